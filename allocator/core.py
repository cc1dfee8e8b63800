"""RacmAllocator: contiguous, predicted-length KV blocks in one device pool (the ODMA way).

    reserve(request, prompt, L, u) --policy--> bucket bound (tokens) --TLSF--> byte range of the pool
    grow(request, total)            fits: bookkeeping only; outgrown: migrate to the large bucket
    release(request, realized)      range back to TLSF (coalesced); realized length -> buckets

Policy (paper section 3.3/3.4): L' = L x (1 + alpha x u); u > tau goes to the large bucket;
otherwise the smallest regular bucket that holds prompt + L' (a prediction beyond the top bound
also goes large). Bounds count generated tokens by default (the paper's Eq. 2: the block holds
prompt + bound) or whole footprints (bucket_basis="footprint": the block holds the bound, so
block sizes come from a set of K sizes). A large block holds prompt + the longest generation
in the bucket window (max_tokens before any data), capped at max_tokens. The large bucket is a reserved share of the pool (large_share):
regular blocks never use it, large blocks use it first and the regular region after.

Migration (grow past capacity): allocate the new block, stream-copy the bytes written so far
(the block's high-water mark) with Device.copy outside the lock, then, under the lock, switch the
request's reference to the new block and free the old one. The old Block is marked migrating
while its bytes are copied (reads allowed, writes refused) and stale afterwards, so a reader
either gets the old block with all its bytes or the new one with all of them, never a half-switch.
If no range fits, grow raises OutOfMemory and the request stays in its old block; if the copy
fails, the new block is freed and the old one stays live (MigrationFailed).

Every failed call leaves the allocator as it was; the only thing a failure changes is the
counters that count failures (reserve_failures, oom_events).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import operator
import threading

from odma_hw import devices as _devices
from odma_hw.devices.base import Device
from odma_hw.errors import BadArgument

from allocator.buckets import QuantileBuckets, RULES
from allocator.copier import StreamingCopier
from allocator.errors import (DuplicateRequest, MigrationFailed, OutOfMemory, PoolTooLarge,
                              RequestBusy, StaleBlock, UnknownRequest)
from allocator.tlsf import TlsfFreeSpace

LARGE = "large"
BASES = ("generated", "footprint")
_LIVE, _MIGRATING, _DEAD = 0, 1, 2
_INF = math.inf


def _count(name: str, v) -> int:
    """A non-negative integer argument (numpy integers accepted, bools and floats not)."""
    if type(v) is not int:
        if isinstance(v, bool):
            raise BadArgument(f"{name} must be an integer, got {v!r}")
        try:
            v = operator.index(v)
        except TypeError:
            raise BadArgument(f"{name} must be an integer, got {v!r}") from None
    if v < 0:
        raise BadArgument(f"{name} must be >= 0, got {v}")
    return v


def _amount(name: str, v, allow_inf: bool = False) -> float:
    """A non-negative real argument; NaN always refused, infinity only when allowed."""
    try:
        v = float(v)
    except (TypeError, ValueError):
        raise BadArgument(f"{name} must be a number, got {v!r}") from None
    if not v >= 0 or (v == _INF and not allow_inf):  # `not v >= 0` is also true for NaN
        raise BadArgument(f"{name} must be a finite number >= 0, got {v!r}")
    return v


def resolve_device(device) -> tuple[Device | None, bool]:
    """(the Device, whether the allocator opened it and so must close it) for a Device, a spec
    string or None (accounting only: no bytes are stored)."""
    if isinstance(device, str):
        return _devices.open(device), True
    if device is not None and not isinstance(device, Device):
        raise BadArgument(f"device must be a Device, a spec string or None, got {device!r}")
    return device, False


def find_live(live: dict, request_id):
    """The live block of `request_id` in `live`; UnknownRequest when there is none."""
    try:
        blk = live.get(request_id)
    except TypeError:
        raise BadArgument(f"request id must be hashable, got {request_id!r}") from None
    if blk is None:
        raise UnknownRequest(f"request {request_id!r} is not live (never reserved or "
                             f"already released)")
    return blk


def check_growth(request_id, held: int, total: int, max_tokens: int) -> None:
    """grow() may only lengthen a request, and never past max_tokens."""
    if total < held:
        raise BadArgument(f"request {request_id!r} holds {held} tokens; cannot grow to {total}")
    if total > max_tokens:
        raise BadArgument(f"{total} tokens exceed max_tokens={max_tokens}")


@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
    """Knobs of the ODMA policy and pool; every field has the default the replays use."""

    alpha: float = 1.0              # L' = L (1 + alpha u)
    tau: float = 4.0                # u > tau: straight to the large bucket
    n_buckets: int = 8              # regular buckets (the large bucket is extra)
    bucket_basis: str = "generated"  # bounds count generated tokens (block = prompt + bound,
    #                                  the paper's Eq. 2) or the whole "footprint"
    bucket_rule: str = "min-waste"  # or "occupancy" (the paper's equal-occupancy quantiles)
    window: int = 10_000            # completions the bounds are learned from
    refresh_every: int = 1_000      # completions between refreshes
    background_refresh: bool = True  # refresh on a thread (False: inline, deterministic)
    token_alignment: int = 16       # bucket bounds / capacities are multiples of this (tokens)
    byte_alignment: int | None = None  # block offsets; None: the device's alignment
    large_share: float = 0.1        # share of the pool reserved for the large bucket
    migration_penalty: float = 1.0  # min-waste rule: cost of a migration, in mean requests
    initial_bounds: tuple | None = None  # bounds before the first refresh (None: equal width)
    copy_chunk_bytes: int | None = None  # migration copy chunk (None: one streaming copy)

    def __post_init__(self):
        for name in ("alpha", "tau", "migration_penalty"):
            _amount(name, getattr(self, name), allow_inf=name == "tau")
        for name in ("n_buckets", "window", "refresh_every", "token_alignment"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise BadArgument(f"{name} must be a positive integer, got {v!r}")
        if self.bucket_basis not in BASES:
            raise BadArgument(f"unknown bucket basis {self.bucket_basis!r}: expected one of "
                              f"{', '.join(BASES)}")
        if self.bucket_rule not in RULES:
            raise BadArgument(f"unknown bucket rule {self.bucket_rule!r}: expected one of "
                              f"{', '.join(RULES)}")
        a = self.byte_alignment
        if a is not None and (not isinstance(a, int) or a <= 0 or a & (a - 1)):
            raise BadArgument(f"byte_alignment must be a power of two, got {a!r}")
        if not 0 <= self.large_share < 1:
            raise BadArgument(f"large_share must be in [0, 1), got {self.large_share!r}")


class Block:
    """A request's contiguous KV block: bytes [offset, offset + nbytes) of its allocator's pool.

    capacity_tokens * bytes_per_token <= nbytes (nbytes is rounded up to the byte alignment).
    `tokens` is the request's current length (prompt + generated) as told by reserve/grow;
    `written` is the high-water mark of bytes written through write() or mark_written(): what a
    migration copies. `predicted` is the inflated prediction the bucket was chosen by (in the
    bucket basis; None when u > tau sent it to the large bucket). A Block goes stale when its request migrates away or is released; using a
    stale block raises StaleBlock.
    """

    __slots__ = ("_owner", "request_id", "offset", "nbytes", "capacity_tokens", "bucket",
                 "written", "prompt_tokens", "tokens", "predicted", "_region", "_state")

    def __init__(self, owner, request_id, offset, nbytes, capacity_tokens, bucket, region,
                 prompt_tokens, tokens, predicted):
        self._owner = owner
        self.request_id = request_id
        self.offset = offset
        self.nbytes = nbytes
        self.capacity_tokens = capacity_tokens
        self.bucket = bucket
        self._region = region
        self.prompt_tokens = prompt_tokens
        self.tokens = tokens
        self.predicted = predicted
        self.written = 0
        self._state = _LIVE

    def __repr__(self):
        state = ("live", "migrating", "stale")[self._state]
        return (f"Block(request={self.request_id!r}, offset={self.offset}, nbytes={self.nbytes}, "
                f"capacity_tokens={self.capacity_tokens}, bucket={self.bucket!r}, {state})")

    @property
    def device(self) -> Device | None:
        return self._owner.device

    @property
    def live(self) -> bool:
        return self._state == _LIVE

    def _range(self, offset: int, nbytes: int) -> None:
        if self._state == _DEAD:
            raise StaleBlock(f"block of request {self.request_id!r} is stale (migrated or released)")
        if self._owner._buffer is None:
            raise BadArgument("this allocator is accounting-only (device=None): blocks hold no bytes")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise BadArgument(f"range [{offset}, {offset + nbytes}) is outside the "
                              f"{self.nbytes}-byte block")

    def write(self, data, offset: int = 0) -> None:
        """Copy bytes-like `data` into the block at `offset` (real bytes on the device)."""
        n = memoryview(data).nbytes
        self._range(offset, n)
        if self._state != _LIVE:
            raise RequestBusy(f"request {self.request_id!r} is migrating; write after grow returns")
        if n:
            self._owner.device.write(self._owner._buffer, self.offset + offset, data)
        if offset + n > self.written:
            self.written = offset + n

    def read(self, nbytes: int, offset: int = 0) -> bytes:
        """`nbytes` bytes of the block from `offset`, read back from the device."""
        self._range(offset, nbytes)
        return self._owner.device.read(self._owner._buffer, self.offset + offset, nbytes)

    def mark_written(self, nbytes: int) -> None:
        """Declare bytes [0, nbytes) written by other means (a tensor view, a kernel), so a
        migration copies them."""
        self._range(0, nbytes)
        if nbytes > self.written:
            self.written = nbytes

    def tensor(self, dtype, shape):
        """A torch tensor of `dtype` and `shape` viewing the start of this block (no copy; torch
        devices only). Writes through it are not tracked: call mark_written()."""
        dev = self._owner.device
        if dev is None or not hasattr(dev, "tensor"):
            raise BadArgument(f"tensor views need a torch device, not {getattr(dev, 'spec', None)}")
        import torch

        itemsize = torch.empty((), dtype=dtype).element_size()
        shape = tuple(shape)
        n = math.prod(shape) * itemsize
        self._range(0, n)
        if self.offset % itemsize:
            raise BadArgument(f"block offset {self.offset} is not aligned to {dtype}")
        return dev.tensor(self._owner._buffer, self.offset, n).view(dtype).view(shape)


class RacmAllocator:
    """Contiguous KV blocks sized by predicted length, in one pool Buffer on one device.

    Invariants (check() verifies them):
    - every live block's byte range is a used range of exactly one region, and every used range
      belongs to exactly one live block or one in-flight migration target: blocks never overlap;
    - reserved_bytes + free_bytes == pool_bytes;
    - for every live block: tokens <= capacity_tokens and capacity_tokens * bytes_per_token <= nbytes.
    Thread-safe: one lock guards the tables; device copies run outside it.

    device: a Device, a spec string (opened here, closed by close()), or None for an explicit
    accounting-only allocator (offsets and sizes only, no memory: Block.read/write refuse).
    """

    name = "odma"

    def __init__(self, device, pool_bytes: int, bytes_per_token: int, max_tokens: int,
                 config: AllocatorConfig | None = None, *, buckets: QuantileBuckets | None = None):
        config = AllocatorConfig() if config is None else config
        if not isinstance(config, AllocatorConfig):
            raise BadArgument(f"config must be an AllocatorConfig, got {type(config).__name__}")
        for name, v in (("pool_bytes", pool_bytes), ("bytes_per_token", bytes_per_token),
                        ("max_tokens", max_tokens)):
            if _count(name, v) == 0:
                raise BadArgument(f"{name} must be > 0")
        self.config = config
        self.bytes_per_token = int(bytes_per_token)
        self.max_tokens = int(max_tokens)
        self.device, self._owns_device = resolve_device(device)
        device = self.device
        align = config.byte_alignment or (device.alignment if device is not None else 64)
        self.alignment = align
        self._mask = align - 1
        pool_bytes = int(pool_bytes) & ~self._mask
        self.pool_bytes = pool_bytes
        large = int(pool_bytes * self._large_share()) & ~self._mask
        regular = pool_bytes - large
        if regular < self.block_bytes(self.max_tokens):
            self._close_device()
            raise BadArgument(
                f"pool too small: its regular region ({regular} B) cannot hold one "
                f"{self.max_tokens}-token block ({self.block_bytes(self.max_tokens)} B)")
        self._buffer = None
        if device is not None:
            total = device.info.total_bytes
            if pool_bytes > total:
                self._close_device()
                raise PoolTooLarge(f"pool of {pool_bytes} B is larger than {device.spec} "
                                   f"({total} B)")
            try:
                self._buffer = device.alloc(pool_bytes)
            except BadArgument as exc:
                self._close_device()
                raise PoolTooLarge(f"pool of {pool_bytes} B does not fit on {device.spec}: "
                                   f"{exc}") from None
        self._regular = TlsfFreeSpace(0, regular, align)
        self._large = TlsfFreeSpace(regular, large, align) if large else None
        self._regions = (self._regular,) if self._large is None else (self._regular, self._large)
        self._regular_only = (self._regular,)
        self._large_first = self._regions[::-1]
        self._by_generated = config.bucket_basis == "generated"
        self._owns_buckets = buckets is None
        self._buckets = self._make_buckets() if buckets is None else buckets
        self._copier = StreamingCopier(device, config.copy_chunk_bytes) if device else None
        self._lock = threading.Lock()
        self._live: dict = {}
        self._migrating = 0           # in-flight migration targets (counted in used ranges)
        self.completed = 0
        self.preemptions = 0          # releases with preempted=True
        self.used_tokens_sum = 0      # over released requests: realized footprint
        self.reserved_tokens_sum = 0  # over released requests: capacity of the final block
        self.migrations = 0
        self.migrated_bytes = 0
        self.migration_seconds = 0.0
        self.oom_events = 0           # grow() found no range: the caller must preempt
        self.reserve_failures = 0     # reserve() found no range: admission must wait

    # -- what subclasses (the baselines) change ----------------------------------------------
    def _large_share(self) -> float:
        return self.config.large_share

    def _make_buckets(self) -> QuantileBuckets | None:
        c = self.config
        return QuantileBuckets(self.max_tokens, c.n_buckets, window=c.window,
                               refresh_every=c.refresh_every, alignment=c.token_alignment,
                               rule=c.bucket_rule, background=c.background_refresh,
                               initial=c.initial_bounds, migration_penalty=c.migration_penalty)

    def _place(self, prompt: int, predicted: float, u: float):
        """(bucket, capacity_tokens, regions to try, predicted value in the bucket basis or
        None when the prediction was not used)."""
        if u > self.config.tau:
            return LARGE, self._buckets.large_capacity(prompt, prompt + 1), self._large_first, None
        inflated = max(1.0, predicted * (1.0 + self.config.alpha * u))
        offset = 0 if self._by_generated else prompt   # bound = generated or footprint tokens
        bounds = self._buckets.bounds
        i = bisect.bisect_left(bounds, offset + inflated)
        if i < len(bounds):
            cap = bounds[i] + prompt - offset
            if cap <= self.max_tokens:
                return i, cap, self._regular_only, offset + inflated
        need = min(self.max_tokens, math.ceil(prompt + inflated))
        return (LARGE, self._buckets.large_capacity(prompt, need), self._large_first,
                offset + inflated)

    def _overflow(self, blk: Block, need: int):
        """(bucket, capacity_tokens, regions) of the block a request that outgrew `blk` moves to."""
        if blk.bucket == LARGE:  # outgrew the large block too: double the generated part
            need = blk.prompt_tokens + 2 * (need - blk.prompt_tokens)
        return LARGE, self._buckets.large_capacity(blk.prompt_tokens, need), self._large_first

    # -- sizes -------------------------------------------------------------------------------
    def block_bytes(self, capacity_tokens: int) -> int:
        return (capacity_tokens * self.bytes_per_token + self._mask) & ~self._mask

    # -- the API -----------------------------------------------------------------------------
    def reserve(self, request_id, prompt_tokens: int, predicted_tokens: float,
                uncertainty: float = 0.0) -> Block:
        """Reserve a contiguous block for a new request. Raises DuplicateRequest, BadArgument,
        OutOfMemory (nothing changed)."""
        prompt = prompt_tokens if type(prompt_tokens) is int and prompt_tokens >= 0 else \
            _count("prompt_tokens", prompt_tokens)
        predicted = _amount("predicted_tokens", predicted_tokens)
        u = uncertainty if type(uncertainty) is float and 0.0 <= uncertainty else \
            _amount("uncertainty", uncertainty, allow_inf=True)
        if prompt >= self.max_tokens:
            raise BadArgument(f"prompt of {prompt} tokens leaves no room under max_tokens="
                              f"{self.max_tokens}")
        bucket, cap, regions, footprint = self._place(prompt, predicted, u)
        nbytes = (cap * self.bytes_per_token + self._mask) & ~self._mask
        with self._lock:
            try:
                if request_id in self._live:
                    raise DuplicateRequest(f"request {request_id!r} is already live")
            except TypeError:
                raise BadArgument(f"request id must be hashable, got {request_id!r}") from None
            for region in regions:
                off = region.alloc(nbytes)
                if off >= 0:
                    break
            else:
                self.reserve_failures += 1
                raise OutOfMemory(f"no free range of {nbytes} B for request {request_id!r} "
                                  f"({cap} tokens, bucket {bucket})")
            blk = Block(self, request_id, off, nbytes, cap, bucket, region, prompt, prompt,
                        footprint)
            self._live[request_id] = blk
        return blk

    def _lookup(self, request_id) -> Block:
        blk = find_live(self._live, request_id)
        if blk._state != _LIVE:
            raise RequestBusy(f"request {request_id!r} is being migrated")
        return blk

    def block(self, request_id) -> Block:
        """The request's current block (after any migration)."""
        with self._lock:
            return self._lookup(request_id)

    def grow(self, request_id, total_tokens: int) -> Block:
        """Tell the allocator the request now holds `total_tokens` (prompt + generated). Returns
        its block: the same one while it fits, a new one after a migration. Raises
        UnknownRequest, BadArgument (below the current length, above max_tokens), OutOfMemory
        (the request stays valid in its old block), MigrationFailed (likewise)."""
        total = _count("total_tokens", total_tokens)
        with self._lock:
            old = self._lookup(request_id)
            check_growth(request_id, old.tokens, total, self.max_tokens)
            if total <= old.capacity_tokens:
                old.tokens = total
                return old
            bucket, cap, regions = self._overflow(old, total)
            nbytes = self.block_bytes(cap)
            for region in regions:
                off = region.alloc(nbytes)
                if off >= 0:
                    break
            else:
                self.oom_events += 1
                raise OutOfMemory(f"request {request_id!r} outgrew its {old.capacity_tokens}-token "
                                  f"block and no free range of {nbytes} B is left")
            new = Block(self, request_id, off, nbytes, cap, bucket, region, old.prompt_tokens,
                        total, old.predicted)
            old._state = _MIGRATING
            self._migrating += 1
            n = min(old.written, old.nbytes)
        seconds = 0.0
        try:
            if n and self._buffer is not None:
                seconds = self._copier.copy(self._buffer, off, self._buffer, old.offset, n)
        except BaseException as exc:
            with self._lock:
                region.free(off)
                self._migrating -= 1
                old._state = _LIVE
            if isinstance(exc, Exception):
                raise MigrationFailed(f"migration of request {request_id!r} failed, it stays in "
                                      f"its old block: {exc}") from exc
            raise
        with self._lock:
            new.written = n
            self._live[request_id] = new      # the atomic switch
            old._state = _DEAD
            old._region.free(old.offset)
            self._migrating -= 1
            self.migrations += 1
            self.migrated_bytes += n
            self.migration_seconds += seconds
        return new

    def release(self, request_id, realized_tokens: int | None = None, *,
                preempted: bool = False) -> None:
        """Free the request's block. realized_tokens: tokens it generated (default: its length
        per the last grow minus its prompt); logged for the bucket bounds. preempted=True: the
        request did not complete (it will be rerun), so its length is neither logged nor counted
        in utilization. Raises UnknownRequest (also on a second release), BadArgument."""
        realized = realized_tokens
        if realized is not None and not (type(realized) is int and realized >= 0):
            realized = _count("realized_tokens", realized_tokens)
        with self._lock:
            blk = self._lookup(request_id)
            if realized is None:
                total = blk.tokens
            else:
                total = blk.prompt_tokens + realized
                if total > blk.capacity_tokens:
                    raise BadArgument(f"request {request_id!r} cannot have generated {realized} "
                                      f"tokens: its block holds {blk.capacity_tokens} in all")
            del self._live[request_id]
            blk._region.free(blk.offset)
            blk._state = _DEAD
            if preempted:
                self.preemptions += 1
                return
            self.completed += 1
            self.used_tokens_sum += total
            self.reserved_tokens_sum += blk.capacity_tokens
        if self._buckets is not None:
            gen = total - blk.prompt_tokens
            self._buckets.record(gen if self._by_generated else total, blk.predicted,
                                 gen, blk.prompt_tokens)

    # -- bucket control ----------------------------------------------------------------------
    @property
    def buckets(self) -> QuantileBuckets | None:
        return self._buckets

    def refresh_buckets(self) -> tuple[int, ...] | None:
        """Recompute the bucket bounds now (synchronously); returns them."""
        return None if self._buckets is None else self._buckets.refresh()

    # -- reporting ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._live)

    def live_blocks(self) -> list[Block]:
        with self._lock:
            return list(self._live.values())

    def fragmentation(self) -> float:
        """External fragmentation of the whole pool: 1 - largest free range / free bytes."""
        with self._lock:
            free = sum(r.free_bytes for r in self._regions)
            if not free:
                return 0.0
            return 1.0 - max(r.largest_free() for r in self._regions) / free

    def stats(self) -> dict:
        with self._lock:
            blocks = list(self._live.values())
            reserved = sum(r.used_bytes for r in self._regions)
            free = sum(r.free_bytes for r in self._regions)
            largest = max(r.largest_free() for r in self._regions)
            used_tokens = sum(b.tokens for b in blocks)
            cap_tokens = sum(b.capacity_tokens for b in blocks)
            per_bucket: dict = {}
            for b in blocks:
                per_bucket[b.bucket] = per_bucket.get(b.bucket, 0) + 1
            out = {
                "policy": self.name,
                "device": None if self.device is None else self.device.spec,
                "pool_bytes": self.pool_bytes,
                "reserved_bytes": reserved,
                "free_bytes": free,
                "used_bytes": used_tokens * self.bytes_per_token,
                "live_blocks": len(blocks),
                "live_tokens": used_tokens,
                "live_capacity_tokens": cap_tokens,
                "occupancy": reserved / self.pool_bytes,
                "live_utilization": used_tokens / cap_tokens if cap_tokens else None,
                "largest_free_bytes": largest,
                "external_fragmentation": 1.0 - largest / free if free else 0.0,
                "large_region_bytes": 0 if self._large is None else self._large.size,
                "large_region_used_bytes": 0 if self._large is None else self._large.used_bytes,
                "blocks_per_bucket": {str(k): v for k, v in per_bucket.items()},
                "completed": self.completed,
                "preemptions": self.preemptions,
                "utilization": (self.used_tokens_sum / self.reserved_tokens_sum
                                if self.reserved_tokens_sum else None),
                "migrations": self.migrations,
                "migrated_bytes": self.migrated_bytes,
                "migration_seconds": self.migration_seconds,
                "oom_events": self.oom_events,
                "reserve_failures": self.reserve_failures,
            }
        if self._buckets is not None:
            out["bucket_bounds"] = list(self._buckets.bounds)
            out["bucket_refreshes"] = self._buckets.refreshes
        return out

    def check(self) -> None:
        """Verify the invariants in the class docstring (and TLSF's); AssertionError if broken."""
        with self._lock:
            for r in self._regions:
                r.check()
            used = {}
            for r in self._regions:
                for off, size in r.used_ranges():
                    used[off] = (size, r)
            for rid, b in self._live.items():
                assert b.request_id == rid and b._state == _LIVE
                assert used.get(b.offset, (None, None)) == (b.nbytes, b._region), \
                    f"block of {rid!r} is not a used range of its region"
                assert b.prompt_tokens <= b.tokens <= b.capacity_tokens
                assert b.capacity_tokens * self.bytes_per_token <= b.nbytes
                assert b.nbytes == self.block_bytes(b.capacity_tokens)
                assert b.offset % self.alignment == 0
            assert len(used) == len(self._live) + self._migrating
            assert (sum(r.used_bytes + r.free_bytes for r in self._regions) == self.pool_bytes)

    # -- lifetime ----------------------------------------------------------------------------
    def _close_device(self):
        if self._owns_device and self.device is not None:
            self.device.close()

    def close(self) -> None:
        """Stop the refresher, free the pool buffer, close a device opened from a spec."""
        if self._owns_buckets and self._buckets is not None:
            self._buckets.close()
        if self._buffer is not None:
            buf, self._buffer = self._buffer, None
            try:
                self.device.free(buf)
            finally:
                self._close_device()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
