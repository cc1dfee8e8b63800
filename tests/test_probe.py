"""The probe's decision rule and the `probe` / `devices` command-line contract."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from odma_hw.devices.base import Measurement
from odma_hw.errors import BadArgument
from odma_hw.probe import classify, parse_granularities


def run_cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "odma_hw", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def m(pattern="read", best=1.0, median=1.0, granule=64):
    return Measurement(pattern, granule, 1, 1 << 20, 1e9, best, median, median, 5, "test")


# --- the decision rule ------------------------------------------------------------------------
def test_saturated_low_ratio_is_racm():
    verdict, reason = classify(0.3, 0.5, {1: 10.0, 2: 10.5}, {1: 3.0, 2: 3.1}, None, [m()])
    assert verdict == "racm" and "0.30" in reason


def test_saturated_high_ratio_is_not_racm():
    assert classify(0.8, 0.5, {1: 10.0}, {1: 8.0}, 12.0, [m()])[0] == "not-racm"


def test_bandwidth_still_scaling_with_threads_is_inconclusive():
    # devices.md rule 8: doubling from 1 to 2 threads means the ratio is a per-core limit
    verdict, reason = classify(0.14, 0.5, {1: 19.0, 2: 38.0}, {1: 2.6, 2: 5.3}, None, [m()])
    assert verdict == "inconclusive" and reason.startswith("unsaturated")


def test_random_still_scaling_is_inconclusive_even_if_sequential_saturated():
    verdict, _ = classify(0.2, 0.5, {1: 30.0, 2: 31.0}, {1: 2.6, 2: 5.3}, None, [m()])
    assert verdict == "inconclusive"


def test_far_below_known_peak_is_inconclusive():
    verdict, reason = classify(0.3, 0.5, {1: 10.0}, {1: 3.0}, 300.0, [m()])
    assert verdict == "inconclusive" and "peak" in reason


def test_disagreeing_repetitions_are_inconclusive():
    verdict, reason = classify(0.3, 0.5, {1: 10.0}, {1: 3.0}, None, [m(best=1.0, median=1.6)])
    assert verdict == "inconclusive" and "disagree" in reason


@pytest.mark.parametrize("text,expected", [("64", [64]), ("32,64,4K", [32, 64, 4096]),
                                           ("128,32,128", [32, 128])])
def test_granularity_parsing(text, expected):
    assert parse_granularities(text) == expected


@pytest.mark.parametrize("text", ["48", "4", "abc", "64,", "-64", "0"])
def test_granularity_rejects_malformed(text):
    with pytest.raises(BadArgument):
        parse_granularities(text)


# --- the command line -------------------------------------------------------------------------
SMALL = ["--buffer-mib", "64", "--reps", "2", "--quiet"]


@pytest.mark.parametrize("args,needle", [
    (["--device", "gpu:0"], "unknown device"),
    (["--device", "cuda:x"], "cuda:N"),
    (["--device", "torch:cpu", "--granularity", "48"], "power of two"),
    (["--device", "torch:cpu", "--granularity", "6x"], "malformed granularity"),
    (["--device", "torch:cpu", "--alpha", "1.5"], "alpha"),
    (["--device", "torch:cpu", "--alpha", "0"], "alpha"),
    (["--device", "torch:cpu", "--threads", "0"], "threads"),
    (["--device", "torch:cpu", "--buffer-mib", "100000000"], "free"),
    (["--device", "torch:cpu", "--buffer-mib", "1", "--granularity", "2K,4M"], "exceeds"),
    (["--device", "emu:no-such-preset"], "no-such-preset"),
])
def test_bad_input_exits_2_with_one_line(args, needle):
    r = run_cli("probe", *args)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_device_lists_the_known_ones():
    r = run_cli("probe", "--device", "tpu:0")
    assert r.returncode == 2
    for known in ("host", "cuda:N", "mlu:N", "torch:", "emu:"):
        assert known in r.stderr


def test_probe_json_schema_on_torch_cpu(tmp_path):
    png = tmp_path / "probe.png"
    r = run_cli("probe", "--device", "torch:cpu", "--granularity", "64,256", "--json",
                "--plot", str(png), *SMALL)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "odma-hw.probe/1"
    (dev,) = doc["devices"]
    for key in ("device", "kind", "name", "peak_gbps", "seq_gbps", "rand_gbps", "granularity",
                "ratio", "alpha", "verdict", "reason"):
        assert key in dev
    assert dev["device"] == "torch:cpu" and dev["kind"] == "torch"
    assert set(dev["rand_gbps"]) == {"64", "256"}
    assert dev["seq_gbps"] > 0 and all(v > 0 for v in dev["rand_gbps"].values())
    assert dev["ratio"] == pytest.approx(dev["rand_gbps"]["64"] / dev["seq_gbps"])
    assert dev["verdict"] in ("racm", "not-racm", "inconclusive") and dev["reason"]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_probe_table_prints_a_verdict_per_device():
    r = run_cli("probe", "--device", "torch:cpu", "--granularity", "64", *SMALL)
    assert r.returncode == 0, r.stderr
    assert "torch:cpu" in r.stdout and any(v in r.stdout for v in ("racm", "inconclusive"))


def test_devices_lists_every_backend_with_reason_when_absent():
    r = run_cli("devices", "--json")
    assert r.returncode == 0, r.stderr
    backends = {b["backend"]: b for b in json.loads(r.stdout)["backends"]}
    assert set(backends) == {"host", "cuda", "mlu", "torch", "emu"}
    for b in backends.values():
        assert b["specs"] or b["reason"], b
    assert "torch:cpu" in backends["torch"]["specs"]


def test_ctrl_c_stops_cleanly():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "odma_hw", "probe", "--device", "torch:cpu",
                          "--buffer-mib", "256", "--reps", "50"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    # wait until measuring has begun (the progress display prints the first step)
    deadline = time.time() + 60
    line = ""
    while time.time() < deadline and "read" not in line:
        line = p.stderr.readline()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130
    assert "interrupted" in err and "Traceback" not in err
