"""Run-table attention (allocator/serving/engine/run_attention.py): the torch reference and the Triton
kernels against a dense attention over K/V assembled plainly from each request's regions, on
every KV layout (one region per request, uneven extents, scattered 16-token pages, 1-token
pages), odd head counts, GQA, 1-token contexts and runs, a 1,000-run request, padded empty
requests; store_kv; prompt chunks after a context.

The Triton tests run compiled on CUDA when there is a GPU (and TRITON_INTERPRET is not 1), else
on the CPU under triton's interpreter (TRITON_INTERPRET=1, set for those tests only: the
module decorates its kernels on first use, per mode). They skip where triton is absent; the
torch-reference tests need no triton.

Tolerances (against float64 dense attention): float32 2e-5 absolute and relative (the kernels
accumulate in fp32, dot products at IEEE precision); bfloat16 2e-2 (the output and the softmax
weights fed to the P.V product are rounded to bf16, 8 significant bits); float16 4e-3 (11).

Every pool starts as NaN, and only the tokens of the runs are written: a kernel that reads a
byte outside its runs (a region's unused tail, a gap between regions) gives NaN.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from allocator.serving.engine import run_attention as ra  # noqa: E402
from allocator.serving.engine import run_kernels as rk  # noqa: E402
from odma_cli.errors import BadArgument  # noqa: E402

LAYERS = 2
LAYER = 1                       # the layer read: offsets of layer 1 exercise the layer stride
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=4e-3, rtol=4e-3)}
LAYOUTS = ("contiguous", "extents", "pages16", "pages1")


# ----------------------------------------------------------------------------- scenarios
def _run_caps(layout: str, ctx: int, rng: random.Random) -> list[tuple[int, int]]:
    """[(cap, tokens)] of a request of `ctx` tokens in `layout`."""
    if ctx == 0:
        return []
    if layout == "contiguous":
        return [(ctx + rng.randrange(0, 9), ctx)]
    if layout in ("pages16", "pages1"):
        T = 16 if layout == "pages16" else 1
        return [(T, min(T, ctx - p)) for p in range(0, ctx, T)]
    runs, left = [], ctx                      # uneven extents; the last one partly filled
    while left:
        cap = rng.choice((1, 3, 5, 16, 29, 64))
        runs.append((cap, min(cap, left)))
        left -= runs[-1][1]
    return runs


class Scenario:
    """A pool holding `ctxs` requests in `layout` at random places (regions shuffled, random
    gaps), the truth K and V of each request [LAYERS, KVH, ctx, D] in float32, and the run
    table."""

    def __init__(self, layout, ctxs, kv_heads, head_dim, dtype, *, group=1, seed=0,
                 device="cpu", gap_align=1, spare_rows=0):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        self.kv_heads, self.head_dim, self.dtype, self.ctxs = kv_heads, head_dim, dtype, ctxs
        self.group = group                      # query heads per kv head
        self.per_tok = LAYERS * 2 * kv_heads * head_dim
        per_tok = LAYERS * 2 * kv_heads * head_dim
        caps = [_run_caps(layout, c, rng) for c in ctxs]
        regions = [(b, j) for b, runs in enumerate(caps) for j in range(len(runs))]
        rng.shuffle(regions)
        offs, at = {}, rng.randrange(0, 4) * gap_align
        for key in regions:
            offs[key] = at
            at += caps[key[0]][key[1]][0] * per_tok + rng.randrange(0, 5) * gap_align
        pool = torch.full((at + 64,), float("nan"), dtype=dtype)
        self.truth = []
        for b, runs in enumerate(caps):
            kv = torch.randn(LAYERS, 2, kv_heads, ctxs[b], head_dim, generator=gen)
            kv = kv.to(dtype).float()             # what the pool can hold
            p = 0
            for j, (cap, n) in enumerate(runs):
                region = pool[offs[b, j]:offs[b, j] + cap * per_tok].view(
                    LAYERS, 2, kv_heads, cap, head_dim)
                region[:, :, :, :n] = kv[:, :, :, p:p + n].to(dtype)
                p += n
            self.truth.append(kv)
        self.requests = [[(offs[b, j], cap, n) for j, (cap, n) in enumerate(runs)]
                         for b, runs in enumerate(caps)]
        self.pool = pool.to(device)
        self.runs = ra.RunTable.from_requests(self.requests, device, align=gap_align,
                                              spare_rows=spare_rows)
        self.runs.validate(pool.numel(), LAYERS, kv_heads, head_dim)

    def dense(self, b, layer=LAYER):
        """K, V [KVH, ctx, D] float64 of request b."""
        kv = self.truth[b][layer].double()
        return kv[0], kv[1]


def dense_attention(q, K, V, qpos, scale):
    """q [n, H, D] at positions qpos [n] over K, V [KVH, ctx, D] (float64), causal."""
    H, KVH = q.shape[1], K.shape[0]
    if K.shape[1] == 0:
        return torch.zeros(q.shape, dtype=torch.float64)
    Kh = K.repeat_interleave(H // KVH, 0)
    Vh = V.repeat_interleave(H // KVH, 0)
    s = torch.einsum("nhd,hld->nhl", q.double(), Kh) * scale
    mask = torch.arange(K.shape[1])[None, :] <= torch.as_tensor(qpos)[:, None]
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("nhl,hld->nhd", torch.softmax(s, -1), Vh)


def dense_decode(sc, q, scale, layer=LAYER):
    out = [dense_attention(q[b:b + 1].cpu(), *sc.dense(b, layer), [sc.ctxs[b] - 1], scale)
           for b in range(len(sc.ctxs))]
    return torch.cat(out)


def chunk_inputs(sc, q_lens, gen, device):
    """Packed queries of a prompt chunk of q_lens[b] tokens at the end of each context."""
    H = sc.kv_heads * sc.group
    q_len = torch.tensor(q_lens, dtype=torch.int32)
    q_pos = torch.tensor([c - n for c, n in zip(sc.ctxs, q_lens)], dtype=torch.int32)
    q_start = (torch.cumsum(q_len, 0) - q_len).to(torch.int32)
    q = torch.randn(int(q_len.sum()), H, sc.head_dim, generator=gen).to(sc.dtype)
    return q.to(device), q_start.to(device), q_len.to(device), q_pos.to(device)


def dense_prefill(sc, q, q_start, q_len, q_pos, scale):
    q = q.cpu()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(sc.ctxs)):
        a, n, p = int(q_start[b]), int(q_len[b]), int(q_pos[b])
        if n:
            out[a:a + n] = dense_attention(q[a:a + n], *sc.dense(b), list(range(p, p + n)),
                                           scale)
    return out


def close(got, want, dtype):
    got = got.detach().cpu().double()
    assert not torch.isnan(got).any(), "NaN in the output"
    torch.testing.assert_close(got, want.cpu().double(), **TOL[dtype])


# Geometries: (kv heads, query heads per kv head, head_dim, dtype, decode splits). The torch
# reference and the Triton decode run each on every layout; the Triton prefill (slower under
# the interpreter) runs LAYOUT_GEOMETRY on every layout and the others on uneven extents.
GEOMETRIES = [
    pytest.param(1, 7, 16, torch.bfloat16, 3, id="kvh1-gqa7-d16-bf16"),
    pytest.param(3, 1, 64, torch.float32, 1, id="kvh3-mha-d64-f32"),
    pytest.param(2, 4, 16, torch.float32, 4, id="kvh2-gqa4-d16-f32"),
]
LAYOUT_GEOMETRY = (1, 7, 16, torch.bfloat16, 3)
CTXS = [1, 37, 0, 100, 2]       # a 1-token context, a padded empty request (ctx 0) among them
CHUNKS = [1, 9, 0, 20, 2]       # prompt chunks ending each context (1 of 1, 2 of 2: whole)


def scenario(layout, kvh, g, d, dtype, device, **kw):
    return Scenario(layout, CTXS, kvh, d, dtype, group=g, device=device, **kw)


# ----------------------------------------------------------------------------- torch reference
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kvh,g,d,dtype,splits", GEOMETRIES)
def test_torch_reference_matches_dense(layout, kvh, g, d, dtype, splits):
    sc = scenario(layout, kvh, g, d, dtype, "cpu", seed=LAYOUTS.index(layout))
    gen = torch.Generator().manual_seed(1)
    scale = d ** -0.5
    q = torch.randn(len(CTXS), kvh * g, d, generator=gen).to(dtype)
    out = ra.decode_attention(q, sc.pool, sc.runs, LAYER, kvh, d, scale, backend="torch")
    assert out.dtype == dtype and out.shape == q.shape
    close(out, dense_decode(sc, q, scale), dtype)
    assert not out[CTXS.index(0)].any()
    # prompt chunks after a context, causal within the chunk (and a whole prompt: 2 of 2)
    qc = chunk_inputs(sc, CHUNKS, gen, "cpu")
    out = ra.prefill_attention(qc[0], sc.pool, sc.runs, *qc[1:], LAYER, kvh, d, scale,
                               backend="torch")
    close(out, dense_prefill(sc, *qc, scale), dtype)


def test_torch_index_reused_across_layers():
    sc = scenario("pages16", 2, 2, 16, torch.float32, "cpu")
    q = torch.randn(len(CTXS), 4, 16)
    for layer in range(LAYERS):
        out = ra.decode_attention(q, sc.pool, sc.runs, layer, 2, 16, 0.25, backend="torch")
        close(out, dense_decode(sc, q, 0.25, layer), torch.float32)
    assert sc.runs.gather_index(2, 16) is sc.runs.gather_index(2, 16)


def test_the_one_run_index_is_the_scattered_one():
    """A batch of contiguous blocks (one run a request, from its first token) takes the short
    way to its gather index: the same index, and the same attention, as any table's."""
    import numpy as np

    ctxs = [1, 37, 100, 2]
    sc = Scenario("contiguous", ctxs, 2, 16, torch.float32, group=2, device="cpu")
    gi = ra.GatherIndex.build(sc.runs, 2, 16)
    r = sc.runs
    host = [getattr(r, f).numpy().astype(np.int64) for f in ("run_start", "ctx_len")]
    R = int(host[0][-1])
    n, off, cap, first = (getattr(r, f)[:R].numpy().astype(np.int64)
                          for f in ("run_len", "run_off", "run_cap", "run_pos"))
    assert R == len(ctxs) and not first.any()                  # the short way was taken
    valid = np.arange(max(ctxs))[None, :] < host[1][:, None]
    base, capd = ra.GatherIndex._scattered(*host, n, off, cap, first, valid, 16)
    ch = np.arange(4).reshape(1, 2, 2, 1)
    want = base[:, None, None, :] + ch * capd[:, None, None, :]
    assert np.array_equal(gi.idx0.numpy() * (16 if gi.rows else 1), want)
    q = torch.randn(len(ctxs), 4, 16)
    out = ra.decode_attention(q, sc.pool, sc.runs, LAYER, 2, 16, 0.25, backend="torch")
    close(out, dense_decode(sc, q, 0.25), torch.float32)


def test_torch_out_and_spare_rows():
    """Trailing unused rows (R > run_start[B]) are ignored; `out` is written."""
    sc = scenario("extents", 1, 3, 16, torch.float32, "cpu", spare_rows=5)
    q = torch.randn(len(CTXS), 3, 16)
    out = torch.full_like(q, 7.0)
    got = ra.decode_attention(q, sc.pool, sc.runs, LAYER, 1, 16, 0.25, out=out, backend="torch")
    assert got is out
    close(out, dense_decode(sc, q, 0.25), torch.float32)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_store_kv(backend, request):
    """New tokens land in their regions (for the layer given, K and V of every head); a
    negative slot leaves the pool untouched; decode then reads what was stored."""
    device = request.getfixturevalue("tri") if backend == "triton" else "cpu"
    kvh, d, dtype = 3, 16, torch.bfloat16
    sc = scenario("pages16", kvh, 2, d, dtype, device)
    gen = torch.Generator().manual_seed(3)
    # overwrite the last token of every non-empty request, plus two skipped lanes
    slot, cap, lanes = [], [], []
    for b, runs in enumerate(sc.requests):
        if runs:
            off, c, n = runs[-1]
            slot.append(off + (n - 1) * d)
            cap.append(c)
            lanes.append(b)
        slot.append(-1)
        cap.append(1)
        lanes.append(None)
    N = len(slot)
    k = torch.randn(N, kvh, d, generator=gen).to(dtype)
    v = torch.randn(N, kvh, d, generator=gen).to(dtype)
    before = sc.pool.clone()
    kt = k.to(device).transpose(0, 1).contiguous().transpose(0, 1)     # a strided view
    ra.store_kv(sc.pool, kt, v.to(device), torch.tensor(slot).to(device),
                torch.tensor(cap).to(device), LAYER, kvh, d, backend=backend)
    expect = before.cpu().clone()
    for n, b in enumerate(lanes):
        if b is not None:
            off, c, used = sc.requests[b][-1]
            region = expect[off:off + c * sc.per_tok].view(LAYERS, 2, kvh, c, d)
            region[LAYER, 0, :, used - 1] = k[n]
            region[LAYER, 1, :, used - 1] = v[n]
            sc.truth[b][LAYER, 0, :, -1] = k[n].float()
            sc.truth[b][LAYER, 1, :, -1] = v[n].float()
    torch.testing.assert_close(sc.pool.cpu(), expect, rtol=0, atol=0, equal_nan=True)
    q = torch.randn(len(CTXS), kvh * 2, d, generator=gen).to(dtype).to(device)
    out = ra.decode_attention(q, sc.pool, sc.runs, LAYER, kvh, d, 0.25, backend=backend,
                              num_splits=2)
    close(out, dense_decode(sc, q, 0.25), dtype)


def test_store_kv_all_skipped_leaves_pool(tri):
    pool = torch.randn(4096).to(tri)
    before = pool.clone()
    k = torch.randn(4, 2, 16, device=tri)
    slot = torch.tensor([-1, -5, -1, -16], device=tri)
    for backend in ("torch", "triton"):
        ra.store_kv(pool, k, k, slot, torch.ones(4, dtype=torch.int64, device=tri), 0, 2, 16,
                    backend=backend)
        assert torch.equal(pool, before)


# ----------------------------------------------------------------------------- Triton kernels
def _triton_decode(tri, layout, kvh, g, d, dtype, splits, seed):
    sc = scenario(layout, kvh, g, d, dtype, tri, seed=seed)
    gen = torch.Generator().manual_seed(2)
    scale = d ** -0.5
    q = torch.randn(len(CTXS), kvh * g, d, generator=gen).to(dtype).to(tri)
    want = dense_decode(sc, q, scale)
    ref = ra.decode_attention(q, sc.pool, sc.runs, LAYER, kvh, d, scale, backend="torch")
    # 16-token tiles and splits of >= 16 tokens: the 100-token context is cut in several
    # places, tiles straddle runs
    got = ra.decode_attention(q, sc.pool, sc.runs, LAYER, kvh, d, scale, backend="triton",
                              num_splits=splits, config=dict(MIN_SPLIT=16, BLOCK_N=16))
    assert got.dtype == dtype and got.shape == q.shape
    close(got, want, dtype)
    close(got, ref.cpu().double(), dtype)
    assert not got[CTXS.index(0)].any()


def _triton_prefill(tri, layout, kvh, g, d, dtype, seed):
    sc = scenario(layout, kvh, g, d, dtype, tri, seed=seed)
    gen = torch.Generator().manual_seed(4)
    scale = d ** -0.5
    qc = chunk_inputs(sc, CHUNKS, gen, tri)
    want = dense_prefill(sc, *qc, scale)
    got = ra.prefill_attention(qc[0], sc.pool, sc.runs, *qc[1:], LAYER, kvh, d, scale,
                               backend="triton", max_q_len=max(CHUNKS),
                               config=dict(BLOCK_N=16, BLOCK_M=16 * -(-g // 4) * 2))
    close(got, want, dtype)
    ref = ra.prefill_attention(qc[0], sc.pool, sc.runs, *qc[1:], LAYER, kvh, d, scale,
                               backend="torch")
    close(got, ref.cpu().double(), dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kvh,g,d,dtype,splits", GEOMETRIES)
def test_triton_decode(tri, layout, kvh, g, d, dtype, splits):
    _triton_decode(tri, layout, kvh, g, d, dtype, splits, seed=7 + LAYOUTS.index(layout) + kvh)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_prefill_layouts(tri, layout):
    _triton_prefill(tri, layout, *LAYOUT_GEOMETRY[:4], seed=11 + LAYOUTS.index(layout))


@pytest.mark.parametrize("kvh,g,d,dtype,splits", GEOMETRIES[1:])
def test_triton_prefill_geometry(tri, kvh, g, d, dtype, splits):
    _triton_prefill(tri, "extents", kvh, g, d, dtype, seed=kvh)


def test_triton_defaults(tri):
    """The default tiles and split count (decode_splits, here 3 for a max_context of 600),
    no max_q_len."""
    sc = scenario("pages16", 2, 3, 16, torch.bfloat16, tri, seed=3)
    sc.runs.max_context = 600
    assert rk.decode_splits(len(CTXS), 2, 600) == 3
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(len(CTXS), 6, 16, generator=gen).to(torch.bfloat16).to(tri)
    got = ra.decode_attention(q, sc.pool, sc.runs, LAYER, 2, 16, 0.25, backend="triton")
    close(got, dense_decode(sc, q, 0.25), torch.bfloat16)
    qc = chunk_inputs(sc, CHUNKS, gen, tri)
    got = ra.prefill_attention(qc[0], sc.pool, sc.runs, *qc[1:], LAYER, 2, 16, 0.25,
                               backend="triton")
    close(got, dense_prefill(sc, *qc, 0.25), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_head_dim_128(tri, dtype):
    """Llama's head_dim (the prefill kernel's 32-token KV tiles) and float16, default tiles."""
    sc = Scenario("pages16", [70, 5], 1, 128, dtype, group=2, device=tri, seed=12)
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(2, 2, 128, generator=gen).to(dtype).to(tri)
    close(ra.decode_attention(q, sc.pool, sc.runs, LAYER, 1, 128, 128 ** -0.5,
                              backend="triton"), dense_decode(sc, q, 128 ** -0.5), dtype)
    qc = chunk_inputs(sc, [40, 5], gen, tri)
    got = ra.prefill_attention(qc[0], sc.pool, sc.runs, *qc[1:], LAYER, 1, 128, 128 ** -0.5,
                               backend="triton")
    close(got, dense_prefill(sc, *qc, 128 ** -0.5), dtype)


def test_triton_thousand_runs(tri):
    """One request of 1,000 one-token pages (and a short one beside it): decode with splits
    that start in the middle of the run list, and a prompt chunk at its end."""
    sc = Scenario("pages1", [1000, 3], 1, 16, torch.float32, group=2, device=tri, seed=5)
    assert len(sc.requests[0]) == 1000
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 2, 16, generator=gen).to(tri)
    want = dense_decode(sc, q, 0.25)
    for splits in (1, 5):
        got = ra.decode_attention(q, sc.pool, sc.runs, LAYER, 1, 16, 0.25, backend="triton",
                                  num_splits=splits, config=dict(MIN_SPLIT=64))
        close(got, want, torch.float32)
    qc = chunk_inputs(sc, [20, 3], gen, tri)
    got = ra.prefill_attention(qc[0], sc.pool, sc.runs, *qc[1:], LAYER, 1, 16, 0.25,
                               backend="triton")
    close(got, dense_prefill(sc, *qc, 0.25), torch.float32)


def test_triton_padded_batch(tri):
    """A graph-style table: padded lanes with no runs (zeros, no NaN) and unused trailing
    rows; the result written into `out`."""
    sc = Scenario("extents", [0, 17, 0, 0], 2, 16, torch.bfloat16, device=tri, seed=8,
                  spare_rows=7)
    q = torch.randn(4, 6, 16).to(torch.bfloat16).to(tri)
    out = torch.full_like(q, float("nan"))
    got = ra.decode_attention(q, sc.pool, sc.runs, LAYER, 2, 16, 0.25, out=out,
                              backend="triton", num_splits=3)
    assert got is out
    close(out, dense_decode(sc, q, 0.25), torch.bfloat16)
    assert not out[[0, 2, 3]].any()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strided_queries(backend, request):
    """q and out as the engine has them: [N, H, D] views of a head-major [H, N, D] tensor."""
    device = request.getfixturevalue("tri") if backend == "triton" else "cpu"
    sc = scenario("extents", 2, 2, 16, torch.float32, device, seed=4)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(4, len(CTXS), 16, generator=gen).to(device).transpose(0, 1)
    assert not q.is_contiguous()
    out = torch.empty(4, len(CTXS), 16, device=device).transpose(0, 1)
    ra.decode_attention(q, sc.pool, sc.runs, LAYER, 2, 16, 0.25, out=out, backend=backend,
                        num_splits=2)
    close(out, dense_decode(sc, q, 0.25), torch.float32)
    qc = chunk_inputs(sc, CHUNKS, gen, device)
    qs = qc[0].transpose(0, 1).contiguous().transpose(0, 1)
    got = ra.prefill_attention(qs, sc.pool, sc.runs, *qc[1:], LAYER, 2, 16, 0.25,
                               backend=backend)
    close(got, dense_prefill(sc, *qc, 0.25), torch.float32)
    # written into a strided `out` (the engine's rows of its step's output), every row a chunk's
    out = torch.full((4, qs.shape[0], 16), float("nan"), device=device).transpose(0, 1)
    got = ra.prefill_attention(qs, sc.pool, sc.runs, *qc[1:], LAYER, 2, 16, 0.25, out,
                               backend=backend)
    assert got is out
    close(out, dense_prefill(sc, *qc, 0.25), torch.float32)


def test_triton_aligned_offsets(tri):
    """align=8 (regions 16-byte aligned): the kernels' vector-load hint changes nothing."""
    sc = scenario("pages16", 2, 2, 64, torch.bfloat16, tri, gap_align=8)
    assert sc.runs.align == 8
    q = torch.randn(len(CTXS), 4, 64).to(torch.bfloat16).to(tri)
    close(ra.decode_attention(q, sc.pool, sc.runs, LAYER, 2, 64, 0.125, backend="triton",
                              num_splits=2),
          dense_decode(sc, q, 0.125), torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graph_replay():
    """store_kv and decode captured once in a CUDA graph over static tables (padded lanes,
    spare rows), then replayed after new tables are copied in: the same as eager calls."""
    pytest.importorskip("triton")
    kvh, g, d, dt = 2, 7, 64, torch.bfloat16
    a = Scenario("pages16", [300, 1, 0, 57], kvh, d, dt, group=g, device="cuda", seed=20,
                 spare_rows=40)
    b = Scenario("extents", [3, 200, 80, 0], kvh, d, dt, group=g, device="cuda", seed=21)
    pool = torch.full((max(a.pool.numel(), b.pool.numel()),), float("nan"), dtype=dt,
                      device="cuda")
    pool[:a.pool.numel()] = a.pool
    static = a.runs
    q = torch.randn(4, kvh * g, d, device="cuda").to(dt)
    k = torch.randn(4, kvh, d, device="cuda").to(dt)
    slot = torch.full((4,), -1, dtype=torch.int64, device="cuda")
    slot_cap = torch.ones(4, dtype=torch.int64, device="cuda")
    out = torch.empty_like(q)

    def step():
        ra.store_kv(pool, k, k, slot, slot_cap, LAYER, kvh, d)
        ra.decode_attention(q, pool, static, LAYER, kvh, d, 0.125, out=out)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    close(out, dense_decode(a, q, 0.125), dt)
    # b's tables into the static buffers (fewer runs: the rest become spare rows)
    pool[:b.pool.numel()] = b.pool
    n = b.runs.run_off.numel()
    assert n <= static.run_off.numel()
    for name in ra.TABLE_FIELDS:
        src = getattr(b.runs, name)
        getattr(static, name)[:src.numel()].copy_(src)
    q.copy_(torch.randn(4, kvh * g, d, device="cuda").to(dt))
    graph.replay()
    close(out, dense_decode(b, q, 0.125), dt)


# ----------------------------------------------------------------------------- the rest
def test_attention_backend(monkeypatch):
    assert ra.attention_backend("cpu") == "torch"
    assert ra.attention_backend("cpu", "torch") == "torch"
    assert ra.attention_backend("cuda", "torch") == "torch"
    with pytest.raises(BadArgument):
        ra.attention_backend("cpu", "flash")
    monkeypatch.setattr(ra, "triton_available", lambda: False)
    assert ra.attention_backend("cuda") == "torch"
    with pytest.raises(BadArgument, match="triton"):
        ra.attention_backend("cuda", "triton")
    monkeypatch.setattr(ra, "triton_available", lambda: True)
    assert ra.attention_backend("cuda") == "triton"
    assert ra.attention_backend("cuda", "triton") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BadArgument, match="CUDA"):
        ra.attention_backend("cpu", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ra.attention_backend("cpu", "triton") == "triton"


def test_decode_splits_fixed():
    """The split count depends on batch, heads and device (and the optional bound), never on
    a step's contexts."""
    assert rk.decode_splits(1, 1) == rk.MAX_SPLITS
    assert rk.decode_splits(64, 8) == 1
    assert rk.decode_splits(1, 1, max_context=300) == 2
    assert all(1 <= rk.decode_splits(b, h) <= rk.MAX_SPLITS for b in (1, 7, 64) for h in (1, 8))


def test_validate_rejects_bad_tables():
    good = ra.RunTable.from_requests([[(0, 4, 4), (1000, 4, 2)], []])
    good.validate(10_000, 2, 1, 16)
    bad = ra.RunTable.from_requests([[(0, 4, 4), (1000, 4, 2)]])
    bad.run_pos[1] = 3
    with pytest.raises(BadArgument, match="run_pos"):
        bad.validate(10_000, 2, 1, 16)
    bad = ra.RunTable.from_requests([[(0, 4, 4)]])
    bad.ctx_len[0] = 5
    with pytest.raises(BadArgument, match="ctx_len"):
        bad.validate(10_000, 2, 1, 16)
    with pytest.raises(BadArgument, match="outside"):
        good.validate(1_000, 2, 1, 16)
    with pytest.raises(BadArgument):
        ra.RunTable.from_requests([[(0, 4, 5)]])


def test_bad_arguments():
    sc = scenario("contiguous", 2, 2, 16, torch.float32, "cpu")
    with pytest.raises(BadArgument):
        ra.decode_attention(torch.randn(len(CTXS), 3, 16), sc.pool, sc.runs, 0, 2, 16, 1.0)
    with pytest.raises(BadArgument):
        ra.decode_attention(torch.randn(2, 4, 16), sc.pool, sc.runs, 0, 2, 16, 1.0)
    with pytest.raises(BadArgument):
        ra.store_kv(sc.pool, torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.zeros(2),
                    torch.ones(2), 0, 2, 16)
