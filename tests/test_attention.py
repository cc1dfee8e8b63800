"""Live decode attention: the same KV gives the same attention output whether it sits in one
contiguous block per request or in scattered pages in any of vLLM's layouts, and the live
measurements return what `odma-hw simulate` reads, refusing bad input with BadArgument."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from allocator import AllocatorConfig, PagedAllocator, RacmAllocator, StaleBlock  # noqa: E402
from allocator.serving.cards.presets import ModelSpec  # noqa: E402
from allocator.serving.sim import live  # noqa: E402
from allocator.serving.sim import live_attention  # noqa: E402
from odma_cli.errors import BadArgument  # noqa: E402
from odma_hw import devices  # noqa: E402

# 2 layers, 8 query heads sharing 2 KV heads (groups of 4), head_dim 16 (two v06 packs of 8)
TINY = ModelSpec("tiny", layers=2, hidden=128, heads=8, kv_heads=2, head_dim=16, ffn=256,
                 vocab=100, tied_embeddings=False, max_context=4096)
CONFIG = AllocatorConfig(large_share=0.0, background_refresh=False)


@pytest.fixture
def dev():
    with devices.open("torch:cpu") as d:
        yield d


def garbage(alloc):
    """Never-written pool bytes may be anything: make them NaN so any read of them shows."""
    alloc.pool_tensor().view(torch.bfloat16).fill_(math.nan)


def random_kv(contexts, seed):
    """Per layer, per request: (K, V), each (kv_heads, ctx, head_dim) bf16."""
    g = torch.Generator().manual_seed(seed)
    return [[tuple(torch.randn(TINY.kv_heads, c, TINY.head_dim, generator=g).to(torch.bfloat16)
                   for _ in "kv") for c in contexts] for _ in range(TINY.layers)]


def reference(q, kv, layer):
    """Grouped-query attention in float64, one query head at a time."""
    group = TINY.heads // TINY.kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, per_layer in enumerate(kv[layer]):
        k, v = (t.double() for t in per_layer)
        for h in range(TINY.heads):
            scores = k[h // group] @ q[i, h].double() / math.sqrt(TINY.head_dim)
            out[i, h] = torch.softmax(scores, 0) @ v[h // group]
    return out


def query(batch, seed):
    # scaled up so that softmax is peaked: outputs are then O(1) and a token read from the
    # wrong place moves them far beyond the tolerance
    g = torch.Generator().manual_seed(seed)
    return (4 * torch.randn(batch, TINY.heads, TINY.head_dim, generator=g)).to(torch.bfloat16)


def contiguous_batch(dev, contexts, pool_bytes=None):
    max_tokens = max(contexts) + 16
    alloc = RacmAllocator(dev, pool_bytes or 1 << 20, TINY.kv_bytes_per_token, max_tokens,
                          CONFIG)
    garbage(alloc)
    blocks = [alloc.reserve(i, c, 1) for i, c in enumerate(contexts)]
    return alloc, blocks


def paged_blocks(dev, contexts, page_tokens):
    """Requests grown round-robin a page at a time, so their pages interleave."""
    alloc = PagedAllocator(dev, 1 << 20, TINY.kv_bytes_per_token, max(contexts),
                           page_tokens=page_tokens)
    garbage(alloc)
    for i in range(len(contexts)):
        alloc.reserve(i, 0)
    for upto in range(page_tokens, max(contexts) + page_tokens, page_tokens):
        for i, c in enumerate(contexts):
            alloc.grow(i, min(upto, c))
    return alloc, [alloc.block(i) for i in range(len(contexts))]


# fp32 accumulation of the very same bf16 inputs: only the summation order differs
TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("piece_elements", [live_attention.PIECE_ELEMENTS, 64])
@pytest.mark.parametrize("page_tokens", [16, 32, 128])
@pytest.mark.parametrize("layout", live_attention.PAGED_LAYOUTS)
def test_paged_layouts_read_the_same_kv_as_contiguous_blocks(dev, layout, page_tokens,
                                                             piece_elements, monkeypatch):
    # small pieces: every run and page is gathered as several consecutive pieces
    monkeypatch.setattr(live_attention, "PIECE_ELEMENTS", piece_elements)
    # partial last pages, one token, whole pages; 1536 tokens x head_dim 16 is read in pieces
    contexts = [37, 5, 1536, 1, 128, 17]
    kv = random_kv(contexts, seed=page_tokens)
    q = query(len(contexts), seed=1)
    calloc, cblocks = contiguous_batch(dev, contexts)
    palloc, pblocks = paged_blocks(dev, contexts, page_tokens)
    assert max(b.segments for b in pblocks) > 1  # the pages really are scattered
    contiguous = live_attention.ContiguousKV(calloc, TINY, cblocks)
    paged = live_attention.PagedKV(palloc, TINY, pblocks, layout)
    for layer in range(TINY.layers):
        for i in range(len(contexts)):
            contiguous.write(i, layer, *kv[layer][i])
            paged.write(i, layer, *kv[layer][i])
    for layer in range(TINY.layers):
        want = reference(q, kv, layer)
        got_contiguous = live_attention.decode_attention(q, contiguous, layer)
        got_paged = live_attention.decode_attention(q, paged, layer)
        assert got_paged.dtype == torch.float32 and got_paged.shape == q.shape
        torch.testing.assert_close(got_paged, got_contiguous, **TOL)
        torch.testing.assert_close(got_contiguous.double(), want, **TOL)
    calloc.close()
    palloc.close()


def test_layer_caches_are_vllm_shaped_views_of_the_pool(dev):
    alloc = PagedAllocator(dev, 1 << 20, TINY.kv_bytes_per_token, 64, page_tokens=16)
    P = alloc.n_pages
    shapes = {lay: [tuple(t.shape) for t in live_attention.layer_caches(alloc, TINY, lay)[0]]
              for lay in live_attention.PAGED_LAYOUTS}
    assert shapes == {"nhd": [(P, 16, 2, 16)] * 2,
                      "hnd": [(P, 2, 16, 16)] * 2,
                      "v06": [(P, 2, 2, 16, 8), (P, 2, 16, 16)]}
    raw = alloc.pool_tensor()
    raw.zero_()
    k1, _ = live_attention.layer_caches(alloc, TINY, "nhd")[1]
    k1.fill_(3.0)                               # layer 1's keys live after all of layer 0
    per_layer_bytes = alloc.pool_bytes // TINY.layers
    assert raw[:per_layer_bytes].view(torch.bfloat16).eq(3.0).sum() == 0
    assert raw[per_layer_bytes:].view(torch.bfloat16).eq(3.0).sum() == k1.numel()
    alloc.close()


@pytest.mark.parametrize("longest", [1536, 1103])
def test_a_short_request_at_the_end_of_the_pool_reads_only_its_own_tokens(dev, longest):
    # the pool holds exactly the two blocks; the batch's window (1536 tokens, read in pieces
    # of 768; or 1103, a prime, read whole) is longer than the last block's runs, so that
    # block's window must start early and be masked to match
    contexts = [longest, 10]
    block_bytes = [-(-(c + 1) // 16) * 16 * TINY.kv_bytes_per_token for c in contexts]
    alloc, blocks = contiguous_batch(dev, contexts, pool_bytes=sum(block_bytes))
    assert blocks[1].offset + blocks[1].nbytes == alloc.pool_bytes
    kv = random_kv(contexts, seed=3)
    q = query(2, seed=4)
    batch = live_attention.ContiguousKV(alloc, TINY, blocks)
    for layer in range(TINY.layers):
        for i in range(2):
            batch.write(i, layer, *kv[layer][i])
    for layer in range(TINY.layers):
        torch.testing.assert_close(live_attention.decode_attention(q, batch, layer).double(),
                                   reference(q, kv, layer), **TOL)
    alloc.close()


def test_decode_attention_refuses_a_mismatched_query_or_layer(dev):
    alloc, blocks = contiguous_batch(dev, [8, 9])
    batch = live_attention.ContiguousKV(alloc, TINY, blocks)
    with pytest.raises(BadArgument, match="q must be"):
        live_attention.decode_attention(torch.zeros(3, TINY.heads, TINY.head_dim), batch, 0)
    with pytest.raises(BadArgument, match="layer 2"):
        live_attention.decode_attention(torch.zeros(2, TINY.heads, TINY.head_dim), batch, 2)
    with pytest.raises(BadArgument, match="ContiguousKV or PagedKV"):
        live_attention.decode_attention(torch.zeros(2, TINY.heads, TINY.head_dim), object(), 0)
    alloc.close()


def test_kv_batches_refuse_allocators_that_cannot_hold_the_model(dev):
    accounting = RacmAllocator(None, 1 << 20, TINY.kv_bytes_per_token, 64, CONFIG)
    blk = accounting.reserve(0, 8, 1)
    with pytest.raises(BadArgument, match="torch device"):
        live_attention.ContiguousKV(accounting, TINY, [blk])
    wrong = RacmAllocator(dev, 1 << 20, TINY.kv_bytes_per_token + 2, 64, CONFIG)
    with pytest.raises(BadArgument, match="B per token"):
        live_attention.ContiguousKV(wrong, TINY, [wrong.reserve(0, 8, 1)])
    alloc, blocks = contiguous_batch(dev, [8, 9])
    alloc.release(1)
    with pytest.raises(StaleBlock):
        live_attention.ContiguousKV(alloc, TINY, blocks)
    blocks = blocks[:1]
    with pytest.raises(BadArgument, match="exceeds"):
        live_attention.ContiguousKV(alloc, TINY, blocks, contexts=[blocks[0].capacity_tokens + 1])
    with pytest.raises(BadArgument, match="PagedAllocator"):
        live_attention.PagedKV(alloc, TINY, blocks, "nhd")
    paged = PagedAllocator(dev, 1 << 20, TINY.kv_bytes_per_token, 64, page_tokens=16)
    with pytest.raises(BadArgument, match="unknown paged layout"):
        live_attention.PagedKV(paged, TINY, [paged.reserve(0, 8)], "nchw")
    with pytest.raises(BadArgument, match="ContiguousPool"):
        live_attention.ContiguousKV(paged, TINY, [paged.block(0)])
    for a in (accounting, wrong, alloc, paged):
        a.close()


def test_measure_run_bandwidth_reports_every_size_in_gb_per_second():
    m = live.measure_run_bandwidth("torch:cpu", [64, 4096], buffer_bytes=1 << 20, reps=1)
    assert m["device"] == "torch:cpu" and m["buffer_bytes"] == 1 << 20
    assert set(m["runs_gbps"]) == set(m["runs_in_order_gbps"]) == {64, 4096}
    figures = [m["seq_gbps"], m["copy_gbps"], *m["runs_gbps"].values(),
               *m["runs_in_order_gbps"].values()]
    assert all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in figures)
    assert "index_select" in m["method"]


def test_measure_attention_times_every_layout_against_contiguous():
    m = live.measure_attention("torch:cpu", TINY, batch=3, context=40, page_tokens=16, reps=1,
                               layers=1)
    assert (m["batch"], m["context"], m["layers"], m["page_tokens"]) == (3, 40, 1, 16)
    assert set(m["seconds"]) == set(m["gather_seconds"]) == set(live_attention.LAYOUTS)
    assert set(m["ratio_to_contiguous"]) == set(live_attention.PAGED_LAYOUTS)
    assert all(s > 0 for s in m["seconds"].values())
    assert m["kv_bytes"] == 3 * 40 * 2 * 1 * TINY.kv_heads * TINY.head_dim * 2
    assert m["paged_segments_mean"] > 1        # 3 pages per request, scattered
    only = live.measure_attention("torch:cpu", TINY, 2, 20, layouts="hnd", reps=1, layers=1)
    assert set(only["seconds"]) == {"hnd"} and "ratio_to_contiguous" not in only


@pytest.mark.parametrize("device", ["emu:lpddr5-6400", None])
def test_non_torch_devices_are_refused(device):
    with pytest.raises(BadArgument, match="torch device"):
        live.measure_run_bandwidth(device, [4096], buffer_bytes=1 << 20, reps=1)
    with pytest.raises(BadArgument, match="torch device"):
        live.measure_attention(device, TINY, 2, 16, reps=1)


@pytest.mark.parametrize("kwargs", [
    dict(run_bytes=[4100]),                    # not a multiple of 8 B
    dict(run_bytes=[0]),
    dict(run_bytes=[1 << 19]),                 # over a quarter of the buffer
    dict(run_bytes=[]),
    dict(run_bytes=[4096], reps=0),
    dict(run_bytes=[4096], buffer_bytes=-1),
])
def test_bad_run_sizes_are_refused(kwargs):
    kwargs.setdefault("buffer_bytes", 1 << 20)
    with pytest.raises(BadArgument):
        live.measure_run_bandwidth("torch:cpu", **kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(batch=0), dict(context=-1), dict(page_tokens=0), dict(reps=0), dict(layers=0),
    dict(layouts=("contiguous", "paged")), dict(layouts=()),
    dict(model=ModelSpec("odd", 1, 64, 6, 4, 16, 64, 10, False, 64)),   # 6 heads, 4 KV heads
    dict(model=ModelSpec("v06-odd", 1, 64, 4, 2, 12, 64, 10, False, 64), layouts=("v06",)),
    dict(model="no-such-model"),
])
def test_bad_attention_arguments_are_refused(kwargs):
    args = dict(model=TINY, batch=2, context=16, page_tokens=16, reps=1, layers=1) | kwargs
    if args["model"] is not TINY:
        args.pop("layers")
    with pytest.raises(BadArgument):
        live.measure_attention("torch:cpu", **args)
