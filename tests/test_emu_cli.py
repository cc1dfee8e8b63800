"""`odma-hw emulate`: table, JSON, one-line errors with exit status 2."""

import json

import pytest

from odma_hw.cli import main


def test_json_output(capsys):
    assert main(["emulate", "--spec", "lpddr5-6400", "--pattern", "rand", "--granularity", "64",
                 "--requests", "20000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("efficiency", "bandwidth_gbps", "requests", "wall_seconds", "requests_per_second",
                "row_hits", "commands", "read_latency_p99_ns", "ca_bus_utilisation"):
        assert key in out
    assert out["requests"] == 20000 and 0.6 <= out["efficiency"] <= 0.8


def test_table_output(capsys):
    assert main(["emulate", "--spec", "mlu370-x4", "--pattern", "seq", "--granularity", "256",
                 "--requests", "50000", "--map", "xor", "--refresh", "perbank"]) == 0
    out = capsys.readouterr().out
    assert "efficiency" in out and "GB/s" in out


@pytest.mark.parametrize("argv,match", [
    (["--spec", "lpddr9"], "unknown emulator preset 'lpddr9': expected one of lpddr5-6400"),
    (["--granularity", "48"], "not a multiple of the 32-byte burst"),
    (["--write-ratio", "1.5"], r"\[0, 1\]"),
    (["--requests", "-5"], "positive"),
    (["--spec", "hbm2-2000", "--refresh", "perbank"], "no per-bank refresh"),
    (["--trace", "/nonexistent/trace.txt"], "does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, match):
    assert main(["emulate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    import re
    assert re.search(match, err), err


def test_malformed_trace_file(tmp_path, capsys):
    p = tmp_path / "t.txt"
    p.write_text("0x0 R\n0x40 Q\n")
    assert main(["emulate", "--trace", str(p)]) == 2
    assert "line 2" in capsys.readouterr().err
