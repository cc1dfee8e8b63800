"""What host, CUDA and MLU devices share: their memory is handed out by the native shim as
addresses, so each keeps a table of live buffers, checks every argument the same way, and frees
memory on free(), on close(), or when a buffer or the device is garbage-collected, whichever comes
first, and never twice."""

from __future__ import annotations

import abc
import threading
import weakref
from typing import Callable

from odma_cli.errors import BadArgument
from odma_hw import native
from odma_hw.devices.base import PATTERNS, Buffer, Device, is_int


class LiveBuffers:
    """Address -> size of every buffer not yet freed. Shared by the device and the finalizers, so
    it must not reference either: `free_fn(addr, nbytes)` is a plain function of the backend."""

    def __init__(self, free_fn: Callable[[int, int], None]):
        self.free_fn = free_fn
        self.sizes: dict[int, int] = {}
        self.lock = threading.Lock()

    def add(self, addr: int, nbytes: int) -> None:
        with self.lock:
            self.sizes[addr] = nbytes

    def live(self, addr: int) -> bool:
        with self.lock:
            return addr in self.sizes

    def release(self, addr: int) -> bool:
        """Free `addr` if it is live; False if it was not (already freed)."""
        with self.lock:
            nbytes = self.sizes.pop(addr, None)
        if nbytes is None:
            return False
        self.free_fn(addr, nbytes)
        return True

    def release_quietly(self, addr: int) -> None:
        try:
            self.release(addr)
        except Exception:  # noqa: BLE001 - runs from finalizers, which must not raise
            pass

    def release_all(self) -> None:
        with self.lock:
            addrs = list(self.sizes)
        for addr in addrs:
            self.release_quietly(addr)


class NativeMemoryDevice(Device):
    """A Device whose buffers are shim addresses. Subclasses call _init_memory(free_fn) in
    __init__ and provide _alloc_raw(nbytes) -> addr (which must add it to self._live) and
    free_bytes() (None when unknown)."""

    #: the most `threads` measure() accepts (host: the shim's limit; devices ignore the value)
    measure_thread_limit: int = 1 << 16

    def _init_memory(self, free_fn: Callable[[int, int], None]) -> None:
        self._closed = False
        self._live = LiveBuffers(free_fn)
        self._finalizers: dict[int, weakref.finalize] = {}
        self._device_finalizer = weakref.finalize(self, LiveBuffers.release_all, self._live)

    @abc.abstractmethod
    def _alloc_raw(self, nbytes: int) -> int:
        """Allocate through the shim, record the address in self._live, return it."""

    @abc.abstractmethod
    def free_bytes(self) -> int | None:
        """Memory free on the device now, None when the runtime cannot tell."""

    # -- checks ---------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise BadArgument(f"{self.spec} is closed")

    def _check_live(self, buf: Buffer, offset, nbytes) -> None:
        self._check_open()
        if not isinstance(buf, Buffer):
            raise BadArgument(f"expected a Buffer, got {type(buf).__name__}")
        if not is_int(offset) or not is_int(nbytes):
            raise BadArgument("offset and size must be integers")
        self._check_range(buf, offset, nbytes)
        if not self._live.live(buf.handle):  # freed through close()
            raise BadArgument("buffer was already freed")

    @staticmethod
    def _bytes_view(data) -> memoryview:
        try:
            return memoryview(data).cast("B")
        except TypeError:
            raise BadArgument(
                f"data must be bytes-like and contiguous, got {type(data).__name__}") from None

    def _check_size_fits(self, nbytes: int, what: str) -> None:
        free = self.free_bytes()
        if free is not None and nbytes > free:
            raise BadArgument(f"{what} of {nbytes} bytes is larger than the {free} bytes available "
                              f"on {self.spec}")

    def check_measure(self, pattern: str, granule: int = 64, threads: int = 1, *,
                      buffer_bytes: int | None = None, reps: int = 5, seed: int = 1,
                      work_bytes: int | None = None) -> int:
        """measure()'s checks, the same on every native device, against the shim's own limits
        (ODMA_MAX_REPS, ODMA_MIN_GRANULE); returns the buffer size measure() uses."""
        _, lib = native.require()
        self._check_open()
        if pattern not in PATTERNS:
            raise BadArgument(f"unknown pattern {pattern!r}: expected one of {', '.join(PATTERNS)}")
        limit = self.measure_thread_limit
        if not is_int(threads) or not 1 <= threads <= limit:
            raise BadArgument(f"threads must be an integer in [1, {limit}], got {threads!r}")
        if not is_int(reps) or not 1 <= reps <= lib.ODMA_MAX_REPS:
            raise BadArgument(f"reps must be an integer in [1, {lib.ODMA_MAX_REPS}], got {reps!r}")
        if not is_int(seed) or not 0 <= seed < 1 << 64:
            raise BadArgument(f"seed must be an integer in [0, 2**64), got {seed!r}")
        if buffer_bytes is None:
            buffer_bytes = self.default_buffer_bytes(pattern)
        elif not is_int(buffer_bytes) or buffer_bytes < 64:
            raise BadArgument(f"buffer size must be an integer >= 64, got {buffer_bytes!r}")
        self._check_size_fits(buffer_bytes, "a measurement buffer")
        if not is_int(granule) or granule < lib.ODMA_MIN_GRANULE or granule & (granule - 1) \
                or granule > buffer_bytes:
            raise BadArgument(f"granularity must be a power of two in [{lib.ODMA_MIN_GRANULE}, "
                              f"{buffer_bytes}] (the buffer), got {granule!r}")
        if work_bytes is not None and (not is_int(work_bytes) or work_bytes < 0):
            raise BadArgument(f"work_bytes must be a non-negative integer, got {work_bytes!r}")
        return buffer_bytes

    # -- memory ---------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> Buffer:
        self._check_open()
        if not is_int(nbytes) or nbytes <= 0:
            raise BadArgument(f"buffer size must be a positive integer, got {nbytes!r}")
        self._check_size_fits(nbytes, "a buffer")
        addr = self._alloc_raw(nbytes)
        buf = Buffer(self, addr, nbytes)
        if len(self._finalizers) > 2 * len(self._live.sizes) + 64:  # forget those that ran
            self._finalizers = {a: f for a, f in self._finalizers.items() if f.alive}
        # a buffer dropped without free() goes back to the device when it is collected
        self._finalizers[addr] = weakref.finalize(buf, self._live.release_quietly, addr)
        return buf

    def free(self, buf: Buffer) -> None:
        if not isinstance(buf, Buffer) or buf.device is not self:
            raise BadArgument(f"not a buffer of {self.spec}")
        if buf.nbytes == 0 or not self._live.live(buf.handle):
            raise BadArgument("buffer was already freed")
        fin = self._finalizers.pop(buf.handle, None)
        if fin is not None:
            fin.detach()
        if not self._live.release(buf.handle):
            raise BadArgument("buffer was already freed")
        buf.nbytes = 0

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
