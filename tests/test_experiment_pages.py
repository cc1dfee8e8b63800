"""The serving experiments' tables in docs/ hold for the code as it is: a row of the ODMA paper's
experiment, of the map and of the policies table, rerun by bench/serving_experiments.py --rows,
print as their page shows them. The rows are those a change of the step model moves first
(TP4's and the A100's, whose steps are compute-bound; a chunked-prefill row); the whole tables
take 10-30 minutes each, a row 20-60 s. The prefix-cache tables, 10 s in all, are held whole.
A failure names the command whose output the page needs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"

ROWS = [  # (experiment, the row's leading cells, the page that shows the row)
    ("paper", "| azure_conv_2023 | TP4 | 8192 |", "experiments.md"),
    ("map", "| memory | HBM (A100-80GB) |", "experiments.md"),
    ("policies", "| LPDDR5 (MLU370-X4) (`--device mlu370-x4`) | azure_conv_2023 | chunked 2048 "
                 "| recompute |", "extents.md"),
]


@pytest.mark.skipif(not TRACES.is_dir(), reason="the shared traces are absent")
@pytest.mark.parametrize("experiment, row, page", ROWS, ids=[r[0] for r in ROWS])
def test_a_row_rerun_prints_as_its_page_shows_it(experiment, row, page, tmp_path):
    command = [sys.executable, "bench/serving_experiments.py", experiment, "--rows", row]
    if experiment == "map":
        command += ["--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    printed = [line for line in done.stdout.splitlines() if line.startswith(row)]
    assert len(printed) == 1, done.stdout
    shown = [line for line in (ROOT / "docs" / page).read_text().splitlines()
             if line.startswith(row)]
    assert shown == printed, (f"docs/{page} shows another row than `.venv/bin/python "
                              f"bench/serving_experiments.py {experiment}` prints today: rerun "
                              "it and put its table into the page")


@pytest.mark.skipif(not TRACES.is_dir(), reason="the shared traces are absent")
def test_the_prefix_cache_tables_rerun_print_as_their_page_shows_them():
    """The prefix experiment is short (10 s): every row of its three tables."""
    done = subprocess.run([sys.executable, "bench/serving_experiments.py", "prefix"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    printed = [line for line in done.stdout.splitlines() if line.startswith("|")]
    shown = [line for line in (ROOT / "docs" / "prefix-cache.md").read_text().splitlines()
             if line.startswith("|")]
    assert printed and shown == printed, ("docs/prefix-cache.md shows other rows than "
                                          "`.venv/bin/python bench/serving_experiments.py "
                                          "prefix` prints today: put its tables into the page")


def test_rows_is_refused_by_the_prefix_experiment_it_does_not_apply_to():
    done = subprocess.run([sys.executable, "bench/serving_experiments.py", "prefix", "--rows",
                           "x"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith(
        "--rows applies to paper, map and policies")
