"""The serving experiments of the README, reproducible: the ODMA paper's experiment on emulated
MLU370-X4 cards, the map of where contiguous ODMA blocks beat paging and where they do not, and
every policy side by side on three memories.

    .venv/bin/python bench/serving_experiments.py paper [--requests N]
        [--max-num-batched-tokens N] [--preemption swap] [--rows TEXT]
    .venv/bin/python bench/serving_experiments.py map   [--requests N] [--out DIR]
        [--max-num-batched-tokens N] [--preemption swap] [--rows TEXT]
    .venv/bin/python bench/serving_experiments.py policies [--requests N] [--rows TEXT]
    .venv/bin/python bench/serving_experiments.py prefix [--requests N]

`policies` sets ODMA, paging and the extent policies side by side on three memories (the
MLU370-X4's LPDDR5, LPDDR5 in 8B mode, HBM), under both schedulers (prefill-first, chunked) and
both preemption modes (recompute, swap). `paper`, `map` and `policies` read the traces from
../shared/traces (or ODMA_TRACES); `prefix` generates the prefix-cache paper's workloads
(`odma-hw workload`). All print Markdown tables; `map` also writes map.png. Every row is one
`odma-hw simulate` run, so any row can be rerun alone with the flags its table names.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from allocator.serving.cards.presets import model_spec
from allocator.serving.sim.replica import PrefixSettings
from allocator.serving.sim.simulation import simulate
from allocator.serving.sim.timing import EmuSettings
from allocator.serving.workloads import chat, text_analysis

TRACES = Path(os.environ.get("ODMA_TRACES", Path(__file__).resolve().parents[2] / "shared" /
                             "traces"))
PAPER = {  # the ODMA paper's figures (Alpaca / Google NQ), for the side-by-side table
    "tps_gain": "+23 % / +27 %",
    "static_utilization": "55.05 % / 42.54 %",
    "odma_utilization": "72.45 % / 61.79 %",
}


def log(text):
    print(text, file=sys.stderr, flush=True)


def paper(args) -> None:
    """Four MLU370-X4 cards, DeepSeek-R1-Distill-Qwen-7B, the same Poisson load for ODMA and
    static; TP4 and four replicas; static capped at max-model-len 4096 and 8192."""
    rates = {"replicas": [1, 2, 3, 4, 6, 8, 12], "tp": [1, 2, 3, 4, 6, 8, 12]}
    every = _every(args)
    if every:
        print(f"Every run also with `{every}`.\n")
    print("| trace | cards | max-model-len | crossover load (req/s) | saturating load | "
          "static tok/s | ODMA tok/s | ODMA / static | static util | ODMA util | "
          "ODMA preempt / migr | paged tok/s | extent tok/s | elastic tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in ("azure_conv_2023", "sharegpt_8k"):
        for mode in ("replicas", "tp"):
            for cap in (4096, 8192):
                lead = f"| {name} | {'TP4' if mode == 'tp' else '4 replicas'} | {cap} |"
                if args.rows not in lead:
                    continue
                t0 = time.perf_counter()
                kw = dict(requests=args.requests, max_model_len=cap, clip=True,
                          tp=4 if mode == "tp" else 1, replicas=4 if mode == "replicas" else 1,
                          predictor=args.predictor, seed=args.seed,
                          max_batched_tokens=args.max_num_batched_tokens,
                          preemption=args.preemption)
                rows = simulate(TRACES / f"{name}.csv", ("odma", "static"), rates[mode], **kw)
                new = _saturated(TRACES / f"{name}.csv", ("paged", "extent", "elastic"),
                                 rates[mode][-1], **kw)
                pairs = [(rows[i], rows[i + 1]) for i in range(0, len(rows), 2)]
                crossover = "-"
                prev = None
                for odma, static in pairs:
                    if odma["output_tps"] >= 1.05 * static["output_tps"]:
                        crossover = f"{prev:g}-{odma['rate']:g}" if prev else f"<= {odma['rate']:g}"
                        break
                    prev = odma["rate"]
                odma, static = pairs[-1]
                print(f"{lead} {crossover} | {odma['rate']:g} | {static['output_tps']:.0f} | "
                      f"{odma['output_tps']:.0f} | {odma['output_tps'] / static['output_tps']:.2f}"
                      f" | {static['utilization']:.3f} | {odma['utilization']:.3f} | "
                      f"{odma['preemptions']} / {odma['migrations']} | "
                      + " | ".join(f"{new[p]['output_tps']:.0f}"
                                   for p in ("paged", "extent", "elastic")) + " |", flush=True)
                log(f"{name} {mode} {cap}: {time.perf_counter() - t0:.0f} s")
    print(f"\nThe paper (Alpaca / NQ, its own static cap): TPS {PAPER['tps_gain']}; utilization "
          f"static {PAPER['static_utilization']} -> ODMA {PAPER['odma_utilization']}.")


def _every(args) -> str:
    """The scheduler flags every run of an experiment takes ("" for the defaults)."""
    return " ".join(f for f in (
        args.max_num_batched_tokens and f"--max-num-batched-tokens {args.max_num_batched_tokens}",
        args.preemption != "recompute" and f"--preemption {args.preemption}") if f)


def _saturated(trace, policies, rate, **kw):
    return {r["policy"]: r for r in simulate(trace, policies, (rate,), **kw)}


def _map_lead(axis, value, label) -> str:
    """A map row's leading cells, as printed (and as --rows selects them)."""
    return f"| {axis} | {value} | `{label}` |"


def map_(args) -> None:
    """Paged vs contiguous ODMA across the axes that decide it, at a saturating load; and the
    elastic policy against the better of the two."""
    import numpy as np

    from odma_cli import plotting

    trace = TRACES / "azure_conv_2023.csv"
    base = dict(requests=args.requests, max_model_len=8192, clip=True, seed=args.seed,
                predictor=args.predictor, max_batched_tokens=args.max_num_batched_tokens,
                preemption=args.preemption)
    rows = []

    def run(label, axis, value, policies=("odma", "paged", "oracle", "elastic"), rate=8.0,
            trace=trace, **kw):
        if args.rows not in _map_lead(axis, value, label):
            return
        t0 = time.perf_counter()
        got = _saturated(trace, policies, rate, **{**base, **kw})
        odma, paged = got["odma"], got["paged"]
        rows.append((axis, value, label, odma, paged, got.get("oracle"), got.get("elastic")))
        log(f"{axis}={value}: {time.perf_counter() - t0:.0f} s")

    for layout in ("hnd", "nhd", "v06"):
        for page in (16, 32, 128):
            run(f"--layout {layout} --page-tokens {page}", "page layout / tokens",
                f"{layout}/{page}", paged_layout=layout, page_tokens=page)
    for interleave in (256, 1024, 4096):
        run(f"--interleave {interleave}", "channel interleave (B)", interleave,
            emu=EmuSettings(preset="mlu370-x4", interleave=interleave))
    for streams, chunk in ((4, 2048), (32, 2048)):
        run(f"--streams {streams} --chunk-bytes {chunk}", "KV streams at the controller",
            f"{streams} x {chunk} B",
            emu=EmuSettings(preset="mlu370-x4", streams=streams, chunk_bytes=chunk))
    for predictor in ("oracle", "noisy", "online"):
        run(f"--predictor {predictor}", "prediction", predictor, predictor=predictor)
    for batch_cap in (16, 64):
        run(f"--max-batch {batch_cap}", "batch (KV share)", f"max {batch_cap}",
            max_batch=batch_cap)
    run("--trace sharegpt_8k", "context (KV share)", "ShareGPT (2x longer)",
        trace=TRACES / "sharegpt_8k.csv")
    run("--model llama-2-7b --max-model-len 4096", "context (KV share)",
        "Llama-2-7B (9x KV/token)", model="llama-2-7b", max_model_len=4096)
    for preset, label in (("lpddr5-6400-8b", "LPDDR5 8B mode BL32"),
                          ("lpddr4-4266", "LPDDR4-4266")):
        run(f"--timing emu:{preset} --channels 24", "memory", f"24 x {label}",
            emu=EmuSettings(preset=preset, channels=24), timing=f"emu:{preset}")
    run("--queue 8", "memory", "MLU370-X4, 8-deep controller queue",
        emu=EmuSettings(preset="mlu370-x4", queue=8))
    run("--device a100-80gb", "memory", "HBM (A100-80GB)", device="a100-80gb", rate=40.0)
    run("--device mlu370-x4", "memory", "LPDDR5 (MLU370-X4)")

    every = _every(args)
    if every:
        print(f"Every row also with `{every}`.\n")
    print("| axis | value | flags | ODMA tok/s | paged tok/s | paged / ODMA | batch ODMA / "
          "paged | step ms ODMA / paged | util ODMA / paged | KV share of step ODMA / paged | "
          "oracle-contiguous tok/s | elastic tok/s | elastic / better |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for axis, value, label, o, p, orc, el in rows:
        print(f"{_map_lead(axis, value, label)} {o['output_tps']:.0f} | {p['output_tps']:.0f} | "
              f"{p['output_tps'] / o['output_tps']:.2f} | {o['mean_batch']:.1f} / "
              f"{p['mean_batch']:.1f} | {o['mean_step_s'] * 1e3:.1f} / "
              f"{p['mean_step_s'] * 1e3:.1f} | {o['utilization']:.3f} / {p['utilization']:.3f} | "
              f"{o['step_time_share']['kv']:.2f} / {p['step_time_share']['kv']:.2f} | "
              f"{orc['output_tps']:.0f} | {el['output_tps']:.0f} | "
              f"{el['output_tps'] / max(o['output_tps'], p['output_tps']):.2f} |")
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(10, 5.5))
    labels = [f"{a}: {v}" for a, v, *_ in rows]
    ratio = [p["output_tps"] / o["output_tps"] for _, _, _, o, p, *_ in rows]
    y = np.arange(len(rows))
    ax.barh(y, [r - 1 for r in ratio], left=1,
            color=["tab:red" if r > 1 else "tab:blue" for r in ratio])
    ax.axvline(1, color="k", lw=1)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("paged tok/s / ODMA tok/s  (> 1: paging wins, red; < 1: ODMA wins, blue)")
    ax.set_title("Where paging beats contiguous ODMA blocks\n(Azure conversation trace, "
                 "saturating load, DeepSeek-R1-Distill-Qwen-7B)", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plotting.save(fig, str(out / "map.png"))
    log(f"wrote {out / 'map.png'}")


MEMORIES = (  # (label, simulate's flags, its arguments, the saturating rate)
    ("LPDDR5 (MLU370-X4)", "--device mlu370-x4", {}, 8.0),
    ("24 x LPDDR5 8B mode", "--timing emu:lpddr5-6400-8b --channels 24",
     dict(emu=EmuSettings(preset="lpddr5-6400-8b", channels=24), timing="emu:lpddr5-6400-8b"),
     8.0),
    ("HBM (A100-80GB)", "--device a100-80gb --rate 40", dict(device="a100-80gb"), 40.0),
)


def policies(args) -> None:
    """ODMA, paging, extent and elastic on three memories, both traces, both schedulers and
    both preemption modes, at the map's saturating load; the best new policy against the
    better of ODMA and paged."""
    from allocator.config import AllocatorConfig

    names = ("odma", "paged", "extent", "elastic")
    print("| memory | trace | scheduler | preemption | ODMA tok/s | paged tok/s | extent tok/s "
          "| elastic tok/s | elastic, `--demand-bound none` | best new / better | preemptions "
          "ODMA / paged / extent / elastic / elastic none | swaps |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, flags, kw, rate in MEMORIES:
        for name in ("azure_conv_2023", "sharegpt_8k"):
            for chunk in (None, 2048):
                for mode in ("recompute", "swap"):
                    sched = "prefill-first" if chunk is None else f"chunked {chunk}"
                    lead = f"| {label} (`{flags}`) | {name} | {sched} | {mode} |"
                    if args.rows not in lead:
                        continue
                    t0 = time.perf_counter()
                    same = dict(requests=args.requests, max_model_len=8192, clip=True,
                                seed=args.seed, predictor=args.predictor,
                                max_batched_tokens=chunk, preemption=mode, **kw)
                    got = _saturated(TRACES / f"{name}.csv", names, rate, **same)
                    got["none"] = _saturated(TRACES / f"{name}.csv", ("elastic",), rate,
                                             config=AllocatorConfig(background_refresh=False,
                                                                    demand_bound=None),
                                             **same)["elastic"]
                    cols = (*names, "none")
                    tps = {p: got[p]["output_tps"] for p in cols}
                    gain = max(tps[p] for p in ("extent", "elastic", "none")) / max(
                        tps["odma"], tps["paged"])
                    print(f"{lead} "
                          + " | ".join(f"{tps[p]:.1f}" for p in cols)
                          + f" | {gain:.2f} | "
                          + " / ".join(str(got[p]["preemptions"]) for p in cols)
                          + " | " + " / ".join(str(got[p]["swaps"]) for p in cols) + " |",
                          flush=True)
                    log(f"{label} {name} {sched} {mode}: {time.perf_counter() - t0:.0f} s")
    print("\nFlags of a row: `odma-hw simulate --trace ../shared/traces/TRACE.csv --rate 8 "
          "--max-model-len 8192 --clip --policy odma,paged,extent,elastic` with the memory's "
          "flags, `--max-num-batched-tokens 2048` for chunked and `--preemption swap`; the "
          "fifth column `--policy elastic --demand-bound none`.")


def prefix(args) -> None:
    """The prefix-cache paper's text-analysis benchmark (n = 128 templates, k requests queued at
    once) with tier capacities of 8 / 32 / 128 mean-sized templates on device / host / disk,
    against no cache; then schedule, eviction and prefetch variants; then the chat workload."""
    import numpy as np

    model = "deepseek-r1-distill-qwen-7b"
    bpt = model_spec(model).kv_bytes_per_token
    k = args.requests or 2000
    ta = text_analysis(k, 128, seed=args.seed)
    per_prefix = float(np.mean([t for t in dict(zip(ta.prefix_id, ta.prefix_tokens)).values()]))
    gb = per_prefix * bpt / 1e9
    # rounded before use: the flags the table prints must rerun its rows exactly
    tiers = dict(device_gb=round(8 * gb, 2), host_gb=round(32 * gb, 2), disk_gb=round(128 * gb, 2))
    log(f"text-analysis: {k} requests, mean template {per_prefix:.0f} tokens = {gb:.3f} GB; "
        f"tiers {tiers['device_gb']:g} / {tiers['host_gb']:g} / {tiers['disk_gb']:g} GB")
    flags = (f"--cache-device-gb {tiers['device_gb']:g} --cache-host-gb "
             f"{tiers['host_gb']:g} --cache-disk-gb {tiers['disk_gb']:g}")

    def run(trace, label, settings, rate=None):
        t0 = time.perf_counter()
        r = simulate(trace, ("odma",), (rate,), model=model, seed=args.seed, prefix=settings)[0]
        log(f"{label}: {time.perf_counter() - t0:.1f} s")
        return label, r

    variants = [run(ta, "no cache", None)]
    base = dict(tiers)
    for label, kw in (("cache (FCFS, LRU, no prefetch)", {}),
                      ("--prefix-schedule fpf", dict(schedule="fpf")),
                      ("--prefix-schedule relaxed-fpf", dict(schedule="relaxed-fpf")),
                      ("--eviction fifo", dict(eviction="fifo")),
                      ("--eviction random", dict(eviction="random")),
                      ("--prefetch 8", dict(prefetch=8)),
                      ("--prefetch 32", dict(prefetch=32)),
                      ("--prefix-schedule fpf --prefetch 32", dict(schedule="fpf", prefetch=32)),
                      ("device tier only (8 templates)", dict(host_gb=0.0, disk_gb=0.0)),
                      ("device + host (8 + 32)", dict(disk_gb=0.0))):
        variants.append(run(ta, label, PrefixSettings(**{**base, **kw})))
    _prefix_table(f"text analysis: n = 128 templates, k = {k} requests queued at once; tiers "
                  f"{flags}", variants)

    # queued at once every request has waited as long: relaxed FPF's weight is FPF's order.
    # Poisson arrivals near the cache's capacity tell the schedules apart (tail latency)
    rate = 4.0
    _prefix_table(f"text analysis at Poisson {rate:g} req/s (`--rate {rate:g}`), tiers as above",
                  [run(ta, label, PrefixSettings(**{**base, **kw}) if kw is not None else None,
                       rate)
                   for label, kw in (("no cache", None), ("FCFS", {}),
                                     ("--prefix-schedule fpf", dict(schedule="fpf")),
                                     ("--prefix-schedule relaxed-fpf",
                                      dict(schedule="relaxed-fpf")),
                                     ("FCFS --prefetch 8", dict(prefetch=8)),
                                     ("relaxed-fpf --prefetch 8",
                                      dict(schedule="relaxed-fpf", prefetch=8)))])

    conv = chat(max(50, k // 5), seed=args.seed)
    cache = PrefixSettings(device_gb=1.0, host_gb=16.0, disk_gb=64.0)
    _prefix_table(f"chat: {len(conv)} turns of {max(50, k // 5)} conversations (one 512-token "
                  "system prompt, histories offered after every turn); tiers 1 / 16 / 64 GB",
                  [run(conv, "no cache", None), run(conv, "cache (FCFS, LRU)", cache),
                   run(conv, "--prefetch 8", dataclasses.replace(cache, prefetch=8))])


def _prefix_table(title, variants) -> None:
    print(f"\n{title}\n")
    print("| variant | tok/s | x no cache | TTFT p50 | TTFT p99 | found device / host / disk / "
          "missed | prompt tokens covered | prefill saved s | restores s | offers s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    none = variants[0][1]["output_tps"]
    for label, r in variants:
        pc = r.get("prefix_cache")
        if pc:
            h = pc["hit_rate"]
            found = " / ".join(f"{(h[t] or 0):.1%}" for t in ("device", "host", "disk", "miss"))
            cov = f"{pc['covered_tokens'] / pc['prompt_tokens']:.1%}"
            extra = (f"{found} | {cov} | {pc['prefill_saved_s']:.0f} | {pc['restore_s']:.1f} | "
                     f"{pc['offer_s']:.1f}")
        else:
            extra = "- | - | - | - | -"
        print(f"| {label} | {r['output_tps']:.0f} | {r['output_tps'] / none:.2f} | "
              f"{r['ttft_s']['p50']:.1f} s | {r['ttft_s']['p99']:.1f} s | {extra} |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("experiment", choices=list(EXPERIMENTS))
    p.add_argument("--requests", type=int, default=None, help="first N requests of each trace")
    p.add_argument("--predictor", default="online", help="ODMA's length predictor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=".", help="folder for map.png")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="paper, map: chunked prefill with N tokens per step on every run")
    p.add_argument("--preemption", default="recompute", choices=("recompute", "swap"),
                   help="paper, map: what a preemption does on every run")
    p.add_argument("--rows", default="", metavar="TEXT",
                   help="paper, map, policies: only the rows whose leading cells (the "
                        "trace, cards and max-model-len; the map's axis, value and flags; the "
                        "memory, trace, scheduler and preemption) hold TEXT, e.g. to rerun one "
                        "row of a page's table")
    args = p.parse_args()
    if args.rows and args.experiment == "prefix":
        p.error("--rows applies to paper, map and policies")
    if args.experiment != "prefix" and not TRACES.is_dir():
        p.error(f"no traces at {TRACES} (set ODMA_TRACES)")
    EXPERIMENTS[args.experiment](args)
    return 0


EXPERIMENTS = {"paper": paper, "map": map_, "policies": policies, "prefix": prefix}

if __name__ == "__main__":
    sys.exit(main())
