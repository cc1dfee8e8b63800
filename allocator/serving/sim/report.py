"""What `odma-hw simulate` prints and plots of its results: the table (format_table, its
head line, each result's load and policy label) and the plot of throughput against load and of
the batch and KV occupancy over time."""

from __future__ import annotations

from odma_cli import plotting

from allocator.policies import policy
from allocator.serving.options import clip_note, scheduler_text, summary_table


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
    """Throughput and p99 latency against load (bars where there is one load), then the running
    batch and the KV pool's reservation over time at the highest load; a line per policy (and
    card, where several), the model, cards and trace in the title."""
    plt = plotting.pyplot()
    cards = list(dict.fromkeys(r["settings"]["device"] for r in results))

    def label(r):
        return policy_label(r) + (f" on {r['settings']['device']}" if len(cards) > 1 else "")

    lines = {}
    for r in results:
        lines.setdefault(label(r), []).append(r)
    rates = sorted({r["rate"] for r in results if r["rate"] is not None})
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    several = len(rates) > 1
    panels = ((axes[0][0], "output tokens/s", lambda r: r["output_tps"]),
              (axes[0][1], "p99 latency (ms)" + (": TPOT solid, TTFT dashed" if several else ""),
               None))
    for ax, ylabel, get in panels:
        if several:
            for name, rs in lines.items():
                rs = sorted((r for r in rs if r["rate"] is not None), key=lambda r: r["rate"])
                x = [r["rate"] for r in rs]
                if get:
                    ax.plot(x, [get(r) for r in rs], marker="o", label=name)
                else:
                    _latency_lines(ax, x, rs, name)
            ax.set_xlabel("offered load (requests/s)")
        else:
            _bars(ax, lines, get)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[0][1].set_yscale("log")      # TTFT and TPOT lie orders of magnitude apart
    axes[0][0].set_title("throughput against load" if several
                         else f"throughput at {load_of(results[0])}")
    axes[0][1].set_title("p99 latency against load" if several
                         else f"p99 latency at {load_of(results[0])}")
    top = rates[-1] if rates else None
    for name, rs in lines.items():
        r = next((r for r in rs if r["rate"] == top), None)
        if r and r.get("series"):
            t = [x["t"] for x in r["series"]]
            axes[1][0].plot(t, [x["running"] for x in r["series"]], label=name)
            axes[1][1].plot(t, [x["occupancy"] for x in r["series"]], label=name)
    at = f" ({top:g} req/s)" if top is not None else ""
    axes[1][0].set(title="running batch over time" + at, xlabel="simulated seconds",
                   ylabel="running requests")
    axes[1][1].set(title="KV pool reserved over time" + at, xlabel="simulated seconds",
                   ylabel="share of KV pool reserved", ylim=(0, 1.05))
    for ax in axes[1]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    st = results[0]["settings"]
    fig.suptitle(f"odma-hw simulate: {st['model']} {st['dtype']} on {', '.join(cards)} "
                 f"(TP{st['tp']}), {results[0]['trace']}")
    fig.tight_layout()
    plotting.save(fig, path)


def _latency_lines(ax, x, rs, name) -> None:
    """p99 TPOT (solid) and TTFT (dashed) of one line's runs, in ms, one colour."""
    tpot = [None if r["tpot_s"]["p99"] is None else r["tpot_s"]["p99"] * 1e3 for r in rs]
    (line,) = ax.plot(x, tpot, marker="o", label=name)
    ax.plot(x, [r["ttft_s"]["p99"] * 1e3 for r in rs], marker="s", linestyle="--",
            color=line.get_color())


def _bars(ax, lines: dict, get) -> None:
    """One load: a bar per line (throughput), or a pair per line (p99 TPOT and TTFT, ms)."""
    names = list(lines)
    first = [rs[0] for rs in lines.values()]
    if get:
        ax.bar(range(len(names)), [get(r) for r in first], color="C0")
    else:
        tpot = [(r["tpot_s"]["p99"] or 0.0) * 1e3 for r in first]
        ttft = [r["ttft_s"]["p99"] * 1e3 for r in first]
        ax.bar([i - 0.2 for i in range(len(names))], tpot, width=0.4, label="TPOT p99")
        ax.bar([i + 0.2 for i in range(len(names))], ttft, width=0.4, label="TTFT p99",
               hatch="//")
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
