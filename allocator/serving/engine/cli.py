"""`odma-hw engine`: the command line of the real engine (allocator/serving/engine/serve.py).
Everything it can refuse, it refuses before any weights are built (what needs the weights'
values, as they load); torch and transformers are imported only when an engine runs, so the rest
of the tool works without them."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np

from odma_cli.errors import (BadArgument, DeviceError, DeviceUnavailable, OdmaError, RunFailed,
                             error_line)

from allocator.predictors import PREDICTORS
from allocator.serving.cards.measure import BUSY_OTHER_SHARE, OtherLoad
from allocator.serving.core.metrics import ENGINE_METRICS
from allocator.serving.models import (DTYPES, check_attention_window, check_memory, check_weights,
                                      config_path, kv_bytes_per_token, load_config, shipped_configs)
from allocator.serving.options import (POOL_GB_TYPE, SERVING_OPTION_UNITS, cap_lengths, clip_note,
                                       goodput_slo, load_text, scheduler_text, summary_table)

SCHEMA = "odma-hw.engine/1"
ROW_KEYS = ("policy",)                  # what tells apart the rows of one run
DEFAULT_METRIC = "output_tps"           # what a sweep of engine prints and plots
OPTION_UNITS = SERVING_OPTION_UNITS
METRICS = ENGINE_METRICS                # the columns a sweep's --metric takes


def prepare(args):
    """Every check before the weights are built: (config, weights, trace lengths, arrivals,
    KV pool bytes, max model length, ...): the config and the weights' headers, the options
    against the policies that use them, the trace against the model, every policy's pool, and
    what the model and the pool take against the device's free memory."""
    # before the imports below: the run-table attention and serve.py import torch
    if importlib.util.find_spec("torch") is None:
        raise DeviceUnavailable("the engine needs torch; pip install 'odma-hw[torch]'")
    from allocator.config import AllocatorConfig
    from allocator.policies import policy as policy_spec
    from allocator.serving.cards.presets import (DTYPE_SPELLINGS, accelerator, auto_dtype,
                                                 model_from_config)
    from allocator.serving.core.checks import check_scheduling
    from allocator.serving.engine.hf_reference import check_memory_probe
    from allocator.serving.engine.run_attention import attention_backend
    from allocator.serving.engine.runner import check_fused
    from allocator.serving.engine.serve import use_graphs
    from allocator.serving.options import check_options_used, parse_policies
    from allocator.serving.sim.replica import check_pool

    policies = parse_policies(args.policy, extra=("hf",))
    ours = [f for f, on in (("--preemption swap", args.preemption == "swap"),
                            ("--cobatch", args.cobatch)) if on]
    if "hf" in policies and ours:
        raise BadArgument(f"--policy hf runs transformers' own scheduler: {ours[0]} is odma-hw's "
                          f"(run hf apart)")
    check_options_used(policies, args.demand_bound, args.cobatch, args.extent_knee_tokens)
    card = accelerator(args.card, "--card") if args.card else None   # refused now, used or not
    config, folder = load_config(args.model)
    weights = check_weights(folder) if folder else []
    trace, prompt, gen, arrivals, cap, dropped, truncated = requests_of(args, config)
    slo = goodput_slo(args.goodput)
    check_scheduling(args.max_batch, args.max_num_batched_tokens, args.concurrency)
    device, free = torch_device(args.device)
    if args.dtype == "auto":
        args.dtype = DTYPE_SPELLINGS[auto_dtype("auto", card and card.dtype, device == "cpu")]
        if args.dtype not in DTYPES:
            raise BadArgument(f"--dtype auto: card {args.card} is of {args.dtype}, which the "
                              f"engine does not run (one of {', '.join(DTYPES)})")
    backend = attention_backend(device, None if args.attention == "auto" else args.attention)
    use_graphs(args.cuda_graphs, device, backend)
    check_fused(args.fused_layers, backend)
    if "hf" in policies:
        import torch

        check_memory_probe(torch)
    bpt = kv_bytes_per_token(config, args.dtype)
    spec = model_from_config(config_path(args.model)[0])
    held = {"weights": spec.params * DTYPES[args.dtype],
            "weight files read": sum(f.stat().st_size for f in weights)}
    pool, pool_option = kv_pool(args, *pool_room(card, free, f"torch:{device}"),
                                sum(held.values()))
    pooled = [policy for policy in policies if policy != "hf"]    # hf sizes its own cache
    check_memory({"weights": held["weights"], "KV pool": pool if pooled else 0,
                  "weight files read": held["weight files read"]}, free, f"torch:{device}")
    if pooled and pool < cap * bpt:
        raise BadArgument(f"{pool_option} holds {pool // bpt} tokens of KV, "
                          f"less than one {cap}-token request ({bpt} B per token)")
    knee = args.extent_knee_tokens
    if knee is None and card is not None and any(policy_spec(p).knee for p in pooled):
        # a (layer, K/V, head) run holds head_dim elements per token
        unit = bpt // (2 * config.num_hidden_layers * config.num_key_value_heads)
        knee = card_knee(card, unit, cap)
    alloc_config = AllocatorConfig(background_refresh=False, extent_knee_tokens=knee,
                                   demand_bound=args.demand_bound)
    for policy in pooled:       # its pages, buckets or regions hold one request, or refused now
        try:
            check_pool(policy, pool, bpt, cap, alloc_config, args.page_tokens)
        except BadArgument as exc:
            raise BadArgument(f"{pool_option} for {policy}: {exc}") from None
    return dict(policies=policies, config=config, weights=folder if weights else None,
                prompt=prompt, gen=gen, arrivals=arrivals, pool=pool, max_model_len=cap,
                device=device, dropped=dropped, truncated=truncated, trace=trace.name, bpt=bpt,
                knee=knee, attention=backend, alloc_config=alloc_config, slo=slo,
                load=load_text(args.rate, args.concurrency, trace.arrival is not None))


def requests_of(args, config):
    """(trace, prompt lengths, output lengths, arrival seconds, max model length, dropped,
    truncated) of the requests the engine serves: the trace cut to --requests and the caps,
    fitted to the max model length and the model's context."""
    import types

    from allocator.serving.core.requests import fit_lengths
    from allocator.trace import arrival_seconds, load_trace

    trace = load_trace(args.trace)
    if args.requests is not None:
        trace = trace.head(args.requests)
    trace = cap_lengths(trace, args.prompt_cap, args.output_cap)
    limit = types.SimpleNamespace(name=args.model, max_context=config.max_position_embeddings)
    prompt, gen, keep, cap, dropped, truncated = fit_lengths(trace, args.max_model_len, limit,
                                                             args.clip)
    check_attention_window(config, cap, args.model)
    # a closed loop without a rate sends as fast as places free, as vllm bench serve does
    arrivals = (np.zeros(len(keep)) if args.concurrency and args.rate is None
                else arrival_seconds(trace, args.rate, 1.0, args.seed)[keep])
    return trace, prompt, gen, arrivals, cap, dropped, truncated


def torch_device(spec: str) -> tuple[str, int]:
    """(torch device name, free bytes) of a torch:DEV spec; BadArgument for another backend."""
    from allocator.pool import resolve_device

    dev, owned = resolve_device(spec)
    try:
        if not hasattr(dev, "dev"):
            raise BadArgument(f"the engine runs on a torch device (torch:cpu, torch:cuda:0, ...), "
                              f"not {spec}")
        return str(dev.dev), dev.info.free_bytes
    finally:
        if owned:
            dev.close()


def pool_room(card, free: int | None, device: str) -> tuple[int | None, str]:
    """(bytes, what they are) of the memory the default pool takes its share of, as simulate
    does of its card: --card's capacity, at most what the device it runs on has free; without
    a card, the device's free memory (None: unknown)."""
    if card is not None and (free is None or card.capacity_gb * 1e9 <= free):
        return int(card.capacity_gb * 1e9), f"card {card.name}"
    return free, f"{device}'s free memory"


def kv_pool(args, room: int | None = None, what: str = "the device", held: int = 0
            ) -> tuple[int, str]:
    """(bytes, how it was set) of the KV pool: --kv-pool-gb, or its alias --kv-pool-mb (both
    given is refused), else simulate's rule: what `held` (the weights) leaves of
    --memory-utilization of `room` bytes (pool_room())."""
    gb, mb = getattr(args, "kv_pool_gb", None), getattr(args, "kv_pool_mb", None)
    if gb is not None and mb is not None:
        raise BadArgument("--kv-pool-mb is an alias of --kv-pool-gb (in MB): give one of them")
    if mb is not None:
        return int(round(mb * 1e6)), f"--kv-pool-mb {mb:g}"
    if gb is not None:
        return int(round(gb * 1e9)), f"--kv-pool-gb {gb:g}"
    share = args.memory_utilization
    if not 0 < share <= 1:
        raise BadArgument(f"--memory-utilization must be in (0, 1], got {share:g}")
    if room is None:
        raise BadArgument(f"the free memory of {what} is unknown: give --kv-pool-gb")
    pool = max(0, int(share * room - held))
    return pool, (f"the default pool ({share:g} of {what}, {room / 1e9:.3g} GB, less the "
                  f"weights: {pool / 1e9:.3g} GB)")


def card_knee(card, run_unit_bytes: int, max_tokens: int) -> int:
    """The extent knee the timing source of `card` (an Accelerator, a preset's name or a card
    file) gives a (layer, K/V, head) run of run_unit_bytes per token, as simulate derives it."""
    from allocator.config import AllocatorConfig
    from allocator.serving.cards.presets import Accelerator, accelerator
    from allocator.serving.options import card_emu
    from allocator.serving.sim.steptime import knee_tokens
    from allocator.serving.sim.timing import make_timing

    dev = card if isinstance(card, Accelerator) else accelerator(card, "--card")
    timing = make_timing(dev.timing, dev.bandwidth_gbps, card_emu(dev))
    return knee_tokens(timing, run_unit_bytes, AllocatorConfig.extent_knee_fraction, max_tokens)


def compute(args, results: list | None = None, failed: list | None = None) -> dict:
    """The JSON object of `odma-hw engine` (results appended to `results` as they finish, so
    that a caller keeps them when a later policy is interrupted). `failed`: where given, a
    policy whose run fails after the checks is recorded there as {"policy", "error"} and the
    others go on (as simulate's runs); else it raises."""
    p = prepare(args)
    from allocator.serving.core.metrics import summarise_engine as summarise
    from allocator.serving.engine.hf_reference import run_hf
    from allocator.serving.engine.serve import build_model, check_tokens, prompt_ids, serve

    model = build_model(p["config"], args.dtype, p["device"], args.seed, p["weights"])
    prompts = prompt_ids(len(p["prompt"]), p["prompt"], p["config"].vocab_size, args.seed)
    settings = run_settings(args, p)
    out = [] if results is None else results
    pooled = [policy for policy in p["policies"] if policy != "hf"]
    if pooled:
        # untimed, as a server that has run a while: the first max-batch requests, 1-4
        # tokens each, through the first policy as it will run (its graphs captured, its
        # prompts chunked as they will be), so that
        # torch's start-up and the kernels each step's shapes load or compile (cuBLAS, Triton)
        # do not land on the first policy measured; each request within the max model length
        # of a pool prepare() checked
        warm = warmup_prompts(prompts, args.max_batch)
        try:
            serve(model, warm, [max(1, min(1 + j % 4, p["max_model_len"] - q.numel()))
                                for j, q in enumerate(warm)],
                  [0.0] * len(warm), pooled[0], pool_bytes=p["pool"],
                  max_model_len=p["max_model_len"], max_batch=args.max_batch,
                  page_tokens=args.page_tokens, config=p["alloc_config"],
                  attention=p["attention"], cuda_graphs=args.cuda_graphs,
                  fused_layers=args.fused_layers, prompt_attention=args.prompt_attention,
                  max_batched_tokens=args.max_num_batched_tokens)
        except OdmaError:
            raise
        except Exception as exc:      # a library's (on an H200: Triton's compiler): one line
            raise DeviceError(f"the warm-up through {pooled[0]} failed, before any policy ran "
                              f"({error_line(exc)})") from exc
    for policy in p["policies"]:
        show = progress(policy) if not args.json or os.isatty(2) else None
        load = OtherLoad()
        try:
            if policy == "hf":
                run = run_hf(model, prompts, p["gen"], p["arrivals"], max_batch=args.max_batch,
                             max_batched_tokens=args.max_num_batched_tokens,
                             concurrency=args.concurrency, progress=show,
                             cuda_graphs={"auto": None, "on": True,
                                          "off": False}[args.cuda_graphs])
            else:
                run = serve(model, prompts, p["gen"], p["arrivals"], policy,
                            pool_bytes=p["pool"], max_model_len=p["max_model_len"],
                            max_batch=args.max_batch, page_tokens=args.page_tokens,
                            predictor=args.predictor,
                            max_batched_tokens=args.max_num_batched_tokens,
                            concurrency=args.concurrency, preemption=args.preemption,
                            swap_bytes=int(args.swap_space * 1e9), cobatch=args.cobatch,
                            seed=args.seed, progress=show, attention=p["attention"],
                            cuda_graphs=args.cuda_graphs, fused_layers=args.fused_layers,
                            prompt_attention=args.prompt_attention,
                            keep_logits=args.check, config=p["alloc_config"])
        except Exception as exc:      # a library's too (Triton's compiler, a CUDA fault)
            if failed is None:
                raise
            failed.append({"policy": policy, "error": error_line(exc)})
            continue
        r = summarise(policy, run, settings, p["slo"])
        r["attention"] = run.get("attention")       # hf: None (transformers' own)
        r["cuda_graphs"] = run.get("cuda_graphs")   # hf: (varlen, decode) as it settled them
        r["fused_layers"] = run.get("fused_layers")  # hf: None (transformers' modules)
        r["prompt_attention"] = run.get("prompt_attention")     # hf: None (its own)
        warn_disturbed(r, run, policy, load)
        # the KV the run kept its cache in: hf sizes its own, whatever --kv-pool-mb says
        r["kv_cache_mb"] = (run["allocator"]["cache_bytes"] / 1e6 if policy == "hf"
                            else p["pool"] / 1e6)
        if args.check:
            r.update(check_tokens(model, prompts, run["tokens"], run["top_logits"]))
        out.append(r)
    return {"schema": SCHEMA, "results": out, "failed": [] if failed is None else failed}


def run_settings(args, p: dict) -> dict:
    """The settings every result row of the run repeats (`p`: what prepare() checked)."""
    return {"model": args.model, "dtype": args.dtype, "device": f"torch:{p['device']}",
            "trace": p["trace"], "max_model_len": p["max_model_len"],
            "max_batch": args.max_batch, "kv_pool_mb": p["pool"] / 1e6,
            "kv_pool_gb": p["pool"] / 1e9, "load": p["load"],
            "kv_bytes_per_token": p["bpt"], "page_tokens": args.page_tokens,
            "predictor": args.predictor, "seed": args.seed, "rate": args.rate,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "concurrency": args.concurrency, "extent_knee_tokens": p["knee"],
            "preemption": (f"swap ({args.swap_space:g} GB host)"
                           if args.preemption == "swap" else "recompute"),
            "cobatch": args.cobatch, "demand_bound": args.demand_bound,
            "dropped_over_length": p["dropped"], "truncated_over_length": p["truncated"],
            "weights": "loaded" if p["weights"] else "random (seeded)"}


def warn_disturbed(r: dict, run: dict, policy: str, load) -> None:
    """Note in the row, and in a warning line, what else was in a policy's times: kernels
    compiled while its clock ran, and other processes' share of the CPUs (on a few cores a
    little of it slows every step the host drives, and the row would not say so)."""
    r["kernel_compiles"] = run.get("kernel_compiles", 0)
    r["other_cpu_share"] = load.share()
    if r["other_cpu_share"] is not None and r["other_cpu_share"] > BUSY_OTHER_SHARE:
        print(f"odma-hw engine: warning: other processes took {r['other_cpu_share']:.0%} of "
              f"the CPUs during {policy}'s run: its times are a busy host's", file=sys.stderr)
    if r["kernel_compiles"]:
        print(f"odma-hw engine: warning: {r['kernel_compiles']} Triton kernel(s) compiled "
              f"during {policy}'s timed run: its times include the compilation",
              file=sys.stderr)


def warmup_prompts(prompts: list, max_batch: int, longest: bool = False) -> list:
    """The prompts of the untimed warm-up: the first max_batch, or the max_batch longest (in
    the trace's order)."""
    if not longest:
        return prompts[:max_batch]
    keep = sorted(sorted(range(len(prompts)), key=lambda j: -prompts[j].numel())[:max_batch])
    return [prompts[j] for j in keep]


def progress(policy: str, stream=None):
    """A progress callback: one line per second on stderr."""
    stream = stream or sys.stderr

    def show(done, total, seconds):
        stream.write(f"engine {policy}: {done}/{total} requests, {seconds:.0f} s\n")
        stream.flush()
    return show


def format_table(results: list[dict]) -> str:
    def ms(x):
        return "-" if x is None else (f"{x * 1e3:.0f}ms" if x < 1 else f"{x:.2f}s")
    head = ["load", "policy", "tok/s", "req/s", "TTFT p50", "TPOT p50", "E2E p50", "util", "batch",
            "preempt", "migr", "mismatches"]
    rows = [head]
    for r in results:
        rows.append([r["settings"].get("load", "-"), r["policy"], f"{r['output_tps']:.1f}", f"{r['requests_per_s']:.2f}",
                     ms(r["ttft_s"]["p50"]), ms(r["tpot_s"]["p50"]), ms(r["e2e_s"]["p50"]),
                     "-" if r["utilization"] is None else f"{r['utilization']:.3f}",
                     "-" if r["mean_batch"] is None else f"{r['mean_batch']:.1f}",
                     str(r["preemptions"]), str(r["migrations"]),
                     "-" if r["mismatches"] is None else
                     f"{r['mismatches']} ({r['near_ties']} near ties"
                     + (f", {r['non_finite']} non-finite" if r.get("non_finite") else "")
                     + ")"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(0, head_line(results))
    s = results[0]["settings"]
    lines.append(f"{s['trace']}: {results[0]['requests']} requests; {s['model']} {s['dtype']} "
                 f"({s['weights']} weights) on {s['device']}; KV pool {s['kv_pool_mb']:g} MB; "
                 f"max model len {s['max_model_len']}")
    note = clip_note(s["dropped_over_length"], s["truncated_over_length"],
                     results[0]["requests"], s["max_model_len"])
    if note:
        lines.append(note)
    for r in results:
        if r["policy"] == "hf":
            lines.append(f"hf: transformers' own KV cache of {r['kv_cache_mb']:.3g} MB, sized "
                         f"for the {s['max_batch']} longest requests (not the KV pool)")
        elif r.get("decode_step_us"):
            d = r["decode_step_us"]
            lines.append(f"{r['policy']}: a decode step (median of {d['steps']}) issued in "
                         f"{d['issue']:.0f} us, its tokens back {d['wait']:.0f} us later, the "
                         f"next step {d['other']:.0f} us after that")
    lines += [""] + summary_table(results, [r["policy"] for r in results])
    return "\n".join(lines)


def head_line(results: list) -> str:
    """The first line of the engine's table: device, model, KV layout of each policy,
    scheduler."""
    from allocator.policies import policy as policy_spec

    s = results[0]["settings"]
    layouts = []
    for r in results:
        p = r["policy"]
        if p == "hf":
            layouts.append("hf transformers' own cache")
        else:
            layout = policy_spec(p).layout
            layouts.append((p if p == layout else f"{p} {layout}")
                           + (f" ({s['page_tokens']}-token pages)" if layout == "paged" else ""))
    return (f"{s['device']}, {s['model']} {s['dtype']} ({s['weights']} weights); KV layout: "
            f"{', '.join(dict.fromkeys(layouts))}; scheduler: "
            f"{scheduler_text(s['max_num_batched_tokens'], s['max_batch'])}")


def _show(args, results: list, failed: list) -> None:
    from odma_cli import jsonout

    if args.json:
        print(jsonout.dumps({"schema": SCHEMA, "results": results, "failed": failed}, indent=1))
    elif results:
        print(format_table(results))


def _cmd(args) -> int:
    results: list = []
    failed: list = []
    try:
        compute(args, results, failed)
    except KeyboardInterrupt:
        if results:                  # the runs that finished are kept, as simulate keeps them
            _show(args, results, failed)
        raise
    _show(args, results, failed)
    problems = [f"{f['policy']}: {f['error']}" for f in failed]
    problems += [f"{r['policy']}: --check found {r['mismatches']} of {r['completed']} requests "
                 f"mismatching" + (f" ({r['non_finite']} with non-finite logits)"
                                   if r.get("non_finite") else "")
                 for r in results if r.get("mismatches")]
    if problems:
        raise RunFailed(f"{len(problems)} of {len(results) + len(failed)} policies failed or "
                        f"mismatched (all results are printed): {'; '.join(problems)}")
    return 0


def register(subparsers) -> None:
    from odma_cli import argtypes

    from allocator.serving.options import (add_dtype_argument, add_goodput_argument,
                                           add_length_caps, add_memory_utilization_argument,
                                           add_preset_argument, add_scheduling_arguments)

    p = subparsers.add_parser(
        "engine", help="serve a trace with a real transformer whose KV lives in allocator blocks",
        description="A Hugging Face decoder (Llama, Qwen2, Mistral) serves a request trace on a "
                    "torch device with continuous batching; every KV byte lives in blocks of the "
                    "policy's allocator and every scheduling decision is the one `simulate` "
                    "makes. --check compares every token and its logits with transformers' own "
                    "forward of the model.")
    p.add_argument("--trace", required=True, metavar="CSV",
                   help="request trace: num_prefill_tokens, num_decode_tokens [, arrived_at]")
    p.add_argument("--requests", type=argtypes.positive_int, default=None, metavar="N",
                   help="serve only the first N requests")
    p.add_argument("--rate", type=argtypes.positive_float, default=None, metavar="R",
                   help="Poisson arrivals at R requests/s (default: the trace's arrived_at, "
                        "else all at once)")
    p.add_argument("--model", default="tiny-qwen2", metavar="CONFIG",
                   help=f"a config.json, a directory with config.json (and safetensors weights), "
                        f"or one of {', '.join(shipped_configs())} (default tiny-qwen2)")
    add_dtype_argument(p, DTYPES, "weight and KV type")
    p.add_argument("--device", default="torch:cpu", metavar="torch:DEV",
                   help="the torch device (default torch:cpu)")
    p.add_argument("--policy", default="odma,static,paged", metavar="P[,P...]",
                   help="allocation policies (odma, static, s3, oracle, paged, extent, elastic, "
                        "and hf: transformers' own continuous batching; default "
                        "odma,static,paged)")
    p.add_argument("--card", default=None, metavar="CARD",
                   help="a card (preset name or file, e.g. from `odma-hw calibrate`) whose "
                        "timing source gives extent and elastic their knee, as simulate "
                        "derives it: the shortest (layer, K/V, head) run reading at 0.8 of "
                        "streaming (default: the token alignment, 16 tokens)")
    p.add_argument("--extent-knee-tokens", type=argtypes.positive_int, default=None,
                   metavar="N", help="extent and elastic's knee in tokens (overrides --card)")
    p.add_argument("--predictor", default="online", choices=list(PREDICTORS),
                   help="ODMA's length predictor (default online)")
    add_scheduling_arguments(p)
    add_memory_utilization_argument(p)
    p.add_argument("--kv-pool-gb", type=POOL_GB_TYPE, default=None, metavar="GB",
                   help="KV pool in GB of 1e9 B (default, simulate's rule: what the weights "
                        "leave of --memory-utilization of --card's capacity, at most of the "
                        "device's free memory; without --card, of the device's free memory; "
                        "small forces preemption)")
    p.add_argument("--kv-pool-mb", type=argtypes.positive_float, default=None, metavar="MB",
                   help="alias of --kv-pool-gb in MB (1e6 B), kept for older command lines")
    p.add_argument("--page-tokens", type=argtypes.positive_int, default=16,
                   help="tokens per page of the paged policy (default 16)")
    p.add_argument("--max-model-len", type=argtypes.positive_int, default=None,
                   help="longest request (default: the trace's longest)")
    p.add_argument("--clip", action="store_true",
                   help="drop prompts longer than --max-model-len and cut generations there")
    add_length_caps(p)
    p.add_argument("--seed", type=argtypes.seed, default=0,
                   help="seeds the weights, the prompts and the arrivals (default 0)")
    p.add_argument("--check", action="store_true",
                   help="compare every token and its logits with transformers' forward")
    _add_forward_arguments(p)
    add_goodput_argument(p)
    add_preset_argument(p)
    p.add_argument("--json", action="store_true", help=f"print one JSON object ({SCHEMA})")
    p.set_defaults(func=_cmd)


def _add_forward_arguments(p) -> None:
    """The options of how the forward pass runs: kernels, graphs, fused layers, prompts."""
    p.add_argument("--attention", default="auto", choices=("auto", "triton", "torch"),
                   help="the run-table attention kernels: triton (GPU kernels, needs the "
                        "'kernels' extra), torch (batched torch ops, the CPU's) or auto "
                        "(triton on a CUDA device where it imports; default auto)")
    p.add_argument("--cuda-graphs", default="auto", choices=("auto", "on", "off"),
                   help="replay decode steps from CUDA graphs captured per padded batch size "
                        "(auto: on a CUDA device with the triton kernels; off to compare); for "
                        "--policy hf, transformers' own CUDA graphs (auto: its choice)")
    p.add_argument("--fused-layers", default="auto", choices=("auto", "on", "off"),
                   help="run each decoder layer in about ten kernel launches (q/k/v and "
                        "gate/up joined, the residual add in the norm, rotary with the KV store, "
                        "silu with the product) instead of transformers' modules' 35; auto: "
                        "with the triton kernels, where the model's layers allow (Llama, Qwen2, "
                        "Mistral); off to compare")
    p.add_argument("--prompt-attention", default="dense", choices=("dense", "runs"),
                   help="how whole prompts attend: dense (a causal attention per prompt over "
                        "its own K and V, flash on a GPU; default) or runs (with the prompt "
                        "chunks, through the run-table prefill kernel: one launch a layer for "
                        "every prompt of a step, K and V read back from the pool)")
