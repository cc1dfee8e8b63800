"""The registry of `odma-hw` commands.

Each package offers its commands through the entry-point group `odma_cli.commands`
(pyproject.toml: command name = the module that implements it), so the command line and the
sweep compose commands without the hardware layer naming any package above it. A command's
module provides:

- register(subparsers): adds its parser and sets func(args) -> exit status (required);
- compute(args) -> dict: its JSON object, for commands a sweep may run;
- sweep_checks() -> [ValueCheck]: the checks compute() makes before any work, which a sweep
  runs for every distinct combination of the values each reads (reads ALL: every distinct
  cell), before any cell;
- warm_up(): loads (or compiles) the Numba code its cells run, which a sweep's workers call
  once before their first cell so that no cell's wall time includes compilation;
- DEFAULT_METRIC: the output column a sweep prints and plots when --metric is not given;
- OPTION_UNITS: {option: unit} of the options a sweep may vary whose names do not say it.

One package may offer, in the entry-point group MODEL_READER_GROUP, kv_head(model) -> (name,
head_dim): what its commands' --model names, read by their rules. `probe --model` asks it
(model_head_dim), so that the hardware layer sizes a model's KV runs by the one rule the
allocator sizes them with, without importing the allocator.
"""

from __future__ import annotations

import collections.abc
import functools
import importlib
from dataclasses import dataclass
from importlib import metadata

GROUP = "odma_cli.commands"


@dataclass(frozen=True)
class ValueCheck:
    """A check that a command's compute() makes before its work, reused from the command.
    `reads` names every parsed argument (argparse dest) it looks at: the sweep runs it once per
    distinct combination of their values, not once per cell, and hands it only those (an
    undeclared read fails loudly rather than being checked against one cell's value only).
    `reads` ALL: every argument, the cell as a whole (once per distinct cell)."""

    key: str                            # the option a refusal names
    reads: tuple | None
    run: collections.abc.Callable       # run(namespace of `reads`), raising BadArgument


ALL = None                              # ValueCheck.reads of a check of the whole cell


@functools.cache
def registry() -> dict[str, str]:
    """Command name -> module, by name (--help's order)."""
    found = {ep.name: ep.value for ep in sorted(metadata.entry_points(group=GROUP),
                                                key=lambda ep: ep.name)}
    if not found:
        from odma_cli.errors import OdmaError

        raise OdmaError("no odma-hw commands are registered: install the package (pip install "
                        "-e .) so that its entry points exist")
    return found


def module_of(command: str):
    """The imported module of a registered command (ImportError when a dependency is missing)."""
    return importlib.import_module(registry()[command])


def by_module() -> dict[str, list[str]]:
    """Module -> its commands, in registry order (a module may register several)."""
    out: dict[str, list[str]] = {}
    for name, module in registry().items():
        out.setdefault(module, []).append(name)
    return out


# the entry-point group of the one function that reads what a command's --model names
MODEL_READER_GROUP = "odma_cli.model_reader"


def model_head_dim(model: str) -> tuple[str, int]:
    """(name, head_dim) of the model `model` names (a shipped config, a config.json or a folder
    holding one, a preset), read by the function the package that serves models offers in
    MODEL_READER_GROUP (`probe --model` thus takes what the serving commands' --model takes,
    by their rule); BadArgument in one line for a model it refuses, or where no installed
    package offers one or it cannot load."""
    from odma_cli.errors import BadArgument, one_line

    try:
        entry = next(iter(metadata.entry_points(group=MODEL_READER_GROUP)))
        read = entry.load()
    except (StopIteration, ImportError, AttributeError) as exc:
        why = "no installed package reads models" if isinstance(exc, StopIteration) \
            else one_line(exc, 120)
        raise BadArgument(f"--model cannot be read here ({why}); give --run-bytes instead") \
            from None
    return read(model)
