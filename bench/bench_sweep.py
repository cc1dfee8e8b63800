"""`odma-hw sweep` speed (pytest-benchmark; figures in extra_info, never asserted).

    .venv/bin/python -m pytest bench/bench_sweep.py --benchmark-only -s

- test_emulate_24_two_workers_vs_serial: bench/grids/emulate-24.toml, side by side in each
  round: the serial loop of its cells in one fresh process (parse + compute(), Numba warm; the
  untimed set-up of the round) and the whole `odma-hw sweep --workers 2` command (Ray start,
  per-worker warm-up and shutdown included; the timed part). The issue's target: sweep <= 0.6 x
  serial. ODMA_SWEEP_ROUNDS sets the rounds (default 3).
- test_scheduling_overhead_per_cell: 200 emulate cells of one request (~1 ms of compute) through
  run_sweep on a warm two-worker local Ray: the sweep's own cost per cell (planning and hashing,
  dispatch, the JSONL log, the CSV). The issue's target: < 50 ms per cell.

As a script, `serial GRID` times that serial loop alone, and `compare A.csv B.csv` says whether two sweeps of one grid agree cell by cell (every
column but wall times and worker names), e.g. a local and a two-node run:

    .venv/bin/python bench/bench_sweep.py compare local/results.csv cluster/results.csv
"""

from __future__ import annotations

import csv
import importlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from odma_cli import sweep
from odma_cli.argtypes import parse_line

REPO = Path(__file__).resolve().parents[1]
GRID_24 = REPO / "bench" / "grids" / "emulate-24.toml"
# columns that measure the run, not the cell
RUN_COLUMNS = {"wall_seconds", "warm_up_seconds", "worker", "out.wall_seconds",
               "requests_per_second", "out.requests_per_second"}


def serial_loop(grid_path) -> float:
    """Seconds to run every cell of the grid one after another in this process."""
    the_plan = sweep.plan(sweep.load_grid(str(grid_path)))
    module = importlib.import_module(the_plan.module)
    parser = sweep.command_parser(the_plan.module, the_plan.grid.command)
    t0 = time.perf_counter()
    for cell in the_plan.cells:
        module.compute(parse_line(parser, list(cell.argv[1:])))
    return time.perf_counter() - t0


def test_emulate_24_two_workers_vs_serial(benchmark, tmp_path):
    pytest.importorskip("ray", reason="pip install 'odma-hw[sweep]'")
    sweep.warm_up()
    rounds = int(os.environ.get("ODMA_SWEEP_ROUNDS", "3"))
    serial, swept = [], []
    outs = iter(tmp_path / f"round{i}" for i in range(rounds + 1))

    def setup():
        # a fresh process, as the sweep's workers are (this long-lived pytest process runs the
        # same loop markedly slower); only the loop is timed, Numba already warm
        done = subprocess.run([sys.executable, __file__, "serial", str(GRID_24)], cwd=REPO,
                              check=True, stdout=subprocess.PIPE, text=True)
        serial.append(float(done.stdout.split()[-1]))
        return (next(outs),), {}

    def run(out):
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "odma_hw", "sweep", str(GRID_24),
                               "--workers", "2", "--out", str(out)], cwd=REPO, check=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        swept.append(time.perf_counter() - t0)
        start, stop = re.search(r"Ray start ([\d.]+) s, stop ([\d.]+) s", done.stdout).groups()
        ray_fixed.append(float(start) + float(stop))
        with open(out / sweep.TABLE, newline="") as f:
            rows = list(csv.DictReader(f))
        cell_sums.append(sum(float(r["wall_seconds"]) for r in rows))

    ray_fixed, cell_sums = [], []
    benchmark.pedantic(run, setup=setup, rounds=rounds, iterations=1)
    ratios = [s / t for s, t in zip(swept, serial)]
    # without starting and stopping the local Ray: what the sweep itself achieves
    dispatch = [(s - f) / t for s, f, t in zip(swept, ray_fixed, serial)]
    # compute() seconds of the 24 cells run two at a time, over the same cells run alone
    contention = [c / t for c, t in zip(cell_sums, serial)]
    benchmark.extra_info.update(cells=24, serial_s=serial, sweep_s=swept, ratio=ratios,
                                ray_start_stop_s=ray_fixed, ratio_without_ray_start_stop=dispatch,
                                cell_seconds_two_at_a_time_over_alone=contention)
    print(f"\nemulate-24: serial {_fmt(serial)} s, sweep --workers 2 {_fmt(swept)} s "
          f"(Ray start + stop {_fmt(ray_fixed)} s); ratio {_fmt(ratios, 2)}, without Ray "
          f"start/stop {_fmt(dispatch, 2)}; cells two at a time take {_fmt(contention, 2)} x "
          f"their time alone")


def _fmt(values, digits=1) -> str:
    return "[" + ", ".join(f"{v:.{digits}f}" for v in values) + "]"


@pytest.fixture
def two_worker_ray():
    ray = pytest.importorskip("ray", reason="pip install 'odma-hw[sweep]'")
    import logging

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    yield ray
    ray.shutdown()


def test_scheduling_overhead_per_cell(benchmark, timings, tmp_path, two_worker_ray):
    n = 200
    grid = tmp_path / "tiny.toml"
    grid.write_text('command = "emulate"\n[fixed]\nrequests = 1\n[axes]\n'
                    f"seed = {list(range(1, n + 1))}\n")
    outs = iter(tmp_path / f"round{i}" for i in range(100))
    stream = open(os.devnull, "w")
    summaries = []

    def run():
        summaries.append(sweep.run_sweep(str(grid), out=str(next(outs)), stream=stream))

    run()                       # warm-up: both workers started and their emulator loaded
    benchmark.pedantic(run, rounds=5, iterations=1)
    stream.close()
    if not timings():
        return
    walls = timings().data
    rows = sweep.table_rows(sweep.plan(sweep.load_grid(str(grid))),
                            str(tmp_path / "round1" / sweep.RESULTS))
    compute_s = sum(float(r["wall_seconds"]) for r in rows) / n
    per_cell_ms = [1e3 * w / n for w in walls]
    # what a worker slot spends per cell on anything but compute()
    overhead_ms = [1e3 * (w * 2 - compute_s * n) / n for w in walls]
    benchmark.extra_info.update(cells=n, workers=2, compute_ms_per_cell=1e3 * compute_s,
                                wall_ms_per_cell=per_cell_ms, overhead_ms_per_cell=overhead_ms,
                                median_overhead_ms=sorted(overhead_ms)[len(overhead_ms) // 2])
    print(f"\n{n} no-op cells on 2 workers: {[f'{x:.2f}' for x in per_cell_ms]} ms wall per "
          f"cell; overhead per cell and worker {[f'{x:.2f}' for x in overhead_ms]} ms "
          f"(compute {1e3 * compute_s:.2f} ms)")


def compare(a_path, b_path) -> int:
    """Print how many cell values differ between two results.csv of one grid; 0 when none."""
    with open(a_path, newline="") as f:
        a = list(csv.DictReader(f))
    with open(b_path, newline="") as f:
        b = list(csv.DictReader(f))
    if [r["hash"] for r in a] != [r["hash"] for r in b]:
        print("the two tables hold different cells")
        return 1
    columns = [c for c in a[0] if c not in RUN_COLUMNS]
    diff = [(r["cell"], c, r[c], s[c]) for r, s in zip(a, b) for c in columns if r[c] != s[c]]
    workers = sorted({r["worker"].rpartition("@")[2] for r in b})
    print(f"{len(a)} rows x {len(columns)} columns compared: {len(diff)} differ; second "
          f"table's nodes: {', '.join(workers)}")
    for d in diff[:10]:
        print("  cell {}: {} {} != {}".format(*d))
    return 1 if diff else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    if len(sys.argv) == 3 and sys.argv[1] == "serial":
        sweep.warm_up()
        print(f"serial loop seconds {serial_loop(sys.argv[2]):.3f}")
        sys.exit(0)
    sys.exit(__doc__)
