"""The Triton kernels of the run-table attention (allocator/serving/engine/run_attention.py holds the
tables, the contract and the torch reference); launched on CUDA, or on the CPU under
TRITON_INTERPRET=1.

- decode: grid (B, KVH, S). A program takes one request, one kv head and one split of the
  request's context, and handles all G = H / KVH query heads of that kv head at once (the
  query block is [G padded to 16, D], one tl.dot per tile), so every KV byte is read once per
  step, not G times. Split s covers positions [s * chunk, (s + 1) * chunk), chunk =
  max(MIN_SPLIT_TOKENS, cdiv(ctx, S) rounded up to whole tiles), computed in the kernel from
  ctx_len: S itself depends only on the batch size, KVH and the device's multiprocessor count
  (and on RunTable.max_context when given), never on the step's data, so the launch is
  CUDA-graph capturable (no host sync). Splits past the end of a short context read no KV.
  With S > 1 each split writes its partial (max, sum, acc) in fp32 and a second small kernel
  (grid (B, H)) combines them.
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

The kernels that store a step's K and V and run a decoder layer around the attention
(layer_kernels.py) are made by the same kernels(), so that both modes keep their own copies of
them too.
"""

from __future__ import annotations

import functools
import math
import os
import types

import torch

from odma_cli.errors import BadArgument

# decode split heuristics (see decode_splits)
MIN_SPLIT_TOKENS = 256      # a split takes at least this many positions (a multiple of BLOCK_N)
MAX_SPLITS = 16
PROGRAMS_PER_SM = 4         # aim for about this many decode programs per multiprocessor


def triton_available() -> bool:
    """Whether triton (and triton.language) imports here."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:           # ImportError, or a broken install
        return False
    return True


def interpreting() -> bool:
    """Whether TRITON_INTERPRET asks for the interpreter (read at each launch: the kernels are
    decorated for the mode in force)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def next_pow2(x: int) -> int:
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
    block_m = max(64, next_pow2(group))
    return dict(BLOCK_M=block_m, BLOCK_N=64 if head_dim <= 64 else 32, num_warps=4,
                num_stages=2)


def align_of(align: int, head_dim: int, element_size: int) -> int:
    a = math.gcd(max(1, int(align)), head_dim)
    return math.gcd(a, max(1, 16 // element_size))


def _tl_dtypes(pool, interp):
    """(dot precision, upcast tiles to fp32 before tl.dot): the interpreter of triton 3.6
    multiplies bf16 tiles as raw integers, so there they are widened (values already rounded
    to bf16, so the products are the same)."""
    prec = "ieee" if pool.dtype == torch.float32 else "tf32"
    return prec, bool(interp and pool.dtype != torch.float32)


def decode_triton(q, pool, runs, layer, kv_heads, head_dim, scale, out, num_splits,
                   config=None):
    interp = interpreting()
    kern = kernels(interp)
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
        layer, float(scale) * 1.4426950408889634, S,
        H=H, KVH=kv_heads, G=G, D=D, MIN_CHUNK=min_chunk if S > 1 else 0,
        BLOCK_G=max(16, next_pow2(G)), BLOCK_D=max(16, next_pow2(D)), BLOCK_N=block_n,
        LOG_N=block_n.bit_length() - 1,
        ALIGN=align_of(runs.align, head_dim, pool.element_size()), DIRECT=S == 1, PREC=prec,
        UPCAST=upcast, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if S > 1:
        kern["combine"][(B, H)](
            part_m, part_l, part_acc, out, out.stride(0), out.stride(1), out.stride(2), S,
            H=H, D=D, BLOCK_S=next_pow2(MAX_SPLITS), BLOCK_D=next_pow2(D), num_warps=1)
    return out


def prefill_triton(q, pool, runs, q_start, q_len, q_pos, layer, kv_heads, head_dim, scale,
                    max_q_len, config=None, out=None):
    interp = interpreting()
    kern = kernels(interp)
    Nq, H, D = q.shape
    G = H // kv_heads
    B = runs.batch
    if out is None:
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
        BLOCK_D=max(16, next_pow2(D)), BLOCK_N=block_n, LOG_N=block_n.bit_length() - 1,
        ALIGN=align_of(runs.align, head_dim, pool.element_size()), PREC=prec, UPCAST=upcast,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


# The kernels and their helpers below are plain functions, made Triton functions on first use
# (kernels()): triton fixes a function's mode (compiled or interpreted, TRITON_INTERPRET) when
# it wraps it, so each mode gets its own copies, whose globals (where a kernel finds its
# helpers) are a namespace of that mode's: the two modes share nothing. Nor do they
# call triton's library functions (tl.max, tl.sum, tl.cdiv, tl.zeros: @jit functions of
# triton.language.standard, decorated in whichever mode was in force when triton was first
# imported, so compiled-mode ones if anything imported triton before TRITON_INTERPRET=1 was
# set; and each interpreted call of one re-patches the language, slowly): reductions are
# tl.reduce with the library's own combine functions, which is what tl.max and tl.sum
# compile to for fp32 and int32, and which the interpreter recognises and runs in numpy.

@functools.lru_cache(maxsize=None)
def kernels(interpret: bool) -> dict:
    if not triton_available():
        raise BadArgument("the triton attention backend needs triton, which does not import here")
    import triton.language as tl_mod
    if interpret:
        _fix_interpreter()
        from triton.runtime.interpreter import InterpretedFunction as make

        def helper(fn):   # a kernel's launch has patched the language: call the rewritten code
            return make(fn).rewrite()
    else:
        from triton.runtime.jit import JITFunction as make
        helper = make
    scope = dict(globals(), tl=tl_mod)

    def own(fn):   # the annotations too: the compiler reads tl.constexpr from them
        copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__)
        copy.__annotations__ = dict(fn.__annotations__)
        copy.__module__, copy.__qualname__ = fn.__module__, fn.__qualname__
        return copy
    scope.update((fn.__name__, helper(own(fn))) for fn in _HELPERS)
    # the split count S and the layer are values, not specialisations: a step whose batch size
    # picks another S (an eager mixed step, a batch between two graph sizes) or a layer whose
    # index is a multiple of 16 must not compile a kernel in the middle of a timed run
    fixed = {"decode": ["S", "layer"], "combine": ["S"], "store": ["layer"],
             "prefill": ["layer"], "rope_store": ["layer"]}
    from allocator.serving.engine import layer_kernels

    scope.update((fn.__name__, helper(own(fn))) for fn in layer_kernels.HELPERS)
    every = (("decode", _decode_kernel), ("combine", _combine_kernel),
             ("prefill", _prefill_kernel), *layer_kernels.KERNELS)
    return {name: make(own(fn), **({} if interpret else
                                    {"do_not_specialize": fixed.get(name, [])}))
            for name, fn in every}


def compilations() -> int:
    """Kernel variants compiled so far in this process (0 under the interpreter or without
    triton): the engine counts those made during a timed run, whose times they would inflate."""
    if interpreting() or kernels.cache_info().currsize == 0 or not triton_available():
        return 0
    return sum(len(cache[0]) for kern in kernels(False).values()
               for cache in kern.device_caches.values())


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


tl = None   # triton.language in the namespaces kernels() makes (annotations are strings)


def _decode_kernel(q_ptr, pool_ptr, run_start_ptr, run_off_ptr, run_cap_ptr, run_pos_ptr,
                   ctx_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                   sq_b, sq_h, sq_d, so_b, so_h, so_d, layer, qk_scale, S,
                   H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                   MIN_CHUNK: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, LOG_N: tl.constexpr,
                   ALIGN: tl.constexpr, DIRECT: tl.constexpr, PREC: tl.constexpr,
                   UPCAST: tl.constexpr):
    """The decode kernel (module docstring)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    gmask = offs_g < G
    dmask = offs_d < D
    heads = h * G + offs_g
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + heads[:, None] * sq_h + offs_d[None, :] * sq_d,
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    q = q.to(pool_ptr.dtype.element_ty)
    if UPCAST:
        q = q.to(tl.float32)

    # this split's positions [lo, hi) of the request's context
    ctx = tl.load(ctx_ptr + b)
    chunk = ((ctx + S - 1) // S + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    chunk = tl.maximum(chunk, MIN_CHUNK)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, ctx)
    r0, r_end = _run_at(run_start_ptr, run_pos_ptr, b, lo)

    head_k = (layer * 2 * KVH + h).to(tl.int64)
    m_i, l_i, acc = _attend_span(q, lo, pool_ptr, run_pos_ptr, run_off_ptr, run_cap_ptr, lo, hi,
                                 r0, r_end, head_k, offs_d, qk_scale, KVH, D, BLOCK_N, LOG_N,
                                 ALIGN, PREC, UPCAST, False)

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


def _combine_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, so_b, so_h, so_d, S,
                    H: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
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
    """The prefill kernel (module docstring)."""
    b = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    # rows are (query token, query head) pairs: TOK tokens x G heads of kv head h
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
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
    q = q.to(pool_ptr.dtype.element_ty)
    if UPCAST:
        q = q.to(tl.float32)

    ctx = tl.load(ctx_ptr + b)
    hi = tl.minimum(ctx, tl.reduce(tl.where(rvalid, qpos + 1, 0), 0, tl.standard._elementwise_max))
    r0 = tl.load(run_start_ptr + b)
    r_end = tl.load(run_start_ptr + b + 1)
    head_k = (layer * 2 * KVH + h).to(tl.int64)
    m_i, l_i, acc = _attend_span(q, qpos, pool_ptr, run_pos_ptr, run_off_ptr, run_cap_ptr, 0, hi,
                                 r0, r_end, head_k, offs_d, qk_scale, KVH, D, BLOCK_N, LOG_N,
                                 ALIGN, PREC, UPCAST, True)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + qrow[:, None] * so_n + heads[:, None] * so_h + offs_d[None, :] * so_d,
             o.to(out_ptr.dtype.element_ty), mask=qmask)


# ---------------------------------------------------------------- helpers of both kernels
def _run_at(run_start_ptr, run_pos_ptr, b, lo):
    """(the run of request b holding position lo, the end of b's runs): a scalar binary search
    over the request's runs."""
    r_end = tl.load(run_start_ptr + b + 1)
    a = tl.load(run_start_ptr + b)
    z = r_end
    while z - a > 1:
        mid = (a + z) // 2
        go = tl.load(run_pos_ptr + mid) <= lo
        a = tl.where(go, mid, a)
        z = tl.where(go, z, mid)
    return a, r_end


def _attend_span(q, qpos, pool_ptr, run_pos_ptr, run_off_ptr, run_cap_ptr, lo, hi, r0, r_end,
                 head_k, offs_d, qk_scale, KVH: tl.constexpr, D: tl.constexpr,
                 BLOCK_N: tl.constexpr, LOG_N: tl.constexpr, ALIGN: tl.constexpr,
                 PREC: tl.constexpr, UPCAST: tl.constexpr, CAUSAL: tl.constexpr):
    """(running max, running sum, accumulator) of online softmax of the query rows q over the
    context positions [lo, hi) of one request and kv head, r0 the run of position lo; CAUSAL:
    query row i sees the positions up to qpos[i] only (prompt chunks)."""
    dmask = offs_d < D
    m_i = tl.full([q.shape[0]], float("-inf"), tl.float32)
    l_i = tl.full([q.shape[0]], 0.0, tl.float32)
    acc = tl.full([q.shape[0], q.shape[1]], 0.0, tl.float32)
    for p in range(lo, hi, BLOCK_N):
        pos, valid, krow, vrow, r = _tile_rows(run_pos_ptr, run_off_ptr, run_cap_ptr, p, hi,
                                               r0, r_end, head_k, KVH, D, BLOCK_N, LOG_N, ALIGN)
        allowed = valid[None, :]
        if CAUSAL:
            allowed = allowed & (pos[None, :] <= qpos[:, None])
        m_i, l_i, acc = _attend_tile(q, pool_ptr, krow, vrow, valid[:, None] & dmask[None, :],
                                     allowed, offs_d, m_i, l_i, acc, qk_scale, PREC, UPCAST)
        # the next tile's first run: this tile's last run, or the one after it
        r_last = tl.reduce(tl.where(valid, r, r0), 0, tl.standard._elementwise_max)
        nxt = tl.load(run_pos_ptr + r_last + 1, mask=r_last + 1 < r_end, other=0x7FFFFFFF)
        r0 = r_last + (nxt <= p + BLOCK_N).to(tl.int32)
    return m_i, l_i, acc


def _tile_rows(run_pos_ptr, run_off_ptr, run_cap_ptr, p, hi, r0, r_end, head_k,
               KVH: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
               LOG_N: tl.constexpr, ALIGN: tl.constexpr):
    """The tile of positions [p, p + BLOCK_N) below hi, r0 the run of position p: each lane's
    (position, valid, K row, V row, run). A lane's run is the last r in [r0, r0 + BLOCK_N)
    with run_pos[r] <= its position (binary lifting)."""
    pos = p + tl.arange(0, BLOCK_N)
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
    return pos, valid, krow, vrow, r


def _attend_tile(q, pool_ptr, krow, vrow, kv_mask, allowed, offs_d, m_i, l_i, acc, qk_scale,
                 PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One tile of online softmax: the queries q against the tile's K rows where `allowed`,
    then its V rows into (running max, running sum, accumulator)."""
    kv_ty = pool_ptr.dtype.element_ty
    k = tl.load(pool_ptr + krow[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale      # [queries, BLOCK_N]
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
    return m_new, l_i, acc


_HELPERS = (_run_at, _attend_span, _tile_rows, _attend_tile)
