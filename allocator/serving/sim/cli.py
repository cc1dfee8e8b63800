"""`odma-hw simulate`: tokens per second, latency and KV utilization of serving a request trace
with each KV allocation policy, on an emulated or measured device.

Every policy sees the same requests at the same (Poisson or trace) arrival times; a list of
rates prints one row per rate and policy.

The command: its parser, compute() (the JSON object a sweep records), --list, and the checks a
sweep runs before any cell. simulation.py holds simulate(), report.py the table and the
plot, allocator/serving/options.py the options it shares with `odma-hw engine`.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

from odma_cli import argtypes, jsonout, plotting
from odma_cli.commands import ALL, ValueCheck
from odma_cli.errors import BadArgument, RunFailed
from odma_hw.emu import cli as emulate_cli

from allocator.config import AllocatorConfig
from allocator.policies import POLICIES, policy
from allocator.replay import add_policy_arguments
from allocator.serving.cards.datafile import FRACTION
from allocator.serving.cards.presets import (DEFAULT_MODEL, DTYPE_BYTES, MODELS, MODEL_ALIASES,
                                             accelerator, auto_dtype, card_names, model_spec)
from allocator.serving.cards.profiles import engine_profile as load_engine_profile
from allocator.serving.core.checks import check_scheduling
from allocator.serving.core.metrics import SIMULATE_METRICS
from allocator.serving.core.requests import fit_lengths
from allocator.serving.models import shipped_configs
from allocator.serving.options import (BANDWIDTH_GBPS_TYPE, POOL_GB_TYPE, SERVING_OPTION_UNITS,
                                       add_card_argument, add_dtype_argument,
                                       add_engine_profile_argument, add_goodput_argument,
                                       add_length_caps,
                                       add_memory_utilization_argument, add_preset_argument,
                                       add_scheduling_arguments, cap_lengths, card_emu, cards_of,
                                       check_options_used, goodput_slo, parse_policies)
from allocator.serving.sim.replica import PAGED_LAYOUTS, SCHEDULES, PrefixSettings
from allocator.serving.sim.report import format_table, plot
from allocator.serving.sim.simulation import DEFAULT_MFU, simulate
from allocator.serving.sim.timing import make_timing
from allocator.trace import load_trace_once, trace_check

EVICTIONS = ("lru", "fifo", "random")
# the prefix cache's options and their defaults (None on the command line: not given, so that
# one given without --prefix-cache is told it does nothing)
PREFIX_CACHE_DEFAULTS = {"cache_device_gb": 1.0, "cache_host_gb": 16.0, "cache_disk_gb": 64.0,
                         "eviction": "lru", "prefix_schedule": "fcfs", "prefetch": 0,
                         "disk_read_gbps": 3.0, "disk_write_gbps": 2.0}

SCHEMA = "odma-hw.simulate/1"
LIST_SCHEMA = "odma-hw.simulate-list/1"
DEFAULT_POLICIES = "odma,static,paged"
# the defaults are the ODMA paper's setting; a GPU user's vLLM v1 is one option away
DEFAULTS_NOTE = ("The defaults are the ODMA paper's: an MLU370-X4, DeepSeek-R1-Distill-Qwen-7B, "
                 "vllm-mlu's head-major pages (hnd), whole prompts first, 256 requests at most; "
                 "vLLM v1's own on an H100 (its OpenAI server) are --card h100-sxm "
                 "--preset vllm-v1.")


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
    prefix = None
    if args.prefix_cache:
        c = argtypes.with_defaults(args, PREFIX_CACHE_DEFAULTS)
        prefix = PrefixSettings(device_gb=c["cache_device_gb"], host_gb=c["cache_host_gb"],
                                disk_gb=c["cache_disk_gb"], eviction=c["eviction"],
                                schedule=c["prefix_schedule"], prefetch=c["prefetch"],
                                host_to_device_gbps=args.pcie_gbps,
                                device_to_host_gbps=args.pcie_gbps,
                                disk_read_gbps=c["disk_read_gbps"],
                                disk_write_gbps=c["disk_write_gbps"])
    results = [] if results is None else results
    cards = cards_of(args)
    # several cards: every card's checks before any card's runs (a bad second card is refused
    # before any work)
    passes = [True] if check_only else [True, False] if len(cards) > 1 else [False]
    for check in passes:
        for card in cards:
            before = len(failed) if failed is not None else 0
            simulate(args.trace, policies, args.rate or [None], model=args.model, device=card,
                     prefix=prefix, timing=args.timing, emu=_card_emu(args, card),
                     dtype=args.dtype, tp=args.tp, replicas=args.replicas,
                     requests=args.requests, max_model_len=args.max_model_len, clip=args.clip,
                     time_scale=args.time_scale, seed=args.seed, config=config,
                     progress=not args.json or sys.stderr.isatty(), max_batch=args.max_batch,
                     mfu=args.mfu, memory_utilization=args.memory_utilization,
                     kv_pool_gb=args.kv_pool_gb, paged_layout=args.layout,
                     page_tokens=args.page_tokens, predictor=args.predictor,
                     max_batched_tokens=args.max_num_batched_tokens,
                     concurrency=args.concurrency, preemption=args.preemption,
                     swap_space_gb=args.swap_space, swap_gbps=args.pcie_gbps,
                     cobatch=args.cobatch, results=results, failed=failed, check_only=check,
                     engine_profile=profile, prompt_cap=args.prompt_cap,
                     output_cap=args.output_cap, goodput=goodput_slo(args.goodput))
            for f in (failed or [])[before:]:
                f["card"] = card
    return {"schema": SCHEMA, "results": results, "failed": failed or []}


def idle_options(args) -> list[str]:
    """What the options given do not do in this combination, a line each: a run that ignores
    an option is still run (a sweep's grid may cross it with the option that enables it), but
    the user is told."""
    lines = []

    def idle(dests, why):
        lines.append(f"{argtypes.flag_names(dests)} do{'es' if len(dests) == 1 else ''} "
                     f"nothing {why}")

    if args.chunk_bytes is not None and args.streams == 1:
        lines.append("--chunk-bytes does nothing with one stream: it interleaves --streams > 1")
    given = argtypes.given(args, PREFIX_CACHE_DEFAULTS)
    if given and not args.prefix_cache:
        idle(given, "without --prefix-cache")
    emulated = _off_default(args, EMULATOR_OPTIONS)
    if emulated and not any((args.timing or accelerator(card).timing).startswith("emu:")
                            for card in cards_of(args)):
        idle(emulated, "here: no card is timed by the emulator (see --timing)")
    pages = _off_default(args, ("layout", "page_tokens"))
    if pages and not any(policy(p).layout == "paged" for p in parse_policies(args.policy)):
        idle(pages, "without the paged policy")
    if args.preemption != "swap" and _off_default(args, ("swap_space",)):
        idle(["swap_space"], "without --preemption swap")
    if args.kv_pool_gb is not None and _off_default(args, ("memory_utilization",)):
        idle(["memory_utilization"], "beside --kv-pool-gb, which sizes the KV pool itself")
    return lines


def _off_default(args, dests) -> list[str]:
    """Of the options `dests`, those the user set off their parser default (set to it, an
    option that does nothing changes nothing either); one --preset sets is the preset's."""
    preset = {flag[2:].replace("-", "_") for flag in (args.preset.flags[::2] if args.preset
                                                       else ())}
    defaults = _parser_defaults()
    return [d for d in dests if d not in preset and getattr(args, d) != defaults[d]]


@functools.cache
def _parser_defaults() -> dict:
    """simulate's options (dest -> parser default), from its own parser."""
    from odma_cli.sweep.grid import command_parser

    return {a.dest: a.default for a in command_parser(__name__, "simulate")._actions}


def _card_emu(args, card: str):
    """The emulator settings of one card, the command's emulator options applied."""
    return card_emu(accelerator(card), args.channels, interleave=args.interleave,
                    address_map=args.address_map, queue=args.queue, streams=args.streams,
                    chunk_bytes=args.chunk_bytes)


def _show(args, results: list[dict], failed: list[dict]) -> None:
    if args.json:
        rows = [dict(r) for r in results]
        if not args.series:
            for r in rows:
                r.pop("series")
        print(jsonout.dumps({"schema": SCHEMA, "results": rows, "failed": failed}, indent=1))
    elif results:
        by_card = {}
        for r in results:
            by_card.setdefault(r["settings"]["device"], []).append(r)
        print("\n\n".join(format_table(rs) for rs in by_card.values()))


def kv_head(model: str) -> tuple[str, int]:
    """(name, head_dim) of what --model names, read as simulate reads it (presets.model_spec;
    a config's head size by models.check_config's rule): `odma-hw probe --model` asks for it
    through the command registry (odma_cli/commands.py) to size the model's KV pages."""
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
    jsonout.check_series(args)
    if args.plot:
        plotting.check_plot_path(args.plot)
    idle = idle_options(args)
    if idle:        # bad input is one line, so the warnings come once every check has passed
        compute(args, check_only=True)
    for line in idle:
        print(f"odma-hw simulate: warning: {line}", file=sys.stderr)
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
        several = len(cards_of(args)) > 1
        runs = "; ".join(f"{f['card'] + ' ' if several else ''}{f['policy']}"
                         + (f" @ {f['rate']:g} req/s" if f["rate"] else "")
                         + f": {f['error']}" for f in failed)
        raise RunFailed(f"{len(failed)} of {len(failed) + len(results)} runs failed (the "
                          f"others are complete): {runs}")
    return 0


ROW_KEYS = ("settings.device", "policy", "rate")  # what tells apart the rows of one run
# a sweep warms a simulate cell up as an emulate one: the default timing source is the emulator
warm_up = emulate_cli.warm_up
DEFAULT_METRIC = "output_tps"           # what a sweep of simulate prints and plots
OPTION_UNITS = {**SERVING_OPTION_UNITS, "interleave": "B", "chunk-bytes": "B"}
METRICS = SIMULATE_METRICS              # the columns a sweep's --metric takes


def sweep_checks() -> list[ValueCheck]:
    """What simulate() refuses before any work, short of measuring (see odma_cli/commands.py)."""
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
        for card in cards_of(a):
            dev = accelerator(card)
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
            ValueCheck("card", ("card", "device"), cards_of),
            ValueCheck("engine-profile", ("engine_profile",),
                       lambda a: a.engine_profile is None
                       or load_engine_profile(a.engine_profile)),
            ValueCheck("dtype", ("dtype", "card", "device"),
                       lambda a: [dev.peak_tflops(auto_dtype(a.dtype, dev.dtype))
                                  for dev in map(accelerator, cards_of(a))]),
            ValueCheck("scheduling", ("max_batch", "max_num_batched_tokens", "concurrency",
                                      "replicas"), scheduling),
            ValueCheck("timing", ("timing", "card", "device", "channels", "interleave"),
                       timing),
            # last, and once per distinct cell: all that simulate() checks short of measuring
            # (a TP the model's heads do not split into, a pool larger than the card, a prefix
            # cache on a trace without prefixes), as the cell itself would check it
            ValueCheck("simulate", ALL, lambda a: compute(a, check_only=True))]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate", help="serving simulation: tokens/s of each KV allocation policy",
        description=__doc__.split("\n\n")[0] + " Memory timing comes from the card (a preset or a "
        "card file): the emulator, a probe JSON or ideal; --timing also takes a live torch "
        "measurement. " + DEFAULTS_NOTE)
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
    _add_model_and_card_arguments(p)
    _add_emulator_arguments(p)
    _add_serving_arguments(p)
    _add_prefix_cache_arguments(p)
    add_goodput_argument(p)
    add_preset_argument(p)
    p.add_argument("--json", action="store_true",
                   help=f"print one JSON object ({SCHEMA}; with --list {LIST_SCHEMA})")
    p.add_argument("--series", action="store_true", help="with --json: include time series")
    p.add_argument("--plot", type=argtypes.nonempty, metavar="PNG",
                   help="tokens/s vs rate per policy; batch and KV occupancy over time")
    p.set_defaults(func=_cmd)


def _add_model_and_card_arguments(p) -> None:
    """What is served on what: --model, --dtype, --card, --engine-profile, --tp,
    --replicas and --timing."""
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="MODEL",
                   help=f"a preset ({', '.join(list(MODELS) + list(MODEL_ALIASES))}), a Hugging "
                        f"Face config.json or a directory holding one (default {DEFAULT_MODEL})")
    add_dtype_argument(p, DTYPE_BYTES, "weight type; KV stays bf16, but fp32 "
                       "serves fp32 KV (as odma-hw's engine on CPU); int8 and fp32 need the "
                       "card's tops_int8 / tflops_fp32")
    add_card_argument(p, "each simulated in turn (a table each; rows told apart by "
                         "settings.device in the JSON)")
    add_engine_profile_argument(p)
    p.add_argument("--tp", type=argtypes.positive_int, default=1,
                   help="tensor-parallel cards per replica (default 1)")
    p.add_argument("--replicas", type=argtypes.positive_int, default=1,
                   help="independent replicas, requests dealt round robin (default 1)")
    p.add_argument("--timing", type=argtypes.nonempty, default=None, metavar="SOURCE",
                   help="emu:PRESET, probe:FILE (odma-hw probe --json output), "
                        "live:torch:DEVICE or ideal (every run at full bandwidth); default: "
                        "the card's timing")


# the options _add_emulator_arguments adds: they change a run only where the timing is emu:
EMULATOR_OPTIONS = ("channels", "interleave", "address_map", "queue", "streams", "chunk_bytes")


def _add_emulator_arguments(p) -> None:
    """The emulated memory's settings, where the timing source is the emulator."""
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


def _add_serving_arguments(p) -> None:
    """How the engine serves: the paged layout, the lengths, the scheduler and the KV pool."""
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
    add_scheduling_arguments(p)
    p.add_argument("--mfu", type=argtypes.between(FRACTION.low, FRACTION.high), default=None,
                   help=f"prefill compute efficiency, in [{FRACTION.low:g}, {FRACTION.high:g}] "
                        f"(default: the card's mfu, else {DEFAULT_MFU})")
    add_memory_utilization_argument(p)
    p.add_argument("--kv-pool-gb", type=POOL_GB_TYPE, default=None, metavar="GB",
                   help="KV pool per card in GB of 1e9 B (default: what the weights leave of "
                        "--memory-utilization of the card, the engine's rule too)")


def _add_prefix_cache_arguments(p) -> None:
    """The prefix cache in front of prefill (--prefix-cache) and its tiers."""
    c = p.add_argument_group("prefix cache (traces with prefix_id / prefix_tokens columns)")
    c.add_argument("--prefix-cache", action="store_true",
                   help="keep prefixes' KV across requests in device, host and disk tiers")
    c.add_argument("--cache-device-gb", type=argtypes.nonnegative_float, default=None,
                   help="device tier, carved out of the KV pool (default 1 GB)")
    c.add_argument("--cache-host-gb", type=argtypes.nonnegative_float, default=None,
                   help="host-memory tier (default 16 GB)")
    c.add_argument("--cache-disk-gb", type=argtypes.nonnegative_float, default=None,
                   help="disk tier (default 64 GB)")
    c.add_argument("--eviction", default=None, choices=list(EVICTIONS),
                   help="which prefix leaves a full tier (default lru)")
    c.add_argument("--prefix-schedule", default=None, choices=list(SCHEDULES),
                   help="admission order: FCFS (default), fastest-prefix-first (may starve), "
                        "relaxed FPF")
    c.add_argument("--prefetch", type=argtypes.count, default=None, metavar="N",
                   help="prefetch the prefixes of the next N queued requests (default 0: off)")
    c.add_argument("--pcie-gbps", type=BANDWIDTH_GBPS_TYPE, default=25.0,
                   help="host <-> device bandwidth, of the prefix cache's host tier and of "
                        "swapped KV (default 25: PCIe 4.0 x16 effective)")
    c.add_argument("--disk-read-gbps", type=BANDWIDTH_GBPS_TYPE, default=None,
                   help="disk tier read bandwidth (default 3: an NVMe SSD)")
    c.add_argument("--disk-write-gbps", type=BANDWIDTH_GBPS_TYPE, default=None,
                   help="disk tier write bandwidth (default 2)")
