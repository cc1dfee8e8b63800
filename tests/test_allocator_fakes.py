"""Helpers for the allocator tests: the backend list the suite runs on, and a small in-memory
Device (bytearray-backed) whose copy can be made to fail. The fake is used only where a test must
inject a device failure or run thousands of hypothesis examples; every property that concerns
real memory also runs on the real backends."""

from __future__ import annotations

import random
import time

import pytest

from odma_cli.errors import BadArgument, DeviceError
from odma_hw import devices
from odma_hw.devices.base import Buffer, Device, DeviceInfo

from allocator import OutOfMemory

BACKENDS = ["host", "emu:lpddr5-6400", "torch:cpu"]


def backend_params():
    """host, emu:lpddr5-6400, torch:cpu, plus every cuda/mlu device discover() lists."""
    found = {s.backend: s for s in devices.discover()}
    specs = list(BACKENDS)
    for name in ("cuda", "mlu"):
        st = found.get(name)
        if st is not None:
            specs += [s for s in st.specs if s not in specs]
    return specs


def open_or_skip(spec: str):
    """Open `spec`, or skip with the reason its backend's discover() gives."""
    backend, _ = devices.parse_spec(spec)
    status = {s.backend: s for s in devices.discover()}[backend]
    if spec not in status.specs:
        pytest.skip(f"{spec} not available here: {status.reason or 'discover() does not list it'}")
    return devices.open(spec)


def pattern(seed: int, n: int) -> bytes:
    """n reproducible random bytes: what a test writes and reads back."""
    return random.Random(seed).randbytes(n)


def fill_grow_release(alloc, seed: int, grow_every: int, grows: int = 1) -> list:
    """Reserve random requests until the pool refuses one (60 at most), grow every grow_every-th
    past its capacity up to `grows` times (stopping at OutOfMemory), then release them all in a
    random order: the ids that were reserved."""
    rng = random.Random(seed)
    ids = []
    for i in range(60):
        try:
            alloc.reserve(i, rng.randint(0, 500), rng.uniform(0, 500), rng.random())
            ids.append(i)
        except OutOfMemory:
            break
    for i in ids[::grow_every]:
        for _ in range(rng.randint(1, grows) if grows > 1 else 1):
            try:
                alloc.grow(i, min(alloc.max_tokens, alloc.block(i).capacity_tokens + 1))
            except OutOfMemory:
                break
    rng.shuffle(ids)
    for i in ids:
        alloc.release(i)
    return ids


class MemoryDevice(Device):
    """Device memory that is a bytearray; `fail_copies = True` makes copy() raise DeviceError."""

    alignment = 64

    def __init__(self, total_bytes: int = 1 << 30):
        self.info = DeviceInfo("fake", "fake", "bytearray", total_bytes, total_bytes, None, 64, 1)
        self.fail_copies = False
        self.copies = 0

    def alloc(self, nbytes):
        if nbytes <= 0 or nbytes > self.info.total_bytes:
            raise BadArgument(f"cannot allocate {nbytes} B")
        return Buffer(self, bytearray(nbytes), nbytes)

    def free(self, buf):
        self._check_range(buf, 0, 0)
        buf.handle, buf.nbytes = None, 0

    def write(self, buf, offset, data):
        data = bytes(data)
        self._check_range(buf, offset, len(data))
        buf.handle[offset:offset + len(data)] = data

    def read(self, buf, offset, nbytes):
        self._check_range(buf, offset, nbytes)
        return bytes(buf.handle[offset:offset + nbytes])

    def copy(self, dst, dst_offset, src, src_offset, nbytes):
        self._check_range(dst, dst_offset, nbytes)
        self._check_range(src, src_offset, nbytes)
        if self.fail_copies:
            raise DeviceError("injected copy failure")
        t0 = time.perf_counter()
        dst.handle[dst_offset:dst_offset + nbytes] = src.handle[src_offset:src_offset + nbytes]
        self.copies += 1
        return time.perf_counter() - t0

    def measure(self, pattern, granule=64, threads=1, *, buffer_bytes=None, reps=5, seed=1):
        raise BadArgument("the fake device does not measure")
