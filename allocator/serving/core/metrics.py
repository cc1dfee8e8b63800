"""The metrics of a serving run, with one set of names: the JSON object `odma-hw simulate` prints
per (policy, rate), from each replica's totals (seconds by component, counts), its time series
and its requests (summarise), and the result object of one policy `odma-hw engine` served
(summarise_engine). Both take their request metrics from request_metrics."""

from __future__ import annotations

import collections
import math

import numpy as np

from allocator.policies import policy as policy_spec


def percentiles(values) -> dict:
    if not len(values):
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    v = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {"mean": float(v.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def request_metrics(reqs, span: float, made: int) -> dict:
    """What every run reports of its requests over `span` seconds in which they made `made`
    tokens: counts, rates and the latency percentiles (time to first token, time per output
    token after the first, end to end)."""
    return {
        "requests": len(reqs),
        "completed": sum(q.finish is not None for q in reqs),
        "output_tps": made / span,
        "requests_per_s": len(reqs) / span,
        "ttft_s": percentiles([q.first_token - q.arrival for q in reqs]),
        "tpot_s": percentiles([(q.finish - q.first_token) / (q.gen - 1) for q in reqs
                               if q.gen > 1]),
        "e2e_s": percentiles([q.finish - q.arrival for q in reqs]),
    }


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
        "output_tps": m["output_tps"],
        "requests_per_s": m["requests_per_s"],
        "ttft_s": m["ttft_s"],
        "tpot_s": m["tpot_s"],
        "e2e_s": m["e2e_s"],
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


def summarise_engine(policy: str, run: dict, setup: dict) -> dict:
    """The result object of one policy the engine served (torch_engine.serve's `run`), with
    simulate's metric names."""
    reqs = run["requests"]
    span = max(run["seconds"], 1e-12)
    made = sum(len(t) for t in run["tokens"])
    m = request_metrics(reqs, span, made)
    used, reserved = run["used_tokens"], run["reserved_tokens"]
    a = run["allocator"]
    return {
        "policy": policy,
        "requests": m["requests"],
        "completed": m["completed"],
        "output_tokens": made,
        "output_tps": m["output_tps"],
        "requests_per_s": m["requests_per_s"],
        "duration_s": span,
        "ttft_s": m["ttft_s"],
        "tpot_s": m["tpot_s"],
        "e2e_s": m["e2e_s"],
        "preemptions": run["preemptions"],
        "migrations": a.get("migrations", 0),
        "utilization": used / reserved if reserved else None,
        "mean_batch": run["batch_sum"] / run["steps"] if run["steps"] else None,
        "peak_batch": run["peak_batch"],
        "steps": run["steps"],
        "startup_s": run.get("startup_seconds"),   # hf: its manager's start-up, not in duration
        "mismatches": None, "near_ties": None, "non_finite": None, "max_logit_diff": None,
        "settings": setup,
    }
