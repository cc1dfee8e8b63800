"""The figures of one bench/gpu_check.sh run, from its step outputs (FOLDER/*.out, each the
JSON a command printed): engine --check mismatches, the tests run on the card, each engine run
beside simulate's prediction of it (output tok/s, TTFT p50, TPOT p50 and p99, simulate /
engine), odma against transformers' continuous batching, and the card calibrate measured.

    python bench/gpu_summary.py FOLDER
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# engine run -> the simulate runs predicting it (by card)
PAIRS = {"speed32": "sim32", "speed32_chunked": "sim32c", "full256": "sim256",
         "full256_rev": "sim256"}


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def by_policy(doc) -> dict:
    return {r["policy"].split("/")[0]: r for r in (doc or {}).get("results", [])}


def metrics(r) -> tuple:
    return (r["output_tps"], r["ttft_s"]["p50"] * 1e3, r["tpot_s"]["p50"] * 1e3,
            r["tpot_s"]["p99"] * 1e3)


def checks(folder: Path) -> list[str]:
    lines = []
    for f in sorted(folder.glob("check_*.out")):
        doc = load(f)
        if doc is None:
            lines.append(f"{f.stem}: no result")
            continue
        got = ", ".join(f"{r['policy']} {r.get('mismatches')}" for r in doc["results"])
        failed = [x["policy"] for x in doc.get("failed", [])]
        lines.append(f"{f.stem}: mismatches {got}" + (f"; FAILED {failed}" if failed else ""))
    return lines


def tests(folder: Path) -> list[str]:
    """pytest's last line of each test step (pytest_*.out): what passed on the card."""
    lines = []
    for f in sorted(folder.glob("pytest_*.out")):
        out = f.read_text(errors="replace").strip().splitlines()
        lines.append(f"{f.stem}: {out[-1].strip('= ') if out else 'no output'}")
    return lines


def fidelity(folder: Path) -> list[str]:
    lines = []
    for run, sim in PAIRS.items():
        eng = by_policy(load(folder / f"{run}.out"))
        if not eng:
            continue
        for f in sorted(folder.glob(f"{sim}_*.out")):
            pred = by_policy(load(f))
            card = f.stem.removeprefix(sim + "_")
            lines.append(f"{run} against simulate on {card}: engine / simulate / sim:eng")
            for p, e in eng.items():
                if p not in pred:
                    continue
                em, sm = metrics(e), metrics(pred[p])
                lines.append(f"  {p:8s} tok/s {em[0]:9.1f} {sm[0]:9.1f} {sm[0] / em[0]:5.2f}"
                             f" | TTFT p50 ms {em[1]:8.1f} {sm[1]:8.1f} {sm[1] / em[1]:5.2f}"
                             f" | TPOT p50 ms {em[2]:6.2f} {sm[2]:6.2f} {sm[2] / em[2]:5.2f}"
                             f" | TPOT p99 ms {em[3]:6.2f} {sm[3]:6.2f}")
    return lines


def speed(folder: Path) -> list[str]:
    lines = []
    for run in ("speed32", "speed32_modules", "speed32_prompt_runs", "speed32_chunked",
                "full256", "full256_rev", "full256_hf", "speed32_hf_graphs"):
        doc = load(folder / f"{run}.out")
        if not doc:
            continue
        for p, r in by_policy(doc).items():
            m = metrics(r)
            lines.append(f"{run:19s} {p:8s} {m[0]:9.1f} tok/s  TTFT p50 {m[1]:8.1f} ms  "
                         f"TPOT p50 {m[2]:6.2f} ms p99 {m[3]:6.2f} ms  graphs "
                         f"{r.get('cuda_graphs')}  attention {r.get('attention')}  "
                         f"fused {r.get('fused_layers')}  prompts {r.get('prompt_attention')}  "
                         f"compiled in run {r.get('kernel_compiles', '-')}")
            d = r.get("decode_step_us")
            if d:
                lines.append(f"{'':19s} {p:8s} a decode step: issue {d['issue']:.0f} us, wait "
                             f"{d['wait']:.0f} us, to the next {d['other']:.0f} us "
                             f"(median of {d['steps']})")
    eng = by_policy(load(folder / "speed32.out"))
    hf_graphs = by_policy(load(folder / "speed32_hf_graphs.out")).get("hf")
    if "odma" in eng:
        for name, hf in (("hf", eng.get("hf")), ("hf with its CUDA graphs", hf_graphs)):
            if hf:
                lines.append(f"speed32 odma / {name}: "
                             f"{eng['odma']['output_tps'] / hf['output_tps']:.2f}x")
    return lines


def card(folder: Path) -> list[str]:
    doc = load(folder / "calibrate.out")
    if not doc:
        return ["calibrate: no result"]
    o = doc["overheads"]
    reads = doc["engine_reads"]
    return [f"calibrate {doc['device']} ({doc['device_name']}): memory {doc['bandwidth']['source']}"
            f", seq {doc['bandwidth']['seq_gbps']:.0f} GB/s",
            f"  engine KV reads ({reads['backend']}): " + ", ".join(
                f"{b} B {g:.0f}" for b, g in reads["gbps"].items()) + " GB/s",
            f"  overheads: step {o['step_us']:.1f} us, layer {o['layer_us']:.2f} us, request "
            f"{o['request_us']:.2f} us, layer-request {o['layer_request_us']:.3f} us; decode rms "
            f"{o['rms_relative_residual']:.3f} max {o['max_relative_residual']:.3f}; prefill rms "
            f"{o['prefill']['rms_relative_residual']:.3f} max "
            f"{o['prefill']['max_relative_residual']:.3f}; chunked rms "
            f"{o['chunked']['rms_relative_residual']:.3f} max "
            f"{o['chunked']['max_relative_residual']:.3f}, a chunk after cached tokens "
            f"{o['card'].get('chunk_layer_overhead_us', 0):.1f} us a layer",
            f"  calibrated in {doc['seconds']:.0f} s"]


def kernel(folder: Path) -> list[str]:
    """The decode kernel's KV read rate per geometry, batch x context and layout, and its
    fraction of the probe's sequential read (calibrate's card) on the same card."""
    doc = load(folder / "kernel_bench.json")
    if not doc:
        return []
    seq = (load(folder / "calibrate.out") or {}).get("bandwidth", {}).get("seq_gbps")
    lines = ["decode kernel KV reads (GB/s; / contiguous" + (f"; / probe seq {seq:.0f}" if seq
                                                             else "") + ")"]
    for b in doc.get("benchmarks", []):
        x = b.get("extra_info", {})
        if "kv_gbps" not in x:
            continue
        p = b.get("params", {})
        lines.append(f"  {p.get('geometry')} {p.get('batch')}x{p.get('context')} "
                     f"{p.get('layout'):10s} {x['kv_gbps']:7.0f}  "
                     f"{x.get('ratio_to_contiguous', 0):.2f}"
                     + (f"  {x['kv_gbps'] / seq:.2f}" if seq else ""))
    for b in doc.get("benchmarks", []):     # bench_engine.py's decode step from its graph
        x = b.get("extra_info", {})
        if "step_ms" in x:
            floor = (x["weight_bytes"] + x["kv_bytes"]) / (seq * 1e9) * 1e3 if seq else None
            lines.append(f"decode step 32 x 1,024 tokens, fused layers {x['fused_layers']}: "
                         f"{x['step_ms']:.3f} ms" + (f" (memory floor {floor:.3f} ms at the "
                                                      f"probe's sequential read)" if floor
                                                      else ""))
    return lines


def main(argv=None) -> int:
    folder = Path((argv or sys.argv[1:] or ["."])[0])
    for section in (card, checks, tests, speed, fidelity, kernel):
        try:        # a step cut short leaves odd files: one section lost, not the summary
            lines = section(folder)
        except Exception as exc:        # noqa: BLE001 - any error, named in its place
            lines = [f"{section.__name__}: not summarised ({type(exc).__name__}: {exc})"]
        print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
