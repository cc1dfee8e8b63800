"""`odma-hw advise`: what a model serves on each card with each KV allocation policy within a
latency SLO, and which policy (contiguous blocks, extents or pages) to run there.

For every card it gives the memory's verdict on the model's paged KV runs (the probe's rule,
applied to the card's timing source), the KV pool in requests, every policy's goodput (its
output tokens/s at the highest closed-loop concurrency whose p99 TTFT and TPOT meet the SLO)
and the recommendation, with its margin over the others. Every figure comes from simulate()'s
runs, unchanged: only the number of loads tried is kept small (double, then bisect).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED

import numpy as np

from odma_cli import argtypes, jsonout, plotting
from odma_cli.errors import BadArgument
from odma_hw.probe.measure import DEFAULT_ALPHA
from odma_hw.probe.runs import FULL_SPEED, KVRun, judge_run, knee, size_text

from allocator.policies import policy as policy_spec
from allocator.serving.cards.presets import (DEFAULT_CARD, DEFAULT_MODEL, DTYPE_BYTES, accelerator,
                                             auto_dtype, model_spec)
from allocator.serving.core.metrics import parse_goodput
from allocator.serving.core.requests import fit_lengths
from allocator.serving.options import (POOL_GB_TYPE, add_card_argument, add_dtype_argument,
                                       add_engine_profile_argument, add_length_caps,
                                       add_preset_argument, cap_lengths, card_emu, cards_of,
                                       parse_policies)
from allocator.serving.sim.replica import PAGED_LAYOUTS, ServingSetup
from allocator.serving.sim.simulation import simulate
from allocator.serving.sim.timing import make_timing
from allocator.trace import load_trace

SCHEMA = "odma-hw.advise/1"
DEFAULT_POLICIES = "odma,paged,elastic"     # one of each layout: contiguous, paged, extents
DEFAULT_SLO = "ttft:2000,tpot:100"          # first token in 2 s, then 10 tokens/s per stream
DEFAULT_REQUESTS = 1000                     # a p99 that rests on 10 requests, in seconds a run
RESOLUTION = 0.125                          # bisect until the failing load is within 1/8
TIE = 0.02                                  # goodputs closer than this are one figure
# what a run of each layout costs to simulate, in order: the step model reads a contiguous
# block at once, a paged request page by page, an extent request extent by extent
RUN_COST = {"contiguous": 0, "paged": 1, "extent": 2}
RESULT_KEYS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "e2e_s"}
LOAD_TEXT = ("closed-loop concurrency (requests in flight, as vllm bench serve "
             "--max-concurrency)")
WHY_CONCURRENCY = (
    "Load is closed-loop concurrency, not a Poisson rate: an operator sets it (max_num_seqs, "
    "a client pool), every load has a steady state with a bounded queue, so the answer does not "
    "depend on how long the trace is; above what a card serves, a Poisson rate's queue grows "
    "for as long as the trace lasts and its p99 TTFT measures the trace, not the card.")


def parse_slo(text: str) -> dict:
    """--slo KEY:MS[,KEY:MS...] (ttft, tpot, e2el) -> {key: seconds}; one line when refused."""
    items = argtypes.comma_items(text)
    if items is None:
        raise argparse.ArgumentTypeError(f"--slo takes KEY:MS items joined by commas (e.g. "
                                         f"ttft:500,tpot:50), not {text!r}")
    try:
        return parse_goodput(items, "--slo", ",")
    except BadArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _Once(argparse.Action):
    """An option that may be given once: a second --slo would silently replace the first."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest) is not None:
            parser.error(f"{option_string} is given twice: give one, its items joined by commas")
        setattr(namespace, self.dest, values)


def meets(result: dict, slo: dict) -> bool:
    """Whether a run's p99 of every SLO metric is within its bound (a run without a value, such
    as TPOT where every request makes one token, has nothing over it)."""
    p99 = (result[RESULT_KEYS[k]]["p99"] for k in slo)
    return all(v is None or v <= bound for v, bound in zip(p99, slo.values()))


def next_load(good, bad, cap: int, resolution: float = RESOLUTION):
    """The load to try next, or None when the search is over: double above the highest load
    that passes, halve below the lowest that fails, bisect between them until the failing one
    is at most max(1, load x resolution) above the passing one."""
    if bad is None:
        return None if good >= cap else min(2 * good, cap)
    if good is None:
        return None if bad == 1 else bad // 2
    return None if bad - good <= max(1, good * resolution) else (good + bad) // 2


def search_load(passes, start: int, cap: int, resolution: float = RESOLUTION, first=()):
    """(highest load that passes or None, lowest load seen to fail or None) over the integer
    loads 1..cap, for a `passes(load)` that holds up to some load and fails above it, starting
    at the loads `first` (another policy's answer, which often is this one's too) else at
    `start`. A load whose answer follows from one already tried is not tried."""
    good, bad = None, None
    queue = [x for x in first if x is not None] or [max(1, min(start, cap))]
    while True:
        load = queue.pop(0) if queue else next_load(good, bad, cap, resolution)
        if load is None:
            return good, bad
        if (good is not None and load <= good) or (bad is not None and load >= bad):
            continue
        if passes(load):
            good = load
        else:
            bad = load


def probe_row(load: int, result: dict, slo: dict) -> dict:
    """What advise keeps of one run: the figures it shows, in ms."""
    def ms(key):
        return {q: None if result[key][q] is None else result[key][q] * 1e3
                for q in ("p50", "p99")}
    return {"load": load, "meets_slo": meets(result, slo), "output_tps": result["output_tps"],
            "requests_per_s": result["requests_per_s"],
            "goodput_requests_per_s": result["goodput"]["requests_per_s"],
            "ttft_ms": ms("ttft_s"), "tpot_ms": ms("tpot_s"), "e2el_ms": ms("e2e_s"),
            "peak_batch": result["peak_batch"], "preemptions": result["preemptions"],
            "migrations": result["migrations"], "kv_pool_tokens": result["kv_pool_tokens"],
            "kv_pool_gb_per_card": result["kv_pool_gb_per_card"],
            "layout": result["layout"], "wall_s": result["wall_seconds"]}


def search_policy(trace, policy: str, card: str, settings: dict, slo: dict, first=(),
                  also=(), widen: bool = False) -> dict:
    """One policy's goodput on one card: the SLO search over closed-loop concurrency (1 up to
    the trace's length) from the loads `first`, then a run at each load of `also` not yet tried
    and, with `widen`, at 1/4 and 1/16 of the lowest load tried (a plot's lines then reach
    light loads). A process pool's task: a module-level function of picklable arguments."""
    tried: dict[int, dict] = {}
    t0 = time.perf_counter()

    def passes(load: int) -> bool:
        if load not in tried:
            r = simulate(trace, (policy,), device=card, concurrency=load, goodput=slo,
                         **settings)[0]
            tried[load] = probe_row(load, r, slo)
        return tried[load]["meets_slo"]

    # the SLO gives out near the batch limit unless it is tight: start below that limit
    good, bad = search_load(passes, settings["max_batch"] // 2, len(trace), first=first)
    searched = len(tried)
    low = min(tried)
    for load in [*also, *((max(1, low // 4), max(1, low // 16)) if widen else ())]:
        passes(load)
    at = tried[good] if good is not None else tried[min(tried)]
    return {"policy": policy, "layout": policy_spec(policy).layout,
            "paged_layout": at["layout"], "load": good, "fail_load": bad,
            "whole_trace": good == len(trace),
            "goodput_tps": at["output_tps"] if good is not None else 0.0,
            "at_load": {k: v for k, v in at.items() if k != "layout"},
            "search_runs": searched, "probes": [tried[k] for k in sorted(tried)],
            "wall_s": time.perf_counter() - t0}


def memory_verdict(card: str, settings: dict) -> dict:
    """The probe's verdict on the model's paged KV runs, from the card's timing source: the
    random/sequential ratio of every power-of-two run of 64 B .. 4 MiB and of the page run,
    judged as `odma-hw probe --model` judges them, and the knee."""
    dev = accelerator(card)
    timing = make_timing(dev.timing, dev.bandwidth_gbps, card_emu(dev))
    m = model_spec(settings["model"])
    setup = ServingSetup(m, dev, timing, dtype=settings["dtype"])
    layout = settings["paged_layout"]
    _, token_bytes, _ = setup.run_layout(layout)
    page_tokens = settings["page_tokens"]
    kv_dtype = "fp32" if setup.kv_dtype_bytes == DTYPE_BYTES["fp32"] else "bf16"
    head_major = token_bytes == m.head_dim * setup.kv_dtype_bytes
    run = (KVRun.of_model(m.name, m.head_dim, page_tokens, kv_dtype) if head_major
           else KVRun(page_tokens * token_bytes))        # token-major: a page of every head
    sizes = sorted({1 << k for k in range(6, 23)} | {run.nbytes})
    ratios = {s: float(timing.run_gbps(s)) / timing.seq_gbps for s in sizes}
    verdict = judge_run(run, ratios, DEFAULT_ALPHA, FULL_SPEED, timing.source)
    if not head_major:
        verdict["summary"] = (f"{page_tokens}-token pages of {m.name} (token-major {layout}: "
                              f"every KV head, {kv_dtype}) are {verdict['summary']}")
    verdict["basis"] = (f"the verdict at the {size_text(run.nbytes)} run size; its ratio is "
                        f"{timing.source}'s at that size")
    verdict["paged_layout"] = layout
    verdict["knee_bytes"] = knee({s: r for s, r in ratios.items() if s & (s - 1) == 0})
    verdict["timing_source"] = timing.source
    return verdict


def kv_capacity(trace, settings: dict, rows: list[dict]) -> dict:
    """The KV pool in requests: tokens it holds over the mean request of the trace (prompt +
    output, as served), beside the batch limit; each policy's peak batch says what it held."""
    m = model_spec(settings["model"])
    prompt, gen, *_ = fit_lengths(trace, settings["max_model_len"], m, settings["clip"])
    mean = float(np.mean(prompt + gen))
    tokens = rows[0]["kv_pool_tokens"]
    return {"pool_gb": rows[0]["kv_pool_gb_per_card"], "pool_tokens": tokens,
            "mean_request_tokens": mean, "requests": int(tokens // mean),
            "max_batch": settings["max_batch"]}


def recommend(found: list[dict]) -> dict:
    """The policy with the most goodput (tok/s within the SLO) and its margin over each other
    policy (None where that one meets the SLO at no load); one sentence says it."""
    best = max(found, key=lambda f: f["goodput_tps"])
    if best["load"] is None:
        return {"policy": None, "layout": None, "load": None, "goodput_tps": 0.0,
                "margins": {}, "tie": False,
                "sentence": "no policy meets the SLO at any load here (see concurrency 1): a "
                            "faster card, a smaller model or a looser SLO"}
    margins = {f["policy"]: (best["goodput_tps"] / f["goodput_tps"] if f["goodput_tps"]
                             else None) for f in found if f is not best}
    tie = [p for p, x in margins.items() if x is not None and x < 1 + TIE]
    parts = [f"{x:.2f}x {p}" if x is not None else f"{p} meets it at no load"
             for p, x in margins.items()]
    sentence = (f"{best['policy']} ({best['layout']} KV): "
                + (" and ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 1 else parts)
                   or "the only policy asked")
                + f", {best['goodput_tps']:,.0f} tok/s at concurrency {best['load']} within "
                  f"the SLO")
    if tie:
        sentence += (f"; within {TIE:.0%} of {', '.join(tie)}: on this card the choice between "
                     f"them costs nothing")
    return {"policy": best["policy"], "layout": best["layout"], "load": best["load"],
            "goodput_tps": best["goodput_tps"], "margins": margins, "tie": bool(tie),
            "sentence": sentence}


class InProcess:
    """The executor of --jobs 1: runs each task as it is submitted, in this process."""

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:            # raised by result(), as a pool's task would be
            future.set_exception(exc)
        return future

    def shutdown(self, **_) -> None:
        pass


def executor(jobs: int):
    """A pool of `jobs` processes (forked, so each has this one's imports), or InProcess."""
    if jobs <= 1:
        return InProcess()
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    return concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx)


def run_searches(trace, cards, policies, settings, slo, jobs: int, progress,
                 same_loads: bool = False) -> dict:
    """{(card, policy): search_policy(...)}. On each card the policy of the cheapest runs
    searches first; the others then start at its answer, which most often is theirs too (two
    runs each). same_loads: it also runs lighter loads, and they every load it ran (a plot's
    lines then share their loads)."""
    order = sorted(policies, key=lambda p: RUN_COST[policy_spec(p).layout])
    lead, followers = order[0], order[:0:-1]          # the costliest followers start first
    pool = executor(min(jobs, len(cards) * len(policies)))
    out: dict = {}
    try:
        pending = {pool.submit(search_policy, trace, lead, c, settings, slo, widen=same_loads):
                   (c, lead) for c in cards}
        while pending:
            done, _ = concurrent.futures.wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                card, p = pending.pop(fut)
                f = out[(card, p)] = fut.result()
                if progress:
                    runs = f"{f['search_runs']} run" + ("" if f["search_runs"] == 1 else "s")
                    print(f"advise: {card} {p}: concurrency {f['load'] or 'none'} within the "
                          f"SLO ({runs}, {f['wall_s']:.1f} s)", file=sys.stderr)
                if p != lead:
                    continue
                also = [x["load"] for x in f["probes"]] if same_loads else ()
                for q in followers:
                    pending[pool.submit(search_policy, trace, q, card, settings, slo,
                                        (f["load"], f["fail_load"]), also)] = (card, q)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return {(c, p): out[(c, p)] for c in cards for p in policies}


def advise(trace, model=DEFAULT_MODEL, devices=(DEFAULT_CARD,),
           policies=tuple(DEFAULT_POLICIES.split(",")), slo=None, *, requests=DEFAULT_REQUESTS,
           dtype="auto", max_model_len=None, clip=False, max_batch=256, kv_pool_gb=None,
           max_num_batched_tokens=None, page_tokens=16, paged_layout="hnd",
           prompt_cap=None, output_cap=None, engine_profile=None, jobs=1, progress=False,
           same_loads=False) -> dict:
    """The JSON object of `odma-hw advise` (schema SCHEMA): per card its memory verdict, KV
    capacity, every policy's goodput search and the recommendation. `trace` a CSV path or a
    RequestTrace; `slo` {ttft|tpot|e2el: seconds} (default DEFAULT_SLO); `engine_profile` a
    serving engine's per-step terms in place of every card's own (a preset name or a profile
    file, as simulate takes it). Every check is made, for every card, before the first run."""
    slo = slo or parse_slo(DEFAULT_SLO)
    tr = trace if not isinstance(trace, (str, os.PathLike)) else load_trace(trace)
    tr = cap_lengths(tr.head(requests) if requests else tr, prompt_cap, output_cap)
    settings = {"model": model, "dtype": dtype, "max_model_len": max_model_len, "clip": clip,
                "max_batch": max_batch, "kv_pool_gb": kv_pool_gb,
                "max_batched_tokens": max_num_batched_tokens, "page_tokens": page_tokens,
                "paged_layout": paged_layout, "engine_profile": engine_profile}
    for card in devices:
        simulate(tr, policies, device=card, concurrency=1, check_only=True, **settings)
    verdicts = {card: memory_verdict(card, settings) for card in devices}
    found = run_searches(tr, devices, policies, settings, slo, jobs, progress, same_loads)
    cards = []
    for card in devices:
        rows = [found[(card, p)] for p in policies]
        dev = accelerator(card)
        cards.append({"card": dev.name, "device": card,
                      "dtype": auto_dtype(dtype, dev.dtype),
                      "memory": verdicts[card],
                      "kv_capacity": kv_capacity(tr, settings,
                                                 [r["at_load"] for r in rows]),
                      "policies": rows, "recommendation": recommend(rows)})
    return {"schema": SCHEMA, "model": model_spec(model).name, "dtype": dtype,
            "trace": tr.name, "requests": len(tr),
            "slo_ms": {k: v * 1e3 for k, v in slo.items()}, "slo_statistic": "p99",
            "load": "concurrency", "load_means": LOAD_TEXT, "resolution": RESOLUTION,
            "settings": settings, "cards": cards}


def _ms(x) -> str:
    return "-" if x is None else (f"{x:.0f}" if x >= 10 else f"{x:.1f}")


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return [lines[0], "-" * max(map(len, lines))] + lines[1:]


def format_card(doc: dict, card: dict) -> list[str]:
    """One card's page: verdict, capacity, every policy at its goodput load, the advice."""
    mem, cap = card["memory"], card["kv_capacity"]
    k = mem["knee_bytes"]
    out = [f"== {card['card']}: {doc['model']} {card['dtype']} (timing {mem['timing_source']})",
           f"memory: {mem['summary']}" + (f"; knee {size_text(k)}" if k else "; no knee"),
           f"KV capacity: {cap['pool_gb']:.2f} GB pool = {cap['pool_tokens']:,} tokens = "
           f"{cap['requests']:,} requests of this trace's mean {cap['mean_request_tokens']:.0f} "
           f"tokens (max batch {cap['max_batch']})"]
    rows = [["policy", "layout", "concurrency", "tok/s", "req/s", "TTFT p50", "TTFT p99",
             "TPOT p50", "TPOT p99", "peak batch", "preempt"]]
    for f in card["policies"]:
        a = f["at_load"]
        load = "none" if f["load"] is None else str(f["load"]) + ("+" if f["whole_trace"] else "")
        layout = f["layout"]
        layout += f"/{f['paged_layout']}" if layout == "paged" else ""
        rows.append([f["policy"], layout, load,
                     f"{f['goodput_tps']:.0f}", f"{a['requests_per_s']:.2f}",
                     _ms(a["ttft_ms"]["p50"]), _ms(a["ttft_ms"]["p99"]),
                     _ms(a["tpot_ms"]["p50"]), _ms(a["tpot_ms"]["p99"]),
                     str(a["peak_batch"]), str(a["preemptions"])])
    out += _table(rows)
    out.append(f"advice: {card['recommendation']['sentence']}")
    return out


def format_doc(doc: dict) -> str:
    """The whole page: a head line, each card's page, and the cards side by side."""
    slo = ", ".join(f"p99 {k.upper()} <= {v:g} ms" for k, v in doc["slo_ms"].items())
    profile = doc["settings"].get("engine_profile")
    out = [f"advise: {doc['model']} on {len(doc['cards'])} card(s), {doc['requests']} requests "
           f"of {doc['trace']}; SLO {slo}; load = {doc['load_means']}; latencies in ms at the "
           f"highest load within the SLO"
           + (f"; engine profile {profile}" if profile else ""), ""]
    for card in doc["cards"]:
        out += format_card(doc, card) + [""]
    if len(doc["cards"]) > 1:
        names = [f["policy"] for f in doc["cards"][0]["policies"]]
        rows = [["card", "paged run / streaming", "KV requests"]
                + [f"{p} tok/s @ conc" for p in names] + ["advice"]]
        for card in doc["cards"]:
            rec = card["recommendation"]
            rows.append([card["card"], f"{card['memory']['ratio']:.2f}",
                         f"{card['kv_capacity']['requests']:,}"]
                        + [f"{f['goodput_tps']:.0f} @ {f['load'] or '-'}"
                           for f in card["policies"]]
                        + [rec["policy"] or "none"])
        out += ["cards side by side (goodput: output tok/s at the highest concurrency within "
                "the SLO):"] + _table(rows)
    return "\n".join(out).rstrip()


def plot(doc: dict, path: str) -> None:
    """Per card, against concurrency: output tok/s, p99 TTFT and p99 TPOT of every run the
    search made, one line per policy, the SLO's bounds dashed."""
    plt = plotting.pyplot()
    cards = doc["cards"]
    fig, axes = plt.subplots(len(cards), 3, figsize=(15, 4.2 * len(cards)), squeeze=False)
    for row, card in zip(axes, cards):
        for f in card["policies"]:
            loads = [p["load"] for p in f["probes"]]
            row[0].plot(loads, [p["output_tps"] for p in f["probes"]], marker="o",
                        label=f["policy"])
            for ax, key in ((row[1], "ttft_ms"), (row[2], "tpot_ms")):
                ax.plot(loads, [p[key]["p99"] for p in f["probes"]], marker="o",
                        label=f["policy"])
        for ax, (key, what) in zip(row, (("", "output tokens/s"), ("ttft", "p99 TTFT (ms)"),
                                         ("tpot", "p99 TPOT (ms)"))):
            if key in doc["slo_ms"]:
                ax.axhline(doc["slo_ms"][key], color="grey", linestyle="--", label="SLO")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency (requests in flight)")
            ax.set_ylabel(what)
            ax.set_title(f"{card['card']}, {doc['model']}: {what}")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    plotting.save(fig, path)


def _cmd(args) -> int:
    if args.trace is None:
        raise BadArgument("advise needs --trace CSV")
    policies = parse_policies(args.policy)
    cards = cards_of(args)
    if args.plot:
        plotting.check_plot_path(args.plot)
    doc = advise(args.trace, args.model, cards, policies, args.slo, requests=args.requests,
                 dtype=args.dtype, max_model_len=args.max_model_len, clip=args.clip,
                 max_batch=args.max_batch, kv_pool_gb=args.kv_pool_gb,
                 max_num_batched_tokens=args.max_num_batched_tokens,
                 page_tokens=args.page_tokens, paged_layout=args.layout,
                 prompt_cap=args.prompt_cap, output_cap=args.output_cap,
                 engine_profile=args.engine_profile, jobs=args.jobs,
                 progress=not args.json or sys.stderr.isatty(), same_loads=bool(args.plot))
    print(jsonout.dumps(doc, indent=1) if args.json else format_doc(doc))
    if args.plot:
        plot(doc, args.plot)
    return 0


def default_jobs() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "advise", help="which KV policy to run on a card, and its goodput within an SLO",
        description=__doc__.split("\n\n")[0] + " " + WHY_CONCURRENCY)
    p.add_argument("--trace", metavar="CSV",
                   help="request trace: num_prefill_tokens, num_decode_tokens (required)")
    p.add_argument("--requests", type=argtypes.positive_int, default=DEFAULT_REQUESTS,
                   metavar="N", help=f"serve the first N requests of the trace (default "
                                     f"{DEFAULT_REQUESTS}: each policy runs them at ~5-8 loads)")
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="MODEL",
                   help="a preset, a shipped config or a Hugging Face config.json (or a folder "
                        f"holding one), as simulate takes it (default {DEFAULT_MODEL})")
    add_card_argument(p, "side by side")
    p.add_argument("--policy", default=DEFAULT_POLICIES, metavar="P[,P...]",
                   help=f"policies to compare (default {DEFAULT_POLICIES}: one of each layout)")
    p.add_argument("--slo", type=parse_slo, default=None, action=_Once,
                   metavar="KEY:MS[,KEY:MS]",
                   help=f"the p99 bounds a load must meet, in ms, among ttft, tpot, e2el "
                        f"(default {DEFAULT_SLO})")
    add_dtype_argument(p, DTYPE_BYTES, "weight type, as simulate takes it")
    p.add_argument("--kv-pool-gb", type=POOL_GB_TYPE, default=None, metavar="GB",
                   help="KV pool per card, GB of 1e9 B (default: what the weights leave of 0.9 "
                        "of the card)")
    p.add_argument("--max-batch", type=argtypes.positive_int, default=256,
                   help="running requests at most (vLLM max_num_seqs, default 256)")
    p.add_argument("--max-num-batched-tokens", type=argtypes.positive_int, default=None,
                   metavar="N", help="chunked prefill, N tokens per step (default: off, vLLM v0)")
    p.add_argument("--max-model-len", type=argtypes.positive_int, default=None,
                   help="longest request served (default: the trace's longest)")
    p.add_argument("--clip", action="store_true",
                   help="drop prompts longer than --max-model-len and cut generations there")
    add_length_caps(p)
    p.add_argument("--layout", default="hnd", choices=list(PAGED_LAYOUTS),
                   help="paged KV layout: v06, hnd (default), nhd (vLLM v1)")
    p.add_argument("--page-tokens", type=argtypes.positive_int, default=16,
                   help="tokens per page of the paged policy (default 16)")
    add_engine_profile_argument(p, "every card's")
    add_preset_argument(p)
    p.add_argument("--jobs", type=argtypes.positive_int, default=default_jobs(),
                   help="processes running the searches (default: this machine's CPUs; the "
                        "results do not depend on it)")
    p.add_argument("--json", action="store_true", help=f"print one JSON object ({SCHEMA})")
    p.add_argument("--plot", type=argtypes.nonempty, metavar="PNG",
                   help="per card: tok/s, p99 TTFT and p99 TPOT against concurrency, one line "
                        "per policy (needs the plot extra: matplotlib)")
    p.set_defaults(func=_cmd)
