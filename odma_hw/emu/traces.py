"""Request traces: (byte address, size, is-write) arrays, generated or read from the user.

Generators model the traffic the allocator question is about: sequential streams, uniformly
random G-byte accesses, strides, mixed reads/writes, a paged-KV gather (fixed-size blocks at random
places, each read in order) and a contiguous KV scan (per-request regions read end to end).
"""

from __future__ import annotations

import dataclasses
import os
import stat

import numpy as np

from odma_cli.errors import BadArgument
from odma_cli.paths import refuse_device

PATTERNS = ("seq", "rand", "strided", "mixed", "paged", "kvscan")


@dataclasses.dataclass
class Trace:
    """Requests in issue order. addr/size int64 bytes, write uint8 (1 = write)."""

    addr: np.ndarray
    size: np.ndarray
    write: np.ndarray

    def __len__(self) -> int:
        return int(self.addr.shape[0])

    @property
    def bytes(self) -> int:
        return int(self.size.sum())


def check_shape(n: int, granule: int, footprint: int, burst: int) -> None:
    """Refuse a request count, granule or footprint that generate() cannot use."""
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise BadArgument(f"request count must be a positive integer, not {n!r}")
    if not isinstance(granule, (int, np.integer)) or granule < burst or granule % burst:
        raise BadArgument(f"granularity {granule} is not a multiple of the {burst}-byte burst")
    if footprint < granule:
        raise BadArgument(f"footprint {footprint} is smaller than the {granule}-byte granule")


def _writes(n: int, write_ratio: float, rng) -> np.ndarray:
    if not 0.0 <= write_ratio <= 1.0:
        raise BadArgument(f"write ratio must be in [0, 1], not {write_ratio}")
    if write_ratio == 0.0:
        return np.zeros(n, np.uint8)
    if write_ratio == 1.0:
        return np.ones(n, np.uint8)
    return (rng.random(n) < write_ratio).astype(np.uint8)


def default_write_ratio(pattern: str, write_ratio: float | None) -> float:
    """The share of writes a generated trace of `pattern` has: write_ratio where given (0
    included), else half for "mixed" (read-write traffic is what it is for) and none for the
    others."""
    if write_ratio is not None:
        return write_ratio
    return 0.5 if pattern == "mixed" else 0.0


def generate(pattern: str, n: int, granule: int, *, footprint: int, burst: int,
             write_ratio: float | None = None, seed: int = 1, stride: int | None = None,
             block_bytes: int = 16384, region_bytes: tuple[int, int] = (64 << 10, 1 << 20),
             start: int = 0) -> Trace:
    """One of PATTERNS, `n` requests of `granule` bytes within [start, start + footprint), a
    share write_ratio of them writes (None: default_write_ratio)."""
    if pattern not in PATTERNS:
        raise BadArgument(f"unknown pattern {pattern!r}: expected one of {', '.join(PATTERNS)}")
    check_shape(n, granule, footprint, burst)
    rng = np.random.default_rng(seed)
    slots = footprint // granule
    i = np.arange(n, dtype=np.int64)
    if pattern in ("seq", "mixed"):
        addr = (i % slots) * granule
    elif pattern == "rand":
        addr = rng.integers(0, slots, n, dtype=np.int64) * granule
    elif pattern == "strided":
        stride = granule * 2 if stride is None else stride
        if stride < granule or stride % burst:
            raise BadArgument(f"stride {stride} must be a multiple of the {burst}-byte burst "
                              f"and at least the granule")
        addr = ((i * stride) % (slots * granule)) // granule * granule
    elif pattern == "paged":
        if block_bytes < granule or block_bytes % granule:
            raise BadArgument(f"block size {block_bytes} must be a multiple of the granule")
        per = block_bytes // granule
        nblocks = max(1, footprint // block_bytes)
        starts = rng.integers(0, nblocks, n // per + 1, dtype=np.int64) * block_bytes
        addr = starts[i // per] + (i % per) * granule
    else:  # kvscan: contiguous per-request regions, each read start to end
        lo, hi = (max(granule, r // granule * granule) for r in region_bytes)
        lengths, total = [], 0
        while total < n:
            k = int(rng.integers(lo // granule, hi // granule + 1))
            lengths.append(k)
            total += k
        lengths = np.array(lengths, np.int64)
        span = min(footprint, max(hi, granule))
        starts = rng.integers(0, max(1, (footprint - span) // 4096 + 1), lengths.size,
                              dtype=np.int64) * 4096
        owner = np.repeat(np.arange(lengths.size), lengths)[:n]
        first = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        addr = starts[owner] + (i - first[owner]) * granule
    write_ratio = default_write_ratio(pattern, write_ratio)
    addr = addr.astype(np.int64) + start
    return Trace(addr, np.full(n, granule, np.int64), _writes(n, write_ratio, rng))


def from_arrays(addr, write=None, size=None, *, granule: int, burst: int, device_bytes: int,
                name: str = "trace") -> Trace:
    """A user trace given as arrays (addresses in bytes; write flags; sizes default `granule`)."""
    addr = np.asarray(addr, dtype=np.int64).reshape(-1)
    n = addr.shape[0]
    if n == 0:
        raise BadArgument(f"{name} has no requests")
    size = np.full(n, granule, np.int64) if size is None else np.asarray(size, np.int64).reshape(-1)
    write = np.zeros(n, np.uint8) if write is None else np.asarray(write).astype(np.uint8).reshape(-1)
    if size.shape[0] != n or write.shape[0] != n:
        raise BadArgument(f"{name}: address, size and write arrays differ in length")
    bad = np.flatnonzero((addr < 0) | (addr % burst != 0) | (size < burst) | (size % burst != 0)
                         | (addr + size > device_bytes))
    if bad.size:
        k = int(bad[0])
        raise BadArgument(f"{name} request {k}: {_why(int(addr[k]), int(size[k]), burst, device_bytes)}")
    return Trace(addr, size, write)


def _why(a: int, s: int, burst: int, device_bytes: int) -> str:
    if a < 0:
        return f"address {a:#x} is negative"
    if a + s > device_bytes:
        return f"address {a:#x} + {s} is beyond the {device_bytes}-byte device"
    if a % burst:
        return f"address {a:#x} is not aligned to the {burst}-byte burst"
    if s <= 0:
        return f"size {s} must be a positive multiple of the {burst}-byte burst"
    return f"size {s} is not a multiple of the {burst}-byte burst"


def read_trace_file(path: str, *, granule: int, burst: int, device_bytes: int) -> Trace:
    """A text trace: one request per line, `ADDRESS R|W [SIZE]` (address decimal or 0x-hex,
    size in bytes, default the granularity). Blank lines and `#` comments are skipped. Errors name
    the file and line."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise BadArgument(f"trace file {path!r} does not exist") from None
    except OSError as exc:
        raise BadArgument(f"cannot read trace file {path!r}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        raise BadArgument(f"trace file {path!r} is a directory")
    addrs, writes, sizes = [], [], []
    try:
        # utf-8-sig: a byte-order mark before the first address is read past, as the CSV
        # reader does
        f = open(path, "r", encoding="utf-8-sig", errors="replace")
    except OSError as exc:
        raise BadArgument(f"cannot read trace file {path!r}: {exc.strerror or exc}") from None
    with f:
        refuse_device(f, f"trace file {path!r}", "a trace file")
        for lineno, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            parts = text.split()
            where = f"{path} line {lineno}"
            if len(parts) not in (2, 3):
                raise BadArgument(f"{where}: expected 'ADDRESS R|W [SIZE]', got {text!r:.80}")
            try:
                a = int(parts[0], 0)
            except ValueError:
                raise BadArgument(f"{where}: bad address {parts[0]!r:.80}") from None
            op = parts[1].upper()
            if op not in ("R", "W"):
                raise BadArgument(f"{where}: operation must be R or W, not {parts[1]!r:.80}")
            s = granule
            if len(parts) == 3:
                try:
                    s = int(parts[2], 0)
                except ValueError:
                    raise BadArgument(f"{where}: bad size {parts[2]!r:.80}") from None
            if a < 0 or a % burst or s < burst or s % burst or a + s > device_bytes:
                raise BadArgument(f"{where}: {_why(a, s, burst, device_bytes)}")
            addrs.append(a)
            writes.append(op == "W")
            sizes.append(s)
    if not addrs:
        raise BadArgument(f"trace file {path!r} has no requests")
    return Trace(np.array(addrs, np.int64), np.array(sizes, np.int64), np.array(writes, np.uint8))
