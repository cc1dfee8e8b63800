"""Grid files: what a sweep runs, checked before anything runs.

A grid file (TOML; YAML or JSON too) names the command, fixed options and axes, with the
command's own option names (no leading dashes); a zip group is axes that vary together (equal
lengths) and counts as one dimension. The cells are the product of the dimensions, the last one
varying fastest, and each is exactly a command line (`true` adds a flag, `false` leaves it out).

Here: the grid file read and checked (load_grid), and the command's own checks that every cell
passes (its parser, its value checks); the cells themselves are in cells.py.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import json
import os
from dataclasses import dataclass

from odma_cli import docfile
from odma_cli.commands import ValueCheck, module_of, registry
from odma_cli.errors import BadArgument
from odma_cli.keys import check_keys

INSTALL_HINT = "pip install 'odma-hw[sweep]'"
GRID_KEYS = ("command", "description", "fixed", "axes", "zip")


@dataclass(frozen=True)
class Grid:
    """A parsed grid file: the command, fixed option values and axes (option name -> values, in
    file order); `zips` are groups of axes that vary together."""

    path: str
    command: str
    fixed: dict
    axes: dict
    zips: tuple = ()
    description: str = ""

    def dimensions(self) -> list[tuple[str, ...]]:
        """The independent dimensions in axis order: a lone axis, or a whole zip group at the
        place of its first axis."""
        group_of = {name: g for g in self.zips for name in g}
        dims, seen = [], set()
        for name in self.axes:
            g = group_of.get(name, (name,))
            if g not in seen:
                seen.add(g)
                dims.append(g)
        return dims

    def dimension_of(self, axis: str) -> tuple[str, ...]:
        """The dimension (a lone axis or its zip group) that holds `axis`."""
        return next(g for g in self.dimensions() if axis in g)

    def positions(self, index: int) -> list[int]:
        """The index of cell `index`'s value on each dimension (the last varying fastest)."""
        sizes = [len(self.axes[g[0]]) for g in self.dimensions()]
        out = []
        for n in reversed(sizes):
            index, j = divmod(index, n)
            out.append(j)
        return out[::-1]

    def cells(self) -> list[dict]:
        """Every cell's axis values (option -> value), the product of the dimensions, the last
        one varying fastest."""
        per_dim = [[dict(zip(g, values)) for values in zip(*(self.axes[n] for n in g))]
                   for g in self.dimensions()]
        cells = []
        for combo in itertools.product(*per_dim):
            merged = {}
            for part in combo:
                merged.update(part)
            cells.append({name: merged[name] for name in self.axes})
        return cells


def option_name(key) -> str:
    """'time_scale', 'time-scale' and '--time-scale' all name the option --time-scale."""
    return str(key).strip().lstrip("-").replace("_", "-")


def value_text(value) -> str:
    """A grid value as a command line writes it (a float exactly: repr)."""
    return repr(value) if isinstance(value, float) else str(value)


def _scalar(value, where: str):
    if isinstance(value, (bool, int, float, str)):
        return value
    raise BadArgument(f"{where}: a value must be a string, number or true/false, not "
                      f"{type(value).__name__} {value!r}")


def _parse_toml(raw: bytes) -> dict:
    from odma_cli import tomlread

    return tomlread.loads(raw.decode("utf-8-sig"))


def _parse_yaml(raw: bytes) -> dict:
    try:
        import yaml
    except ImportError:
        raise BadArgument("YAML grids need PyYAML (installed with Ray: "
                          f"{INSTALL_HINT}); or write the grid as TOML") from None
    class UniqueKeys(yaml.SafeLoader):
        """PyYAML keeps the last of a key given twice; a grid refuses it, as TOML does."""

    def mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise ValueError(f"duplicate key {key!r}")
            seen.add(key)
        return loader.construct_mapping(node, deep=deep)

    UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    data = yaml.load(raw, Loader=UniqueKeys)
    return {} if data is None else data


def _parse_json(raw: bytes) -> dict:
    return json.loads(raw, object_pairs_hook=docfile.refuse_duplicates)


_PARSERS = {".toml": _parse_toml, ".yaml": _parse_yaml, ".yml": _parse_yaml, ".json": _parse_json}


def _read_grid_file(path: str) -> dict:
    if os.path.isdir(path):
        raise BadArgument(f"grid {path} is a folder: give the grid file (.toml, .yaml or .json)")
    ext = os.path.splitext(path)[1].lower()
    if ext not in _PARSERS:
        raise BadArgument(f"grid {path}: unknown format {ext or '(none)'!r}; use .toml, .yaml "
                          f"or .json")
    raw = docfile.read_bounded(path, "grid")
    try:
        return _PARSERS[ext](raw)
    except BadArgument:
        raise
    except Exception as exc:  # each parser has its own error class; all mean a malformed file
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BadArgument(f"grid {path}: malformed {ext[1:].upper()}: {text}") from None


def _options(path: str, fixed: dict, axes: dict) -> tuple[dict, dict]:
    """The fixed options and the axes under their option names, each value checked."""
    for name, table in (("fixed", fixed), ("axes", axes)):
        if not isinstance(table, dict):
            raise BadArgument(f"grid {path}: {name} must be a table of option = value")
    norm_fixed, norm_axes = {}, {}
    for key, value in fixed.items():
        name = option_name(key)
        if isinstance(value, list):
            raise BadArgument(f"grid {path}: fixed {key!r} is a list; an option with several "
                              f"values is an axis (a comma-separated option such as "
                              f"simulate's rate takes one string, \"1,2,4\")")
        norm_fixed[name] = _scalar(value, f"grid {path}: fixed {key!r}")
    for key, values in axes.items():
        name = option_name(key)
        if not isinstance(values, list) or not values:
            raise BadArgument(f"grid {path}: axis {key!r} must be a non-empty list of values")
        if name in norm_axes or name in norm_fixed:
            raise BadArgument(f"grid {path}: option {name!r} is given twice (fixed and axes, "
                              f"or two spellings)")
        norm_axes[name] = [_scalar(v, f"grid {path}: axis {key!r}") for v in values]
    if len(norm_fixed) != len(fixed):
        raise BadArgument(f"grid {path}: a fixed option is given twice (two spellings)")
    return norm_fixed, norm_axes


def _zip_groups(path: str, zips, axes: dict) -> tuple:
    if not isinstance(zips, list) or not all(isinstance(g, list) for g in zips):
        raise BadArgument(f"grid {path}: zip must be a list of lists of axis names, e.g. "
                          f"zip = [[\"rate\", \"seed\"]]")
    groups, grouped = [], set()
    for g in zips:
        names = tuple(option_name(n) for n in g)
        if len(names) < 2:
            raise BadArgument(f"grid {path}: a zip group needs two or more axes, not {g!r}")
        for n in names:
            if n not in axes:
                raise BadArgument(f"grid {path}: zip names {n!r}, which is not an axis")
            if n in grouped:
                raise BadArgument(f"grid {path}: axis {n!r} is in two zip groups")
            grouped.add(n)
        lengths = {n: len(axes[n]) for n in names}
        if len(set(lengths.values())) > 1:
            raise BadArgument(f"grid {path}: the axes zipped together need equal lengths, not "
                              + ", ".join(f"{n} {k}" for n, k in lengths.items()))
        groups.append(names)
    return tuple(groups)


def load_grid(path: str) -> Grid:
    """Read and check a grid file's structure (not yet its option names or values)."""
    data = _read_grid_file(path)
    check_keys(f"grid {path}", data, {k: (False, None) for k in GRID_KEYS}, "a grid")
    command = data.get("command")
    if not sweepable(command):
        raise BadArgument(f"grid {path}: command must be one of "
                          f"{', '.join(c for c in registry() if sweepable(c))}, not {command!r}")
    fixed, axes = _options(path, data.get("fixed", {}), data.get("axes", {}))
    zips = _zip_groups(path, data.get("zip", []), axes)
    return Grid(path, command, fixed, axes, zips, str(data.get("description", "")))


# ------------------------------------------------------------------ the command's own checks
@functools.lru_cache(maxsize=None)
def command_parser(module: str, command: str) -> argparse.ArgumentParser:
    """The command's own parser (what `odma-hw COMMAND` uses), whose errors raise BadArgument
    instead of exiting."""
    from odma_cli.main import Parser

    sub = Parser(prog="odma-hw").add_subparsers(dest="command", parser_class=Parser)
    importlib.import_module(module).register(sub)
    parser = sub.choices[command]

    def error(message):
        raise BadArgument(message)
    parser.error = error  # argparse calls self.error(message) on every refusal
    return parser


def cell_argv(parser, options: dict) -> list[str]:
    """Option -> value as the command line argparse would see (before --json)."""
    argv = []
    for name, value in options.items():
        action = parser._option_string_actions.get("--" + name)
        takes_no_value = action is not None and action.nargs == 0
        if takes_no_value:
            if not isinstance(value, bool):
                raise BadArgument(f"{name}: --{name} is a flag: give true or false, not "
                                  f"{value!r}")
            if value:
                argv.append("--" + name)
        elif isinstance(value, bool):
            raise BadArgument(f"{name}: --{name} takes a value, not {str(value).lower()}")
        else:
            argv += ["--" + name, value_text(value)]
    return argv



def _trace_exists(a) -> None:
    if a.trace is not None and not os.path.isfile(a.trace):
        raise BadArgument(f"no such file {a.trace!r}")


def value_checks(command: str, dests) -> list[ValueCheck]:
    """The checks of `command` (its module's sweep_checks(): what parsing alone lets through, a
    preset name, a policy list, a trace too long for --max-model-len, is refused up front), in
    order; first that a named trace exists (every check that reads the trace comes after)."""
    checks = [ValueCheck("trace", ("trace",), _trace_exists)] if "trace" in dests else []
    return checks + list(getattr(module_of(command), "sweep_checks", lambda: [])())


def sweepable(command) -> bool:
    """Whether a grid may run `command`: a registered command with a compute(args), not the
    sweep itself."""
    if command not in registry() or command == "sweep":
        return False
    try:
        return hasattr(module_of(command), "compute")
    except ImportError:
        return False


def uses_numba(command: str) -> bool:
    """Whether `command`'s cells run the Numba emulator (and so warm it up per worker)."""
    return callable(getattr(module_of(command), "warm_up", None))
