"""Migration copier: moves a request's KV bytes from its old block to its new one.

One contiguous source, one contiguous destination: a single streaming Device.copy (the native
multi-threaded non-temporal copier on host, a device-to-device copy on CUDA/MLU/torch, the timing
engine's modelled time on the emulated device). Optionally in chunks, so a very large migration
can be observed (and interleaved with other work) chunk by chunk.
"""

from __future__ import annotations

from odma_hw.devices.base import Buffer, Device


class StreamingCopier:
    """Copies [src_off, src_off + n) of one buffer to [dst_off, ...) of another (or the same) via
    Device.copy. Keeps running totals of bytes and device seconds (measured or modelled)."""

    def __init__(self, device: Device, chunk_bytes: int | None = None):
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.bytes_copied = 0
        self.seconds = 0.0
        self.copies = 0

    def copy(self, dst: Buffer, dst_off: int, src: Buffer, src_off: int, nbytes: int) -> float:
        """Seconds the device took. Raises what Device.copy raises; bytes already copied stay
        copied (the caller discards the destination on failure)."""
        step = self.chunk_bytes or nbytes
        seconds = 0.0
        done = 0
        while done < nbytes:
            n = min(step, nbytes - done)
            seconds += self.device.copy(dst, dst_off + done, src, src_off + done, n)
            done += n
        self.bytes_copied += nbytes
        self.seconds += seconds
        self.copies += 1
        return seconds

    @property
    def gbps(self) -> float:
        """Mean copy bandwidth so far in GB/s (bytes copied / device seconds; 0 before any)."""
        return self.bytes_copied / self.seconds / 1e9 if self.seconds else 0.0


MigrationCopier = StreamingCopier  # the name the issue uses
