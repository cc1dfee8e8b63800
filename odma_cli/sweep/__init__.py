"""`odma-hw sweep GRID`: run a grid of `emulate`, `replay`, `simulate` or `engine` command lines
as Ray tasks and collect one results table.

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

Where each concern lives:
- grid.py: the grid file and the command's own checks; cells.py: its cells. Before any cell
  runs, every cell is checked with the command's own parser and the value checks its compute()
  would make first, so a typo fails in one line (exit 2) naming the first bad cell and the key;
- log.py: content hashes (what --resume trusts: arguments, the files they name, the code) and
  the framed results log, which keeps every finished cell however the sweep ends;
- run.py: Ray (an embedded local cluster by default, --address joins one), the workers, the
  progress line and Ctrl-C (every finished cell is kept; exit 130);
- report.py: results.csv (and Parquet), the compact table printed at the end, --plot.

Results go to --out DIR (default: GRID's folder, `<grid name>-sweep/`): results.jsonl (the
log), results.csv (the table, the latest complete attempt of each cell, in cell order) and
sweep.json (the grid, the environment, how wall times were taken). A results folder that cannot
be written fails in one line (exit 3), before any cell runs where that can be known; one
that holds a file of these names without a sweep's log is someone else's and refused (exit 2).

A row holds `cell`, `row`, `hash`, `status` (ok / failed), `error`, `wall_seconds` (compute()
alone), `warm_up_seconds`, `worker`, `command_line`, then the axes under their option names, then
the command's JSON object flattened to scalars (nested keys joined with '.', lists left out; an
output key equal to an axis or bookkeeping name becomes `out.KEY`). A command that returns
several results (simulate: one per rate and policy, under "results") gives one row per result,
numbered by `row`; a failed cell gives one row.

--resume skips the cells already recorded ok under the same hash and reruns failed, missing and
torn ones; when none is left, Ray is not started at all and the table is written again.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time

from odma_cli import argtypes, jsonout
from odma_cli.commands import module_of, registry
from odma_cli.errors import BadArgument, OdmaError
from odma_cli.paths import folder_problem
from odma_cli.sweep.cells import Cell, Cells, Plan, plan
from odma_cli.sweep.grid import (
    GRID_KEYS,
    INSTALL_HINT,
    Grid,
    cell_argv,
    command_parser,
    load_grid,
    option_name,
    sweepable,
    uses_numba,
    value_checks,
    value_text,
)
from odma_cli.sweep.log import (
    BOOKKEEPING,
    FRAME_CHECK,
    FRAME_KEYS,
    FRAME_ROWS,
    META,
    PARQUET,
    RESERVED_OPTIONS,
    RESULTS,
    TABLE,
    OutputError,
    ResultLog,
    cell_records,
    code_digest,
    code_files,
    content_hash,
    default_out,
    file_digest,
    flatten,
    framed_lines,
    latest_attempts,
    log_holds_anything,
    normalised_arguments,
    output_rows,
    prepare_out,
    read_log,
    reason,
    unframe,
)
from odma_cli.sweep.report import (
    FALLBACK_METRIC,
    PlotView,
    check_metric,
    check_metric_column,
    check_plot,
    default_metric,
    plot,
    plot_lines,
    plot_view,
    print_table,
    results_table,
    table_rows,
    unit,
    write_table,
)
from odma_cli.sweep.run import (
    JOIN_TIMEOUTS,
    TCP_TIMEOUT_S,
    Outcome,
    Progress,
    check_reachable,
    choose_local_auth,
    cluster_cpus,
    connect,
    ctrl_c_held,
    dispatch,
    import_ray,
    one_line,
    resolve_address,
    run_cell,
    shut_down,
    warm_up,
)

# the names `from odma_cli import sweep` gives, wherever in the package each lives
__all__ = [
    "BOOKKEEPING", "default_metric", "FRAME_CHECK", "FRAME_KEYS", "FRAME_ROWS", "GRID_KEYS",
    "INSTALL_HINT", "JOIN_TIMEOUTS", "META", "PARQUET", "RESERVED_OPTIONS", "RESULTS", "SCHEMA",
    "SUMMARY_SCHEMA", "TABLE", "TCP_TIMEOUT_S", "Cell", "cell_argv", "cell_records", "Cells",
    "check_plot", "check_reachable", "choose_local_auth", "cluster_cpus", "code_digest",
    "code_files", "command_parser", "compute", "connect", "content_hash", "ctrl_c_held",
    "default_out", "dispatch", "file_digest", "flatten", "framed_lines", "Grid", "import_ray",
    "latest_attempts", "load_grid", "log_holds_anything", "normalised_arguments", "one_line",
    "option_name", "Outcome", "output_rows", "OutputError", "Plan", "plan", "plot", "plot_lines",
    "plot_view", "PlotView", "prepare_out", "print_table", "Progress", "read_log", "reason",
    "register", "resolve_address", "ResultLog", "results_table", "run_cell", "run_sweep",
    "shut_down", "sweepable", "table_rows", "unframe", "unit", "uses_numba", "value_checks",
    "value_text", "warm_up", "write_table",
]

SCHEMA = "odma-hw.sweep/1"
SUMMARY_SCHEMA = "odma-hw.sweep-summary/1"


def _meta(the_plan: Plan, ray, address, started: str) -> dict:
    from odma_cli import __version__

    g = the_plan.grid
    numba_note = ("each worker process ran one small emulate before its first cell "
                  "(warm_up_seconds on that row): wall_seconds never includes Numba compilation"
                  if uses_numba(g.command) else "no Numba in this command")
    return {"schema": SCHEMA, "grid": os.path.abspath(g.path), "command": g.command,
            "description": g.description, "fixed": g.fixed, "axes": g.axes,
            "zip": [list(z) for z in g.zips], "cells": len(the_plan.cells),
            "odma_hw": __version__, "code": getattr(the_plan.cells, "code", None),
            "ray": getattr(ray, "__version__", None),
            "address": address or "local", "cluster_cpus": cluster_cpus(ray),
            "wall_seconds": "compute() alone, from parsing the cell to its JSON object",
            "numba_warm_up": numba_note, "started": started}


def _done_cells(cells, log_path: str, resume: bool) -> bytearray:
    """One byte per cell (a million cells, one MB): 1 where --resume finds it recorded ok."""
    done = bytearray(len(cells))
    latest = latest_attempts(log_path) if resume else {}
    for i in range(len(cells)) if latest else ():
        done[i] = latest.get(cells.hash_at(i), (None,))[0] == "ok"
    return done


def _run_cells(the_plan: Plan, done: bytearray, out: str, *, workers, address, retries,
               stream) -> tuple[Outcome, float, float]:
    """Start or join Ray, run the cells not done and log each as it finishes; the outcome and
    the seconds Ray took to start and to stop. Every check that needs no cell comes first."""
    if address is not None:
        address = resolve_address(address)
        check_reachable(address)
    else:
        choose_local_auth()
    ray = import_ray()
    prepare_out(out)
    results_log = ResultLog(os.path.join(out, RESULTS))
    cells = the_plan.cells
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
        # a joined cluster: --workers caps the cells in flight; local: Ray has that many CPUs
        window = workers if (workers and (address or not owned)) else 2 * cluster_cpus(ray)
        meta = os.path.join(out, META)
        try:
            with open(meta, "w") as f:
                json.dump(_meta(the_plan, ray, address, started), f, indent=1, default=str)
        except OSError as exc:
            raise OutputError(f"cannot write {meta}: {reason(exc)}") from None
        progress = Progress(stream, os.path.basename(the_plan.grid.path), len(cells),
                            done.count(1))
        outcome = dispatch(ray, the_plan, (cells[i] for i in range(len(cells)) if not done[i]),
                           results_log, progress, window=window, retries=retries,
                           cancel=not owned)
        progress.show(final=True)
    except KeyboardInterrupt:
        outcome.interrupted = True
    except OutputError as exc:
        outcome.output_error = exc
    finally:
        # a Ctrl-C here would skip the shutdown, leaving it to Ray's exit hook
        with ctrl_c_held() as came:
            results_log.close()
            if owned:
                t_stop = time.perf_counter()
                shut_down(ray)
                ray_stop = time.perf_counter() - t_stop
        outcome.interrupted |= bool(came)
    return outcome, ray_start, ray_stop


def _written_table(the_plan: Plan, out: str, outcome: Outcome) -> tuple[list[dict], list[str]]:
    """The table's rows and the files written; OutputError saying where the cells are."""
    log_path = os.path.join(out, RESULTS)
    if outcome.output_error:
        with contextlib.suppress(OutputError):  # the table too, where it can still be written
            write_table(table_rows(the_plan, log_path), out)
        raise OutputError(f"{outcome.output_error} (the cells finished before are kept in "
                          f"{log_path}; --resume runs the others)")
    rows = table_rows(the_plan, log_path)
    try:
        return rows, write_table(rows, out)
    except OutputError as exc:
        raise OutputError(f"{exc} (every finished cell is in {log_path}; --resume writes the "
                          f"table again)") from None


def _draw(grid: Grid, rows, metric: str, plot_path: str, view: PlotView, files) -> None:
    try:
        plot(grid, rows, metric, plot_path, view)
    except Exception as exc:
        # the work is done and its table written: whatever stops the plot now (a --metric
        # that is no column, a full disk, matplotlib) is one line and exit 3, never a
        # traceback that buries where the results are
        text = str(exc) if isinstance(exc, OdmaError) else (
            f"cannot draw it: {one_line(exc)}; the results are complete")
        raise OutputError(f"--plot {plot_path}: {text} ({', '.join(files)})") from None


def _refuse_files_of_no_sweep(out: str, log_path: str) -> None:
    """BadArgument where --out holds a file a sweep writes but no sweep's log (a sweep's
    folder always has one, from before its first cell): someone else's results.csv or
    sweep.json, which the sweep would replace."""
    if os.path.lexists(log_path):
        return
    for name in (TABLE, PARQUET, META):
        if os.path.isfile(os.path.join(out, name)):
            raise BadArgument(f"--out {out!r} holds {name} but no sweep's {RESULTS}: the sweep "
                              f"would overwrite it; give another --out")


def run_sweep(grid_path: str, *, out: str | None = None, workers: int | None = None,
              address: str | None = None, resume: bool = False, plot_path: str | None = None,
              metric: str | None = None, retries: int = 1, dry_run: bool = False,
              plot_x: str | None = None, plot_series: str | None = None, plot_fix=(),
              stream=None, table=None) -> dict:
    """The sweep as a function (the command is a thin layer over it). Every check happens
    before Ray starts, and Ray starts only when a cell is left to run; returns a summary dict,
    after printing the compact results table on `table` (a stream) where given. Raises
    KeyboardInterrupt after an interrupted sweep's finished cells are written; OutputError
    when the results cannot be written (the cells logged before are kept) or --plot fails
    after the work."""
    stream = stream or sys.stderr
    for option, given in (("--plot-x", plot_x), ("--plot-series", plot_series),
                          ("--plot-fix", plot_fix)):
        if given and not plot_path:
            raise BadArgument(f"{option} shapes the plot: give --plot PNG too")
    grid = load_grid(grid_path)
    if metric:  # before any cell: a name the command does not make is refused, not a '-' table
        check_metric(grid, metric)
    view = None
    if plot_path:  # before the cells are made: refusing a grid costs nothing however large
        view = check_plot(grid, plot_path, plot_x, plot_series, plot_fix)
    the_plan = plan(grid)
    cells = the_plan.cells
    if out == "":
        raise BadArgument("--out is empty: give a folder, or leave --out out for the default")
    out = default_out(grid_path) if out is None else out
    log_path = os.path.join(out, RESULTS)
    given_metric = metric
    metric = metric or default_metric(grid.command)
    problem = folder_problem(out, created=True)
    if problem:
        raise BadArgument(f"--out {out!r}: {problem}")
    # any byte in the log, even a torn line, is a sweep that ran here: never append silently
    if log_holds_anything(log_path) and not resume and not dry_run:
        raise BadArgument(f"{out} already holds sweep results: --resume completes them; remove "
                          f"the folder (or give another --out) to start over")
    if not dry_run:
        _refuse_files_of_no_sweep(out, log_path)
    done = _done_cells(cells, log_path, resume)
    skipped = done.count(1)
    if dry_run:
        for c in cells:
            print(f"{c.index}\t{c.hash}\t{'done' if done[c.index] else 'todo'}\t"
                  f"odma-hw {c.command_line}")
        return {"cells": len(cells), "skipped": skipped, "ran": 0, "failed": 0, "out": out}
    t0 = time.perf_counter()
    if skipped < len(cells):
        outcome, ray_start, ray_stop = _run_cells(the_plan, done, out, workers=workers,
                                                  address=address, retries=retries,
                                                  stream=stream)
    else:   # nothing left to run: no Ray (its start and stop alone take seconds)
        prepare_out(out)
        Progress(stream, os.path.basename(grid_path), len(cells), skipped)
        outcome, ray_start, ray_stop = Outcome(), 0.0, 0.0
    rows, files = _written_table(the_plan, out, outcome)
    summary = {"schema": SUMMARY_SCHEMA, "cells": len(cells), "skipped": skipped,
               "ran": outcome.ran,
               "failed": sum(r["status"] != "ok" for r in rows if r["row"] == 0),
               "missing": len(cells) - sum(r["row"] == 0 for r in rows),
               "wall_seconds": time.perf_counter() - t0, "ray_started": skipped < len(cells),
               "ray_start_seconds": ray_start, "ray_stop_seconds": ray_stop, "metric": metric,
               "out": out, "files": files}
    if outcome.interrupted:
        print(f"sweep interrupted: {outcome.ran} cells finished in this run are in "
              f"{files[0]}; --resume runs the other {summary['missing']}", file=stream)
        raise KeyboardInterrupt
    if given_metric and not plot_path:  # a command that names no METRICS: its results say
        # (--plot says it itself, after the table, as a failure after the work)
        check_metric_column(grid, rows, metric)
    if table is not None:
        print_table(grid, rows, metric, table, files[0])
    if plot_path:
        _draw(grid, rows, metric, plot_path, view, files)
        summary["files"].append(plot_path)
    return summary


# ------------------------------------------------------------------------------ the command
def _sweep(args, table=None) -> dict:
    return run_sweep(args.grid, out=args.out, workers=args.workers, address=args.address,
                     resume=args.resume, plot_path=args.plot, metric=args.metric,
                     retries=args.retries, dry_run=args.dry_run, plot_x=args.plot_x,
                     plot_series=args.plot_series, plot_fix=args.plot_fix or (), table=table)


def compute(args) -> dict:
    """The sweep's summary (what --json prints): cells, skipped, ran, failed, missing, seconds,
    the files written. Nothing on standard output."""
    return _sweep(args)


def _cmd(args) -> int:
    s = _sweep(args, table=None if args.json or args.dry_run else sys.stdout)
    if args.dry_run:
        return 0
    if args.json:
        print(jsonout.dumps(s))
    else:
        ray = (f"Ray start {s['ray_start_seconds']:.1f} s, stop {s['ray_stop_seconds']:.1f} s"
               if s["ray_started"] else "nothing to run: Ray not started")
        print(f"{s['cells']} cells: {s['cells'] - s['failed'] - s['missing']} ok, {s['failed']} "
              f"failed, {s['skipped']} already done; {s['wall_seconds']:.1f} s ({ray}); "
              f"{', '.join(s['files'])}")
    if s["failed"]:
        print(f"odma-hw: error: {s['failed']} of {s['cells']} cells failed (their errors are in "
              f"{s['files'][0]}); --resume reruns them", file=sys.stderr)
        return 3
    return 0


def _default_metrics() -> str:
    """Each installed command's default metric, as --help lists them (asked of the commands)."""
    found = []
    for command in registry():
        try:
            metric = getattr(module_of(command), "DEFAULT_METRIC", None)
        except ImportError:     # a command whose dependency is missing has no say here
            continue
        if metric:
            found.append(f"{command} {metric}")
    return ", ".join(found)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sweep", help="run a grid of command lines of any sweepable command on Ray",
        description=__doc__.split("\n\n")[0] + " Needs Ray: " + INSTALL_HINT + ".")
    p.add_argument("grid", metavar="GRID", help="grid file: .toml, .yaml or .json")
    p.add_argument("--out", type=argtypes.nonempty, metavar="DIR", default=None,
                   help="results folder (default: next to GRID, <grid name>-sweep)")
    p.add_argument("--resume", action="store_true",
                   help="keep the cells already recorded ok in --out; run the others (none "
                        "left: Ray is not started)")
    p.add_argument("--workers", type=argtypes.positive_int, default=None, metavar="N",
                   help="local Ray: N worker CPUs (default: all cores); with --address: at "
                        "most N cells at once")
    p.add_argument("--address", default=None, metavar="ADDR",
                   help="join a running Ray cluster: auto, HOST:PORT or ray://HOST:PORT "
                        "(default: start a local one)")
    p.add_argument("--retries", type=argtypes.count, default=1, metavar="N",
                   help="rerun a cell whose worker died up to N times (default 1); a cell "
                        "that raises is recorded failed at once")
    p.add_argument("--metric", default=None, metavar="NAME",
                   help="column of the printed table and the plot (default: the command's "
                        f"own: {_default_metrics()}; else {FALLBACK_METRIC})")
    p.add_argument("--plot", type=argtypes.nonempty, metavar="PNG", default=None,
                   help="draw --metric against --plot-x, a line per value of --plot-series, "
                        "the other axes held (--plot-fix)")
    p.add_argument("--plot-x", metavar="AXIS", default=None,
                   help="the axis along x (default: the first axis not held)")
    p.add_argument("--plot-series", metavar="AXIS", default=None,
                   help="a line per value of this axis (default: the next axis not held)")
    p.add_argument("--plot-fix", metavar="AXIS=VALUE", action="append", default=None,
                   help="hold an axis at a value (repeatable; default: every other axis at its "
                        "first value; the title says which)")
    p.add_argument("--json", action="store_true",
                   help="print the summary as one JSON object instead of the table and summary")
    p.add_argument("--dry-run", action="store_true",
                   help="check the grid and list its cells (hash, done/todo, command line); "
                        "run nothing")
    p.set_defaults(func=_cmd)
