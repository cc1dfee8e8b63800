"""The models the engine builds: the shipped configs (allocator/serving/configs), the
architectures it runs, and what a config says about the KV cache. Light to import: transformers
is loaded only to read a config."""

from __future__ import annotations

import importlib
import json
import pathlib

from odma_hw.errors import BadArgument, DeviceUnavailable

SUPPORTED = ("llama", "qwen2", "mistral")
CONFIG_DIR = pathlib.Path(__file__).with_name("configs")
DTYPES = ("float32", "bfloat16")


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def need(module: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise DeviceUnavailable(f"the engine needs {module} ({exc}); pip install "
                                f"'odma-hw[{extra}]'") from None


def load_config(spec: str):
    """(transformers config, directory of weights or None) for a config file, a directory with
    config.json, or a shipped config's name."""
    transformers = need("transformers", "engine")
    weights = None
    path = pathlib.Path(spec)
    if spec in shipped_configs():
        path = CONFIG_DIR / f"{spec}.json"
    elif path.is_dir():
        weights = path if any(path.glob("*.safetensors")) else None
        path = path / "config.json"
    elif not path.is_file():
        raise BadArgument(f"--model {spec!r} is neither a config.json, a directory holding one, "
                          f"nor a shipped config ({', '.join(shipped_configs())})")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise BadArgument(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") \
            from None
    if not isinstance(data, dict) or data.get("model_type") not in SUPPORTED:
        kind = data.get("model_type") if isinstance(data, dict) else None
        raise BadArgument(f"{path}: model_type {kind!r} is not supported (the engine runs "
                          f"{', '.join(SUPPORTED)})")
    data = dict(data)
    try:
        config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    except (TypeError, ValueError) as exc:
        raise BadArgument(f"{path}: not a valid config: {exc}") from None
    return config, weights


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_bytes_per_token(config, dtype: str) -> int:
    """K and V of every layer and KV head, in the model's dtype."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim(config) * \
        (4 if dtype == "float32" else 2)
