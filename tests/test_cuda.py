"""The CUDA backend (native/cuda.c + odma_hw/devices/accel.py).

Four layers, each runs where it can:
- no driver / stub driver / driver without GPU: everywhere (fake libraries from tests/fakes/);
- the shipped PTX (native/kernels_ptx.h, generated): assembles with ptxas for sm_75 and sm_90, and
  is what kernels.cu compiles to;
- the host-side logic (primary context, argument lists against the PTX signatures, events, error
  reporting) against tests/fakes/fake_cuda.c, a driver model over host memory;
- the whole path on a real NVIDIA GPU when one is present (skipped otherwise, with the reason).
The shim loads libcuda once per process, so library scenarios run in subprocesses.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from odma_hw import native

ROOT = Path(__file__).resolve().parents[1]
FAKES = ROOT / "tests" / "fakes"
CUDA_C = ROOT / "native" / "cuda.c"
PTX_H = ROOT / "native" / "kernels_ptx.h"
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc)")


def real_driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def run(code: str, env: dict, timeout: int = 300):
    """Run `code` in a fresh interpreter; it prints one JSON object last. Returns that object."""
    prelude = textwrap.dedent("""
        import json
        from odma_hw import devices, native

        def _raises(fn):
            try:
                fn()
            except Exception as exc:
                return f"{type(exc).__name__}: {exc}"
            return "no error"

        def _init():
            count = native.ffi.new("int *")
            status, msg = native.status_of("odma_cuda_init", count)
            return {"status": status, "msg": msg, "count": count[0]}
    """)
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def env_with_libdir(libdir: Path | None, **extra) -> dict:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(libdir) if libdir else ""
    env.update(extra)
    return env


def build(source: str, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(out),
                    str(FAKES / source), "-lpthread"], check=True)
    return out


# ----------------------------------------------------------------------------- no usable driver

@pytest.mark.skipif(real_driver_present(), reason="this machine has a real NVIDIA driver")
def test_missing_driver_is_reported_not_crashed_on(tmp_path):
    out = run("""
        s = {b.backend: b for b in devices.discover()}["cuda"]
        print(json.dumps({"init": _init(), "specs": s.specs, "reason": s.reason,
                          "open": _raises(lambda: devices.open("cuda:0"))}))
    """, env_with_libdir(tmp_path))
    assert out["init"]["status"] == native.lib.ODMA_ENOLIB and out["init"]["count"] == 0
    assert out["specs"] == [] and "no NVIDIA driver" in out["reason"]
    assert out["open"].startswith("DeviceUnavailable") and "libcuda" in out["open"]


@needs_cc
@pytest.mark.skipif(real_driver_present(), reason="libcuda.so.1 of the real driver would load first")
def test_stub_libcuda_found_by_the_fallback_name_is_reported_as_no_driver(tmp_path):
    # the toolkit's stub is called libcuda.so (no .so.1); its cuInit answers CUDA_ERROR_STUB_LIBRARY
    build("fake_libcuda_stub.c", tmp_path / "libcuda.so")
    out = run("""
        s = {b.backend: b for b in devices.discover()}["cuda"]
        print(json.dumps({"init": _init(), "reason": s.reason,
                          "open": _raises(lambda: devices.open("cuda:0"))}))
    """, env_with_libdir(tmp_path))
    assert out["init"]["status"] == native.lib.ODMA_ENOLIB
    assert out["init"]["msg"] == "stub libcuda: no NVIDIA driver (cuInit: CUDA_ERROR_STUB_LIBRARY)"
    assert "stub libcuda" in out["reason"]
    assert out["open"].startswith("DeviceUnavailable") and "stub" in out["open"]


@pytest.mark.skipif(real_driver_present(), reason="libcuda.so.1 of the real driver would load first")
def test_toolkit_stub_libcuda_is_reported_as_no_driver():
    stubs = [d for d in (Path("/usr/local/cuda/lib64/stubs"),
                         Path("/usr/local/cuda/targets/x86_64-linux/lib/stubs"))
             if (d / "libcuda.so").exists()]
    if not stubs:
        pytest.skip("this CUDA toolkit ships no stubs/libcuda.so (the fake stub test covers it)")
    out = run("print(json.dumps(_init()))", env_with_libdir(stubs[0]))
    assert out["status"] == native.lib.ODMA_ENOLIB and "stub libcuda" in out["msg"]


@needs_cc
def test_driver_without_gpu_is_reported_as_no_device(tmp_path):
    build("fake_libcuda_stub.c", tmp_path / "libcuda.so.1")
    out = run("""
        s = {b.backend: b for b in devices.discover()}["cuda"]
        print(json.dumps({"init": _init(), "reason": s.reason}))
    """, env_with_libdir(tmp_path, FAKE_CUDA_INIT_RESULT="100"))
    assert out["init"]["status"] == native.lib.ODMA_ENODEV
    assert "no CUDA device" in out["reason"] and "CUDA_ERROR_NO_DEVICE" in out["reason"]


def test_argument_errors_are_reported_before_the_driver_is_needed():
    from odma_cli.errors import BadArgument

    if not native.available():
        pytest.skip(native.IMPORT_ERROR)
    ffi = native.ffi
    with pytest.raises(BadArgument):
        native.call("odma_cuda_alloc", 0, 0, ffi.new("uint64_t *"))
    with pytest.raises(BadArgument):
        native.call("odma_cuda_free", 0, 0)
    with pytest.raises(BadArgument):  # overlapping copy
        native.call("odma_cuda_copy", 0, 4096, 4000, 200, ffi.NULL)
    too_many = native.lib.ODMA_MAX_REPS + 1
    for args in [(4096, 1 << 20, 7, 64, 5), (4096, 1 << 20, 2, 64, 0), (4097, 1 << 20, 0, 64, 5),
                 (4096, 1 << 20, 0, 64, too_many)]:
        # unknown pattern, zero reps, misaligned buffer, more reps than the one shared limit
        with pytest.raises(BadArgument):
            native.call("odma_cuda_measure", 0, args[0], args[1], args[2], args[3], args[4], 0, 1,
                        ffi.new("odma_result *"))


# ----------------------------------------------------------------------------- the shipped PTX

def embedded_ptx() -> str:
    """The PTX text of the string literal in kernels_ptx.h."""
    lines = re.findall(r'^\s*"(.*)\\n"', PTX_H.read_text(), flags=re.M)
    return "\n".join(ln.replace('\\"', '"').replace("\\\\", "\\") for ln in lines) + "\n"


def test_ptx_lives_in_its_generated_header_not_in_cuda_c():
    header = PTX_H.read_text()
    assert header.splitlines()[0].startswith("/* kernels_ptx.h - GENERATED by native/regen_ptx.py")
    assert "do not edit" in header.splitlines()[0]
    cuda_c = CUDA_C.read_text()
    assert '#include "kernels_ptx.h"' in cuda_c
    assert ".visible .entry" not in cuda_c and "ODMA_PTX[] =" not in cuda_c


def test_embedded_ptx_has_the_low_isa_header_and_all_kernels():
    ptx = embedded_ptx()
    assert "\n.version 6.4\n" in ptx and "\n.target sm_52\n" in ptx
    for name in ("odma_read", "odma_copy", "odma_gather8", "odma_gather16"):
        assert f".visible .entry {name}(" in ptx


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not installed")
@pytest.mark.parametrize("arch", ["sm_75", "sm_90"])
def test_embedded_ptx_assembles(arch, tmp_path):
    src = tmp_path / "odma.ptx"
    src.write_text(embedded_ptx())
    proc = subprocess.run(["ptxas", f"-arch={arch}", str(src), "-o", str(tmp_path / "odma.cubin")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("ptxas") is None,
                    reason="nvcc/ptxas (CUDA toolkit) not installed")
def test_embedded_ptx_is_what_kernels_cu_compiles_to():
    version = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    recorded = re.search(r"// (Cuda compilation tools, release [^\n]*)", embedded_ptx())
    if not recorded or recorded.group(1) not in version:
        pytest.skip("the installed nvcc differs from the one that generated the embedded PTX")
    proc = subprocess.run([sys.executable, str(ROOT / "native" / "regen_ptx.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("ptxas") is None,
                    reason="nvcc/ptxas (CUDA toolkit) not installed")
def test_regen_check_catches_a_hand_edited_header(tmp_path):
    # a copy of native/ whose header was edited by hand: --check must fail and say which file
    for name in ("regen_ptx.py", "kernels.cu", "kernels_ptx.h"):
        shutil.copy(ROOT / "native" / name, tmp_path / name)
    edited = tmp_path / "kernels_ptx.h"
    edited.write_text(edited.read_text().replace(".minnctapersm 4", ".minnctapersm 2", 1))
    proc = subprocess.run([sys.executable, str(tmp_path / "regen_ptx.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert "kernels_ptx.h differs" in proc.stdout, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- host-side logic, fake driver

@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory) -> Path:
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler (cc)")
    libdir = tmp_path_factory.mktemp("fake_cuda")
    build("fake_cuda.c", libdir / "libcuda.so.1")
    return libdir


def test_fake_driver_info_peak_and_details(fake_driver):
    out = run("""
        d = devices.open("cuda:0")
        i = d.info
        print(json.dumps({"spec": i.spec, "kind": i.kind, "name": i.name, "peak": i.peak_gbps,
                          "granule": i.natural_granule, "details": i.details,
                          "rand": d.default_buffer_bytes("rand"), "read": d.default_buffer_bytes("read")}))
    """, env_with_libdir(fake_driver))
    assert out["spec"] == "cuda:0" and out["kind"] == "cuda" and out["granule"] == 32
    assert out["name"] == "Fake GPU (host memory)"
    assert out["peak"] == pytest.approx(3.2)  # 100000 kHz x 128 bit / 8 x 2
    det = out["details"]
    assert det["compute_units"] == 4 and det["compute_capability"] == "9.0"
    assert det["l2_bytes"] == 1 << 20 and det["runtime_version"] == 12080
    # 1 GiB wanted; the fake has 512 MiB, less an eighth of headroom
    assert out["read"] == out["rand"] == 448 << 20


def test_fake_driver_roundtrip_copy_and_errors(fake_driver):
    out = run("""
        d = devices.open("cuda:0")
        a, b = d.alloc(1 << 20), d.alloc(1 << 20)
        data = bytes((i * 13 + 1) % 256 for i in range(1 << 20))
        d.write(a, 0, data)
        d.write(b, 0, bytes(1 << 20))
        secs = d.copy(b, 1, a, 3, 777777)
        r = {"roundtrip": d.read(a, 5, 1000) == data[5:1005],
             "copy": d.read(b, 0, 1 << 20) == bytes(1) + data[3:3 + 777777] + bytes((1 << 20) - 777778),
             "secs": secs,
             "read_past_end": _raises(lambda: d.read(a, (1 << 20) - 1, 2)),
             "ordinal": _raises(lambda: devices.open("cuda:1")),
             "shim_bad_free": _raises(lambda: native.call("odma_cuda_free", 0, 12345))}
        d.free(a)
        r["double_free"] = _raises(lambda: d.free(a))
        print(json.dumps(r))
    """, env_with_libdir(fake_driver))
    assert out["roundtrip"] and out["copy"] and out["secs"] >= 0
    assert out["read_past_end"].startswith("BadArgument")
    assert out["double_free"].startswith("BadArgument")
    assert out["ordinal"].startswith("DeviceUnavailable") and "1 CUDA device" in out["ordinal"]
    # the driver's own refusal comes back with its error name
    assert out["shim_bad_free"].startswith("BadArgument") and "CUDA_ERROR_INVALID_VALUE" in out["shim_bad_free"]


def test_fake_driver_measure_passes_arguments_matching_the_ptx(fake_driver):
    # the fake reads each kernel's arguments with the sizes the PTX declares and checks every
    # address it touches, so a mismatched argument list fails here as a range error
    out = run("""
        d = devices.open("cuda:0")
        r = {}
        for pattern, g in [("read", 32), ("copy", 32), ("rand", 8), ("rand", 16), ("rand", 32),
                           ("rand", 512), ("rand", 1024), ("rand", 4096)]:
            m = d.measure(pattern, g, buffer_bytes=4 << 20, reps=5, work_bytes=8 << 20)
            r[f"{pattern}{g}"] = {"bytes": m.bytes, "gbps": m.gbps, "method": m.method,
                                  "order": m.best_s <= m.median_s <= m.worst_s}
        print(json.dumps(r))
    """, env_with_libdir(fake_driver))
    for key, m in out.items():
        assert m["gbps"] > 0 and m["order"], key
        assert m["bytes"] == 8 << 20, key  # whole passes (read, copy) or granules (rand)
    assert out["read32"]["method"].startswith("ptx-read")
    assert out["copy32"]["method"].startswith("ptx-copy")
    assert out["rand8"]["method"] == "ptx-gather (8 B loads, 1 thread/granule)"
    assert out["rand32"]["method"] == "ptx-gather (16 B loads, 2 threads/granule)"
    assert out["rand4096"]["method"] == "ptx-gather (16 B loads, 32 threads/granule)"


def test_fake_driver_copy_kernel_moves_the_first_half_onto_the_second(fake_driver):
    out = run("""
        d = devices.open("cuda:0")
        buf = d.alloc(1 << 20)
        data = bytes((i * 7) % 251 for i in range(1 << 19))
        d.write(buf, 0, data)
        # measure() works on its own buffer; call the shim on ours to see the kernel's effect
        res = native.ffi.new("odma_result *")
        native.call("odma_cuda_measure", 0, buf.handle, 1 << 20, 1, 32, 1, 0, 1, res)
        print(json.dumps({"second_half": d.read(buf, 1 << 19, 1 << 19) == data,
                          "bytes": res.bytes}))
    """, env_with_libdir(fake_driver))
    assert out == {"second_half": True, "bytes": float(1 << 20)}


def test_fake_driver_rejected_ptx_reports_error_name_and_log(fake_driver):
    out = run("""
        d = devices.open("cuda:0")  # opening needs no kernels
        print(json.dumps({"err": _raises(lambda: d.measure("read", 32, buffer_bytes=1 << 20))}))
    """, env_with_libdir(fake_driver, FAKE_CUDA_PTX_ERROR="1"))
    assert out["err"].startswith("DeviceError")
    assert "CUDA_ERROR_INVALID_PTX" in out["err"] and "fake driver asked to reject" in out["err"]
    assert "second line" not in out["err"]  # one-line messages


# ----------------------------------------------------------------------------- a real GPU

@pytest.fixture(scope="module")
def gpu():
    from odma_hw.devices import cuda

    specs, reason = cuda.discover()
    if not specs:
        pytest.skip(f"no CUDA GPU here: {reason}")
    dev = cuda.open_device("0")
    yield dev
    dev.close()


def test_gpu_info(gpu):
    info = gpu.info
    assert info.kind == "cuda" and info.natural_granule == 32 and info.total_bytes > 0
    assert info.peak_gbps and info.peak_gbps > 0
    assert info.details["compute_units"] > 0 and info.details["compute_capability"]


def test_gpu_roundtrip_and_copy_are_byte_exact(gpu):
    size = (1 << 24) + 13
    data = os.urandom(size)
    a, b = gpu.alloc(size + 64), gpu.alloc(size + 64)
    try:
        gpu.write(a, 3, data)
        assert gpu.read(a, 3, size) == data
        seconds = gpu.copy(b, 5, a, 3, size)
        assert seconds > 0 and gpu.read(b, 5, size) == data
    finally:
        gpu.free(a)
        gpu.free(b)


@pytest.mark.parametrize("pattern,granule", [("read", 32), ("copy", 32), ("rand", 8), ("rand", 32),
                                             ("rand", 128), ("rand", 4096)])
def test_gpu_measurements_are_positive_and_below_physics(gpu, pattern, granule):
    m = gpu.measure(pattern, granule)
    assert m.gbps > 0 and m.best_s <= m.median_s <= m.worst_s
    assert m.method.startswith("ptx-")
    # a read or gather from a buffer >= 4 x L2 cannot beat DRAM peak by much (L2 hits at most 25 %)
    if pattern != "copy":
        assert m.gbps < 1.5 * gpu.info.peak_gbps


def test_gpu_bad_arguments(gpu):
    from odma_cli.errors import BadArgument

    buf = gpu.alloc(4096)
    with pytest.raises(BadArgument):
        gpu.read(buf, 4000, 200)
    with pytest.raises(BadArgument):
        gpu.measure("rand", 48, buffer_bytes=1 << 20)
    gpu.free(buf)
    with pytest.raises(BadArgument):
        gpu.free(buf)
