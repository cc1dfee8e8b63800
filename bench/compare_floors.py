"""The decode steps of one calibration fitted twice, side by side: with the step model's floor
(the products, then the attention, each at its own roofline) and with the larger of the whole
step's reads and FLOPs (the model before it), the overheads refitted each time on the same
measured steps.

    odma-hw calibrate --device torch:cpu --model qwen2.5-0.5b --out cpu.toml --json > cal.json
    .venv/bin/python bench/compare_floors.py cal.json [--json]

Each point of `odma-hw calibrate --json` carries its memory and compute seconds (memory_s,
compute_s) beside the floor calibrate used (floor_s): max(memory_s, compute_s) is the older
floor, so no step is measured again.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from allocator.serving.cards.fit import fit_overheads

FLOORS = {"per-operator": lambda q: q["floor_s"],
          "whole-step": lambda q: max(q["memory_s"], q["compute_s"])}


def refit(points: list, floor) -> dict:
    """The overheads fitted on `points` above `floor`, and each point's relative residual."""
    floors = [floor(q) for q in points]
    step = [q["step_s"] for q in points]
    got = fit_overheads([q["layers"] for q in points], [q["batch"] for q in points],
                        [s - f for s, f in zip(step, floors)], step)
    fitted = np.array(floors) + np.asarray(got.pop("fitted_s"), dtype=float)
    rel = (np.array(step) - fitted) / np.array(step)
    return {"overheads": got, "rms": float(np.sqrt(np.mean(rel ** 2))),
            "max": float(np.abs(rel).max()),
            "residuals": [{"layers": q["layers"], "batch": q["batch"], "context": q["context"],
                           "relative_residual": float(r)} for q, r in zip(points, rel)]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("calibration", help="the output of `odma-hw calibrate --json`")
    parser.add_argument("--json", action="store_true", help="both fits as JSON")
    a = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        with open(a.calibration) as f:
            points = json.load(f)["overheads"]["points"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"compare_floors: {a.calibration}: not the output of `odma-hw calibrate --json` "
              f"({exc})", file=sys.stderr)
        return 2
    fits = {name: refit(points, floor) for name, floor in FLOORS.items()}
    if a.json:
        print(json.dumps(fits, indent=1))
        return 0
    deepest = max(q["layers"] for q in points)
    longest = max(q["context"] for q in points)
    for name, f in fits.items():
        worst = [f"batch {r['batch']} {r['relative_residual']:+.1%}" for r in f["residuals"]
                 if r["layers"] == deepest and r["context"] == longest]
        print(f"{name:13s} rms {f['rms']:.1%}, largest {f['max']:.1%} over {len(points)} steps; "
              f"at {deepest} layers and {longest} tokens: {', '.join(worst)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
