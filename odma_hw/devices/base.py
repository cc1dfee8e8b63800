"""The one Device interface every backend implements and the allocator uses.

A Device hands out Buffers (device memory regions), moves real bytes in and out of them, copies
between them on the device, and measures sustained bandwidth for an access pattern. Nothing above
this layer knows which backend it talks to.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

from odma_cli.errors import BadArgument

PATTERNS = ("read", "copy", "rand")
# smallest random-access granule any backend measures (the native shim's ODMA_MIN_GRANULE)
MIN_GRANULE = 8


def is_int(x) -> bool:
    """An int that is not a bool (True is not a size)."""
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass
class Buffer:
    """A region of device memory. `handle` is backend-specific (host address, CUdeviceptr,
    torch tensor, emulated address); `nbytes` is its size. Freed buffers have nbytes == 0."""

    device: "Device"
    handle: Any
    nbytes: int


@dataclasses.dataclass
class Measurement:
    """One bandwidth measurement: `bytes` useful bytes per repetition (a copy counts read + write,
    random access counts granule x accesses), best/median seconds over `reps` timed repetitions."""

    pattern: str
    granule: int
    threads: int
    buffer_bytes: int
    bytes: float
    best_s: float
    median_s: float
    worst_s: float
    reps: int
    method: str
    extra: dict = dataclasses.field(default_factory=dict)

    @property
    def gbps(self) -> float:
        """Best-repetition bandwidth in GB/s (1e9 B/s)."""
        return self.bytes / self.best_s / 1e9

    @property
    def median_gbps(self) -> float:
        return self.bytes / self.median_s / 1e9

    @property
    def spread(self) -> float:
        """(worst - best) / best: how much the repetitions disagree."""
        return (self.worst_s - self.best_s) / self.best_s


@dataclasses.dataclass
class DeviceInfo:
    spec: str
    kind: str               # host | cuda | mlu | torch | emu
    name: str
    total_bytes: int
    free_bytes: int
    peak_gbps: float | None  # None when the backend cannot know it (host DRAM inside a VM)
    natural_granule: int     # the granule the RACM verdict is taken at (64 host/MLU, 32 CUDA)
    max_threads: int         # host CPUs a measurement can use (1 for devices, which use their own
                             # parallelism)
    details: dict = dataclasses.field(default_factory=dict)


class Device(abc.ABC):
    """Device memory with real bytes and a bandwidth probe."""

    info: DeviceInfo
    #: byte alignment of every buffer and the natural alignment of copies
    alignment: int = 64

    @property
    def spec(self) -> str:
        return self.info.spec

    @abc.abstractmethod
    def alloc(self, nbytes: int) -> Buffer:
        """Allocate `nbytes` of device memory (raises BadArgument for nbytes <= 0 or larger than
        free memory, DeviceError if the device refuses)."""

    @abc.abstractmethod
    def free(self, buf: Buffer) -> None:
        """Free a buffer; freeing twice is a BadArgument."""

    @abc.abstractmethod
    def write(self, buf: Buffer, offset: int, data) -> None:
        """Copy bytes-like `data` from the host into `buf` at `offset`."""

    @abc.abstractmethod
    def read(self, buf: Buffer, offset: int, nbytes: int) -> bytes:
        """Copy `nbytes` at `offset` of `buf` back to the host."""

    @abc.abstractmethod
    def copy(self, dst: Buffer, dst_offset: int, src: Buffer, src_offset: int, nbytes: int) -> float:
        """Copy on the device (streaming). Returns the seconds it took: measured on real
        devices, modelled by the timing engine on emulated ones."""

    @abc.abstractmethod
    def measure(self, pattern: str, granule: int = 64, threads: int = 1, *,
                buffer_bytes: int | None = None, reps: int = 5, seed: int = 1) -> Measurement:
        """Sustained bandwidth of `pattern` ('read', 'copy', 'rand') at `granule` bytes."""

    def default_buffer_bytes(self, pattern: str) -> int:
        """Working-set size per devices.md rule 1; backends override."""
        return 1 << 30

    def check_measure(self, pattern: str, granule: int = 64, threads: int = 1, *,
                      buffer_bytes: int | None = None, reps: int = 5) -> int:
        """Raise BadArgument, before anything is allocated or timed, for what measure() would
        refuse with these arguments; return the buffer size measure() would use. This default
        checks what every backend shares (a known pattern, a power-of-two granule >= 8 bytes that
        fits the buffer, threads and reps >= 1, a buffer no larger than the device's memory);
        backends with rules of their own override it and call it from measure()."""
        if pattern not in PATTERNS:
            raise BadArgument(f"unknown pattern {pattern!r}: expected one of {', '.join(PATTERNS)}")
        if not is_int(threads) or threads < 1:
            raise BadArgument(f"threads must be a positive integer, got {threads!r}")
        if not is_int(reps) or reps < 1:
            raise BadArgument(f"reps must be a positive integer, got {reps!r}")
        size = self.default_buffer_bytes(pattern) if buffer_bytes is None else buffer_bytes
        if not is_int(size) or size <= 0:
            raise BadArgument(f"buffer size must be a positive integer, got {size!r}")
        memory = self.info.free_bytes or self.info.total_bytes
        if memory and size > memory:
            raise BadArgument(f"a measurement buffer of {size} bytes is larger than the {memory} "
                              f"bytes free on {self.spec}")
        if not is_int(granule) or granule < MIN_GRANULE or granule & (granule - 1) or granule > size:
            raise BadArgument(f"granularity must be a power of two in [{MIN_GRANULE}, {size}] "
                              f"(the buffer), got {granule!r}")
        return size

    def close(self) -> None:
        """Release whatever the device holds (idempotent)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # shared argument checks, so every backend rejects the same things the same way
    def _check_range(self, buf: Buffer, offset: int, nbytes: int) -> None:
        if buf.device is not self:
            raise BadArgument(f"buffer belongs to {buf.device.spec}, not {self.spec}")
        if buf.nbytes == 0:
            raise BadArgument("buffer was already freed")
        if offset < 0 or nbytes < 0 or offset + nbytes > buf.nbytes:
            raise BadArgument(
                f"range [{offset}, {offset + nbytes}) is outside the {buf.nbytes}-byte buffer")
