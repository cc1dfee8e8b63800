"""simulate(): serving a request trace with each KV allocation policy on a card, every
(rate, policy) pair one run of the serving simulation (engine.py), after every check that needs
no measurement. `odma-hw simulate` (cli.py) is its command line."""

from __future__ import annotations

import numpy as np

from odma_cli import argtypes
from odma_cli.errors import BadArgument, OdmaError

from allocator.config import AllocatorConfig
from allocator.policies import POLICIES
from allocator.serving.cards.presets import DEFAULT_CARD, DEFAULT_MODEL, accelerator, model_spec
from allocator.serving.cards.profiles import EngineProfile
from allocator.serving.cards.profiles import engine_profile as load_engine_profile
from allocator.serving.core.checks import check_scheduling
from allocator.serving.core.metrics import apply_goodput
from allocator.serving.core.requests import fit_lengths
from allocator.serving.options import card_emu, cap_lengths, check_options_used, load_text
from allocator.serving.sim.replica import (PrefixSettings, ServingSetup, check_policy,
                                           progress_printer, run_policy)
from allocator.serving.sim.timing import EmuSettings, make_timing
from allocator.trace import RequestTrace, arrival_seconds, load_trace

DEFAULT_MFU = 0.5                       # prefill compute efficiency where the card gives none


def simulate(trace, policies=("odma", "static", "paged"), rates=(None,), *,
             model=DEFAULT_MODEL, device=DEFAULT_CARD, timing=None,
             emu: EmuSettings | None = None, dtype="auto", tp=1, replicas=1, requests=None,
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
    trace = _workload(trace, requests, prefix, prompt_cap, output_cap)
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
    _serve(trace, zip(rates, arrivals), policies, setup, replicas=replicas, clip=clip,
           prefix=prefix, progress=progress, failed=failed, profile=profile,
           time_scale=time_scale, goodput=goodput, out=out)
    return out


def _workload(trace, requests, prefix, prompt_cap, output_cap) -> RequestTrace:
    """The trace simulate() serves: read (a CSV path), its first `requests`, cut to the length
    caps; BadArgument where the caps or a prefix cache do not fit it."""
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
    return trace


def _serve(trace, runs, policies, setup, *, replicas, clip, prefix, progress, failed, profile,
           time_scale, goodput, out) -> None:
    """Run every policy at every (rate, arrival times) of `runs`, appending each result to
    `out` (a run that fails goes to `failed` where given, else raises)."""
    for rate, arr in runs:
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
