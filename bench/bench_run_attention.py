"""Run-table decode attention (allocator/serving/engine/run_attention.py): KV bytes read per second of
the Triton decode kernel over each KV layout (pytest-benchmark; figures in extra_info, never
asserted).

    .venv/bin/python -m pytest bench/bench_run_attention.py --benchmark-only \
        --benchmark-columns=median --benchmark-json run_attention.json

- geometry: Qwen2.5-0.5B (2 KV heads, 14 query heads, head_dim 64) and one Llama-3.1-8B layer
  (8 KV heads, 32 query heads, head_dim 128), bfloat16, one layer per pool;
- batch x context: 64 x 1,024 and 16 x 4,096 tokens;
- layouts: one run per request (a contiguous block), 512-token extents, 16-token pages and
  1-token pages; the regions (extents, pages, blocks) placed in random order across a pool
  that they fill exactly.

extra_info: seconds per decode call, kv_gbps (GB = 1e9 B: the K and V bytes of every token of
the batch for one layer, read once per call), ratio_to_contiguous (this layout's GB/s over the
contiguous layout's, same geometry and batch), runs per request, the split count. Timing: the
decode call is captured DECODES_PER_GRAPH times in one CUDA graph (launch overhead out of the
figure: a 32 MB step lasts about 10 us), replayed after a warm-up, ROUNDS timed rounds of
REPLAYS replays between CUDA events; the median round. Each benchmark is one call
(rounds=1): its own columns are whole calls, set-up included.

On CUDA only; elsewhere one dry run of the same code at a tiny size on the CPU with the torch
path (so the file is known to work), its figures meaningless.

    .venv/bin/python bench/bench_run_attention.py --sweep     # tile/warp sweep (CUDA)
    .venv/bin/python bench/bench_run_attention.py --splits    # split counts (CUDA)
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from allocator.serving.engine import run_attention as ra  # noqa: E402
from allocator.serving.engine import run_kernels as rk  # noqa: E402

GEOMETRIES = {                       # name: (kv heads, query heads, head_dim)
    "qwen2.5-0.5b": (2, 14, 64),
    "llama-3.1-8b": (8, 32, 128),
}
DRY = {"tiny": (2, 4, 16)}           # the CPU dry run's geometry
SHAPES = [(64, 1024), (16, 4096)]     # (batch, context)
LAYOUTS = {"contiguous": None, "extents512": 512, "pages16": 16, "pages1": 1}
DECODES_PER_GRAPH = 20
REPLAYS = 10
ROUNDS = 5
SEED = 0

CUDA = torch.cuda.is_available()


def build(layout: str, batch: int, context: int, kv_heads: int, head_dim: int, dtype,
          device, seed: int = SEED, align: int | None = None):
    """(pool, RunTable): `batch` requests of `context` tokens of one layer in `layout`, the
    regions in random order, filling the pool; random KV. The table's align (default: 16
    bytes' worth of elements, which every region offset here is a multiple of)."""
    gen = torch.Generator().manual_seed(seed)
    region = LAYOUTS[layout] or context            # tokens per region
    per_tok = 2 * kv_heads * head_dim              # elements of one token (one layer)
    per_req = -(-context // region)
    n_regions = batch * per_req
    slots = torch.randperm(n_regions, generator=gen).tolist()
    dgen = torch.Generator(device=device).manual_seed(seed)
    pool = torch.randn(n_regions * region * per_tok, generator=dgen, device=device, dtype=dtype)
    requests = []
    for b in range(batch):
        runs = []
        for j in range(per_req):
            slot = slots[b * per_req + j]
            runs.append((slot * region * per_tok, region, min(region, context - j * region)))
        requests.append(runs)
    runs = ra.RunTable.from_requests(requests, device, max_context=context,
                                     align=align or 16 // pool.element_size())
    return pool, runs


def _time_cuda(fn) -> tuple[float, str]:
    """Seconds per fn() call: DECODES_PER_GRAPH calls in a CUDA graph, replayed; eager calls
    between events where capture fails."""
    for _ in range(3):
        fn()                                       # compile, warm caches
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph):
                for _ in range(DECODES_PER_GRAPH):
                    fn()
        torch.cuda.current_stream().wait_stream(stream)
        run, per, method = graph.replay, DECODES_PER_GRAPH, "cuda-graph"
    except RuntimeError:
        run, per, method = fn, 1, "eager"
    for _ in range(3):
        run()
    rounds = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            run()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / 1e3 / (REPLAYS * per))
    return statistics.median(rounds), method


def _time_cpu(fn) -> tuple[float, str]:
    fn()
    t = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t) / 3, "wall"


def measure(geometry: str, batch: int, context: int, layout: str, *, device="cuda",
            backend=None, dtype=torch.bfloat16, config=None, num_splits=None,
            align=None) -> dict:
    kvh, heads, d = {**GEOMETRIES, **DRY}[geometry]
    pool, runs = build(layout, batch, context, kvh, d, dtype, device, align=align)
    gen = torch.Generator().manual_seed(SEED + 1)
    q = torch.randn(batch, heads, d, generator=gen).to(dtype).to(device)
    out = torch.empty_like(q)
    backend = ra.attention_backend(device, backend)

    def call():
        ra.decode_attention(q, pool, runs, 0, kvh, d, d ** -0.5, out=out, backend=backend,
                            config=config, num_splits=num_splits)
    seconds, method = (_time_cuda if torch.device(device).type == "cuda" else _time_cpu)(call)
    kv_bytes = batch * context * 2 * kvh * d * pool.element_size()
    return dict(geometry=geometry, batch=batch, context=context, layout=layout,
                backend=backend, kv_bytes=kv_bytes, seconds=seconds,
                kv_gbps=kv_bytes / seconds / 1e9, runs_per_request=len(runs.run_off) // batch,
                splits=num_splits or rk.decode_splits(batch, kvh, context, device),
                method=method, config=config or rk._decode_config(d, dtype))


@functools.lru_cache(maxsize=None)
def contiguous(geometry: str, batch: int, context: int) -> dict:
    return measure(geometry, batch, context, "contiguous")


@pytest.mark.skipif(not CUDA, reason="the decode kernels' bandwidth is measured on CUDA")
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("batch,context", SHAPES)
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_decode_bandwidth(benchmark, geometry, batch, context, layout):
    def run():
        base = contiguous(geometry, batch, context)
        m = base if layout == "contiguous" else measure(geometry, batch, context, layout)
        return m, base
    m, base = benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(
        device=torch.cuda.get_device_name(), **{k: v for k, v in m.items() if k != "config"},
        config=str(m["config"]), ratio_to_contiguous=m["kv_gbps"] / base["kv_gbps"],
        contiguous_gbps=base["kv_gbps"])


@pytest.mark.skipif(CUDA, reason="the dry run is for machines without CUDA")
def test_dry_run_cpu(benchmark):
    """The same measurement on the CPU through the torch path at a tiny size: proof that the
    file runs, not a figure."""
    def run():
        return {layout: measure("tiny", 2, 40, layout, device="cpu", backend="torch")
                for layout in LAYOUTS}
    got = benchmark.pedantic(run, rounds=1, iterations=1)
    base = got["contiguous"]["kv_gbps"]
    benchmark.extra_info.update(dry_run=True, ratio_to_contiguous={
        k: v["kv_gbps"] / base for k, v in got.items()})
    assert all(v["seconds"] > 0 for v in got.values())


# ----------------------------------------------------------------------------- tuning sweep
def sweep() -> None:
    """GB/s of decode tile configurations over the layouts (CUDA), for _decode_config."""
    configs = [dict(BLOCK_N=n, num_warps=w, num_stages=s, MIN_SPLIT=rk.MIN_SPLIT_TOKENS)
               for n in (32, 64, 128) for w in (4, 8) for s in (1, 3)]
    for geometry in GEOMETRIES:
        for batch, context in SHAPES:
            for layout in ("contiguous", "pages16"):
                row = []
                for cfg in configs:
                    try:
                        m = measure(geometry, batch, context, layout, config=cfg)
                        row.append((m["kv_gbps"], cfg))
                    except Exception as exc:                # noqa: BLE001 (a sweep goes on)
                        print(f"  {cfg}: {type(exc).__name__}: {exc}"[:200], flush=True)
                row.sort(key=lambda x: -x[0])
                best = ", ".join(f"{g:.0f} n{c['BLOCK_N']}w{c['num_warps']}s{c['num_stages']}"
                                 for g, c in row[:4])
                print(f"{geometry} {batch}x{context} {layout}: {best}", flush=True)


def splits() -> None:
    """GB/s of each split count against decode_splits' choice (CUDA, contiguous and 1-token
    pages)."""
    for geometry in GEOMETRIES:
        for batch, context in SHAPES:
            for layout in ("contiguous", "pages1"):
                row = []
                for s in (1, 2, 4, 8, 16):
                    m = measure(geometry, batch, context, layout, num_splits=s)
                    row.append(f"S{s} {m['kv_gbps']:.0f}")
                kvh = GEOMETRIES[geometry][0]
                print(f"{geometry} {batch}x{context} {layout} (decode_splits "
                      f"{rk.decode_splits(batch, kvh, context, 'cuda')}): {', '.join(row)}",
                      flush=True)


if __name__ == "__main__":
    if "--sweep" in sys.argv:
        sweep()
    if "--splits" in sys.argv:
        splits()
