"""The prefix cache's tiers: their space, and moving entries into and between them.

Space: the device and host tiers are pools (OracleAllocator: exact-size blocks in TLSF free
space) that round blocks up to POOL_ALIGNMENT bytes, or the device's own alignment where that is
larger (no supported device's is), in accounting mode too, so the same calls make the same
decisions with bytes or without. The disk tier counts file bytes, headers included
(disk.file_bytes), against its capacity.

Eviction: room for an entry is reserved before its bytes move. Where a tier has none, victims
(by the tier's order, order.py, skipping entries moving, pinned, doomed or protected) move one tier
down, to the next tier that can hold them, making room there the same way; the bottom tier drops
them. A move settles the index only once its bytes have arrived: until then the entry is marked
moving and stays where it was (index.py).
"""

from __future__ import annotations

from odma_cli.errors import BadArgument

from allocator.config import AllocatorConfig
from allocator.errors import OutOfMemory, require
from allocator.prefix import disk
from allocator.prefix.index import Entry
from allocator.prefix.transfer import TransferFailed

TIERS = ("device", "host", "disk")  # top to bottom: eviction moves down, promotion up
POOL_ALIGNMENT = 256        # block rounding of both pools on every device (and in accounting)
MAX_ROOM_ROUNDS = 10_000    # victims one make-room may demote before giving up


class TierSpace:
    """PrefixCache's tier space and eviction (a mixin: the state is made by PrefixCache.__init__).
    capacity[tier] is each tier's bytes; _pools[tier] the device and host pools (None for a tier
    of 0 bytes, and once closed); _disk_used the disk tier's reserved bytes. Reserved room is
    counted at once, under the lock, so two threads never reserve the same bytes."""

    def _make_pool(self, tier: str, dev, nbytes: int):
        from allocator.placement import OracleAllocator

        align = max(POOL_ALIGNMENT, dev.alignment if dev is not None else 0)
        usable = nbytes & ~(align - 1)
        max_tokens = usable // self.bytes_per_token
        if max_tokens == 0:
            raise BadArgument(f"{tier}_bytes={nbytes} cannot hold one token of "
                              f"{self.bytes_per_token} B (after {align}-byte alignment)")
        config = AllocatorConfig(byte_alignment=align, large_share=0.0, background_refresh=False)
        return OracleAllocator(dev, usable, self.bytes_per_token, max_tokens, config)

    def _could_hold(self, tier: str, e: Entry) -> bool:
        """Whether `tier` could hold `e` were it empty."""
        if tier == "disk":         # a disk tier with bytes always has its directory (__init__)
            return self.capacity["disk"] >= disk.file_bytes(e.nbytes)
        pool = self._pools[tier]
        return pool is not None and e.tokens <= pool.max_tokens

    def _reserve(self, tier: str, e: Entry):
        """Lock held. (storage, size) of new room for `e` in `tier`, or None when it does not fit
        now."""
        if tier == "disk":
            size = disk.file_bytes(e.nbytes)
            if self._disk_used + size > self.capacity["disk"]:
                return None
            self._disk_used += size
            path = None if self._disk_dir is None else disk.new_path(self._disk_dir, e.key)
            return path, size
        try:
            blk = self._pools[tier].reserve(e.eid, e.tokens - 1, 1.0)   # exactly e.tokens
        except OutOfMemory:
            return None
        return blk, blk.nbytes

    def _free(self, tier: str, storage, size: int, unlink: list) -> None:
        """Lock held. Give back room in `tier`; file paths to remove go to `unlink` (removed
        outside the lock)."""
        if tier == "disk":
            self._disk_used -= size
            if storage is not None:
                unlink.append(storage)
        elif storage is not None:
            self._pools[tier].release(storage.request_id)

    # -- eviction (no lock held) -------------------------------------------------------------------
    def _movable(self, protect):
        return lambda v: not (v.moving or v.pins or v.doomed or v.key in protect)

    def _make_room(self, tier: str, e: Entry, protect: frozenset):
        """Reserve room for `e` in `tier`, demoting victims as needed. Returns
        ((storage, size) or None, seconds spent demoting)."""
        seconds = 0.0
        for _ in range(MAX_ROOM_ROUNDS):
            with self._lock:
                got = self._reserve(tier, e)
                if got is not None:
                    return got, seconds
                victim = self._orders[tier].victim(self._movable(protect))
                if victim is None:
                    return None, seconds
                victim.moving = True
            seconds += self._demote(victim, protect)
        return None, seconds

    def _demote(self, v: Entry, protect: frozenset) -> float:
        """Move victim `v` (marked moving by the caller) to the next lower tier that takes it,
        or drop it. Returns seconds."""
        with self._settles(v):
            return self._demote_moving(v, protect)

    def _demote_moving(self, v: Entry, protect: frozenset) -> float:
        src = v.tier
        seconds = 0.0
        for lower in TIERS[TIERS.index(src) + 1:]:
            if not self._could_hold(lower, v):
                continue
            room, s = self._make_room(lower, v, protect)
            seconds += s
            if room is not None:
                return seconds + self._move(v, src, lower, room, v.storage, evicted=True)[0]
        with self._locked() as unlink:
            self.evictions[src] += 1
            if not v.doomed:
                self._drop(v, "full", unlink)    # still moving: only marked doomed
            v.moving = False
            self._let_go(v, unlink)              # frees it
        return seconds

    # -- moving entries in (no lock held) ----------------------------------------------------------
    def _store(self, e: Entry, tier: str, room, source) -> float:
        """Copy a new entry from the request's block into its reserved room and index it."""
        storage, size = room
        failure = None
        try:
            seconds = self._transfer(e, "request", source, tier, storage)
        except TransferFailed as exc:
            failure, seconds = exc.args
        except BaseException:
            with self._locked() as unlink:
                self._free(tier, storage, size, unlink)
            raise
        with self._locked() as unlink:
            self._account("request", tier, e.nbytes, seconds)
            e.moving = False
            if failure is not None or self._closed or e.key in self._index:
                self._free(tier, storage, size, unlink)    # failed, or another thread won
                if failure is not None:
                    self.drops[failure] += 1
            else:
                self._settle_in(e, tier, storage, size)
                self._index[e.key] = e
            self._cond.notify_all()
        return seconds

    def _move(self, e: Entry, src: str, dst: str, room, src_storage, *,
              evicted: bool) -> tuple[float, bool]:
        """Move `e` (marked moving, inside _settles(e)) from `src` (its tier, or "request" for a
        promotion copied from a request's block `src_storage`) into the reserved `room` of tier
        `dst`; settle the index. A failed transfer drops the entry, except a failed promotion,
        which leaves it where it was. Returns (seconds, whether `e` is now in `dst`)."""
        storage, size = room
        failure = None
        try:
            seconds = self._transfer(e, src, src_storage, dst, storage)
        except TransferFailed as exc:
            failure, seconds = exc.args
        except BaseException:
            with self._locked() as unlink:
                self._free(dst, storage, size, unlink)
            raise
        with self._locked() as unlink:
            old_tier = e.tier
            self._account(src, dst, e.nbytes, seconds)
            if evicted:
                self.evictions[old_tier] += 1
            moved = failure is None and not e.doomed
            if moved:
                self._orders[old_tier].remove(e)
                self._free(old_tier, e.storage, e.size, unlink)
                self._settle_in(e, dst, storage, size)
            else:
                self._free(dst, storage, size, unlink)
                # a promotion copies from the request's block, not from the entry's storage: its
                # failure says nothing against the entry, which stays where it is
                if failure is not None and not e.doomed and src != "request":
                    self._drop(e, failure, unlink)   # still moving: only marked doomed
            e.moving = False
            self._let_go(e, unlink)                  # frees a doomed entry's old storage
        return seconds, moved

    # -- invariants (lock held) --------------------------------------------------------------------
    def _check_storage(self, key: str, e: Entry) -> None:
        """`e` holds a live block of its size in its pool (device, host) or, on disk, a file path
        and a file size matching its payload (the file itself is checked when read); bytes that
        went through host memory have their checksum."""
        if e.tier == "disk":
            require(e.size == disk.file_bytes(e.nbytes), f"entry {key!r}: disk size off")
            if self.holds_bytes:        # disk reads are checked whatever `verify` says
                require(isinstance(e.storage, str), f"entry {key!r} has no file")
                require(e.checksum is not None, f"entry {key!r} on disk has no checksum")
            return
        pool = self._pools[e.tier]
        require(pool is not None, f"entry {key!r} is in a {e.tier} tier of 0 B")
        blk = e.storage
        require(blk.live and pool.block(e.eid) is blk,
                f"entry {key!r}: its block is not live in the {e.tier} pool")
        require(blk.capacity_tokens == e.tokens and e.size == blk.nbytes,
                f"entry {key!r}: block of {blk.capacity_tokens} tokens / {blk.nbytes} B")
        if e.tier == "host" and self.holds_bytes:
            require(e.checksum is not None, f"entry {key!r} in host has no checksum")

    def _check_space(self, members: dict) -> None:
        """Each tier's reserved bytes match its pool (or the disk count) and stay within its
        capacity (members: tier -> the entries of its order)."""
        for tier in ("device", "host"):
            pool = self._pools[tier]
            if pool is None:
                continue
            pool.check()
            used = sum(e.size for e in members[tier])
            require(pool.reserved_bytes == used,
                    f"{tier} pool reserves {pool.reserved_bytes} B, entries hold {used}")
            require(len(pool) == len(members[tier]),
                    f"{tier} pool has {len(pool)} blocks for {len(members[tier])} entries")
            require(used <= self.capacity[tier], f"{tier} tier holds {used} B > capacity")
        disk_used = sum(e.size for e in members["disk"])
        require(disk_used == self._disk_used,
                f"disk count {self._disk_used} B, files {disk_used} B")
        require(disk_used <= self.capacity["disk"], "disk tier over capacity")
