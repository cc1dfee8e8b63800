"""Simulate against published measurements of vLLM on real GPUs: one row per (point, metric),
the simulated figure beside the published one, and the mean absolute error.

    .venv/bin/python bench/fidelity_published.py [--json] [--profiles fitted|v1-defaults|none]

--profiles says which overheads the points take: fitted (the default: each source's engine
profile), v1-defaults (the V1 rows take the card's default overheads, as before V1 had fitted
profiles) or none (every row the card's defaults: one set of overheads for every card).

Each point is a dense 7-8B model on one GPU (TP1) at fixed input and output lengths and a fixed
concurrency or batch, as its source states it; the cards are the presets in
allocator/serving/cards/ (datasheet figures, MFU 0.5; h100-sxm's run rates from the native
probe of an H100), each with the engine profile of the vLLM version measured
(allocator/serving/engine_profiles: the engine's overheads and weight read efficiency, fitted
by bench/fit_profiles.py on other published points of that version, never on these; for V1, a
profile per GPU family, vllm-v1-a100 and vllm-v1-h100): nothing here is fitted to these
points. The scheduler follows the vLLM version measured: V0
(up to 0.6) prefills whole prompts first; V1 (0.8 on) runs chunked prefill with its default
token budget (8,192 for the OpenAI server on >= 70 GB cards other than A100, 2,048 on A100;
16,384 and 8,192 for the offline LLM class) and paged KV in its token-major layout.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from allocator.serving.sim.simulation import simulate
from allocator.trace import RequestTrace
from fit_profiles import SCHEDULERS             # vLLM's schedulers, one place for both scripts

BLOG = "blog.vllm.ai/2026/04/22/fp8-kvcache.html"
QWEN25 = "QwenLM/Qwen2.5 docs/source/benchmark/speed_benchmark.rst (a912d23), 7B vLLM table"
QWEN2 = "QwenLM/Qwen2.5 docs/source/benchmark/speed_benchmark.rst (5c4e69c), Qwen2-7B vLLM table"
A100PCIE = ("cssnoeasy/a100-vllm-benchmark-blog docs/reports/a100-tp1-vs-tp2-formal-baseline.md "
            "(e4226b0), TP=1 rows")
BUILDKITE = "buildkite.com/vllm/performance-benchmark/builds/9515, latency_llama8B_tp1"

V1_SERVER_H = SCHEDULERS["v1-server-8192"]
V1_SERVER_A100 = SCHEDULERS["v1-server-2048"]
V1_OFFLINE_H = SCHEDULERS["v1-offline"]
V0 = SCHEDULERS["v0"]
# the engine profile of each source's vLLM version and GPU (the blog's is a recent V1 on an H100;
# vllm-v1-h100 is fitted on 0.11, vllm-v1-a100 on 0.17 and 0.20.1, around the sweep's 0.19.0)
PROFILE = {BLOG: "vllm-v1-h100", QWEN25: "vllm-0.6", QWEN2: "vllm-0.4", A100PCIE: "vllm-v1-a100",
           BUILDKITE: "vllm-ci-9500"}


def itl_fit(isl):
    """The blog's fit of batch-1 inter-token latency on H100, BF16 KV (ms)."""
    return 6.44 + 4.37e-05 * isl


# (id, source, card, model, input, output, requests, concurrency (None: all at once),
#  scheduler, {metric: published}, memory utilization, note)
POINTS = [
    ("P1 isl 1k", BLOG, "h100-sxm", "llama-3.1-8b", 1024, 128, 4, 1, V1_SERVER_H,
     {"tpot_p50_ms": itl_fit(1024)}, 0.9, "the post's fitted line at 1,024 input tokens"),
    ("P1 isl 32k", BLOG, "h100-sxm", "llama-3.1-8b", 32768, 128, 4, 1, V1_SERVER_H,
     {"tpot_p50_ms": itl_fit(32768)}, 0.9, "the post's fitted line at 32,768 input tokens"),
    ("P2", BLOG, "h100-sxm", "llama-3.1-8b", 20000, 2000, 150, 8, V1_SERVER_H,
     {"output_tps": 450.3, "tpot_p50_ms": 15.18, "ttft_p50_ms": 763.6}, 0.9,
     "lengths +-15 % (uniform, seeded)"),
    ("P4", QWEN25, "a100-80gb", "qwen2.5-7b", 1, 2048, 1, None, V0, {"speed_tps": 84.28}, 0.9,
     "vLLM 0.6.3; speed = 2048 / whole request"),
    ("P5", QWEN25, "a100-80gb", "qwen2.5-7b", 6144, 2048, 1, None, V0, {"speed_tps": 80.70},
     0.9, "vLLM 0.6.3"),
    ("P6", QWEN25, "a100-80gb", "qwen2.5-7b", 14336, 2048, 1, None, V0, {"speed_tps": 77.69},
     0.9, "vLLM 0.6.3"),
    ("P7", QWEN25, "a100-80gb", "qwen2.5-7b", 30720, 2048, 1, None, V0, {"speed_tps": 70.33},
     0.9, "vLLM 0.6.3"),
    ("P8", QWEN2, "a100-80gb", "qwen2.5-7b", 1, 2048, 1, None, V0, {"speed_tps": 80.45}, 0.9,
     "vLLM 0.4.2; Qwen2-7B has Qwen2.5-7B's shapes"),
    ("P9", QWEN2, "a100-80gb", "qwen2.5-7b", 6144, 2048, 1, None, V0, {"speed_tps": 76.41},
     0.9, "vLLM 0.4.2"),
    ("P10", QWEN2, "a100-80gb", "qwen2.5-7b", 14336, 2048, 1, None, V0, {"speed_tps": 66.54},
     0.9, "vLLM 0.4.2"),
    ("P11", QWEN2, "a100-80gb", "qwen2.5-7b", 30720, 2048, 1, None, V0, {"speed_tps": 55.83},
     0.9, "vLLM 0.4.2"),
    ("P12", A100PCIE, "a100-80gb-pcie", "qwen2.5-7b", 512, 256, 100, 8, V1_SERVER_A100,
     {"output_tps": 623.18, "ttft_p50_ms": 139.96, "tpot_p99_ms": 11.69}, 0.75,
     "vLLM 0.19.0, fp16, mean of 3 runs"),
    ("P13", A100PCIE, "a100-80gb-pcie", "qwen2.5-7b", 2048, 128, 100, 16, V1_SERVER_A100,
     {"output_tps": 906.60, "ttft_p50_ms": 351.41, "tpot_p99_ms": 16.80}, 0.75,
     "vLLM 0.19.0"),
    ("P14", A100PCIE, "a100-80gb-pcie", "qwen2.5-7b", 2048, 512, 100, 32, V1_SERVER_A100,
     {"output_tps": 1757.34, "ttft_p50_ms": 228.90, "tpot_p99_ms": 14.75}, 0.75,
     "vLLM 0.19.0"),
    ("P16", BUILDKITE, "h200", "llama-3.1-8b", 32, 128, 8, None, V1_OFFLINE_H,
     {"batch_latency_ms": 833.421}, 0.9, "benchmark_latency, batch of 8 at once"),
]


PROFILE_CHOICES = ("fitted", "v1-defaults", "none")


def profile_of(source: str, choice: str = "fitted") -> str | None:
    """The engine profile a source's points take under --profiles `choice` (None: the card's
    default overheads)."""
    name = PROFILE[source]
    if choice == "none" or (choice == "v1-defaults" and name.startswith("vllm-v1-")):
        return None
    return name


def run_point(point, choice: str = "fitted") -> list:
    pid, source, card, model, isl, osl, n, conc, sched, published, util, note = point
    rng = np.random.default_rng(0)
    if pid == "P2":                                 # the post's +-15 % lengths
        prompt = (isl * rng.uniform(0.85, 1.15, n)).astype(int)
        gen = (osl * rng.uniform(0.85, 1.15, n)).astype(int)
    else:
        prompt, gen = np.full(n, isl), np.full(n, osl)
    trace = RequestTrace(prompt, gen, None, name=pid)
    sched = dict(sched)
    profile = profile_of(source, choice)
    r = simulate(trace, ["paged"], model=model, device=card,
                 max_model_len=int((prompt + gen).max()), memory_utilization=util,
                 concurrency=conc, engine_profile=profile, **sched)[0]
    got = {"tpot_p50_ms": r["tpot_s"]["p50"] * 1e3, "tpot_p99_ms": r["tpot_s"]["p99"] * 1e3,
           "ttft_p50_ms": r["ttft_s"]["p50"] * 1e3, "output_tps": r["output_tps"],
           "speed_tps": osl / r["e2e_s"]["p50"], "batch_latency_ms": r["duration_s"] * 1e3}
    rows = []
    for metric, pub in published.items():
        sim = got[metric]
        rows.append({"point": pid, "card": card, "profile": profile or "card", "model": model,
                     "input": isl, "output": osl,
                     "requests": n, "concurrency": conc, "metric": metric, "published": pub,
                     "simulated": sim, "error": sim / pub - 1, "source": source,
                     "note": note})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="rows and summary as JSON")
    parser.add_argument("--profiles", choices=PROFILE_CHOICES, default="fitted",
                        help="the overheads the points take (default fitted)")
    a = parser.parse_args(sys.argv[1:] if argv is None else argv)
    rows = [row for p in POINTS for row in run_point(p, a.profiles)]
    err = np.abs([r["error"] for r in rows])
    summary = {"rows": len(rows), "mae": float(err.mean()), "max": float(err.max()),
               "beyond_20pct": int((err > 0.2).sum())}
    if a.json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=1))
        return 0
    print("| point | card | profile | model | in / out | conc. | metric | published | simulated "
          "| error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['point']} | {r['card']} | {r['profile']} | {r['model']} | {r['input']} / {r['output']} | "
              f"{r['concurrency'] or 'batch ' + str(r['requests'])} | {r['metric']} | "
              f"{r['published']:.4g} | {r['simulated']:.4g} | {r['error']:+.1%} |")
    print(f"\nmean absolute error {summary['mae']:.1%} over {summary['rows']} rows; largest "
          f"{summary['max']:.1%}; {summary['beyond_20pct']} beyond 20 %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
