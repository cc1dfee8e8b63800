"""Serving-simulation speed (pytest-benchmark; figures in extra_info, never asserted).

    .venv/bin/python -m pytest bench/bench_simulate.py --benchmark-only

The issue's target: 10,000 requests of azure_conv_2023 through one policy in < 30 s on a
2-core machine, emulator efficiencies cached (the first round computes them; warm-up excluded).

Long contexts: bench/fidelity_published.py's point P2 (llama-3.1-8b on h100-sxm, 150 requests of
20,000 / 2,000 tokens +-15 %, concurrency 8, vLLM V1's chunked prefill of 8,192 tokens and nhd
pages), paged beside odma, and prefill-first. A paged request there grows a page every 16
tokens into a pool whose pages are scattered (hundreds of runs a request): each growth re-reads
its KV line, which once recounted and recosted every run (issue 28, item 8: 55x odma's time).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from allocator.serving.sim.simulation import simulate
from allocator.trace import RequestTrace

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


def p2_trace():
    """fidelity_published.py's P2 requests: 150 of 20,000 / 2,000 tokens, +-15 % uniform."""
    rng = np.random.default_rng(0)
    prompt = (20000 * rng.uniform(0.85, 1.15, 150)).astype(int)
    gen = (2000 * rng.uniform(0.85, 1.15, 150)).astype(int)
    return RequestTrace(prompt, gen, None, name="P2")


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "prefill-first"])
@pytest.mark.parametrize("policy", ["odma", "paged"])
def test_long_context_point(benchmark, policy, chunked):
    trace = p2_trace()
    sched = dict(max_batched_tokens=8192) if chunked else {}

    def run():
        return simulate(trace, (policy,), model="llama-3.1-8b", device="h100-sxm",
                        max_model_len=int((trace.prompt + trace.generated).max()),
                        memory_utilization=0.9, concurrency=8, engine_profile="vllm-v1-h100",
                        max_batch=1024, paged_layout="nhd", **sched)[0]

    run()                                   # warm-up: emulator efficiencies into the cache
    r = benchmark.pedantic(run, rounds=3, iterations=1)
    benchmark.extra_info.update(requests=r["requests"], output_tps=r["output_tps"],
                                steps=r["steps"], wall_seconds=r["wall_seconds"])
