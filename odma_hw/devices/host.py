"""The host's DRAM as a Device, backed by the native shim (native/host.c, native/copier.c).

Buffers are 2 MiB-aligned, huge-page-advised mappings from odma_host_alloc; their handle is the
address as an int. Every live buffer is recorded in a table shared with finalizers, so memory is
returned when the buffer is freed, when the device is closed, or when either is garbage-collected,
whichever comes first, and never twice.
"""

from __future__ import annotations

import ast
import os
import pathlib
import time

from odma_cli.errors import BadArgument, DeviceError
from odma_hw import native
from odma_hw.devices.base import Buffer, DeviceInfo, Measurement
from odma_hw.devices.native_memory import NativeMemoryDevice

GIB = 1 << 30
HUGE_PAGE = 2 << 20
# Random reads: 1 GiB on huge pages (devices.md rule 1; larger footprints measure the TLB).
RAND_BUFFER_BYTES = GIB
# Random reads per repetition: 256 MiB worth of granules keeps each repetition around 10-200 ms
# from 32 B to 4 KiB granules on current DRAM, independent of the footprint.
RAND_WORK_BYTES = 256 << 20
# Streaming working sets derived from the reported LLC stop here: a VM may report the host's
# aggregate cache, and beyond a few GiB a bigger buffer only costs time.
STREAM_CAP_BYTES = 4 * GIB


# ----------------------------------------------------------------------------- facts about the host

def mem_available() -> int:
    """MemAvailable from /proc/meminfo in bytes (free physical memory where that is unreadable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (a container's or taskset's cpuset), which
    can be fewer than os.cpu_count() reports for the whole machine."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def mem_total() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "Hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def llc_reported_bytes() -> int | None:
    """Largest cache the OS reports for CPU 0 (inside a VM this can be the host's: use it only as a
    lower bound for working sets, never as proof that a buffer misses the cache)."""
    best = None
    root = pathlib.Path("/sys/devices/system/cpu/cpu0/cache")
    for index in root.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        best = size if best is None else max(best, size)
    if best is None:
        try:
            best = os.sysconf("SC_LEVEL3_CACHE_SIZE") or None
        except (ValueError, OSError):
            best = None
    return best


def compiler_flags() -> str:
    """The flags native/build_shim.py compiles the shim with (read from the source tree of an
    editable install), or 'unknown'."""
    builder = pathlib.Path(__file__).resolve().parents[2] / "native" / "build_shim.py"
    try:
        tree = ast.parse(builder.read_text())
    except (OSError, SyntaxError):
        return "unknown"
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extra_compile_args":
            try:
                return " ".join(ast.literal_eval(node.value))
            except ValueError:
                break
    return "unknown"


# ----------------------------------------------------------------------------- the device

class HostDevice(NativeMemoryDevice):
    """Host DRAM. Buffers are 2 MiB aligned (the advertised `alignment` is the 64-byte line);
    copies use the multi-threaded streaming copier; measure() allocates its own buffer."""

    alignment = 64

    def __init__(self):
        ffi, lib = native.require()
        self._ffi, self._lib = ffi, lib
        # more threads than CPUs are allowed (and recorded as oversubscribed), up to the shim's limit
        self.measure_thread_limit = lib.ODMA_MAX_THREADS
        self._cpu = cpu_model()
        threads = usable_cpus()
        self.info = DeviceInfo(
            spec="host", kind="host", name=self._cpu, total_bytes=mem_total(),
            free_bytes=mem_available(), peak_gbps=None, natural_granule=64,
            max_threads=threads,
            details={"llc_reported_bytes": llc_reported_bytes(), "compiler_flags": compiler_flags()})
        self._init_memory(_free_host)

    # -- memory ---------------------------------------------------------------------------------
    def _threads_for_touch(self) -> int:
        return max(1, min(self.info.max_threads, self.measure_thread_limit))

    def free_bytes(self) -> int:
        return mem_available()

    def _alloc_raw(self, nbytes: int) -> int:
        ptr = self._ffi.new("void **")
        native.call("odma_host_alloc", nbytes, self._threads_for_touch(), ptr)
        addr = int(self._ffi.cast("uintptr_t", ptr[0]))
        self._live.add(addr, nbytes)
        return addr

    def _ptr(self, buf: Buffer, offset: int):
        return self._ffi.cast("char *", buf.handle + offset)

    def write(self, buf: Buffer, offset: int, data) -> None:
        view = self._bytes_view(data)
        self._check_live(buf, offset, view.nbytes)
        if view.nbytes:
            self._ffi.memmove(self._ptr(buf, offset), view, view.nbytes)

    def read(self, buf: Buffer, offset: int, nbytes: int) -> bytes:
        self._check_live(buf, offset, nbytes)
        if nbytes == 0:
            return b""
        return bytes(self._ffi.buffer(self._ptr(buf, offset), nbytes))

    def copy(self, dst: Buffer, dst_offset: int, src: Buffer, src_offset: int, nbytes: int) -> float:
        self._check_live(dst, dst_offset, nbytes)
        self._check_live(src, src_offset, nbytes)
        t0 = time.perf_counter()
        native.call("odma_copy", self._ptr(dst, dst_offset), self._ptr(src, src_offset), nbytes,
                    self._threads_for_touch())
        return time.perf_counter() - t0

    # -- measurement ----------------------------------------------------------------------------
    def default_buffer_bytes(self, pattern: str) -> int:
        """devices.md rule 1. Streaming read: max(4 x LLC, 1 GiB); copy: twice that, so each half
        is that large. The LLC term is capped at 4 GiB (a VM may report the host's cache), and the
        whole is capped at half the memory available now. Random: 1 GiB (more measures the TLB)."""
        if pattern == "rand":
            size = RAND_BUFFER_BYTES
        else:
            llc = self.info.details.get("llc_reported_bytes") or 0
            size = max(min(4 * llc, STREAM_CAP_BYTES), GIB)
            if pattern == "copy":
                size *= 2
        size = min(size, mem_available() // 2)
        return max(HUGE_PAGE, size // HUGE_PAGE * HUGE_PAGE)

    def measure(self, pattern: str, granule: int = 64, threads: int = 1, *,
                buffer_bytes: int | None = None, reps: int = 5, seed: int = 1,
                work_bytes: int | None = None) -> Measurement:
        """Sustained bandwidth of `pattern` with `threads` host threads on a fresh buffer that is
        freed before returning (also on error or KeyboardInterrupt). `granule` matters for 'rand'
        only but is validated for every pattern. `work_bytes`: useful bytes per repetition
        (default: one pass for read/copy, 256 MiB of granules for rand)."""
        buffer_bytes = self.check_measure(pattern, granule, threads, buffer_bytes=buffer_bytes,
                                          reps=reps, seed=seed, work_bytes=work_bytes)
        if work_bytes is None:
            work_bytes = RAND_WORK_BYTES if pattern == "rand" else 0

        loadavg = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        ffi = self._ffi
        ptr = ffi.new("void **")  # NULL until the shim allocates
        try:
            native.call("odma_host_alloc", buffer_bytes, threads, ptr)
            huge = ffi.new("size_t *")
            native.call("odma_host_huge_bytes", ptr[0], buffer_bytes, huge)
            out = ffi.new("odma_result *")
            native.call("odma_host_measure", ptr[0], buffer_bytes, native.PATTERN_CODES[pattern],
                        granule, threads, reps, work_bytes, seed, out)
        finally:  # also on KeyboardInterrupt: the buffer never outlives the call
            if ptr[0] != ffi.NULL:
                native.call("odma_host_free", ptr[0], buffer_bytes)

        huge_fraction = huge[0] / buffer_bytes
        extra = {
            "cpu_model": self._cpu,
            "huge_page_bytes": int(huge[0]),
            "huge_page_fraction": round(huge_fraction, 4),
            # what the buffer actually got (rule 5): mostly 2 MiB pages, mostly 4 KiB, or a mix
            "page_size": "2M" if huge_fraction >= 0.9 else "4K" if huge_fraction <= 0.1 else "mixed",
            "buffer_bytes": buffer_bytes,
            "threads": threads,
            "threads_oversubscribed": threads > self.info.max_threads,
            "reps": reps,
            "seed": seed,
            "work_bytes": work_bytes,
            "llc_reported_bytes": self.info.details.get("llc_reported_bytes"),
            "compiler_flags": self.info.details.get("compiler_flags"),
            "loadavg_1m": loadavg,
            "byte_convention": {"read": "bytes read", "copy": "read + write (2x copied)",
                                "rand": "granule x accesses"}[pattern],
        }
        if out.best_s <= 0:
            raise DeviceError(f"host {pattern} measurement returned a non-positive time")
        return Measurement(
            pattern=pattern, granule=granule, threads=threads, buffer_bytes=buffer_bytes,
            bytes=out.bytes, best_s=out.best_s, median_s=out.median_s, worst_s=out.worst_s,
            reps=out.reps, method=ffi.string(out.method).decode(), extra=extra)


def _free_host(addr: int, nbytes: int) -> None:
    ffi, _ = native.require()
    native.call("odma_host_free", ffi.cast("void *", addr), nbytes)


def discover():
    """(['host'], None) when the native shim is built, else ([], why not)."""
    if not native.available():
        return [], native.IMPORT_ERROR
    return ["host"], None


def open_device(arg: str = "") -> HostDevice:
    if arg:
        raise BadArgument(f"the host device takes no argument, got {arg!r}")
    return HostDevice()
