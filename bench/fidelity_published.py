"""Simulate against published measurements of vLLM on real GPUs: one row per (point, metric),
the simulated figure beside the published one, and the mean absolute error.

    .venv/bin/python bench/fidelity_published.py [--json] [--profiles fitted|v1-defaults|none]
                                                 [--set vllm-points|saturated|all]

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

A second set, `saturated`, is reported beside the first and kept out of its summary (the
targets, a mean absolute error of at most 10 % and no row beyond 20 %, are the first set's):
every vLLM baseline (`vllm serve MODEL`, all defaults,
vLLM 0.11.0) of the random-dataset cases of GPUStack's performance lab for a dense model on one
A100 SXM or H100 SXM (Qwen3-14B and Qwen3-32B): 100 to 1,000 requests sent at once, 128 to
32,000 tokens in, a queue that the engine works off at its full rate.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from allocator.serving.cards.profiles import model_path
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

GPUSTACK = ("gpustack/gpustack docs/performance-lab/{}.md (47277d79), 'Other Benchmark Cases', "
            "the vLLM baseline")
CHAT_TEMPLATE = 8       # tokens Qwen3's chat template puts around one user message
# per page: its cases as (requests, total input tokens, total generated tokens, output tok/s,
# TTFT p50 ms, TPOT p50 ms), as `vllm bench serve --backend openai-chat --dataset-name random`
# printed them (input counted before the chat template; outputs that met EOS early included)
GPUSTACK_CASES = {
    ("qwen3-14b", "a100"): [(100, 3200000, 9891, 13.65, 359424.54, 462.54),
                            (500, 1997942, 99783, 245.13, 196621.85, 272.93),
                            (500, 998175, 50000, 284.64, 86575.09, 334.17),
                            (1000, 127698, 4000, 149.33, 19150.52, 238.61)],
    ("qwen3-14b", "h100"): [(100, 3200000, 9855, 25.48, 191051.49, 284.52),
                            (500, 1997942, 99803, 438.56, 110734.54, 139.68),
                            (500, 998175, 50000, 505.51, 49138.28, 231.62),
                            (1000, 127698, 4000, 176.06, 18061.13, 597.29)],
    ("qwen3-32b", "a100"): [(100, 3200000, 7699, 4.32, 892708.86, 67.32),
                            (500, 1997942, 99893, 87.48, 564705.97, 96.40),
                            (500, 998175, 50000, 120.27, 209108.79, 143.96),
                            (1000, 127698, 4000, 80.69, 31073.76, 544.55)],
    ("qwen3-32b", "h100"): [(100, 3200000, 7681, 6.64, 582757.65, 43.36),
                            (500, 1997942, 99790, 102.21, 483375.28, 62.08),
                            (500, 998175, 50000, 152.42, 164148.38, 84.24),
                            (1000, 127698, 4000, 121.66, 21342.36, 1292.78)],
}
GPUSTACK_GPU = {"a100": ("a100-80gb", V1_SERVER_A100, "vllm-v1-a100"),
                "h100": ("h100-sxm", V1_SERVER_H, "vllm-v1-h100")}


def gpustack_source(model: str, gpu: str) -> str:
    """The source of one GPUStack page (a model on a GPU)."""
    return GPUSTACK.format(f"{model}/{gpu}")


def gpustack_points() -> list:
    """GPUSTACK_CASES as points of POINTS' form."""
    points = []
    for (model, gpu), cases in GPUSTACK_CASES.items():
        card, sched, _ = GPUSTACK_GPU[gpu]
        source = gpustack_source(model, gpu)
        for n, total_in, total_out, tps, ttft, tpot in cases:
            isl = round(total_in / n)
            points.append((f"{model} {gpu} {isl}", source, card, model, isl + CHAT_TEMPLATE,
                           round(total_out / n), n, None, sched,
                           {"output_tps": tps, "ttft_p50_ms": ttft, "tpot_p50_ms": tpot}, 0.9,
                           "vLLM 0.11.0; all sent at once; output: the mean generated"))
    return points


SATURATED = gpustack_points()
PROFILE.update({gpustack_source(model, gpu): GPUSTACK_GPU[gpu][2]
                for model, gpu in GPUSTACK_CASES})
SETS = {"vllm-points": POINTS, "saturated": SATURATED}


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
    r = simulate(trace, ["paged"], model=model_path(model), device=card,
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
    parser.add_argument("--set", choices=("vllm-points", "saturated", "all"),
                        default="vllm-points",
                        help="which points: the target set (default), GPUStack's saturated "
                             "runs, or both, each with its own summary")
    a = parser.parse_args(sys.argv[1:] if argv is None else argv)
    rows = {name: [dict(row, set=name) for p in points for row in run_point(p, a.profiles)]
            for name, points in SETS.items() if a.set in (name, "all")}
    summaries = {name: summarize(r) for name, r in rows.items()}
    if a.json:
        doc = {"rows": [r for rs in rows.values() for r in rs], "summaries": summaries}
        if "vllm-points" in summaries:
            doc["summary"] = summaries["vllm-points"]
        print(json.dumps(doc, indent=1))
        return 0
    for name, rs in rows.items():
        print(f"### {name}\n")
        print("| point | card | profile | model | in / out | conc. | metric | published | "
              "simulated | error |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rs:
            print(f"| {r['point']} | {r['card']} | {r['profile']} | {r['model']} | {r['input']} / "
                  f"{r['output']} | {r['concurrency'] or 'batch ' + str(r['requests'])} | "
                  f"{r['metric']} | {r['published']:.4g} | {r['simulated']:.4g} | "
                  f"{r['error']:+.1%} |")
        m = summaries[name]
        print(f"\nmean absolute error {m['mae']:.1%} over {m['rows']} rows; largest "
              f"{m['max']:.1%}; {m['beyond_20pct']} beyond 20 %\n")
    return 0


def summarize(rows: list) -> dict:
    err = np.abs([r["error"] for r in rows])
    return {"rows": len(rows), "mae": float(err.mean()), "max": float(err.max()),
            "beyond_20pct": int((err > 0.2).sum())}


if __name__ == "__main__":
    raise SystemExit(main())
