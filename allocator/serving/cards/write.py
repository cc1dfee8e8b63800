"""A card and its probe file as calibrate writes them: where (checked before anything is
measured), what the card says (card_contents: its values, the sentence of its source, the
comments on its keys), TOML or JSON text with six significant digits, checked by the card reader
itself before it is written.
"""

from __future__ import annotations

import math
import os
import secrets

from odma_cli.errors import BadArgument, DeviceError
from odma_cli.paths import folder_problem

from allocator.serving.cards.measure import TORCH_SOURCE

PROBE_SCHEMA = "odma-hw.probe/1"
# Placeholders for what one device cannot measure: PCIe 4.0 x16 per direction, and the
# per-hop latency the shipped mlu370-x4 card assumes. They matter only for simulate --tp > 1.
LINK_GBPS_PLACEHOLDER = 32.0
LINK_LATENCY_US_PLACEHOLDER = 10.0


# ----------------------------------------------------------------------------- checks
def card_paths(out: str) -> tuple[str, str]:
    """(the card, its probe file beside it) for --out; BadArgument unless both can be written
    there (the folder exists and takes new files: each is written as a new file renamed over
    the old, which asks only the folder's permission; a link at --out is replaced, not
    followed, so that the card and the probe file it names stay side by side) and --out names a
    card simulate reads: CARD.toml, or CARD.json for a card in JSON (simulate tells them by
    the suffix). Called before anything is measured."""
    if not isinstance(out, str) or not out.strip():
        raise BadArgument("--out needs a file name")
    card = os.path.abspath(out)
    stem, suffix = os.path.splitext(card)
    if suffix.lower() not in (".toml", ".json"):
        raise BadArgument(f"--out must name a .toml or a .json card (simulate reads a card by "
                          f"its suffix), not {out!r}")
    probe = stem + ".probe.json"
    folder = os.path.dirname(card)
    for path in (card, probe):
        if os.path.isdir(path) and not os.path.islink(path):
            raise BadArgument(f"cannot write {path}: it is a directory")
    problem = folder_problem(folder)
    if problem:
        raise BadArgument(f"cannot write card {out}: {problem}")
    trial = os.path.join(folder, f".calibrate-{secrets.token_hex(6)}.tmp")
    try:
        os.close(os.open(trial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(trial)
    except OSError as exc:
        raise BadArgument(f"cannot write card {out}: {exc.strerror or exc}") from None
    return card, probe


# ----------------------------------------------------------------------------- the card
def toml_string(text: str) -> str:
    """A TOML basic string: quotes and backslashes escaped, control characters as \\uXXXX."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def card_number(v: float) -> float:
    """A card's number: six significant digits, as a float."""
    v = float(v)
    if not math.isfinite(v):
        raise BadArgument(f"a card value must be finite, got {v}")
    return float(f"{v:.6g}")


def toml_float(v: float) -> str:
    """card_number(v), always a TOML float (1e-05, 33.1, 100000.0: never an integer)."""
    return repr(card_number(v))


def card_text(values: dict, comments: dict, header: list[str]) -> str:
    """The card as TOML: one `key = value` per line, in `values`' order, each preceded by its
    comment lines (comments[key]) where it has some."""
    lines = [f"# {h}" for h in header] + [""]
    for key, v in values.items():
        for c in comments.get(key, ()):
            lines.append(f"# {c}")
        if isinstance(v, str):
            lines.append(f"{key} = {toml_string(v)}")
        elif isinstance(v, dict):           # an inline table, its keys quoted
            inner = ", ".join(f"{toml_string(str(k))} = {toml_float(x)}" for k, x in v.items())
            lines.append(f"{key} = {{ {inner} }}")
        else:
            lines.append(f"{key} = {toml_float(v)}")
    return "\n".join(lines) + "\n"


def card_json(values: dict) -> str:
    """The card as JSON (a CARD.json), its numbers as card_text writes them; JSON has no
    comments, so its `source` alone says where each figure comes from."""
    import json

    def value(v):
        if isinstance(v, str):
            return v
        if isinstance(v, dict):
            return {str(k): card_number(x) for k, x in v.items()}
        return card_number(v)
    return json.dumps({k: value(v) for k, v in values.items()}, indent=1,
                      ensure_ascii=False) + "\n"


def check_card(path: str, text: str) -> None:
    """DeviceError unless simulate accepts the card `text` about to be written at `path`: a
    figure measured outside the range a card may hold (allocator/serving/cards/datafile.py) is a
    measurement gone wrong, and writing it would only move the refusal to simulate."""
    import json

    from odma_cli import tomlread

    from allocator.serving.cards.presets import card_fields, card_is_json

    data = json.loads(text) if card_is_json(path) else tomlread.loads(text)
    try:
        card_fields(path, data)
    except BadArgument as exc:
        raise DeviceError(f"calibrate measured what no card may hold, so wrote nothing: {exc}") \
            from None


def probe_document(dev: dict, bw: dict, run_sizes) -> dict:
    """The bandwidths as `odma-hw probe --json` writes a device (allocator/serving/sim/timing.py,
    probe_timing, reads rand_gbps, seq_gbps and copy_gbps). From the native probe: its own
    entry (the native device, with its verdict), plus what it was measured for; from torch's
    gather: an entry of the torch device, with no RACM verdict, which needs the probe's
    saturation checks. Either way "memory_source" names what measured the figures."""
    import odma_hw

    if bw.get("memory") == "native" and bw.get("probe_entry"):
        return {"schema": PROBE_SCHEMA, "devices": [dict(
            bw["probe_entry"], measured_for=dev["spec"], memory_source=bw["source"],
            measured_by="odma-hw calibrate (the native probe of the memory behind "
                        f"{dev['spec']})")]}
    runs = {str(s): float(bw["runs_gbps"][s]) for s in run_sizes}
    seq = float(bw["seq_gbps"])
    return {"schema": PROBE_SCHEMA, "devices": [{
        "device": dev["spec"], "kind": "torch", "name": dev["name"], "peak_gbps": None,
        "seq_gbps": seq, "copy_gbps": float(bw["copy_gbps"]), "rand_gbps": runs,
        "ratios": {k: v / seq for k, v in runs.items()},
        "granularity": int(run_sizes[0]), "ratio": runs[str(run_sizes[0])] / seq,
        "verdict": "inconclusive",
        "reason": "measured by odma-hw calibrate for a card (run reads through torch); it makes "
                  "no saturation check: classify the device with odma-hw probe",
        "runs_in_order_gbps": {str(s): float(bw["runs_in_order_gbps"][s]) for s in run_sizes},
        "buffer_bytes": int(bw["buffer_bytes"]), "reps": int(bw["reps"]),
        "memory_source": bw.get("source", TORCH_SOURCE), "measures": TORCH_SOURCE + (
            ", torch sum and copy_: the rate torch's kernels reach on this memory, not the "
            "memory's rate"),
        "convention": "GB = 1e9 B; copy counts read + write; random counts run bytes x runs",
        "details": {"method": bw["method"], "odma_hw": odma_hw.__version__}}]}


# ----------------------------------------------------------------------------- contents
def byte_text(n: int) -> str:
    """4194304 -> '4 MiB', 2048 -> '2 KiB', 96 -> '96 B'."""
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def card_source(args, p: dict, effort, m: dict, when: str, torch_version: str) -> str:
    """The card's `source` line: what calibrate measured, how, and the fit's figures."""
    dev, dtype = p["device"], p["dtype"]
    bw, mm, peak, tflops_bf16 = m["bw"], m["mm"], m["peak"], m["tflops_bf16"]
    reads, fitting, loop = m["reads"], m["fitting"], m["loop"]
    busy, points, loaded = m["busy"], m["points"], m["loaded"]
    rms = {kind: fitting[kind]["rms_relative_residual"] for kind in ("prefill", "chunked")}
    decode, stack = mm[dtype], m["mm_stack"]
    probe_name = os.path.basename(p["probe"])
    return (
        f"odma-hw calibrate on {dev['spec']} ({dev['name']}), torch {torch_version}, {when}. "
        f"Bandwidth (memory: {bw['source']}): reads of random runs, sequential read and copy "
        f"({probe_name}). Matmul {dtype} over {args.model}'s layer and LM-head shapes, each "
        f"weighed by the time a step spends in it, at {args.prefill_tokens} rows: "
        f"{peak:.4g} TFLOPS (mfu 1: the engine's matrix products reach this)"
        + (f"; bfloat16 {tflops_bf16:.4g}" if dtype != "bfloat16" else "")
        + "; at decode rows " + ", ".join(f"{r}: {decode[r]:.3g}" for r in effort.decode_rows)
        + ("; the layers' alone (prompts) at rows " + ", ".join(
            f"{r}: {stack[r]:.3g}" for r in effort.prompt_rows) if effort.prompt_rows else "")
        + f" TFLOPS (x{m['speed']:.3g}: as fast as the products ran among the engine's steps "
        f"against their own phase). The engine's KV reads ({reads['backend']} attention) by run: "
        + ", ".join(f"{byte_text(b)} {g:.4g}" for b, g in reads["gbps"].items())
        + f" GB/s. Overheads fitted on the engine's decode steps of {args.model} at "
        f"{'/'.join(map(str, effort.fit_layers))} layers, batch "
        f"{'/'.join(map(str, effort.fit_batches))}, contexts "
        f"{'/'.join(map(str, effort.fit_contexts))}: per step "
        f"{fitting['step_s'] * 1e6:.4g} us, per layer {fitting['layer_s'] * 1e6:.4g} us, per "
        f"request {fitting['request_s'] * 1e6:.4g} us, per request per layer "
        f"{fitting['layer_request_s'] * 1e6:.4g} us; rms relative residual "
        f"{fitting['rms_relative_residual']:.3f}, max {fitting['max_relative_residual']:.3f}; "
        f"prefill steps then rms {rms['prefill']:.3f}, chunked {rms['chunked']:.3f}. The "
        f"serving loop adds {loop['step_s'] * 1e6:.4g} us per step and "
        f"{loop['request_s'] * 1e6:.4g} us per request (in the card's step and request "
        f"overheads)"
        + (f" (WARNING: the steps of {len(busy)} of {len(points)} shapes varied as on a busy "
           f"machine)" if busy else "")
        + (" (WARNING: other processes ran during " + ", ".join(loaded) + ")" if loaded else "")
        + ". link_gbps and link_latency_us are placeholders, not measured."
        + (" (--quick: fewer repetitions)" if args.quick else ""))


def card_contents(args, p: dict, effort, m: dict, when: str, measured: str | None,
                  torch_version: str) -> tuple[dict, dict, list[str]]:
    """(values, comments by key, header lines) of the card a calibration writes: `args` its
    parsed arguments (name, model, prefill_tokens, quick), `p` calibrate.check()'s plan, `m`
    its measurements, `when` the time it ran, `measured` the name of the device its probe file
    measured (None where unknown)."""
    dev, dtype = p["device"], p["dtype"]
    bw, mm, peak, tflops_bf16 = m["bw"], m["mm"], m["peak"], m["tflops_bf16"]
    reads, over = m["reads"], m["over"]
    name = args.name or f"calibrated-{dev['spec'].replace(':', '-')}"
    probe_name = os.path.basename(p["probe"])
    source = card_source(args, p, effort, m, when, torch_version)
    values = {"name": name, "bandwidth_gbps": float(bw["seq_gbps"]),
              "capacity_gb": dev["capacity_bytes"] / 1e9, "tflops_bf16": tflops_bf16}
    if dtype == "float32":
        values["tflops_fp32"] = peak
    values.update({"mfu": 1.0,
                   "matmul_tflops": {r: mm[dtype][r] for r in sorted(mm[dtype])},
                   "layer_matmul_tflops": dict(sorted(m["mm_stack"].items())),
                   "timing": f"probe:{probe_name}",
                   **({"engine_run_gbps": dict(reads["gbps"])} if reads["gbps"] else {}),
                   "link_gbps": LINK_GBPS_PLACEHOLDER,
                   "link_latency_us": LINK_LATENCY_US_PLACEHOLDER,
                   **over, **({"device_name": measured} if measured else {}),
                   "dtype": dtype, "source": source})
    comments = {
        "bandwidth_gbps": [f"sequential read, GB/s (1e9 B/s); memory figures: {bw['source']}"],
        "capacity_gb": ["the device's whole memory, GB" + (" (host memory)" if
                                                          dev["device"].type == "cpu" else "")],
        "tflops_bf16": [f"matmul throughput of {args.model}'s products at "
                        f"{args.prefill_tokens} rows, TFLOPS"],
        "mfu": ["the figures above are what the engine's matmuls reach, not a datasheet peak"],
        "matmul_tflops": [f"{dtype} matmul throughput by rows (tokens) in the products, TFLOPS, "
                          f"over {args.model}'s", "shapes, each as often as a step runs it: a "
                          "step's compute runs at its row count's"],
        "layer_matmul_tflops": ["the same of the layers' products alone, TFLOPS: a prompt's "
                                "tokens go through", "the layers at their row count's, only "
                                "each sequence's last through the LM head"],
        "timing": [f"the memory's run-read bandwidth by run size, measured with the card "
                   f"({bw['source']})"],
        "engine_run_gbps": [f"the engine's own KV reads ({reads['backend']} attention, "
                            f"{dtype}) by (layer, K/V, head) run bytes, GB/s:",
                            "what a step's KV reads cost in simulate; the memory's figures "
                            "above size extents"],
        "link_gbps": ["placeholders, NOT measured (one device has no peer): PCIe 4.0 x16 per",
                      "direction and a 10 us hop; they matter only for simulate --tp > 1"],
        "dtype": ["the engine's weight and KV type of every figure here: what simulate and the "
                  "engine run with --dtype auto"],
        "step_overhead_us": [f"overheads fitted on the engine's steps of {args.model}, "
                             f"microseconds: per step, per layer,",
                             "per running request, per running request per layer"],
    }
    header = [f"device card of {dev['spec']}, written by odma-hw calibrate on {when}",
              f"engine dtype {dtype}; `odma-hw simulate --card THIS_FILE` reads it"]
    return values, comments, header
