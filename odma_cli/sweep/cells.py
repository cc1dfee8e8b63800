"""The cells of a grid, checked before anything runs: Cell (one command line and its hash),
Cells (the sequence of them) and plan().

Cells never holds memory per cell: every check and every hash is put together from pieces made
once per axis value (see its docstring), so a million cells are checked in well under a second
and each cell is made only when it is wanted.
"""

from __future__ import annotations

import argparse
import collections.abc
import itertools
import math
import shlex
from dataclasses import dataclass, field

from odma_cli.argtypes import parse_line
from odma_cli.commands import ALL, ValueCheck, registry
from odma_cli.errors import BadArgument, DeviceUnavailable
from odma_cli.sweep.grid import Grid, cell_argv, command_parser, value_checks, value_text
from odma_cli.sweep.log import (RESERVED_OPTIONS, code_digest, hash_fragment, hash_payload, hashed,
                                short_sha256)


def _verdict(check: ValueCheck, args: dict) -> str | None:
    """`KEY: reason` when the check refuses these values, else None."""
    try:
        check.run(argparse.Namespace(**args))
    except (BadArgument, DeviceUnavailable) as exc:
        return f"{check.key}: {exc}"
    return None


@dataclass(frozen=True)
class Cell:
    index: int
    axes: dict          # option -> value as the grid gives it
    argv: tuple         # the command's arguments, --json included
    hash: str

    @property
    def command_line(self) -> str:
        return shlex.join(self.argv)


def _describe(axes: dict) -> str:
    return " ".join(f"{k}={value_text(v)}" for k, v in axes.items()) or "(no axes)"


class Cells(collections.abc.Sequence):
    """The cells of a grid in order (the last dimension varying fastest), each made when asked
    for from pieces made once per axis value: its argv, its parsed arguments, its hash.

    That is exact because argparse sets each option's own argument from its own value alone: a
    cell's parsed arguments are cell 0's with each dimension's arguments taken from the cell of
    that dimension's value (the other dimensions at their first value). So the checks run per
    axis value and per distinct combination of what a value check reads, never per cell, and
    a grid of a million cells holds no memory per cell. `code` is the digest of the code the
    cells run (see log.code_digest), taken once, when the cells are made."""

    def __init__(self, grid: Grid, parser: argparse.ArgumentParser):
        self.grid, self.command = grid, grid.command
        self.dims = grid.dimensions()
        self.sizes = [len(grid.axes[g[0]]) for g in self.dims]
        self.strides = [math.prod(self.sizes[d + 1:]) for d in range(len(self.dims))]
        self._dim_of = {name: d for d, g in enumerate(self.dims) for name in g}
        self.code = code_digest(grid.command)
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
        return short_sha256("".join(p if isinstance(p, str) else p[1][pos[p[0]]]
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
            return vars(parse_line(parser, self.argv_at(i)))
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
            reads = tuple(base) if check.reads is ALL else check.reads
            read_dims = sorted({dim_of_dest[r] for r in reads if r in dim_of_dest})
            verdicts = {}
            for combo in itertools.product(*(range(self.sizes[d]) for d in read_dims)):
                index = sum(self._first_at(d, j) for d, j in zip(read_dims, combo))
                if self._fails_later((index, 2, order)):
                    continue
                columns = [self._values[d][j] for d, j in zip(read_dims, combo)]
                if None in columns:     # that cell does not parse: refused already
                    continue
                args = {r: base[r] for r in reads}
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
                texts = tuple(hash_fragment(dest, v) for dest, v in zip(
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
        for key in sorted(k for k in base if hashed(k)):
            pieces.append(fragments.get(key) or hash_fragment(key, base[key]))
        head, _, tail = hash_payload(self.command, ["\0"], self.code).partition("\0")
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
