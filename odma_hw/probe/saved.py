"""A saved probe result judged again without measuring (`probe --from FILE`): load_saved()
reads and checks the device entries of a `probe --json` document, rejudge() takes its knee at
another full-speed fraction and judges a KV run against its ratios."""

from __future__ import annotations

import dataclasses
import math

from odma_cli import docfile
from odma_cli.errors import BadArgument
from odma_hw.devices.base import MIN_GRANULE, is_int
from odma_hw.probe.measure import SCHEMA, VERDICTS, ProbeResult
from odma_hw.probe.runs import FULL_SPEED, KVRun, check_full_speed, judge_run


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _saved_entry(entry, path: str, i: int) -> ProbeResult:
    """One device entry of a saved result, checked as far as re-judging it needs."""
    if not isinstance(entry, dict):
        raise BadArgument(f"{path}: devices[{i}] is not an object")
    name = entry.get("device")
    where = f"{path}: device {name!r}" if isinstance(name, str) else f"{path}: devices[{i}]"
    if not isinstance(name, str) or not name:
        raise BadArgument(f"{where} lacks a 'device' name")
    for key in ("verdict", "reason"):
        if not isinstance(entry.get(key), str):
            raise BadArgument(f"{where}: {key!r} must be text, got {entry.get(key)!r:.60}")
    if entry["verdict"] not in VERDICTS:
        raise BadArgument(f"{where}: 'verdict' must be one of {', '.join(VERDICTS)}, got "
                          f"{entry['verdict']!r:.60}")
    # copy_gbps and peak_gbps may be absent (or null: no peak known), never wrong
    given = [key for key in ("copy_gbps", "peak_gbps") if entry.get(key) is not None]
    for key in ("seq_gbps", "ratio", "alpha", *given):
        if not _positive(entry.get(key)):
            raise BadArgument(f"{where}: {key!r} must be a finite number > 0, got "
                              f"{entry.get(key)!r:.60}")
    if entry["alpha"] > 1:
        raise BadArgument(f"{where}: 'alpha' is a fraction of streaming in (0, 1], got "
                          f"{entry['alpha']!r:.60}")
    gran = entry.get("granularity")
    if not is_int(gran) or gran < MIN_GRANULE:
        raise BadArgument(f"{where}: 'granularity' must be a granule in bytes, got {gran!r:.60}")
    rand = entry.get("rand_gbps")
    if not isinstance(rand, dict) or not rand:
        raise BadArgument(f"{where}: 'rand_gbps' must be an object of GB/s by granule")
    table = {}
    for g, v in rand.items():
        size = int(g) if isinstance(g, str) and g.isdigit() else None
        if size is None or size < MIN_GRANULE or not _positive(v):
            raise BadArgument(f"{where}: 'rand_gbps' {g!r}: {v!r:.60} is not a granule in bytes "
                              f"and a bandwidth > 0")
        table[size] = float(v)
    if gran not in table:
        raise BadArgument(f"{where}: 'granularity' {gran} has no figure in 'rand_gbps' (its "
                          f"ratio was measured there)")
    buffer_bytes = entry.get("buffer_bytes")
    if buffer_bytes is not None and (not is_int(buffer_bytes) or buffer_bytes <= 0):
        raise BadArgument(f"{where}: 'buffer_bytes' must be a positive integer, got "
                          f"{buffer_bytes!r:.60}")
    seq = float(entry["seq_gbps"])
    copy = entry.get("copy_gbps")
    threads = entry.get("threads") if is_int(entry.get("threads")) else 1

    def scaling(key):
        v = entry.get(key)
        ok = isinstance(v, dict) and v and all(k.isdigit() and _positive(x) for k, x in v.items())
        return {int(k): float(x) for k, x in v.items()} if ok else None

    peak = entry.get("peak_gbps")
    return ProbeResult(
        device=name, kind=str(entry.get("kind", "?")), name=str(entry.get("name", "")),
        peak_gbps=None if peak is None else float(peak), seq_gbps=seq,
        copy_gbps=seq if copy is None else float(copy), rand_gbps=table, granularity=gran,
        ratio=float(entry["ratio"]), alpha=float(entry["alpha"]), verdict=entry["verdict"],
        reason=entry["reason"], threads=threads,
        seq_scaling=scaling("seq_scaling") or {threads: seq},
        rand_scaling=scaling("rand_scaling") or {}, buffer_bytes=buffer_bytes, measurements=[],
        details=entry.get("details") if isinstance(entry.get("details"), dict) else {},
        saved={k: v for k, v in entry.items()
               if k not in ("knee_bytes", "full_speed", "granule_note", "kv_run", "from_file")},
        origin=path)


def load_saved(path: str, devices: list[str] | None = None) -> list[ProbeResult]:
    """The device entries of a saved `probe --json` (schema odma-hw.probe/1), or those named in
    `devices`, as ProbeResults that keep their saved fields; BadArgument in one line naming the
    file (and the key) for anything amiss."""
    doc = docfile.load_document(path, "--from file", as_json=True)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        schema = doc.get("schema") if isinstance(doc, dict) else None
        raise BadArgument(f"--from {path}: not an {SCHEMA} document (schema {schema!r:.60})")
    entries = doc.get("devices")
    if not isinstance(entries, list) or not entries:
        raise BadArgument(f"--from {path}: 'devices' must be a non-empty list")
    results = [_saved_entry(e, path, i) for i, e in enumerate(entries)]
    if devices:
        have = {r.device: r for r in results}
        missing = [d for d in devices if d not in have]
        if missing:
            raise BadArgument(f"--device {missing[0]!r} is not in {path}, which holds "
                              f"{', '.join(have)}")
        results = [have[d] for d in dict.fromkeys(devices)]
    return results


def rejudge(result: ProbeResult, full_speed: float = FULL_SPEED,
            run: KVRun | None = None) -> ProbeResult:
    """A saved result judged again: its knee at `full_speed` and what paging `run` costs (the
    saved verdict stands: it needs the measurements' spread and scaling, which were judged when
    they were taken)."""
    check_full_speed(full_speed)
    where = result.origin or result.device
    kv_run = None
    if run is not None:
        if result.buffer_bytes is not None:
            run.check_fits(result.buffer_bytes, f"{result.device} in {where}")
        kv_run = judge_run(run, result.ratios, result.alpha, full_speed, where)
    return dataclasses.replace(result, full_speed=full_speed, kv_run=kv_run)

