"""Engine profiles: the serving engine's own per-step terms, one file per engine version.

A card (allocator/serving/cards) says what the hardware does; a profile says what the serving
engine adds on top of it: its CPU and launch overheads per step, per layer, per running request,
and the share of the card's sequential read rate its decode kernels stream the weights at. The
presets are allocator/serving/engine_profiles/*.toml (`odma-hw simulate --engine-profile NAME`; also
any profile file). Each states its engine and version, and for every fitted term the published
measurements it was fitted from (`[[fit_points]]`, each with its source); bench/fit_profiles.py
refits the terms from those points through the simulator and rewrites them.

Applying a profile replaces the card's overhead fields (dataclasses.replace); the card keeps its
bandwidth, compute, timing source and MFU. A profile file is checked whole before any work: an
unknown key, a missing one, a negative or non-finite term: BadArgument in one line naming the
file and the key.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

from odma_cli import docfile
from odma_cli.errors import BadArgument
from odma_cli.keys import check_keys

from allocator.serving.cards import datafile
from allocator.serving.cards.datafile import FRACTION, MICROSECONDS, Range

PROFILE_DIR = pathlib.Path(__file__).parents[1] / "engine_profiles"

# the Accelerator fields a profile sets, and the range of each
TERMS = {
    "step_overhead_us": MICROSECONDS,
    "layer_overhead_us": MICROSECONDS,
    "request_overhead_us": MICROSECONDS,
    "layer_request_overhead_us": MICROSECONDS,
    "weight_read_efficiency": FRACTION,
}
# key -> (required, what it must be); the order is the order a message lists them in
PROFILE_KEYS = {
    "name": (True, "text"),
    "engine": (True, "text"),
    "version": (True, "text"),
    **{k: (True, r) for k, r in TERMS.items()},
    "fitted": (False, "terms"),
    "source": (False, "text"),
    "fit_points": (False, "points"),
}
# one published measurement a profile was fitted from: `batch` requests of the same lengths,
# sent at once, or `concurrency` at a time (a closed loop, as vllm bench serve
# --max-concurrency)
POINT_KEYS = {
    "id": (True, "text"),
    "source": (True, "text"),
    "measured": (True, "text"),
    "card": (True, "text"),
    "model": (True, "text"),
    "input": (True, Range(1, 1 << 24)),
    "output": (True, Range(1, 1 << 24)),
    "batch": (True, Range(1, 1 << 20)),
    "concurrency": (False, Range(1, 1 << 20)),
    "metric": (True, "metric"),
    "published": (True, Range(1e-9, 1e12)),
    "scheduler": (True, "scheduler"),
}
METRICS = ("speed_tps", "batch_latency_ms", "tpot_p50_ms")
SCHEDULERS = ("v0", "v1-offline", "v1-server-2048", "v1-server-8192")


@dataclasses.dataclass(frozen=True)
class EngineProfile:
    name: str
    engine: str
    version: str
    step_overhead_us: float
    layer_overhead_us: float
    request_overhead_us: float
    layer_request_overhead_us: float
    weight_read_efficiency: float
    fitted: tuple = ()
    source: str = ""
    fit_points: tuple = ()          # dicts, as POINT_KEYS describes them
    path: str = ""

    @property
    def terms(self) -> dict:
        return {k: getattr(self, k) for k in TERMS}

    def apply(self, card):
        """The card with this profile's terms in place of its own overheads."""
        return dataclasses.replace(card, **self.terms)


def profile_names() -> list[str]:
    """The preset profiles: the files of allocator/serving/profiles, by name."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def _value(where: str, key: str, v, kind):
    if isinstance(kind, Range):
        return datafile.number(where, key, v, kind)
    if kind == "terms":
        if not (isinstance(v, list) and all(isinstance(t, str) and t in TERMS for t in v)
                and len(set(v)) == len(v)):
            raise BadArgument(f"{where}: {key!r} must be a list of distinct terms of "
                              f"{', '.join(TERMS)}, got {datafile.shown(v)}")
        return tuple(v)
    if kind == "metric" and v not in METRICS:
        raise BadArgument(f"{where}: {key!r} must be one of {', '.join(METRICS)}, got "
                          f"{datafile.shown(v)}")
    if kind == "scheduler" and v not in SCHEDULERS:
        raise BadArgument(f"{where}: {key!r} must be one of {', '.join(SCHEDULERS)}, got "
                          f"{datafile.shown(v)}")
    if kind == "text" and not (isinstance(v, str) and (v.strip() or key == "source")):
        raise BadArgument(f"{where}: {key!r} must be a non-empty string, got "
                          f"{datafile.shown(v)}")
    return v


def _checked(where: str, data, keys: dict) -> dict:
    check_keys(where, data, keys, "a profile")
    return {k: _value(where, k, v, keys[k][1]) for k, v in data.items()}


def load_profile(path) -> EngineProfile:
    """An EngineProfile from a TOML file; BadArgument in one line naming the file and the key
    for anything amiss (an unknown or missing key, a negative or non-finite term, a point
    without its source)."""
    path = os.fspath(path)
    where = f"engine profile {path}"
    data = docfile.load_document(path, "engine profile", as_json=False)
    fields = _checked(where, data, PROFILE_KEYS)
    points = fields.pop("fit_points", [])
    if not isinstance(points, list):
        raise BadArgument(f"{where}: 'fit_points' must be an array of tables ([[fit_points]])")
    checked = []
    for i, p in enumerate(points):
        c = _checked(f"{where}: fit_points[{i}]", p, POINT_KEYS)
        for k in ("input", "output", "batch", "concurrency"):
            if k not in c:
                continue
            if not float(c[k]).is_integer():
                raise BadArgument(f"{where}: fit_points[{i}]: {k!r} must be an integer, got "
                                  f"{datafile.shown(p[k])}")
            c[k] = int(c[k])
        checked.append(c)
    if fields.get("fitted") and not checked:
        raise BadArgument(f"{where}: 'fitted' names terms but no [[fit_points]] say what they "
                          f"were fitted from")
    return EngineProfile(**fields, fit_points=tuple(checked), path=os.path.abspath(path))


def engine_profile(name_or_path, option: str = "--engine-profile") -> EngineProfile:
    """A preset profile by name (profile_names()), or the profile a TOML file describes;
    `option` is the command-line option an error names."""
    name = os.fspath(name_or_path)
    if name in profile_names():
        return load_profile(PROFILE_DIR / f"{name}.toml")
    if os.path.exists(name) or os.sep in name or name.lower().endswith(".toml"):
        return load_profile(name)
    raise BadArgument(f"unknown {option} {name!r}: expected a profile file (TOML) or a "
                      f"preset: {', '.join(profile_names())}")


def model_path(name: str) -> str:
    """What a published point's `model` names, as simulate's --model takes it: a preset or
    shipped config by name, else a config of allocator/serving/engine_profiles/configs
    (published config.json files of the models of the profiles' fit points and of
    bench/fidelity_published.py)."""
    own = PROFILE_DIR / "configs" / f"{name}.json"
    return str(own) if own.is_file() else name
