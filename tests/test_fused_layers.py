"""The Triton path's fused decoder layers (runner.FusedLayers): each small kernel computes what
transformers' modules compute, rounded alike (on the CPU under TRITON_INTERPRET=1, compiled on
a GPU); the engine makes generate()'s tokens through them on every layout and schedule; a
layer is about ten launches where the modules' are 35; a model or path they do not fit
runs the modules (auto) or is refused in one line (on)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("triton")

from allocator.config import AllocatorConfig  # noqa: E402
from allocator.policies import make_allocator  # noqa: E402
from allocator.serving import models  # noqa: E402
from allocator.serving.engine import layer_kernels, run_attention  # noqa: E402
from allocator.serving.engine import serve as te  # noqa: E402
from allocator.serving.engine.kv_runs import KVPool  # noqa: E402
from allocator.serving.engine.launches import step_launches  # noqa: E402
from allocator.serving.engine.runner import FusedLayers, Runner  # noqa: E402
from odma_cli.errors import BadArgument  # noqa: E402
from odma_cli.main import main  # noqa: E402
from test_hf_reference import reference  # noqa: E402

# bfloat16 keeps 8 bits of mantissa: where the kernel and torch reduce in another order, an
# intermediate may round one unit of the last place apart, and two roundings after it (the
# normalised row, then its product with the weight) make that up to two units
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -6, atol=1e-2)}


def randn(*shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("hidden", [37, 64])
@pytest.mark.parametrize("with_delta", [False, True], ids=["norm", "add-norm"])
def test_add_rms_norm_is_the_residual_add_then_transformers_rmsnorm(tri, dtype, hidden,
                                                                   with_delta):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    norm = Qwen2RMSNorm(hidden, eps=1e-6).to(tri, dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(hidden, dtype=dtype, device=tri, seed=1) * 0.5 + 1)
    x = randn(5, hidden, dtype=dtype, device=tri, seed=2)
    delta = randn(5, hidden, dtype=dtype, device=tri, seed=3) if with_delta else None
    want_x = x + delta if with_delta else x.clone()
    with torch.no_grad():
        want = norm(want_x)
    out = torch.empty_like(x)
    layer_kernels.add_rms_norm_triton(x, delta, norm.weight, norm.variance_epsilon, out)
    assert torch.equal(x, want_x)          # the residual row holds the rounded sum
    torch.testing.assert_close(out, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(14, 2, 16), (3, 3, 8), (7, 1, 32)])
def test_rope_store_rotates_q_and_k_in_place_and_stores_k_and_v(tri, dtype, heads, kv_heads,
                                                                head_dim):
    """Against transformers' apply_rotary_pos_emb and the torch store: q and k rotated in the
    fused row, the rotated K and V at each token's slot, a negative slot not written."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    N, layers, layer = 6, 3, 1
    width = (heads + 2 * kv_heads) * head_dim
    qkv = randn(N, width, dtype=dtype, device=tri, seed=4)
    pos = torch.arange(N, dtype=torch.float32) * 7 + 3
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.cat([pos[:, None] * inv[None]] * 2, dim=1)
    cos, sin = ang.cos().to(dtype).to(tri), ang.sin().to(dtype).to(tri)
    q = qkv[:, :heads * head_dim].reshape(N, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(N, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].reshape(N, kv_heads, head_dim)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          cos[None], sin[None])
    want_q, want_k = want_q[0].transpose(0, 1), want_k[0].transpose(0, 1)
    # slots: token n at 40 n of a pool laid out as store_kv lays it, token 2 not stored
    cap = np.full(N, 8, dtype=np.int64)
    slot = np.arange(N, dtype=np.int64) * 40
    slot[2] = -1
    size = int(slot.max()) + layers * 2 * kv_heads * 8 * head_dim + 64
    pool = torch.full((size,), -7.0, dtype=dtype, device=tri)
    want_pool = pool.clone()
    slot_t, cap_t = torch.from_numpy(slot).to(tri), torch.from_numpy(cap).to(tri)
    run_attention.store_kv(want_pool, want_k.contiguous(), v.contiguous(), slot_t, cap_t, layer,
                           kv_heads, head_dim, backend="torch")
    before = v.clone()
    layer_kernels.rope_store_triton(qkv, cos, sin, pool, slot_t, cap_t, layer, heads, kv_heads,
                                  head_dim, 1)
    torch.testing.assert_close(qkv[:, :heads * head_dim].reshape(N, heads, head_dim), want_q,
                               **TOL[dtype])
    torch.testing.assert_close(
        qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(N, kv_heads, head_dim),
        want_k, **TOL[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:].reshape(N, kv_heads, head_dim),
                       before)
    torch.testing.assert_close(pool, want_pool, **TOL[dtype])
    assert (pool == -7.0).sum() == (want_pool == -7.0).sum()    # nothing written elsewhere


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("inter", [5, 1500])
def test_silu_mul_is_silu_of_gate_times_up(tri, dtype, inter):
    gu = randn(3, 2 * inter, dtype=dtype, device=tri, seed=5) * 3
    want = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    out = layer_kernels.silu_mul_triton(gu, gu.new_empty(3, inter))
    torch.testing.assert_close(out, want, **TOL[dtype])


# ----------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("name,policy,chunk", [
    ("tiny-qwen2", "odma", None), ("tiny-qwen2", "paged", 16), ("tiny-llama", "extent", None),
    ("tiny-llama", "static", 16)], ids=["qwen2-odma", "qwen2-paged-chunked", "llama-extent",
                                        "llama-static-chunked"])
def test_fused_layers_make_generates_tokens_on_every_layout_and_schedule(tri, name, policy,
                                                                         chunk):
    """Qwen2's q/k/v biases and Llama's none; contiguous blocks, pages of 4 tokens, extents;
    whole prompts and prompt chunks of 16 tokens beside decodes."""
    cfg, _ = models.load_config(name)
    model = te.build_model(cfg, "float32", tri, seed=0)
    rng = np.random.default_rng(5)
    prompts = te.prompt_ids(5, rng.integers(2, 30, 5), cfg.vocab_size, 4)
    gen = [int(g) for g in rng.integers(1, 8, 5)]
    want = reference(model, prompts, gen)
    bpt = models.kv_bytes_per_token(cfg, "float32")
    run = te.serve(model, prompts, gen, np.zeros(len(gen)), policy, pool_bytes=300 * bpt,
                   max_model_len=48, max_batch=4, page_tokens=4, max_batched_tokens=chunk,
                   attention="triton", fused_layers="on",
                   config=AllocatorConfig(background_refresh=False, token_alignment=4,
                                          extent_knee_tokens=4, extent_max=4))
    assert run["fused_layers"] is True
    assert run["tokens"] == want
    # the modules read the same values through views of the joined weights: no second copy
    attn = model.model.layers[0].self_attn
    joined = model._odma_fused_layers.blocks[0][1]
    assert attn.k_proj.weight.untyped_storage().data_ptr() == \
        joined.untyped_storage().data_ptr()
    assert reference(model, prompts, gen) == want


def test_a_fused_decode_layer_is_ten_launches_or_fewer(tri):
    """norm, qkv, rotary with the store, attention (a second launch where the context is
    split), o, add-norm, gate/up, silu-mul, down: 9 or 10; the modules make four times that."""
    cfg, _ = models.load_config("tiny-qwen2")
    fused, rest, kinds = step_launches(cfg, "triton", "on", tri)
    modules, _, _ = step_launches(cfg, "triton", "off", tri)
    # every layer's launches counted, the layer kernels' among them (4 layers, a final norm)
    assert kinds["triton:rope_store"] == 4 and kinds["triton:add_rms_norm"] == 9
    assert fused <= 10, fused
    assert modules >= 3 * fused, (modules, fused)
    assert rest <= 12, rest          # embedding, rotary tables, final norm, head, the rows


def test_what_cannot_run_fused_runs_the_modules_or_is_refused(tri, tmp_path, capsys,
                                                              monkeypatch):
    cfg, _ = models.load_config("tiny-llama")
    gelu = copy.deepcopy(cfg)
    gelu.hidden_act = "gelu"
    model = te.build_model(gelu, "float32", tri, seed=0)
    assert "silu" in FusedLayers.why_not(model)
    bpt = models.kv_bytes_per_token(gelu, "float32")
    alloc = make_allocator("odma", f"torch:{tri}", 100 * bpt, bpt, 32,
                           AllocatorConfig(background_refresh=False))
    try:
        kv = KVPool(alloc, gelu, torch.float32, models.head_dim(gelu))
        assert Runner(model, kv, "triton", "auto").fused is None
        with pytest.raises(BadArgument, match="silu"):
            Runner(model, kv, "triton", "on")
        assert Runner(model, kv, "torch", "auto").fused is None
        with pytest.raises(BadArgument, match="auto, on or off"):
            Runner(model, kv, "triton", "yes")
    finally:
        alloc.close()
    # on the CPU's torch path, asked for on the command line: one line, exit 2, no work
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    trace = tmp_path / "t.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n12,4\n30,3\n")
    code = main(["engine", "--trace", str(trace), "--model", "tiny-llama", "--policy", "odma",
                 "--fused-layers", "on"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--fused-layers on" in err, err
