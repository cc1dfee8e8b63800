"""What a sweep leaves to read: the results table (results.csv, Parquet), the compact table it
prints, and --plot.

The table holds the latest complete attempt of each cell of the grid, in cell order, rebuilt
from the log. --plot draws one metric against one axis (--plot-x), a line per value of another
(--plot-series), every other dimension held at one value (--plot-fix AXIS=VALUE, else its first
value; the title says which); all of that is checked before any cell runs.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import math
import os
import shutil
from dataclasses import dataclass

from odma_cli import plotting
from odma_cli.commands import module_of
from odma_cli.errors import BadArgument
from odma_cli.sweep.cells import Cells, Plan
from odma_cli.sweep.grid import Grid, option_name, value_text
from odma_cli.sweep.log import (
    BOOKKEEPING,
    FRAME_KEYS,
    PARQUET,
    TABLE,
    OutputError,
    latest_attempts,
    reason,
    unframe,
)

# cells the printed table shows where standard output is no terminal (on one: a screenful)
TABLE_CELLS = 40
# the metric of the printed table and of --plot where --metric is not given and the command
# names none (its DEFAULT_METRIC)
FALLBACK_METRIC = "wall_seconds"
# units of the output columns, by the last word of their name (output_tps, bandwidth_gbps)
WORD_UNITS = {"tps": "tok/s", "gbps": "GB/s", "s": "s", "seconds": "s", "ns": "ns",
              "gb": "GB", "bytes": "B"}
STATISTICS = {"mean", "min", "max", "p50", "p90", "p95", "p99"}
# bookkeeping columns that are no metric (the --metric list leaves them out)
NOT_METRICS = {"cell", "row", "hash", "status", "error", "worker", "command_line"}
# a numeric axis whose values span this factor or more is drawn on a log scale (page sizes 16
# to 128; granules 32 to 256)
LOG_SPAN = 8


# ------------------------------------------------------------------------------ the table
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
        raise OutputError(f"cannot write {path}: {reason(exc)}") from None
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
        raise OutputError(f"cannot write {pq}: {reason(exc)}") from None
    written.append(pq)
    return written


def _column(rows: list[dict], name: str) -> str | None:
    for candidate in (name, f"out.{name}"):
        if any(candidate in r for r in rows):
            return candidate
    return None


def metric_names(command: str) -> tuple | None:
    """The columns `command` says its --metric may name (its module's METRICS; GROUP.* for
    every column under GROUP), with the bookkeeping columns; None where it says none."""
    try:
        names = getattr(module_of(command), "METRICS", None)
    except ImportError:
        return None
    return None if names is None else (*names, *BOOKKEEPING)


def _known(name: str, names) -> bool:
    name = name.removeprefix("out.")
    return any(name == n or (n.endswith(".*") and name.startswith(n[:-1])) for n in names)


def _listed(names) -> str:
    """Names, with each run of NAME.mean, NAME.p50... written NAME.{mean,p50,...}."""
    out, groups = [], {}
    for n in names:
        head, _, stat = n.rpartition(".")
        if head and stat in STATISTICS:
            if head not in groups:
                groups[head] = []
                out.append(head)
            groups[head].append(stat)
        else:
            out.append(n)
    return ", ".join(f"{n}.{{{','.join(groups[n])}}}" if n in groups else n for n in out)


def check_metric(grid: Grid, metric: str) -> None:
    """BadArgument (one line, the known names) for a --metric that the grid's command does not
    make, before any cell runs; an axis of the grid is a column too. Commands that name no
    METRICS are checked on their results (check_metric_column)."""
    names = metric_names(grid.command)
    if names is None or _known(metric, names) or metric.removeprefix("out.") in grid.axes:
        return
    shown = [n for n in names if n not in NOT_METRICS]
    raise BadArgument(f"--metric {metric!r} is no metric of {grid.command}: known are "
                      f"{_listed(shown)}")


def check_metric_column(grid: Grid, rows: list[dict], metric: str) -> None:
    """BadArgument (one line, the numeric columns) for a --metric that is no column of the
    results (where some cell succeeded)."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok or _column(ok, metric) is not None or metric in grid.axes:
        return
    numeric = sorted(k for k in {k for r in ok for k in r}
                     if any(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)
                            for r in ok))
    raise BadArgument(f"--metric {metric!r} is not a column of the results of {grid.command}: "
                      f"known are {_listed(numeric)} (every row is in the results table)")


def _row_keys(command: str, ok: list[dict]) -> list[str]:
    """The columns (the command's ROW_KEYS) that tell apart the rows of one cell: those whose
    value differs between the rows of some cell (simulate's policy; its rate only when a cell
    runs several)."""
    keys = []
    for key in getattr(module_of(command), "ROW_KEYS", ()):
        col = _column(ok, key)
        per_cell = collections.defaultdict(set)
        for r in ok:
            per_cell[r["cell"]].add(r.get(col))
        if col and any(len(values) > 1 for values in per_cell.values()):
            keys.append(col)
    return keys


def _decimals(values) -> int | None:
    """Decimals that give the largest of a column's floats four significant digits, so that
    the column lines up; None (4 significant digits each) for very large or small ones."""
    floats = [abs(v) for v in values if isinstance(v, float) and math.isfinite(v)]
    top = max(floats, default=0.0)
    if not top:
        return None if not floats else 1
    return max(0, 3 - math.floor(math.log10(top))) if 1e-3 <= top < 1e6 else None


def _shown(value, decimals: int | None = None, width: int = 28) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        text = f"{value:.{decimals}f}" if decimals is not None else f"{value:.4g}"
    else:
        text = value_text(value)
    return text if len(text) <= width else text[:width - 1] + "…"


def _by_cell(rows: list[dict], column: str, keys: list[str]) -> tuple[dict, dict]:
    """cell -> {row label: the metric} (None for a failed cell), and cell -> its first row,
    both in cell order; a row's label is its values of `keys` (empty where there are none)."""
    values, first = {}, {}
    for r in rows:
        first.setdefault(r["cell"], r)
        if r.get("status") != "ok":
            values[r["cell"]] = None
        elif values.setdefault(r["cell"], {}) is not None:
            values[r["cell"]][" ".join(_shown(r.get(k)) for k in keys)] = r.get(column)
    return values, first


def results_table(grid: Grid, rows: list[dict], metric: str, limit: int = TABLE_CELLS
                  ) -> tuple[list[str], int]:
    """The compact table the sweep prints: a line per cell (its index, axis values and
    `metric`; a column per row of a cell where the command gives several, e.g. one per
    policy; `failed` for a failed cell), for the first `limit` cells of `rows`; and how many
    cells were left out."""
    ok = [r for r in rows if r.get("status") == "ok"]
    column = _column(ok, metric) or metric
    by_cell, first = _by_cell(rows, column, _row_keys(grid.command, ok))
    shown = list(by_cell)[:limit]
    labels = list(dict.fromkeys(label for cell in shown for label in by_cell[cell] or {}))
    labels = labels or [""]
    decimals = [_decimals([(by_cell[c] or {}).get(label) for c in shown]) for label in labels]
    header = ["cell", *grid.axes, *(f"{column.removeprefix('out.')} {label}".rstrip()
                                    for label in labels)]
    right = [True, *(all(_number(v) is not None and not isinstance(v, str) for v in values)
                     for values in grid.axes.values()), *([True] * len(labels))]
    body = []
    for cell in shown:
        metrics = (["failed"] * len(labels) if by_cell[cell] is None else
                   [_shown(by_cell[cell].get(label), d) for label, d in zip(labels, decimals)])
        body.append([str(cell), *(_shown(first[cell].get(name)) for name in grid.axes),
                     *metrics])
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(v.rjust(w) if r else v.ljust(w)
                       for v, w, r in zip(line, widths, right)).rstrip()
             for line in [header, *body]]
    return lines, max(0, len(by_cell) - limit)


def table_limit(stream) -> int:
    """How many cells the printed table shows on `stream`: on a terminal, what leaves room on
    one screen for the lines around it; elsewhere TABLE_CELLS."""
    isatty = getattr(stream, "isatty", None)
    if isatty is None or not isatty():
        return TABLE_CELLS
    return max(10, shutil.get_terminal_size().lines - 8)


def print_table(grid: Grid, rows: list[dict], metric: str, stream, table_path: str) -> None:
    lines, left_out = results_table(grid, rows, metric, table_limit(stream))
    for line in lines:
        print(line, file=stream)
    if left_out:
        print(f"({left_out} more cells not shown: every row is in {table_path})", file=stream)


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


def default_metric(command: str) -> str:
    """The column a sweep of `command` prints and plots without --metric: the command's
    DEFAULT_METRIC."""
    return getattr(module_of(command), "DEFAULT_METRIC", FALLBACK_METRIC)


def unit(name: str, command: str | None = None) -> str | None:
    """The unit of an axis or output column where known (tok/s, GB/s, s, B...): an option's
    from the command's OPTION_UNITS, else by the last word of its name."""
    name = name.removeprefix("out.")
    option_units = getattr(module_of(command), "OPTION_UNITS", {}) if command else {}
    if name in option_units:
        return option_units[name]
    parts = name.split(".")
    while len(parts) > 1 and parts[-1] in STATISTICS:     # ttft_s.p50: the unit of ttft_s
        parts.pop()
    last = parts[-1]
    if last.endswith(("_per_s", "_per_second")):
        return "req/s" if last.startswith("requests") else "1/s"
    return WORD_UNITS.get(last.replace("-", "_").rpartition("_")[2])    # kv-pool-gb: GB


def labelled(name: str, command: str | None = None) -> str:
    u = unit(name, command)
    name = name.removeprefix("out.")
    return f"{name} ({u})" if u else name


@dataclass(frozen=True)
class PlotView:
    """What --plot draws of a grid: the metric against axis `x` (its dimension varies along
    x), a line per value of axis `series` (its dimension; None: one line per row a cell
    gives), and every other dimension held at one value: `held` maps it to (the index of that
    value, whether --plot-fix chose it)."""

    x: str
    series: str | None
    held: dict

    def caption(self, grid: Grid) -> str:
        """The held dimensions in words, e.g. `spec=lpddr5-6400 (first value)`."""
        parts = []
        for dim, (j, chosen) in self.held.items():
            values = " ".join(f"{n}={value_text(grid.axes[n][j])}" for n in dim)
            parts.append(f"{values} ({'--plot-fix' if chosen else 'first value'})")
        return ", ".join(parts)


def _axis(grid: Grid, option: str, name: str) -> str:
    axis = option_name(name)
    if axis not in grid.axes:
        raise BadArgument(f"{option} {name!r} is not an axis of {grid.path} (its axes: "
                          f"{', '.join(grid.axes) or 'none'})")
    return axis


def _value_index(grid: Grid, axis: str, text: str) -> int | None:
    for j, v in enumerate(grid.axes[axis]):
        if (value_text(v) == text or (isinstance(v, bool) and str(v).lower() == text.lower())
                or (_number(v) is not None and _number(v) == _number(text))):
            return j
    return None


def _fixes(grid: Grid, fix) -> dict:
    """--plot-fix AXIS=VALUE, each: dimension -> index of the value."""
    held = {}
    for item in fix:
        name, sep, text = item.partition("=")
        if not sep:
            raise BadArgument(f"--plot-fix {item!r}: expected AXIS=VALUE, e.g. "
                              f"{next(iter(grid.axes), 'spec')}=...")
        axis = _axis(grid, "--plot-fix", name)
        j = _value_index(grid, axis, text.strip())
        if j is None:
            values = [value_text(v) for v in grid.axes[axis]]
            shown = ", ".join(values[:12]) + (f", … ({len(values)} in all)"
                                              if len(values) > 12 else "")
            raise BadArgument(f"--plot-fix {item!r}: {axis} has no value {text.strip()!r} (its "
                              f"values: {shown})")
        dim = grid.dimension_of(axis)
        if dim in held:
            raise BadArgument(f"--plot-fix {item!r}: {'/'.join(dim)} is held twice")
        held[dim] = j
    return held


def plot_view(grid: Grid, x: str | None = None, series: str | None = None, fix=()) -> PlotView:
    """What --plot draws (see PlotView), from --plot-x, --plot-series and --plot-fix: by
    default x is the first dimension not held, the series the next; BadArgument in one line
    for a name that is no axis, a value that is not on its axis, or one dimension given two
    roles."""
    dims = grid.dimensions()
    if not dims:
        raise BadArgument(f"--plot needs a grid with an axis; {grid.path} has none")
    fixed = _fixes(grid, fix)
    x = _axis(grid, "--plot-x", x) if x else None
    series = _axis(grid, "--plot-series", series) if series else None
    roles = [("--plot-x", x), ("--plot-series", series)]
    for option, axis in roles:
        if axis and grid.dimension_of(axis) in fixed:
            raise BadArgument(f"{option} {axis} is also held by --plot-fix")
    if x and series and grid.dimension_of(x) == grid.dimension_of(series):
        raise BadArgument(f"--plot-series {series} varies with --plot-x {x} (a zip group, or "
                          f"the same axis): give another axis")
    free = [d for d in dims if d not in fixed and x not in d and series not in d]
    if x is None:
        if not free:
            raise BadArgument("--plot-fix holds every axis: leave one for --plot-x")
        x = free.pop(0)[0]
    if series is None and free:
        series = free.pop(0)[0]
    held = {d: (fixed[d], True) if d in fixed else (0, False)
            for d in dims if d not in (grid.dimension_of(x),
                                       grid.dimension_of(series) if series else None)}
    return PlotView(x, series, held)


def check_plot(grid: Grid, path: str, x=None, series=None, fix=()) -> PlotView:
    """What --plot will draw, or BadArgument, before the grid's cells are even made, for what
    would make it fail after the work: a path or format matplotlib cannot write, a file that
    cannot be opened for writing, axes and values that are not in the grid."""
    plotting.check_plot_path(path)       # it opens the file, too
    return plot_view(grid, x, series, fix)


def plot_lines(grid: Grid, rows: list[dict], metric: str, view: PlotView | None = None
               ) -> tuple[str, dict, bool]:
    """What plot() draws: the metric's column, {line label: [(x, y), ...]} in x order, and
    whether x is numeric (else x is the position of the axis value in the grid). Only the
    cells at the view's held values count. Lines: one per value of the series axis, and per
    policy / rate where these tell apart the rows of one cell of a multi-row command."""
    view = view or plot_view(grid)
    ok = [r for r in rows if r.get("status") == "ok"]
    column = _column(ok, metric)
    if column is None:
        numeric = sorted(k for k in {k for r in ok for k in r if k not in BOOKKEEPING}
                         if any(isinstance(r.get(k), (int, float)) for r in ok))
        raise BadArgument(f"--metric {metric!r} is not a column of the results (some: "
                          f"{', '.join(numeric[:12])}); the results are complete")
    dims = grid.dimensions()
    held = [(dims.index(d), j) for d, (j, _) in view.held.items()]
    ok = [r for r in ok if all(grid.positions(r["cell"])[d] == j for d, j in held)]
    series_keys = ([view.series] if view.series else []) + _row_keys(grid.command, ok)
    xs = grid.axes[view.x]
    numeric_x = all(_number(v) is not None for v in xs)
    position = {v: i for i, v in enumerate(xs)}
    lines = collections.defaultdict(list)
    for r in ok:
        if r.get(column) is None:
            continue
        label = ", ".join(f"{k.removeprefix('out.')}={value_text(r.get(k))}"
                          for k in series_keys)
        x = _number(r[view.x]) if numeric_x else position.get(r[view.x])
        lines[label].append((x, r[column]))
    return column, {label: sorted(points) for label, points in lines.items()}, numeric_x


def log_x(values) -> bool:
    """Whether an axis' values are drawn on a log scale: all numbers above 0, the largest
    LOG_SPAN times the smallest or more."""
    numbers = [_number(v) for v in values]
    if not numbers or any(n is None or n <= 0 for n in numbers):
        return False
    return max(numbers) >= LOG_SPAN * min(numbers)


def plot(grid: Grid, rows: list[dict], metric: str, path: str,
         view: PlotView | None = None) -> None:
    """`metric` against the view's x axis (see plot_lines), axes labelled with their units."""
    view = view or plot_view(grid)
    column, lines, numeric_x = plot_lines(grid, rows, metric, view)
    xs = grid.axes[view.x]
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, points in lines.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                label=label or None)
    if not numeric_x:
        ax.set_xticks(range(len(xs)))
        ax.set_xticklabels([value_text(v) for v in xs], rotation=30 if len(xs) > 6 else 0)
    else:
        if log_x(xs):
            ax.set_xscale("log")
            ax.minorticks_off()
        if len(xs) <= 12:   # a tick at each value the grid has, as it wrote it
            ax.set_xticks([_number(v) for v in xs], [value_text(v) for v in xs])
    together = [n for n in grid.dimension_of(view.x) if n != view.x]
    ax.set_xlabel(" / ".join([labelled(view.x, grid.command), *together]))
    ax.set_ylabel(labelled(column, grid.command))
    title = f"{os.path.basename(grid.path)}: odma-hw {grid.command}"
    caption = view.caption(grid)
    ax.set_title(title + (f"\nat {caption}" if caption else ""), fontsize="medium")
    ax.grid(alpha=0.3)
    if any(lines):
        ax.legend(fontsize="small")
    fig.tight_layout()
    plotting.save(fig, path)
