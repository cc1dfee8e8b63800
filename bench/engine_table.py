"""The real engine side by side: output tokens/s, TTFT and TPOT of each policy and of
transformers' own continuous batching (hf), on slices of the shared traces, in one run.

    .venv/bin/python bench/engine_table.py [--model qwen2.5-0.5b] [--requests 32]
        [--prompt-cap 256] [--output-cap 32] [--max-batch 16] [--policy odma,static,paged,hf]
        [--max-num-batched-tokens N] [--card CARD | --extent-knee-tokens N]
        [--preemption swap]

Every run is one `odma-hw engine` computation (allocator/serving/engine/cli.compute), so a row
reproduces with the flags printed under the table. All requests arrive at once (the traces'
lengths, not their times): the engine is saturated, as a throughput comparison needs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

TRACES = Path(os.environ.get("ODMA_TRACES", Path(__file__).resolve().parents[1].parent /
                             "shared" / "traces"))


TRACES_HELP = "trace CSVs, or names of ones in the shared traces folder, comma-separated"


def lengths_only(trace: str, folder: str) -> str:
    """The trace (a CSV file, or the name of one in TRACES) without its arrival times (all at
    once), written into `folder`; SystemExit with one line where there is no such trace."""
    import csv

    src = Path(trace) if Path(trace).is_file() else TRACES / trace
    if not src.is_file():
        raise SystemExit(f"no trace {trace!r}: neither a file nor one of {TRACES}")
    out = Path(folder) / src.name
    with open(src) as f, open(out, "w") as g:
        rows = csv.DictReader(f)
        g.write("num_prefill_tokens,num_decode_tokens\n")
        for r in rows:
            g.write(f"{r['num_prefill_tokens']},{r['num_decode_tokens']}\n")
    return str(out)


def main(argv=None) -> None:
    from odma_cli.main import build_parser

    from allocator.serving.engine.cli import compute

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-cap", type=int, default=256)
    p.add_argument("--output-cap", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--kv-pool-gb", type=float, default=0.512)
    p.add_argument("--policy", default="odma,static,paged,hf")
    p.add_argument("--traces", default="azure_conv_2023.csv,sharegpt_8k.csv", help=TRACES_HELP)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="chunked prefill at this token budget per step (default: prefill-first)")
    p.add_argument("--card", default=None,
                   help="the card whose timing gives extent and elastic their knee (e.g. from "
                        "odma-hw calibrate)")
    p.add_argument("--extent-knee-tokens", type=int, default=None)
    p.add_argument("--preemption", default="recompute", choices=("recompute", "swap"))
    a = p.parse_args(argv)
    print("| trace | policy | output tok/s | TTFT p50 | TPOT p50 | E2E p50 | mean batch | "
          "preempt | migr |")
    print("|---|---|---|---|---|---|---|---|---|")
    flags = (f"--model {a.model} --requests {a.requests} --prompt-cap {a.prompt_cap} "
             f"--output-cap {a.output_cap} --max-batch {a.max_batch} --kv-pool-gb {a.kv_pool_gb:g}"
             + (f" --max-num-batched-tokens {a.max_num_batched_tokens}"
                if a.max_num_batched_tokens else "")
             + (f" --card {a.card}" if a.card else "")
             + (f" --extent-knee-tokens {a.extent_knee_tokens}" if a.extent_knee_tokens else "")
             + (f" --preemption {a.preemption}" if a.preemption != "recompute" else ""))
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.traces.split(","):
            trace = lengths_only(name, tmp)
            args = build_parser().parse_args(["engine", "--trace", trace, *flags.split(),
                                              "--policy", a.policy, "--json"])
            for r in compute(args)["results"]:
                print(f"| {name} | {r['policy']} | {r['output_tps']:.1f} | "
                      f"{r['ttft_s']['p50']:.2f} s | {r['tpot_s']['p50'] * 1e3:.1f} ms | "
                      f"{r['e2e_s']['p50']:.1f} s | "
                      f"{r['mean_batch'] if r['mean_batch'] is None else round(r['mean_batch'], 1)}"
                      f" | {r['preemptions']} | {r['migrations']} |", flush=True)
    print(f"\nodma-hw engine --trace TRACE (lengths only) {flags} --policy {a.policy}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
