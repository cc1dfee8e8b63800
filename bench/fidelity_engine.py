"""Simulate against the real engine on the same machine: `odma-hw engine` serves slices of the
shared traces on a torch device, `odma-hw simulate` predicts the same runs from a card that
`odma-hw calibrate` measured on that device, and the table sets the two side by side.

    .venv/bin/python bench/fidelity_engine.py --card CARD.toml [--requests 32]
        [--prompt-cap 128] [--output-cap 32] [--max-batch 16] [--budget 256] [--rounds 1]

Every request of a slice arrives at once (the traces' lengths, not their times), prompts and
outputs cut as for the engine's table; each (trace, policy, scheduler) is one engine run and one
simulate run of the same command line, only the command's name differs (prefill-first, and
chunked prefill at --budget tokens per step). The card is the only link between the two (its timing also gives extent and elastic
their knee in both): nothing is fitted to these runs.

A shared host moves one engine run by up to 30 % from the next, so --rounds N runs every engine
command N times, round after round over all of them (a slow spell of the host then falls on
every row alike), and sets simulate against the median of its row, the rounds' range beside
it: a difference inside that range is the host's, not the model's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_table import TRACES_HELP, lengths_only  # noqa: E402

METRICS = (("output_tps", "output tok/s", lambda r: r["output_tps"]),
           ("tpot_p50", "TPOT p50 (ms)", lambda r: r["tpot_s"]["p50"] * 1e3),
           ("ttft_p50", "TTFT p50 (s)", lambda r: r["ttft_s"]["p50"]))


def odma_hw(*args) -> dict:
    exe = os.path.join(os.path.dirname(sys.executable), "odma-hw")
    out = subprocess.run([exe, *args, "--json"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def run_args(a, trace: str, sched: list) -> list[str]:
    """The one command line of a row: `engine` and `simulate` run it as it is, nothing but the
    command's name differs (tests/test_same_flags.py checks that both read it alike)."""
    return ["--trace", trace, "--requests", str(a.requests), "--prompt-cap", str(a.prompt_cap),
            "--output-cap", str(a.output_cap), "--model", a.model, "--dtype", "fp32",
            "--card", a.card, "--kv-pool-gb", f"{a.kv_pool_gb:g}", "--max-batch",
            str(a.max_batch), "--policy", a.policy, *sched]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--card", required=True)
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-cap", type=int, default=128)
    p.add_argument("--output-cap", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--kv-pool-gb", type=float, default=0.064)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--policy", default="odma,paged")
    p.add_argument("--traces", default="azure_conv_2023.csv,sharegpt_8k.csv", help=TRACES_HELP)
    p.add_argument("--rounds", type=int, default=1,
                   help="engine runs of every row, round-robin; simulate meets their median")
    p.add_argument("--json", action="store_true")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {a.rounds}")
    with tempfile.TemporaryDirectory() as tmp:
        lines = [(os.path.basename(name).removesuffix(".csv"), sched,
                  run_args(a, lengths_only(name, tmp), sched))
                 for name in a.traces.split(",")
                 for sched in ([], ["--max-num-batched-tokens", str(a.budget)])]
        sims = [odma_hw("simulate", *args) for _, _, args in lines]
        engines = [[] for _ in lines]
        for k in range(a.rounds):
            for (name, sched, args), runs in zip(lines, engines):
                # the card also gives the engine's extents the knee simulate derives from it
                runs.append(odma_hw("engine", *args))
                print(f"round {k + 1}/{a.rounds}: {name} {' '.join(sched) or 'prefill-first'}",
                      file=sys.stderr, flush=True)
    rows = []
    for (name, sched, _), sim, runs in zip(lines, sims, engines):
        for i, s in enumerate(sim["results"]):
            row = {"trace": name, "policy": s["policy"],
                   "scheduler": f"chunked {a.budget}" if sched else "prefill-first"}
            for key, _, get in METRICS:
                each = sorted(get(run["results"][i]) for run in runs)
                eng = statistics.median(each)
                row[key] = {"engine": eng, "engine_runs": each, "simulate": get(s),
                            "ratio": get(s) / eng}
            rows.append(row)
    if a.json:
        print(json.dumps({"rows": rows}, indent=1))
        return 0
    engine = "engine" if a.rounds == 1 else f"engine (median of {a.rounds}: range)"

    def cell(m):
        spread = (f" ({m['engine_runs'][0]:.3g}-{m['engine_runs'][-1]:.3g})"
                  if a.rounds > 1 else "")
        return f"{m['engine']:.3g}{spread} / {m['simulate']:.3g} ({m['ratio'] - 1:+.0%})"
    print("| trace | policy | scheduler | " + " | ".join(
        f"{label}: {engine} / simulate" for _, label, _ in METRICS) + " |")
    print("|---|---|---|" + "---|" * len(METRICS))
    for r in rows:
        print(f"| {r['trace']} | {r['policy']} | {r['scheduler']} | " +
              " | ".join(cell(r[k]) for k, _, _ in METRICS) + " |")
    worst = max(abs(r[k]["ratio"] - 1) for r in rows for k, _, _ in METRICS)
    print(f"\nlargest difference {worst:.0%} over {len(rows)} rows x {len(METRICS)} metrics"
          + (f", against the engine's median of {a.rounds} rounds" if a.rounds > 1 else ""))
    if a.rounds > 1:
        spread = max(r[k]["engine_runs"][-1] / r[k]["engine_runs"][0] - 1
                     for r in rows for k, _, _ in METRICS)
        print(f"the engine's widest row: its fastest and slowest rounds {spread:.0%} apart")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
