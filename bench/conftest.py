"""pytest configuration for the benchmarks in bench/.

Benchmark modules are named bench_*.py (so `pytest tests` never picks them up); this hook makes
`pytest bench` collect them. Run them with:

    .venv/bin/python -m pytest bench --benchmark-only --benchmark-columns=min,median,max

Bandwidth figures (GB = 1e9 B) are in each benchmark's extra_info (`--benchmark-json FILE` keeps
them); the timing columns are whole calls, set-up included.
"""

import pytest

from odma_cli.main import end_on_sigterm_as_on_ctrl_c

# A time limit's SIGTERM (timeout, a batch system) ends the run as Ctrl-C does: pytest then
# finishes its session and --benchmark-json keeps what was measured, where the default handler
# would end the process with nothing written (bench/gpu_check.sh's kernel_bench step).
end_on_sigterm_as_on_ctrl_c()


@pytest.fixture
def timings(benchmark):
    """A function giving the benchmark's timings (pytest-benchmark's Stats: min, median, data)
    once it ran, or None under --benchmark-disable, where each benchmark runs its code once,
    untimed, as a test: the figures derived from timings are then left out."""
    return lambda: None if benchmark.stats is None else benchmark.stats.stats


def pytest_collect_file(file_path, parent):
    # files named on the command line are collected by pytest itself; don't collect them twice
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_")
            and not parent.session.isinitpath(file_path)):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
