"""`odma-hw sweep GRID`: run a grid of `emulate`, `replay` or `simulate` command lines as Ray
tasks and collect one results table.

A grid file (TOML; YAML or JSON too) names the command, fixed options and axes, with the
command's own option names (no leading dashes):

    command = "emulate"
    zip = [["spec", "channels"]]        # optional: axes that vary together (equal lengths)
    [fixed]
    requests = 1000000
    [axes]
    spec = ["lpddr5-6400", "lpddr4-4266"]
    channels = [1, 2]
    pattern = ["seq", "rand"]
    granularity = [32, 64]

The cells are the product of the axes (a zip group counts as one axis). Each cell is exactly a
command line (`true` adds a flag, `false` leaves it out): before any cell runs, the sweep checks
every cell with the command's own parser, plus the value checks its compute() would make first
(for simulate: a trace longer than --max-model-len, a timing source that is not there), so a
typo fails in one line (exit 2) naming the first bad cell and the key. It parses each axis value
once and runs each value check once per distinct combination of the values it reads, so a grid
of a million cells is checked in well under a second, and makes each cell only when it is
wanted. Then each cell calls the command's compute() in a Ray task holding one CPU (in-process:
no shell).

Ray is optional (pip install 'odma-hw[sweep]') and imported only here, when a sweep runs. By
default `ray.init()` starts a single-machine cluster with one worker per core (--workers N);
--address auto|HOST:PORT|ray://HOST:PORT joins a running cluster; an address where none
answers fails in seconds with one line (exit 2), not after Ray's 20 to 35 s of retries. Cells
run in the driver's folder where it exists, so relative paths mean what they mean on the command
line; other machines of a cluster need the same files at the same paths. Ctrl-C keeps every
finished cell and exits 130; further Ctrl-C while Ray shuts down wait for it to finish.

Results go to --out DIR (default: GRID's folder, `<grid name>-sweep/`):
- results.jsonl: the log, one line per table row, written as each cell finishes, so an
  interrupted or crashed sweep keeps every finished cell. Each line also holds `cell_rows` (the
  rows of its cell's attempt) and, last, `line_sha256` (the start of the sha256 of the line
  before it): a cell counts only when every row of its attempt is there and whole, so one torn
  by a crash or a full disk reruns on --resume (as do lines written before lines carried these);
- results.csv (and results.parquet when pandas and pyarrow are installed): the table, rebuilt
  from the log, in cell order, the latest complete attempt of each cell of the grid;
- sweep.json: the grid, the environment and how wall times were taken.
A results folder that cannot be written (read-only, full, a folder where a file goes) fails in
one line (exit 3), before any cell runs where that can be known; the cells logged are kept.

A row holds `cell`, `row`, `hash`, `status` (ok / failed), `error`, `wall_seconds` (compute()
alone), `warm_up_seconds`, `worker`, `command_line`, then the axes under their option names, then
the command's JSON object flattened to scalars (nested keys joined with '.', lists left out; an
output key equal to an axis or bookkeeping name becomes `out.KEY`). A command that returns
several results (simulate: one per rate and policy, under "results") gives one row per result,
numbered by `row`, with the result's own `policy` and `rate` columns; a failed cell gives one row.

`hash` identifies a cell: the command, its parsed arguments with defaults, the odma-hw version,
and the sha256 of every file an argument names (a trace, `probe:FILE`), so a moved trace keeps
its cells and an edited one reruns them. --resume skips cells already recorded `ok` under the
same hash and reruns failed and missing ones.

Numba: emulate and simulate run the emulator, whose compiled code is cached on disk. Each worker
process runs one small emulate before its first cell (warm_up_seconds on that row), so no
wall_seconds includes compilation or cache loading, and runs Numba on the one CPU its task holds
unless the cell gives --threads.
"""

from __future__ import annotations

import argparse
import collections
import collections.abc
import contextlib
import csv
import datetime
import functools
import hashlib
import importlib
import itertools
import json
import math
import os
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from odma_hw import argtypes, plotting
from odma_hw.commands import ValueCheck, module_of, registry
from odma_hw.errors import BadArgument, DeviceUnavailable, OdmaError

SCHEMA = "odma-hw.sweep/1"
INSTALL_HINT = "pip install 'odma-hw[sweep]'"

# what --plot draws when --metric is not given
DEFAULT_METRICS = {"emulate": "efficiency", "replay": "utilization", "simulate": "output_tps"}
# options a cell cannot take: the sweep prints nothing per cell and plots the whole grid
RESERVED_OPTIONS = {"json": "cells always return their JSON object",
                    "plot": "use the sweep's --plot", "series": "time series are not tabulated",
                    "help": "not a cell option"}
BOOKKEEPING = ("cell", "row", "hash", "status", "error", "wall_seconds", "warm_up_seconds",
               "worker", "command_line")
GRID_KEYS = ("command", "description", "fixed", "axes", "zip")
RESULTS, TABLE, PARQUET, META = "results.jsonl", "results.csv", "results.parquet", "sweep.json"
TCP_TIMEOUT_S = 3.0
# Ray's settings for how long joining a cluster waits (seconds): the GCS's tries, one a
# second; the Ray client's first and longest connection timeouts (three tries)
JOIN_TIMEOUTS = {"RAY_gcs_server_port_wait_time_s": "5",
                 "RAY_CLIENT_INITIAL_CONNECTION_TIMEOUT_S": "1",
                 "RAY_CLIENT_MAX_CONNECTION_TIMEOUT_S": "2"}


# ------------------------------------------------------------------------------------ the grid
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


def _scalar(value, where: str):
    if isinstance(value, (bool, int, float, str)):
        return value
    raise BadArgument(f"{where}: a value must be a string, number or true/false, not "
                      f"{type(value).__name__} {value!r}")


def _read_grid_file(path: str) -> dict:
    ext = os.path.splitext(path)[1].lower()
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise BadArgument(f"cannot read grid {path!r}: {exc.strerror or exc}") from None
    try:
        if ext == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                try:
                    import tomli as tomllib
                except ImportError:
                    raise BadArgument("TOML grids need Python >= 3.11 or `pip install tomli`; "
                                      "or write the grid as JSON") from None
            return tomllib.loads(raw.decode())
        if ext in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise BadArgument("YAML grids need PyYAML (installed with Ray: "
                                  f"{INSTALL_HINT}); or write the grid as TOML") from None
            data = yaml.safe_load(raw)
            return {} if data is None else data
        if ext == ".json":
            return json.loads(raw)
    except BadArgument:
        raise
    except Exception as exc:  # each parser has its own error class; all mean a malformed file
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BadArgument(f"grid {path}: malformed {ext[1:].upper()}: {text}") from None
    raise BadArgument(f"grid {path}: unknown format {ext or '(none)'!r}; use .toml, .yaml or "
                      f".json")


def load_grid(path: str) -> Grid:
    """Read and check a grid file's structure (not yet its option names or values)."""
    data = _read_grid_file(path)
    if not isinstance(data, dict):
        raise BadArgument(f"grid {path}: the top level must be a table of keys")
    unknown = [k for k in data if k not in GRID_KEYS]
    if unknown:
        raise BadArgument(f"grid {path}: unknown key {unknown[0]!r}; a grid has "
                          f"{', '.join(GRID_KEYS)}")
    command = data.get("command")
    if not sweepable(command):
        raise BadArgument(f"grid {path}: command must be one of "
                          f"{', '.join(c for c in registry() if sweepable(c))}, not {command!r}")
    fixed, axes = data.get("fixed", {}), data.get("axes", {})
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
    zips = data.get("zip", [])
    if not isinstance(zips, list) or not all(isinstance(g, list) for g in zips):
        raise BadArgument(f"grid {path}: zip must be a list of lists of axis names, e.g. "
                          f"zip = [[\"rate\", \"seed\"]]")
    groups, grouped = [], set()
    for g in zips:
        names = tuple(option_name(n) for n in g)
        if len(names) < 2:
            raise BadArgument(f"grid {path}: a zip group needs two or more axes, not {g!r}")
        for n in names:
            if n not in norm_axes:
                raise BadArgument(f"grid {path}: zip names {n!r}, which is not an axis")
            if n in grouped:
                raise BadArgument(f"grid {path}: axis {n!r} is in two zip groups")
            grouped.add(n)
        lengths = {n: len(norm_axes[n]) for n in names}
        if len(set(lengths.values())) > 1:
            raise BadArgument(f"grid {path}: the axes zipped together need equal lengths, not "
                              + ", ".join(f"{n} {k}" for n, k in lengths.items()))
        groups.append(names)
    description = data.get("description", "")
    return Grid(path, command, norm_fixed, norm_axes, tuple(groups), str(description))


# ---------------------------------------------------------------- parsing cells, content hashes
@functools.lru_cache(maxsize=None)
def command_parser(module: str, command: str) -> argparse.ArgumentParser:
    """The command's own parser (what `odma-hw COMMAND` uses), whose errors raise BadArgument
    instead of exiting."""
    from odma_hw.cli import Parser

    sub = Parser(prog="odma-hw").add_subparsers(dest="command", parser_class=Parser)
    importlib.import_module(module).register(sub)
    parser = sub.choices[command]

    def error(message):
        raise BadArgument(message)
    parser.error = error  # argparse calls self.error(message) on every refusal
    return parser


def _text(value) -> str:
    return repr(value) if isinstance(value, float) else str(value)


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
            argv += ["--" + name, _text(value)]
    return argv


def _verdict(check: ValueCheck, args: dict) -> str | None:
    """`KEY: reason` when the check refuses these values, else None."""
    try:
        check.run(argparse.Namespace(**args))
    except (BadArgument, DeviceUnavailable) as exc:
        return f"{check.key}: {exc}"
    return None


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
    return bool(getattr(module_of(command), "USES_NUMBA", False))


@functools.lru_cache(maxsize=None)
def _file_sha256(path: str, mtime_ns: int, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_digest(path: str) -> str:
    """sha256 of a file's bytes (remembered per path, modification time and size)."""
    st = os.stat(path)
    return _file_sha256(os.path.realpath(path), st.st_mtime_ns, st.st_size)


def _named_file(value):
    """The file an argument value names (`PATH` or `KIND:PATH`, e.g. probe:FILE), or None."""
    if not isinstance(value, str) or not value:
        return None
    for candidate in (value, value.partition(":")[2]):
        if candidate and os.path.isfile(candidate):
            return candidate
    return None


def _hashed(key: str) -> bool:
    """Whether a parsed argument decides a cell's result (presentation options do not)."""
    return key not in ("func", "command") and key not in RESERVED_OPTIONS


def _normalised(value):
    path = _named_file(value)
    return {"sha256": file_digest(path)} if path else value


def normalised_arguments(args) -> dict:
    """The parsed arguments that decide a cell's result: defaults filled in, values converted
    by the parser, presentation options left out, files replaced by their content digest."""
    return {key: _normalised(value) for key, value in sorted(vars(args).items())
            if _hashed(key)}


def _fragment(key: str, value) -> str:
    """One argument as content_hash's JSON writes it (`"key": value`), so that a cell's hash can
    be put together from pieces made once per axis value."""
    return json.dumps(key) + ": " + json.dumps(_normalised(value), sort_keys=True, default=str)


def _hash_payload(command: str, fragments) -> str:
    from odma_hw import __version__

    return ('{"arguments": {' + ", ".join(fragments) + '}, "command": ' + json.dumps(command)
            + ', "odma_hw": ' + json.dumps(__version__) + "}")


def _short_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def content_hash(command: str, args) -> str:
    """A cell's identity for --resume: command + normalised arguments + odma-hw version + the
    sha256 of each file it reads."""
    return _short_sha256(_hash_payload(
        command, [_fragment(k, v) for k, v in sorted(vars(args).items()) if _hashed(k)]))


@dataclass(frozen=True)
class Cell:
    index: int
    axes: dict          # option -> value as the grid gives it
    argv: tuple         # the command's arguments, --json included
    hash: str

    @property
    def command_line(self) -> str:
        import shlex

        return shlex.join(self.argv)


def _describe(axes: dict) -> str:
    return " ".join(f"{k}={_text(v)}" for k, v in axes.items()) or "(no axes)"


class Cells(collections.abc.Sequence):
    """The cells of a grid in order (the last dimension varying fastest), each made when asked
    for from pieces made once per axis value: its argv, its parsed arguments, its hash.

    That is exact because argparse sets each option's own argument from its own value alone: a
    cell's parsed arguments are cell 0's with each dimension's arguments taken from the cell of
    that dimension's value (the other dimensions at their first value). So the checks run per
    axis value and per distinct combination of what a value check reads, never per cell, and
    a grid of a million cells holds no memory per cell."""

    def __init__(self, grid: Grid, parser: argparse.ArgumentParser):
        self.grid, self.command = grid, grid.command
        self.dims = grid.dimensions()
        self.sizes = [len(grid.axes[g[0]]) for g in self.dims]
        self.strides = [math.prod(self.sizes[d + 1:]) for d in range(len(self.dims))]
        self._dim_of = {name: d for d, g in enumerate(self.dims) for name in g}
        self._check_names(parser)
        # (cell index, stage, order within the stage, message): the first cell's is raised, as
        # if every cell were checked in turn
        self._failures = []
        self._argv_pieces(parser)
        base = self._parse_values(parser)
        self._run_value_checks(base)
        self._hash_pieces(base)
        self._raise_first()

    # -- what a cell is made of
    def __len__(self) -> int:
        return math.prod(self.sizes)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"cell {i} of a grid of {n}")
        i %= n
        return Cell(i, self.axes_at(i), tuple([self.command] + self.argv_at(i)), self.hash_at(i))

    def positions(self, i: int) -> list[int]:
        """The index of cell i's value on each dimension."""
        return [(i // s) % n for s, n in zip(self.strides, self.sizes)]

    def axes_at(self, i: int) -> dict:
        pos = self.positions(i)
        return {name: values[pos[self._dim_of[name]]] for name, values in self.grid.axes.items()}

    def argv_at(self, i: int) -> list[str]:
        pos = self.positions(i)
        argv = list(self._fixed_argv)
        for name, tokens in self._axis_argv.items():
            argv += tokens[pos[self._dim_of[name]]]
        return argv + ["--json"]

    def hash_at(self, i: int) -> str:
        """content_hash() of cell i's parsed arguments, from the JSON pieces of its values."""
        pos = self.positions(i)
        return _short_sha256("".join(p if isinstance(p, str) else p[1][pos[p[0]]]
                                     for p in self._template))

    def _where(self, i: int) -> str:
        return f"{self.grid.path}: cell {i} ({_describe(self.axes_at(i))})"

    def _first_at(self, d: int, j: int) -> int:
        """The first cell whose dimension d has its j-th value."""
        return j * self.strides[d]

    # -- the checks, in the order a cell's would fail: option names, argv, parsing, values,
    #    a cell that repeats another
    def _check_names(self, parser) -> None:
        known = {s[2:] for s in parser._option_string_actions if s.startswith("--")}
        for name in {**self.grid.fixed, **self.grid.axes}:
            if name in RESERVED_OPTIONS:
                raise BadArgument(f"{self._where(0)}: {name}: a cell takes no --{name} "
                                  f"({RESERVED_OPTIONS[name]})")
            if name not in known:
                raise BadArgument(f"{self._where(0)}: {name}: `odma-hw {self.command}` has no "
                                  f"option --{name}")
        dest_of = {name: parser._option_string_actions["--" + name].dest
                   for name in {**self.grid.fixed, **self.grid.axes}}
        owner = {}
        for name, dest in dest_of.items():
            if dest in owner:  # two spellings of one argument: the cell would keep only one
                raise BadArgument(f"grid {self.grid.path}: --{owner[dest]} and --{name} set the "
                                  f"same argument; give one of them")
            owner[dest] = name
        self._dests = [[dest_of[name] for name in g] for g in self.dims]

    def _argv_pieces(self, parser) -> None:
        """Each fixed option's and each axis value's command-line words, made once."""
        fixed = []
        self._fail_at((0, 0, 0), lambda: fixed.extend(cell_argv(parser, self.grid.fixed)))
        self._fixed_argv = fixed
        self._axis_argv = {}
        self._bad = set()         # (dimension, value index) whose words are refused
        for order, (name, values) in enumerate(self.grid.axes.items(), 1):
            d = self._dim_of[name]
            pieces = []
            for j, v in enumerate(values):
                tokens = []
                if self._fail_at((self._first_at(d, j), 0, order),
                                 lambda: tokens.extend(cell_argv(parser, {name: v}))):
                    self._bad.add((d, j))
                pieces.append(tokens)
            self._axis_argv[name] = pieces

    def _fail_at(self, where: tuple, fn) -> bool:
        """Run fn; a refusal becomes a failure at `where` (cell index, stage, order within the
        stage). True when it failed."""
        try:
            fn()
        except (BadArgument, DeviceUnavailable) as exc:
            self._failures.append((*where, str(exc)))
            return True
        return False

    def _raise_first(self) -> None:
        if self._failures:
            i, _, _, message = min(self._failures)
            raise BadArgument(f"{self._where(i)}: {message}")

    def _fails_later(self, where: tuple) -> bool:
        """Whether a failure at `where` would come after one already found (so need not be
        looked for)."""
        return bool(self._failures) and where >= min(self._failures)[:3]

    def _parse(self, parser, i: int) -> dict | None:
        """Cell i's parsed arguments, or None with its refusal recorded."""
        try:
            return vars(parser.parse_args(self.argv_at(i)))
        except BadArgument as exc:
            self._failures.append((i, 1, 0, str(exc)))
            return None

    def _parse_values(self, parser) -> dict:
        """Cell 0's parsed arguments; in self._values[d][j], the arguments that dimension d's
        j-th value sets, from the first cell that has it (None where that cell is refused)."""
        base = None if self._fails_later((0, 1, 0)) else self._parse(parser, 0)
        if base is None:        # cell 0 is refused: no cell can be checked further
            self._raise_first()
        self._values = []
        for d, dests in enumerate(self._dests):
            column = []
            for j in range(self.sizes[d]):
                i = self._first_at(d, j)
                parsed = (None if (d, j) in self._bad else base if i == 0
                          else self._parse(parser, i))
                column.append(None if parsed is None else tuple(parsed[k] for k in dests))
            self._values.append(column)
        return base

    def _run_value_checks(self, base: dict) -> None:
        """Each value check once per distinct combination of what it reads, found on the first
        cell that has that combination."""
        dim_of_dest = {dest: d for d, dests in enumerate(self._dests) for dest in dests}
        for order, check in enumerate(value_checks(self.command, base)):
            read_dims = sorted({dim_of_dest[r] for r in check.reads if r in dim_of_dest})
            verdicts = {}
            for combo in itertools.product(*(range(self.sizes[d]) for d in read_dims)):
                index = sum(self._first_at(d, j) for d, j in zip(read_dims, combo))
                if self._fails_later((index, 2, order)):
                    continue
                columns = [self._values[d][j] for d, j in zip(read_dims, combo)]
                if None in columns:     # that cell does not parse: refused already
                    continue
                args = {r: base[r] for r in check.reads}
                for d, values in zip(read_dims, columns):
                    args.update((k, v) for k, v in zip(self._dests[d], values) if k in args)
                key = repr(tuple(args.values()))
                if key not in verdicts:
                    verdicts[key] = _verdict(check, args)
                if verdicts[key] is not None:
                    self._failures.append((index, 2, order, verdicts[key]))

    def _hash_pieces(self, base: dict) -> None:
        """The pieces of every cell's hash payload: constant text between the arguments that
        an axis sets, and for those, one JSON fragment per value. Two values of one dimension
        with equal fragments would make two cells one (1 and "01"; a default and no value)."""
        fragments = {}      # dest -> (dimension, [fragment per value])
        for d, dests in enumerate(self._dests):
            first_of = {}
            columns = [[] for _ in dests]
            for j, values in enumerate(self._values[d]):
                refused = values is None    # already: the grid never runs, any text will do
                texts = tuple(_fragment(dest, v) for dest, v in zip(
                    dests, (base[dest] for dest in dests) if refused else values))
                if not refused and texts in first_of:
                    self._failures.append((self._first_at(d, j), 3, 0,
                                           f"the same arguments as cell "
                                           f"{self._first_at(d, first_of[texts])} once parsed"))
                elif not refused:
                    first_of[texts] = j
                for column, text in zip(columns, texts):
                    column.append(text)
            fragments.update((dest, (d, column)) for dest, column in zip(dests, columns))
        pieces = []
        for key in sorted(k for k in base if _hashed(k)):
            pieces.append(fragments.get(key) or _fragment(key, base[key]))
        head, _, tail = _hash_payload(self.command, ["\0"]).partition("\0")
        self._template = []
        text = head
        for n, piece in enumerate(pieces):
            text += ", " if n else ""
            if isinstance(piece, str):
                text += piece
            else:
                self._template += [text, piece]
                text = ""
        self._template.append(text + tail)


@dataclass
class Plan:
    grid: Grid
    module: str
    cells: collections.abc.Sequence = field(default_factory=list)


def plan(grid: Grid) -> Plan:
    """Every cell checked as the command would check it, and hashed, without making the cells
    (see Cells): BadArgument naming the first bad cell and key. Nothing runs."""
    module = registry()[grid.command]
    return Plan(grid, module, Cells(grid, command_parser(module, grid.command)))


# ------------------------------------------------------------------------------ output rows
def flatten(obj: dict, prefix: str = "") -> dict:
    """Nested dicts -> 'a.b' keys; scalars kept, lists left out."""
    flat = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif value is None or isinstance(value, (bool, int, float, str)):
            flat[name] = value
    return flat


def output_rows(output: dict) -> list[dict]:
    """A command's JSON object as table rows: one per entry of a "results" list (with the
    object's other scalars repeated), else one."""
    results = output.get("results")
    if isinstance(results, list) and all(isinstance(r, dict) for r in results):
        top = flatten({k: v for k, v in output.items() if k != "results"})
        return [{**top, **flatten(r)} for r in results]
    return [flatten(output)]


# ------------------------------------------------------------------------ the Ray worker side
_WORKER = {"warm": False}


def _warm_up() -> float:
    """Load (or compile) the emulator's Numba code in this process once; its seconds."""
    if _WORKER["warm"]:
        return 0.0
    t0 = time.perf_counter()
    from odma_hw.emu import simulate

    simulate("lpddr5-6400", "rand", 64, 256)
    _WORKER["warm"] = True
    return time.perf_counter() - t0


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def run_cell(module: str, argv: list, cwd: str | None, numba_threads: int | None) -> dict:
    """One cell, in a Ray worker: the command's parser and compute(), nothing printed. The
    cell's own failure comes back as status 'failed' with a one-line error, never raised.
    numba_threads: warm the emulator up first and run it on this many threads."""
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)  # relative paths in a grid mean the driver's folder, as on a command line
    warm = 0.0
    result = {"status": "ok", "error": None, "rows": []}
    t0 = time.perf_counter()
    try:
        if numba_threads:
            warm = _warm_up()
            import numba

            numba.set_num_threads(min(numba_threads, numba.config.NUMBA_NUM_THREADS))
        t0 = time.perf_counter()
        args = command_parser(module, argv[0]).parse_args(list(argv[1:]))
        result["rows"] = output_rows(importlib.import_module(module).compute(args))
    except Exception as exc:
        result.update(status="failed", error=_one_line(exc))
    ray = sys.modules.get("ray")
    node = ""
    if ray is not None and ray.is_initialized():  # in a Ray worker: which node it ran on
        node = "@" + ray.get_runtime_context().get_node_id()[:8]
    result.update(wall_seconds=time.perf_counter() - t0, warm_up_seconds=warm,
                  worker=f"{socket.gethostname()}:{os.getpid()}{node}")
    return result


# ------------------------------------------------------------------------ results on disk
class OutputError(OdmaError):
    """The sweep's results cannot be written (a read-only or full folder, a folder where a file
    goes); the cells already logged are kept. The command exits 3 with this one line."""


def default_out(grid_path: str) -> str:
    stem = os.path.splitext(os.path.basename(grid_path))[0]
    return os.path.join(os.path.dirname(os.path.abspath(grid_path)), f"{stem}-sweep")


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


# Each log line is one table row, framed so that a line cut short by a crash or a full disk is
# told from a whole one: it carries the number of rows its cell's attempt wrote (a cell counts
# only once all of them are there) and, as its last field, the start of the sha256 of the line
# before that field. Lines are JSON objects still (`pandas.read_json(lines=True)` reads them).
FRAME_ROWS = "cell_rows"
FRAME_CHECK = "line_sha256"
FRAME_KEYS = (FRAME_ROWS, FRAME_CHECK)
_CHECK_HEAD = b', "' + FRAME_CHECK.encode() + b'": "'
_CHECK_DIGITS = 16
_CHECK_TAIL = len(_CHECK_HEAD) + _CHECK_DIGITS + len(b'"}')


def _line_digest(body: bytes) -> bytes:
    return hashlib.sha256(body).hexdigest()[:_CHECK_DIGITS].encode()


def framed_lines(records: list[dict]) -> bytes:
    """The log lines of one attempt of a cell (its records, in row order)."""
    lines = []
    for r in records:
        body = json.dumps({**r, FRAME_ROWS: len(records)}, default=str).encode()
        lines.append(body[:-1] + _CHECK_HEAD + _line_digest(body) + b'"}\n')
    return b"".join(lines)


def unframe(line: bytes) -> dict | None:
    """The record of a whole log line (its newline may be missing), else None: a torn or
    altered line, or one written before lines were framed."""
    line = line[:-1] if line.endswith(b"\n") else line
    tail = line[-_CHECK_TAIL:]
    if len(line) <= _CHECK_TAIL or not (tail.startswith(_CHECK_HEAD) and tail.endswith(b'"}')):
        return None
    body = line[:-_CHECK_TAIL] + b"}"
    if _line_digest(body) != tail[len(_CHECK_HEAD):-2]:
        return None
    try:
        record = json.loads(body)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    rows, row = record.get(FRAME_ROWS), record.get("row")
    if not (isinstance(record.get("hash"), str) and type(rows) is int and type(row) is int
            and 0 <= row < rows):
        return None
    return record


def _regular_file(path: str) -> bool:
    """False where nothing is; OutputError where something that is no file is (a folder, a
    device: reading it could block or never end)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise OutputError(f"cannot read {path}: {_reason(exc)}") from None
    if not stat.S_ISREG(mode):
        raise OutputError(f"cannot use {path}: it is a "
                          f"{'folder' if stat.S_ISDIR(mode) else 'special file'}, not a file")
    return True


def read_log(path: str):
    """(line offset, record or None) for each line of a results log: None for a line that is
    not whole (see unframe)."""
    if not _regular_file(path):
        return
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise OutputError(f"cannot read {path}: {_reason(exc)}") from None
    with f:
        offset = 0
        for line in f:
            yield offset, unframe(line)
            offset += len(line)


def log_holds_anything(path: str) -> bool:
    return _regular_file(path) and os.path.getsize(path) > 0


def latest_attempts(path: str) -> dict:
    """hash -> (status, [line offsets]) of each cell's latest complete attempt in the log: its
    lines in row order, each whole, as many as it says. One attempt's lines are written
    together, so its rows follow each other; a line that is not whole ends the attempt it is
    in, which then does not count."""
    latest = {}
    attempt = None      # [hash, rows, status, offsets] of the attempt being read
    for offset, r in read_log(path):
        if r is None:
            attempt = None
            continue
        if r["row"] == 0:
            attempt = [r["hash"], r[FRAME_ROWS], r.get("status"), [offset]]
        elif attempt and (r["hash"], r[FRAME_ROWS], r["row"]) == (attempt[0], attempt[1],
                                                                 len(attempt[3])):
            attempt[3].append(offset)
        else:
            attempt = None
            continue
        if len(attempt[3]) == attempt[1]:
            latest[attempt[0]] = (attempt[2], attempt[3])
            attempt = None
    return latest


def cell_records(cell: Cell, result: dict) -> list[dict]:
    """The table rows of one finished cell (see the module docstring)."""
    base = {"cell": cell.index, "row": 0, "hash": cell.hash, "status": result["status"],
            "error": result["error"], "wall_seconds": result["wall_seconds"],
            "warm_up_seconds": result["warm_up_seconds"], "worker": result["worker"],
            "command_line": "odma-hw " + cell.command_line, **cell.axes}
    records = []
    for i, row in enumerate(result["rows"] or [{}]):
        r = dict(base, row=i)
        for key, value in row.items():
            r[f"out.{key}" if key in base or key in FRAME_KEYS else key] = value
        records.append(r)
    return records


class ResultLog:
    """The append-only results log: each cell's rows framed (see unframe) and written in one go
    as it finishes. An append always starts a line of its own, so a line torn by a crash or a
    full disk spoils only itself."""

    def __init__(self, path: str):
        self.path = path
        self._at_line_start = None      # whether the file ends in a newline; None: look
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as exc:
            raise OutputError(f"cannot write {path}: {_reason(exc)}") from None
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            self.close()
            raise OutputError(f"cannot use {path}: it is not a file")

    def _ends_in_newline(self) -> bool:
        size = os.fstat(self.fd).st_size
        return size == 0 or os.pread(self.fd, 1, size - 1) == b"\n"

    def write(self, records: list[dict]) -> None:
        data = framed_lines(records)
        try:
            if not (self._at_line_start or self._ends_in_newline()):
                data = b"\n" + data
            self._at_line_start = None
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as exc:
            raise OutputError(f"cannot append to {self.path}: {_reason(exc)}") from None
        self._at_line_start = True

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def table_rows(the_plan: Plan, log_path: str) -> list[dict]:
    """The latest complete attempt of each cell of the plan, in cell order (without the log's
    framing)."""
    latest = latest_attempts(log_path)
    cells = the_plan.cells
    wanted = []
    for i in range(len(cells)) if latest else ():
        attempt = latest.get(cells.hash_at(i) if isinstance(cells, Cells) else cells[i].hash)
        if attempt:
            wanted += [(i, off) for off in attempt[1]]
    rows = []
    with open(log_path, "rb") if wanted else contextlib.nullcontext() as f:
        for cell_index, off in wanted:
            f.seek(off)
            r = unframe(f.readline())
            if r is None:  # changed since it was read: --resume reruns the cell
                continue
            for key in FRAME_KEYS:
                r.pop(key, None)
            r["cell"] = cell_index  # the index in this grid (an older grid may have numbered it)
            rows.append(r)
    return rows


def write_table(rows: list[dict], out_dir: str) -> list[str]:
    """results.csv (and results.parquet when pandas + pyarrow are importable); the paths.
    OutputError when they cannot be written."""
    columns = list(BOOKKEEPING)
    seen = set(columns)
    for r in rows:
        for k in r:
            if k not in seen:
                seen.add(k)
                columns.append(k)
    path = os.path.join(out_dir, TABLE)
    tmp = path + ".tmp"
    try:
        try:
            with open(tmp, "w", newline="", encoding="utf-8") as f:
                w = csv.DictWriter(f, columns, restval="", extrasaction="ignore")
                w.writeheader()
                for r in rows:
                    w.writerow({k: ("" if v is None else v) for k, v in r.items()})
            os.replace(tmp, path)
        except BaseException:
            # a full disk or a Ctrl-C half way leaves no partial table behind
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {_reason(exc)}") from None
    written = [path]
    try:
        import pandas
        import pyarrow  # noqa: F401  (to_parquet's engine)
    except ImportError:
        return written
    pq = os.path.join(out_dir, PARQUET)
    try:
        pandas.DataFrame.from_records(rows, columns=columns).to_parquet(pq, index=False)
    except OSError as exc:
        raise OutputError(f"cannot write {pq}: {_reason(exc)}") from None
    written.append(pq)
    return written


def prepare_out(out: str) -> None:
    """Create --out and make sure that the files the sweep writes can be written there, before
    any cell runs: OutputError for a folder that cannot be made or written, or a folder where
    a file goes (the log is checked when it is opened)."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create --out {out!r}: {_reason(exc)}") from None
    for name in (TABLE, TABLE + ".tmp", PARQUET, META):
        path = os.path.join(out, name)
        if os.path.isdir(path):
            raise OutputError(f"cannot write {path}: it is a folder")
    probe = os.path.join(out, TABLE + ".tmp")   # made and replaced by write_table anyway
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise OutputError(f"cannot write in --out {out}: {_reason(exc)}") from None


# ------------------------------------------------------------------------------ progress
class Progress:
    """Cells done / failed / total and an ETA on stderr: one line rewritten on a terminal,
    otherwise a line per tenth of the cells (or every 30 s)."""

    def __init__(self, stream, name: str, total: int, skipped: int):
        self.stream, self.name, self.total = stream, name, total
        self.done = self.skipped = skipped
        self.failed = 0
        self.tty = stream.isatty()
        self.t0 = self.last = time.perf_counter()
        self.shown = -1
        self.text = ""
        if skipped:
            print(f"sweep {name}: {skipped} of {total} cells already done (--resume)",
                  file=stream, flush=True)

    def finished(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok

    def line(self, running: int) -> str:
        ran = self.done - self.skipped
        elapsed = time.perf_counter() - self.t0
        eta = "-"
        if ran:
            eta = str(datetime.timedelta(seconds=round(elapsed / ran * (self.total - self.done))))
        return (f"sweep {self.name}: {self.done}/{self.total} cells done, {self.failed} failed, "
                f"{running} running, ETA {eta}")

    def show(self, running: int = 0, final: bool = False) -> None:
        now = time.perf_counter()
        text = self.line(running)
        if self.tty:
            end = "\n" if final else ""
            print("\r" + text.ljust(78), end=end, file=self.stream, flush=True)
            return
        tenth = 10 * self.done // max(1, self.total)
        if (final or tenth > self.shown or now - self.last > 30) and text != self.text:
            self.shown, self.last, self.text = tenth, now, text
            print(text, file=self.stream, flush=True)


# ------------------------------------------------------------------------------ Ray
def import_ray():
    """The ray module, or BadArgument saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise BadArgument(f"sweep needs Ray ({exc}): {INSTALL_HINT}") from None
    return ray


def _host_port(address: str) -> tuple[str, int]:
    rest = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise BadArgument(f"--address {address!r}: expected auto, HOST:PORT or ray://HOST:PORT")
    return host.strip("[]"), int(port)


def resolve_address(address: str) -> str:
    """`auto` -> the running cluster's HOST:PORT (RAY_ADDRESS, else the latest `ray start` on
    this machine); other forms as given, checked for shape."""
    if address != "auto":
        _host_port(address)
        return address
    import_ray()
    from ray._private.services import canonicalize_bootstrap_address

    try:
        found = canonicalize_bootstrap_address("auto")
    except Exception as exc:
        raise BadArgument(f"--address auto: no running Ray cluster found ({_one_line(exc)}); "
                          f"start one with `ray start --head`") from None
    if not found:
        raise BadArgument("--address auto: no running Ray cluster found; start one with "
                          "`ray start --head`")
    return found


def check_reachable(address: str, timeout: float = TCP_TIMEOUT_S) -> None:
    """BadArgument unless the cluster's port accepts a TCP connection within `timeout` (the
    quick answer for a host that is down or a port nobody listens on)."""
    host, port = _host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        raise BadArgument(f"--address {address}: no Ray cluster answers at {host}:{port} "
                          f"({exc.strerror or exc})") from None


@contextlib.contextmanager
def _join_timeouts():
    """Ray's own waits for a cluster to answer, bounded to seconds while joining (where the
    user has not set them): the TCP check passes wherever something, a proxy say, accepts
    connections, and Ray would then retry for 20 s (GCS) or 35 s (Ray client)."""
    added = [k for k in JOIN_TIMEOUTS if k not in os.environ]
    os.environ.update({k: JOIN_TIMEOUTS[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


@contextlib.contextmanager
def _held_stderr():
    """Hold back what is written to file descriptor 2 (Ray's C++ client logs every failed try
    to reach a cluster there); pass it on only when the block succeeds, so a failure is one
    line."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        ok = False
        try:
            yield
            ok = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if ok:
                held.seek(0)
                sys.stderr.write(held.read().decode(errors="replace"))
                sys.stderr.flush()


def connect(ray, address: str | None, workers: int | None) -> bool:
    """Start or join Ray unless this process already has; True when this call started it (and
    so must shut it down)."""
    import logging

    if ray.is_initialized():
        return False
    try:
        if address is None:
            ray.init(num_cpus=workers or os.cpu_count() or 1, include_dashboard=False,
                     log_to_driver=False, logging_level=logging.WARNING)
        else:
            with _join_timeouts(), _held_stderr():
                ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except Exception as exc:
        if address is None:
            raise OdmaError(f"cannot start Ray: {_one_line(exc)}") from None
        raise BadArgument(f"--address {address}: cannot join a Ray cluster there: "
                          f"{_one_line(exc)} (a cluster with token authentication also needs "
                          f"RAY_AUTH_MODE=token here)") from None
    return True


def cluster_cpus(ray) -> int:
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


@dataclass
class Outcome:
    ran: int = 0
    failed: int = 0
    interrupted: bool = False
    output_error: OutputError | None = None     # the log could not be written: the sweep stopped


@contextlib.contextmanager
def ctrl_c_held():
    """Hold Ctrl-C off while the block runs (shutting Ray down: cut short, Ray's own exit hook
    would do it again and a further Ctrl-C there prints a traceback); yields a list that holds a
    SIGINT for each Ctrl-C that came meanwhile. Only the main thread can hold signals; elsewhere
    the block runs as it is."""
    came = []
    if threading.current_thread() is not threading.main_thread():
        yield came
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield came
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


def dispatch(ray, the_plan: Plan, todo, log: ResultLog, progress: Progress, *,
             window: int, retries: int = 1, cancel: bool = True) -> Outcome:
    """Run the `todo` cells (any iterable, taken as needed) as Ray tasks, at most `window` in
    flight (so the driver holds a bounded number of references however large the grid); each
    cell's rows are logged as it finishes. Ctrl-C returns, marked interrupted, and a log that
    cannot be written returns with its OutputError, after cancelling the tasks in flight when
    `cancel` (a cluster this process started is better shut down: its workers die with it, and
    Ray's driver can abort when a cancelled task's completion races the shutdown)."""
    command = the_plan.grid.command
    cpus = cluster_cpus(ray)
    task = ray.remote(run_cell).options(num_cpus=1, max_retries=retries, retry_exceptions=False)
    threads = 1 if uses_numba(command) else None
    cwd = os.getcwd()
    pending = iter(todo)
    more = True
    in_flight = {}
    outcome = Outcome()
    try:
        while more or in_flight:
            while more and len(in_flight) < window:
                cell = next(pending, None)
                if cell is None:
                    more = False
                    break
                in_flight[task.remote(the_plan.module, list(cell.argv), cwd, threads)] = cell
            if not in_flight:
                break
            ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=0.5)
            for ref in ready:
                cell = in_flight.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayError as exc:  # the worker died, a node was lost
                    result = {"status": "failed", "error": _one_line(exc), "rows": [],
                              "wall_seconds": None, "warm_up_seconds": None, "worker": None}
                log.write(cell_records(cell, result))
                outcome.ran += 1
                outcome.failed += result["status"] != "ok"
                progress.finished(result["status"] == "ok")
            progress.show(min(len(in_flight), cpus))
    except KeyboardInterrupt:
        outcome.interrupted = True
    except OutputError as exc:
        outcome.output_error = exc
    if cancel and in_flight and (outcome.interrupted or outcome.output_error):
        with ctrl_c_held() as came:
            for ref in in_flight:
                try:
                    ray.cancel(ref, force=True)
                except Exception:  # already finished or its worker already gone
                    pass
        outcome.interrupted |= bool(came)
    return outcome


# ------------------------------------------------------------------------------ plotting
def _number(value):
    """A grid value as a number (simulate's rate is a string such as "4"), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def check_plot(grid: Grid, path: str) -> None:
    """BadArgument, before the grid's cells are even made, for what would make --plot fail
    after the work: a path or format matplotlib cannot write, a file that cannot be opened
    for writing, a grid of more than two dimensions."""
    plotting.check_plot_path(path)
    existed = os.path.lexists(path)
    try:
        with open(path, "ab"):
            pass
        if not existed:
            os.remove(path)
    except OSError as exc:
        raise BadArgument(f"--plot {path!r}: cannot write it: {_reason(exc)}") from None
    dims = grid.dimensions()
    if not 1 <= len(dims) <= 2:
        raise BadArgument(f"--plot draws a grid of one or two axes (zip groups count as one); "
                          f"{grid.path} has {len(dims)}")


def _column(rows: list[dict], name: str) -> str | None:
    for candidate in (name, f"out.{name}"):
        if any(candidate in r for r in rows):
            return candidate
    return None


def plot_lines(grid: Grid, rows: list[dict], metric: str) -> tuple[str, dict, bool]:
    """What plot() draws: the metric's column, {line label: [(x, y), ...]} in x order, and
    whether x is numeric (else x is the position of the axis value in the grid). Lines: one
    per value of the second axis, and per policy / rate where these tell apart the rows of one
    cell of a multi-row command."""
    ok = [r for r in rows if r.get("status") == "ok"]
    column = _column(ok, metric)
    if column is None:
        numeric = sorted(k for k in {k for r in ok for k in r if k not in BOOKKEEPING}
                         if any(isinstance(r.get(k), (int, float)) for r in ok))
        raise BadArgument(f"--metric {metric!r} is not a column of the results (some: "
                          f"{', '.join(numeric[:12])}); the results are complete")
    dims = grid.dimensions()
    x_axis = dims[0][0]
    series_keys = [dims[1][0]] if len(dims) > 1 else []
    for key in getattr(module_of(grid.command), "ROW_KEYS", ()):
        col = _column(ok, key)
        per_cell = collections.defaultdict(set)
        for r in ok:
            per_cell[r["cell"]].add(r.get(col))
        if col and any(len(values) > 1 for values in per_cell.values()):
            series_keys.append(col)
    xs = grid.axes[x_axis]
    numeric_x = all(_number(v) is not None for v in xs)
    position = {v: i for i, v in enumerate(xs)}
    lines = collections.defaultdict(list)
    for r in ok:
        if r.get(column) is None:
            continue
        label = ", ".join(f"{k.removeprefix('out.')}={_text(r.get(k))}" for k in series_keys)
        x = _number(r[x_axis]) if numeric_x else position.get(r[x_axis])
        lines[label].append((x, r[column]))
    return column, {label: sorted(points) for label, points in lines.items()}, numeric_x


def plot(grid: Grid, rows: list[dict], metric: str, path: str) -> None:
    """`metric` against the first axis (see plot_lines)."""
    column, lines, numeric_x = plot_lines(grid, rows, metric)
    dims = grid.dimensions()
    xs = grid.axes[dims[0][0]]
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, points in lines.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                label=label or None)
    if not numeric_x:
        ax.set_xticks(range(len(xs)))
        ax.set_xticklabels([_text(v) for v in xs], rotation=30 if len(xs) > 6 else 0)
    ax.set_xlabel(" / ".join(dims[0]))
    ax.set_ylabel(column.removeprefix("out."))
    ax.set_title(f"{os.path.basename(grid.path)}: odma-hw {grid.command}")
    ax.grid(alpha=0.3)
    if any(lines):
        ax.legend(fontsize="small")
    fig.tight_layout()
    plotting.save(fig, path)


# ------------------------------------------------------------------------------ the command
def _meta(the_plan: Plan, ray, address, started: str) -> dict:
    from odma_hw import __version__

    g = the_plan.grid
    numba_note = ("each worker process ran one small emulate before its first cell "
                  "(warm_up_seconds on that row): wall_seconds never includes Numba compilation"
                  if uses_numba(g.command) else "no Numba in this command")
    return {"schema": SCHEMA, "grid": os.path.abspath(g.path), "command": g.command,
            "description": g.description, "fixed": g.fixed, "axes": g.axes,
            "zip": [list(z) for z in g.zips], "cells": len(the_plan.cells),
            "odma_hw": __version__, "ray": getattr(ray, "__version__", None),
            "address": address or "local", "cluster_cpus": cluster_cpus(ray),
            "wall_seconds": "compute() alone, from parsing the cell to its JSON object",
            "numba_warm_up": numba_note, "started": started}


def run_sweep(grid_path: str, *, out: str | None = None, workers: int | None = None,
              address: str | None = None, resume: bool = False, plot_path: str | None = None,
              metric: str | None = None, retries: int = 1, dry_run: bool = False,
              stream=None) -> dict:
    """The sweep as a function (the command is a thin layer over it). Every check happens
    before Ray starts; returns a summary dict. Raises KeyboardInterrupt after an interrupted
    sweep's finished cells are written; OutputError when the results cannot be written (the
    cells logged before are kept) or --plot fails after the work."""
    stream = stream or sys.stderr
    grid = load_grid(grid_path)
    if plot_path:  # before the cells are made: refusing a grid costs nothing however large
        check_plot(grid, plot_path)
    the_plan = plan(grid)
    cells = the_plan.cells
    out = out or default_out(grid_path)
    log_path = os.path.join(out, RESULTS)
    metric = metric or DEFAULT_METRICS[grid.command]
    if os.path.exists(out) and not os.path.isdir(out):
        raise BadArgument(f"--out {out!r} is a file, not a folder")
    # any byte in the log, even a torn line, is a sweep that ran here: never append silently
    if log_holds_anything(log_path) and not resume and not dry_run:
        raise BadArgument(f"{out} already holds sweep results: --resume completes them; remove "
                          f"the folder (or give another --out) to start over")
    latest = latest_attempts(log_path) if resume else {}
    done = bytearray(len(cells))    # one byte per cell: a million cells, one MB
    for i in range(len(cells)) if latest else ():
        done[i] = latest.get(cells.hash_at(i), (None,))[0] == "ok"
    skipped = done.count(1)
    if dry_run:
        for c in cells:
            print(f"{c.index}\t{c.hash}\t{'done' if done[c.index] else 'todo'}\t"
                  f"odma-hw {c.command_line}")
        return {"cells": len(cells), "skipped": skipped, "ran": 0, "failed": 0, "out": out}
    if address is not None:
        address = resolve_address(address)
        check_reachable(address)
    ray = import_ray()
    prepare_out(out)
    log = ResultLog(log_path)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    t0 = time.perf_counter()
    outcome = Outcome()
    owned = False
    ray_start = ray_stop = 0.0
    # Ctrl-C anywhere from here on (starting Ray, between cells, shutting down) ends in the same
    # place: the log closed, the table written from every finished cell, exit 130; so does a
    # log that cannot be written, with exit 3
    try:
        owned = connect(ray, address, workers)
        ray_start = time.perf_counter() - t0
        cpus = cluster_cpus(ray)
        # a joined cluster: --workers caps the cells in flight; local: Ray has that many CPUs
        window = workers if (workers and (address or not owned)) else 2 * cpus
        meta = os.path.join(out, META)
        try:
            with open(meta, "w") as f:
                json.dump(_meta(the_plan, ray, address, started), f, indent=1, default=str)
        except OSError as exc:
            raise OutputError(f"cannot write {meta}: {_reason(exc)}") from None
        progress = Progress(stream, os.path.basename(grid_path), len(cells), skipped)
        if skipped < len(cells):
            outcome = dispatch(ray, the_plan, (cells[i] for i in range(len(cells))
                                               if not done[i]),
                               log, progress, window=window, retries=retries, cancel=not owned)
        progress.show(final=True)
    except KeyboardInterrupt:
        outcome.interrupted = True
    except OutputError as exc:
        outcome.output_error = exc
    finally:
        log.close()
        if owned:
            t_stop = time.perf_counter()
            with ctrl_c_held() as came:
                ray.shutdown()
            outcome.interrupted |= bool(came)
            ray_stop = time.perf_counter() - t_stop
    if outcome.output_error:
        with contextlib.suppress(OutputError):  # the table too, where it can still be written
            write_table(table_rows(the_plan, log_path), out)
        raise OutputError(f"{outcome.output_error} (the cells finished before are kept in "
                          f"{log_path}; --resume runs the others)")
    rows = table_rows(the_plan, log_path)
    try:
        files = write_table(rows, out)
    except OutputError as exc:
        raise OutputError(f"{exc} (every finished cell is in {log_path}; --resume writes the "
                          f"table again)") from None
    summary = {"cells": len(cells), "skipped": skipped, "ran": outcome.ran,
               "failed": sum(r["status"] != "ok" for r in rows if r["row"] == 0),
               "missing": len(cells) - sum(r["row"] == 0 for r in rows),
               "wall_seconds": time.perf_counter() - t0, "ray_start_seconds": ray_start,
               "ray_stop_seconds": ray_stop, "out": out, "files": files}
    if outcome.interrupted:
        print(f"sweep interrupted: {outcome.ran} cells finished in this run are in "
              f"{files[0]}; --resume runs the other {summary['missing']}", file=stream)
        raise KeyboardInterrupt
    if plot_path:
        try:
            plot(grid, rows, metric, plot_path)
        except Exception as exc:
            # the work is done and its table written: whatever stops the plot now (a --metric
            # that is no column, a full disk, matplotlib) is one line and exit 3, never a
            # traceback that buries where the results are
            text = str(exc) if isinstance(exc, OdmaError) else (
                f"cannot draw it: {_one_line(exc)}; the results are complete")
            raise OutputError(f"--plot {plot_path}: {text} ({', '.join(files)})") from None
        summary["files"].append(plot_path)
    return summary


def _cmd(args) -> int:
    s = run_sweep(args.grid, out=args.out, workers=args.workers, address=args.address,
                  resume=args.resume, plot_path=args.plot, metric=args.metric,
                  retries=args.retries, dry_run=args.dry_run)
    if args.dry_run:
        return 0
    print(f"{s['cells']} cells: {s['cells'] - s['failed'] - s['missing']} ok, {s['failed']} "
          f"failed, {s['skipped']} already done; {s['wall_seconds']:.1f} s (Ray start "
          f"{s['ray_start_seconds']:.1f} s, stop {s['ray_stop_seconds']:.1f} s); "
          f"{', '.join(s['files'])}")
    if s["failed"]:
        print(f"odma-hw: error: {s['failed']} of {s['cells']} cells failed (their errors are in "
              f"{s['files'][0]}); --resume reruns them", file=sys.stderr)
        return 3
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sweep", help="run a grid of emulate / replay / simulate command lines on Ray",
        description=__doc__.split("\n\n")[0] + " Needs Ray: " + INSTALL_HINT + ".")
    p.add_argument("grid", metavar="GRID", help="grid file: .toml, .yaml or .json")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="results folder (default: next to GRID, <grid name>-sweep)")
    p.add_argument("--resume", action="store_true",
                   help="keep the cells already recorded ok in --out; run the others")
    p.add_argument("--workers", type=argtypes.positive_int, default=None, metavar="N",
                   help="local Ray: N worker CPUs (default: all cores); with --address: at "
                        "most N cells at once")
    p.add_argument("--address", default=None, metavar="ADDR",
                   help="join a running Ray cluster: auto, HOST:PORT or ray://HOST:PORT "
                        "(default: start a local one)")
    p.add_argument("--retries", type=argtypes.count, default=1, metavar="N",
                   help="rerun a cell whose worker died up to N times (default 1); a cell "
                        "that raises is recorded failed at once")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="a one- or two-axis grid: --metric against the first axis, a line per "
                        "value of the second")
    p.add_argument("--metric", default=None, metavar="NAME",
                   help="column to plot (default: " + ", ".join(
                       f"{c} {m}" for c, m in DEFAULT_METRICS.items()) + ")")
    p.add_argument("--dry-run", action="store_true",
                   help="check the grid and list its cells (hash, done/todo, command line); "
                        "run nothing")
    p.set_defaults(func=_cmd)
