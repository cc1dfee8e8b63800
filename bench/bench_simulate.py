"""Serving-simulation speed (pytest-benchmark; figures in extra_info, never asserted).

    .venv/bin/python -m pytest bench/bench_simulate.py --benchmark-only

The issue's target: 10,000 requests of azure_conv_2023 through one policy in < 30 s on a
2-core machine, emulator efficiencies cached (the first round computes them; warm-up excluded).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from allocator.serving.cli import simulate

TRACES = Path(os.environ.get("ODMA_TRACES",
                             Path(__file__).resolve().parents[2] / "shared" / "traces"))


@pytest.mark.parametrize("policy", ["odma", "paged", "static"])
def test_ten_thousand_azure_requests(benchmark, policy):
    path = TRACES / "azure_conv_2023.csv"
    if not path.exists():
        pytest.skip(f"{path} absent (set ODMA_TRACES)")

    def run():
        return simulate(path, (policy,), (6.0,), requests=10_000, max_model_len=8192,
                        clip=True)[0]

    run()                                   # warm-up: emulator efficiencies into the cache
    r = benchmark.pedantic(run, rounds=3, iterations=1)
    benchmark.extra_info.update(requests=r["requests"], output_tps=r["output_tps"],
                                steps=r["steps"], wall_seconds=r["wall_seconds"])
