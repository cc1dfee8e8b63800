"""A card and its probe file as calibrate writes them: where (checked before anything is
measured), TOML or JSON text with six significant digits, checked by the card reader itself
before it is written.
"""

from __future__ import annotations

import math
import os
import secrets

from odma_hw.errors import BadArgument, DeviceError

from allocator.serving.calibration.measure import TORCH_SOURCE

PROBE_SCHEMA = "odma-hw.probe/1"


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
    if not os.path.isdir(folder):
        raise BadArgument(f"cannot write card {out}: folder {folder} does not exist")
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
    figure measured outside the range a card may hold (allocator/serving/datafile.py) is a
    measurement gone wrong, and writing it would only move the refusal to simulate."""
    import json

    from odma_hw import tomlread

    from allocator.serving.presets import card_fields, card_is_json

    data = json.loads(text) if card_is_json(path) else tomlread.loads(text)
    try:
        card_fields(path, data)
    except BadArgument as exc:
        raise DeviceError(f"calibrate measured what no card may hold, so wrote nothing: {exc}") \
            from None


def probe_document(dev: dict, bw: dict, run_sizes) -> dict:
    """The bandwidths as `odma-hw probe --json` writes a device (allocator/serving/timing.py,
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
