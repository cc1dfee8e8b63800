"""`odma-hw replay`: iteration-level replay of a request-length trace through an allocator.

Model (the one the paper's utilization figures assume): time advances in decode steps; at every
step each running request generates one token, so a request admitted at the end of step s with
prompt p holds p + k tokens at step s + k and completes at the end of step s + g (g = its
generated length in the trace). Requests arrive at arrived_at (seconds, times --time-scale) or as
a Poisson process at --rate (or all at step 0 when the trace has no arrival times); they wait in
one FCFS queue and are admitted, in order, while the policy can reserve their block. A request
that outgrows its block calls grow(), which migrates it; when that raises OutOfMemory the running
request admitted last is preempted (block freed, rerun from scratch at the head of the queue) and
counted, and the grow is tried again, until it succeeds or the request itself was the last
admitted (as vLLM preempts its lowest-priority request): the request admitted first always makes
progress, so a pool too busy for every request's growth cannot cycle forever. No request is ever
dropped: the replay ends when every request has completed.

The replay is event driven: between two events (an arrival, a completion, a block outgrown)
nothing changes but token counts, which it integrates in closed form, so a 30k-request trace
takes seconds, not the ~10M Python steps a literal per-token loop would.

Metrics
- utilization: sum over requests of (prompt + generated) / sum of the capacity of the block the
  request completed in (tokens): the paper's "total actual KV usage / total reserved".
- time_avg_occupancy: reserved bytes / pool bytes, averaged over steps; time_avg_kv_fill: tokens
  in use / pool tokens; time_avg_utilization: tokens in use / tokens reserved, averaged over steps.
- mean/peak_concurrency: running requests per step; tokens_per_step: generated tokens / steps.
- external_fragmentation_mean/max: sampled from the allocator; bucket_bounds_history: every
  published bound tuple with the completion count it was published at.

Memory: --device SPEC (default `host` when the native host backend is present, else `torch:cpu`)
holds a real pool; migrations copy the bytes the request had written (its high-water mark) with
Device.copy. `--device none` is an explicit accounting-only mode: offsets and sizes only, no
memory, no copies (same allocation decisions, so the same metrics; migration_seconds is 0).
"""

from __future__ import annotations

import math
import sys
import time

import numpy as np

from odma_cli import argtypes, jsonout, plotting
from odma_cli.commands import ALL, ValueCheck
from odma_cli.errors import BadArgument
from odma_hw import devices

from allocator.buckets import RULES
from allocator.config import BASES, COLD_STARTS, AllocatorConfig
from allocator.policies import POLICIES, make_allocator, policy as policy_spec
from allocator.predictors import PREDICTORS, make_predictor
from allocator.replay_events import replay_requests
from allocator.trace import RequestTrace, arrival_seconds, load_trace, trace_check

Trace = RequestTrace  # the name replay's callers know

# KV bytes per token: 2 (K and V) x layers x KV heads x head dim x 2 B (bf16)
MODELS = {
    "qwen2.5-7b": 2 * 28 * 4 * 128 * 2,                   # 57,344; = DeepSeek-R1-Distill-Qwen-7B
    "deepseek-r1-distill-qwen-7b": 2 * 28 * 4 * 128 * 2,
    "llama-3-8b": 2 * 32 * 8 * 128 * 2,                   # 131,072
    "llama-2-7b": 2 * 32 * 32 * 128 * 2,                  # 524,288 (no GQA)
}
GIB = 1 << 30
MAX_POOL_GIB = 1 << 20  # a PiB: beyond any device; a larger figure is a typo


DEFAULT_POOL_GIB = 6.0


def pool_bytes(kv_pool_gb: float | None = None, pool_gib: float | None = None) -> int:
    """The KV pool in bytes: --kv-pool-gb (1e9 B, as simulate and engine take it) or its older
    spelling --pool-gib (2^30 B), one of them (default 6 GiB); refusing what no device holds."""
    if kv_pool_gb is not None and pool_gib is not None:
        raise BadArgument("--pool-gib is the older spelling of --kv-pool-gb (in GiB): give one "
                          "of them")
    if kv_pool_gb is not None:
        if not 0 < kv_pool_gb * 1e9 <= MAX_POOL_GIB * GIB:
            # the bound rounded down: every value the message allows is taken
            bound = math.floor(MAX_POOL_GIB * GIB / 1e6) / 1e3
            raise BadArgument(f"--kv-pool-gb must be in (0, {bound:.3f}], got {kv_pool_gb}")
        return int(round(kv_pool_gb * 1e9))
    gib = DEFAULT_POOL_GIB if pool_gib is None else pool_gib
    if not (0 < gib <= MAX_POOL_GIB):
        raise BadArgument(f"--pool-gib must be in (0, {MAX_POOL_GIB}], got {gib}")
    return int(gib * GIB)


def run_replay(trace, policy: str = "odma", predictor: str = "online", *,
               model: str = "qwen2.5-7b", bytes_per_token: int | None = None,
               pool_bytes: int = 6 * GIB, max_tokens: int | None = None, n_buckets: int = 8,
               bucket_rule: str = "min-waste", bucket_basis: str = "generated", device="none",
               rate: float | None = None,
               time_scale: float = 1.0, step_seconds: float = 0.05, alpha: float = 1.0,
               tau: float = 4.0, large_share: float = 0.1, noise_sigma: float = 0.3,
               cold_start: str = "prediction", seed: int = 0, progress: bool = False,
               samples: int = 400, check_only: bool = False) -> dict:
    """Replay `trace` (a Trace or a CSV path) and return the metrics dict (see module doc).
    device: a spec string, a Device, or "none"/None for accounting-only. check_only: make every
    check, open the device and close it again, and return {}."""
    t_wall = time.perf_counter()
    if not isinstance(trace, RequestTrace):
        trace = load_trace(trace)
    if policy not in POLICIES:
        raise BadArgument(f"unknown policy {policy!r}: expected one of {', '.join(POLICIES)}")
    if predictor not in PREDICTORS:
        raise BadArgument(f"unknown predictor {predictor!r}: expected one of "
                          f"{', '.join(PREDICTORS)}")
    if bytes_per_token is None:
        if model not in MODELS:
            raise BadArgument(f"unknown model {model!r}: expected one of {', '.join(MODELS)}")
        bytes_per_token = MODELS[model]
    if not (step_seconds > 0 and math.isfinite(step_seconds)):
        raise BadArgument(f"step_seconds must be a finite number > 0, got {step_seconds}")
    arrive = np.floor(arrival_seconds(trace, rate, time_scale, seed) / step_seconds)
    if len(arrive) and not arrive.max() < 2**53:       # beyond int64 and a float's integers
        raise BadArgument(f"--step-seconds {step_seconds:g} makes the trace's arrivals "
                          f"{arrive.max():.3g} steps long: more steps than a count holds")
    arrive = arrive.astype(np.int64)
    prompt = trace.prompt.tolist()
    gen = [max(1, g) for g in trace.generated.tolist()]   # every request makes >= 1 token
    longest = max(p + g for p, g in zip(prompt, gen))
    max_tokens = longest if max_tokens is None else int(max_tokens)
    if max_tokens < longest:
        raise BadArgument(f"--max-tokens {max_tokens} is below the longest request of the trace "
                          f"({longest} tokens): such requests could never complete")
    # the oracle policy reserves the realized length by definition
    predictor = policy_spec(policy).predictor(predictor)
    config = AllocatorConfig(alpha=alpha, tau=tau, n_buckets=n_buckets, bucket_rule=bucket_rule,
                             bucket_basis=bucket_basis, background_refresh=False,
                             large_share=large_share, cold_start=cold_start)
    dev = None if device in (None, "none") else device
    if check_only:                      # the device too, which a spec alone does not prove
        if isinstance(dev, str):
            with devices.open(dev):
                pass
        return {}
    alloc = make_allocator(policy, dev, pool_bytes, bytes_per_token, max_tokens, config)
    try:
        return replay_requests(trace, alloc, make_predictor(predictor, seed=seed, sigma=noise_sigma),
                       prompt, gen, arrive,
                       policy, predictor, samples, progress, t_wall,
                       dict(model=model, bytes_per_token=bytes_per_token, max_tokens=max_tokens,
                            pool_bytes=alloc.pool_bytes, n_buckets=n_buckets,
                            bucket_rule=bucket_rule, bucket_basis=bucket_basis,
                            alpha=alpha, tau=tau,
                            large_share=large_share, cold_start=cold_start,
                            step_seconds=step_seconds,
                            time_scale=time_scale, rate=rate, seed=seed,
                            noise_sigma=noise_sigma if predictor == "noisy" else None,
                            device=None if alloc.device is None else alloc.device.spec))
    finally:
        alloc.close()


def default_device() -> str:
    """`host` when its backend finds a device here, else `torch:cpu`, else accounting-only."""
    found = {s.backend: s.specs for s in devices.discover()}
    if found.get("host"):
        return "host"
    if "torch:cpu" in found.get("torch", []):
        return "torch:cpu"
    return "none"


def plot(result: dict, path: str) -> None:
    plt = plotting.pyplot()
    s = result["series"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    steps = [x["step"] for x in s]
    ax1.plot(steps, [x["occupancy"] for x in s], label="reserved / pool")
    ax1.plot(steps, [x["fragmentation"] for x in s], label="external fragmentation")
    ax1.set_ylim(0, 1.05)
    ax1.legend(loc="lower right")
    ax1.set_title(f"{result['trace']}: {result['policy']} ({result['predictor']}), "
                  f"utilization {result['utilization']:.3f}")
    ax2.plot(steps, [x["running"] for x in s], color="tab:green")
    ax2.set_ylabel("running requests")
    ax2.set_xlabel("decode step")
    fig.tight_layout()
    plotting.save(fig, path)


def compute(args, check_only: bool = False) -> dict:
    """The JSON object of `odma-hw replay` for parsed arguments (with the time series);
    check_only as run_replay takes it."""
    device = args.device or default_device()
    return run_replay(
        args.trace, args.policy, args.predictor, model=args.model,
        bytes_per_token=args.bytes_per_token, pool_bytes=pool_bytes(args.kv_pool_gb, args.pool_gib),
        max_tokens=args.max_tokens, n_buckets=args.buckets, bucket_rule=args.bucket_rule,
        bucket_basis=args.bucket_basis,
        device=device, rate=args.rate, time_scale=args.time_scale,
        step_seconds=args.step_seconds, alpha=args.alpha, tau=args.tau,
        large_share=args.large_share, cold_start=args.cold_start, seed=args.seed,
        progress=not args.json or sys.stderr.isatty(), check_only=check_only)


def _cmd(args) -> int:
    jsonout.check_series(args)
    if args.plot:
        plotting.check_plot_path(args.plot)
    result = compute(args)
    if args.json:
        shown = dict(result)
        if not args.series:
            shown.pop("series")
        print(jsonout.dumps(shown, indent=1))
    else:
        r = result
        print(f"{r['trace']}: policy {r['policy']}, predictor {r['predictor']}, "
              f"device {r['settings']['device'] or 'none (accounting only)'}")
        print(f"  requests {r['requests']}, completed {r['completed']}, lost {r['lost']}")
        print(f"  utilization (token-level) {r['utilization']:.4f}")
        print(f"  migrations {r['migrations']} ({100 * r['migration_rate']:.2f} %), OutOfMemory "
              f"events {r['oom_events']} (preempted and rerun)")
        print(f"  concurrency mean {r['mean_concurrency']:.1f}, peak {r['peak_concurrency']}; "
              f"tokens/step {r['tokens_per_step']:.1f}; occupancy {r['time_avg_occupancy']:.3f}")
        print(f"  external fragmentation mean {r['external_fragmentation_mean']:.3f}, max "
              f"{r['external_fragmentation_max']:.3f}")
        if r["bucket_bounds"]:
            print(f"  bucket bounds {r['bucket_bounds']} ({len(r['bucket_bounds_history'])} sets)")
        if "segments_per_request_mean" in r:
            print(f"  segments per request mean {r['segments_per_request_mean']:.1f}, max "
                  f"{r['segments_per_request_max']}")
        print(f"  {r['wall_seconds']:.1f} s")
    if args.plot:
        plot(result, args.plot)
    return 0


def add_workload_arguments(p) -> None:
    """Trace, load and model options shared by `replay` and `simulate`."""
    p.add_argument("--trace", required=True, metavar="CSV",
                   help="request trace: num_prefill_tokens, num_decode_tokens [, arrived_at]")
    p.add_argument("--rate", type=argtypes.positive_float, default=None, metavar="REQ/S",
                   help="Poisson arrivals at this many requests/s instead of arrived_at")
    p.add_argument("--time-scale", type=argtypes.positive_float, default=1.0,
                   help="multiply arrived_at by this (< 1 = more load)")
    p.add_argument("--max-tokens", type=argtypes.positive_int, default=None,
                   help="max tokens per request (default: the longest request of the trace)")
    p.add_argument("--seed", type=argtypes.seed, default=0,
                   help="seeds Poisson arrivals and noisy predictions (default 0)")


def add_policy_arguments(p) -> None:
    """Allocation policy and predictor options shared by `replay` and `simulate`."""
    p.add_argument("--predictor", default="online", choices=list(PREDICTORS),
                   help="length predictor for odma/s3/oracle (default online)")
    p.add_argument("--buckets", type=argtypes.positive_int, default=8,
                   help="regular buckets (default 8)")
    p.add_argument("--bucket-rule", default="min-waste", choices=list(RULES),
                   help="min-waste (ours) or occupancy (the paper's equal-occupancy quantiles)")
    p.add_argument("--bucket-basis", default="generated", choices=list(BASES),
                   help="bounds count generated tokens (block = prompt + bound; the paper's "
                        "Eq. 2) or whole KV footprints (block = bound)")
    p.add_argument("--cold-start", default="prediction", choices=list(COLD_STARTS),
                   help="for the first 1,000 completions, size blocks by the prediction while "
                        "the buckets learn (default) or by equal-width bounds up to --max-tokens "
                        "(the paper's rule)")
    p.add_argument("--alpha", type=argtypes.nonnegative_float, default=1.0,
                   help="L' = L (1 + alpha u)")
    p.add_argument("--tau", type=argtypes.nonnegative_float, default=4.0,
                   help="u > tau: large bucket")
    p.add_argument("--large-share", type=argtypes.unit_fraction, default=0.1,
                   help="pool share reserved for the large bucket")


DEFAULT_METRIC = "utilization"          # what a sweep of replay prints and plots
OPTION_UNITS = {"bytes-per-token": "B", "max-tokens": "tokens", "rate": "req/s",
                "pool-gib": "GiB", "step-seconds": "s"}


def sweep_checks() -> list[ValueCheck]:
    """What compute() refuses before any work (see odma_cli/commands.py)."""
    return [trace_check(), ValueCheck("kv-pool-gb", ("kv_pool_gb", "pool_gib"),
                                      lambda a: pool_bytes(a.kv_pool_gb, a.pool_gib)),
            # last, once per distinct cell: the rest of what run_replay() checks before any
            # work (--max-tokens against the trace, the step count, the device), as the cell
            # itself would
            ValueCheck("replay", ALL, lambda a: compute(a, check_only=True))]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "replay", help="replay a request-length trace through a KV allocation policy",
        description=__doc__.split("\n\n")[0])
    add_workload_arguments(p)
    p.add_argument("--policy", default="odma", choices=list(POLICIES))
    add_policy_arguments(p)
    p.add_argument("--model", default="qwen2.5-7b", choices=list(MODELS),
                   help="sets the KV bytes per token (default qwen2.5-7b: 57,344 B)")
    p.add_argument("--bytes-per-token", type=argtypes.positive_int, default=None,
                   help="KV bytes per token (overrides --model)")
    p.add_argument("--kv-pool-gb", type=argtypes.positive_float, default=None, metavar="GB",
                   help="KV pool per device in GB of 1e9 B, the unit simulate and engine take "
                        f"(default {DEFAULT_POOL_GIB:g} GiB: "
                        f"{DEFAULT_POOL_GIB * GIB / 1e9:.2f} GB)")
    p.add_argument("--pool-gib", type=argtypes.positive_float, default=None, metavar="GIB",
                   help="the pool in GiB (2^30 B): the older spelling of --kv-pool-gb, kept "
                        "for older command lines")
    p.add_argument("--device", type=argtypes.nonempty, default=None,
                   help="device holding the pool (default host, else torch:cpu); 'none' = "
                        "accounting only: no memory, no copies, same metrics")
    p.add_argument("--step-seconds", type=argtypes.positive_float, default=0.05,
                   help="seconds per decode step (maps arrival times to steps)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--series", action="store_true", help="with --json: include the time series")
    p.add_argument("--plot", type=argtypes.nonempty, metavar="PNG",
                   help="plot occupancy, fragmentation, concurrency")
    p.set_defaults(func=_cmd)
