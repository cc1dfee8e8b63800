"""Attention over KV described by run tables: one kernel family for every KV layout.

THE LAYOUT. The KV pool is one flat 1-D tensor of the KV dtype (float32, bfloat16 or float16).
A *region* is a piece of it laid out head-major as [layers, 2 (K, V), kv_heads, cap, head_dim]
from element offset `off`, `cap` being the region's capacity in tokens: element (layer l,
c in {0: K, 1: V}, kv head h, token t, d) is at

    off + (((l * 2 + c) * KVH + h) * cap + t) * D + d.

A contiguous block is one region (cap = its capacity), an extent is one region, a page is one
region (cap = page_tokens). A request's KV is a sequence of RUNS in token order, each the first
`len` tokens of one region. A step's runs for a batch of B requests are a RunTable of device
tensors (CSR over requests):

    run_start int32 [B+1]  request b's runs are rows run_start[b] .. run_start[b+1]-1
    run_off   int64 [R]    the region's element offset
    run_cap   int32 [R]    the region's capacity (tokens): heads are cap * D elements apart
    run_len   int32 [R]    tokens of the run read this step (1 <= len <= cap)
    run_pos   int32 [R]    position of the run's first token in its request
    ctx_len   int32 [B]    request b's context, the sum of its run_len (0: a padded lane)

R may exceed run_start[B] (trailing rows unused: fixed-size buffers for CUDA graphs). New
tokens' K and V are stored through `slot` int64 [N] (the element offset of the token's
(layer 0, K, head 0) row, off + t * D; negative: skip) and `slot_cap` int64 [N] (its region's
cap), as vLLM's reshape_and_cache.

THE KERNELS (Triton; CUDA, or the CPU under TRITON_INTERPRET=1) are in
allocator/serving/engine/run_kernels.py: decode (flash-decoding over the runs, all G query heads
of a KV head in one program) and prefill (prompt chunks, causally masked); store_kv's is in
layer_kernels.py.

THE TORCH REFERENCE (the default path off CUDA): RunTable.gather_index() turns the run table
into a token-level index once per step (a handful of torch ops, no loop over requests), which
every layer reuses: per layer one gather gives padded K and V [B, KVH, Lmax, D] (positions
past a request's context read some real token, weighed 0), then scaled_dot_product_attention in
fp32 with a mask (decode: each request's context; prefill: causal as well). It needs no triton and syncs with
the host (it sizes its tensors from the tables), so it is not for CUDA graphs.
"""

from __future__ import annotations

import dataclasses

import torch

from odma_cli.errors import BadArgument

from allocator.serving.engine.layer_kernels import store_kv_triton
from allocator.serving.engine.run_kernels import (decode_triton, interpreting, prefill_triton,
                                                  triton_available)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TABLE_FIELDS = ("run_start", "run_off", "run_cap", "run_len", "run_pos", "ctx_len")


# ============================================================================ run tables
@dataclasses.dataclass(eq=False)
class RunTable:
    """One step's runs for a batch of B requests (see the module docstring). All tensors on the
    pool's device. `max_context` (optional, a fixed bound such as the model's context limit)
    caps the decode split count; `align` (elements) is a promise that every run_off is a
    multiple of it: the Triton kernels then tell the compiler so (gcd(align, head_dim), at most
    16 bytes' worth), for 16-byte vector loads. It matters: on an H100 the bf16 decode read
    2.1-2.7 TB/s with align 8, 1.0-1.7 with align 1. A wrong promise gives misaligned vector
    loads (wrong values or a fault): set it from what the allocator guarantees (regions at
    multiples of 16 bytes: 16 // element size), never from one step's offsets if a captured
    graph will replay other steps' tables."""

    run_start: torch.Tensor
    run_off: torch.Tensor
    run_cap: torch.Tensor
    run_len: torch.Tensor
    run_pos: torch.Tensor
    ctx_len: torch.Tensor
    max_context: int | None = None
    align: int = 1
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self):
        for name in TABLE_FIELDS:
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point():
                raise BadArgument(f"RunTable.{name} must be a 1-D integer tensor")
            if t.device != self.ctx_len.device:
                raise BadArgument(f"RunTable.{name} is on {t.device}, ctx_len on "
                                  f"{self.ctx_len.device}")
        if self.run_start.numel() != self.ctx_len.numel() + 1:
            raise BadArgument(f"run_start holds {self.run_start.numel()} entries for "
                              f"{self.ctx_len.numel()} requests (B + 1 expected)")

    @property
    def batch(self) -> int:
        return self.ctx_len.numel()

    @property
    def device(self) -> torch.device:
        return self.ctx_len.device

    @classmethod
    def from_requests(cls, requests, device="cpu", *, max_context=None, align=1,
                      spare_rows: int = 0) -> "RunTable":
        """A table from per-request lists of runs [(off, cap, tokens)] in token order (tests,
        benchmarks; `spare_rows` unused trailing rows)."""
        start, off, cap, length, pos, ctx = [0], [], [], [], [], []
        for runs in requests:
            p = 0
            for o, c, n in runs:
                if not 1 <= n <= c:
                    raise BadArgument(f"a run of {n} tokens in a region of {c}")
                off.append(o)
                cap.append(c)
                length.append(n)
                pos.append(p)
                p += n
            start.append(len(off))
            ctx.append(p)
        off += [0] * spare_rows
        cap += [1] * spare_rows
        length += [1] * spare_rows
        pos += [0] * spare_rows

        def t(x, dt):
            return torch.tensor(x, dtype=dt).to(device)
        i32 = torch.int32
        return cls(t(start, i32), t(off, torch.int64), t(cap, i32), t(length, i32),
                   t(pos, i32), t(ctx, i32), max_context=max_context, align=align)

    def validate(self, pool_numel: int, layers: int, kv_heads: int, head_dim: int) -> None:
        """Check the table against the contract (host sync; for tests and debugging):
        BadArgument with the first thing found wrong."""
        st = self.run_start.cpu().long()
        B = self.batch
        if st.numel() != B + 1 or st[0] != 0 or bool((st[1:] < st[:-1]).any()):
            raise BadArgument("run_start is not a CSR index of the batch")
        R = int(st[-1])
        if R > self.run_off.numel():
            raise BadArgument(f"run_start names {R} runs, the tables hold {self.run_off.numel()}")
        off = self.run_off[:R].cpu().long()
        cap = self.run_cap[:R].cpu().long()
        n = self.run_len[:R].cpu().long()
        pos = self.run_pos[:R].cpu().long()
        ctx = self.ctx_len.cpu().long()
        if bool(((n < 1) | (n > cap)).any()):
            raise BadArgument("a run of no tokens or of more than its region's capacity")
        if bool(((off < 0) | (off + layers * 2 * kv_heads * cap * head_dim > pool_numel)).any()):
            raise BadArgument("a region outside the pool")
        if self.align > 1 and bool((off % self.align != 0).any()):
            raise BadArgument(f"a run offset not a multiple of align={self.align}")
        req = torch.repeat_interleave(torch.arange(B), st[1:] - st[:-1])     # [R]
        before = torch.cumsum(n, 0) - n               # tokens of the batch before each run
        req_first = torch.cat((before, torch.zeros(1, dtype=torch.long)))[st[:-1]]  # [B]
        if bool((pos != before - req_first[req]).any()):
            raise BadArgument("run_pos is not the prefix sum of run_len within each request")
        total = torch.zeros(B, dtype=torch.long).index_add_(0, req, n)
        if bool((total != ctx).any()):
            raise BadArgument("ctx_len is not the sum of each request's run_len")

    def reset(self) -> None:
        """Forget the cached torch-path indexes (after changing the tables in place)."""
        self._cache.clear()

    def gather_index(self, kv_heads: int, head_dim: int) -> "GatherIndex":
        """The token-level index of the torch path for these tables, built once and cached."""
        key = ("gather", kv_heads, head_dim)
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = GatherIndex.build(self, kv_heads, head_dim)
        return got

    def query_index(self, q_start, q_len, q_pos, n_rows: int) -> "QueryIndex":
        """The torch path's padding of packed prompt-chunk queries, cached for the same
        (q_start, q_len, q_pos) tensors (the same objects: every layer of a step)."""
        got = self._cache.get("query")
        if got is not None and got[0] == (id(q_start), id(q_len), id(q_pos), n_rows):
            return got[2]
        qi = QueryIndex.build(self, q_start, q_len, q_pos, n_rows)
        self._cache["query"] = ((id(q_start), id(q_len), id(q_pos), n_rows),
                                (q_start, q_len, q_pos), qi)   # keep them alive: ids stay theirs
        return qi


@dataclasses.dataclass
class GatherIndex:
    """The torch path's per-step index: for request b and position p < L (the longest context
    of the step), the element offset of its (layer 0, c, kv head h) row, and the stride
    between layers."""

    idx0: torch.Tensor       # int64 [B, 2, KVH, L]; 0 where p >= ctx_len[b]
    layer_stride: torch.Tensor  # int64 [B, 1, 1, L]
    valid: torch.Tensor      # bool [B, L]
    length: int              # L
    rows: bool = False       # every offset a multiple of head_dim: idx0, layer_stride in rows
    # the step's K/V of one layer, gathered into the same memory for every layer: a fresh
    # tensor of tens of MB a layer costs the host its page faults, 3-4x the gather itself
    out: torch.Tensor | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def build(cls, runs: RunTable, kv_heads: int, head_dim: int) -> "GatherIndex":
        """Built on the host with numpy (the torch path syncs anyway, and a dozen numpy
        operations on a step's few thousand tokens cost a fraction of as many torch calls),
        then moved to the tables' device."""
        import numpy as np

        B, D = runs.batch, head_dim
        st = runs.run_start.cpu().numpy().astype(np.int64)
        ctx = runs.ctx_len.cpu().numpy().astype(np.int64)
        L = int(ctx.max()) if B else 0
        R = int(st[-1])
        n = runs.run_len[:R].cpu().numpy().astype(np.int64)
        off = runs.run_off[:R].cpu().numpy().astype(np.int64)
        cap = runs.run_cap[:R].cpu().numpy().astype(np.int64)
        first = runs.run_pos[:R].cpu().numpy().astype(np.int64)
        valid = np.arange(L)[None, :] < ctx[:, None]
        # whole rows of head_dim elements when every region starts on one (blocks and pages
        # do, at the allocator's alignment): a row gather moves head_dim times fewer indices
        rows = bool(R) and not (off % D).any()
        unit = D if rows else 1          # the index counts rows, else elements
        if R == B and B and not first.any() and (n == ctx).all() and ctx.all():
            # one run a request from its first token (a contiguous block): its tokens are
            # that run's rows in order, and past its context it reads its own first token
            base = off[:, None] // unit + np.where(valid, np.arange(L) * (D // unit), 0)
            capd = np.broadcast_to((cap * (D // unit))[:, None], (B, L))
        else:
            base, capd = cls._scattered(st, ctx, n, off, cap, first, valid, D)
            base, capd = base // unit, capd // unit
        ch = np.arange(2 * kv_heads).reshape(1, 2, kv_heads, 1)
        idx0 = base[:, None, None, :] + ch * capd[:, None, None, :]
        stride = (2 * kv_heads * capd)[:, None, None, :]
        dev = runs.device
        return cls(torch.from_numpy(idx0).to(dev), torch.from_numpy(stride).to(dev),
                   torch.from_numpy(valid).to(dev), L, rows=rows)

    @staticmethod
    def _scattered(st, ctx, n, off, cap, first, valid, D):
        """(base, capd) [B, L] of any table: each run's tokens scattered to their positions."""
        import numpy as np

        B, L = valid.shape
        R = off.size
        req = np.repeat(np.arange(B), st[1:] - st[:-1])
        tok_run = np.repeat(np.arange(R), n)
        t = np.arange(tok_run.size) - np.repeat(np.cumsum(n) - n, n)
        pos = first[tok_run] + t
        b = req[tok_run]
        keep = pos < ctx[b]            # a table that says more than ctx_len: ctx_len wins
        b, pos, tok_run, t = b[keep], pos[keep], tok_run[keep], t[keep]
        base = np.zeros((B, L), dtype=np.int64)
        capd = np.zeros((B, L), dtype=np.int64)
        base[b, pos] = off[tok_run] + t * D
        capd[b, pos] = cap[tok_run] * D
        if L:    # positions past a context read a real token (its request's first, else any
            # request's): finite values that the masks weigh 0, so nothing needs zeroing
            donor = np.where(ctx > 0, np.arange(B), ctx.argmax())
            base = np.where(valid, base, base[donor, :1])
            capd = np.where(valid, capd, capd[donor, :1])
        return base, capd

    def kv(self, pool: torch.Tensor, layer: int, head_dim: int):
        """(K, V), each [B, KVH, L, head_dim] in the pool's dtype; past each context, the
        values of some real token (finite: weigh them 0). Views of memory that the next call
        overwrites: use them before asking for another layer's."""
        idx = self.idx0 + self.layer_stride * layer if layer else self.idx0
        shape = (*idx.shape, head_dim)
        if self.out is None or self.out.dtype != pool.dtype or self.out.shape != shape:
            self.out = torch.empty(shape, dtype=pool.dtype, device=pool.device)
        flat = self.out.view(-1, head_dim)
        # index_select of a flat index: on a CPU a few times faster than indexing with the
        # [B, 2, KVH, L] index itself
        if self.rows:
            rows = pool[:pool.numel() // head_dim * head_dim].view(-1, head_dim)
            torch.index_select(rows, 0, idx.reshape(-1), out=flat)
        else:   # elements (rows of an overlapping strided view would copy the whole pool)
            at = idx[..., None] + torch.arange(head_dim, device=pool.device)
            torch.index_select(pool, 0, at.reshape(-1), out=flat.view(-1))
        return self.out[:, 0], self.out[:, 1]                          # [B, 2, KVH, L, D]


@dataclasses.dataclass
class QueryIndex:
    """The torch path's padding of packed queries: request b's i-th query is packed row
    rows[b, i] (n_rows, a spare row, where i >= q_len[b]) at position qpos[b, i]."""

    rows: torch.Tensor       # int64 [B, Qmax]
    qpos: torch.Tensor       # int64 [B, Qmax]
    qvalid: torch.Tensor     # bool [B, Qmax]
    qmax: int

    @classmethod
    def build(cls, runs, q_start, q_len, q_pos, n_rows):
        dev = runs.device
        q_len = q_len.to(dev).long()
        Qm = int(q_len.max()) if q_len.numel() else 0
        i = torch.arange(Qm, device=dev)[None, :]
        qvalid = i < q_len[:, None]
        rows = torch.where(qvalid, q_start.to(dev).long()[:, None] + i, n_rows)
        return cls(rows, q_pos.to(dev).long()[:, None] + i, qvalid, Qm)


# ============================================================================ backends
def attention_backend(device, prefer: str | None = None) -> str:
    """"triton" where `device` is CUDA and triton imports, else "torch"; prefer="torch" or
    "triton" forces one (BadArgument when triton is not installed, or the device is not CUDA
    and TRITON_INTERPRET=1 is not set)."""
    dev = torch.device(device)
    if prefer is None:
        return "triton" if dev.type == "cuda" and triton_available() else "torch"
    if prefer == "torch":
        return "torch"
    if prefer != "triton":
        raise BadArgument(f"unknown attention backend {prefer!r} (torch or triton)")
    if not triton_available():
        raise BadArgument("the triton attention backend needs triton, which does not import here")
    if dev.type != "cuda" and not interpreting():
        raise BadArgument(f"the triton attention backend runs on CUDA devices, not {dev.type} "
                          "(or on the CPU under TRITON_INTERPRET=1)")
    return "triton"


def _pick(backend, device) -> str:
    return attention_backend(device) if backend is None else attention_backend(device, backend)


def _check(q, pool, kv_heads, head_dim, what):
    if pool.dim() != 1:
        raise BadArgument(f"{what}: the pool must be a 1-D tensor, not {tuple(pool.shape)}")
    if pool.dtype not in _DTYPES:
        raise BadArgument(f"{what}: KV dtype {pool.dtype} (float32, bfloat16 or float16)")
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % kv_heads:
        raise BadArgument(f"{what}: q of shape {tuple(q.shape)} is not [rows, heads, {head_dim}] "
                          f"with heads a multiple of {kv_heads} kv heads")
    if q.device != pool.device:
        raise BadArgument(f"{what}: q on {q.device}, the pool on {pool.device}")


# ============================================================================ store
def store_kv(pool, k, v, slot, slot_cap, layer: int, kv_heads: int, head_dim: int, *,
             backend: str | None = None, align: int = 1, cache: dict | None = None) -> None:
    """Write k, v [N, kv_heads, head_dim] (the step's new tokens) into their slots for `layer`:
    token n's (layer, c, h) row goes to slot[n] + ((layer * 2 + c) * kv_heads + h) *
    slot_cap[n] * head_dim; slot[n] < 0 is skipped. The Triton path is device ops only (no
    host sync: a CUDA graph captures it); the torch path is one scatter, its index built once a
    step where the caller passes the same `cache` dict for every layer of the step, which reads
    back once whether every slot is kept. `align`: as RunTable.align, for the slots."""
    N = k.shape[0]
    if k.shape != (N, kv_heads, head_dim) or v.shape != k.shape:
        raise BadArgument(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, expected "
                          f"[N, {kv_heads}, {head_dim}]")
    if N == 0:
        return
    if _pick(backend, pool.device) == "triton":
        return store_kv_triton(pool, k, v, slot, slot_cap, layer, kv_heads, head_dim, align)
    index = cache.get("store") if cache is not None else None
    if index is None:
        index = StoreIndex.build(slot, slot_cap, kv_heads, head_dim)
        if cache is not None:
            cache["store"] = index
    index.put(pool, k, v, layer)


@dataclasses.dataclass
class StoreIndex:
    """The torch path's scatter index of a step's new tokens: the element offsets of each kept
    token's (layer 0, c, h, d) and the stride to the next layer."""

    keep: torch.Tensor | None     # bool [N], None when every token is stored
    idx0: torch.Tensor            # int64 [n, 2, KVH, D]
    stride: torch.Tensor          # int64 [n, 1, 1, 1]: elements between layers

    @classmethod
    def build(cls, slot, slot_cap, kv_heads: int, head_dim: int) -> "StoreIndex":
        keep = slot >= 0
        every = bool(keep.all())
        s, c = (slot, slot_cap.long()) if every else (slot[keep], slot_cap[keep].long())
        dev = slot.device
        ch = torch.arange(2 * kv_heads, device=dev).view(1, 2, kv_heads, 1)
        rows = (c * head_dim).view(-1, 1, 1, 1)
        idx0 = s.view(-1, 1, 1, 1) + ch * rows + torch.arange(head_dim, device=dev)
        return cls(None if every else keep, idx0, 2 * kv_heads * rows)

    def put(self, pool, k, v, layer: int) -> None:
        if self.keep is not None:
            k, v = k[self.keep], v[self.keep]
        idx = self.idx0 + self.stride * layer if layer else self.idx0
        pool[idx] = torch.stack((k, v), 1).to(pool.dtype)              # [n, 2, KVH, D]


# ============================================================================ torch reference
def _decode_torch(q, pool, runs, layer, kv_heads, head_dim, scale):
    B, H, D = q.shape
    G = H // kv_heads
    out = torch.zeros(B, H, D, dtype=torch.float32, device=q.device)
    gi = runs.gather_index(kv_heads, head_dim)
    if B == 0 or gi.length == 0:
        return out.to(q.dtype)
    K, V = gi.kv(pool, layer, head_dim)                                      # [B, KVH, L, D]
    # a request's G query heads of one kv head are SDPA's query rows of that head
    o = torch.nn.functional.scaled_dot_product_attention(
        q.float().reshape(B, kv_heads, G, D), K.float(), V.float(),
        attn_mask=gi.valid[:, None, None, :], scale=scale)                   # [B, KVH, G, D]
    return o.nan_to_num_(0.0).reshape(B, H, D).to(q.dtype)                   # ctx 0: zeros


def _prefill_torch(q, pool, runs, q_start, q_len, q_pos, layer, kv_heads, head_dim, scale):
    Nq, H, D = q.shape
    B = runs.batch
    gi = runs.gather_index(kv_heads, head_dim)
    qi = runs.query_index(q_start, q_len, q_pos, Nq)
    out = torch.zeros(Nq + 1, H, D, dtype=q.dtype, device=q.device)          # + a spare row
    if Nq == 0 or B == 0 or gi.length == 0 or qi.qmax == 0:
        return out[:Nq]
    K, V = gi.kv(pool, layer, head_dim)
    qpad = torch.cat((q, q.new_zeros(1, H, D)))[qi.rows]                     # [B, Qm, H, D]
    kpos = torch.arange(gi.length, device=q.device)
    allowed = gi.valid[:, None, :] & (kpos[None, None, :] <= qi.qpos[:, :, None])  # [B, Qm, L]
    o = torch.nn.functional.scaled_dot_product_attention(
        qpad.transpose(1, 2).float(), K.float(), V.float(), attn_mask=allowed[:, None],
        scale=scale, enable_gqa=True)                                         # [B, H, Qm, D]
    o = torch.where(allowed.any(-1)[:, None, :, None], o, 0.0)               # no NaN rows
    out[qi.rows] = o.transpose(1, 2).to(q.dtype)
    return out[:Nq]


def decode_attention_torch(q, pool, runs, layer, kv_heads, head_dim, scale):
    """The torch reference of decode_attention."""
    _check(q, pool, kv_heads, head_dim, "decode_attention")
    return _decode_torch(q, pool, runs, layer, kv_heads, head_dim, scale)


def prefill_attention_torch(q, pool, runs, q_start, q_len, q_pos, layer, kv_heads, head_dim,
                            scale):
    """The torch reference of prefill_attention."""
    _check(q, pool, kv_heads, head_dim, "prefill_attention")
    return _prefill_torch(q, pool, runs, q_start, q_len, q_pos, layer, kv_heads, head_dim,
                          scale)


# ============================================================================ public entry points
def decode_attention(q, pool, runs: RunTable, layer: int, kv_heads: int, head_dim: int,
                     scale: float, out=None, *, backend: str | None = None,
                     num_splits: int | None = None, config: dict | None = None):
    """One query token per request: q [B, H, D] (H = G * kv_heads; query head j reads kv head
    j // G), over request b's runs in `runs` (B = runs.batch) at `layer`; [B, H, D] in q's dtype
    (written into `out` when given). fp32 accumulation, online softmax; a request with no
    context gets zeros. backend: None (attention_backend(q.device)), "torch" or "triton";
    num_splits overrides decode_splits; config overrides the Triton kernel's tiles
    (_decode_config: BLOCK_N, num_warps, num_stages, MIN_SPLIT) for tests and benchmarks."""
    _check(q, pool, kv_heads, head_dim, "decode_attention")
    if q.shape[0] != runs.batch:
        raise BadArgument(f"decode_attention: {q.shape[0]} queries, {runs.batch} requests")
    if _pick(backend, q.device) == "triton":
        return decode_triton(q, pool, runs, layer, kv_heads, head_dim, scale, out, num_splits,
                              config)
    res = _decode_torch(q, pool, runs, layer, kv_heads, head_dim, scale)
    if out is None:
        return res
    out.copy_(res)
    return out


def prefill_attention(q, pool, runs: RunTable, q_start, q_len, q_pos, layer: int,
                      kv_heads: int, head_dim: int, scale: float, out=None, *,
                      backend: str | None = None, max_q_len: int | None = None,
                      config: dict | None = None):
    """Prompt chunks: q packed [Nq, H, D]; request b's queries are rows q_start[b] ..
    q_start[b] + q_len[b] - 1 at positions q_pos[b] .. q_pos[b] + q_len[b] - 1 (int32 device
    tensors [B]); each attends causally over the request's KV positions <= its own (its chunk's
    K/V already stored). [Nq, H, D] in q's dtype, rows no request names zeros; written into `out`
    when given (such rows then unspecified). The Triton grid depends on max(q_len): pass
    max_q_len to spare the host sync. config overrides the Triton kernel's tiles
    (_prefill_config: BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    _check(q, pool, kv_heads, head_dim, "prefill_attention")
    if not q_start.numel() == q_len.numel() == q_pos.numel() == runs.batch:
        raise BadArgument(f"prefill_attention: q_start, q_len, q_pos of {q_start.numel()}, "
                          f"{q_len.numel()}, {q_pos.numel()} requests, the runs of "
                          f"{runs.batch}")
    if _pick(backend, q.device) == "triton":
        return prefill_triton(q, pool, runs, q_start, q_len, q_pos, layer, kv_heads, head_dim,
                               scale, max_q_len, config, out)
    res = _prefill_torch(q, pool, runs, q_start, q_len, q_pos, layer, kv_heads, head_dim,
                         scale)
    if out is None:
        return res
    out.copy_(res)
    return out


