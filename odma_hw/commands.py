"""The registry of `odma-hw` commands.

Each package offers its commands through the entry-point group `odma_hw.commands`
(pyproject.toml: command name = the module that implements it), so the command line and the
sweep compose commands without the hardware layer naming any package above it. A command's
module provides:

- register(subparsers): adds its parser and sets func(args) -> exit status (required);
- compute(args) -> dict: its JSON object, for commands a sweep may run;
- sweep_checks() -> [ValueCheck]: the checks compute() makes before any work, which a sweep
  runs for every distinct combination of the values each reads, before any cell;
- USES_NUMBA = True: a sweep's workers load the emulator's compiled code before its cells.

The module of MODEL_COMMAND also provides kv_head(model) -> (name, head_dim): what its --model
names, read by its own rules. `probe --model` asks it (model_head_dim), so that the hardware
layer sizes a model's KV runs by the one rule the allocator sizes them with, without importing
the allocator.
"""

from __future__ import annotations

import collections.abc
import functools
import importlib
from dataclasses import dataclass
from importlib import metadata

GROUP = "odma_hw.commands"


@dataclass(frozen=True)
class ValueCheck:
    """A check that a command's compute() makes before its work, reused from the command.
    `reads` names every parsed argument (argparse dest) it looks at: the sweep runs it once per
    distinct combination of their values, not once per cell, and hands it only those (an
    undeclared read fails loudly rather than being checked against one cell's value only)."""

    key: str                            # the option a refusal names
    reads: tuple
    run: collections.abc.Callable       # run(namespace of `reads`), raising BadArgument


@functools.cache
def registry() -> dict[str, str]:
    """Command name -> module, by name (--help's order)."""
    found = {ep.name: ep.value for ep in sorted(metadata.entry_points(group=GROUP),
                                                key=lambda ep: ep.name)}
    if not found:
        from odma_hw.errors import OdmaError

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


# `probe --model` takes what `simulate --model` takes: that command's module reads it
MODEL_COMMAND = "simulate"


def model_head_dim(model: str) -> tuple[str, int]:
    """(name, head_dim) of the model `model` names (a shipped config, a config.json or a folder
    holding one, a preset), as the module of MODEL_COMMAND reads it (its kv_head); BadArgument
    in one line for a model it refuses, or where that command is not installed or cannot load."""
    from odma_hw.errors import BadArgument, one_line

    try:
        read = module_of(MODEL_COMMAND).kv_head
    except (KeyError, ImportError, AttributeError) as exc:
        raise BadArgument(f"--model needs the {MODEL_COMMAND} command, which cannot load here "
                          f"({one_line(exc, 120)}); give --run-bytes instead") \
            from None
    return read(model)
