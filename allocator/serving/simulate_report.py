"""What `odma-hw simulate` prints and plots of its results: the table (format_table, its
head line, each result's load and policy label) and the plot of throughput against load and of
the batch and KV occupancy over time."""

from __future__ import annotations

from odma_hw import plotting

from allocator.policies import policy
from allocator.serving.cli import clip_note, scheduler_text, summary_table


def _paged(r) -> bool:
    return policy(r["policy"]).layout == "paged"


def policy_label(r) -> str:
    """A result's policy as the tables name it: a paged one with its layout (paged/hnd)."""
    return r["policy"] + (f"/{r['layout']}" if _paged(r) else "")


def load_of(r: dict) -> str:
    return r.get("load") or ("trace" if r["rate"] is None else f"{r['rate']:g} req/s")


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
