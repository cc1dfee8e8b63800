"""The sweep's results log (results.jsonl): a cell counts as done only when every line of its
latest attempt is there and whole, however the file was cut short, and an append after a torn
line loses nothing. No Ray needed: the log is written and read as the sweep does.
"""

from __future__ import annotations

import json
import os

import pytest

from odma_cli import sweep


def attempt(index: int, status: str = "ok", rows: int = 1) -> tuple[sweep.Cell, dict]:
    """A finished cell (its Cell and run_cell's result) with `rows` table rows."""
    cell = sweep.Cell(index, {"x": index}, ("fake", "--x", str(index), "--json"), f"h{index:03d}")
    result = {"status": status, "error": None if status == "ok" else "RuntimeError: no",
              "rows": [{"policy": p, "tps": 1.5 * index + n, "note": "a\nb é"}
                       for n, p in enumerate(["odma", "paged", "static"][:rows])],
              "wall_seconds": 0.25, "warm_up_seconds": 0.0, "worker": "w:1"}
    return cell, result


# one cell of each shape, and cells tried twice (failed, then ok): the second attempt counts
ATTEMPTS = [attempt(0, rows=1), attempt(1, rows=3), attempt(2, "failed"), attempt(3, rows=2),
            attempt(2, rows=2), attempt(4, "failed", rows=1), attempt(4, rows=3)]


def write_log(path, attempts=ATTEMPTS) -> list[tuple[str, str, int]]:
    """Write each attempt with ResultLog; (hash, status, offset just past its last byte other
    than the final newline) per attempt, in order."""
    ends = []
    log = sweep.ResultLog(str(path))
    try:
        for cell, result in attempts:
            log.write(sweep.cell_records(cell, result))
            ends.append((cell.hash, result["status"], path.stat().st_size - 1))
    finally:
        log.close()
    return ends


def expected_latest(ends, length: int) -> dict:
    """hash -> status of the latest attempt whose every byte up to its last line's closing brace
    lies within the first `length` bytes of the log."""
    latest = {}
    for h, status, end in ends:
        if end <= length:
            latest[h] = status
    return latest


def test_every_cut_of_the_log_counts_exactly_the_whole_attempts(tmp_path):
    log = tmp_path / "results.jsonl"
    ends = write_log(log)
    # every length from whole to empty (shrinking the file: cheaper than writing it anew)
    for length in range(log.stat().st_size, -1, -1):
        os.truncate(log, length)
        latest = sweep.latest_attempts(str(log))
        assert {h: s for h, (s, _) in latest.items()} == expected_latest(ends, length), length


def test_an_append_after_any_cut_gives_back_every_whole_attempt(tmp_path):
    log = tmp_path / "results.jsonl"
    ends = write_log(log)
    new_cell, new_result = attempt(9, rows=2)
    new_rows = json.loads(json.dumps(sweep.cell_records(new_cell, new_result)))
    for length in range(log.stat().st_size, -1, -1):
        os.truncate(log, length)        # also drops what the last round appended
        write_log(log, [(new_cell, new_result)])
        latest = sweep.latest_attempts(str(log))
        want = {**expected_latest(ends, length), new_cell.hash: "ok"}
        assert {h: s for h, (s, _) in latest.items()} == want, length
        # the rows read back are the rows written, without the framing
        with open(log, "rb") as f:
            got = []
            for off in latest[new_cell.hash][1]:
                f.seek(off)
                got.append(sweep.unframe(f.readline()))
        assert [{k: v for k, v in r.items() if k not in sweep.FRAME_KEYS}
                for r in got] == new_rows, length


def test_an_append_after_a_torn_line_starts_a_line_of_its_own(tmp_path):
    log = tmp_path / "results.jsonl"
    write_log(log, ATTEMPTS[:2])
    log.write_bytes(log.read_bytes()[:-40])         # the last row of cell 1 is torn
    write_log(log, [attempt(5)])
    lines = log.read_bytes().split(b"\n")
    assert sweep.unframe(lines[-2]) is not None     # cell 5's line is whole, on a line of its own
    assert set(sweep.latest_attempts(str(log))) == {"h000", "h005"}   # cell 1 reruns


def test_a_changed_byte_spoils_its_line_and_so_its_cell(tmp_path):
    log = tmp_path / "results.jsonl"
    write_log(log, ATTEMPTS[:2])
    data = bytearray(log.read_bytes())
    i = data.index(b'"tps": ', data.index(b'"cell": 1,')) + len(b'"tps": ')   # a digit
    data[i] = ord("9") if data[i] != ord("9") else ord("8")
    log.write_bytes(bytes(data))
    assert set(sweep.latest_attempts(str(log))) == {"h000"}


def test_lines_written_before_the_log_was_framed_count_as_not_done(tmp_path):
    log = tmp_path / "results.jsonl"
    cell, result = attempt(0)
    log.write_text("".join(json.dumps(r) + "\n" for r in sweep.cell_records(cell, result)))
    assert sweep.latest_attempts(str(log)) == {}
    assert sweep.log_holds_anything(str(log))      # so a sweep there still asks for --resume


def test_an_output_key_named_like_the_framing_is_kept_as_out_key(tmp_path):
    cell, result = attempt(0)
    result["rows"] = [{"cell_rows": 7, "line_sha256": "x"}]
    log = tmp_path / "results.jsonl"
    write_log(log, [(cell, result)])
    (line,) = log.read_bytes().splitlines()
    record = sweep.unframe(line)
    assert (record["out.cell_rows"], record["out.line_sha256"]) == (7, "x")
    assert record["cell_rows"] == 1


def test_a_log_that_is_a_folder_is_an_output_error(tmp_path):
    log = tmp_path / "results.jsonl"
    log.mkdir()
    with pytest.raises(sweep.OutputError, match="it is a folder"):
        sweep.latest_attempts(str(log))
    with pytest.raises(sweep.OutputError, match="cannot write"):
        sweep.ResultLog(str(log))
