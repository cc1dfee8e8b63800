"""`odma-hw emulate`: table, JSON, one-line errors with exit status 2."""

import json

import pytest

from odma_cli.main import main


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


@pytest.fixture
def no_work(monkeypatch):
    """Bad input must be refused before any work: neither a trace nor its decomposition."""
    import odma_hw.emu.model as model

    def refuse(*a, **k):
        raise AssertionError("work started before the arguments were checked")
    monkeypatch.setattr(model, "generate", refuse)
    monkeypatch.setattr(model, "decompose", refuse)


@pytest.mark.parametrize("argv,match", [
    (["--spec", "lpddr9"], "unknown emulator preset 'lpddr9': expected one of lpddr5-6400"),
    (["--granularity", "48"], "not a multiple of the 32-byte burst"),
    (["--write-ratio", "1.5"], r"\[0, 1\]"),
    (["--requests", "-5"], "positive"),
    (["--spec", "hbm2-2000", "--refresh", "perbank"], "no per-bank refresh"),
    (["--spec", "hbm2-2000", "--wck-always-on"], "WCK always on applies to LPDDR5 presets only"),
    (["--trace", "/nonexistent/trace.txt"], "does not exist"),
    (["--trace", "/dev/zero"], "'/dev/zero' is a device, not a trace file"),
    (["--seed", "-1"], "seed must be a non-negative integer, not -1"),
    (["--threads", "0"], "threads must be a positive integer, not 0"),
    (["--threads", "-1"], "threads must be a positive integer, not -1"),
    # more than any machine holds: refused up front, not a MemoryError minutes later
    (["--requests", "1000000000000"], r"1000000000000 requests of 64 B need about [\d,.]+ GB of "
                                      r"memory .* GB is available"),
    (["--granularity", "1073741824"], r"200000 requests of 1073741824 B need about [\d,.]+ GB"),
    (["--queue", "0"], r"queue depth must be an integer in \[1, 4096\], not 0"),
    (["--queue", "5000"], r"queue depth must be an integer in \[1, 4096\], not 5000"),
    (["--channels", "0"], r"channels must be an integer in \[1, 1024\], not 0"),
    (["--channels", "2000"], r"channels must be an integer in \[1, 1024\], not 2000"),
    (["--interleave", "96"], "channel interleave must be a power of two between the 32-byte "
                             "burst and the 1073741824-byte channel, not 96"),
    (["--interleave", str(1 << 41)], "channel interleave must be a power of two between"),
    (["--footprint", "0"], "--footprint must be positive, not 0"),
    (["--footprint", "lots"], "--footprint must be an integer, not 'lots'"),
    (["--footprint", str(1 << 40)], r"footprint 1099511627776 must be in \(0, 1073741824\]"),
    (["--footprint", "32"], "footprint 32 is smaller than the 64-byte granule"),
    (["--write-high", "1.5"], r"write high watermark must be a fraction of the write queue in "
                              r"\[0, 1\], not 1.5"),
    (["--write-low", "0.9"], "write low watermark 0.9 must be below the high watermark 0.8"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, no_work, argv, match):
    assert main(["emulate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    import re
    assert re.search(match, err), err


@pytest.mark.parametrize("line, says", [
    ("1" * 100_000 + " R", "bad address '1111"),
    ("-64 R", "address -0x40 is negative"),
])
def test_a_bad_trace_line_is_named_in_one_short_line(tmp_path, capsys, line, says):
    trace = tmp_path / "t.txt"
    trace.write_text("0 R\n" + line + "\n")
    assert main(["emulate", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) < 300 and f"t.txt line 2: {says}" in err, err


def test_a_trace_from_a_pipe_is_emulated(capsys):
    import os

    read, write = os.pipe()
    try:
        os.write(write, b"0 R\n64 W\n")
        os.close(write)
        assert main(["emulate", "--trace", f"/dev/fd/{read}", "--json"]) == 0
    finally:
        os.close(read)
    out = json.loads(capsys.readouterr().out)
    assert (out["reads"], out["writes"]) == (1, 1)


def test_a_run_that_would_not_fit_in_available_memory_is_refused(capsys, monkeypatch, no_work):
    from odma_hw.devices import host

    monkeypatch.setattr(host, "mem_available", lambda: 1 << 30)
    # 50 M requests need about 2.4 GB: more than the 1 GiB said to be available
    assert main(["emulate", "--requests", "50000000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "1.1 GB is available" in err


def test_write_drain_and_queue_options(capsys):
    assert main(["emulate", "--requests", "20000", "--write-ratio", "0.3", "--write-high", "0.9",
                 "--write-low", "0", "--queue", "16", "--queue-unit", "access", "--json"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["write_high"], config["write_low"]) == (0.9, 0.0)
    assert (config["queue"], config["queue_unit"]) == (16, "access")


def test_malformed_trace_file(tmp_path, capsys):
    p = tmp_path / "t.txt"
    p.write_text("0x0 R\n0x40 Q\n")
    assert main(["emulate", "--trace", str(p)]) == 2
    assert "line 2" in capsys.readouterr().err
