"""The Triton kernels around the run-table attention: the store of a step's K and V, and the
fused decoder layers' (allocator/serving/engine/runner.py's FusedLayers); made and launched as
the attention's are (run_kernels.kernels: on CUDA, or on the CPU under TRITON_INTERPRET=1).

- store_kv: grid (N,): a program writes one token's K and V rows of every kv head.

At a decode batch every launch costs a few microseconds of a GPU that has nothing else to do,
inside a CUDA graph too, and transformers' modules spend 35 launches a layer, most of them on
norms, rotary and activation; with these three a layer is 9 (10 where the decode splits the
context):
- add_rms_norm: grid (N,): adds a delta into the residual row (rounded to its dtype, as
  `x + delta` is) and writes the row's RMSNorm, rounded as transformers' RMSNorm rounds.
- rope_store: grid (N,): rotates one token's query and key heads in place in the fused qkv row
  (rotate_half convention, each product rounded to the dtype as transformers' rotary is) and
  writes its K and V rows into the pool, as store_kv does.
- silu_mul: grid (N, column blocks): silu(gate) * up from the fused gate_up row.
"""

from __future__ import annotations

from allocator.serving.engine import run_kernels
from allocator.serving.engine.run_kernels import align_of, next_pow2


def _kernel(name: str):
    """The kernel `name` in the mode TRITON_INTERPRET asks for."""
    return run_kernels.kernels(run_kernels.interpreting())[name]


def store_kv_triton(pool, k, v, slot, slot_cap, layer, kv_heads, head_dim, align):
    N = k.shape[0]
    _kernel("store")[(N,)](
        pool, k, v, slot, slot_cap,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        layer, KVH=kv_heads, D=head_dim, BLOCK_H=next_pow2(kv_heads),
        BLOCK_D=next_pow2(head_dim), ALIGN=align_of(align, head_dim, pool.element_size()),
        num_warps=1 if kv_heads * head_dim <= 256 else 4)


def add_rms_norm_triton(x, delta, weight, eps: float, out):
    """x += delta (when given), out = RMSNorm(x) * weight; x, delta, out [N, H] with unit
    column stride."""
    N, H = x.shape
    if N:
        _kernel("add_rms_norm")[(N,)](
            x, x if delta is None else delta, weight, out, x.stride(0),
            0 if delta is None else delta.stride(0), out.stride(0), H, float(eps),
            HAS_D=delta is not None, BLOCK=next_pow2(H), num_warps=4 if H >= 1024 else 1)
    return out


def rope_store_triton(qkv, cos, sin, pool, slot, slot_cap, layer, heads, kv_heads, head_dim,
                      align):
    """Rotate the query and key heads of qkv [N, (heads + 2 kv_heads) * head_dim] in place by
    cos, sin [N, head_dim] and store each token's K and V rows at its slot for `layer`."""
    N = qkv.shape[0]
    if N:
        half = head_dim // 2
        _kernel("rope_store")[(N,)](
            qkv, cos, sin, pool, slot, slot_cap, qkv.stride(0), cos.stride(0), sin.stride(0),
            layer, HQ=heads, KVH=kv_heads, D=head_dim, HALF=half,
            BLOCK_HQ=next_pow2(heads), BLOCK_KV=next_pow2(kv_heads),
            BLOCK_HALF=next_pow2(half), ALIGN=align_of(align, head_dim, pool.element_size()),
            num_warps=1 if heads * head_dim <= 1024 else 4)


def silu_mul_triton(gate_up, out):
    """out [N, I] = silu(gate) * up of gate_up [N, 2 I] (gate first)."""
    N, I2 = gate_up.shape
    block = min(1024, next_pow2(I2 // 2))
    if N:
        _kernel("silu_mul")[(N, -(-(I2 // 2) // block))](
            gate_up, out, gate_up.stride(0), out.stride(0), I2 // 2, BLOCK=block, num_warps=4)
    return out


tl = None   # triton.language in run_kernels.kernels()'s namespaces (annotations are strings)


def _kv_rows(slot_ptr, slot_cap_ptr, n, offs_h, layer, KVH: tl.constexpr, D: tl.constexpr,
             ALIGN: tl.constexpr):
    """(token n's slot, the pool offsets of its K rows and of its V rows for the kv heads
    offs_h at `layer`), as store_kv lays them out."""
    slot = tl.load(slot_ptr + n)
    cap = tl.load(slot_cap_ptr + n).to(tl.int64)
    krow = slot + (layer * 2 * KVH + offs_h) * cap * D
    vrow = krow + KVH * cap * D
    if ALIGN > 1:
        krow = tl.multiple_of(krow, ALIGN)
        vrow = tl.multiple_of(vrow, ALIGN)
    return slot, krow, vrow


def _store_kv_kernel(pool_ptr, k_ptr, v_ptr, slot_ptr, slot_cap_ptr,
                     sk_n, sk_h, sk_d, sv_n, sv_h, sv_d, layer,
                     KVH: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, ALIGN: tl.constexpr):
    n = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot, krow, vrow = _kv_rows(slot_ptr, slot_cap_ptr, n, offs_h, layer, KVH, D, ALIGN)
    mask = (slot >= 0) & (offs_h[:, None] < KVH) & (offs_d[None, :] < D)
    k = tl.load(k_ptr + n * sk_n + offs_h[:, None] * sk_h + offs_d[None, :] * sk_d, mask=mask)
    v = tl.load(v_ptr + n * sv_n + offs_h[:, None] * sv_h + offs_d[None, :] * sv_d, mask=mask)
    ty = pool_ptr.dtype.element_ty
    tl.store(pool_ptr + krow[:, None] + offs_d[None, :], k.to(ty), mask=mask)
    tl.store(pool_ptr + vrow[:, None] + offs_d[None, :], v.to(ty), mask=mask)


def _rounded(x, ty: tl.constexpr):
    """fp32 x in the dtype ty, rounded to nearest. For bfloat16 Veltkamp's split rounds it to
    8 significant bits first, so that the conversion itself is exact: triton 3.6's interpreter
    converts fp32 to bfloat16 by truncation (compiled code rounds to nearest even)."""
    if ty == tl.bfloat16:
        c = x * 65537.0
        x = c - (c - x)
    return x.to(ty)


def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, out_ptr, sx, sd, so, H, eps,
                         HAS_D: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    ty = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + n * sx + offs, mask=m, other=0.0)
    if HAS_D:
        d = tl.load(d_ptr + n * sd + offs, mask=m, other=0.0)
        x = _rounded(x.to(tl.float32) + d.to(tl.float32), ty)
        tl.store(x_ptr + n * sx + offs, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.reduce(xf * xf, 0, tl.standard._sum_combine) / H
    y = _rounded(xf * (1.0 / tl.sqrt(var + eps)), ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * so + offs, _rounded(w * y, out_ptr.dtype.element_ty), mask=m)


def _rotate(ptr, rows, offs_j, mask, c1, c2, s1, s2, HALF: tl.constexpr):
    """Rotate the heads at rows (element offsets of each head's first element) in place;
    (the first half, the second half) rotated, in the row's dtype."""
    ty = ptr.dtype.element_ty
    x1 = tl.load(ptr + rows[:, None] + offs_j[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + rows[:, None] + HALF + offs_j[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    # q * cos + rotate_half(q) * sin, each product and the sum rounded to the dtype
    y1 = _rounded(_rounded(x1 * c1[None, :], ty).to(tl.float32)
                  - _rounded(x2 * s1[None, :], ty).to(tl.float32), ty)
    y2 = _rounded(_rounded(x2 * c2[None, :], ty).to(tl.float32)
                  + _rounded(x1 * s2[None, :], ty).to(tl.float32), ty)
    tl.store(ptr + rows[:, None] + offs_j[None, :], y1, mask=mask)
    tl.store(ptr + rows[:, None] + HALF + offs_j[None, :], y2, mask=mask)
    return y1, y2


def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, pool_ptr, slot_ptr, slot_cap_ptr, s_qkv,
                       s_cos, s_sin, layer, HQ: tl.constexpr, KVH: tl.constexpr,
                       D: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                       BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr, ALIGN: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs_j = tl.arange(0, BLOCK_HALF)
    jm = offs_j < HALF
    c1 = tl.load(cos_ptr + n * s_cos + offs_j, mask=jm, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + n * s_cos + HALF + offs_j, mask=jm, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + n * s_sin + offs_j, mask=jm, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + n * s_sin + HALF + offs_j, mask=jm, other=0.0).to(tl.float32)
    row = n * s_qkv
    offs_q = tl.arange(0, BLOCK_HQ)
    _rotate(qkv_ptr, row + offs_q * D, offs_j, (offs_q[:, None] < HQ) & jm[None, :],
            c1, c2, s1, s2, HALF)
    offs_h = tl.arange(0, BLOCK_KV)
    hm = offs_h < KVH
    k1, k2 = _rotate(qkv_ptr, row + (HQ + offs_h) * D, offs_j, hm[:, None] & jm[None, :],
                     c1, c2, s1, s2, HALF)
    slot, krow, prow = _kv_rows(slot_ptr, slot_cap_ptr, n, offs_h, layer, KVH, D, ALIGN)
    mask = (slot >= 0) & hm[:, None] & jm[None, :]
    vrow = row + (HQ + KVH + offs_h) * D
    v1 = tl.load(qkv_ptr + vrow[:, None] + offs_j[None, :], mask=mask, other=0.0)
    v2 = tl.load(qkv_ptr + vrow[:, None] + HALF + offs_j[None, :], mask=mask, other=0.0)
    ty = pool_ptr.dtype.element_ty
    tl.store(pool_ptr + krow[:, None] + offs_j[None, :], k1.to(ty), mask=mask)
    tl.store(pool_ptr + krow[:, None] + HALF + offs_j[None, :], k2.to(ty), mask=mask)
    tl.store(pool_ptr + prow[:, None] + offs_j[None, :], v1.to(ty), mask=mask)
    tl.store(pool_ptr + prow[:, None] + HALF + offs_j[None, :], v2.to(ty), mask=mask)


def _silu_mul_kernel(gu_ptr, out_ptr, s_gu, s_out, inter, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < inter
    ty = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + n * s_gu + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + n * s_gu + inter + offs, mask=m, other=0.0).to(tl.float32)
    act = _rounded(g / (1.0 + tl.exp(-g)), ty).to(tl.float32)   # silu, rounded as F.silu is
    tl.store(out_ptr + n * s_out + offs, _rounded(act * u, ty), mask=m)


KERNELS = (("store", _store_kv_kernel), ("add_rms_norm", _add_rms_norm_kernel),
           ("rope_store", _rope_store_kernel), ("silu_mul", _silu_mul_kernel))
HELPERS = (_kv_rows, _rounded, _rotate)
