"""PrefixCache: prompt prefixes' KV bytes kept across requests in three tiers, device -> host ->
disk, as exact-size contiguous blocks.

    offer(key, block, tokens)   a request computed a prefix: copy its first `tokens` tokens into
                                the device tier (demoting others: device -> host -> disk -> dropped)
    lookup(key)                 where a prefix is (a query: schedulers call it freely)
    restore(key, block, tokens) copy a cached prefix into the start of a new request's block;
                                bytes that came through host memory are checked first
    prefetch(keys)              bring the next requests' prefixes up, evicting others
    evict(tier, nbytes)         demote until nbytes left the tier

Tiers
-----
- device: a pool of `device_bytes` on the serving device (an OracleAllocator: exact-size blocks
  in TLSF free space, the allocator's pins). Restoring from it is one device copy. On the native
  host device the pool is the same DRAM mapped lazily (memory.py).
- host: a pool of `host_bytes` in host memory (CPU tensors for torch:cpu, pinned CPU tensors for a
  torch accelerator, lazily mapped host memory otherwise: pages are taken as prefixes fill the
  tier, so a tier of many GiB costs nothing to set up).
- disk: one file per prefix in `disk_dir` (disk.py), `disk_bytes` of files at most (headers
  counted). Files outlive the cache: a new cache on the same directory re-indexes them after
  checking their headers (payload checksums are checked on every read).

Capacities are bytes, rounded and counted as tiers.py says. Eviction (lru, fifo, random: order.py)
picks victims per tier; a victim moves one tier down, the bottom tier drops it (tiers.py). A
restore from host or disk promotes the entry to the device tier, and a prefetch moves entries up
(promotion.py).

Bad bytes are never served: a mismatch of the checksum kept since the bytes were in host memory
drops the entry and the restore returns 0 tokens (transfer.py says what is checked when). A
restore with `tokens` different from the entry's is a key collision: the entry is dropped, nothing
is copied.

offer, restore and prefetch return the seconds their transfers took (evict's are in
stats()["moved_seconds"]): wall-clock on real devices, modelled from TierBandwidth otherwise
(transfer.py). A restore returns its critical path: the copy into the request's block, checksum
included; the promotion that follows runs on a background thread (real devices) and its seconds
are reported in stats()["background_seconds"].

Threads: one lock guards the index and both pools' bookkeeping; bytes move outside it, with the
entries they touch marked moving or pinned (index.py). Request blocks are pinned (BlockPin) while
bytes move in or out of them, so a release waits for the copy. Every public call first waits for
background promotions to finish, so a single-threaded caller sees exactly the decisions
accounting mode makes.

PrefixCache is assembled from mixins that share its state: EntryIndex (index.py), TierSpace
(tiers.py), Transfers (transfer.py), Promotions (promotion.py) and CacheCounters (counters.py:
the counters and stats()). This module holds the public calls, construction, the invariants'
check and lifetime.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import threading
import weakref

from odma_cli.errors import BadArgument

from allocator.arguments import count, positive_count
from allocator.contiguous import Block
from allocator.errors import AllocatorClosed, require
from allocator.pool import resolve_device
from allocator.prefix import disk
from allocator.prefix.counters import CacheCounters
from allocator.prefix.index import DROP_REASONS, Entry, EntryIndex, prefix_key
from allocator.prefix.memory import move, tier_devices
from allocator.prefix.order import EVICTIONS, TierOrder
from allocator.prefix.promotion import PromotionQueue, Promotions
from allocator.prefix.tiers import POOL_ALIGNMENT, TIERS, TierSpace
from allocator.prefix.transfer import TierBandwidth, TransferFailed, Transfers

WORKER_IDLE_S = 2.0         # the promotion worker exits after this long without work
MAX_BYTES = (1 << 63) - 1   # sizes beyond a signed 64-bit byte offset address nothing real


def _byte_count(name: str, v, positive: bool = False) -> int:
    """A size in bytes: an integer >= 0 (> 0 when `positive`) and at most MAX_BYTES."""
    v = (positive_count if positive else count)(name, v)
    if v > MAX_BYTES:
        raise BadArgument(f"{name} must be at most 2**63 - 1 bytes, got about "
                          f"2**{v.bit_length() - 1}")
    return v


def _checked_arguments(device, bytes_per_token, device_bytes, host_bytes, disk_bytes, disk_dir,
                       eviction, seed, verify, bandwidth) -> tuple[int, dict, int]:
    """(bytes per token, capacity by tier, seed) of PrefixCache's arguments, each checked
    (BadArgument for the first that is amiss) before anything is opened or allocated."""
    bytes_per_token = _byte_count("bytes_per_token", bytes_per_token, positive=True)
    capacity = {"device": _byte_count("device_bytes", device_bytes),
                "host": _byte_count("host_bytes", host_bytes),
                "disk": _byte_count("disk_bytes", disk_bytes)}
    if eviction not in EVICTIONS:
        raise BadArgument(f"unknown eviction {eviction!r}: expected one of "
                          f"{', '.join(EVICTIONS)}")
    seed = count("seed", seed)
    if not isinstance(verify, bool):
        raise BadArgument(f"verify must be True or False, got {verify!r}")
    if bandwidth is not None and not isinstance(bandwidth, TierBandwidth):
        raise BadArgument(f"bandwidth must be a TierBandwidth, got {bandwidth!r}")
    if device is None:
        if bandwidth is None:
            raise BadArgument("accounting mode (device=None) models seconds: pass "
                              "bandwidth=TierBandwidth(...)")
        if disk_dir is not None:
            raise BadArgument("accounting mode (device=None) stores no bytes: disk_dir "
                              "must be None")
    elif capacity["disk"] and disk_dir is None:
        raise BadArgument("a disk tier (disk_bytes > 0) needs disk_dir")
    return bytes_per_token, capacity, seed


def _release(queue: PromotionQueue, pools: dict, owned: list) -> None:
    """Stop the promotion worker, free the device and host tiers' memory, close the devices the
    cache opened: close() calls it, and so does the garbage collector for a cache dropped without
    close() (it holds no reference to the cache)."""
    queue.stop()
    try:
        for tier in ("device", "host"):
            pool, pools[tier] = pools[tier], None
            if pool is not None:
                pool.close()
    finally:
        while owned:
            owned.pop().close()


class PrefixCache(EntryIndex, TierSpace, Transfers, Promotions, CacheCounters):
    """A tiered prefix cache of contiguous KV blocks (see the module docstring).

    device: the serving Device, a spec string (opened and closed by the cache), or None for
    accounting only (no bytes anywhere: the same decisions, sizes and statistics; seconds from
    `bandwidth`, which is then required). A tier of 0 bytes does not exist. disk_dir: required
    for a disk tier with bytes, refused in accounting mode.
    """

    def __init__(self, device, bytes_per_token: int, *, device_bytes: int = 0,
                 host_bytes: int = 0, disk_bytes: int = 0, disk_dir: str | None = None,
                 eviction: str = "lru", seed: int = 0, verify: bool = True,
                 bandwidth: TierBandwidth | None = None):
        self.bytes_per_token, capacity, seed = _checked_arguments(
            device, bytes_per_token, device_bytes, host_bytes, disk_bytes, disk_dir, eviction,
            seed, verify, bandwidth)
        self.eviction = eviction
        self.verify = verify
        self.capacity = capacity
        self._disk_dir = None if disk_dir is None else disk.check_dir(disk_dir)

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._closed = True                       # until construction succeeds
        self._pools: dict = {"device": None, "host": None}
        self._host_device = None
        self._owned_devices: list = []
        self._queue = PromotionQueue(WORKER_IDLE_S)
        self._finalizer = weakref.finalize(self, _release, self._queue, self._pools,
                                           self._owned_devices)
        self.device, owns = resolve_device(device)
        try:
            if owns:
                self._owned_devices.append(self.device)
            self.holds_bytes = self.device is not None
            self._modelled = self.device is None or self.device.info.kind == "emu"
            if bandwidth is None and self.device is not None and self._modelled:
                bandwidth = TierBandwidth(device_copy_gbps=self.device.info.peak_gbps or 1.0)
            self.bandwidth = bandwidth
            tier_dev = {"device": None, "host": None}
            if self.holds_bytes:
                tier_dev["device"], tier_dev["host"], opened = tier_devices(
                    self.device, capacity["device"] > 0, capacity["host"] > 0)
                self._owned_devices.extend(opened)
                self._host_device = tier_dev["host"]
            for tier in ("device", "host"):
                if capacity[tier]:
                    self._pools[tier] = self._make_pool(tier, tier_dev[tier], capacity[tier])
        except BaseException:
            self._finalizer()
            raise

        self._rng = random.Random(seed)
        self._index: dict[str, Entry] = {}
        self._orders = {t: TierOrder(eviction, self._rng) for t in TIERS}
        self._tick = 0
        self._eids = itertools.count(1)
        self._disk_used = 0
        self._active = 0                          # public calls running
        self._start_counting()
        self._closed = False
        if self._disk_dir is not None and capacity["disk"]:
            try:
                self._reindex()
            except BaseException:
                self._closed = True
                self._finalizer()
                raise

    # -- checks of a public call's arguments and state ---------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise AllocatorClosed("this prefix cache is closed")

    @contextlib.contextmanager
    def _op(self):
        """A public call: wait for queued promotions (so decisions follow the calls' order),
        refuse a closed cache, and keep close() waiting until the call is over."""
        self._drain()
        with self._lock:
            self._check_open()
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                self._cond.notify_all()

    @staticmethod
    def _key(key) -> str:
        if not isinstance(key, str):
            raise BadArgument(f"a prefix key must be a string, got {key!r}")
        try:                                     # the disk tier names and stores keys as UTF-8
            raw = key.encode()
        except UnicodeEncodeError:
            raise BadArgument("a prefix key must be encodable as UTF-8 (no lone surrogates)") \
                from None
        if len(raw) > disk.MAX_KEY_BYTES:
            raise BadArgument(f"a prefix key must be at most {disk.MAX_KEY_BYTES} UTF-8 bytes")
        return key

    def _check_block(self, block, what: str) -> int:
        """The block's capacity in tokens; BadArgument for something that is not a block here."""
        cap = getattr(block, "capacity_tokens", None)
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise BadArgument(f"{what} needs a KV block (an object with capacity_tokens), got "
                              f"{block!r}")
        if self.holds_bytes and not isinstance(block, Block):
            raise BadArgument(f"{what} needs a Block of a ContiguousPool when the cache holds "
                              f"bytes, got {type(block).__name__}")
        return cap

    # -- the copy between two places that Transfers makes ------------------------------------------
    @staticmethod
    def _copy(src, dst, nbytes: int, checksum: bool):
        """memory.move, looked up in this module at each call: replacing cache.move (as the tests
        do, to hold a restore mid-copy) replaces every such copy."""
        return move(src, dst, nbytes, checksum=checksum)

    # -- the API ---------------------------------------------------------------------------------
    def lookup(self, key) -> tuple[str | None, int]:
        """(tier holding the prefix, its tokens), or (None, 0). A pure query: it neither counts
        as a hit or miss nor refreshes recency."""
        key = self._key(key)
        self._drain()
        with self._lock:
            self._check_open()
            e = self._index.get(key)
            return (None, 0) if e is None else (e.tier, e.tokens)

    def restore(self, key, block, tokens: int | None = None) -> tuple[int, float]:
        """Copy the cached prefix `key` into the start of `block` and promote it to the device
        tier. Returns (tokens covered, seconds of the copy into the block). A miss returns
        (0, 0.0); a key collision (tokens given and different) drops the entry and returns
        (0, 0.0); bad bytes (checksum) or a failed read drop the entry and return (0, seconds
        spent). Covers min(entry's tokens, block's capacity) tokens; a partial restore does not
        promote. `tokens`, when given, must be > 0 (no entry has 0 tokens: 0 would only ever
        drop the entry as a collision)."""
        key = self._key(key)
        want = None if tokens is None else positive_count("tokens", tokens)
        cap = self._check_block(block, "restore")
        with self._op():
            # pin the block first: one that cannot take the bytes (stale, released, too small
            # for `cap` tokens) raises here, before the cache changes anything
            pin = block.pin(cap * self.bytes_per_token, writing=True) if self.holds_bytes else None
            try:
                return self._restore(key, block, want, cap, pin)
            finally:
                if pin is not None:
                    pin.release()

    def _restore(self, key: str, block, want: int | None, cap: int, pin) -> tuple[int, float]:
        with self._locked() as unlink:
            e = self._index.get(key)
            while e is not None and e.moving:
                self._cond.wait()
                e = self._index.get(key)
            if e is None:
                self.misses += 1
                return 0, 0.0
            if want is not None and want != e.tokens:
                self._drop(e, "collision", unlink)
                self.misses += 1
                return 0, 0.0
            cover = min(e.tokens, cap)
            if cover == 0:
                self.misses += 1
                return 0, 0.0
            tier = e.tier
            e.pins += 1
            self._touch(e)
        n = cover * self.bytes_per_token
        failure = None
        try:
            seconds = self._transfer(e, tier, e.storage, "request", pin, n)
        except TransferFailed as exc:
            failure, seconds = exc.args
        except BaseException:
            with self._locked() as unlink:
                e.pins -= 1
                self._let_go(e, unlink)
            raise
        with self._locked() as unlink:
            e.pins -= 1
            self._account(tier, "request", n, seconds)
            if failure is not None:
                self.misses += 1
                if not e.doomed:
                    self._drop(e, failure, unlink)
            self._let_go(e, unlink)
        if failure is not None:
            return 0, seconds
        if hasattr(block, "mark_written"):
            block.mark_written(n)     # under the caller's pin: a migration cannot slip in between
        with self._lock:
            self.hits[tier] += 1
            self.covered_tokens += cover
            promote = (tier != "device" and cover == e.tokens and not e.doomed
                       and self._could_hold("device", e))
        if promote:
            source = block.pin(n, writing=False) if self.holds_bytes else block
            self._promote_in_background(e, source)
        return cover, seconds

    def offer(self, key, block, tokens: int) -> float:
        """Keep the first `tokens` tokens of `block` as the prefix `key`, in the device tier (or
        the highest tier that can hold it), demoting others by the eviction policy. Already cached
        with as many tokens: refresh its recency only; with a different length: a collision, the
        old entry is dropped and this one kept. Returns seconds; a prefix no tier can take is
        dropped (counted as full), never an error."""
        key = self._key(key)
        tokens = positive_count("tokens", tokens)
        cap = self._check_block(block, "offer")
        if tokens > cap:
            raise BadArgument(f"cannot offer {tokens} tokens of a block of {cap}")
        with self._op():
            return self._offer(key, block, tokens)

    def _offer(self, key: str, block, tokens: int) -> float:
        # pin the block first: one that cannot give the bytes (stale, released, too small) raises
        # here, before a colliding entry is dropped or anything is counted
        nbytes = tokens * self.bytes_per_token
        pin = block.pin(nbytes, writing=False) if self.holds_bytes else block
        try:
            with self._locked() as unlink:
                self.offers += 1
                old = self._index.get(key)
                if old is not None:
                    if old.tokens == tokens:
                        self._touch(old)
                        return 0.0
                    self._drop(old, "collision", unlink)
                e = Entry(key, tokens, nbytes, next(self._eids))
                e.moving = True
                self._tick += 1
                e.last_use = self._tick
            seconds = 0.0
            for tier in TIERS:
                if not self._could_hold(tier, e):
                    continue
                room, s = self._make_room(tier, e, frozenset((key,)))
                seconds += s
                if room is not None:
                    return seconds + self._store(e, tier, room, pin)
            with self._lock:
                self.drops["full"] += 1
            return seconds
        finally:
            if self.holds_bytes:
                pin.release()

    def prefetch(self, keys) -> float:
        """Bring the prefixes `keys` (nearest need first) up: each to the device tier if room can
        be made there, else (from disk) to the host tier, evicting entries not in `keys`.
        Unknown keys are skipped. Returns seconds."""
        if isinstance(keys, str):
            raise BadArgument("prefetch takes a list of keys, not one string")
        try:
            wanted = list(dict.fromkeys(self._key(k) for k in keys))
        except TypeError:
            raise BadArgument(f"prefetch takes an iterable of keys, got {keys!r}") from None
        with self._op():
            return self._prefetch(wanted)

    def evict(self, tier: str, nbytes: int) -> None:
        """Demote entries of `tier` by the eviction policy until at least `nbytes` bytes (as the
        tier counts them) have left it, or nothing evictable is left."""
        if tier not in TIERS:
            raise BadArgument(f"unknown tier {tier!r}: expected one of {', '.join(TIERS)}")
        nbytes = count("nbytes", nbytes)
        with self._op():
            freed = 0
            while freed < nbytes:
                with self._lock:
                    v = self._orders[tier].victim(self._movable(frozenset()))
                    if v is None:
                        return
                    v.moving = True
                    freed += v.size
                self._demote(v, frozenset())

    # -- invariants --------------------------------------------------------------------------------
    def check(self) -> None:
        """Verify the invariants (InvariantBroken if one fails): every indexed entry is in
        exactly its tier's order and holds its tier's storage (EntryIndex._check_entry,
        TierSpace._check_storage); each tier's reserved bytes match its pool (or the disk count)
        and stay within its capacity (TierSpace._check_space); no entry is left moving, pinned or
        doomed, and no promotion left running, once calls return."""
        self._drain()
        with self._lock:
            members = {t: set(self._orders[t].members()) for t in TIERS}
            for key, e in self._index.items():
                self._check_entry(key, e, members)
                self._check_storage(key, e)
            total = sum(len(m) for m in members.values())
            require(total == len(self._index), f"{total} ordered entries, "
                                               f"{len(self._index)} indexed")
            for t in TIERS:
                for problem in self._orders[t].check():
                    require(False, problem)
            self._check_space(members)
            require(self._queue.jobs == 0, "background promotions left running")

    # -- lifetime ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for background promotions, free the device and host tiers' memory, close devices
        the cache opened. Disk files stay (a new cache on the directory re-indexes them).
        Idempotent; after it lookup, restore, offer, prefetch and evict raise AllocatorClosed
        (stats() and check() still answer, for an empty cache)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True                  # new calls are refused from here on
            while self._active:                  # running calls finish ...
                self._cond.wait()
        self._drain()                            # ... and the promotions they queued
        with self._lock:
            self._index.clear()
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        caps = ", ".join(f"{t} {self.capacity[t]} B" for t in TIERS)
        return (f"PrefixCache({None if self.device is None else self.device.spec}, "
                f"{self.bytes_per_token} B/token, {caps}, {self.eviction})")


__all__ = ["TIERS", "EVICTIONS", "DROP_REASONS", "POOL_ALIGNMENT", "prefix_key", "PrefixCache",
           "TierBandwidth"]
