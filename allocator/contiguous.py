"""ContiguousPool: one contiguous byte range per request in a device pool, sized by a policy.

    reserve(request, prompt, L, u) --policy.place--> capacity (tokens) --TLSF--> byte range
    grow(request, total)            fits: bookkeeping only; outgrown: policy.overflow, migrate
    release(request, realized)      range back to TLSF (coalesced); policy learns the length

The pool owns the device memory, the free space (TLSF, headers kept outside the pool: one
regular region, and a large region when the policy reserves a share of the pool for it: regular
blocks never use it, large blocks use it first and the regular region after), the statistics and
migration; RegionPool holds these, shared with the extent allocator (allocator/extent.py), and
ContiguousPool adds the one-range-per-request protocol. A policy (allocator/policies.py: ODMA, static, S3, oracle) only answers how many tokens
a block gets and whether it goes large; it never sees an offset.

Migration (grow past capacity): allocate the new block, mark the old one migrating (new writes
refused, reads allowed), wait for the writes already running, stream-copy the bytes written so far
(the high-water mark) with the device's copy outside the lock, then, under the lock, switch the
request's reference to the new block, mark the old one stale, wait for its readers and free it.
If no range fits, grow raises OutOfMemory and the request stays in its old block; if the copy
fails, the new block is freed and the old one stays live (MigrationFailed).

Every failed call leaves the allocator as it was; the only thing a failure changes is the
counters that count failures (reserve_failures, oom_events).
"""

from __future__ import annotations

import time

from odma_cli.errors import BadArgument

from allocator.arguments import amount, count, positive_count
from allocator.errors import MigrationFailed, OutOfMemory, require
from allocator.pool import DEAD, LIVE, MIGRATING, PinnedBlock, PoolAllocator
from allocator.tlsf import TlsfFreeSpace


class Block(PinnedBlock):
    """A request's contiguous KV block: bytes [offset, offset + nbytes) of its allocator's pool.

    capacity_tokens * bytes_per_token <= nbytes (nbytes is rounded up to the byte alignment).
    `tokens` is the request's current length (prompt + generated) as told by reserve/grow;
    `written` is the high-water mark of bytes written through write() or mark_written(): what a
    migration copies. `bucket` is the policy's label (a regular bucket index, "large", ...);
    `predicted` is the prediction the block was sized by, in the policy's bucket basis (None when
    the prediction was not used). A Block goes stale when its request migrates away or is
    released; using a stale block raises StaleBlock.
    """

    __slots__ = ("offset", "_nbytes", "bucket", "predicted", "_region")

    def __init__(self, owner, request_id, offset, nbytes, capacity_tokens, bucket, region,
                 prompt_tokens, tokens, predicted):
        # PinnedBlock's fields set here, not through super(): this runs on every reserve
        self._owner = owner
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.capacity_tokens = capacity_tokens
        self.written = 0
        self._state = LIVE
        self._readers = 0
        self._writers = 0
        self.offset = offset
        self._nbytes = nbytes
        self.bucket = bucket
        self._region = region
        self.tokens = tokens
        self.predicted = predicted

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def _location(self):
        owner = self._owner
        return owner.device, owner._pool.buffer, self.offset

    def __repr__(self):
        state = ("live", "migrating", "stale")[self._state]
        return (f"Block(request={self.request_id!r}, offset={self.offset}, nbytes={self.nbytes}, "
                f"capacity_tokens={self.capacity_tokens}, bucket={self.bucket!r}, {state})")

    def _spans(self, offset, nbytes):
        return ((self.offset + offset, nbytes, 0),) if nbytes else ()

    def tensor(self, dtype, shape):
        """A torch tensor of `dtype` and `shape` viewing the start of this block (no copy; torch
        devices only). Writes through it are not tracked: call mark_written(), and do not write
        through a view while the request may migrate."""
        return self._tensor_at(self.offset, self.nbytes, dtype, shape)


class RegionPool(PoolAllocator):
    """The half of an allocator that places a request's KV in byte ranges of TLSF regions, sized
    in tokens by a policy, and moves a request by migration.

    The pool: one regular region, and a large region when the policy reserves a share of the
    pool for it (regular ranges never use it, large ranges use it first and the regular region
    after). Invariants every such pool keeps (_used_ranges and _require_tiling check them): the
    regions tile the pool, TLSF's own invariants hold in each, every range is a multiple of the
    alignment at an aligned offset.

    A migration moves a request from its live block to a block already taken: the old block is
    marked migrating (new writes refused, reads allowed), the writes already running land first,
    the bytes written so far (the high-water mark) are stream-copied with the device's copy
    outside the lock, then, under the lock, the request's reference switches to the new block,
    the old one goes stale, its readers finish and its ranges are freed. If the copy fails the new
    block is freed and the old one stays live (MigrationFailed).
    """

    def __init__(self, device, pool_bytes: int, bytes_per_token: int, max_tokens: int, policy, *,
                 byte_alignment: int | None = None, copy_chunk_bytes: int | None = None):
        self.policy = policy
        try:
            pool_bytes = positive_count("pool_bytes", pool_bytes)
            self.bytes_per_token = positive_count("bytes_per_token", bytes_per_token)
            self.max_tokens = positive_count("max_tokens", max_tokens)
            super().__init__(device, byte_alignment)
            self.name = policy.name
            align = self.alignment
            self._mask = align - 1
            pool_bytes &= ~self._mask
            large = int(pool_bytes * policy.large_share) & ~self._mask
            regular = pool_bytes - large
            if regular < self.block_bytes(self.max_tokens):
                raise BadArgument(
                    f"pool too small: its regular region ({regular} B) cannot hold one "
                    f"{self.max_tokens}-token block ({self.block_bytes(self.max_tokens)} B)")
            self._pool.allocate(pool_bytes, copy_chunk_bytes)
        except BaseException:
            policy.close()
            if hasattr(self, "_pool"):
                self._pool.close()
            raise
        self.pool_bytes = pool_bytes
        self._regular = TlsfFreeSpace(0, regular, align)
        self._large = TlsfFreeSpace(regular, large, align) if large else None
        self._regions = (self._regular,) if self._large is None else (self._regular, self._large)
        self._regular_only = (self._regular,)
        self._large_first = self._regions[::-1]
        self.migrations = 0
        self.migrated_bytes = 0
        self.migration_seconds = 0.0

    @property
    def buckets(self):
        """The policy's QuantileBuckets (None for policies without buckets)."""
        return self.policy.buckets

    def block_bytes(self, capacity_tokens: int) -> int:
        return (capacity_tokens * self.bytes_per_token + self._mask) & ~self._mask

    def _take_new(self, request_id, nbytes: int, p):
        """Lock held: (offset, region) of the first range of a new request placed as `p`; raises
        DuplicateRequest, AllocatorClosed, OutOfMemory (nothing changed)."""
        self._check_new(request_id)
        off, region = self._take(nbytes, p.large)
        if off < 0:
            self.reserve_failures += 1
            raise OutOfMemory(f"no free range of {nbytes} B for request {request_id!r} "
                              f"({p.capacity} tokens, bucket {p.bucket})")
        return off, region

    def _take(self, nbytes: int, large: bool):
        """Lock held: (offset, region) of a new used range, or (-1, None)."""
        for region in (self._large_first if large else self._regular_only):
            off = region.alloc(nbytes)
            if off >= 0:
                return off, region
        return -1, None

    def _place(self, prompt_tokens, predicted_tokens, uncertainty):
        """reserve()'s arguments checked, and the policy's placement: (prompt, Placement).
        Raises BadArgument (nothing changed)."""
        prompt = count("prompt_tokens", prompt_tokens)
        predicted = amount("predicted_tokens", predicted_tokens)
        u = amount("uncertainty", uncertainty, allow_inf=True)
        if prompt >= self.max_tokens:
            raise BadArgument(f"prompt of {prompt} tokens leaves no room under max_tokens="
                              f"{self.max_tokens}")
        return prompt, self.policy.place(prompt, predicted, u)

    # -- migration -----------------------------------------------------------------------------
    def _begin_migration(self, old) -> int:
        """Lock held, the new block taken: refuse new writes to `old` and let the running ones
        land; the number of bytes the migration copies (old's high-water mark)."""
        old._state = MIGRATING        # refuse new writes ...
        self._migrating += 1
        self._wait_idle(old, writers_only=True)   # ... and let the running ones land first
        return min(old.written, old.nbytes)

    def _finish_migration(self, old, new, n: int, copy=None):
        """Lock not held: copy old's first `n` bytes into `new` (or call copy(old, new)), switch
        the request to `new` and free `old`; returns `new`. On a failed copy `new` is freed, `old`
        is live again and MigrationFailed is raised."""
        request_id = old.request_id
        seconds = 0.0
        try:
            if copy is not None and self._pool.holds_bytes:
                start = time.perf_counter()
                copy(old, new)
                seconds = time.perf_counter() - start
            elif n and self._pool.holds_bytes:
                for at, length, pos in old._spans(0, n):
                    seconds += self._pool.copy(new.offset + pos, at, length)
        except BaseException as exc:
            with self._lock:
                self._free_storage(new)
                self._migrating -= 1
                old._state = LIVE
                self._cond.notify_all()
            if isinstance(exc, Exception):
                raise MigrationFailed(f"migration of request {request_id!r} failed, it stays in "
                                      f"its old block: {exc}") from exc
            raise
        with self._lock:
            new.written = n
            self._live[request_id] = new      # the atomic switch
            old._state = DEAD
            self._wait_idle(old)              # readers of the old bytes finish first
            self._free_storage(old)
            self._migrating -= 1
            self.migrations += 1
            self.migrated_bytes += n
            self.migration_seconds += seconds
            self._cond.notify_all()
        return new

    def _completed(self, blk, total: int) -> None:
        self.policy.learn(blk, total)

    # -- bucket control ----------------------------------------------------------------------------
    def refresh_buckets(self) -> tuple[int, ...] | None:
        """Recompute the bucket bounds now (synchronously); returns them."""
        return None if self.buckets is None else self.buckets.refresh()

    # -- reporting ---------------------------------------------------------------------------------
    @property
    def reserved_bytes(self) -> int:
        return sum(r.used_bytes for r in self._regions)

    def fragmentation(self) -> float:
        """External fragmentation of the whole pool: 1 - largest free range / free bytes."""
        with self._lock:
            free = sum(r.free_bytes for r in self._regions)
            if not free:
                return 0.0
            return 1.0 - max(r.largest_free() for r in self._regions) / free

    def _pool_stats(self, blocks) -> dict:
        """Lock held: the keys of stats() that describe the pool and the live `blocks`."""
        reserved = sum(r.used_bytes for r in self._regions)
        free = sum(r.free_bytes for r in self._regions)
        largest = max(r.largest_free() for r in self._regions)
        used_tokens = sum(b.tokens for b in blocks)
        cap_tokens = sum(b.capacity_tokens for b in blocks)
        per_bucket: dict = {}
        for b in blocks:
            per_bucket[b.bucket] = per_bucket.get(b.bucket, 0) + 1
        return {
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
        }

    def _migration_stats(self) -> dict:
        """Lock held: the migration counters of stats()."""
        return {"migrations": self.migrations, "migrated_bytes": self.migrated_bytes,
                "migration_seconds": self.migration_seconds}

    def _bucket_stats(self, out: dict) -> dict:
        """`out` with the policy's bucket bounds and refresh count, when it has buckets."""
        buckets = self.buckets
        if buckets is not None:
            out["bucket_bounds"] = list(buckets.bounds)
            out["bucket_refreshes"] = buckets.refreshes
        return out

    def _used_ranges(self) -> dict:
        """Lock held: check TLSF's invariants in every region; {offset: (size, region)} of every
        used range."""
        for r in self._regions:
            r.check()
        used = {}
        for r in self._regions:
            for off, size in r.used_ranges():
                used[off] = (size, r)
        return used

    def _require_tiling(self) -> None:
        """Lock held: the regions tile the pool (InvariantBroken if not)."""
        require(sum(r.used_bytes + r.free_bytes for r in self._regions) == self.pool_bytes,
                "the regions do not tile the pool")

    def _before_close(self) -> None:
        self.policy.close()


class ContiguousPool(RegionPool):
    """KV allocator with one contiguous block per request, sized by `policy`.

    Invariants (check() verifies them): every live block is a used range of its region and no
    two overlap (TLSF's heap walk); used ranges = live blocks + running migration targets;
    prompt <= tokens <= capacity; capacity * bytes_per_token <= nbytes = block_bytes(capacity);
    offsets are multiples of the alignment; the regions tile the pool.
    """

    # -- the protocol ------------------------------------------------------------------------------
    def reserve(self, request_id, prompt_tokens: int, predicted_tokens: float = 0.0,
                uncertainty: float = 0.0) -> Block:
        """Reserve a contiguous block for a new request. Raises DuplicateRequest, BadArgument,
        OutOfMemory, AllocatorClosed (nothing changed)."""
        prompt, p = self._place(prompt_tokens, predicted_tokens, uncertainty)
        nbytes = self.block_bytes(p.capacity)
        with self._lock:
            off, region = self._take_new(request_id, nbytes, p)
            blk = Block(self, request_id, off, nbytes, p.capacity, p.bucket, region, prompt,
                        prompt, p.key)
            self._live[request_id] = blk
        return blk

    def grow(self, request_id, total_tokens: int, copy=None) -> Block:
        """Tell the allocator the request now holds `total_tokens` (prompt + generated). Returns
        its block: the same one while it fits, a new one after a migration. A migration copies
        the old block's first `written` bytes, or calls copy(old, new) when given: the caller's
        own copy, for a layout whose place of a token depends on the capacity (head-major KV);
        it runs while the old block is still readable and the new one not yet the request's.
        Raises UnknownRequest, BadArgument (below the current length, above max_tokens),
        OutOfMemory (the request stays valid in its old block), MigrationFailed (likewise)."""
        total = count("total_tokens", total_tokens)
        with self._lock:
            old = self._lookup(request_id)
            self._check_growth(old, total)
            if total <= old.capacity_tokens:
                old.tokens = total
                return old
            p = self.policy.overflow(old, total)
            nbytes = self.block_bytes(p.capacity)
            off, region = self._take(nbytes, p.large)
            if off < 0:
                self.oom_events += 1
                raise OutOfMemory(f"request {request_id!r} outgrew its {old.capacity_tokens}-token "
                                  f"block and no free range of {nbytes} B is left")
            new = Block(self, request_id, off, nbytes, p.capacity, p.bucket, region,
                        old.prompt_tokens, total, old.predicted)
            n = self._begin_migration(old)
        return self._finish_migration(old, new, n, copy)

    def _free_storage(self, blk: Block) -> None:
        blk._region.free(blk.offset)

    def stats(self) -> dict:
        with self._lock:
            out = {**self._pool_stats(list(self._live.values())), **self._migration_stats(),
                   **self._counters()}
        return self._bucket_stats(out)

    def check(self) -> None:
        """Verify the invariants in the class docstring (and TLSF's); InvariantBroken if not."""
        with self._lock:
            used = self._used_ranges()
            for rid, b in self._live.items():
                require(b.request_id == rid and b._state == LIVE,
                        f"the live table maps {rid!r} to {b!r}")
                require(used.get(b.offset, (None, None)) == (b.nbytes, b._region),
                        f"block of {rid!r} is not a used range of its region")
                require(b.prompt_tokens <= b.tokens <= b.capacity_tokens,
                        f"block of {rid!r}: prompt {b.prompt_tokens} <= tokens {b.tokens} <= "
                        f"capacity {b.capacity_tokens} does not hold")
                require(b.nbytes == self.block_bytes(b.capacity_tokens),
                        f"block of {rid!r} has {b.nbytes} B for {b.capacity_tokens} tokens")
                require(b.offset % self.alignment == 0, f"block of {rid!r} is misaligned")
            require(len(used) == len(self._live) + self._migrating,
                    f"{len(used)} used ranges for {len(self._live)} live blocks and "
                    f"{self._migrating} migrations")
            self._require_tiling()
