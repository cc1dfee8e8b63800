"""The MLU backend (native/cnrt.c + odma_hw/devices/accel.py) against a fake libcnrt.

tests/fakes/fake_cnrt.c implements the real CNRT 6.x prototypes over host memory and reports one
MLU370-X4. It is compiled here into <tmp>/neuware/lib64/libcnrt.so and found through NEUWARE_HOME,
exactly like the real SDK. The shim loads libcnrt once per process (the handle is never closed), so
every scenario runs in its own Python subprocess with its own environment.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FAKES = Path(__file__).resolve().parent / "fakes"
TOTAL_MB = 256  # the fake device's memory: small, so default-sized buffers stay small here

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc)")


def build_fake(home: Path, *defines: str) -> Path:
    lib64 = home / "lib64"
    lib64.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", *defines,
                    "-o", str(lib64 / "libcnrt.so"), str(FAKES / "fake_cnrt.c"), "-lpthread"],
                   check=True)
    return home


@pytest.fixture(scope="module")
def neuware(tmp_path_factory) -> Path:
    """NEUWARE_HOME of the full fake (async copies, 2D copies, notifiers, attributes)."""
    return build_fake(tmp_path_factory.mktemp("neuware"))


@pytest.fixture(scope="module")
def neuware_minimal(tmp_path_factory) -> Path:
    """NEUWARE_HOME of a fake exporting only count / set device / malloc / free / memcpy."""
    return build_fake(tmp_path_factory.mktemp("neuware_min"), "-DFAKE_CNRT_MINIMAL")


def env_for(home: Path | None, **extra: str) -> dict:
    env = dict(os.environ)
    env.pop("NEUWARE_HOME", None)
    if home is not None:
        env["NEUWARE_HOME"] = str(home)
    env["FAKE_CNRT_TOTAL_MB"] = str(TOTAL_MB)
    env.update(extra)
    return env


def run(code: str, env: dict, timeout: int = 300):
    """Run `code` in a fresh interpreter; it prints one JSON object last. Returns that object."""
    prelude = textwrap.dedent("""
        import json
        from odma_hw import devices, native

        def _raises(fn):
            \"\"\"'Name: message' of the exception fn() raises, or 'no error'.\"\"\"
            try:
                fn()
            except Exception as exc:
                return f"{type(exc).__name__}: {exc}"
            return "no error"
    """)
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- discovery and info

def test_discovery_lists_mlu0(neuware):
    out = run("""
        s = {b.backend: b for b in devices.discover()}["mlu"]
        print(json.dumps({"specs": s.specs, "reason": s.reason}))
    """, env_for(neuware))
    assert out == {"specs": ["mlu:0"], "reason": None}


def test_info_reports_the_mlu370_x4_peak_from_clock_and_bus_width(neuware):
    out = run("""
        d = devices.open("mlu:0")
        i = d.info
        print(json.dumps({"kind": i.kind, "granule": i.natural_granule, "peak": i.peak_gbps,
                          "total": i.total_bytes, "threads": i.max_threads, "details": i.details,
                          "name": i.name}))
    """, env_for(neuware))
    assert out["kind"] == "mlu" and out["granule"] == 64 and out["threads"] == 1
    assert out["peak"] == pytest.approx(307.2)  # 3200000 kHz x 384 bit / 8 x 2
    assert out["total"] == TOTAL_MB << 20
    assert out["details"]["mem_clock_khz"] == 3200000 and out["details"]["bus_width_bits"] == 384
    assert out["details"]["runtime_version"] == 60600 and "CNRT 6.6.0" in out["name"]


def test_no_device_is_reported_with_a_reason(neuware):
    out = run("""
        s = {b.backend: b for b in devices.discover()}["mlu"]
        print(json.dumps({"specs": s.specs, "reason": s.reason}))
    """, env_for(neuware, FAKE_CNRT_DEVICES="0"))
    assert out["specs"] == [] and "no MLU device" in out["reason"]


def test_absent_library_is_reported_naming_libcnrt(tmp_path):
    if ctypes.util.find_library("cnrt"):
        pytest.skip("a real libcnrt is on the loader path of this machine")
    empty = tmp_path / "empty_neuware"
    (empty / "lib64").mkdir(parents=True)
    out = run("""
        s = {b.backend: b for b in devices.discover()}["mlu"]
        print(json.dumps({"specs": s.specs, "reason": s.reason,
                          "open": _raises(lambda: devices.open("mlu:0"))}))
    """, env_for(empty))
    assert out["specs"] == [] and "libcnrt" in out["reason"]
    assert out["open"].startswith("DeviceUnavailable") and "libcnrt" in out["open"]


# ----------------------------------------------------------------------------- memory

def test_write_read_roundtrip_is_byte_exact_at_odd_sizes_and_offsets(neuware):
    out = run("""
        import random
        d = devices.open("mlu:0")
        rng = random.Random(7)
        ok = []
        for size, offset in [(1, 0), (3, 5), (4097, 13), (1000003, 255)]:
            b = d.alloc(size + offset + 7)
            data = bytes(rng.getrandbits(8) for _ in range(size))
            d.write(b, offset, data)
            ok.append(d.read(b, offset, size) == data)
            d.free(b)
        print(json.dumps(ok))
    """, env_for(neuware))
    assert out == [True, True, True, True]


def test_copy_moves_exact_bytes_and_reports_time(neuware):
    out = run("""
        d = devices.open("mlu:0")
        a, b = d.alloc(1 << 20), d.alloc(1 << 20)
        data = bytes((i * 7 + 3) % 256 for i in range(1 << 20))
        d.write(a, 0, data)
        d.write(b, 0, bytes(1 << 20))
        secs = d.copy(b, 3, a, 11, 500001)
        got = d.read(b, 0, 1 << 20)
        expect = bytes(3) + data[11:11 + 500001] + bytes((1 << 20) - 3 - 500001)
        same = d.copy(a, 0, a, 600000, 1000)  # same buffer, disjoint ranges
        print(json.dumps({"exact": got == expect, "secs": secs, "same_ok": d.read(a, 0, 1000) ==
                          data[600000:601000]}))
    """, env_for(neuware))
    assert out["exact"] and out["same_ok"] and out["secs"] >= 0


def test_concurrent_threads_use_the_device_safely(neuware):
    out = run("""
        import threading
        d = devices.open("mlu:0")
        results = []
        def worker(k):
            for i in range(20):
                b = d.alloc(4096 + k)
                payload = bytes([k, i]) * 2048
                d.write(b, 0, payload)
                results.append(d.read(b, 0, 4096) == payload)
                d.free(b)
        ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        [t.start() for t in ts]; [t.join() for t in ts]
        print(json.dumps({"n": len(results), "all": all(results)}))
    """, env_for(neuware))
    assert out == {"n": 80, "all": True}


def test_bad_arguments_raise_and_leave_data_unchanged(neuware):
    out = run("""
        d = devices.open("mlu:0")
        b = d.alloc(4096)
        d.write(b, 0, b"x" * 4096)
        r = {
            "alloc0": _raises(lambda: d.alloc(0)),
            "alloc_huge": _raises(lambda: d.alloc(1 << 40)),
            "write_past_end": _raises(lambda: d.write(b, 4000, b"y" * 200)),
            "read_past_end": _raises(lambda: d.read(b, 4090, 7)),
            "negative_offset": _raises(lambda: d.read(b, -1, 1)),
            "overlap": _raises(lambda: d.copy(b, 0, b, 100, 200)),
            "pattern": _raises(lambda: d.measure("zigzag", 64, buffer_bytes=1 << 20)),
            "granule": _raises(lambda: d.measure("rand", 48, buffer_bytes=1 << 20)),
            "granule_big": _raises(lambda: d.measure("rand", 1 << 21, buffer_bytes=1 << 20)),
            "reps": _raises(lambda: d.measure("read", 64, buffer_bytes=1 << 20, reps=0)),
            "buffer_too_big": _raises(lambda: d.measure("read", 64, buffer_bytes=1 << 40)),
            "ordinal": _raises(lambda: devices.open("mlu:1")),
        }
        r["unchanged"] = d.read(b, 0, 4096) == b"x" * 4096
        d.free(b)
        r["double_free"] = _raises(lambda: d.free(b))
        r["use_after_free"] = _raises(lambda: d.read(b, 0, 1))
        # the shim itself refuses an address the runtime never handed out (no crash)
        r["shim_foreign_free"] = _raises(lambda: native.call("odma_mlu_free", 0, 4096))
        # and more repetitions than the limit every backend shares (native/odma.h)
        r["shim_reps_limit"] = _raises(lambda: native.call(
            "odma_mlu_measure", 0, 4096, 1 << 20, native.lib.ODMA_PAT_READ, 64,
            native.lib.ODMA_MAX_REPS + 1, 0, 1, native.ffi.new("odma_result *")))
        print(json.dumps(r))
    """, env_for(neuware))
    assert out.pop("unchanged") is True
    assert out.pop("ordinal").startswith("DeviceUnavailable")
    for name, text in out.items():
        assert text.startswith("BadArgument"), (name, text)


def test_close_frees_every_buffer(neuware):
    out = run("""
        d = devices.open("mlu:0")
        before = d.free_bytes()
        bufs = [d.alloc(1 << 20) for _ in range(8)]
        during = d.free_bytes()
        d.close()
        e = devices.open("mlu:0")
        print(json.dumps({"before": before, "during": during, "after": e.free_bytes()}))
    """, env_for(neuware))
    assert out["during"] == out["before"] - (8 << 20)
    assert out["after"] == out["before"]


# ----------------------------------------------------------------------------- measurement

def test_measurements_are_positive_dma_based_and_count_copies_twice(neuware):
    out = run("""
        d = devices.open("mlu:0")
        r = {}
        for pattern, g in [("read", 64), ("copy", 64), ("rand", 8), ("rand", 64), ("rand", 4096)]:
            m = d.measure(pattern, g, buffer_bytes=32 << 20, reps=5)
            r[f"{pattern}{g}"] = {"gbps": m.gbps, "bytes": m.bytes, "method": m.method,
                                  "reps": m.reps, "best": m.best_s, "median": m.median_s,
                                  "worst": m.worst_s, "dma": m.extra["dma_based"]}
        r["free_after"] = d.free_bytes()
        r["total"] = d.info.total_bytes
        print(json.dumps(r))
    """, env_for(neuware))
    assert out.pop("free_after") == out.pop("total")  # measure() frees its buffer and scratch
    for key, m in out.items():
        assert m["gbps"] > 0 and m["reps"] == 5 and m["dma"], key
        assert m["best"] <= m["median"] <= m["worst"], key
        assert m["method"].startswith("cnrt-dma-async"), key
    # read streams the whole buffer once; copy moves half of it, counted read + write
    assert out["read64"]["bytes"] == out["copy64"]["bytes"] == 32 << 20
    assert "into scratch, reads counted" in out["read64"]["method"]
    assert "counted 2x" in out["copy64"]["method"]
    assert "2d-randstride" in out["rand64"]["method"]
    # random work defaults to 2**18 granules (bounded by the buffer)
    assert out["rand64"]["bytes"] == 64 * (1 << 18)
    assert out["rand4096"]["bytes"] == 32 << 20


def test_minimal_cnrt_degrades_to_synchronous_copies(neuware_minimal):
    out = run("""
        d = devices.open("mlu:0")
        r = {"peak": d.info.peak_gbps, "total": d.info.total_bytes}
        for pattern in ("read", "rand"):
            m = d.measure(pattern, 64, buffer_bytes=8 << 20, reps=3)
            r[pattern] = {"method": m.method, "gbps": m.gbps, "bytes": m.bytes}
        b = d.alloc(1000)
        c = d.alloc(1000)
        d.write(b, 0, bytes(range(250)) * 4)
        r["copy_secs"] = d.copy(c, 0, b, 0, 1000)
        r["copy_ok"] = d.read(c, 0, 1000) == bytes(range(250)) * 4
        print(json.dumps(r))
    """, env_for(neuware_minimal))
    assert out["peak"] is None  # no cnrtDeviceGetAttribute: peak unknown, not invented
    assert out["read"]["method"] == "cnrt-dma-sync-hostclock (d2d into scratch, reads counted)"
    assert out["rand"]["method"] == "cnrt-dma-sync-hostclock (1d-gather)"
    assert out["read"]["gbps"] > 0 and out["rand"]["gbps"] > 0
    # one DMA call per granule: capped at 65536 calls per repetition to bound the run time
    assert out["rand"]["bytes"] == 64 * 65536
    assert out["copy_ok"] and out["copy_secs"] > 0


# ----------------------------------------------------------------------------- command line

def run_cli(args, env, timeout=300):
    return subprocess.run([sys.executable, "-m", "odma_hw", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_cli_devices_lists_mlu0(neuware):
    proc = run_cli(["devices"], env_for(neuware))
    assert proc.returncode == 0, proc.stderr
    assert "mlu:0" in proc.stdout


def test_cli_probe_mlu_json_completes(neuware):
    if importlib.util.find_spec("odma_hw.probe") is None:
        pytest.skip("odma_hw.probe (the probe command) is not written yet")
    proc = run_cli(["probe", "--device", "mlu:0", "--json", "--granularity", "64"], env_for(neuware))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema"] == "odma-hw.probe/1"
    (dev,) = doc["devices"]
    assert dev["device"] == "mlu:0" and dev["kind"] == "mlu"
    assert dev["peak_gbps"] == pytest.approx(307.2)
    assert dev["seq_gbps"] > 0 and dev["rand_gbps"]["64"] > 0
    assert dev["verdict"] in ("racm", "not-racm", "inconclusive") and dev["reason"]


def test_cli_probe_of_a_missing_mlu_exits_2(neuware):
    proc = run_cli(["probe", "--device", "mlu:3", "--json"], env_for(neuware))
    assert proc.returncode == 2
    assert "mlu:3" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
