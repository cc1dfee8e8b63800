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

THE KERNELS (Triton; CUDA, or the CPU under TRITON_INTERPRET=1):

- store_kv: grid (N,): a program writes one token's K and V rows of every kv head.
- decode: grid (B, KVH, S). A program takes one request, one kv head and one split of the
  request's context, and handles all G = H / KVH query heads of that kv head at once (the
  query block is [G padded to 16, D], one tl.dot per tile), so every KV byte is read once per
  step, not G times. Split s covers positions [s * chunk, (s + 1) * chunk), chunk =
  max(MIN_SPLIT_TOKENS, cdiv(ctx, S) rounded up to whole tiles), computed in the kernel from
  ctx_len: S itself depends only on the batch size, KVH and the device's multiprocessor count
  (and on RunTable.max_context when given), never on the step's data, so the launch is
  CUDA-graph capturable (no host sync). Splits past the end of a short context read no KV. With S > 1 each split writes its
  partial (max, sum, acc) in fp32 and a second small kernel (grid (B, H)) combines them.
- prefill: grid (B, query tiles, KVH): a program takes BLOCK_M rows of (query token, query
  head) pairs of one request and one kv head (BLOCK_M // G tokens x G heads), so again the
  K/V tiles are shared by the G heads; it walks the request's KV from position 0 to the tile's
  last query position, causally masked.

Both attention kernels walk the context in tiles of BLOCK_N consecutive token positions. A
tile may span several runs (pages of 16 or of 1 token), so every lane finds its own run: a
branch-free binary search (binary lifting, log2(BLOCK_N) steps of gathers of run_pos) over
the window [r0, r0 + BLOCK_N) of runs, r0 being the run holding the tile's first position
(BLOCK_N positions can span at most BLOCK_N runs since a run holds >= 1 token). r0 is carried
from tile to tile (the last lane's run, plus one if the next position starts a new run), and
found once per program for the split's first position by a scalar binary search over the
request's runs (O(log R) dependent scalar loads, 12 at 4,096 one-token pages, where a linear
skip would read O(R / BLOCK_N) vectors of run_pos, 32 there, before the first tile). The same
code runs for every layout: for one run per request the lookups fall outside the request's
runs and are masked away; the cost that grows with the number of runs is the metadata
gathers, which is the layout's own. Softmax is online (exp2, fp32 running max, sum and
accumulator), with bf16/fp16 tiles fed to tl.dot and fp32 tiles at IEEE precision (no TF32).
Decode tiles are 128 tokens, 4 warps (_decode_config); on an H100, bf16, the decode read
2.5-2.7 TB/s of KV with one run per request, 0.86-0.95 of that over 16-token pages and
0.77-0.87 over 1-token pages (bench/bench_run_attention.py).

THE TORCH REFERENCE (the default path off CUDA): RunTable.gather_index() turns the run table
into a token-level index once per step (a handful of torch ops, no loop over requests), which
every layer reuses: per layer one gather gives padded K and V [B, KVH, Lmax, D] (positions
past a request's context read some real token, weighed 0), then a masked softmax in fp32 (decode) or
scaled_dot_product_attention with a causal mask (prefill). It needs no triton and syncs with
the host (it sizes its tensors from the tables), so it is not for CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import torch

from odma_hw.errors import BadArgument

# decode split heuristics (see decode_splits)
MIN_SPLIT_TOKENS = 256      # a split takes at least this many positions (a multiple of BLOCK_N)
MAX_SPLITS = 16
PROGRAMS_PER_SM = 4         # aim for about this many decode programs per multiprocessor
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
        req = np.repeat(np.arange(B), st[1:] - st[:-1])
        tok_run = np.repeat(np.arange(R), n)
        t = np.arange(tok_run.size) - np.repeat(np.cumsum(n) - n, n)
        pos = runs.run_pos[:R].cpu().numpy().astype(np.int64)[tok_run] + t
        b = req[tok_run]
        keep = pos < ctx[b]            # a table that says more than ctx_len: ctx_len wins
        b, pos, tok_run, t = b[keep], pos[keep], tok_run[keep], t[keep]
        base = np.zeros((B, L), dtype=np.int64)
        capd = np.zeros((B, L), dtype=np.int64)
        base[b, pos] = off[tok_run] + t * D
        capd[b, pos] = cap[tok_run] * D
        valid = np.arange(L)[None, :] < ctx[:, None]
        if L:    # positions past a context read a real token (its request's first, else any
            # request's): finite values that the masks weigh 0, so nothing needs zeroing
            donor = np.where(ctx > 0, np.arange(B), ctx.argmax())
            base = np.where(valid, base, base[donor, :1])
            capd = np.where(valid, capd, capd[donor, :1])
        ch = np.arange(2 * kv_heads).reshape(1, 2, kv_heads, 1)
        idx0 = base[:, None, None, :] + ch * capd[:, None, None, :]
        stride = (2 * kv_heads * capd)[:, None, None, :]
        # whole rows of head_dim elements when every region starts on one (blocks and pages
        # do, at the allocator's alignment): a row gather moves head_dim times fewer indices
        rows = bool(R) and not (off % D).any()
        if rows:
            idx0, stride = idx0 // D, stride // D
        dev = runs.device
        return cls(torch.from_numpy(idx0).to(dev), torch.from_numpy(stride).to(dev),
                   torch.from_numpy(valid).to(dev), L, rows=rows)

    def kv(self, pool: torch.Tensor, layer: int, head_dim: int):
        """(K, V), each [B, KVH, L, head_dim] in the pool's dtype; past each context, the
        values of some real token (finite: weigh them 0)."""
        idx = self.idx0 + self.layer_stride * layer if layer else self.idx0
        if self.rows:
            kv = pool[:pool.numel() // head_dim * head_dim].view(-1, head_dim)[idx]
        else:   # elements (rows of an overlapping strided view would copy the whole pool)
            kv = pool[idx[..., None] + torch.arange(head_dim, device=pool.device)]
        return kv[:, 0], kv[:, 1]                                      # [B, 2, KVH, L, D]


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
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:           # ImportError, or a broken install
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def attention_backend(device, prefer: str | None = None) -> str:
    """"triton" where `device` is CUDA and triton imports, else "torch"; prefer="torch" or
    "triton" forces one (BadArgument when triton is not installed, or the device is not CUDA
    and TRITON_INTERPRET=1 is not set)."""
    dev = torch.device(device)
    if prefer is None:
        return "triton" if dev.type == "cuda" and _triton_available() else "torch"
    if prefer == "torch":
        return "torch"
    if prefer != "triton":
        raise BadArgument(f"unknown attention backend {prefer!r} (torch or triton)")
    if not _triton_available():
        raise BadArgument("the triton attention backend needs triton, which does not import here")
    if dev.type != "cuda" and not _interpreting():
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
             backend: str | None = None, align: int = 1) -> None:
    """Write k, v [N, kv_heads, head_dim] (the step's new tokens) into their slots for `layer`:
    token n's (layer, c, h) row goes to slot[n] + ((layer * 2 + c) * kv_heads + h) *
    slot_cap[n] * head_dim; slot[n] < 0 is skipped. Device ops only on CUDA (no host sync);
    on the torch path one scatter. `align`: as RunTable.align, for the slots."""
    N = k.shape[0]
    if k.shape != (N, kv_heads, head_dim) or v.shape != k.shape:
        raise BadArgument(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, expected "
                          f"[N, {kv_heads}, {head_dim}]")
    if N == 0:
        return
    if _pick(backend, pool.device) == "triton":
        return _store_kv_triton(pool, k, v, slot, slot_cap, layer, kv_heads, head_dim, align)
    keep = slot >= 0
    s, c = slot[keep], slot_cap[keep].long()
    vals = torch.stack((k[keep], v[keep]), 1).to(pool.dtype)                # [n, 2, KVH, D]
    ch = layer * 2 * kv_heads + torch.arange(2 * kv_heads, device=pool.device).view(
        1, 2, kv_heads, 1)
    idx = (s.view(-1, 1, 1, 1) + ch * (c * head_dim).view(-1, 1, 1, 1)
           + torch.arange(head_dim, device=pool.device))
    pool[idx] = vals


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
        return _decode_triton(q, pool, runs, layer, kv_heads, head_dim, scale, out, num_splits,
                              config)
    res = _decode_torch(q, pool, runs, layer, kv_heads, head_dim, scale)
    if out is None:
        return res
    out.copy_(res)
    return out


def prefill_attention(q, pool, runs: RunTable, q_start, q_len, q_pos, layer: int,
                      kv_heads: int, head_dim: int, scale: float, *,
                      backend: str | None = None, max_q_len: int | None = None,
                      config: dict | None = None):
    """Prompt chunks: q packed [Nq, H, D]; request b's queries are rows q_start[b] ..
    q_start[b] + q_len[b] - 1 at positions q_pos[b] .. q_pos[b] + q_len[b] - 1 (int32 device
    tensors [B]); each attends causally over the request's KV positions <= its own (its chunk's
    K/V already stored). [Nq, H, D] in q's dtype; rows no request names are zeros. The Triton
    grid depends on max(q_len): pass max_q_len to spare the host sync. config overrides the
    Triton kernel's tiles (_prefill_config: BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    _check(q, pool, kv_heads, head_dim, "prefill_attention")
    if not q_start.numel() == q_len.numel() == q_pos.numel() == runs.batch:
        raise BadArgument(f"prefill_attention: q_start, q_len, q_pos of {q_start.numel()}, "
                          f"{q_len.numel()}, {q_pos.numel()} requests, the runs of "
                          f"{runs.batch}")
    if _pick(backend, q.device) == "triton":
        return _prefill_triton(q, pool, runs, q_start, q_len, q_pos, layer, kv_heads, head_dim,
                               scale, max_q_len, config)
    return _prefill_torch(q, pool, runs, q_start, q_len, q_pos, layer, kv_heads, head_dim,
                          scale)


# ============================================================================ Triton
def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_splits(batch: int, kv_heads: int, max_context: int | None = None,
                  device=None) -> int:
    """The decode kernel's split count: enough programs (batch x kv_heads x splits) to give
    every multiprocessor PROGRAMS_PER_SM of them, at most MAX_SPLITS, and no more than
    max_context / MIN_SPLIT_TOKENS when a bound on the context is known. A function of fixed
    things only (batch size, geometry, device), so a captured graph's launch stays valid."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        sms = _sm_count(dev.index if dev.index is not None else torch.cuda.current_device())
    else:
        sms = 32
    s = -(-sms * PROGRAMS_PER_SM // max(1, batch * kv_heads))
    if max_context is not None:
        s = min(s, -(-max(1, max_context) // MIN_SPLIT_TOKENS))
    return max(1, min(MAX_SPLITS, s))


def _decode_config(head_dim: int, dtype) -> dict:
    """Tile sizes and warps of the decode kernel; MIN_SPLIT: the fewest positions a split
    takes (rounded up to whole tiles). From `python bench/bench_run_attention.py --sweep` on an
    H100 (bf16, head_dim 64 and 128, contiguous and 16-token pages): 128-token tiles, 4 warps,
    no software pipelining gave 2.4-2.7 TB/s, 64-token tiles 1.5-2.4."""
    return dict(BLOCK_N=128, num_warps=4, num_stages=1, MIN_SPLIT=MIN_SPLIT_TOKENS)


def _prefill_config(head_dim: int, group: int) -> dict:
    block_m = max(64, _next_pow2(group))
    return dict(BLOCK_M=block_m, BLOCK_N=64 if head_dim <= 64 else 32, num_warps=4,
                num_stages=2)


def _align_of(align: int, head_dim: int, element_size: int) -> int:
    a = math.gcd(max(1, int(align)), head_dim)
    return math.gcd(a, max(1, 16 // element_size))


def _tl_dtypes(pool, interp):
    """(dot precision, upcast tiles to fp32 before tl.dot): the interpreter of triton 3.6
    multiplies bf16 tiles as raw integers, so there they are widened (values already rounded
    to bf16, so the products are the same)."""
    prec = "ieee" if pool.dtype == torch.float32 else "tf32"
    return prec, bool(interp and pool.dtype != torch.float32)


def _store_kv_triton(pool, k, v, slot, slot_cap, layer, kv_heads, head_dim, align):
    kern = _kernels(_interpreting())
    N = k.shape[0]
    kern["store"][(N,)](
        pool, k, v, slot, slot_cap,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        layer, KVH=kv_heads, D=head_dim, BLOCK_H=_next_pow2(kv_heads),
        BLOCK_D=_next_pow2(head_dim), ALIGN=_align_of(align, head_dim, pool.element_size()),
        num_warps=1 if kv_heads * head_dim <= 256 else 4)


def _decode_triton(q, pool, runs, layer, kv_heads, head_dim, scale, out, num_splits,
                   config=None):
    interp = _interpreting()
    kern = _kernels(interp)
    B, H, D = q.shape
    G = H // kv_heads
    if out is None:
        out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    cfg = dict(_decode_config(head_dim, pool.dtype), **(config or {}))
    S = num_splits or decode_splits(B, kv_heads, runs.max_context, q.device)
    block_n = cfg["BLOCK_N"]
    min_chunk = -(-cfg["MIN_SPLIT"] // block_n) * block_n
    prec, upcast = _tl_dtypes(pool, interp)
    if S > 1:
        part_m = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(B, H, S, D, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out            # unused
    kern["decode"][(B, kv_heads, S)](
        q, pool, runs.run_start, runs.run_off, runs.run_cap, runs.run_pos, runs.ctx_len,
        out, part_m, part_l, part_acc,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        layer, float(scale) * 1.4426950408889634,
        H=H, KVH=kv_heads, G=G, D=D, S=S, MIN_CHUNK=min_chunk if S > 1 else 0,
        BLOCK_G=max(16, _next_pow2(G)), BLOCK_D=max(16, _next_pow2(D)), BLOCK_N=block_n,
        LOG_N=block_n.bit_length() - 1,
        ALIGN=_align_of(runs.align, head_dim, pool.element_size()), DIRECT=S == 1, PREC=prec,
        UPCAST=upcast, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if S > 1:
        kern["combine"][(B, H)](
            part_m, part_l, part_acc, out, out.stride(0), out.stride(1), out.stride(2),
            H=H, D=D, S=S, BLOCK_S=_next_pow2(S), BLOCK_D=_next_pow2(D), num_warps=1)
    return out


def _prefill_triton(q, pool, runs, q_start, q_len, q_pos, layer, kv_heads, head_dim, scale,
                    max_q_len, config=None):
    interp = _interpreting()
    kern = _kernels(interp)
    Nq, H, D = q.shape
    G = H // kv_heads
    B = runs.batch
    out = torch.zeros(Nq, H, D, dtype=q.dtype, device=q.device)
    if Nq == 0 or B == 0:
        return out
    cfg = dict(_prefill_config(head_dim, G), **(config or {}))
    tok = cfg["BLOCK_M"] // G
    qmax = int(q_len.max()) if max_q_len is None else int(max_q_len)
    tiles = -(-qmax // tok)
    if tiles == 0:
        return out
    prec, upcast = _tl_dtypes(pool, interp)
    block_n = cfg["BLOCK_N"]
    kern["prefill"][(B, tiles, kv_heads)](
        q, pool, runs.run_start, runs.run_off, runs.run_cap, runs.run_pos, runs.ctx_len,
        q_start, q_len, q_pos, out,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        layer, float(scale) * 1.4426950408889634,
        KVH=kv_heads, G=G, D=D, TOK=tok, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_D=max(16, _next_pow2(D)), BLOCK_N=block_n, LOG_N=block_n.bit_length() - 1,
        ALIGN=_align_of(runs.align, head_dim, pool.element_size()), PREC=prec, UPCAST=upcast,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


# The kernels below are plain functions, decorated with triton.jit only on first use
# (_kernels): triton decides at decoration time whether a kernel is compiled or interpreted
# (TRITON_INTERPRET), so decorating at import would fix the mode for whoever imported first.
# They call no helper functions (a helper is a global the compiled and interpreted kernels
# would have to share): the run lookup is written out in both attention kernels. Nor do they
# call triton's library functions (tl.max, tl.sum, tl.cdiv, tl.zeros: @jit functions of
# triton.language.standard, decorated in whichever mode was in force when triton was first
# imported, so compiled-mode ones if anything imported triton before TRITON_INTERPRET=1 was
# set; and each interpreted call of one re-patches the language, slowly): reductions are
# tl.reduce with the library's own combine functions, which is what tl.max and tl.sum
# compile to for fp32 and int32, and which the interpreter recognises and runs in numpy.

@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool) -> dict:
    if not _triton_available():
        raise BadArgument("the triton attention backend needs triton, which does not import here")
    import triton.language as tl_mod
    globals()["tl"] = tl_mod
    if interpret:
        _fix_interpreter()
        from triton.runtime.interpreter import InterpretedFunction as make
    else:
        from triton.runtime.jit import JITFunction as make
    return {name: make(fn) for name, fn in (
        ("store", _store_kv_kernel), ("decode", _decode_kernel),
        ("combine", _combine_kernel), ("prefill", _prefill_kernel))}


def _fix_interpreter() -> None:
    """triton 3.6's interpreter holds a scalar as a 1-element array and makes a Python int of
    it with int(array), which numpy >= 2.4 refuses for anything but 0-d arrays (a loop over
    range(lo, hi) with loaded bounds fails). While an interpreted kernel runs (inside the
    interpreter's own patch scope, undone with it), its __index__ takes the one element."""
    from triton.runtime import interpreter
    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_odma_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    patched._odma_fixed = True
    interpreter._patch_lang_tensor = patched


tl = None   # triton.language, set by _kernels (annotations are strings: never evaluated)


def _store_kv_kernel(pool_ptr, k_ptr, v_ptr, slot_ptr, slot_cap_ptr,
                     sk_n, sk_h, sk_d, sv_n, sv_h, sv_d, layer,
                     KVH: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, ALIGN: tl.constexpr):
    n = tl.program_id(0)
    slot = tl.load(slot_ptr + n)
    cap = tl.load(slot_cap_ptr + n).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (slot >= 0) & (offs_h[:, None] < KVH) & (offs_d[None, :] < D)
    k = tl.load(k_ptr + n * sk_n + offs_h[:, None] * sk_h + offs_d[None, :] * sk_d, mask=mask)
    v = tl.load(v_ptr + n * sv_n + offs_h[:, None] * sv_h + offs_d[None, :] * sv_d, mask=mask)
    krow = slot + (layer * 2 * KVH + offs_h) * cap * D
    vrow = krow + KVH * cap * D
    if ALIGN > 1:
        krow = tl.multiple_of(krow, ALIGN)
        vrow = tl.multiple_of(vrow, ALIGN)
    ty = pool_ptr.dtype.element_ty
    tl.store(pool_ptr + krow[:, None] + offs_d[None, :], k.to(ty), mask=mask)
    tl.store(pool_ptr + vrow[:, None] + offs_d[None, :], v.to(ty), mask=mask)


def _decode_kernel(q_ptr, pool_ptr, run_start_ptr, run_off_ptr, run_cap_ptr, run_pos_ptr,
                   ctx_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                   sq_b, sq_h, sq_d, so_b, so_h, so_d, layer, qk_scale,
                   H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                   S: tl.constexpr, MIN_CHUNK: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, LOG_N: tl.constexpr,
                   ALIGN: tl.constexpr, DIRECT: tl.constexpr, PREC: tl.constexpr,
                   UPCAST: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    gmask = offs_g < G
    dmask = offs_d < D
    heads = h * G + offs_g
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + heads[:, None] * sq_h + offs_d[None, :] * sq_d,
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    kv_ty = pool_ptr.dtype.element_ty
    q = q.to(kv_ty)
    if UPCAST:
        q = q.to(tl.float32)

    # this split's positions [lo, hi) of the request's context
    ctx = tl.load(ctx_ptr + b)
    chunk = ((ctx + S - 1) // S + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    chunk = tl.maximum(chunk, MIN_CHUNK)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, ctx)

    # r0: the run holding position lo (scalar binary search over the request's runs)
    r_end = tl.load(run_start_ptr + b + 1)
    a = tl.load(run_start_ptr + b)
    z = r_end
    while z - a > 1:
        mid = (a + z) // 2
        go = tl.load(run_pos_ptr + mid) <= lo
        a = tl.where(go, mid, a)
        z = tl.where(go, z, mid)
    r0 = a

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    head_k = (layer * 2 * KVH + h).to(tl.int64)
    for p in range(lo, hi, BLOCK_N):
        pos = p + offs_n
        valid = pos < hi
        # each lane's run: the last r in [r0, r0 + BLOCK_N) with run_pos[r] <= pos
        r = tl.full([BLOCK_N], 0, tl.int32) + r0
        for i in tl.static_range(LOG_N):
            mid = r + (BLOCK_N >> (i + 1))
            ok = valid & (mid < r_end)
            go = ok & (tl.load(run_pos_ptr + mid, mask=ok, other=0) <= pos)
            r = tl.where(go, mid, r)
        first = tl.load(run_pos_ptr + r, mask=valid, other=0)
        off = tl.load(run_off_ptr + r, mask=valid, other=0)
        cap = tl.load(run_cap_ptr + r, mask=valid, other=0).to(tl.int64)
        krow = off + (head_k * cap + (pos - first)) * D
        vrow = krow + KVH * cap * D
        if ALIGN > 1:
            krow = tl.multiple_of(krow, ALIGN)
            vrow = tl.multiple_of(vrow, ALIGN)
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(pool_ptr + krow[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale      # [BLOCK_G, BLOCK_N]
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(qk, 1, tl.standard._elementwise_max))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        pexp = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.reduce(pexp, 1, tl.standard._sum_combine)
        v = tl.load(pool_ptr + vrow[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        pv = pexp.to(kv_ty)
        if UPCAST:
            v = v.to(tl.float32)
            pv = pv.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PREC)
        m_i = m_new
        # the next tile's first run: this tile's last run, or the one after it
        r_last = tl.reduce(tl.where(valid, r, r0), 0, tl.standard._elementwise_max)
        nxt = tl.load(run_pos_ptr + r_last + 1, mask=r_last + 1 < r_end, other=0x7FFFFFFF)
        r0 = r_last + (nxt <= p + BLOCK_N).to(tl.int32)

    if DIRECT:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b.to(tl.int64) * so_b + heads[:, None] * so_h + offs_d[None, :] * so_d,
                 o.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
    else:
        row = (b * H + heads) * S + s
        tl.store(part_m_ptr + row, m_i, mask=gmask)
        tl.store(part_l_ptr + row, l_i, mask=gmask)
        tl.store(part_acc_ptr + row.to(tl.int64)[:, None] * D + offs_d[None, :], acc,
                 mask=gmask[:, None] & dmask[None, :])


def _combine_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, so_b, so_h, so_d,
                    H: tl.constexpr, D: tl.constexpr, S: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < S
    dmask = offs_d < D
    row = (b * H + hq) * S + offs_s
    m = tl.load(part_m_ptr + row, mask=smask, other=float("-inf"))
    l = tl.load(part_l_ptr + row, mask=smask, other=0.0)
    m_top = tl.reduce(m, 0, tl.standard._elementwise_max)
    m_top = tl.where(m_top == float("-inf"), 0.0, m_top)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_top), 0.0)
    total = tl.reduce(w * l, 0, tl.standard._sum_combine)
    acc = tl.load(part_acc_ptr + row.to(tl.int64)[:, None] * D + offs_d[None, :],
                  mask=smask[:, None] & dmask[None, :], other=0.0)
    o = tl.reduce(acc * w[:, None], 0, tl.standard._sum_combine) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * so_b + hq * so_h + offs_d * so_d,
             o.to(out_ptr.dtype.element_ty), mask=dmask)


def _prefill_kernel(q_ptr, pool_ptr, run_start_ptr, run_off_ptr, run_cap_ptr, run_pos_ptr,
                    ctx_ptr, q_start_ptr, q_len_ptr, q_pos_ptr, out_ptr,
                    sq_n, sq_h, sq_d, so_n, so_h, so_d, layer, qk_scale,
                    KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, TOK: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    LOG_N: tl.constexpr, ALIGN: tl.constexpr, PREC: tl.constexpr,
                    UPCAST: tl.constexpr):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    # rows are (query token, query head) pairs: TOK tokens x G heads of kv head h
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    dmask = offs_d < D
    t_in = offs_m // G
    heads = h * G + offs_m % G
    tok = tile * TOK + t_in
    qn = tl.load(q_len_ptr + b)
    rvalid = (t_in < TOK) & (tok < qn)
    qrow = (tl.load(q_start_ptr + b) + tok).to(tl.int64)
    qpos = tl.where(rvalid, tl.load(q_pos_ptr + b) + tok, 0)
    qmask = rvalid[:, None] & dmask[None, :]
    q = tl.load(q_ptr + qrow[:, None] * sq_n + heads[:, None] * sq_h + offs_d[None, :] * sq_d,
                mask=qmask, other=0.0)
    kv_ty = pool_ptr.dtype.element_ty
    q = q.to(kv_ty)
    if UPCAST:
        q = q.to(tl.float32)

    ctx = tl.load(ctx_ptr + b)
    hi = tl.minimum(ctx, tl.reduce(tl.where(rvalid, qpos + 1, 0), 0, tl.standard._elementwise_max))
    r0 = tl.load(run_start_ptr + b)
    r_end = tl.load(run_start_ptr + b + 1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    head_k = (layer * 2 * KVH + h).to(tl.int64)
    for p in range(0, hi, BLOCK_N):
        pos = p + offs_n
        valid = pos < hi
        r = tl.full([BLOCK_N], 0, tl.int32) + r0
        for i in tl.static_range(LOG_N):
            mid = r + (BLOCK_N >> (i + 1))
            ok = valid & (mid < r_end)
            go = ok & (tl.load(run_pos_ptr + mid, mask=ok, other=0) <= pos)
            r = tl.where(go, mid, r)
        first = tl.load(run_pos_ptr + r, mask=valid, other=0)
        off = tl.load(run_off_ptr + r, mask=valid, other=0)
        cap = tl.load(run_cap_ptr + r, mask=valid, other=0).to(tl.int64)
        krow = off + (head_k * cap + (pos - first)) * D
        vrow = krow + KVH * cap * D
        if ALIGN > 1:
            krow = tl.multiple_of(krow, ALIGN)
            vrow = tl.multiple_of(vrow, ALIGN)
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(pool_ptr + krow[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale      # [BLOCK_M, BLOCK_N]
        allowed = valid[None, :] & (pos[None, :] <= qpos[:, None])
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(qk, 1, tl.standard._elementwise_max))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        pexp = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.reduce(pexp, 1, tl.standard._sum_combine)
        v = tl.load(pool_ptr + vrow[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        pv = pexp.to(kv_ty)
        if UPCAST:
            v = v.to(tl.float32)
            pv = pv.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PREC)
        m_i = m_new
        r_last = tl.reduce(tl.where(valid, r, r0), 0, tl.standard._elementwise_max)
        nxt = tl.load(run_pos_ptr + r_last + 1, mask=r_last + 1 < r_end, other=0x7FFFFFFF)
        r0 = r_last + (nxt <= p + BLOCK_N).to(tl.int32)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + qrow[:, None] * so_n + heads[:, None] * so_h + offs_d[None, :] * so_d,
             o.to(out_ptr.dtype.element_ty), mask=qmask)
