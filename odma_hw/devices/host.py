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
import threading
import time
import weakref

from odma_hw import native
from odma_hw.devices.base import PATTERNS, Buffer, Device, DeviceInfo, Measurement
from odma_hw.errors import BadArgument, DeviceError

_PATTERN_CODES = {"read": 0, "copy": 1, "rand": 2}
MAX_THREADS = 256            # the shim's limit
MIN_GRANULE = 8
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


# ----------------------------------------------------------------------------- live buffers

class _LiveBuffers:
    """Address -> size of every buffer not yet returned to the OS. Shared by the device and the
    finalizers (it must not reference either), so each address is freed exactly once."""

    def __init__(self):
        self.sizes: dict[int, int] = {}
        self.lock = threading.Lock()

    def add(self, addr: int, nbytes: int) -> None:
        with self.lock:
            self.sizes[addr] = nbytes

    def release(self, addr: int) -> bool:
        """Free `addr` if it is live; False if it was not (already freed)."""
        with self.lock:
            nbytes = self.sizes.pop(addr, None)
        if nbytes is None:
            return False
        ffi, _ = native.require()
        native.call("odma_host_free", ffi.cast("void *", addr), nbytes)
        return True

    def release_all(self) -> None:
        with self.lock:
            addrs = list(self.sizes)
        for addr in addrs:
            try:
                self.release(addr)
            except Exception:  # noqa: BLE001 - finalizers must not raise; nothing else to do
                pass


def _release_quietly(live: _LiveBuffers, addr: int) -> None:
    try:
        live.release(addr)
    except Exception:  # noqa: BLE001 - called from a finalizer
        pass


# ----------------------------------------------------------------------------- the device

def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class HostDevice(Device):
    """Host DRAM. Buffers are 2 MiB aligned (the advertised `alignment` is the 64-byte line);
    copies use the multi-threaded streaming copier; measure() allocates its own buffer."""

    alignment = 64

    def __init__(self):
        ffi, lib = native.require()
        self._ffi, self._lib = ffi, lib
        self._live = _LiveBuffers()
        self._finalizers: dict[int, weakref.finalize] = {}
        self._closed = False
        self._cpu = cpu_model()
        threads = os.cpu_count() or 1
        self.info = DeviceInfo(
            spec="host", kind="host", name=self._cpu, total_bytes=mem_total(),
            free_bytes=mem_available(), peak_gbps=None, natural_granule=64,
            max_threads=threads,
            details={"llc_reported_bytes": llc_reported_bytes(), "compiler_flags": compiler_flags()})
        self._device_finalizer = weakref.finalize(self, _LiveBuffers.release_all, self._live)

    # -- memory ---------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise BadArgument("the host device is closed")

    def _threads_for_touch(self) -> int:
        return max(1, min(self.info.max_threads, MAX_THREADS))

    def alloc(self, nbytes: int) -> Buffer:
        self._check_open()
        if not _is_int(nbytes) or nbytes <= 0:
            raise BadArgument(f"buffer size must be a positive integer, got {nbytes!r}")
        available = mem_available()
        if nbytes > available:
            raise BadArgument(f"{nbytes} bytes requested but only {available} bytes are available")
        ptr = self._ffi.new("void **")
        native.call("odma_host_alloc", nbytes, self._threads_for_touch(), ptr)
        addr = int(self._ffi.cast("uintptr_t", ptr[0]))
        self._live.add(addr, nbytes)
        buf = Buffer(self, addr, nbytes)
        # a buffer dropped without free() goes back to the OS when it is collected
        if len(self._finalizers) > 2 * len(self._live.sizes) + 64:  # forget those that ran
            self._finalizers = {a: f for a, f in self._finalizers.items() if f.alive}
        self._finalizers[addr] = weakref.finalize(buf, _release_quietly, self._live, addr)
        return buf

    def free(self, buf: Buffer) -> None:
        if not isinstance(buf, Buffer) or buf.device is not self:
            raise BadArgument("not a buffer of this host device")
        if buf.nbytes == 0 or buf.handle not in self._live.sizes:
            raise BadArgument("buffer was already freed")
        fin = self._finalizers.pop(buf.handle, None)
        if fin is not None:
            fin.detach()
        if not self._live.release(buf.handle):
            raise BadArgument("buffer was already freed")
        buf.nbytes = 0

    def _ptr(self, buf: Buffer, offset: int):
        return self._ffi.cast("char *", buf.handle + offset)

    def _check_live(self, buf: Buffer, offset, nbytes) -> None:
        if not isinstance(buf, Buffer):
            raise BadArgument(f"expected a Buffer, got {type(buf).__name__}")
        if not _is_int(offset) or not _is_int(nbytes):
            raise BadArgument("offset and size must be integers")
        self._check_range(buf, offset, nbytes)
        if buf.handle not in self._live.sizes:  # freed through close()
            raise BadArgument("buffer was already freed")

    def write(self, buf: Buffer, offset: int, data) -> None:
        try:
            view = memoryview(data).cast("B")
        except TypeError:
            raise BadArgument(f"data must be bytes-like and contiguous, got {type(data).__name__}") from None
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
        self._check_open()
        if pattern not in PATTERNS:
            raise BadArgument(f"unknown pattern {pattern!r}: expected one of {', '.join(PATTERNS)}")
        if not _is_int(threads) or not 1 <= threads <= MAX_THREADS:
            raise BadArgument(f"threads must be an integer in [1, {MAX_THREADS}], got {threads!r}")
        if not _is_int(reps) or reps < 1:
            raise BadArgument(f"reps must be a positive integer, got {reps!r}")
        if not _is_int(seed) or not 0 <= seed < 1 << 64:
            raise BadArgument(f"seed must be an integer in [0, 2**64), got {seed!r}")
        if buffer_bytes is None:
            buffer_bytes = self.default_buffer_bytes(pattern)
        elif not _is_int(buffer_bytes) or buffer_bytes <= 0:
            raise BadArgument(f"buffer size must be a positive integer, got {buffer_bytes!r}")
        available = mem_available()
        if buffer_bytes > available:
            raise BadArgument(
                f"a {buffer_bytes}-byte buffer is larger than the {available} bytes available")
        if not _is_int(granule) or granule < MIN_GRANULE or granule & (granule - 1) \
                or granule > buffer_bytes:
            raise BadArgument(f"granularity must be a power of two in [{MIN_GRANULE}, "
                              f"{buffer_bytes}] (the buffer), got {granule!r}")
        if work_bytes is None:
            work_bytes = RAND_WORK_BYTES if pattern == "rand" else 0
        elif not _is_int(work_bytes) or work_bytes < 0:
            raise BadArgument(f"work_bytes must be a non-negative integer, got {work_bytes!r}")

        loadavg = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        ffi = self._ffi
        ptr = ffi.new("void **")  # NULL until the shim allocates
        try:
            native.call("odma_host_alloc", buffer_bytes, threads, ptr)
            huge = ffi.new("size_t *")
            native.call("odma_host_huge_bytes", ptr[0], buffer_bytes, huge)
            out = ffi.new("odma_result *")
            native.call("odma_host_measure", ptr[0], buffer_bytes, _PATTERN_CODES[pattern],
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

    def close(self) -> None:
        """Free every live buffer (idempotent); the device cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        for fin in self._finalizers.values():
            fin.detach()
        self._finalizers.clear()
        self._live.release_all()
        self._device_finalizer.detach()


def discover():
    """(['host'], None) when the native shim is built, else ([], why not)."""
    if not native.available():
        return [], native.IMPORT_ERROR
    return ["host"], None


def open_device(arg: str = "") -> HostDevice:
    if arg:
        raise BadArgument(f"the host device takes no argument, got {arg!r}")
    return HostDevice()
