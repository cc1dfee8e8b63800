"""The prefix cache's index: prefix keys, the entries they map to, and an entry's life.

An entry is in exactly one tier's order while indexed (order.py: which leaves first). Threads
share entries under the cache's one lock, and three marks keep them safe while bytes move outside
it:

- moving: one thread is moving the entry between tiers; only that thread changes it, no other
  thread picks it as a victim, and a restore of it waits until it settles;
- pins: restores reading its bytes; a pinned entry is never chosen as a victim;
- doomed: dropped from the index while moving or pinned; its storage is freed by the thread moving
  or reading it when that thread lets go, not by the thread that dropped it (the entry's bytes may
  still be in flight).
"""

from __future__ import annotations

import contextlib
import hashlib

import numpy as np

from odma_cli.errors import BadArgument

from allocator.errors import require
from allocator.prefix import disk

DROP_REASONS = ("corrupt", "collision", "io_error", "full")


def prefix_key(token_ids) -> str:
    """Content key of a prefix: SHA-256 of its token ids as int64 little-endian, in hex."""
    if isinstance(token_ids, (str, bytes, bytearray)):
        raise BadArgument("token_ids must be a sequence of integers, not a string")
    try:
        arr = np.asarray(token_ids)
    except (TypeError, ValueError):
        raise BadArgument("token_ids must be a sequence of integers") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu") or arr.dtype == np.bool_:
        raise BadArgument(f"token_ids must be a flat sequence of integers, got dtype {arr.dtype}"
                          f" with shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise BadArgument("token ids must fit in int64")
    return hashlib.sha256(arr.astype("<i8", copy=False).tobytes()).hexdigest()


class Entry:
    """One cached prefix. `storage` is a pool Block (device, host), a file path (disk) or None
    (accounting mode's disk tier). `size` is what it takes in its tier (block bytes, file bytes).
    moving, pins, doomed: see the module docstring. `checksum` is set once its bytes have been in
    host memory (kernels.py)."""

    __slots__ = ("key", "tokens", "nbytes", "eid", "tier", "storage", "size", "checksum",
                 "pins", "moving", "doomed", "last_use")

    def __init__(self, key: str, tokens: int, nbytes: int, eid: int):
        self.key = key
        self.tokens = tokens
        self.nbytes = nbytes
        self.eid = eid
        self.tier = None
        self.storage = None
        self.size = 0
        self.checksum = None
        self.pins = 0
        self.moving = False
        self.doomed = False
        self.last_use = 0

    def __repr__(self):
        return f"Entry({self.key!r}, {self.tokens} tokens, {self.tier})"


class EntryIndex:
    """PrefixCache's index and the life of its entries (a mixin: the state is made by
    PrefixCache.__init__). _index maps key -> Entry for every entry in a tier; _orders[tier] holds
    exactly that tier's indexed entries; _tick orders uses and arrivals; _lock guards all of it,
    and _cond (on _lock) wakes threads waiting for an entry to settle. Methods say whether the lock
    is held."""

    def _touch(self, e: Entry) -> None:
        """Lock held. `e` was just used: it becomes the most recent in lru order."""
        self._tick += 1
        e.last_use = self._tick
        if e.tier is not None:
            self._orders[e.tier].touch(e)

    def _settle_in(self, e: Entry, tier: str, storage, size: int) -> None:
        """Lock held. `e` now lives in `storage` (`size` bytes of `tier`) and joins its order."""
        e.tier, e.storage, e.size = tier, storage, size
        self._tick += 1
        self._orders[tier].add(e, self._tick)

    def _forget(self, e: Entry) -> None:
        """Lock held. Take `e` out of the index and its tier's order (its storage is the
        caller's)."""
        if self._index.get(e.key) is e:
            del self._index[e.key]
        if e.tier is not None:
            self._orders[e.tier].remove(e)

    def _drop(self, e: Entry, reason: str, unlink: list) -> None:
        """Lock held. Remove `e` from the cache, counted under `reason` (one of DROP_REASONS). Its
        storage is freed now, or by the thread moving or reading it when that ends."""
        self._forget(e)
        self.drops[reason] += 1
        if e.moving or e.pins:
            e.doomed = True
        elif e.tier is not None:
            self._free(e.tier, e.storage, e.size, unlink)
            e.tier = None

    @contextlib.contextmanager
    def _locked(self):
        """The lock, and a list for the paths of files to remove: they are removed once the lock
        is released (file system calls can be slow), whatever happened under it."""
        unlink: list = []
        try:
            with self._lock:
                yield unlink
        finally:
            for path in unlink:
                disk.remove(path)

    def _let_go(self, e: Entry, unlink: list) -> None:
        """Lock held. This thread stopped moving `e` (it cleared e.moving) or reading it (it
        dropped its pin). An entry dropped meanwhile (doomed) has its storage freed once no thread
        moves or reads it any more; threads waiting for `e` to settle are woken."""
        if e.doomed and not e.moving and not e.pins and e.tier is not None:
            self._free(e.tier, e.storage, e.size, unlink)
            e.tier = None
        self._cond.notify_all()

    def _stop_moving(self, e: Entry) -> None:
        """Lock not held. `e` stays where it is: clear its moving mark and let go."""
        with self._locked() as unlink:
            e.moving = False
            self._let_go(e, unlink)

    @contextlib.contextmanager
    def _settles(self, e: Entry):
        """Let go of `e` if an unexpected error escapes while this thread moves it, so that a
        restore waiting for it never hangs and a dropped entry's room is not leaked. Every
        _move() runs inside one (it leaves e.moving to this on such an error)."""
        try:
            yield
        except BaseException:
            if e.moving:
                self._stop_moving(e)
            raise

    def _reindex(self) -> None:
        """Lock not needed (construction). Index the prefix files a previous cache left in
        disk_dir (oldest first); drop files whose header is torn; trim to disk_bytes by the
        eviction policy."""
        valid, bad = disk.scan(self._disk_dir, self.bytes_per_token)
        for path in bad:
            disk.remove(path)
            self.drops["corrupt"] += 1
        unlink: list = []                       # files to remove: stale copies, trimmed ones
        for _, path, h, size in valid:
            old = self._index.get(h.key)
            if old is not None:                  # two files of one key: keep the newer
                self._forget(old)
                self._disk_used -= old.size
                unlink.append(old.storage)
            e = Entry(h.key, h.tokens, h.nbytes, next(self._eids))
            e.checksum = h.checksum
            self._tick += 1
            e.last_use = self._tick
            self._settle_in(e, "disk", path, size)
            self._index[e.key] = e
            self._disk_used += size
        while self._disk_used > self.capacity["disk"]:
            self._drop(self._orders["disk"].victim(lambda _e: True), "full", unlink)
        for path in unlink:
            disk.remove(path)
        self.reindexed = len(self._index)        # the files kept, trimmed ones not counted

    def _check_entry(self, key: str, e: Entry, members: dict) -> None:
        """Lock held. The index's invariants for one entry (InvariantBroken if one fails): it is
        indexed under its own key, in exactly its tier's order (members: tier -> the entries of
        its order), its payload is its tokens' bytes, and no thread is left moving, pinning or
        dooming it."""
        require(e.key == key, f"index maps {key!r} to the entry of {e.key!r}")
        require(e.tier in members, f"entry {key!r} has no tier")
        for t, m in members.items():
            require((e in m) == (t == e.tier),
                    f"entry {key!r} ({e.tier}) is{'' if e in m else ' not'} in the {t} order")
        require(e.nbytes == e.tokens * self.bytes_per_token,
                f"entry {key!r}: {e.nbytes} B for {e.tokens} tokens")
        require(not e.moving and not e.pins and not e.doomed,
                f"entry {key!r} is left moving/pinned/doomed")
