"""The metrics of a serving run, with one set of names: the JSON object `odma-hw simulate` prints
per (policy, rate), from each replica's totals (seconds by component, counts), its time series
and its requests (summarise), and the result object of one policy `odma-hw engine` served
(summarise_engine). Both take their request metrics from request_metrics."""

from __future__ import annotations

import collections
import math

import numpy as np

from odma_cli.errors import BadArgument

from allocator.policies import policy as policy_spec


# the per-request figures (request_metrics) both summaries give, in their JSON's order
REQUEST_KEYS = ("output_tps", "requests_per_s", "ttft_s", "tpot_s", "e2e_s", "input_tokens",
                "total_tps", "itl_s", "itl_basis", "goodput")

def percentiles(values) -> dict:
    if not len(values):
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    v = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {"mean": float(v.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def weighted_percentiles(values, counts) -> dict:
    """percentiles() of the array in which values[i] appears counts[i] times, without building
    it (np.percentile's linear interpolation between the two ranks around each quantile)."""
    v = np.asarray(values, dtype=np.float64)
    c = np.asarray(counts, dtype=np.int64)
    keep = c > 0
    v, c = v[keep], c[keep]
    n = int(c.sum())
    if not n:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    order = np.argsort(v, kind="stable")
    v, ends = v[order], np.cumsum(c[order])       # ranks [ends[i-1], ends[i]) hold v[i]

    def at(rank):
        return v[np.searchsorted(ends, rank, side="right")]

    out = {"mean": float((v * c[order]).sum() / n)}
    for name, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        pos = q / 100 * (n - 1)
        lo = int(np.floor(pos))
        a, b = at(lo), at(min(lo + 1, n - 1))
        out[name] = float(a + (b - a) * (pos - lo))
    return out


# what a request's time per output token is where it made one token, for goodput (as vLLM)
SLO_METRICS = {"ttft": "time to first token", "tpot": "time per output token",
               "e2el": "end-to-end latency"}
# how ITL was measured: from every token's time, or (simulate, which times runs of decode steps
# in closed form and keeps no token's time) from each request's first and last token
ITL_TOKEN_TIMES = "token times"
ITL_MEAN_GAPS = ("per-request mean gap: the mean is exact (all gaps' sum over their count); "
                 "median and p99 take each gap of a request at its request's mean gap")


def parse_goodput(items, option: str = "--goodput", joined_by: str = " ") -> dict:
    """--goodput's KEY:MS items (ttft, tpot, e2el, as vllm bench serve --goodput) -> {key:
    seconds}; BadArgument in one line naming `option`, whose items are `joined_by` apart."""
    out = {}
    for item in items:
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_METRICS:
            raise BadArgument(f"{option} takes KEY:MS items with KEY among "
                              f"{', '.join(SLO_METRICS)} (e.g. ttft:500{joined_by}tpot:50), not "
                              f"{item!r}")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not (math.isfinite(ms) and ms > 0):
            raise BadArgument(f"{option} {key}: a number of milliseconds > 0 is needed, not "
                              f"{value!r}")
        if key in out:
            raise BadArgument(f"{option} names {key} twice")
        out[key] = ms / 1e3
    return out


def request_metrics(reqs, span: float, made: int, token_times=None, slo=None) -> dict:
    """What every run reports of its requests over `span` seconds in which they made `made`
    tokens: counts, rates and the latency percentiles (time to first token, time per output
    token after the first, inter-token latency, end to end), as vllm bench serve reports them.
    token_times: each request's times of its tokens (ITL from every gap between two
    consecutive tokens); None: ITL from each request's first and last token (ITL_MEAN_GAPS).
    slo: {ttft|tpot|e2el: seconds} (parse_goodput): the requests within all of them are good
    (a one-token request's TPOT counts as 0, as vLLM counts it)."""
    ttft = np.array([q.first_token - q.arrival for q in reqs], dtype=np.float64)
    e2e = np.array([q.finish - q.arrival for q in reqs], dtype=np.float64)
    gaps = np.array([q.gen - 1 for q in reqs], dtype=np.int64)
    decode = np.array([q.finish - q.first_token for q in reqs], dtype=np.float64)
    tpot = np.divide(decode, gaps, out=np.zeros_like(decode), where=gaps > 0)
    if token_times is not None:
        itl = (np.concatenate([np.diff(np.asarray(t, dtype=np.float64)) for t in token_times])
               if len(token_times) else np.zeros(0))
        itl_s, basis = percentiles(itl), ITL_TOKEN_TIMES
    else:
        itl_s, basis = weighted_percentiles(tpot, gaps), ITL_MEAN_GAPS
    prompt = int(sum(q.prompt for q in reqs))
    out = RunMetrics({
        "requests": len(reqs),
        "completed": sum(q.finish is not None for q in reqs),
        "output_tps": made / span,
        "requests_per_s": len(reqs) / span,
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(tpot[gaps > 0]),
        "e2e_s": percentiles(e2e),
        "input_tokens": prompt,
        "total_tps": (prompt + made) / span,
        "itl_s": itl_s,
        "itl_basis": basis,
        "goodput": None,
    })
    out.latencies = {"ttft": ttft, "tpot": tpot, "e2el": e2e}
    out.span = span
    if slo:
        out["goodput"] = goodput(out.latencies, span, slo)
    return out


class RunMetrics(dict):
    """A result object that also keeps its requests' latencies (not in its JSON), for what the
    command line decides after the run (--goodput): `latencies` {ttft, tpot, e2el: seconds per
    request} over `span` seconds."""

    latencies: dict
    span: float


def goodput(latencies: dict, span: float, slo: dict) -> dict:
    """The requests within every SLO of `slo` ({ttft|tpot|e2el: seconds}) and their rate."""
    good = np.ones(len(latencies["ttft"]), dtype=bool)
    for key, limit in slo.items():
        good &= latencies[key] <= limit
    n = int(good.sum())
    return {"slo_ms": {k: v * 1e3 for k, v in slo.items()}, "good_requests": n,
            "requests_per_s": n / span}


def apply_goodput(result: dict, slo: dict | None) -> None:
    """Set a result's goodput (and its vLLM summary's) for `slo` (None: nothing to do); the
    result must be a RunMetrics from this run."""
    if not slo:
        return
    result["goodput"] = goodput(result.latencies, result.span, slo)
    if "vllm_summary" in result:
        result["vllm_summary"]["request_goodput"] = result["goodput"]["requests_per_s"]


def vllm_summary(r: dict) -> dict:
    """A result's figures under the names of vllm bench serve --save-result (ms), to set beside
    a vLLM run's."""
    def ms(p):
        return {f"{name}": None if p[key] is None else p[key] * 1e3
                for name, key in (("mean", "mean"), ("median", "p50"), ("p99", "p99"))}
    out = {"completed": r["completed"], "duration": r["duration_s"],
           "total_input_tokens": r["input_tokens"], "total_output_tokens": r["output_tokens"],
           "request_throughput": r["completed"] / r["duration_s"],
           "request_goodput": None if r["goodput"] is None else r["goodput"]["requests_per_s"],
           "output_throughput": r["output_tps"], "total_token_throughput": r["total_tps"]}
    for metric, key in (("ttft", "ttft_s"), ("tpot", "tpot_s"), ("itl", "itl_s"),
                        ("e2el", "e2e_s")):
        for stat, v in ms(r[key]).items():
            out[f"{stat}_{metric}_ms"] = v
    return out


def summarise(trace, policy, setup, results, reqs, replicas, dropped, truncated, wall) -> dict:
    tot = collections.Counter()
    for r in results:
        for k, v in r["totals"].items():
            if k.endswith("_min"):
                tot[k] = min(tot.get(k, math.inf), v)
            elif k == "peak_batch":
                tot[k] = max(tot[k], v)
            else:
                tot[k] += v
    t0 = min(r["t_first"] for r in results)
    t1 = max(r["t_end"] for r in results)
    span = max(t1 - t0, 1e-12)
    made = sum(q.gen for q in reqs)
    m = request_metrics(reqs, span, made)
    decode = tot["decode"] or 1e-30
    busy = tot["decode"] + tot["prefill"] + tot["migration"] + tot["swap"]
    used = sum(r["used_tokens"] for r in results)
    reserved = sum(r["reserved_tokens"] for r in results)
    alloc_stats = [r["allocator"] for r in results]
    weight_bytes = tot["steps"] * setup.weight_bytes
    out = {
        "schema": "odma-hw.simulate/1",
        "policy": policy,
        "layout": results[0]["layout"],
        "trace": trace.name,
        "requests": m["requests"],
        "completed": m["completed"],
        "lost": sum(q.finish is None for q in reqs),
        "dropped_over_length": dropped,
        "truncated_over_length": truncated,
        "duration_s": span,
        "output_tokens": made,
        **{k: m[k] for k in REQUEST_KEYS},
        "utilization": used / reserved if reserved else None,
        "mean_batch": tot["batch_seconds"] / decode,
        "peak_batch": int(tot["peak_batch"]),
        "preemptions": int(tot["preemptions"]),
        "swaps": int(tot["swap_outs"]),            # preemptions that kept the KV on the host
        "swap_s": tot["swap"],
        "migrations": sum(a.get("migrations", 0) for a in alloc_stats),
        "migrated_bytes": sum(a.get("migrated_bytes", 0) for a in alloc_stats),
        "migration_s": tot["migration"],
        "steps": int(tot["steps"]),
        "mean_step_s": decode / tot["steps"] if tot["steps"] else None,
        "step_time_share": {k: tot[k] / decode for k in ("kv", "weights", "overheads",
                                                         "allreduce", "compute",
                                                         "prefill_chunks")},
        "compute_bound_step_share": tot["compute_bound_steps"] / tot["steps"]
        if tot["steps"] else None,
        "busy_time_share": {k: tot[k] / busy if busy else None
                            for k in ("decode", "prefill", "migration", "swap")},
        "kv_read_bytes_share": (tot["kv_bytes"] / (tot["kv_bytes"] + weight_bytes)
                                if tot["steps"] else None),
        "time_avg_occupancy": tot["occupancy_seconds"] / busy if busy else None,
        "floor_margin_min": tot.get("floor_margin_min"),
        "compute_floor_margin_min": tot.get("compute_floor_margin_min"),
        "prefill_floor_margin_min": tot.get("prefill_floor_margin_min"),
        "kv_pool_gb_per_card": results[0]["pool_bytes"] / 1e9,
        "kv_pool_tokens": results[0]["pool_bytes"] // setup.kv_bytes_per_token,
        "wall_seconds": wall,
        "settings": _settings(policy, setup, replicas),
        "timing": setup.timing.describe(),
        "prefix_cache": _prefix_summary(tot, results, reqs),
        "series": [{"t": t, "running": nr, "waiting": nw, "occupancy": o}
                   for t, nr, nw, o in results[0]["series"]],
    }
    out["vllm_summary"] = vllm_summary(out)
    return _keeping(m, out)


def _keeping(m: RunMetrics, out: dict) -> RunMetrics:
    """`out` as a RunMetrics with m's latencies."""
    out = RunMetrics(out)
    out.latencies, out.span = m.latencies, m.span
    return out


def _settings(policy, setup, replicas) -> dict:
    """The settings a simulate result records."""
    return {
        "model": setup.model.name, "dtype": setup.dtype, "device": setup.device.name,
        "device_file": setup.device.file,
        "tp": setup.tp, "replicas": replicas, "max_model_len": setup.max_model_len,
        "max_batch": setup.max_batch, "mfu": setup.mfu, "page_tokens": setup.page_tokens,
        "predictor": policy_spec(policy).predictor(setup.predictor),
        "prefill": ("whole prompts, prefill-first (vLLM v0)"
                    if setup.max_batched_tokens is None else
                    f"chunked, {setup.max_batched_tokens} tokens per step (vLLM v1)"),
        "max_num_batched_tokens": setup.max_batched_tokens,
        "concurrency": setup.concurrency,
        "preemption": (f"swap ({setup.swap_space_gb:g} GB host, {setup.swap_gbps:g} GB/s)"
                       if setup.preemption == "swap" else "recompute"),
        "cobatch": setup.cobatch, "demand_bound": setup.config.demand_bound,
        "dispatch": "round robin" if replicas > 1 else None,
        "kv_bytes_per_token_per_card": setup.kv_bytes_per_token,
        "weight_bytes_per_card": setup.weight_bytes, "seed": setup.seed,
    }


def _prefix_summary(tot, results, reqs) -> dict | None:
    """What the prefix cache did: lookups by where the prefix was, tokens and prefill seconds
    saved, restore and offer seconds, and the caches' own statistics."""
    caches = [r["prefix_cache"] for r in results if "prefix_cache" in r]
    if not caches:
        return None
    found = {t: int(tot[f"prefix_{t}"]) for t in ("device", "host", "disk", "miss")}
    lookups = sum(found.values())
    return {
        "lookups": lookups,
        "found": found,
        "hit_rate": {t: (v / lookups if lookups else None) for t, v in found.items()},
        "covered_tokens": int(tot["prefix_covered_tokens"]),
        "prompt_tokens": int(sum(q.prompt for q in reqs)),
        "prefill_saved_s": tot["prefill_saved"],
        "restore_s": tot["prefix_restore"],
        "offer_s": tot["prefix_offer"],
        "caches": caches,
    }


def summarise_engine(policy: str, run: dict, setup: dict, slo: dict | None = None) -> dict:
    """The result object of one policy the engine served (engine.serve.serve's `run`), with
    simulate's metric names; ITL from the run's token times where it kept them."""
    reqs = run["requests"]
    span = max(run["seconds"], 1e-12)
    made = sum(len(t) for t in run["tokens"])
    m = request_metrics(reqs, span, made, run.get("token_times"), slo)
    used, reserved = run["used_tokens"], run["reserved_tokens"]
    a = run["allocator"]
    out = {
        "policy": policy,
        "requests": m["requests"],
        "completed": m["completed"],
        "duration_s": span,
        "output_tokens": made,
        **{k: m[k] for k in REQUEST_KEYS},
        "preemptions": run["preemptions"],
        "migrations": a.get("migrations", 0),
        "utilization": used / reserved if reserved else None,
        "mean_batch": run["batch_sum"] / run["steps"] if run["steps"] else None,
        "peak_batch": run["peak_batch"],
        "steps": run["steps"],
        "startup_s": run.get("startup_seconds"),   # hf: its manager's start-up, not in duration
        "decode_step_us": run.get("decode_step_us"),  # hf: None (its own loop, not timed)
        "mismatches": None, "near_ties": None, "non_finite": None, "max_logit_diff": None,
        "settings": setup,
    }
    out["vllm_summary"] = vllm_summary(out)
    return _keeping(m, out)


# -- the metric names a sweep's --metric takes: the result objects' numeric columns, flattened
# as a sweep flattens them ("ttft_s.p99"); GROUP.* stands for every column under GROUP
STATS = ("mean", "p50", "p90", "p99")
_LATENCIES = tuple(f"{k}.{s}" for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s") for s in STATS)
_SUMMARY = ("input_tokens", "total_tps", *_LATENCIES, "goodput.good_requests",
            "goodput.requests_per_s", "goodput.slo_ms.*", "vllm_summary.*")
SIMULATE_METRICS = (
    "rate", "offered_rate", "requests", "completed", "lost", "dropped_over_length",
    "truncated_over_length", "duration_s", "output_tokens", "output_tps", "requests_per_s",
    *_SUMMARY, "utilization", "mean_batch", "peak_batch", "preemptions", "swaps", "swap_s",
    "migrations", "migrated_bytes", "migration_s", "steps", "mean_step_s", "step_time_share.*",
    "compute_bound_step_share", "busy_time_share.*", "kv_read_bytes_share",
    "time_avg_occupancy", "floor_margin_min", "compute_floor_margin_min",
    "prefill_floor_margin_min", "kv_pool_gb_per_card", "kv_pool_tokens", "wall_seconds",
    "prefix_cache.*", "settings.*", "timing.*")
ENGINE_METRICS = (
    "requests", "completed", "output_tokens", "output_tps", "requests_per_s", "duration_s",
    *_SUMMARY, "preemptions", "migrations", "utilization", "mean_batch", "peak_batch", "steps",
    "startup_s", "decode_step_us.*", "mismatches", "near_ties", "non_finite", "max_logit_diff",
    "kv_cache_mb", "settings.*")
