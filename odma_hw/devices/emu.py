"""`emu:<preset>`: device memory emulated on the host, timed by the LPDDR5 engine.

Bytes are real: the device's whole address space is one anonymous, lazily backed mapping (pages
appear when first touched, so a 24 GB MLU370-X4 costs nothing until written). Buffers are address
ranges handed out first-fit. read/write/copy move bytes in that mapping; copy() and measure()
return the time the timing engine gives for the same traffic, not host time.
"""

from __future__ import annotations

import mmap
import threading

from odma_cli.errors import BadArgument, DeviceError
from odma_hw.devices.base import PATTERNS, Buffer, Device, DeviceInfo, Measurement
from odma_hw.emu import emulate
from odma_hw.emu.specs import PRESETS, device_spec

_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)

# Largest copy simulated in full; longer copies simulate this representative prefix (a
# streaming copy is stationary after a few row cycles) and scale the time by length.
COPY_SIM_BYTES = 4 << 20
# Bursts one measure() simulates per channel: enough for steady state (thousands of row cycles
# and several refresh intervals) and fast (~0.1 s per channel).
MEASURE_BURSTS_PER_CHANNEL = 1 << 16
# the traffic of one random-read measurement at most, as far as one request allows: 1,024
# positions of a 1 GiB run would be a terabyte to emulate, where a few long runs tell as much
MEASURE_MAX_BYTES = 256 << 20
COPY_TILE = 1024  # the streaming copier reads a tile, then writes it


def natural_granule(burst_bytes: int) -> int:
    """The granule an emulated memory is judged at: 64 B, or the channel's burst where that is
    larger. 64 B is the line the consumers of every one of these memories request (a CPU cache
    line, a GPU L2 fetch of two 32 B sectors, a DMA descriptor) and the granule of the host and
    MLU backends, so a preset and the real device it stands for are judged at the same granule;
    a 32 B burst (LPDDR5 BL16 x16, HBM2 BL4) is never requested alone."""
    return max(64, burst_bytes)


def discover():
    return ["emu:" + name for name in PRESETS], None


def open_device(arg: str) -> "EmuDevice":
    return EmuDevice(arg)


class EmuDevice(Device):
    alignment = 256

    def __init__(self, preset: str):
        self.preset = (preset or "").strip().lower()
        self.dev = device_spec(self.preset)  # BadArgument listing the presets
        ch = self.dev.channel
        total = self.dev.total_bytes
        try:
            self._mem = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                                  | _MAP_NORESERVE)
        except (OSError, ValueError) as exc:
            raise DeviceError(f"emu:{self.preset}: cannot map {total} bytes of backing "
                              f"memory: {exc}") from None
        self._lock = threading.Lock()
        self._free = [(0, total)]         # sorted, coalesced (start, size) ranges
        self._used: dict[int, int] = {}   # start -> size
        self.info = DeviceInfo(
            spec=f"emu:{self.preset}", kind="emu",
            name=f"{ch.name}" + (f" x {self.dev.channels} channels" if self.dev.channels > 1 else "")
            + " (emulated)",
            total_bytes=total, free_bytes=total, peak_gbps=self.dev.peak_gbps,
            natural_granule=natural_granule(ch.burst_bytes), max_threads=1,
            details={"preset": self.preset, "channels": self.dev.channels,
                     "interleave_bytes": self.dev.interleave_bytes,
                     "burst_bytes": ch.burst_bytes, "standard": ch.standard,
                     "source": ch.source,
                     "timing": "odma_hw.emu engine (FR-FCFS, 32-burst queues)"})

    # -- memory ---------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> Buffer:
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise BadArgument(f"allocation size must be a positive integer, not {nbytes!r}")
        size = -(-nbytes // self.alignment) * self.alignment
        with self._lock:
            for i, (start, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (start + size, free - size)
                    self._used[start] = size
                    self.info.free_bytes -= size
                    return Buffer(self, start, nbytes)
        raise BadArgument(f"cannot allocate {nbytes} bytes on {self.spec}: "
                          f"{self.info.free_bytes} bytes free (largest range smaller)")

    def free(self, buf: Buffer) -> None:
        if buf.device is not self:
            raise BadArgument(f"buffer belongs to {buf.device.spec}, not {self.spec}")
        with self._lock:
            size = self._used.pop(buf.handle, None) if buf.nbytes else None
            if size is None:
                raise BadArgument("buffer was already freed")
            buf.nbytes = 0
            self.info.free_bytes += size
            self._free.append((buf.handle, size))
            self._free.sort()
            merged = []
            for s, n in self._free:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((s, n))
            self._free = merged
            # give the pages back to the host
            try:
                self._mem.madvise(mmap.MADV_DONTNEED, buf.handle - buf.handle % mmap.PAGESIZE,
                                  -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
            except (AttributeError, OSError, ValueError):
                pass

    def write(self, buf: Buffer, offset: int, data) -> None:
        mv = memoryview(data).cast("B")
        self._check_range(buf, offset, mv.nbytes)
        a = buf.handle + offset
        self._mem[a:a + mv.nbytes] = mv

    def read(self, buf: Buffer, offset: int, nbytes: int) -> bytes:
        self._check_range(buf, offset, nbytes)
        a = buf.handle + offset
        return self._mem[a:a + nbytes]

    def copy(self, dst: Buffer, dst_offset: int, src: Buffer, src_offset: int, nbytes: int) -> float:
        self._check_range(dst, dst_offset, nbytes)
        self._check_range(src, src_offset, nbytes)
        if nbytes == 0:
            return 0.0
        self._mem.move(dst.handle + dst_offset, src.handle + src_offset, nbytes)
        return self.copy_seconds(src.handle + src_offset, dst.handle + dst_offset, nbytes)

    def copy_seconds(self, src_addr: int, dst_addr: int, nbytes: int) -> float:
        """Engine time of a streaming copy: tiles of COPY_TILE bytes read (natural-granule requests) then
        written. Copies longer than COPY_SIM_BYTES simulate a prefix and scale linearly."""
        import numpy as np

        from odma_hw.emu.traces import Trace

        g = natural_granule(self.dev.channel.burst_bytes)
        sim = min(nbytes, COPY_SIM_BYTES)
        sim = max(g, sim // g * g)
        offs = np.arange(0, sim, g, dtype=np.int64)
        # each tile of COPY_TILE bytes is read, then written: sort reads and writes by tile
        tile = (offs // COPY_TILE) * 2
        order = np.argsort(np.concatenate([tile, tile + 1]), kind="stable")
        addr = np.concatenate([src_addr // g * g + offs, dst_addr // g * g + offs])[order]
        write = np.repeat(np.array([0, 1], np.uint8), offs.size)[order]
        addr = np.minimum(addr, self.dev.total_bytes - g)
        tr = Trace(addr, np.full(addr.size, g, np.int64), write)
        s = emulate(self.preset, trace=tr, granularity=g)
        return s.simulated_ns * 1e-9 * (nbytes / sim)

    # -- bandwidth ------------------------------------------------------------------------------
    def default_buffer_bytes(self, pattern: str) -> int:
        return min(1 << 30, self.dev.total_bytes)

    def measure(self, pattern: str, granule: int = 64, threads: int = 1, *,
                buffer_bytes: int | None = None, reps: int = 5, seed: int = 1) -> Measurement:
        """Modelled sustained bandwidth. The engine is deterministic for a given trace, so one
        simulation stands for every repetition (reps is reported as 1). Concurrency is the
        controller's queues (32 bursts per direction), not host threads. A granule below the
        burst still moves a whole burst per request: the bytes counted are the granule's."""
        if pattern not in PATTERNS:
            raise BadArgument(f"unknown pattern {pattern!r}: expected one of {', '.join(PATTERNS)}")
        burst = self.dev.channel.burst_bytes
        if (not isinstance(granule, int) or granule <= 0
                or (granule % burst if granule >= burst else burst % granule)):
            raise BadArgument(f"granularity {granule} is neither a multiple nor a divisor of the "
                              f"{burst}-byte burst of {self.spec}")
        moved = max(granule, burst)
        fp = self.default_buffer_bytes(pattern) if buffer_bytes is None else int(buffer_bytes)
        if fp < granule or fp > self.dev.total_bytes:
            raise BadArgument(f"buffer of {fp} bytes does not fit {self.spec} "
                              f"({self.dev.total_bytes} bytes) or is below the granule")
        bursts = MEASURE_BURSTS_PER_CHANNEL * min(self.dev.channels, 8)
        n = max(1024, bursts // (moved // burst))
        n = max(1, min(n, MEASURE_MAX_BYTES // moved))
        if pattern == "copy":
            half = fp // 2 // 4096 * 4096 or granule
            nbytes = min(half, n * granule // 2)
            secs = self.copy_seconds(0, half, nbytes)
            useful, extra = 2 * nbytes, {"copied_bytes": nbytes}
        else:
            s = emulate(self.preset, "seq" if pattern == "read" else "rand", moved, n,
                        footprint=fp, seed=seed)
            secs, useful = s.simulated_ns * 1e-9, s.requests * granule
            extra = {"efficiency": s.efficiency, "row_hit_rate": s.row_hit_rate,
                     "requests": s.requests, "wall_seconds": s.wall_seconds}
        return Measurement(pattern=pattern, granule=granule, threads=1, buffer_bytes=fp,
                           bytes=float(useful), best_s=secs, median_s=secs, worst_s=secs, reps=1,
                           method="emulated: odma_hw.emu timing engine", extra=extra)

    def close(self) -> None:
        mem, self._mem = getattr(self, "_mem", None), None
        if mem is not None:
            try:
                mem.close()
            except (BufferError, ValueError):
                pass
