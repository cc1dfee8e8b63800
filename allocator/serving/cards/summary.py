"""What `odma-hw calibrate` prints of its result without --json: the memory's figures, the
products' rates, the engine's reads, the fitted overheads and every timed step beside what
simulate makes of it."""

from __future__ import annotations

from allocator.serving.cards.write import byte_text


def _step_tokens(q: dict) -> str:
    """A measured step's tokens: a decode's context, a prefill's prompt, a chunked step's
    decodes' context + its chunk at its first position."""
    if "chunk" in q:
        return f"{q['context']}+{q['chunk']}@{q['start']}"
    return str(q.get("context", q.get("prompt")))


def format_summary(r: dict) -> str:
    """calibrate's result (its --json object) as the lines it prints without --json."""
    v = r["card_values"]
    bw = r["bandwidth"]
    lines = [f"{r['device']} ({r['device_name']}), engine dtype {r['dtype']}"
             + (" (--quick)" if r["quick"] else ""),
             f"memory figures: {bw['source']}"
             + (f" (--memory {r['memory']})" if r.get("memory") else ""),
             f"bandwidth: sequential {bw['seq_gbps']:.2f} GB/s, copy {bw['copy_gbps']:.2f} GB/s; "
             "random runs: " + ", ".join(f"{byte_text(int(s))} {g:.2f}"
                                         for s, g in bw["runs_gbps"].items()) + " GB/s"]
    mm = r["matmul"]
    shapes = ", ".join(f"{q['count']} x {q['k']} -> {q['n']}" for q in mm["products"])
    for dtype, t in mm["tflops"].items():
        parts = [f"{rows} rows {x:.4g}" for rows, x in t.items()]
        lines.append(f"matmul {dtype} ({shapes}): " + ", ".join(parts) + " TFLOPS")
    if mm.get("layers_tflops"):
        lines.append(f"matmul {r['dtype']}, the layers' shapes alone (a prompt's tokens): "
                     + ", ".join(f"{rows} rows {x:.4g}" for rows, x in mm["layers_tflops"].items())
                     + " TFLOPS")
    lines.append(f"the products ran {mm['steps_speed']:.3g}x as fast among the engine's steps "
                 f"(at {', '.join(map(str, mm['steps_speed_rows']))} rows) as in their own "
                 f"phase: the figures above are scaled by it")
    er = r["engine_reads"]
    lines.append(f"engine KV reads ({er['backend']} attention) by run: "
                 + ", ".join(f"{byte_text(int(b))} {g:.3g}" for b, g in er["gbps"].items())
                 + " GB/s")
    o = r["overheads"]
    c = o["card"]
    lines.append(f"overheads fitted on {o['fit_model']}'s decode steps at "
                 f"{'/'.join(map(str, o['fit_layers']))} layers: per step "
                 f"{o['step_us']:.1f} us, per layer {o['layer_us']:.1f} us, per request "
                 f"{o['request_us']:.2f} us, per request per layer {o['layer_request_us']:.2f} us; "
                 f"rms relative residual {o['rms_relative_residual']:.3f}, max "
                 f"{o['max_relative_residual']:.3f}"
                 + (f"; WARNING: {len(o['disturbed'])} shapes measured on a busy machine"
                    if o["disturbed"] else ""))
    lp = o["loop"]
    lines.append(f"the serving loop adds {lp['step_s'] * 1e6:.1f} us per step and "
                 f"{lp['request_s'] * 1e6:.2f} us per request: "
                 + ", ".join(f"batch {q['batch']} {q['step_s'] * 1e3:.3f} ms a step, the Runner's "
                             f"{q['runner_step_s'] * 1e3:.3f}" for q in lp["points"]))
    lines.append(f"card overheads: step_overhead_us {c['step_overhead_us']:.1f}, "
                 f"layer_overhead_us {c['layer_overhead_us']:.1f}, request_overhead_us "
                 f"{c['request_overhead_us']:.2f}, layer_request_overhead_us "
                 f"{c['layer_request_overhead_us']:.2f}")
    head = ["step", "layers", "batch", "tokens", "measured ms", "simulate ms", "residual"]
    rows = [head] + [[kind, str(q["layers"]), str(q["batch"]), _step_tokens(q),
                      f"{q['step_s'] * 1e3:.3f}", f"{q['fitted_s'] * 1e3:.3f}",
                      f"{q['relative_residual'] * 100:+.1f}%"]
                     for kind, pts in (("decode", o["points"]),
                                       ("prefill", o["prefill"]["points"]),
                                       ("chunked", o["chunked"]["points"]))
                     for q in pts]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        lines.append("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)))
    for kind in ("prefill", "chunked"):
        if o[kind]["points"]:
            lines.append(f"{kind} steps as simulate predicts them with these overheads: rms "
                         f"relative residual {o[kind]['rms_relative_residual']:.3f}, max "
                         f"{o[kind]['max_relative_residual']:.3f}")
    lines.append(f"card: {r['card']} (name {v['name']!r}; capacity {v['capacity_gb']:.1f} GB, "
                 f"tflops_bf16 {v['tflops_bf16']:.4g}"
                 + (f", tflops_fp32 {v['tflops_fp32']:.4g}" if "tflops_fp32" in v else "")
                 + f"; link_gbps {v['link_gbps']:g} and link_latency_us "
                   f"{v['link_latency_us']:g} are placeholders)")
    lines.append(f"probe: {r['probe']}; {r['seconds']:.0f} s")
    shares = {k: v for k, v in r["other_cpu_share"].items() if v is not None}
    if shares:
        lines.append("other processes' share of the CPUs: "
                     + ", ".join(f"{k} {v:.0%}" for k, v in shares.items())
                     + ("; WARNING: " + ", ".join(r["busy_phases"]) + " measured on a busy "
                        "machine" if r["busy_phases"] else ""))
    return "\n".join(lines)
