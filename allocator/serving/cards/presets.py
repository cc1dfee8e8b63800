"""Models and accelerators as plain numbers: what a decode step reads and computes, and how fast
a card reads, computes and talks to its peers.

Model numbers are each model's published config.json (layers, hidden size, heads, KV heads, head
dimension, FFN size, vocabulary, whether the embedding is tied); parameters are derived from
them, not copied. Accelerators are card files (TOML or JSON; the presets are
allocator/serving/cards/*.toml) whose numbers carry their source in `source`; figures nobody
publishes (MLU370-X4's own FLOPS, its per-kernel overheads) are marked as assumptions there.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib

from odma_cli import docfile
from odma_cli.errors import BadArgument
from odma_cli.keys import check_keys

from allocator.serving.cards import datafile
from allocator.serving.cards.datafile import (BANDWIDTH_GBPS, CAPACITY_GB, FRACTION, MICROSECONDS,
                                              TFLOPS, Range)

DTYPE_BYTES = {"bf16": 2, "int8": 1, "fp32": 4}
# both spellings of a dtype, as torch and as vLLM's short names
DTYPE_SPELLINGS = {"fp32": "float32", "float32": "fp32", "bf16": "bfloat16", "bfloat16": "bf16",
                   "fp16": "float16", "float16": "fp16", "int8": "int8"}


def auto_dtype(dtype: str, card_dtype: str | None, on_cpu: bool = False) -> str:
    """`dtype`, or where it is auto the one rule of simulate and the engine (in simulate's
    spelling): the type a card's figures were measured at (calibrate writes it), else float32
    on a CPU (the engine's own there: bf16 matmuls are an extension some CPUs lack), else bf16."""
    if dtype != "auto":
        return dtype
    return card_dtype or ("fp32" if on_cpu else "bf16")


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
    kv_dtype_bytes: int = 2          # bf16 KV for bf16 and int8 weights (fp32: ServingSetup)

    @property
    def layer_params(self) -> int:
        """Weights of one layer: q, k, v, o projections, the gated MLP, two norms."""
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return sum(k * n for k, n in self.layer_products) + bias + 2 * self.hidden

    @property
    def layer_products(self) -> tuple:
        """(in, out) features of each matrix product of one layer: the q, k, v and o
        projections, the gated MLP's gate, up and down."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return ((self.hidden, q), (self.hidden, kv), (self.hidden, kv), (q, self.hidden),
                (self.hidden, self.ffn), (self.hidden, self.ffn), (self.ffn, self.hidden))

    @property
    def stack_products(self) -> dict:
        """{(in, out): how many}: every layer's matrix products, which all of a step's tokens go
        through (only each sequence's last token goes on through the LM head)."""
        return dict(collections.Counter(self.layer_products * self.layers))

    @property
    def decode_products(self) -> dict:
        """{(in, out): how many}: the matrix products of a decode step, every layer's and the LM
        head's, each over the step's rows (the products its streamed weights go through)."""
        count = collections.Counter(self.stack_products)
        count[(self.hidden, self.vocab)] += 1
        return dict(count)

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
        2 per weight of the layers and final norm per token, the LM head for the last token
        only (an engine computes logits where it samples), plus causal attention over cached +
        new tokens."""
        head = self.vocab * self.hidden
        return (2.0 * (self.streamed_params - head) * prompt + 2.0 * head
                + self.prefill_attention_flops(prompt, cached))

    def prefill_attention_flops(self, prompt: int, cached: int = 0) -> float:
        """prefill_flops' attention: QK^T and AV of `prompt` new tokens, causal, over `cached`
        tokens before them and themselves."""
        return 4.0 * self.layers * self.heads * self.head_dim * (
            prompt * cached + prompt * (prompt + 1) / 2)


# config.json of each model (Hugging Face): DeepSeek-R1-Distill-Qwen-7B is the Qwen2.5-7B
# architecture (with q/k/v biases); Llama 3 8B, Llama 3.1 8B and Llama 2 7B as published by
# Meta.
MODELS = {
    "deepseek-r1-distill-qwen-7b": ModelSpec("deepseek-r1-distill-qwen-7b", 28, 3584, 28, 4, 128,
                                             18944, 152064, False, 131072, qkv_bias=True),
    "llama-3-8b": ModelSpec("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, False, 8192),
    # Llama 3.1 8B: Llama 3 8B's shapes with a 128k context (rope scaling)
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, False,
                              131072),
    "llama-2-7b": ModelSpec("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000, False, 4096),
}
MODEL_ALIASES = {"qwen2.5-7b": "deepseek-r1-distill-qwen-7b"}
# the ODMA paper's setting: what simulate and advise serve, and on what, unless told
DEFAULT_MODEL = "deepseek-r1-distill-qwen-7b"
DEFAULT_CARD = "mlu370-x4"


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
    if os.path.exists(name):       # a file, or a pipe (`--model <(...)`)
        return model_from_config(name)
    raise BadArgument(f"unknown --model {name!r}: expected a Hugging Face config.json (or a "
                      f"directory holding one), a shipped config ({', '.join(shipped_configs())})"
                      f" or one of {', '.join(list(MODELS) + list(MODEL_ALIASES))}")


def model_from_config(path) -> ModelSpec:
    """The ModelSpec of a decoder-only Hugging Face config.json (Llama, Qwen2, Mistral and the
    like: grouped-query attention and a gated MLP), read and checked as the engine reads it
    (models.read_config): BadArgument naming the file and the key for a missing or bad field,
    or a mixture of experts. A sliding window is accepted and ignored: the simulation sizes
    every request's KV whole, as the engine keeps it."""
    import os

    from allocator.serving.models import read_config

    c, n = read_config(path)
    stem = os.path.splitext(os.path.basename(path))[0]
    folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
    name = c.get("_name_or_path")
    return ModelSpec(
        name=name if isinstance(name, str) and name else (folder if stem == "config" else stem),
        layers=n["num_hidden_layers"], hidden=n["hidden_size"], heads=n["num_attention_heads"],
        kv_heads=n["num_key_value_heads"], head_dim=n["head_dim"], ffn=n["intermediate_size"],
        vocab=n["vocab_size"], tied_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_context=n["max_position_embeddings"],
        qkv_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")))


CARD_DIR = pathlib.Path(__file__).parent

# Nobody publishes these cards' per-kernel costs, so one set of defaults serves every card: they
# are assumptions of the size BLIS fits on an H100 (~44 us per layer, ~49 us per request).
LAYER_OVERHEAD_US = 40.0            # kernel launches and syncs per layer per step
REQUEST_OVERHEAD_US = 50.0          # per running request per step (scheduling, sampling)
# per running request per layer per step: 0 for engines that batch attention over requests;
# one that launches attention once per request per layer (odma-hw's own engine on CPU) pays it
LAYER_REQUEST_OVERHEAD_US = 0.0


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One card, as a card file describes it (allocator/serving/cards holds the presets).
    Bandwidth in GB/s (1e9 B/s), capacity in GB (1e9 B), compute in TFLOPS."""

    name: str
    bandwidth_gbps: float
    capacity_gb: float
    tflops_bf16: float
    timing: str                     # emu:PRESET, probe:ABSOLUTE-FILE or ideal
    link_gbps: float                # card-to-card bandwidth for tensor-parallel all-reduce
    link_latency_us: float          # per all-reduce hop
    tops_int8: float | None = None
    tflops_fp32: float | None = None
    emu_channels: int | None = None  # channel count override of the emu preset (None: preset's)
    layer_overhead_us: float = LAYER_OVERHEAD_US
    request_overhead_us: float = REQUEST_OVERHEAD_US
    layer_request_overhead_us: float = LAYER_REQUEST_OVERHEAD_US
    step_overhead_us: float = 0.0   # per step, whatever its batch and depth (sampling, LM head)
    # the same of steps that run prompts (whole or chunks), where an engine runs those
    # differently (eagerly where its decode steps replay CUDA graphs): per step, per layer, per
    # prompt per layer; None: the decode steps' overheads
    prefill_step_overhead_us: float | None = None
    prefill_layer_overhead_us: float | None = None
    prefill_layer_request_overhead_us: float | None = None
    # per layer, for each prompt piece that starts after tokens already in the KV cache (a
    # chunk after a prompt's first, a prompt after its cached prefix), beyond the prefill
    # terms: an engine attends such a piece over the cache, not as a whole prompt of its own
    chunk_layer_overhead_us: float = 0.0
    # the share of the sequential read rate at which the serving engine's decode streams the
    # weights (its matrix-vector kernels); an engine profile (allocator/serving/profiles) sets it
    weight_read_efficiency: float = 1.0
    mfu: float | None = None        # replaces simulate's default --mfu where given
    # measured matrix-product throughput by rows (tokens) in the product, ((rows, TFLOPS), ...):
    # where given, a step's compute runs at its row count's throughput instead of peak x mfu
    matmul_tflops: tuple | None = None
    # the same of the layers' products alone, ((rows, TFLOPS), ...): where given with
    # matmul_tflops, a prompt step's tokens go through the layers at their row count's rate and
    # only its sequences' last tokens through the LM head (the head's time the whole set's less
    # the layers'), as an engine computes logits where it samples
    layer_matmul_tflops: tuple | None = None
    # the serving engine's own read rate of KV runs by run bytes, ((bytes, GB/s), ...), as its
    # attention kernel reads them (calibrate measures it): where given, a step's KV reads cost
    # this instead of the memory's rate from `timing`, which still sizes extents and weights
    engine_run_gbps: tuple | None = None
    # the hardware the card describes, as its driver names it ("NVIDIA H100 80GB HBM3"): a
    # probe file the card's timing names must be of that device
    device_name: str | None = None
    # the weight and KV type the card's measured figures are of (bf16, fp32): --dtype auto
    dtype: str | None = None
    source: str = ""
    path: str = ""                  # the card file

    @property
    def file(self) -> str | None:
        """The card file of a user's card; None for a preset (its name says which)."""
        if not self.path or pathlib.Path(self.path).resolve().parent == CARD_DIR.resolve():
            return None
        return self.path

    def peak_tflops(self, dtype: str) -> float:
        """Peak compute for weights of `dtype`; BadArgument when the card gives no figure."""
        key = DTYPE_PEAK_KEYS.get(dtype)
        if key is None:
            raise BadArgument(f"unknown dtype {dtype!r}: expected one of "
                              f"{', '.join(DTYPE_PEAK_KEYS)}")
        value = getattr(self, key)
        if value is None:
            raise BadArgument(f"card {self.path or self.name}: --dtype {dtype} needs {key!r}, "
                              f"which card {self.name} does not give")
        return value


# the card key giving each weight type's peak compute
DTYPE_PEAK_KEYS = {"bf16": "tflops_bf16", "int8": "tops_int8", "fp32": "tflops_fp32"}

# key -> (required, what it must be: text, a count, a matmul table or the Range of a number);
# the order is the order a message lists them in
CARD_KEYS = {
    "name": (True, "text"),
    "bandwidth_gbps": (True, BANDWIDTH_GBPS),
    "capacity_gb": (True, CAPACITY_GB),
    "tflops_bf16": (True, TFLOPS),
    "timing": (True, "text"),
    "link_gbps": (True, BANDWIDTH_GBPS),
    "link_latency_us": (True, MICROSECONDS),
    "tops_int8": (False, TFLOPS),
    "tflops_fp32": (False, TFLOPS),
    "emu_channels": (False, "count"),
    "layer_overhead_us": (False, MICROSECONDS),
    "request_overhead_us": (False, MICROSECONDS),
    "layer_request_overhead_us": (False, MICROSECONDS),
    "step_overhead_us": (False, MICROSECONDS),
    "prefill_step_overhead_us": (False, MICROSECONDS),
    "prefill_layer_overhead_us": (False, MICROSECONDS),
    "prefill_layer_request_overhead_us": (False, MICROSECONDS),
    "chunk_layer_overhead_us": (False, MICROSECONDS),
    "weight_read_efficiency": (False, FRACTION),
    "mfu": (False, FRACTION),
    "matmul_tflops": (False, "table"),
    "layer_matmul_tflops": (False, "table"),
    "engine_run_gbps": (False, "rate table"),
    "device_name": (False, "text"),
    "dtype": (False, "dtype"),
    "source": (False, "text"),
}


def card_names() -> list[str]:
    """The preset cards: the files of allocator/serving/cards, by name."""
    return sorted(p.stem for p in CARD_DIR.glob("*.toml"))


def _card_value(path, key: str, v):
    where = f"card {path}"
    kind = CARD_KEYS[key][1]
    if isinstance(kind, Range):
        return datafile.number(where, key, v, kind)
    if kind == "table":
        rows = datafile.table(where, key, v, datafile.MAX_MATMUL_ROWS, TFLOPS)
        if len(rows) < 2:
            # one row's figure would cost every step, a decode of 1 row as a prefill of 256,
            # at that one throughput: several times off on a CPU, and nothing would say so
            raise BadArgument(f"{where}: {key!r} needs at least 2 rows to interpolate between "
                              f"(a prefill and a decode row count), got {datafile.shown(v)}; "
                              f"for one throughput at every row count, give tflops_* and mfu "
                              f"instead")
        return tuple(rows.items())
    if kind == "rate table":
        rows = datafile.table(where, key, v, datafile.MAX_RUN_BYTES, BANDWIDTH_GBPS)
        if len(rows) < 2:
            raise BadArgument(f"{where}: {key!r} needs at least 2 run sizes to interpolate "
                              f"between, got {datafile.shown(v)}")
        return tuple(rows.items())
    if kind == "dtype":
        name = DTYPE_SPELLINGS.get(v) if isinstance(v, str) else None
        short = v if v in DTYPE_BYTES else name
        if short not in DTYPE_BYTES:
            raise BadArgument(f"{where}: 'dtype' must be one of {', '.join(DTYPE_BYTES)} (or "
                              f"float32, bfloat16), got {datafile.shown(v)}")
        return short
    if kind == "count":
        ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
        what = "a positive integer"
    else:
        ok = isinstance(v, str) and (bool(v.strip()) or key == "source")
        what = "a non-empty string"
    if not ok:
        raise BadArgument(f"{where}: {key!r} must be {what}, got {datafile.shown(v)}")
    return v


def _card_timing(path, timing: str, channels) -> str:
    """The card's timing source checked, a probe file made absolute (relative to the card's
    folder, so that a card and its probe JSON move together)."""
    import os

    from odma_hw.emu.specs import device_spec, preset_names

    kind, _, arg = timing.partition(":")
    if kind == "emu" and arg:
        if arg not in preset_names():
            raise BadArgument(f"card {path}: 'timing' names unknown emulator preset {arg!r}: "
                              f"expected one of {', '.join(preset_names())}")
        if channels is not None:
            try:
                device_spec(arg, channels=channels)
            except BadArgument as exc:
                raise BadArgument(f"card {path}: 'emu_channels': {exc}") from None
        return timing
    if channels is not None:
        raise BadArgument(f"card {path}: 'emu_channels' applies to emu timing only, not "
                          f"{timing!r}")
    if kind == "probe" and arg:
        probe = os.path.join(os.path.dirname(os.path.abspath(path)), os.path.expanduser(arg))
        if not os.path.isfile(probe) or not os.access(probe, os.R_OK):
            raise BadArgument(f"card {path}: 'timing' names probe file {probe}, which cannot be "
                              f"read")
        return f"probe:{probe}"
    if timing == "ideal":
        return timing
    raise BadArgument(f"card {path}: unknown 'timing' {timing!r}: expected emu:PRESET, "
                      f"probe:FILE or ideal")


def load_card(path) -> Accelerator:
    """An Accelerator from a card file: JSON for a .json file, else TOML, with the keys of
    CARD_KEYS. BadArgument in one line naming the file and the key for anything amiss."""
    import os

    path = os.fspath(path)
    data = docfile.load_document(path, "card", as_json=card_is_json(path))
    fields = card_fields(path, data)
    fields["timing"] = _card_timing(path, fields["timing"], fields.get("emu_channels"))
    if fields.get("device_name") and fields["timing"].startswith("probe:"):
        _check_probe_device(path, fields["timing"].removeprefix("probe:"), fields["device_name"])
    return Accelerator(**fields, path=os.path.abspath(path))


def _check_probe_device(path, probe: str, device_name: str) -> None:
    """A card's probe file must measure the device the card names: a probe of another card
    (an A100's figures under an H100's name, a host's under a GPU's) would pass every other
    check and price every run wrong. BadArgument in one line naming both."""
    data = docfile.load_document(probe, "probe JSON", as_json=True)
    entries = data.get("devices") if isinstance(data, dict) else None
    first = entries[0] if isinstance(entries, list) and entries else None
    measured = first.get("name") if isinstance(first, dict) else None
    if not isinstance(measured, str) or measured.strip().lower() != device_name.strip().lower():
        raise BadArgument(f"card {path}: 'device_name' is {device_name!r}, but its timing's "
                          f"probe file {probe} measured {datafile.shown(measured)}")


def card_is_json(path) -> bool:
    """Whether the card file `path` is JSON (a .json file, any case) rather than TOML."""
    import os

    return os.fspath(path).lower().endswith(".json")


def card_fields(path, data) -> dict:
    """The Accelerator fields of a card's parsed document `data`, every key checked, the timing
    source as written; BadArgument in one line naming the file `path` and the key."""
    check_keys(f"card {path}", data, CARD_KEYS, "a card")
    if "layer_matmul_tflops" in data and "matmul_tflops" not in data:
        # the LM head's time is the whole set's less the layers': nothing to take it from
        raise BadArgument(f"card {path}: 'layer_matmul_tflops' needs 'matmul_tflops' (the "
                          f"layers' and the LM head's products together) beside it")
    fields = {k: _card_value(path, k, v) for k, v in data.items()}
    peak = DTYPE_PEAK_KEYS.get(fields.get("dtype"))
    if peak is not None and fields.get(peak) is None:   # --dtype auto serves the card's dtype
        raise BadArgument(f"card {path}: 'dtype' {fields['dtype']} (the type its figures are "
                          f"of) needs {peak!r} beside it")
    return fields


def accelerator(name_or_path, option: str = "--device") -> Accelerator:
    """A preset card by name (card_names()), or the card a TOML or JSON file describes;
    `option` is the command-line option an error names."""
    import os

    name = os.fspath(name_or_path)
    if name in card_names():
        return load_card(CARD_DIR / f"{name}.toml")
    if os.path.exists(name) or os.sep in name or name.lower().endswith((".toml", ".json")):
        return load_card(name)
    raise BadArgument(f"unknown {option} {name!r}: expected a card file (TOML or JSON) or a "
                      f"preset: {', '.join(card_names())}")
