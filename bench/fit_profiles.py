"""Refit the engine profiles (allocator/serving/engine_profiles/*.toml) from the published points each
states in its [[fit_points]], through the simulator itself, and print (or write) the terms.

    .venv/bin/python bench/fit_profiles.py [NAME ...] [--write] [--check]

For each profile, the terms its `fitted` list names are fitted; the others keep the values the
file gives. Every point is simulated as its source measured it (card, model, lengths, a batch
sent at once, the vLLM scheduler of that version) with the fitted terms at zero (efficiency 1),
then with each term alone moved: the step time is linear in every overhead and in 1 / efficiency
- 1 (the extra time per byte of weights streamed), so these differences are the columns of a
least-squares problem in the published times (each point's error relative to its published
figure), solved with every term >= 0 (exactly: the best of the unconstrained fits on every subset
of the terms whose solution is non-negative). Terms are rounded to 0.1 us and 0.001 of
efficiency. --write puts them into the file; --check exits 1 when a file's terms are not what the
fit gives. No point of bench/fidelity_published.py is a fit point.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import sys

import numpy as np

from allocator.serving.cards.profiles import engine_profile, load_profile, model_path, profile_names
from allocator.serving.sim.simulation import simulate
from allocator.trace import RequestTrace

# vLLM's schedulers by version and entry point: V0 prefills whole prompts first; V1 chunks them
# at its default token budget, 16,384 for the offline LLM class and, for the OpenAI server,
# 8,192 on >= 70 GB cards other than the A100 and 2,048 elsewhere
SCHEDULERS = {"v0": dict(paged_layout="v06"),
              "v1-offline": dict(max_batched_tokens=16384, max_batch=1024, paged_layout="nhd"),
              "v1-server-2048": dict(max_batched_tokens=2048, max_batch=256, paged_layout="nhd"),
              "v1-server-8192": dict(max_batched_tokens=8192, max_batch=1024, paged_layout="nhd")}
STEP_US = 100.0             # the move of an overhead term that gives its column
STEP_X = 0.25               # the move of 1 / efficiency - 1


def seconds(point: dict, profile) -> float:
    """The simulated time the point's metric measures: a request's whole time (speed = output
    tokens / it), the batch's (batch latency) or the median time per output token."""
    n = point["batch"]
    trace = RequestTrace(np.full(n, point["input"]), np.full(n, point["output"]), None,
                         name=point["id"])
    r = simulate(trace, ["paged"], model=model_path(point["model"]), device=point["card"],
                 max_model_len=point["input"] + point["output"], memory_utilization=0.9,
                 concurrency=point.get("concurrency"), engine_profile=profile,
                 **SCHEDULERS[point["scheduler"]])[0]
    return {"speed_tps": r["e2e_s"]["p50"], "batch_latency_ms": r["duration_s"],
            "tpot_p50_ms": r["tpot_s"]["p50"]}[point["metric"]]


def published_seconds(point: dict) -> float:
    if point["metric"] == "speed_tps":
        return point["output"] / point["published"]
    return point["published"] / 1e3                 # batch_latency_ms, tpot_p50_ms


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a x - b| with x >= 0, exactly, over the subsets of columns (a handful of terms)."""
    best, best_x = np.inf, np.zeros(a.shape[1])
    cols = range(a.shape[1])
    for k in range(a.shape[1] + 1):
        for subset in itertools.combinations(cols, k):
            x = np.zeros(a.shape[1])
            if subset:
                x[list(subset)] = np.linalg.lstsq(a[:, subset], b, rcond=None)[0]
            if (x < 0).any():
                continue
            res = float(np.sum((a @ x - b) ** 2))
            if res < best - 1e-15:
                best, best_x = res, x
    return best_x


def rounded(term: str, value: float) -> float:
    return float(round(value, 3) if term == "weight_read_efficiency" else round(value, 1))


def fit(profile) -> tuple[dict, list]:
    """({term: fitted value}, [(point, published s, simulated s)] with those values)."""
    terms = list(profile.fitted)
    zero = {t: (1.0 if t == "weight_read_efficiency" else 0.0) for t in terms}
    base = dataclasses.replace(profile, **zero)
    points = profile.fit_points
    t0 = np.array([seconds(p, base) for p in points])
    cols = []
    for t in terms:
        moved = (1.0 / (1.0 + STEP_X) if t == "weight_read_efficiency" else STEP_US)
        d = STEP_X if t == "weight_read_efficiency" else STEP_US
        tm = np.array([seconds(p, dataclasses.replace(base, **{t: moved})) for p in points])
        cols.append((tm - t0) / d)
    target = np.array([published_seconds(p) for p in points])
    a = np.array(cols).T / target[:, None]
    x = nnls(a, (target - t0) / target) if terms else np.zeros(0)
    values = {}
    for t, v in zip(terms, x):
        values[t] = rounded(t, 1.0 / (1.0 + v) if t == "weight_read_efficiency" else v)
    fitted = dataclasses.replace(profile, **values)
    rows = [(p, published_seconds(p), seconds(p, fitted)) for p in points]
    return values, rows


def write(path: str, values: dict) -> None:
    text = open(path, encoding="utf-8").read()
    for t, v in values.items():
        text, n = re.subn(rf"(?m)^{t}\s*=\s*[-+0-9.eE]+", f"{t} = {v!r}", text)
        if n != 1:
            raise SystemExit(f"{path}: no one line '{t} = NUMBER' to write")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = [a for a in argv if not a.startswith("--")] or profile_names()
    differ = []
    for name in names:
        profile = engine_profile(name)
        values, rows = fit(profile)
        print(f"{profile.name} ({profile.engine} {profile.version}): "
              + ", ".join(f"{t} = {v}" for t, v in values.items()))
        for p, pub, sim in rows:
            load = f"x{p['batch']}" + (f" c{p['concurrency']}" if "concurrency" in p else "")
            print(f"  {p['id']:<28} {p['model']:<14} {p['card']:<16} in {p['input']:>6} out "
                  f"{p['output']:>5} {load:<10} published {pub:9.4g} s  simulated "
                  f"{sim:9.4g} s  {sim / pub - 1:+.1%}")
        shipped = {t: getattr(profile, t) for t in values}
        if shipped != values:
            differ.append(f"{profile.path}: ships {shipped}, the fit gives {values}")
            if "--write" in argv:
                write(profile.path, values)
                load_profile(profile.path)          # still a valid profile
                print(f"  written to {profile.path}")
    if differ and "--check" in argv:
        print("\n".join(differ))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
