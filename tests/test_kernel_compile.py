"""The engine's Triton kernels compile for an H100 (sm_90) here, where no GPU is: triton's own
compiler and ptxas build each kernel ahead of time, as the first launch on a GPU would. The
interpreter runs their arithmetic in the other tests; this proves the compiled mode accepts them
(a kernel the interpreter runs may still fail to compile), that the layer kernels' bfloat16
conversions round to nearest even there (the interpreter of triton 3.6 truncates), and that
the values a step changes (the decode split count, the layer) stay run-time arguments: one
compilation serves every batch size, so none lands inside a timed run."""

import inspect
import re

import pytest

from allocator.serving.engine import run_kernels

triton = pytest.importorskip("triton")

PTR = {"pool_ptr": "*bf16", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
       "out_ptr": "*bf16", "run_off_ptr": "*i64", "slot_ptr": "*i64", "slot_cap_ptr": "*i64",
       "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32",
       "x_ptr": "*bf16", "d_ptr": "*bf16", "w_ptr": "*bf16", "qkv_ptr": "*bf16",
       "cos_ptr": "*bf16", "sin_ptr": "*bf16", "gu_ptr": "*bf16"}
# Qwen2.5-0.5B's attention: 14 query heads over 2 KV heads of 64, bf16 (the GPU runs' model)
GEOMETRY = dict(H=14, KVH=2, G=7, D=64, BLOCK_D=64, ALIGN=8, PREC="tf32", UPCAST=False)
CONSTANTS = {
    "store": dict(KVH=2, D=64, BLOCK_H=2, BLOCK_D=64, ALIGN=8),
    "decode": dict(GEOMETRY, MIN_CHUNK=256, BLOCK_G=16, BLOCK_N=128, LOG_N=7, DIRECT=False),
    "decode_direct": dict(GEOMETRY, MIN_CHUNK=0, BLOCK_G=16, BLOCK_N=128, LOG_N=7, DIRECT=True),
    "combine": dict(H=14, D=64, BLOCK_S=16, BLOCK_D=64),
    "prefill": dict(GEOMETRY, TOK=9, BLOCK_M=64, BLOCK_N=64, LOG_N=6),
    # the fused layers' kernels (layer_kernels.py), at the same model's shapes
    "add_rms_norm": dict(HAS_D=True, BLOCK=1024),
    "rope_store": dict(HQ=14, KVH=2, D=64, HALF=32, BLOCK_HQ=16, BLOCK_KV=2, BLOCK_HALF=32,
                       ALIGN=8),
    "silu_mul": dict(BLOCK=1024),
}
# what rounds fp32 to bfloat16 in them: every conversion to nearest even, as the kernels'
# rounding (and transformers' modules, which they match) assume
ROUNDING = {"add_rms_norm", "rope_store", "silu_mul"}


def _signature(fn, constants):
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constants:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = PTR.get(name, "*i32")
        else:
            sig[name] = "fp32" if name in ("qk_scale", "eps") else "i32"
    return sig


@pytest.mark.parametrize("name", sorted(CONSTANTS))
def test_kernel_compiles_for_sm90(name):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kern = run_kernels.kernels(False)[name.removesuffix("_direct")]
    constants = {k: v for k, v in CONSTANTS[name].items()
                 if k in inspect.signature(kern.fn).parameters}
    params = list(inspect.signature(kern.fn).parameters)
    src = ASTSource(kern, _signature(kern, constants),
                    {(params.index(k),): v for k, v in constants.items()})
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4, "num_stages": 1})
    except RuntimeError as exc:
        if "ptxas" in str(exc).lower() and "not found" in str(exc).lower():
            pytest.skip(f"no ptxas here: {exc}")
        raise
    assert compiled.asm["cubin"], "no cubin came out"
    if name in ROUNDING:
        to_bf16 = set(re.findall(r"cvt\.(\w+)\.bf16\.f32", compiled.asm["ptx"]))
        assert to_bf16 == {"rn"}, to_bf16


def test_step_values_are_not_specialised():
    """The split count and the layer never pick a kernel variant: a batch size between two
    graph sizes, or an eager mixed step, must reuse what the warm-up compiled."""
    kernels = run_kernels.kernels(False)
    assert {"S", "layer"} <= set(kernels["decode"].do_not_specialize)
    assert "S" in kernels["combine"].do_not_specialize
    assert "layer" in kernels["store"].do_not_specialize
    assert "layer" in kernels["prefill"].do_not_specialize
    assert "layer" in kernels["rope_store"].do_not_specialize


@pytest.mark.parametrize("name", sorted({n.removesuffix("_direct") for n in CONSTANTS}))
def test_launch_reads_the_constexpr_parameters(name):
    """A launch on a GPU takes the kernel's tl.constexpr parameters from its annotations; the
    per-mode copy of a kernel must keep them (a copy without them failed on an H200 with
    "arange's arguments must be of type tl.constexpr"), which the ahead-of-time compile
    above, given its constants by name, does not see."""
    kern = run_kernels.kernels(False)[name]
    annotated = [p for p, a in inspect.signature(kern.fn).parameters.items()
                 if "constexpr" in str(a.annotation)]
    assert annotated, "the copy lost its annotations"
    assert [p.name for p in kern.params if p.is_constexpr] == annotated
