"""Models and accelerators as plain numbers: what a decode step reads and computes, and how fast
a card reads, computes and talks to its peers.

Model numbers are each model's published config.json (layers, hidden size, heads, KV heads, head
dimension, FFN size, vocabulary, whether the embedding is tied); parameters are derived from
them, not copied. Accelerator numbers carry their source in `source`; figures nobody publishes
(MLU370-X4's own FLOPS, its per-kernel overheads) are marked as assumptions there.
"""

from __future__ import annotations

import dataclasses

from odma_hw.errors import BadArgument

DTYPE_BYTES = {"bf16": 2, "int8": 1}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer with grouped-query attention and a gated MLP."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied_embeddings: bool
    max_context: int                 # max_position_embeddings: no request may be longer
    qkv_bias: bool = False
    kv_dtype_bytes: int = 2          # the KV cache stays bf16 whatever the weights are

    @property
    def layer_params(self) -> int:
        """Weights of one layer: q, k, v, o projections, the gated MLP, two norms."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return q + kv + o + bias + 3 * self.hidden * self.ffn + 2 * self.hidden

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden
        return (self.layers * self.layer_params + embed + (0 if self.tied_embeddings else embed)
                + self.hidden)

    @property
    def streamed_params(self) -> int:
        """Weights a decode step reads in full: every layer, the final norm and the LM head.
        The input embedding is a gather of a few rows per step, not a stream of the table."""
        return self.layers * self.layer_params + self.hidden + self.vocab * self.hidden

    def weight_bytes(self, dtype: str = "bf16") -> int:
        return self.params * DTYPE_BYTES[dtype]

    def streamed_weight_bytes(self, dtype: str = "bf16") -> int:
        return self.streamed_params * DTYPE_BYTES[dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer and KV head: 2 x layers x kv_heads x head_dim x 2 B."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def kv_run_bytes_per_token(self) -> int:
        """Bytes one token adds to one (layer, K or V, KV head) run: head_dim x 2 B."""
        return self.head_dim * self.kv_dtype_bytes

    def decode_flops(self, context: int) -> float:
        """FLOPs of one generated token at `context` tokens: 2 per streamed weight, plus the
        attention's QK^T and AV over the context (2 x 2 x layers x heads x head_dim x ctx)."""
        return 2.0 * self.streamed_params + 4.0 * self.layers * self.heads * self.head_dim * context

    def prefill_flops(self, prompt: int, cached: int = 0) -> float:
        """FLOPs to prefill `prompt` new tokens after `cached` tokens already in the KV cache:
        2 per weight per token, plus causal attention over cached + new tokens."""
        attn = 4.0 * self.layers * self.heads * self.head_dim * (
            prompt * cached + prompt * (prompt + 1) / 2)
        return 2.0 * self.streamed_params * prompt + attn


# config.json of each model (Hugging Face): DeepSeek-R1-Distill-Qwen-7B is the Qwen2.5-7B
# architecture (with q/k/v biases); Llama 3 8B and Llama 2 7B as published by Meta.
MODELS = {
    "deepseek-r1-distill-qwen-7b": ModelSpec("deepseek-r1-distill-qwen-7b", 28, 3584, 28, 4, 128,
                                             18944, 152064, False, 131072, qkv_bias=True),
    "llama-3-8b": ModelSpec("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, False, 8192),
    "llama-2-7b": ModelSpec("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000, False, 4096),
}
MODEL_ALIASES = {"qwen2.5-7b": "deepseek-r1-distill-qwen-7b"}


def model_spec(name: str) -> ModelSpec:
    """A preset by name, or the model a Hugging Face config.json describes: a file, a directory
    holding one, or a config the engine ships (allocator/serving/configs)."""
    import os

    from allocator.serving.models import CONFIG_DIR, shipped_configs

    key = MODEL_ALIASES.get(name, name)
    if key in MODELS:
        return MODELS[key]
    if name in shipped_configs():
        return model_from_config(CONFIG_DIR / f"{name}.json")
    if os.path.isdir(name):
        return model_from_config(os.path.join(name, "config.json"))
    if os.path.isfile(name):
        return model_from_config(name)
    raise BadArgument(f"unknown --model {name!r}: expected a Hugging Face config.json (or a "
                      f"directory holding one), a shipped config ({', '.join(shipped_configs())})"
                      f" or one of {', '.join(list(MODELS) + list(MODEL_ALIASES))}")


# a mixture of experts reads only its routed experts per token: the dense streaming model above
# would overstate its weights per step, so such configs are refused rather than misjudged
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def model_from_config(path) -> ModelSpec:
    """The ModelSpec of a decoder-only Hugging Face config.json (Llama, Qwen2, Mistral and the
    like: grouped-query attention and a gated MLP). BadArgument naming the file and the key for
    a missing or bad field, or a mixture of experts."""
    import json
    import math
    import os

    try:
        with open(path) as f:
            c = json.load(f)
    except (OSError, ValueError) as exc:
        raise BadArgument(f"cannot read model config {path}: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    if not isinstance(c, dict):
        raise BadArgument(f"{path} is not a config.json (a JSON object)")
    moe = [k for k in MOE_KEYS if c.get(k)]
    if moe:
        raise BadArgument(f"{path}: a mixture of experts ({moe[0]}) is not supported: the "
                          f"simulation streams every weight each step")

    def field(key, default=None):
        v = c.get(key, default)
        if v is None:
            raise BadArgument(f"{path}: missing {key!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v <= 0 or v != int(v):
            raise BadArgument(f"{path}: {key!r} must be a positive integer, got {v!r}")
        return int(v)

    heads = field("num_attention_heads")
    hidden = field("hidden_size")
    head_dim = field("head_dim", c.get("head_dim") or hidden // heads)
    stem = os.path.splitext(os.path.basename(path))[0]
    folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return ModelSpec(
        name=c.get("_name_or_path") or (folder if stem == "config" else stem),
        layers=field("num_hidden_layers"), hidden=hidden, heads=heads,
        kv_heads=field("num_key_value_heads", heads), head_dim=head_dim,
        ffn=field("intermediate_size"), vocab=field("vocab_size"),
        tied_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_context=field("max_position_embeddings"),
        qkv_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")))


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One card. Bandwidth in GB/s (1e9 B/s), capacity in GB (1e9 B), compute in TFLOPS."""

    name: str
    bandwidth_gbps: float
    capacity_gb: float
    tflops_bf16: float
    tops_int8: float
    emu_preset: str                 # the emulated memory standing for this card's DRAM
    emu_channels: int | None        # channel count override of that preset (None: preset's)
    link_gbps: float                # card-to-card bandwidth for tensor-parallel all-reduce
    link_latency_us: float          # per all-reduce hop
    layer_overhead_us: float        # kernel launches and syncs per layer per step
    request_overhead_us: float      # per running request per step (scheduling, sampling)
    source: str

    def peak_tflops(self, dtype: str) -> float:
        return self.tops_int8 if dtype == "int8" else self.tflops_bf16


ACCELERATORS = {
    "mlu370-x4": Accelerator(
        "mlu370-x4", 307.2, 24.0, 96.0, 256.0, "mlu370-x4", None, 32.0, 10.0, 40.0, 50.0,
        "24 GB LPDDR5, 384 bit x 6400 MT/s = 307.2 GB/s (the ODMA paper); 96 TFLOPS BF16 and "
        "256 TOPS INT8 are the MLU370 family's published figures (the X4's own is not published: "
        "an assumption); PCIe 4.0 x16 between cards (no MLU-Link on the X4, an assumption); "
        "per-layer and per-request overheads are assumptions of the size BLIS fits on an H100 "
        "(~44 us per layer, ~49 us per request)"),
    "a100-80gb": Accelerator(
        "a100-80gb", 2039.0, 80.0, 312.0, 624.0, "hbm2-2000", 80, 300.0, 5.0, 40.0, 50.0,
        "NVIDIA A100 80GB SXM datasheet: 2,039 GB/s HBM2e, 312 TFLOPS BF16, 624 TOPS INT8; "
        "NVLink 600 GB/s bidirectional = 300 GB/s per direction; memory timing from the "
        "emulated HBM2 pseudo channel (gem5's HBM_2000) x 80 channels"),
}


def accelerator(name: str) -> Accelerator:
    if name not in ACCELERATORS:
        raise BadArgument(f"unknown device preset {name!r}: expected one of "
                          f"{', '.join(ACCELERATORS)}")
    return ACCELERATORS[name]
