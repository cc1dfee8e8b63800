"""The real engine's decode step (allocator/serving/engine/runner.py) with the KV in contiguous blocks
(one run per request) against 16-token pages (one run per page), read by the same run-table
attention: Qwen2.5-0.5B's published config, random weights, float32, on torch:cpu. The ratio
paged / contiguous seconds goes to extra_info. On a CUDA machine, also the step from its CUDA
graph with the fused layers against transformers' modules (`make gpu-check` runs it)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from allocator.config import AllocatorConfig  # noqa: E402
from allocator.policies import make_allocator  # noqa: E402
from allocator.serving import models  # noqa: E402
from allocator.serving.engine import serve as te  # noqa: E402
from allocator.serving.engine.kv_runs import KVPool  # noqa: E402
from allocator.serving.engine.runner import Runner  # noqa: E402

BATCH, CONTEXT = 8, 256


@pytest.fixture(scope="module")
def model():
    cfg, _ = models.load_config("qwen2.5-0.5b")
    return te.build_model(cfg, "float32", "cpu", seed=0)


def _step(model, policy):
    """A decode step over BATCH requests holding CONTEXT tokens each (prefilled, untimed)."""
    cfg = model.config
    bpt = models.kv_bytes_per_token(cfg, "float32")
    alloc = make_allocator(policy, "torch:cpu", 2 * BATCH * (CONTEXT + 64) * bpt, bpt,
                           CONTEXT + 64, AllocatorConfig(background_refresh=False),
                           page_tokens=16)
    runner = Runner(model, KVPool(alloc, cfg, torch.float32, models.head_dim(cfg)))
    ids = te.prompt_ids(BATCH, [CONTEXT] * BATCH, cfg.vocab_size, 0)
    for i in range(BATCH):
        alloc.reserve(i, CONTEXT, 32.0, 0.0)
    runner.prefill(list(enumerate(ids)))
    for i in range(BATCH):
        alloc.grow(i, CONTEXT + 1)               # room for the decoded token (paged: a page)
    tokens = [int(t[-1]) for t in ids]
    positions = [CONTEXT] * BATCH

    def step():
        runner.decode(tokens, positions, list(range(BATCH)))
    return alloc, step


@pytest.mark.parametrize("policy", ["odma", "paged"])
def test_decode_step(benchmark, timings, model, policy):
    alloc, step = _step(model, policy)
    try:
        step()                                   # warm-up: first kernels, workspaces
        benchmark.pedantic(step, rounds=5, iterations=1)
        if timings():
            benchmark.extra_info["tokens_per_s"] = BATCH / timings().median
    finally:
        alloc.close()


def test_paged_over_contiguous_decode_ratio(benchmark, model):
    """Both layouts in one run, alternating, so that the machine's noise hits both alike."""
    import time

    steps = {p: _step(model, p) for p in ("odma", "paged")}
    times = {p: [] for p in steps}
    try:
        for p in steps:
            steps[p][1]()
        for _ in range(5):
            for p, (_, step) in steps.items():
                t = time.perf_counter()
                step()
                times[p].append(time.perf_counter() - t)
        ratio = float(np.median(times["paged"]) / np.median(times["odma"]))
        benchmark.extra_info["paged_over_contiguous"] = ratio
        benchmark.pedantic(lambda: ratio, rounds=1, iterations=1)
    finally:
        for alloc, _ in steps.values():
            alloc.close()


# ----------------------------------------------------------------------------- on a GPU
GPU_BATCH, GPU_CONTEXT = 32, 1024


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused layers are timed on CUDA")
@pytest.mark.parametrize("fused", ["on", "off"], ids=["fused", "modules"])
def test_cuda_graph_decode_step(benchmark, timings, fused):
    """One decode step of Qwen2.5-0.5B (bfloat16, random weights) at 32 requests x 1,024 tokens
    from its CUDA graph, with the fused layers and with transformers' modules, tokens read back
    as the engine reads them; extra_info: the step's milliseconds and the weight and KV bytes
    it reads (over the native probe's sequential rate, the step's memory floor)."""
    from allocator.serving.engine.runner import make_graphs

    cfg, _ = models.load_config("qwen2.5-0.5b")
    model = te.build_model(cfg, "bfloat16", "cuda", seed=0)
    bpt = models.kv_bytes_per_token(cfg, "bfloat16")
    longest = GPU_CONTEXT + 64
    # twice the requests' KV, as _step sizes it: odma reserves each block past its context
    alloc = make_allocator("odma", "torch:cuda:0", 2 * GPU_BATCH * longest * bpt, bpt, longest,
                           AllocatorConfig(background_refresh=False))
    try:
        runner = Runner(model, KVPool(alloc, cfg, torch.bfloat16, models.head_dim(cfg)),
                        "triton", fused)
        ids = te.prompt_ids(GPU_BATCH, [GPU_CONTEXT] * GPU_BATCH, cfg.vocab_size, 0)
        for i in range(GPU_BATCH):
            alloc.reserve(i, GPU_CONTEXT, 32.0, 0.0)
        for first in range(0, GPU_BATCH, 8):             # prompts, untimed
            runner.prefill([(i, ids[i]) for i in range(first, first + 8)])
        for i in range(GPU_BATCH):
            alloc.grow(i, GPU_CONTEXT + 1)               # room for the decoded token
        assert make_graphs(runner, GPU_BATCH, GPU_BATCH + 1) is not None, "capture failed"
        tokens = [int(t[-1]) for t in ids]

        def step():
            runner.decode(tokens, [GPU_CONTEXT] * GPU_BATCH,
                          list(range(GPU_BATCH))).argmax(-1).tolist()
        for _ in range(3):
            step()                                        # warm-up: first replays
        benchmark.pedantic(step, rounds=30, iterations=1)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        benchmark.extra_info.update(fused_layers=runner.fused is not None,
                                    weight_bytes=weights,
                                    kv_bytes=GPU_BATCH * GPU_CONTEXT * bpt)
        if timings():
            benchmark.extra_info["step_ms"] = timings().median * 1e3
    finally:
        alloc.close()
