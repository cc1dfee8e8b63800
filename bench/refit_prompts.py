"""One calibration's measured steps (its --json result) fitted again two ways, side by side: the
prompt steps' products priced as the engine runs them (the layers at their own rate, each
sequence's last token through the LM head: the card's layer_matmul_tflops) and at the whole
set's rate (a card without that table). The same steps, the same tables: only the pricing moves.

    odma-hw calibrate --model qwen2.5-0.5b --out cpu.toml --json > cal.json
    python bench/refit_prompts.py cal.json
"""

from __future__ import annotations

import argparse
import json
import sys

from allocator.serving.cards import fit as calfit
from allocator.serving.cards.presets import model_spec
from allocator.serving.sim.timing import MeasuredTiming

KEPT = ("layers", "batch", "context", "prompt", "chunk", "start", "step_s")


def inputs(result: dict) -> tuple:
    """(spec, dtype, steps, timing, each product's table, prefill rows, reads) of a result."""
    o, bw, dtype = result["overheads"], result["bandwidth"], result["dtype"]
    steps = {kind: [{k: q[k] for k in KEPT if k in q} for q in points]
             for kind, points in (("decode", o["points"]), ("prefill", o["prefill"]["points"]),
                                  ("chunked", o["chunked"]["points"]))}
    timing = MeasuredTiming("probe", {int(s): g for s, g in bw["runs_gbps"].items()},
                            bw["seq_gbps"], bw["copy_gbps"])
    each = {tuple(map(int, shape.split("x"))): {int(r): v for r, v in t.items()}
            for shape, t in result["matmul"]["tflops_by_product"][dtype].items()}
    reads = {int(b): g for b, g in result["engine_reads"]["gbps"].items()} or None
    return (model_spec(o["fit_model"]), dtype, steps, timing, each,
            result["matmul"]["prefill_rows"], reads)


def refit(result: dict) -> dict:
    """{"layers apart" | "whole set": {kind: {rms, max}, "card": the prompt terms}}."""
    spec, dtype, steps, timing, each, rows, reads = inputs(result)
    out = {}
    for name, apart in (("layers apart", True), ("whole set", False)):
        got = calfit.fit_steps(spec, dtype, {k: [dict(q) for q in v] for k, v in steps.items()},
                               timing, each, rows, reads, layers_apart=apart)
        f = got["fit"]
        out[name] = {"decode": {"rms": f["rms_relative_residual"],
                                "max": f["max_relative_residual"]},
                     **{kind: {"rms": f[kind]["rms_relative_residual"],
                               "max": f[kind]["max_relative_residual"]}
                        for kind in ("prefill", "chunked")},
                     "card": {k: v for k, v in got["card"].items()
                              if k.startswith(("prefill_", "chunk_"))}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="calibrate's --json output")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = ap.parse_args(argv)
    try:
        with open(args.result) as f:
            got = refit(json.load(f))
    except (OSError, ValueError, KeyError) as exc:
        print(f"refit_prompts: {args.result}: not a calibrate --json result ({exc!r})",
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(got, indent=1))
        return 0
    for name, r in got.items():
        print(f"{name:12s} " + "; ".join(f"{kind} rms {r[kind]['rms']:.3f} max {r[kind]['max']:.3f}"
                                         for kind in ("decode", "prefill", "chunked"))
              + "; " + ", ".join(f"{k} {v:.0f}" for k, v in r["card"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
