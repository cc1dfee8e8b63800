"""The models the engine builds: the shipped configs (allocator/serving/configs), the
architectures it runs, the one check of a config.json every command makes (simulate sizes the
model it describes; the engine and calibrate build it), what a config says about the KV cache,
and the checks of a model's weights and memory made before any weight exists. Light to import:
transformers is loaded only to read a config, safetensors only to read weights' headers."""

from __future__ import annotations

import importlib
import math
import pathlib

from odma_cli import docfile
from odma_cli.errors import BadArgument, DeviceUnavailable, one_line

SUPPORTED = ("llama", "qwen2", "mistral")
CONFIG_DIR = pathlib.Path(__file__).with_name("configs")
DTYPES = {"float32": 4, "bfloat16": 2}     # the engine's dtypes and their bytes per element

# A count beyond this is a corrupt config, not a model: torch sizes many kernels' dimensions in
# 32-bit places, and no published decoder comes near it.
MAX_CONFIG_COUNT = 2**31 - 1
# Layers beyond this are not a model either (the deepest published decoders have a few
# hundred), and transformers builds a list a layer as it reads a config: for 2**31 layers it
# never ends, where a million take milliseconds and leave the refusal to the memory checks
MAX_LAYERS = 1 << 20
# key -> whether a config must give it; the counts every command sizes the model with
COUNT_KEYS = {"num_hidden_layers": True, "hidden_size": True, "num_attention_heads": True,
              "intermediate_size": True, "vocab_size": True, "max_position_embeddings": True,
              "num_key_value_heads": False, "head_dim": False, "sliding_window": False}
# numbers that must be positive and finite where given: an epsilon <= 0 under a norm's square
# root makes every logit NaN, a rope base <= 0 every angle
POSITIVE_KEYS = ("rms_norm_eps", "rope_theta")
FLAG_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
# the rope scaling block, under its transformers 4 and 5 names
ROPE_KEYS = ("rope_scaling", "rope_parameters")
# a mixture of experts reads only its routed experts per token: simulate's dense streaming model
# would overstate its weights per step and the engine builds dense models, so such configs are
# refused rather than misjudged
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
# the engine's prompts are token ids from this one up (engine.serve.prompt_ids), clear of the
# special tokens most vocabularies put first
FIRST_PROMPT_ID = 3
# checkpoint formats the engine does not read: a folder holding only these would otherwise run
# on random weights without a word
OTHER_CHECKPOINTS = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
# what safetensors calls the floating-point types; an integer tensor is not a weight torch's
# load_state_dict should quietly cast
FLOAT_WEIGHTS = ("F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2")


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def need(module: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise DeviceUnavailable(f"the engine needs {module} ({exc}); pip install "
                                f"'odma-hw[{extra}]'") from None


def config_path(spec: str) -> tuple[pathlib.Path, pathlib.Path | None]:
    """(the config.json, the model's folder or None) of a config file, a directory holding
    config.json, or a shipped config's name."""
    path = pathlib.Path(spec)
    if spec in shipped_configs():
        return CONFIG_DIR / f"{spec}.json", None
    if path.is_dir():
        return path / "config.json", path
    if not path.is_file():
        raise BadArgument(f"--model {spec!r} is neither a config.json, a directory holding one, "
                          f"nor a shipped config ({', '.join(shipped_configs())})")
    return path, None


def read_config(path) -> tuple[dict, dict]:
    """(the JSON object of a config.json, what check_config returns of it)."""
    data = _json(path)
    return data, check_config(data, path)


def _json(path):
    return docfile.load_document(path, "model config", as_json=True)


def check_config(data, path) -> dict:
    """The counts and numbers of a decoder config.json (Llama, Qwen2, Mistral and the like:
    grouped-query attention and a gated MLP), checked as every command needs them, before any
    weight exists: each count a whole number in [1, MAX_CONFIG_COUNT] (an integral float is
    taken as its integer), the query heads a multiple of the KV heads (each KV head serves a
    whole group), a head size that divides the hidden size where the config gives none (and
    always for Llama, as transformers' LlamaConfig demands), epsilon and rope base positive, the
    flags true or false, a rope scaling block a table naming its type, the activation a name.
    Returns {key: value} of the keys checked, integers as int, with num_key_value_heads and
    head_dim filled in where the config leaves them out. BadArgument naming the file and the
    key."""
    if not isinstance(data, dict):
        raise BadArgument(f"{path} is not a config.json (a JSON object)")
    moe = [k for k in MOE_KEYS if data.get(k)]
    if moe:
        raise BadArgument(f"{path}: a mixture of experts ({moe[0]}) is not supported: the "
                          f"simulation streams every weight each step, the engine builds dense "
                          f"layers")

    def bad(key, what):
        shown = data[key]
        shown = repr(shown) if len(repr(shown)) <= 60 else repr(shown)[:57] + "..."
        return BadArgument(f"{path}: {key!r} must be {what}, got {shown}")

    out = {}
    for key, required in COUNT_KEYS.items():
        v = data.get(key)
        most = MAX_LAYERS if key == "num_hidden_layers" else MAX_CONFIG_COUNT
        if v is None:
            if required:
                raise BadArgument(f"{path}: missing {key!r}")
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v != int(v) or not 1 <= v <= most:
            raise bad(key, f"a whole number in [1, {most}]")
        out[key] = int(v)
    heads, hidden = out["num_attention_heads"], out["hidden_size"]
    out.setdefault("num_key_value_heads", heads)
    if heads % out["num_key_value_heads"]:
        raise bad("num_key_value_heads", f"a divisor of num_attention_heads ({heads}): each KV "
                                         f"head serves a whole group of query heads")
    if hidden % heads and ("head_dim" not in out or data.get("model_type") == "llama"):
        why = ("transformers' Llama demands it" if "head_dim" in out
               else "the config gives no head_dim to take instead")
        raise BadArgument(f"{path}: 'hidden_size' {hidden} is not a multiple of "
                          f"num_attention_heads ({heads}): {why}")
    out.setdefault("head_dim", hidden // heads)
    for key in POSITIVE_KEYS:
        v = data.get(key)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v <= 0:
                raise bad(key, "a finite number > 0")
            out[key] = float(v)
    for key in FLAG_KEYS:
        if data.get(key) is not None and not isinstance(data[key], bool):
            raise bad(key, "true or false")
    for key in ROPE_KEYS:
        v = data.get(key)
        if v is None:
            continue
        kind = v.get("rope_type", v.get("type", "default")) if isinstance(v, dict) else None
        if not isinstance(kind, str):
            raise bad(key, 'null or a table naming its "rope_type"')
        factor = v.get("factor")
        if factor is not None and (isinstance(factor, bool) or
                                   not isinstance(factor, (int, float)) or
                                   not math.isfinite(factor) or factor <= 0):
            raise BadArgument(f"{path}: {key!r} has factor {factor!r}: it must be a finite "
                              f"number > 0")
    act = data.get("hidden_act")
    if act is not None and not isinstance(act, str):
        raise bad("hidden_act", "the name of an activation")
    return out


def load_config(spec: str):
    """(transformers config, the model's folder or None) for a config file, a directory holding
    config.json (and maybe weights: see check_weights), or a shipped config's name: the config
    checked by check_config, then by what transformers implements (the architecture, the
    activation, the rope type), then built by transformers; BadArgument in one line for
    anything it refuses."""
    transformers = need("transformers", "engine")
    path, folder = config_path(spec)
    data = _json(path)
    kind = data.get("model_type") if isinstance(data, dict) else None
    if kind not in SUPPORTED:
        raise BadArgument(f"{path}: model_type {kind!r} is not supported (the engine runs "
                          f"{', '.join(SUPPORTED)})")
    checked = check_config(data, path)
    if checked["vocab_size"] <= FIRST_PROMPT_ID:
        raise BadArgument(f"{path}: 'vocab_size' {checked['vocab_size']} leaves no token for "
                          f"the engine's prompts (it draws ids {FIRST_PROMPT_ID}.., clear of the "
                          f"special tokens)")
    activations = importlib.import_module("transformers.activations").ACT2FN
    act = data.get("hidden_act")
    if act is not None and act not in activations:
        raise BadArgument(f"{path}: 'hidden_act' {act!r} is not an activation transformers "
                          f"knows ({', '.join(sorted(activations))})")
    ropes = {"default", *importlib.import_module("transformers.modeling_rope_utils")
             .ROPE_INIT_FUNCTIONS}
    for key in ROPE_KEYS:
        v = data.get(key)
        if v is not None and v.get("rope_type", v.get("type", "default")) not in ropes:
            raise BadArgument(f"{path}: {key!r} names rope type "
                              f"{v.get('rope_type', v.get('type'))!r}: transformers knows "
                              f"{', '.join(sorted(ropes))}")
    # the values as checked (2.0 layers as 2, an epsilon of 1 as 1.0): transformers' configs
    # are strict about types; a number given as null is absent (transformers' default), as
    # check_config takes it
    data = {k: checked.get(k, v) for k, v in data.items()
            if k != "model_type" and not (k in POSITIVE_KEYS and v is None)}
    try:
        config = transformers.AutoConfig.for_model(kind, **data)
    except Exception as exc:            # noqa: BLE001  (its validators raise their own kinds)
        raise BadArgument(f"{path}: not a valid {kind} config: {one_line(exc)}") from None
    return config, folder


def check_attention_window(config, max_model_len: int, name: str) -> None:
    """BadArgument for a config whose layers attend over a sliding window shorter than the
    longest request: the engine attends over the whole context, so its tokens would not be the
    model's. (simulate accepts such a config: it only sizes the KV, and sizes it whole.)"""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    sliding = window is not None and (types is None or "sliding_attention" in types)
    if sliding and window < max_model_len:
        raise BadArgument(f"{name}: a sliding window of {window} tokens, shorter than the "
                          f"{max_model_len}-token max model length, is not supported by the "
                          f"engine (it attends over the whole context): lower --max-model-len "
                          f"to {window}, or serve it with simulate")


def check_weights(folder) -> list[pathlib.Path]:
    """The safetensors files of a model's folder (none: random weights), each one's header read
    before any weight is built: a file that is not a readable safetensors file (truncated,
    empty, a header larger than the file, a directory), a tensor in two files, a tensor that is
    not floating point, or a folder holding only checkpoints of other formats is a BadArgument
    naming it. Tensors' values are read only when the weights load."""
    folder = pathlib.Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in folder.iterdir() if p.suffix in OTHER_CHECKPOINTS)
        if other:
            raise BadArgument(f"{folder} holds {other[0]} but no .safetensors file: the engine "
                              f"reads safetensors weights only (convert them, or name the "
                              f"config.json alone for random weights)")
        return []
    safetensors = need("safetensors", "engine")
    seen: dict = {}
    for f in files:
        if not f.is_file():
            raise BadArgument(f"weights {f} are not a file")
        try:
            with safetensors.safe_open(str(f), framework="numpy") as st:
                dtypes = {key: st.get_slice(key).get_dtype() for key in st.keys()}
        except (safetensors.SafetensorError, OSError, ValueError) as exc:
            raise BadArgument(f"cannot read weights {f}: "
                              f"{one_line(getattr(exc, 'strerror', None) or exc)}") from None
        for key, dtype in dtypes.items():
            if key in seen:
                raise BadArgument(f"tensor {key!r} is in both {seen[key].name} and {f.name}: "
                                  f"which one is the model's is ambiguous")
            seen[key] = f
            if dtype not in FLOAT_WEIGHTS:
                raise BadArgument(f"weights {f}: tensor {key!r} is {dtype}, not a "
                                  f"floating-point weight")
    return files


def check_memory(needs: dict, free_bytes: int | None, where: str) -> None:
    """BadArgument when what a run would hold at once ({what: bytes}) is more than the
    `free_bytes` free on the device `where` (host: available RAM; an accelerator: its free
    memory; None: unknown, nothing checked), before any of it is allocated."""
    total = sum(needs.values())
    if free_bytes is not None and total > free_bytes:
        parts = " + ".join(f"{what} {_gb(n)}" for what, n in needs.items() if n)
        raise BadArgument(f"this run needs {_gb(total)} ({parts}), more than the "
                          f"{_gb(free_bytes)} free on {where}")


def _gb(n: int) -> str:
    return f"{n / 1e9:.3g} GB"


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def with_layers(config, layers: int):
    """A copy of `config` with `layers` decoder layers (calibration and launch counts run models
    cut, or grown, to a few layers); a per-layer list (layer_types) is cut to match, or grown
    with its first entry."""
    cut = type(config).from_dict(config.to_dict())
    cut.num_hidden_layers = layers
    types = getattr(cut, "layer_types", None)
    if types:
        cut.layer_types = (list(types) + [types[0]] * layers)[:layers]
    return cut


def kv_bytes_per_token(config, dtype: str) -> int:
    """K and V of every layer and KV head, in the model's dtype."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim(config) * \
        DTYPES[dtype]
