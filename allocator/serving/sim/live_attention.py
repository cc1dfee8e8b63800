"""Decode attention over KV that sits in real allocator blocks on a torch device: the KV of a
decode batch in each layout (ContiguousKV, PagedKV, layer_caches) and decode_attention(), which
live.py times.

Decode attention (one query token per request, grouped-query attention, fp32 accumulation over a
bf16 KV cache) reads each request's KV from its allocator:

- contiguous (ContiguousKV): a RacmAllocator (or any ContiguousPool) Block per request, head-major
  inside the block: [layers, 2 (K, V), kv_heads, capacity_tokens, head_dim]. One (layer, K/V,
  KV head) is one run of ctx x head_dim x 2 B; only the first ctx tokens are valid.
- paged (PagedKV): a PagedAllocator pool in one of vLLM's cache layouts, per layer:
    "nhd"  vLLM v1 FlashAttention   (2, pages, page_tokens, kv_heads, head_dim)
    "hnd"  Cambricon vllm-mlu       (2, pages, kv_heads, page_tokens, head_dim)
    "v06"  vLLM 0.6 paged_attn      K [pages, kv_heads, head_dim / x, page_tokens, x] (x = 8 for
                                    bf16: 16 B), then V [pages, kv_heads, head_dim, page_tokens]
  The pool is split per layer as vLLM splits it: layer l owns bytes [l R, (l + 1) R) with
  R = pages x page_tokens x (bytes per token of one layer), and page p of a request is block p of
  every layer's cache (one block table serves all layers). That keeps each layer's cache one dense
  tensor whose page rows a gather indexes directly, and gives the runs a paged kernel really
  reads: one page of one layer's K (or V), page_tokens x kv_heads x head_dim x 2 B. The
  allocator's page_bytes = page_tokens x bytes_per_token is the same total per page; but
  PagedBlock.read/write, which treat page p as bytes [p page_bytes, (p + 1) page_bytes), do not
  address this layout: write KV through PagedKV.write or the layer_caches() views.

Both paths do the same work per layer, so their times differ by where the bytes come from and
by the order a layout leaves them in: one gather (index_select) of the batch's K and V out of
the pool into a workspace (contiguous: each (request, K/V, KV head) run of T tokens, in
consecutive pieces; nhd: one row per page of the block table, all KV heads; hnd and v06: one row
per (page, KV head), the run a paged kernel's warp reads), one conversion into fp32 in (batch,
kv_heads, T, head_dim) order (a plain copy for contiguous and hnd, a transposing one for nhd and
v06), QK^T, a masked softmax, PV. A fused kernel would not materialise the gather nor reorder
v06's packed keys; torch without custom kernels must.
"""

from __future__ import annotations

import dataclasses
import math

from odma_cli.errors import BadArgument, DeviceUnavailable
from odma_hw.devices.torch_device import TorchDevice

from allocator.arguments import count, positive_count
from allocator.contiguous import ContiguousPool
from allocator.errors import StaleBlock
from allocator.paged import PagedAllocator
from allocator.serving.cards.presets import ModelSpec, model_spec

try:
    import torch
except ImportError:  # the rest of the package works without torch; these functions do not
    torch = None

LAYOUTS = ("contiguous", "nhd", "hnd", "v06")
PAGED_LAYOUTS = LAYOUTS[1:]
V06_PACK_BYTES = 16          # vLLM 0.6 packs x = 16 B / element size of K's head_dim together
# torch's CPU index_select runs one parallel loop over the rows it gathers when a row is below
# its grain (32768 elements), but one parallel region per row above it: on a few shared cores
# every region waits for a descheduled thread. Long runs are therefore gathered as consecutive
# pieces of at most this many elements (the same bytes in the same order; one kernel on GPUs).
PIECE_ELEMENTS = 16384


def pieces_per_row(row_elements: int) -> int:
    """The fewest equal pieces, each of at most PIECE_ELEMENTS, that a row splits into."""
    k = -(-row_elements // PIECE_ELEMENTS)
    while row_elements % k:
        k += 1
    return k


def _piece_tokens(window: int, head_dim: int) -> int:
    """Tokens per piece of a contiguous run of `window` tokens: the largest divisor of the
    window that keeps a piece within PIECE_ELEMENTS, or the whole window when the only such
    divisors are so small that per-piece overheads would dominate (a prime window)."""
    most = max(1, PIECE_ELEMENTS // head_dim)
    if window <= most:
        return window
    best = next(p for p in range(most, 0, -1) if window % p == 0)
    return best if 4 * best >= most else window


def require_torch():
    if torch is None:
        raise DeviceUnavailable("live timing needs torch; pip install 'odma-hw[torch]'")



def attention_model(model, layers=None) -> ModelSpec:
    spec = model_spec(model) if isinstance(model, str) else model
    if not isinstance(spec, ModelSpec):
        raise BadArgument(f"model must be a ModelSpec or a model name, got {model!r}")
    if layers is not None:
        layers = positive_count("layers", layers)
        spec = dataclasses.replace(spec, layers=layers)
    if spec.kv_dtype_bytes != 2:
        raise BadArgument(f"{spec.name}: live attention reads a bf16 KV cache (2 B), not "
                          f"{spec.kv_dtype_bytes} B")
    if spec.heads % spec.kv_heads:
        raise BadArgument(f"{spec.name}: {spec.heads} query heads do not share "
                          f"{spec.kv_heads} KV heads evenly")
    return spec


def _check_allocator(alloc, model: ModelSpec) -> None:
    if not alloc.holds_bytes or not isinstance(alloc.device, TorchDevice):
        raise BadArgument("attention reads real KV: the allocator must hold bytes on a torch "
                          f"device, not {getattr(alloc.device, 'spec', None)}")
    if alloc.bytes_per_token != model.kv_bytes_per_token:
        raise BadArgument(f"the allocator stores {alloc.bytes_per_token} B per token, "
                          f"{model.name} at {model.layers} layers needs "
                          f"{model.kv_bytes_per_token}")


def _contexts(blocks, contexts, limit) -> list[int]:
    """Each request's context (default: the tokens its block holds), checked against `limit`
    (the tokens its storage holds)."""
    if not blocks:
        raise BadArgument("a decode batch needs at least one request")
    for b in blocks:
        if not b.live:
            raise StaleBlock(f"block of request {b.request_id!r} is stale (migrated or released)")
    if contexts is None:
        contexts = [b.tokens for b in blocks]
    contexts = [positive_count("context", c) for c in contexts]
    if len(contexts) != len(blocks):
        raise BadArgument(f"{len(contexts)} contexts for {len(blocks)} blocks")
    for b, c in zip(blocks, contexts):
        if c > limit(b):
            raise BadArgument(f"request {b.request_id!r}: context {c} exceeds the "
                              f"{limit(b)} tokens its storage holds")
    return contexts


class _KVBatch:
    """The KV of one decode batch as an attention kernel sees it: index tensors built once per
    step (vLLM's block table and sequence lengths), then one gather per layer."""

    layout = "?"

    def _finish(self, model, dev, contexts, window, starts):
        """Keep what every layout needs: the valid positions of the T-token window (request i's
        tokens are positions [starts[i], starts[i] + ctx_i)) and the step's workspaces."""
        self.model = model
        self.device = dev
        self.contexts = contexts
        self.window_tokens = window
        pos = torch.arange(window)
        start = torch.tensor(starts)[:, None]
        invalid = ~((pos >= start) & (pos < start + torch.tensor(contexts)[:, None]))
        self._any_invalid = bool(invalid.any())
        self._invalid = invalid.to(dev.dev)                          # (batch, T)
        self._invalid_at = tuple(i.to(dev.dev) for i in torch.nonzero(invalid, as_tuple=True))
        self._work = None

    def workspace(self):
        """(staged bf16 K and V, fp32 K, fp32 V, fp32 scores): made on first use and then
        reused by every layer and step, as a kernel's workspace is; a fresh tensor per call would
        time the allocator (first-touch page faults on the CPU), not the reads."""
        if self._work is None:
            m, dev = self.model, self.device.dev
            n = self.batch * m.kv_heads * self.window_tokens * m.head_dim
            self._work = (torch.empty(2 * n, dtype=torch.bfloat16, device=dev),
                          torch.empty(n, dtype=torch.float32, device=dev),
                          torch.empty(n, dtype=torch.float32, device=dev),
                          torch.empty((self.batch, m.kv_heads, m.heads // m.kv_heads,
                                       self.window_tokens), dtype=torch.float32, device=dev))
        return self._work

    def release_workspace(self) -> None:
        self._work = None

    @property
    def batch(self) -> int:
        return len(self.contexts)

    @property
    def kv_bytes(self) -> int:
        """Bytes of valid KV one step reads (all layers)."""
        return sum(self.contexts) * self.model.kv_bytes_per_token

    def gather(self, layer: int):
        """(K, V) of `layer` for the whole batch, gathered into the staging workspace: bf16
        views whose contiguous form is (batch, kv_heads, T, head_dim)."""
        raise NotImplementedError


class ContiguousKV(_KVBatch):
    """A batch of requests whose KV is one contiguous Block each (head-major inside it)."""

    layout = "contiguous"

    def __init__(self, alloc, model, blocks, contexts=None):
        require_torch()
        model = attention_model(model)
        if not isinstance(alloc, ContiguousPool):
            raise BadArgument(f"contiguous blocks come from a ContiguousPool (RacmAllocator, "
                              f"...), not {type(alloc).__name__}")
        _check_allocator(alloc, model)
        self.blocks = list(blocks)
        contexts = _contexts(self.blocks, contexts, lambda b: b.capacity_tokens)
        L, H, D = model.layers, model.kv_heads, model.head_dim
        window = max(contexts)
        piece = _piece_tokens(window, D)      # a run is read in pieces, one after the other
        pool = alloc.pool_tensor().view(torch.bfloat16)
        n = pool.numel()
        # every element offset as the start of an overlapping row of one piece: one
        # index_select then reads each run as consecutive pieces of one stretch
        self._windows = pool.as_strided((n - piece * D + 1, piece * D), (1, 1))
        pieces = torch.arange(0, window * D, piece * D)
        starts, shifts = [], []
        for b in self.blocks:
            base = b.offset // 2
            cap = b.capacity_tokens
            last = base + (2 * L * H - 1) * cap * D            # the block's last run
            # a window running past the pool's end starts earlier; the mask follows it
            shift = max(0, -(-(last + window * D - n) // D))
            starts.append([[[base + ((l * 2 + kv) * H + h) * cap * D - shift * D
                             for h in range(H)] for kv in (0, 1)] for l in range(L)])
            shifts.append(shift)
        # (layers, 2, batch, kv_heads, pieces): a layer's K runs of the batch, then its V runs
        index = torch.tensor(starts, dtype=torch.int64).permute(1, 2, 0, 3)[..., None] + pieces
        if int(index.min()) < 0:
            raise BadArgument("the pool is smaller than one context window")  # unreachable
        self._index = index.reshape(L, -1).to(alloc.device.dev)
        self._finish(model, alloc.device, contexts, window, shifts)

    def block_view(self, i: int):
        """Request i's block as [layers, 2, kv_heads, capacity_tokens, head_dim] bf16."""
        m, b = self.model, self.blocks[i]
        return b.tensor(torch.bfloat16, (m.layers, 2, m.kv_heads, b.capacity_tokens, m.head_dim))

    def write(self, i: int, layer: int, k, v) -> None:
        """Store request i's K and V of `layer`, each (kv_heads, ctx, head_dim)."""
        ctx = k.shape[1]
        view = self.block_view(i)
        view[layer, 0, :, :ctx] = k
        view[layer, 1, :, :ctx] = v
        self.blocks[i].mark_written(self.blocks[i].capacity_tokens * self.model.kv_bytes_per_token)

    def gather(self, layer):
        b, H, T, D = self.batch, self.model.kv_heads, self.window_tokens, self.model.head_dim
        g = self.workspace()[0].view(self._index.shape[1], -1)
        torch.index_select(self._windows, 0, self._index[layer], out=g)
        g = g.view(2, b, H, T, D)
        return g[0], g[1]


def layer_caches(alloc, model, layout: str) -> list:
    """Per layer, (key_cache, value_cache) as vLLM's kernels see them: views of the paged pool
    (no copy) in `layout` ("nhd", "hnd" or "v06"); page p of any request is index p of each."""
    require_torch()
    model = attention_model(model)
    if layout not in PAGED_LAYOUTS:
        raise BadArgument(f"unknown paged layout {layout!r}: expected one of "
                          f"{', '.join(PAGED_LAYOUTS)}")
    if not isinstance(alloc, PagedAllocator):
        raise BadArgument(f"paged layouts need a PagedAllocator, not {type(alloc).__name__}")
    _check_allocator(alloc, model)
    P, T, H, D = alloc.n_pages, alloc.page_tokens, model.kv_heads, model.head_dim
    x = V06_PACK_BYTES // model.kv_dtype_bytes
    if layout == "v06" and D % x:
        raise BadArgument(f"layout v06 packs {x} elements of head_dim; {D} is not a multiple")
    per_layer = 2 * P * T * H * D
    pool = alloc.pool_tensor().view(torch.bfloat16)
    out = []
    for layer in range(model.layers):
        kv = pool[layer * per_layer:(layer + 1) * per_layer].view(2, P, T * H * D)
        if layout == "nhd":
            out.append((kv[0].view(P, T, H, D), kv[1].view(P, T, H, D)))
        elif layout == "hnd":
            out.append((kv[0].view(P, H, T, D), kv[1].view(P, H, T, D)))
        else:
            out.append((kv[0].view(P, H, D // x, T, x), kv[1].view(P, H, D, T)))
    return out


class PagedKV(_KVBatch):
    """A batch of requests whose KV is in pages of a PagedAllocator, in one of vLLM's layouts."""

    def __init__(self, alloc, model, blocks, layout="nhd", contexts=None):
        require_torch()
        model = attention_model(model)
        self.caches = layer_caches(alloc, model, layout)
        self.layout = layout
        self.blocks = list(blocks)
        T = self.page_tokens = alloc.page_tokens
        self.n_pages = alloc.n_pages
        contexts = _contexts(self.blocks, contexts, lambda b: len(b.pages) * T)
        used = [-(-c // T) for c in contexts]
        width = max(used)
        # the block table, padded with each request's first page (read, then masked)
        table = [b.pages[:n] + [b.pages[0]] * (width - n) for b, n in zip(self.blocks, used)]
        table = torch.tensor(table, dtype=torch.int64)                # (batch, pages)
        P, H = self.n_pages, model.kv_heads
        if layout == "nhd":
            # a page holds every KV head's tokens interleaved: one row per page
            rows_per_page, index = 1, table
        else:
            # head-major pages: one row per (page, KV head), the run a kernel's warp reads
            rows_per_page = H
            index = (table[:, None, :] * H + torch.arange(H)[None, :, None])  # (batch, H, pages)
        index = torch.cat([index, index + P * rows_per_page])                  # K rows, V rows
        row = T * H * model.head_dim // rows_per_page
        split = pieces_per_row(row)
        self._index = (index[..., None] * split + torch.arange(split)).reshape(-1).to(
            alloc.device.dev)
        per_layer = 2 * P * T * H * model.head_dim
        pool = alloc.pool_tensor().view(torch.bfloat16)
        self._rows = [pool[l * per_layer:(l + 1) * per_layer].view(-1, row // split)
                      for l in range(model.layers)]
        self._finish(model, alloc.device, contexts, width * T, [0] * len(contexts))

    def write(self, i: int, layer: int, k, v) -> None:
        """Store request i's K and V of `layer`, each (kv_heads, ctx, head_dim), into its pages
        (what vLLM's reshape_and_cache does for new tokens)."""
        ctx = k.shape[1]
        T, blk = self.page_tokens, self.blocks[i]
        pos = torch.arange(ctx)
        page = torch.tensor(blk.pages, dtype=torch.int64)[pos // T].to(k.device)
        slot = (pos % T).to(k.device)
        kc, vc = self.caches[layer]
        k_tok, v_tok = k.transpose(0, 1), v.transpose(0, 1)       # (ctx, kv_heads, head_dim)
        if self.layout == "nhd":
            kc[page, slot] = k_tok
            vc[page, slot] = v_tok
        elif self.layout == "hnd":
            kc[page, :, slot] = k_tok
            vc[page, :, slot] = v_tok
        else:
            kc[page, :, :, slot] = k_tok.reshape(ctx, kc.shape[1], kc.shape[2], kc.shape[4])
            vc[page, :, :, slot] = v_tok

    def gather(self, layer):
        b, W = self.batch, self.window_tokens // self.page_tokens
        H, D, T = self.model.kv_heads, self.model.head_dim, self.page_tokens
        g = self.workspace()[0].view(self._index.numel(), -1)
        torch.index_select(self._rows[layer], 0, self._index, out=g)
        if self.layout == "nhd":        # (b, pages, T, H, D) -> (b, H, pages, T, D)
            g = g.view(2, b, W, T, H, D)
            return g[0].permute(0, 3, 1, 2, 4), g[1].permute(0, 3, 1, 2, 4)
        if self.layout == "hnd":        # already (b, H, pages, T, D)
            g = g.view(2, b, H, W, T, D)
            return g[0], g[1]
        x = V06_PACK_BYTES // self.model.kv_dtype_bytes
        g = g.view(2, b, H, W, -1)
        k = g[0].view(b, H, W, D // x, T, x).transpose(3, 4)    # (b, H, pages, T, D/x, x)
        v = g[1].view(b, H, W, D, T).transpose(3, 4)            # (b, H, pages, T, D)
        return k, v


def decode_attention(q, kv: _KVBatch, layer: int):
    """One decode step's attention at `layer` for the batch in `kv` (a ContiguousKV or PagedKV).
    q: (batch, heads, head_dim), any float dtype. Query head j reads KV head j // (heads /
    kv_heads). Returns (batch, heads, head_dim) fp32."""
    if not isinstance(kv, _KVBatch):
        raise BadArgument(f"kv must be a ContiguousKV or PagedKV, got {type(kv).__name__}")
    m = kv.model
    layer = count("layer", layer)
    if layer >= m.layers:
        raise BadArgument(f"layer {layer} of a {m.layers}-layer model")
    if tuple(q.shape) != (kv.batch, m.heads, m.head_dim):
        raise BadArgument(f"q must be (batch, heads, head_dim) = "
                          f"{(kv.batch, m.heads, m.head_dim)}, got {tuple(q.shape)}")
    b, H, D, T = kv.batch, m.kv_heads, m.head_dim, kv.window_tokens
    k, v = kv.gather(layer)
    _, kf, vf, scores = kv.workspace()
    kf = kf.view(k.shape).copy_(k).view(b, H, T, D)     # to fp32, in (b, H, T, D) order
    vf = vf.view(v.shape).copy_(v).view(b, H, T, D)
    qf = q.to(torch.float32).mul(1.0 / math.sqrt(D)).reshape(b, H, m.heads // H, D)
    scores = torch.matmul(qf, kf.transpose(-1, -2), out=scores)   # (b, H, group, T)
    if kv._any_invalid:
        # positions outside a context may hold anything (never-written pool bytes can be NaN):
        # their scores are masked and their values zeroed, since 0 x NaN would still be NaN
        scores.masked_fill_(kv._invalid[:, None, None, :], -math.inf)
        rows, positions = kv._invalid_at
        vf[rows, :, positions] = 0.0
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vf).reshape(b, m.heads, D)
