"""The engine's Triton kernels compile for an H100 (sm_90) here, where no GPU is: triton's own
compiler and ptxas build each kernel ahead of time, as the first launch on a GPU would. The
interpreter runs their arithmetic in the other tests; this proves the compiled mode accepts them
(a kernel the interpreter runs may still fail to compile), that the engine's own launches
bind their arguments and compile through triton's launch path as on a GPU, that the layer
kernels' bfloat16 conversions round to nearest even there (the interpreter of triton 3.6
truncates), and that the values a step changes (the decode split count, the layer) stay
run-time arguments: one compilation serves every batch size, so none lands inside a timed
run."""

import collections
import inspect
import re
import types

import numpy as np
import pytest

from allocator.serving.engine import run_kernels

# imported before any test sets TRITON_INTERPRET=1: triton's library functions (the reductions'
# combine functions) are then decorated for the compiled mode, as on a GPU
triton = pytest.importorskip("triton")
torch = pytest.importorskip("torch")

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


class _Sm90Driver:
    """What triton's launch path asks of the active driver before it compiles: an H100's
    target, device 0 and its stream (never used: nothing is launched)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


@pytest.fixture
def sm90_launches(monkeypatch):
    """The engine's Triton launches through triton's own launch path for an H100, with no GPU:
    the compiled-mode kernel binds the call's arguments (its tl.constexpr parameters read from
    its annotations, the others specialised by type, value and alignment) and compiles for
    sm_90, as a GPU's first launch does; then, where asked (`.run = True`), the interpreted copy
    of the same kernel runs the call on the CPU, so the engine's results stay checkable.
    .launched counts the launches by kernel."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    state = types.SimpleNamespace(launched=collections.Counter(), run=True)
    names = {id(k): name for name, k in run_kernels.kernels(False).items()}
    interpreted = run_kernels.kernels(True)
    compile_then_interpret = JITFunction.run

    def launch(self, *args, grid, warmup, **kwargs):
        try:
            kernel = compile_then_interpret(self, *args, grid=grid, warmup=True, **kwargs)
        except RuntimeError as exc:
            if "ptxas" in str(exc).lower() and "not found" in str(exc).lower():
                pytest.skip(f"no ptxas here: {exc}")
            raise
        state.launched[names[id(self)]] += 1
        if state.run and not warmup:
            interpreted[names[id(self)]][grid](*args, **kwargs)
        return kernel

    from allocator.serving.engine import run_attention

    monkeypatch.setattr(run_attention, "interpreting", lambda: True)  # Triton on the CPU...
    monkeypatch.setattr(run_kernels, "interpreting", lambda: False)   # ...its compiled kernels
    monkeypatch.setattr(JITFunction, "run", launch)
    # set, and put back as it was (triton's reset_active would look for a real GPU driver)
    monkeypatch.setattr(driver, "_active", _Sm90Driver())
    return state


@pytest.mark.parametrize("fused,chunk,prompt_attention", [
    ("on", 16, "dense"), ("on", None, "dense"), ("off", 16, "dense"), ("on", None, "runs")],
    ids=["fused-chunked", "fused", "modules-chunked", "fused-prompts-over-runs"])
def test_the_engine_launches_its_kernels_as_a_gpu_would(sm90_launches, fused, chunk,
                                                        prompt_attention):
    """A float32 run of the engine (the GPU check's tiny run) whose every Triton launch goes
    through triton's launch path for sm_90 first: every call site's arguments bind and compile,
    and the tokens are generate()'s (an H200 failed every launch that the ahead-of-time compile
    above passed: the kernels had lost their annotations)."""
    from allocator.config import AllocatorConfig
    from allocator.serving import models
    from allocator.serving.engine import serve as te
    from test_hf_reference import reference

    cfg, _ = models.load_config("tiny-qwen2")
    model = te.build_model(cfg, "float32", "cpu", seed=0)
    rng = np.random.default_rng(5)
    prompts = te.prompt_ids(5, rng.integers(2, 30, 5), cfg.vocab_size, 4)
    gen = [int(g) for g in rng.integers(1, 8, 5)]
    run = te.serve(model, prompts, gen, np.zeros(len(gen)), "paged",
                   pool_bytes=300 * models.kv_bytes_per_token(cfg, "float32"),
                   max_model_len=48, max_batch=4, page_tokens=4, max_batched_tokens=chunk,
                   attention="triton", fused_layers=fused, prompt_attention=prompt_attention,
                   config=AllocatorConfig(background_refresh=False))
    assert run["tokens"] == reference(model, prompts, gen)
    want = {"decode"} | ({"prefill"} if chunk or prompt_attention == "runs" else set()) | (
        {"add_rms_norm", "rope_store", "silu_mul"} if fused == "on" else {"store"})
    assert want <= set(sm90_launches.launched), sm90_launches.launched


def test_a_split_decode_and_bfloat16_launch_as_a_gpu_would(sm90_launches):
    """The decode split over the context (its combine kernel), and every kernel in bfloat16,
    the GPU runs' type: compiled through the launch path (bfloat16's results are not checked
    here: the interpreter of triton 3.6 multiplies bfloat16 tiles as integers)."""
    from allocator.config import AllocatorConfig
    from allocator.serving import models
    from allocator.serving.engine import run_attention as ra
    from allocator.serving.engine import serve as te

    per_token = 2 * 2 * 2 * 64          # 2 layers x K and V x 2 kv heads x 64
    pool = torch.randn(per_token * (64 + 32))
    runs = ra.RunTable.from_requests([[(0, 64, 40)], [(per_token * 64, 32, 30)]])
    q = torch.randn(2, 4, 64)           # 4 query heads over the 2 kv heads
    got = ra.decode_attention(q, pool, runs, 1, 2, 64, 0.125, backend="triton", num_splits=3)
    want = ra.decode_attention_torch(q, pool, runs, 1, 2, 64, 0.125)
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
    assert sm90_launches.launched["combine"] == 1

    sm90_launches.run = False
    sm90_launches.launched.clear()
    cfg, _ = models.load_config("tiny-qwen2")
    model = te.build_model(cfg, "bfloat16", "cpu", seed=0)
    prompts = te.prompt_ids(3, [9, 20, 5], cfg.vocab_size, 4)
    for fused in ("on", "off"):
        te.serve(model, prompts, [3, 2, 4], np.zeros(3), "odma",
                 pool_bytes=300 * models.kv_bytes_per_token(cfg, "bfloat16"),
                 max_model_len=48, max_batch=4, max_batched_tokens=8, attention="triton",
                 fused_layers=fused, config=AllocatorConfig(background_refresh=False))
    assert set(sm90_launches.launched) == {"decode", "prefill", "store", "add_rms_norm",
                                           "rope_store", "silu_mul"}, sm90_launches.launched
