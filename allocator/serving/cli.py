"""`odma-hw simulate`: tokens per second, latency and KV utilization of serving a request trace
with each KV allocation policy, on an emulated or measured device.

Every policy sees the same requests at the same (Poisson or trace) arrival times; a list of
rates prints one row per rate and policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

from odma_hw import argtypes, jsonout, plotting
from odma_hw.commands import ValueCheck
from odma_hw.errors import BadArgument, OdmaError, RunFailed

from allocator.config import AllocatorConfig
from allocator.policies import POLICIES, policy
from allocator.replay import add_policy_arguments
from allocator.serving.core.checks import PREEMPTION, check_scheduling
from allocator.serving.core.metrics import (ITL_TOKEN_TIMES, SIMULATE_METRICS, SLO_METRICS,
                                            apply_goodput, parse_goodput)
from allocator.serving.core.requests import fit_lengths
from allocator.serving.engine import (MAX_TIER_BYTES, PAGED_LAYOUTS, SCHEDULES, PrefixSettings,
                                     ServingSetup, check_policy, progress_printer, run_policy)
from allocator.serving.models import shipped_configs
from allocator.serving.presets import (DTYPE_BYTES, MODEL_ALIASES, MODELS, accelerator,
                                      card_names, model_spec)
from allocator.serving.profiles import EngineProfile, profile_names
from allocator.serving.profiles import engine_profile as load_engine_profile
from allocator.serving.timing import EmuSettings, make_timing
from allocator.trace import (RequestTrace, arrival_seconds, load_trace, load_trace_once,
                             trace_check)

EVICTIONS = ("lru", "fifo", "random")

SCHEMA = "odma-hw.simulate/1"
LIST_SCHEMA = "odma-hw.simulate-list/1"
DEFAULT_POLICIES = "odma,static,paged"
DEFAULT_MFU = 0.5                       # prefill compute efficiency where the card gives none


def card_emu(dev, channels=None, **settings) -> EmuSettings:
    """The emulator settings of a card: its emu preset and channels (channels overrides them);
    a card timed otherwise keeps EmuSettings' preset, used only when --timing names emu."""
    kind, _, preset = dev.timing.partition(":")
    if kind == "emu":
        settings["preset"] = preset
    return EmuSettings(channels=channels or dev.emu_channels, **settings)


def demand_bound(text: str):
    """--demand-bound: a finite number >= 0, or none."""
    return None if text.strip().lower() == "none" else argtypes.nonnegative_float(text)


def swap_space(text: str) -> float:
    """--swap-space: GB >= 0 whose bytes a byte count holds (the simulator and the engine both
    take int(GB x 1e9): 1e300 GB would overflow it only once a model is built)."""
    gb = argtypes.nonnegative_float(text)
    if gb * 1e9 > MAX_TIER_BYTES:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_TIER_BYTES / 1e9:.3g} GB, not "
                                         f"{text!r}")
    return gb


def parse_policies(text: str, extra: tuple = ()) -> list[str]:
    """A comma-separated list of policies (and of the `extra` names a command adds)."""
    known = [*POLICIES, *extra]
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in known]
    if not names or bad:
        raise BadArgument(f"unknown policy {', '.join(bad) or repr(text)}: expected a comma-"
                          f"separated list of {', '.join(known)}")
    return list(dict.fromkeys(names))


# both spellings of a dtype, as torch and as vLLM's short names
DTYPE_SPELLINGS = {"fp32": "float32", "float32": "fp32", "bf16": "bfloat16", "bfloat16": "bf16",
                   "fp16": "float16", "float16": "fp16", "int8": "int8"}


def dtype_argument(names):
    """The type of a --dtype among `names` (a command's own spellings): either spelling of
    one (fp32 or float32, bf16 or bfloat16) -> the command's."""
    names = list(names)

    def parse(text: str) -> str:
        t = text.strip().lower()
        for name in (t, DTYPE_SPELLINGS.get(t)):
            if name in names:
                return name
        both = ", ".join(f"{n} ({DTYPE_SPELLINGS[n]})" if DTYPE_SPELLINGS.get(n, n) != n else n
                         for n in names)
        raise argparse.ArgumentTypeError(f"expected one of {both}, not {text!r}")
    return parse


def goodput_item(text: str) -> str:
    """One --goodput KEY:MS item, checked as it is parsed (in one line)."""
    try:
        parse_goodput([text])
    except BadArgument as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--goodput ")) from None
    return text


def goodput_slo(items) -> dict | None:
    """--goodput's items -> {ttft|tpot|e2el: seconds} (None when not given)."""
    return parse_goodput(items) if items else None


def cap_lengths(trace, prompt_cap: int | None = None, output_cap: int | None = None):
    """`trace` with every prompt cut to at most prompt_cap tokens and every output to at most
    output_cap (None: not cut), as --prompt-cap / --output-cap cut them in simulate and the
    engine alike; a new trace (the one given, perhaps a cached one, is left as it was)."""
    if not (prompt_cap or output_cap):
        return trace
    prompt = trace.prompt if not prompt_cap else np.minimum(trace.prompt, prompt_cap)
    gen = trace.generated if not output_cap else np.minimum(trace.generated, output_cap)
    prefix = (None if trace.prefix_tokens is None
              else np.minimum(trace.prefix_tokens, prompt))
    return RequestTrace(prompt, gen, trace.arrival, trace.name, prefix_id=trace.prefix_id,
                        prefix_tokens=prefix, offer_id=trace.offer_id)


def load_text(rate, concurrency, arrivals_given: bool, time_scale: float = 1.0) -> str:
    """What the load of a run is, in words: all at once, the trace's arrivals, R req/s, a
    closed loop of C (at R req/s where given)."""
    if concurrency is not None:
        return f"closed loop {concurrency}" + (f" at {rate:g} req/s" if rate else "")
    if rate:
        return f"{rate:g} req/s"
    if not arrivals_given:
        return "all at once"
    return "trace arrivals" + (f" x{time_scale:g}" if time_scale != 1.0 else "")


def summary_table(results: list[dict], labels: list[str]) -> list[str]:
    """The lines of vllm bench serve's summary of each result (labelled): request, output and
    total token throughput; mean, median and p99 of TTFT, TPOT and ITL in ms; goodput where
    --goodput set SLOs."""
    good = any(r.get("goodput") for r in results)
    head = ["", "req/s", "out tok/s", "total tok/s"]
    for m in ("TTFT", "TPOT", "ITL"):
        head += [f"{m} mean", f"{m} median", f"{m} p99"]
    if good:
        head += ["goodput req/s", "good"]
    rows = [head]
    for r, label in zip(results, labels):
        v = r["vllm_summary"]

        def ms(x):
            return "-" if x is None else f"{x:.1f}"
        row = [label, f"{v['request_throughput']:.3f}", f"{v['output_throughput']:.1f}",
               f"{v['total_token_throughput']:.1f}"]
        for m in ("ttft", "tpot", "itl"):
            row += [ms(v[f"mean_{m}_ms"]), ms(v[f"median_{m}_ms"]), ms(v[f"p99_{m}_ms"])]
        if good:
            g = r.get("goodput")
            row += (["-", "-"] if not g else
                    [f"{g['requests_per_s']:.3f}", f"{g['good_requests']}/{r['completed']}"])
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                       enumerate(zip(row, widths))).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(0, "as vllm bench serve reports it (latencies in ms):")
    g = next((r["goodput"] for r in results if r.get("goodput")), None)
    if g:
        lines.append("goodput = requests/s within every SLO: " + ", ".join(
            f"{k} <= {v:g} ms" for k, v in g["slo_ms"].items()))
    if any(r.get("itl_basis") != ITL_TOKEN_TIMES for r in results):
        lines.append("ITL (simulated): the mean is exact; median and p99 take each request's "
                     "gaps at its mean gap (no token's time is kept)")
    return lines



# options that change only some policies' runs -> those policies: a demand bound is elastic's
# admission plan; co-batching picks requests by bucket tag, and static puts every request in one
# bucket, so its runs keep arrival order
OPTION_POLICIES = {"--demand-bound": tuple(p for p in POLICIES if policy(p).demand),
                   "--cobatch": tuple(p for p in POLICIES if policy(p).cobatches)}


def check_options_used(policies, demand_bound=0.0, cobatch: int = 0) -> None:
    """BadArgument for an option of OPTION_POLICIES set (off its default) that changes none of
    `policies`' runs: their results would be the ones without it."""
    given = [option for option, on in (("--demand-bound", demand_bound != 0.0),
                                       ("--cobatch", cobatch)) if on]
    for option in given:
        users = OPTION_POLICIES[option]
        if not set(users) & set(policies):
            raise BadArgument(f"{option} changes only {', '.join(users)} runs: --policy "
                              f"{','.join(policies)} would run as without it (drop it, or add "
                              f"one of those policies)")


def clip_note(dropped: int, cut: int, served: int, max_model_len: int) -> str | None:
    """The line saying what --clip changed of the workload (None: nothing), so that a table of
    19,365 requests does not pass for the 19,366-request trace it was asked to serve."""
    if not (dropped or cut):
        return None
    return (f"--clip: {dropped} of {served + dropped} requests dropped (prompt alone >= max "
            f"model len {max_model_len}), {cut} generations cut at that length")


def add_length_caps(p) -> None:
    """--prompt-cap and --output-cap: simulate's and the engine's."""
    p.add_argument("--prompt-cap", type=argtypes.positive_int, default=None, metavar="N",
                   help="cut every prompt to at most N tokens (before --max-model-len and "
                        "--clip; an engine run on a CPU takes minutes, not hours)")
    p.add_argument("--output-cap", type=argtypes.positive_int, default=None, metavar="N",
                   help="make at most N tokens per request")


def add_goodput_argument(p) -> None:
    """--goodput KEY:MS ...: simulate's and the engine's, as vllm bench serve --goodput."""
    p.add_argument("--goodput", type=goodput_item, nargs="+", default=None,
                   metavar="KEY:MS",
                   help=f"service level objectives in ms, as vllm bench serve --goodput: any "
                        f"of {', '.join(f'{k} ({v})' for k, v in SLO_METRICS.items())}, e.g. "
                        f"ttft:500 tpot:50; reports the requests within all of them per second "
                        f"(goodput)")


def add_scheduling_arguments(p) -> None:
    """How steps are filled and requests sent: simulate's and the engine's."""
    p.add_argument("--max-num-batched-tokens", type=argtypes.positive_int, default=None,
                   metavar="N",
                   help="chunked prefill (vLLM v1's default): at most N tokens per step, one "
                        "per running request's decode and the rest prompt chunks; at least "
                        "--max-batch (default: off, whole prompts run first, as vLLM v0)")
    p.add_argument("--concurrency", type=argtypes.positive_int, default=None, metavar="C",
                   help="closed loop, as vllm bench serve --max-concurrency C: at most C "
                        "requests in flight, the next sent when one completes (at its --rate "
                        "time if later; without --rate all are ready at once)")
    p.add_argument("--preemption", choices=PREEMPTION, default="recompute",
                   help="what a preempted request's KV becomes: recompute (freed; its prompt "
                        "and tokens run through prefill again, vLLM's default) or swap (copied "
                        "to host memory while --swap-space has room and back when it is "
                        "readmitted, as vLLM v0's preemption_mode=swap)")
    p.add_argument("--swap-space", type=swap_space, default=4.0, metavar="GB",
                   help="host memory for swapped KV, per card (default 4, vLLM's)")
    p.add_argument("--demand-bound", type=demand_bound, default=0.0, metavar="B|none",
                   help="elastic's admission plans for each admitted request's predicted "
                        "length L x (1 + B x u), u the predictor's distance to its 95 %% upper "
                        "bound (default 0: the prediction itself); none plans for nothing beyond "
                        "what a request holds (admit as paging does: for --preemption swap)")
    p.add_argument("--cobatch", type=argtypes.count, default=0, metavar="W",
                   help="co-batch by bucket tag (the ODMA paper's task pool): admit, among the "
                        "first W waiting requests, the oldest whose predicted length falls in "
                        "the batch's commonest bucket (the head after W pass-overs; default 0: "
                        "off, arrival order)")


def simulate(trace, policies=("odma", "static", "paged"), rates=(None,), *,
             model="deepseek-r1-distill-qwen-7b", device="mlu370-x4", timing=None,
             emu: EmuSettings | None = None, dtype="bf16", tp=1, replicas=1, requests=None,
             max_model_len=None, clip=False, time_scale=1.0, seed=0, config=None,
             prefix: PrefixSettings | None = None, progress=False, results: list | None = None,
             failed: list | None = None, check_only=False, engine_profile=None,
             prompt_cap: int | None = None, output_cap: int | None = None,
             goodput: dict | None = None, **setup_args) -> list[dict]:
    """Simulate every (rate, policy) pair; returns one result dict per pair, rates outermost.
    `trace` is a RequestTrace or a CSV path; `device` a preset card's name or a card file;
    `timing` a source string (default: the card's); `emu` the emulator settings of an emu
    source (default: the card's); mfu (in setup_args) defaults to the card's, else DEFAULT_MFU;
    `prefix` a prefix cache in front of prefill (the trace must name prefixes). `results`: the
    list each finished run is appended to (default a new one), so that a caller keeps the
    finished runs when a later one is interrupted. `failed`: where given, a run that fails after
    the checks is recorded there as {"policy", "rate", "error"} and the others go on; else it
    raises. engine_profile: a profile's name or file (allocator/serving/profiles), or an
    EngineProfile, whose terms replace the card's overheads (default: the card's own).
    check_only: make every check that needs no measurement nor simulation, and return [].
    prompt_cap / output_cap: cut every prompt / output to at most that many tokens (cap_lengths,
    as the engine cuts them). goodput: {ttft|tpot|e2el: seconds} SLOs (goodput_slo) whose
    requests within all of them each result counts."""
    profile = engine_profile
    if profile is not None and not isinstance(profile, EngineProfile):
        profile = load_engine_profile(profile)
    if not isinstance(trace, RequestTrace):
        trace = load_trace(trace)
    if requests is not None:
        trace = trace.head(argtypes.positive_int(str(requests)))
    if prefix is not None and (prompt_cap or output_cap):
        raise BadArgument("--prompt-cap and --output-cap change the lengths a trace's prefixes "
                          "are counted in: they do not combine with --prefix-cache")
    trace = cap_lengths(trace, prompt_cap, output_cap)
    if prefix is not None and trace.prefix_id is None:
        raise BadArgument(f"{trace.name} names no prefixes (columns prefix_id, prefix_tokens): "
                          f"a prefix cache has nothing to do; see `odma-hw workload`")
    for p in policies:
        if p not in POLICIES:
            raise BadArgument(f"unknown policy {p!r}: expected one of {', '.join(POLICIES)}")
    check_options_used(policies, (config or AllocatorConfig()).demand_bound,
                       setup_args.get("cobatch", 0))
    if prefix is not None and prefix.schedule != "fcfs" and setup_args.get("cobatch"):
        raise BadArgument(f"--cobatch takes requests in arrival order: it does not combine "
                          f"with --prefix-schedule {prefix.schedule}")
    m, dev = model_spec(model), accelerator(device)
    if profile is not None:
        dev = profile.apply(dev)
    if not (isinstance(replicas, int) and replicas >= 1):
        raise BadArgument(f"replicas must be a positive integer, got {replicas!r}")
    emu = emu or card_emu(dev)
    source = timing or dev.timing
    if setup_args.get("mfu") is None:
        setup_args["mfu"] = DEFAULT_MFU if dev.mfu is None else dev.mfu
    setup = ServingSetup(m, dev, None, dtype=dtype, tp=tp, max_model_len=max_model_len or 0,
                         config=config or AllocatorConfig(background_refresh=False), seed=seed,
                         **setup_args)
    # every check that can fail before the timing source runs the emulator
    # a closed loop without a rate sends as fast as places free, as vllm bench serve does
    closed = setup_args.get("concurrency") is not None
    arrivals = [np.zeros(len(trace)) if closed and rate is None
                else arrival_seconds(trace, rate, time_scale, seed) for rate in rates]
    check_scheduling(setup.max_batch, setup.max_batched_tokens, setup.concurrency, replicas)
    _, _, _, setup.max_model_len, _, _ = fit_lengths(trace, max_model_len, m, clip)
    for p in policies:
        check_policy(setup, p, prefix)
    setup.timing = make_timing(source, dev.bandwidth_gbps, emu, check_only=check_only)
    if check_only:
        return []
    out = [] if results is None else results
    for rate, arr in zip(rates, arrivals):
        for p in policies:
            show = progress_printer(f"{p}" + (f" @ {rate:g} req/s" if rate else "")) \
                if progress else None
            try:
                r = run_policy(trace, arr, p, setup, replicas=replicas, clip=clip,
                               progress=show, prefix=prefix)
            except (OdmaError, RuntimeError, MemoryError) as exc:
                if failed is None:
                    raise
                failed.append({"policy": p, "rate": rate, "error": f"{exc}"})
                continue
            r["rate"] = rate
            r["engine_profile"] = None if profile is None else profile.name
            r["offered_rate"] = (len(trace) / max(float(arr.max()), 1e-12)
                                 if len(trace) > 1 else None)
            r["load"] = load_text(rate, setup.concurrency, trace.arrival is not None,
                                  time_scale)
            apply_goodput(r, goodput)
            out.append(r)
    return out


def _paged(r) -> bool:
    return policy(r["policy"]).layout == "paged"


def policy_label(r) -> str:
    """A result's policy as the tables name it: a paged one with its layout (paged/hnd)."""
    return r["policy"] + (f"/{r['layout']}" if _paged(r) else "")


def load_of(r: dict) -> str:
    return r.get("load") or ("trace" if r["rate"] is None else f"{r['rate']:g} req/s")


def scheduler_text(max_batched_tokens, max_batch, concurrency=None) -> str:
    """The scheduler a run used, in words: prefill-first or chunked N, and its batch."""
    kind = ("prefill-first" if max_batched_tokens is None
            else f"chunked {max_batched_tokens} tokens/step")
    return f"{kind}, max batch {max_batch}"


def head_line(results: list[dict]) -> str:
    """The first line of simulate's table: device, model, KV layout of each policy, scheduler."""
    st = results[0]["settings"]
    layouts = ", ".join(dict.fromkeys(
        f"{r['policy']} {r['layout']}" + (f" ({st['page_tokens']}-token pages)"
                                          if _paged(r) else "")
        for r in results))
    chunk = st.get("max_num_batched_tokens")
    return (f"{st['device']} TP{st['tp']} x {st['replicas']} replica(s), {st['model']} "
            f"{st['dtype']}; KV layout: {layouts}; scheduler: "
            f"{scheduler_text(chunk, st['max_batch'])}")


def format_table(results: list[dict]) -> str:
    head = ["load", "policy", "tok/s", "req/s", "TTFT p50", "TTFT p99", "TPOT p50", "E2E p50",
            "E2E p99", "util", "batch", "peak", "preempt", "migr", "KV share"]
    rows = [head]
    for r in results:
        def ms(x):
            return "-" if x is None else (f"{x * 1e3:.0f}ms" if x < 1 else f"{x:.1f}s")
        rows.append([
            load_of(r), policy_label(r),
            f"{r['output_tps']:.1f}", f"{r['requests_per_s']:.3f}", ms(r["ttft_s"]["p50"]),
            ms(r["ttft_s"]["p99"]), ms(r["tpot_s"]["p50"]), ms(r["e2e_s"]["p50"]),
            ms(r["e2e_s"]["p99"]),
            "-" if r["utilization"] is None else f"{r['utilization']:.3f}",
            f"{r['mean_batch']:.1f}", str(r["peak_batch"]), str(r["preemptions"]),
            str(r["migrations"]), f"{r['step_time_share']['kv']:.2f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(0, head_line(results))
    r = results[0]
    st, t = r["settings"], r["timing"]
    lines.append(
        f"{r['trace']}: {r['requests']} requests; {st['model']} {st['dtype']} on "
        f"{st['device']} TP{st['tp']} x {st['replicas']} replica(s); KV pool "
        f"{r['kv_pool_gb_per_card']:.2f} GB/card ({r['kv_pool_tokens']} tokens); max model len "
        f"{st['max_model_len']}; timing {t['source']} (seq {t['seq_gbps']:.0f} GB/s, 16 KiB "
        f"runs {t['run_gbps']['16384']:.0f} GB/s)")
    note = clip_note(r["dropped_over_length"], r["truncated_over_length"], r["requests"],
                     st["max_model_len"])
    if note:
        lines.append(note)
    lines.append("util = KV used / KV reserved over completed requests; KV share = share of "
                 "decode step time spent reading KV; TPOT = time per output token")
    for r in results:
        pc = r.get("prefix_cache")
        if pc:
            hit = pc["hit_rate"]
            lines.append(
                f"prefix cache ({r['policy']}" + (f" @ {r['rate']:g}" if r["rate"] else "")
                + f"): {pc['lookups']} lookups, found on device {hit['device'] or 0:.1%}, host "
                f"{hit['host'] or 0:.1%}, disk {hit['disk'] or 0:.1%}, missed {hit['miss'] or 0:.1%};"
                f" {pc['covered_tokens']} of {pc['prompt_tokens']} prompt tokens covered; prefill "
                f"saved {pc['prefill_saved_s']:.1f} s, restores {pc['restore_s']:.1f} s, offers "
                f"{pc['offer_s']:.1f} s")
    lines += [""] + summary_table(results, [
        f"{load_of(r)} {policy_label(r)}" for r in results])
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    plt = plotting.pyplot()

    policies = list(dict.fromkeys(r["policy"] for r in results))
    rates = sorted({r["rate"] for r in results if r["rate"] is not None})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for p in policies:
        rs = [r for r in results if r["policy"] == p and r["rate"] is not None]
        if rs:
            ax.plot([r["rate"] for r in rs], [r["output_tps"] for r in rs], marker="o", label=p)
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs load" if rates else "(one load: see the time series)")
    ax.grid(alpha=0.3)
    if rates:
        ax.legend()
    last = [r for r in results if r["rate"] == (rates[-1] if rates else None)]
    for r in last:
        t = [x["t"] for x in r["series"]]
        axes[1].plot(t, [x["running"] for x in r["series"]], label=r["policy"])
        axes[2].plot(t, [x["occupancy"] for x in r["series"]], label=r["policy"])
    axes[1].set_title("running batch over time" + (f" ({rates[-1]:g} req/s)" if rates else ""))
    axes[1].set_xlabel("simulated seconds")
    axes[1].set_ylabel("running requests")
    axes[2].set_title("KV pool reserved over time")
    axes[2].set_xlabel("simulated seconds")
    axes[2].set_ylabel("share of KV pool reserved")
    axes[2].set_ylim(0, 1.05)
    for ax in axes[1:]:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    plotting.save(fig, path)


def compute(args, results: list | None = None, failed: list | None = None,
            check_only: bool = False) -> dict:
    """The JSON object of `odma-hw simulate` for parsed arguments (with the time series);
    `results`, `failed` and `check_only` as simulate() takes them."""
    policies = parse_policies(args.policy)
    config = AllocatorConfig(alpha=args.alpha, tau=args.tau, n_buckets=args.buckets,
                             bucket_rule=args.bucket_rule, bucket_basis=args.bucket_basis,
                             large_share=args.large_share, cold_start=args.cold_start,
                             demand_bound=args.demand_bound, background_refresh=False)
    profile = (None if args.engine_profile is None
               else load_engine_profile(args.engine_profile))
    dev = accelerator(args.device)
    emu = card_emu(dev, args.channels, interleave=args.interleave,
                   address_map=args.address_map, queue=args.queue, streams=args.streams,
                   chunk_bytes=args.chunk_bytes)
    prefix = None
    if args.prefix_cache:
        prefix = PrefixSettings(device_gb=args.cache_device_gb, host_gb=args.cache_host_gb,
                                disk_gb=args.cache_disk_gb, eviction=args.eviction,
                                schedule=args.prefix_schedule, prefetch=args.prefetch,
                                host_to_device_gbps=args.pcie_gbps,
                                device_to_host_gbps=args.pcie_gbps,
                                disk_read_gbps=args.disk_read_gbps,
                                disk_write_gbps=args.disk_write_gbps)
    results = simulate(
        args.trace, policies, args.rate or [None], model=args.model, device=args.device,
        prefix=prefix,
        timing=args.timing, emu=emu, dtype=args.dtype, tp=args.tp, replicas=args.replicas,
        requests=args.requests, max_model_len=args.max_model_len, clip=args.clip,
        time_scale=args.time_scale, seed=args.seed, config=config,
        progress=not args.json or sys.stderr.isatty(),
        max_batch=args.max_batch, mfu=args.mfu, memory_utilization=args.memory_utilization,
        kv_pool_gb=args.kv_pool_gb, paged_layout=args.layout, page_tokens=args.page_tokens,
        predictor=args.predictor, max_batched_tokens=args.max_num_batched_tokens,
        concurrency=args.concurrency, preemption=args.preemption, swap_space_gb=args.swap_space,
        swap_gbps=args.pcie_gbps, cobatch=args.cobatch, results=results, failed=failed,
        check_only=check_only, engine_profile=profile, prompt_cap=args.prompt_cap,
        output_cap=args.output_cap, goodput=goodput_slo(args.goodput))
    return {"schema": SCHEMA, "results": results, "failed": failed or []}


def _show(args, results: list[dict], failed: list[dict]) -> None:
    if args.json:
        rows = [dict(r) for r in results]
        if not args.series:
            for r in rows:
                r.pop("series")
        print(jsonout.dumps({"schema": SCHEMA, "results": rows, "failed": failed}, indent=1))
    elif results:
        print(format_table(results))


def kv_head(model: str) -> tuple[str, int]:
    """(name, head_dim) of what --model names, read as simulate reads it (presets.model_spec;
    a config's head size by models.check_config's rule): `odma-hw probe --model` asks for it
    through the command registry (odma_hw/commands.py) to size the model's KV pages."""
    m = model_spec(model)
    return m.name, m.head_dim


def list_doc() -> dict:
    """What --list shows: the models --model takes by name and the preset cards."""
    models = []
    for name in [*MODELS, *MODEL_ALIASES, *shipped_configs()]:
        m = model_spec(name)
        kind = ("alias" if name in MODEL_ALIASES else "preset" if name in MODELS
                else "shipped config")
        models.append({"name": name, "kind": kind, "alias_of": MODEL_ALIASES.get(name),
                       "layers": m.layers, "params": m.params,
                       "kv_bytes_per_token": m.kv_bytes_per_token,
                       "max_context": m.max_context})
    cards = [dataclasses.asdict(accelerator(name)) for name in card_names()]
    return {"schema": LIST_SCHEMA, "models": models, "cards": cards}


def format_list(doc: dict) -> str:
    def table(head, rows):
        rows = [head] + rows
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return [lines[0], "-" * max(map(len, lines))] + lines[1:]

    out = ["models (--model; also any Hugging Face config.json):"]
    out += table(["model", "kind", "layers", "params", "KV B/token", "max context"],
                 [[m["name"], m["kind"] + (f" of {m['alias_of']}" if m["alias_of"] else ""),
                   str(m["layers"]), f"{m['params'] / 1e9:.2f}B" if m["params"] >= 1e8
                   else f"{m['params'] / 1e6:.2f}M",
                   str(m["kv_bytes_per_token"]), str(m["max_context"])]
                  for m in doc["models"]])
    out += ["", "cards (--device; also any card file, TOML or JSON):"]
    out += table(["card", "GB/s", "GB", "TFLOPS bf16", "timing", "file"],
                 [[c["name"], f"{c['bandwidth_gbps']:g}", f"{c['capacity_gb']:g}",
                   f"{c['tflops_bf16']:g}", c["timing"], c["path"]] for c in doc["cards"]])
    return "\n".join(out)


def _cmd(args) -> int:
    if args.list:
        doc = list_doc()
        print(jsonout.dumps(doc, indent=1) if args.json else format_list(doc))
        return 0
    if args.trace is None:
        raise BadArgument("simulate needs --trace CSV (or --list)")
    if args.plot:
        plotting.check_plot_path(args.plot)
    results: list[dict] = []
    failed: list[dict] = []
    try:
        compute(args, results, failed)
    except KeyboardInterrupt:
        if results:                  # the runs that finished are kept, as a sweep keeps cells
            _show(args, results, failed)
        raise
    _show(args, results, failed)
    if args.plot and results:
        plot(results, args.plot)
    if failed:
        runs = "; ".join(f"{f['policy']}" + (f" @ {f['rate']:g} req/s" if f["rate"] else "")
                         + f": {f['error']}" for f in failed)
        raise RunFailed(f"{len(failed)} of {len(failed) + len(results)} runs failed (the "
                          f"others are complete): {runs}")
    return 0


USES_NUMBA = True                       # the default timing source is the emulator
ROW_KEYS = ("policy", "rate")           # what tells apart the rows of one run
METRICS = SIMULATE_METRICS              # the columns a sweep's --metric takes


def sweep_checks() -> list[ValueCheck]:
    """What simulate() refuses before any work, short of measuring (see odma_hw/commands.py)."""
    def given(a):
        if a.trace is None:
            raise BadArgument("simulate needs --trace CSV")

    def fits(a):
        trace = load_trace_once(a.trace)
        if a.requests is not None:
            trace = trace.head(a.requests)
        trace = cap_lengths(trace, a.prompt_cap, a.output_cap)
        fit_lengths(trace, a.max_model_len, model_spec(a.model), a.clip)

    def scheduling(a):
        check_scheduling(a.max_batch, a.max_num_batched_tokens, a.concurrency, a.replicas)

    def timing(a):
        dev = accelerator(a.device)
        emu = card_emu(dev, a.channels, interleave=a.interleave)
        make_timing(a.timing or dev.timing, dev.bandwidth_gbps, emu, check_only=True)

    return [ValueCheck("policy", ("policy",), lambda a: parse_policies(a.policy)),
            ValueCheck("policy", ("policy", "demand_bound", "cobatch"),
                       lambda a: check_options_used(parse_policies(a.policy), a.demand_bound,
                                                    a.cobatch)),
            ValueCheck("trace", ("trace",), given),
            trace_check(),
            ValueCheck("max-model-len", ("trace", "requests", "max_model_len", "model", "clip",
                                         "prompt_cap", "output_cap"), fits),
            ValueCheck("goodput", ("goodput",), lambda a: goodput_slo(a.goodput)),
            ValueCheck("device", ("device",), lambda a: accelerator(a.device)),
            ValueCheck("engine-profile", ("engine_profile",),
                       lambda a: a.engine_profile is None
                       or load_engine_profile(a.engine_profile)),
            ValueCheck("dtype", ("dtype", "device"),
                       lambda a: accelerator(a.device).peak_tflops(a.dtype)),
            ValueCheck("scheduling", ("max_batch", "max_num_batched_tokens", "concurrency",
                                      "replicas"), scheduling),
            ValueCheck("timing", ("timing", "device", "channels", "interleave"), timing)]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate", help="serving simulation: tokens/s of each KV allocation policy",
        description=__doc__.split("\n\n")[0] + " Memory timing comes from the card (a preset or a "
        "card file): the emulator, a probe JSON or ideal; --timing also takes a live torch "
        "measurement.")
    p.add_argument("--trace", metavar="CSV",
                   help="request trace: num_prefill_tokens, num_decode_tokens [, arrived_at] "
                        "(required unless --list)")
    p.add_argument("--list", action="store_true",
                   help="print the models and the preset cards (with --json: one object, "
                        f"{LIST_SCHEMA}) and exit")
    p.add_argument("--requests", type=argtypes.positive_int, default=None, metavar="N",
                   help="serve only the first N requests of the trace")
    p.add_argument("--rate", type=argtypes.positive_floats, default=None, metavar="R[,R...]",
                   help="Poisson arrivals at these requests/s (one run each; default: the "
                        "trace's arrived_at, else all at once)")
    p.add_argument("--time-scale", type=argtypes.positive_float, default=1.0,
                   help="multiply arrived_at by this (< 1 = more load)")
    p.add_argument("--seed", type=argtypes.seed, default=0,
                   help="seeds arrivals and noisy predictions (default 0)")
    p.add_argument("--policy", default=DEFAULT_POLICIES, metavar="P[,P...]",
                   help=f"policies among {', '.join(POLICIES)} (default {DEFAULT_POLICIES})")
    add_policy_arguments(p)
    p.add_argument("--model", default="deepseek-r1-distill-qwen-7b", metavar="MODEL",
                   help=f"a preset ({', '.join(list(MODELS) + list(MODEL_ALIASES))}), a Hugging "
                        f"Face config.json or a directory holding one (default "
                        f"deepseek-r1-distill-qwen-7b)")
    p.add_argument("--dtype", default="bf16", type=dtype_argument(DTYPE_BYTES),
                   metavar="{bf16,bfloat16,int8,fp32,float32}",
                   help="weight type (default bf16; the engine's default is float32, its CPU "
                        "runs); KV stays bf16, but fp32 serves fp32 KV (as odma-hw's engine on "
                        "CPU); int8 and fp32 need the card's tops_int8 / tflops_fp32")
    p.add_argument("--device", default="mlu370-x4", metavar="CARD",
                   help=f"a preset card ({', '.join(card_names())}; default mlu370-x4, "
                        f"a100-80gb is the HBM contrast) or a card file: TOML, or JSON if named "
                        f"*.json, with name, bandwidth_gbps, capacity_gb, tflops_bf16, timing "
                        f"(emu:PRESET, probe:FILE or ideal), link_gbps, link_latency_us (see "
                        f"--list and the README)")
    p.add_argument("--engine-profile", default=None, metavar="NAME|FILE",
                   help=f"the serving engine's per-step terms (overheads, weight read "
                        f"efficiency) in place of the card's: a preset ({', '.join(profile_names())}"
                        f") or a profile file (TOML); default: the card's own")
    p.add_argument("--tp", type=argtypes.positive_int, default=1,
                   help="tensor-parallel cards per replica (default 1)")
    p.add_argument("--replicas", type=argtypes.positive_int, default=1,
                   help="independent replicas, requests dealt round robin (default 1)")
    p.add_argument("--timing", default=None, metavar="SOURCE",
                   help="emu:PRESET, probe:FILE (odma-hw probe --json output), "
                        "live:torch:DEVICE or ideal (every run at full bandwidth); default: "
                        "the card's timing")
    p.add_argument("--channels", type=argtypes.positive_int, default=None,
                   help="emulated channels (default: the card's)")
    p.add_argument("--interleave", type=argtypes.positive_int, default=None, metavar="BYTES",
                   help="emulated channel-interleave granule (default 256)")
    p.add_argument("--address-map", default="bg", choices=["bg", "rbc", "xor"],
                   help="emulated address map (default bg)")
    p.add_argument("--queue", type=argtypes.positive_int, default=32,
                   help="emulated controller queue depth per direction (default 32)")
    p.add_argument("--streams", type=argtypes.positive_int, default=1,
                   help="KV runs in flight at the memory controller at once (default 1)")
    p.add_argument("--chunk-bytes", type=argtypes.positive_int, default=None,
                   help="with --streams > 1: bytes of one run before another's interleave")
    p.add_argument("--layout", default="hnd", choices=list(PAGED_LAYOUTS),
                   help="paged KV layout: v06 (vLLM 0.6), hnd (vllm-mlu, default), nhd (vLLM v1)")
    p.add_argument("--page-tokens", type=argtypes.positive_int, default=16,
                   help="tokens per page of the paged policy (default 16)")
    p.add_argument("--max-model-len", type=argtypes.positive_int, default=None,
                   help="longest request served; static blocks are this long (default: the "
                        "longest request of the trace)")
    p.add_argument("--clip", action="store_true",
                   help="drop prompts longer than --max-model-len and cut generations there, "
                        "instead of refusing the trace")
    add_length_caps(p)
    p.add_argument("--max-batch", type=argtypes.positive_int, default=256,
                   help="running requests at most (vLLM max_num_seqs, default 256)")
    add_scheduling_arguments(p)
    p.add_argument("--mfu", type=argtypes.positive_float, default=None,
                   help=f"prefill compute efficiency, in (0, 1] (default: the card's mfu, "
                        f"else {DEFAULT_MFU})")
    p.add_argument("--memory-utilization", type=argtypes.positive_float, default=0.9,
                   help="share of card memory for weights + KV (default 0.9)")
    p.add_argument("--kv-pool-gb", type=argtypes.positive_float, default=None, metavar="GB",
                   help="KV pool per card in GB of 1e9 B (default: what the weights leave of "
                        "--memory-utilization of the card; the engine's default is 0.064, "
                        "as a CPU has no card capacity)")
    c = p.add_argument_group("prefix cache (traces with prefix_id / prefix_tokens columns)")
    c.add_argument("--prefix-cache", action="store_true",
                   help="keep prefixes' KV across requests in device, host and disk tiers")
    c.add_argument("--cache-device-gb", type=argtypes.nonnegative_float, default=1.0,
                   help="device tier, carved out of the KV pool (default 1 GB)")
    c.add_argument("--cache-host-gb", type=argtypes.nonnegative_float, default=16.0,
                   help="host-memory tier (default 16 GB)")
    c.add_argument("--cache-disk-gb", type=argtypes.nonnegative_float, default=64.0,
                   help="disk tier (default 64 GB)")
    c.add_argument("--eviction", default="lru", choices=list(EVICTIONS))
    c.add_argument("--prefix-schedule", default="fcfs", choices=list(SCHEDULES),
                   help="admission order: FCFS, fastest-prefix-first (may starve), relaxed FPF")
    c.add_argument("--prefetch", type=argtypes.count, default=0, metavar="N",
                   help="prefetch the prefixes of the next N queued requests (default 0: off)")
    c.add_argument("--pcie-gbps", type=argtypes.positive_float, default=25.0,
                   help="host <-> device bandwidth, of the prefix cache's host tier and of "
                        "swapped KV (default 25: PCIe 4.0 x16 effective)")
    c.add_argument("--disk-read-gbps", type=argtypes.positive_float, default=3.0,
                   help="disk tier read bandwidth (default 3: an NVMe SSD)")
    c.add_argument("--disk-write-gbps", type=argtypes.positive_float, default=2.0,
                   help="disk tier write bandwidth (default 2)")
    add_goodput_argument(p)
    p.add_argument("--json", action="store_true",
                   help=f"print one JSON object ({SCHEMA}; with --list {LIST_SCHEMA})")
    p.add_argument("--series", action="store_true", help="with --json: include time series")
    p.add_argument("--plot", metavar="PNG",
                   help="tokens/s vs rate per policy; batch and KV occupancy over time")
    p.set_defaults(func=_cmd)

