"""Live decode attention and run-read bandwidth on every torch device present (pytest-benchmark;
figures in benchmark.extra_info, never asserted).

    .venv/bin/python -m pytest bench/bench_attention.py --benchmark-only \
        --benchmark-columns=median --benchmark-json attention.json

- decode attention of DeepSeek-R1-Distill-Qwen-7B geometry (4 KV heads x 128, 28 query heads;
  4 of its 28 layers, so a pool is 512 MiB rather than 3.5 GiB) for 16 requests of 4096 tokens
  and 64 of 1024: contiguous RacmAllocator blocks against vLLM's paged layouts (nhd, hnd, v06)
  over scattered pages of 16 and of 128 tokens. extra_info: seconds per step and per gather,
  GB/s, and each paged layout's ratio to contiguous;
- read bandwidth of random 4 KiB, 16 KiB, 64 KiB and 1 MiB runs against one sequential read
  (and the same gather over consecutive runs) in a 1 GiB buffer.

Each benchmark is one call (rounds=1): the timing inside is the library's own (median of 5 after
a warm-up), so the benchmark's own columns are whole calls, set-up included.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from allocator.serving.cards.presets import model_spec  # noqa: E402
from allocator.serving.sim.live import measure_attention, measure_run_bandwidth  # noqa: E402
from odma_hw import devices  # noqa: E402

QWEN = model_spec("deepseek-r1-distill-qwen-7b")
LAYERS = 4
RUN_SIZES = (4096, 16384, 65536, 1 << 20)


def torch_specs() -> list[str]:
    found = {s.backend: s for s in devices.discover()}["torch"]
    return found.specs or ["torch:cpu"]      # torch:cpu is listed whenever torch imports


@pytest.mark.parametrize("spec", torch_specs())
@pytest.mark.parametrize("batch,context,page_tokens",
                         [(16, 4096, 16), (16, 4096, 128), (64, 1024, 16)])
def test_decode_attention_contiguous_vs_paged(benchmark, spec, batch, context, page_tokens):
    m = benchmark.pedantic(measure_attention, args=(spec, QWEN, batch, context),
                           kwargs=dict(page_tokens=page_tokens, reps=5, layers=LAYERS),
                           rounds=1, iterations=1)
    benchmark.extra_info.update(
        device=spec, model=m["model"], layers=m["layers"], batch=batch, context=context,
        page_tokens=page_tokens, kv_bytes=m["kv_bytes"], seconds=m["seconds"],
        gather_seconds=m["gather_seconds"], kv_gbps=m["kv_gbps"], gather_gbps=m["gather_gbps"],
        ratio_to_contiguous=m["ratio_to_contiguous"],
        gather_ratio_to_contiguous=m["gather_ratio_to_contiguous"],
        paged_segments_mean=m["paged_segments_mean"],
        threads=torch.get_num_threads())


@pytest.mark.parametrize("spec", torch_specs())
def test_run_read_bandwidth(benchmark, spec):
    m = benchmark.pedantic(measure_run_bandwidth, args=(spec, RUN_SIZES), kwargs=dict(reps=5),
                           rounds=1, iterations=1)
    benchmark.extra_info.update(
        device=spec, buffer_bytes=m["buffer_bytes"], seq_gbps=m["seq_gbps"],
        copy_gbps=m["copy_gbps"], runs_gbps={str(s): g for s, g in m["runs_gbps"].items()},
        runs_in_order_gbps={str(s): g for s, g in m["runs_in_order_gbps"].items()},
        runs_over_seq={str(s): g / m["seq_gbps"] for s, g in m["runs_gbps"].items()},
        threads=torch.get_num_threads(), method=m["method"])
