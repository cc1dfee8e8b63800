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
  host device the pool is the same DRAM mapped lazily (allocator/prefix/memory.py).
- host: a pool of `host_bytes` in host memory (CPU tensors for torch:cpu, pinned CPU tensors for a
  torch accelerator, lazily mapped host memory otherwise: pages are taken as prefixes fill the
  tier, so a tier of many GiB costs nothing to set up).
- disk: one file per prefix in `disk_dir` (allocator/prefix/disk.py), `disk_bytes` of files at
  most (headers counted). Files outlive the cache: a new cache on the same directory re-indexes
  them after checking their headers (payload checksums are checked on every read).

Capacities are bytes. Both pools round blocks up to POOL_ALIGNMENT bytes (or the device's own
alignment where that is larger; no supported device's is), in accounting mode too, so the same calls
make the same decisions with bytes or without.

Eviction (lru, fifo, random: allocator/prefix/order.py) picks victims per tier; a victim moves
one tier down (to the next tier that can hold it), making room there the same way; the bottom
tier drops it. Promotion goes straight to the device tier, skipping host on the way up from disk: a
prefix just reused is the likeliest to be reused next, and a restore from the device tier is one
device copy. A restore from host or disk queues the entry's move to the device tier (copied from the
request's freshly restored block, a device-internal copy) and a prefetch moves entries up
synchronously.

Integrity
---------
Bytes in host memory carry a checksum (allocator/prefix/kernels.py), computed in the pass that
brings them there. Disk reads are always checked; host-tier reads are checked when `verify`
(default). A mismatch drops the entry (counted as corrupt) and the restore returns 0 tokens:
the caller recomputes, and bad bytes are never reported as a prefix. Bytes bound for a request's
block that holds bytes of its own (Block.written) are checked before they are copied (one more
read of them), so a bad entry leaves the request's bytes as they were; bytes bound for a fresh
block or a tier are checked in the pass that copies them. A restore with `tokens`
different from the entry's is a key collision: the entry is dropped, nothing is copied. A
promotion copies from the request's block, whose bytes the restore just checked, and does not
check them again on the device; a failed promotion leaves the entry where it was.

Seconds
-------
offer, restore and prefetch return the seconds their transfers took (evict's are in
stats()["moved_seconds"]): wall-clock on real devices (host, torch, CUDA, MLU); modelled from
TierBandwidth in accounting mode (device=None) and on emulated devices (whose own Device.copy
models device-internal copies). A restore returns its critical path:
the copy into the request's block, checksum included; the promotion that follows runs on a
background thread (real devices) and its seconds are reported in stats()["background_seconds"].

Threads
-------
One lock guards the index and both pools' bookkeeping; bytes move outside it. An entry being read
by a restore is pinned and never chosen as a victim; an entry being moved is marked moving, and
a restore of it waits until it settles; an entry dropped meanwhile is freed by the thread moving or
reading it when that thread lets go. Request blocks are pinned (BlockPin) while bytes move in or
out of them, so a release waits for the copy. Every public call first waits for background
promotions to finish, so a single-threaded caller sees exactly the decisions accounting mode makes.
The promotion worker holds no reference to the cache while it waits for work: a cache dropped
without close() is freed when its last reference goes, memory and worker thread with it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import math
import random
import threading
import time
import weakref

import numpy as np

from odma_hw.errors import BadArgument, DeviceError

from allocator.arguments import count, positive_count
from allocator.config import AllocatorConfig
from allocator.contiguous import Block
from allocator.errors import AllocatorClosed, OutOfMemory, require
from allocator.pool import BlockPin, resolve_device
from allocator.prefix import disk
from allocator.prefix.kernels import copy_digest, digest
from allocator.prefix.memory import host_view, move, tier_devices
from allocator.prefix.order import TierOrder

TIERS = ("device", "host", "disk")
EVICTIONS = ("lru", "fifo", "random")
DROP_REASONS = ("corrupt", "collision", "io_error", "full")
POOL_ALIGNMENT = 256        # block rounding of both pools on every device (and in accounting)
MAX_ROOM_ROUNDS = 10_000    # victims one make-room may demote before giving up
WORKER_IDLE_S = 2.0         # the promotion worker exits after this long without work
MAX_BYTES = (1 << 63) - 1   # sizes beyond a signed 64-bit byte offset address nothing real


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


def _byte_count(name: str, v, positive: bool = False) -> int:
    """A size in bytes: an integer >= 0 (> 0 when `positive`) and at most MAX_BYTES."""
    v = (positive_count if positive else count)(name, v)
    if v > MAX_BYTES:
        raise BadArgument(f"{name} must be at most 2**63 - 1 bytes, got about "
                          f"2**{v.bit_length() - 1}")
    return v


def _bandwidth(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
        raise BadArgument(f"{name} must be a finite number > 0 (GB/s), got {v!r}")
    return float(v)


@dataclasses.dataclass(frozen=True)
class TierBandwidth:
    """Bandwidths in GB/s (1e9 B/s) that modelled seconds are computed from (accounting mode,
    emulated devices). device_copy_gbps counts read + write, as a streaming copy's bandwidth is
    quoted here (odma-hw probe's `copy`, the serving timing's copy_gbps): copying n bytes within
    the device takes 2n / device_copy_gbps. Links count the bytes moved once."""

    device_copy_gbps: float
    host_to_device_gbps: float = 25.0    # PCIe 4.0 x16 effective (MLU370-X4)
    device_to_host_gbps: float = 25.0
    disk_read_gbps: float = 3.0          # an NVMe SSD
    disk_write_gbps: float = 2.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _bandwidth(f.name, getattr(self, f.name))

    def seconds(self, src: str, dst: str, nbytes: int) -> float:
        """Modelled seconds to move `nbytes` from `src` to `dst`, each a tier name or "request"
        (a request's block: device memory). Disk <-> device goes through host memory, one hop
        after the other."""
        on_device = ("request", "device")
        g = 1e9
        if src in on_device and dst in on_device:
            return 2 * nbytes / (self.device_copy_gbps * g)
        s = 0.0
        if src == "disk":
            s += nbytes / (self.disk_read_gbps * g)
        if dst == "disk":
            s += nbytes / (self.disk_write_gbps * g)
        if src in on_device:
            s += nbytes / (self.device_to_host_gbps * g)
        if dst in on_device:
            s += nbytes / (self.host_to_device_gbps * g)
        return s


class _Entry:
    """One cached prefix. `storage` is a pool Block (device, host), a file path (disk) or None
    (accounting mode's disk tier). `size` is what it takes in its tier (block bytes, file bytes).
    moving: a thread is moving it between tiers (only that thread changes it); pins: restores
    reading it; doomed: dropped from the index while moving or pinned (freed when they end)."""

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
        return f"_Entry({self.key!r}, {self.tokens} tokens, {self.tier})"


class _PromotionQueue:
    """A cache's background promotions: jobs (callables) and the worker thread that runs them.
    The cache and its worker share this and it references no cache, so an idle worker keeps no
    cache alive: a cache dropped without close() is freed at once, and its finalizer stops the
    worker. A queued job references its cache, which therefore lives until its jobs ran.

    jobs counts jobs queued or running; errors keeps what the latest failed jobs raised (bounded,
    as a long run may fail many)."""

    def __init__(self):
        # reentrant: the finalizer that calls stop() runs in whichever thread drops the cache or
        # collects it, the worker included, possibly while that thread holds this lock
        self.cond = threading.Condition(threading.RLock())
        self.pending: collections.deque = collections.deque()
        self.jobs = 0
        self.errors: collections.deque = collections.deque(maxlen=10)
        self._running = False
        self._stopped = False

    def submit(self, job) -> None:
        """Queue `job` for the worker (started on first use; it exits after WORKER_IDLE_S without
        work, so an idle cache holds no thread)."""
        with self.cond:
            self.jobs += 1
            self.pending.append(job)
            self.cond.notify_all()
            if self._running:
                return
            self._running = True
        try:
            threading.Thread(target=self.work, name="odma-prefix-promote", daemon=True).start()
        except RuntimeError:        # no thread to be had: the caller runs the queue itself
            self.work(idle_s=0.0)

    def work(self, idle_s: float | None = None) -> None:
        if idle_s is None:
            idle_s = WORKER_IDLE_S
        while True:
            with self.cond:
                idle_until = time.monotonic() + idle_s
                while not self.pending:
                    left = idle_until - time.monotonic()
                    if left <= 0 or self._stopped:
                        self._running = False
                        return
                    self.cond.wait(left)
                job = self.pending.popleft()
            try:
                job()
            except Exception as exc:  # noqa: BLE001 - the worker must outlive any job
                with self.cond:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                # let go of the job's cache before waiting for the next (its last reference may be
                # this one: the cache is then finalized here, which stops this worker)
                job = None
                with self.cond:
                    self.jobs -= 1
                    self.cond.notify_all()

    def drain(self) -> None:
        """Wait until no job is queued or running."""
        with self.cond:
            while self.jobs:
                self.cond.wait()

    def stop(self) -> None:
        """The worker exits as soon as the queue is empty."""
        with self.cond:
            self._stopped = True
            self.cond.notify_all()


def _release(queue: _PromotionQueue, pools: dict, owned: list) -> None:
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


class _Failed(Exception):
    """A transfer that failed for a reason the cache counts: args = (drop reason, seconds it
    spent)."""


class PrefixCache:
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
        self.bytes_per_token = _byte_count("bytes_per_token", bytes_per_token, positive=True)
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
        self._queue = _PromotionQueue()
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
        self._index: dict[str, _Entry] = {}
        self._orders = {t: TierOrder(eviction, self._rng) for t in TIERS}
        self._tick = 0
        self._eids = itertools.count(1)
        self._disk_used = 0
        self._active = 0                          # public calls running
        self.hits = dict.fromkeys(TIERS, 0)
        self.misses = 0
        self.covered_tokens = 0
        self.evictions = dict.fromkeys(TIERS, 0)
        self.drops = dict.fromkeys(DROP_REASONS, 0)
        self.moved_bytes: dict = collections.defaultdict(int)
        self.moved_seconds: dict = collections.defaultdict(float)
        self.background_seconds = 0.0
        self.offers = 0
        self.promotions = 0
        self.prefetched = 0
        self.reindexed = 0
        self._closed = False
        if self._disk_dir is not None and capacity["disk"]:
            try:
                self._reindex()
            except BaseException:
                self._closed = True
                self._finalizer()
                raise

    # -- construction helpers --------------------------------------------------------------------
    def _make_pool(self, tier: str, dev, nbytes: int):
        from allocator.policies import OracleAllocator

        align = max(POOL_ALIGNMENT, dev.alignment if dev is not None else 0)
        usable = nbytes & ~(align - 1)
        max_tokens = usable // self.bytes_per_token
        if max_tokens == 0:
            raise BadArgument(f"{tier}_bytes={nbytes} cannot hold one token of "
                              f"{self.bytes_per_token} B (after {align}-byte alignment)")
        config = AllocatorConfig(byte_alignment=align, large_share=0.0, background_refresh=False)
        return OracleAllocator(dev, usable, self.bytes_per_token, max_tokens, config)

    def _reindex(self) -> None:
        """Index the prefix files a previous cache left in disk_dir (oldest first); drop files
        whose header is torn; trim to disk_bytes by the eviction policy."""
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
            e = _Entry(h.key, h.tokens, h.nbytes, next(self._eids))
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

    # -- small helpers (lock held unless said otherwise) --------------------------------------------
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

    def _touch(self, e: _Entry) -> None:
        self._tick += 1
        e.last_use = self._tick
        if e.tier is not None:
            self._orders[e.tier].touch(e)

    def _settle_in(self, e: _Entry, tier: str, storage, size: int) -> None:
        e.tier, e.storage, e.size = tier, storage, size
        self._tick += 1
        self._orders[tier].add(e, self._tick)

    def _forget(self, e: _Entry) -> None:
        """Take `e` out of the index and its tier's order (its storage is the caller's)."""
        if self._index.get(e.key) is e:
            del self._index[e.key]
        if e.tier is not None:
            self._orders[e.tier].remove(e)

    def _could_hold(self, tier: str, e: _Entry) -> bool:
        if tier == "disk":         # a disk tier with bytes always has its directory (__init__)
            return self.capacity["disk"] >= disk.file_bytes(e.nbytes)
        pool = self._pools[tier]
        return pool is not None and e.tokens <= pool.max_tokens

    def _reserve(self, tier: str, e: _Entry):
        """(storage, size) of new room for `e` in `tier`, or None when it does not fit now."""
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
        """Give back room in `tier`; file paths to remove go to `unlink` (removed outside the
        lock)."""
        if tier == "disk":
            self._disk_used -= size
            if storage is not None:
                unlink.append(storage)
        elif storage is not None:
            self._pools[tier].release(storage.request_id)

    def _drop(self, e: _Entry, reason: str, unlink: list) -> None:
        """Remove `e` from the cache, counted under `reason`. Its storage is freed now, or by the
        thread moving or reading it when that ends."""
        self._forget(e)
        self.drops[reason] += 1
        if e.moving or e.pins:
            e.doomed = True
        elif e.tier is not None:
            self._free(e.tier, e.storage, e.size, unlink)
            e.tier = None

    def _account(self, src: str, dst: str, nbytes: int, seconds: float) -> None:
        pair = f"{src}->{dst}"
        self.moved_bytes[pair] += nbytes
        self.moved_seconds[pair] += seconds

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

    def _let_go(self, e: _Entry, unlink: list) -> None:
        """This thread stopped moving `e` (it cleared e.moving) or reading it (it dropped its
        pin). An entry dropped meanwhile (doomed) has its storage freed once no thread moves or
        reads it any more; threads waiting for `e` to settle are woken."""
        if e.doomed and not e.moving and not e.pins and e.tier is not None:
            self._free(e.tier, e.storage, e.size, unlink)
            e.tier = None
        self._cond.notify_all()

    def _stop_moving(self, e: _Entry) -> None:
        """Lock not held. `e` stays where it is: clear its moving mark and let go."""
        with self._locked() as unlink:
            e.moving = False
            self._let_go(e, unlink)

    # -- moving bytes (no lock held) ------------------------------------------------------------
    def _transfer(self, e: _Entry, src: str, src_storage, dst: str, dst_storage,
                  nbytes: int | None = None) -> float:
        """Move e's first `nbytes` (default all) from src to dst ("request", a tier name; the
        storage is a Block, a file path or a BlockPin of a request block). Returns seconds;
        raises _Failed(reason, seconds spent) when the bytes are bad or a device or file failed.
        Sets e.checksum when the bytes arrive in host memory."""
        n = e.nbytes if nbytes is None else nbytes
        if not self.holds_bytes:
            return self.bandwidth.seconds(src, dst, n)
        pins: list = []
        t0 = time.perf_counter()
        reason = None
        try:
            dev_s = self._transfer_bytes(e, src, src_storage, dst, dst_storage, n, pins)
        except _Failed as exc:
            reason, cause = exc.args[0], exc
        except (OSError, DeviceError) as exc:
            reason, cause = "io_error", exc
        except disk.CorruptFile as exc:
            reason, cause = "corrupt", exc
        finally:
            for pin in pins:
                pin.release()
        wall = time.perf_counter() - t0
        if reason is not None:
            raise _Failed(reason, self._seconds(src, dst, n, wall, None)) from cause
        return self._seconds(src, dst, n, wall, dev_s)

    def _seconds(self, src: str, dst: str, n: int, wall: float, dev_s: float | None) -> float:
        """What a transfer cost: wall-clock on real devices; on emulated ones the device's own
        model of an internal copy, TierBandwidth for the rest."""
        if not self._modelled:
            return wall
        if dev_s is not None and src in ("request", "device") and dst in ("request", "device"):
            return dev_s
        return self.bandwidth.seconds(src, dst, n)

    @staticmethod
    def _place(kind: str, storage, n: int, pins: list, writing: bool):
        """(Device, Buffer, offset) of a request block (`storage` is its BlockPin) or of a tier
        block (pinned here; the pin goes to `pins`)."""
        if kind == "request":
            return storage.location
        pin = storage.pin(n, writing)
        pins.append(pin)
        return pin.location

    def _transfer_bytes(self, e, src, src_storage, dst, dst_storage, n, pins):
        """The byte-moving half of _transfer; returns the device's own seconds when one
        Device.copy did the move, else None."""
        whole = n == e.nbytes
        # Bytes bound for a request's block that holds bytes of its own (below its `written` mark,
        # which is also all a migration keeps) are checked before they are copied: a bad entry
        # must leave the request's bytes as they were. Into a fresh block, or a tier's fresh room,
        # the one-pass copy + checksum is enough: bad bytes there are never reported as a prefix.
        # A partial copy needs the whole entry's sum first in any case.
        check_first = not whole or (dst == "request" and dst_storage.block.written > 0)
        if src == "disk":
            expect = disk.FileHeader(e.key, e.tokens, e.nbytes, self.bytes_per_token, e.checksum)
            to = self._place(dst, dst_storage, n, pins, writing=True)

            def consume(payload):
                view = host_view(*to, n)
                if view is not None and not check_first:
                    return copy_digest(view, payload)      # one pass: copy + checksum
                got = digest(payload)
                if got == e.checksum:
                    if view is None:
                        to[0].write(to[1], to[2], payload[:n])
                    else:
                        copy_digest(view, payload[:n])     # for its parallel streaming copy
                return got

            if disk.read_payload(src_storage, expect, consume) != e.checksum:
                raise _Failed("corrupt")
            return None
        frm = self._place(src, src_storage, n, pins, writing=False)
        if dst == "disk":
            data = host_view(*frm, n)
            if data is None:
                data = frm[0].read(frm[1], frm[2], n)
            # host bytes keep their checksum (a host-side corruption fails the file's check on
            # read); bytes straight from the device are summed here, first time in host memory
            checksum = e.checksum if src == "host" else digest(data)
            header = disk.pack_header(e.key, e.tokens, e.nbytes, self.bytes_per_token, checksum)
            disk.write_file(dst_storage, header, data)
            e.checksum = checksum
            return None
        to = self._place(dst, dst_storage, n, pins, writing=True)
        check = src == "host" and self.verify and e.checksum is not None
        if check and check_first:
            entire = self._place(src, src_storage, e.nbytes, pins, False)
            if digest(host_view(*entire, e.nbytes)) != e.checksum:
                raise _Failed("corrupt")
            return move(frm, to, n, checksum=False)[1]
        _, dev_s, got = move(frm, to, n, checksum=check or dst == "host")
        if check and got != e.checksum:
            raise _Failed("corrupt")
        if dst == "host":
            e.checksum = got
        return dev_s

    # -- eviction --------------------------------------------------------------------------------
    def _movable(self, protect):
        return lambda v: not (v.moving or v.pins or v.doomed or v.key in protect)

    def _make_room(self, tier: str, e: _Entry, protect: frozenset):
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

    @contextlib.contextmanager
    def _settles(self, e: _Entry):
        """Let go of `e` if an unexpected error escapes while this thread moves it, so that a
        restore waiting for it never hangs and a dropped entry's room is not leaked. Every
        _move() runs inside one (it leaves e.moving to this on such an error)."""
        try:
            yield
        except BaseException:
            if e.moving:
                self._stop_moving(e)
            raise

    def _demote(self, v: _Entry, protect: frozenset) -> float:
        """Move victim `v` (marked moving by the caller) to the next lower tier that takes it,
        or drop it. Returns seconds."""
        with self._settles(v):
            return self._demote_moving(v, protect)

    def _demote_moving(self, v: _Entry, protect: frozenset) -> float:
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

    def _move(self, e: _Entry, src: str, dst: str, room, src_storage, *,
              evicted: bool) -> tuple[float, bool]:
        """Move `e` (marked moving, inside _settles(e)) from `src` (its tier, or "request" for a
        promotion copied from a request's block `src_storage`) into the reserved `room` of tier
        `dst`; settle the index. A failed transfer drops the entry, except a failed promotion,
        which leaves it where it was. Returns (seconds, whether `e` is now in `dst`)."""
        storage, size = room
        failure = None
        try:
            seconds = self._transfer(e, src, src_storage, dst, storage)
        except _Failed as exc:
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

    # -- background promotion ------------------------------------------------------------------------
    def _drain(self) -> None:
        """Wait for queued promotions (so decisions follow the calls' order)."""
        self._queue.drain()

    def _promote(self, e: _Entry, source) -> float:
        """Move `e` up to the device tier, copying from `source` (a pinned request block holding
        its bytes) or, when None, from its own tier. Returns seconds."""
        with self._lock:
            if (self._closed or self._index.get(e.key) is not e or e.moving or e.pins
                    or e.tier == "device"):
                return 0.0
            e.moving = True
        with self._settles(e):
            room, seconds = self._make_room("device", e, frozenset())
            if room is None:
                self._stop_moving(e)
                return seconds
            src, src_storage = (e.tier, e.storage) if source is None else ("request", source)
            s, moved = self._move(e, src, "device", room, src_storage, evicted=False)
        if moved:
            with self._lock:
                self.promotions += 1
        return seconds + s

    def _promote_in_background(self, e: _Entry, source) -> None:
        """Promote `e` from `source` (a BlockPin of the request's block holding its bytes,
        released here; the block itself in accounting mode) on the promotion worker."""
        def job():
            try:
                s = self._promote(e, source)
                with self._lock:
                    self.background_seconds += s
            finally:
                if isinstance(source, BlockPin):
                    source.release()

        if self.holds_bytes:
            self._queue.submit(job)
        else:
            job()

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
        except _Failed as exc:
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
                e = _Entry(key, tokens, nbytes, next(self._eids))
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

    def _store(self, e: _Entry, tier: str, room, source) -> float:
        """Copy a new entry from the request's block into its reserved room and index it."""
        storage, size = room
        failure = None
        try:
            seconds = self._transfer(e, "request", source, tier, storage)
        except _Failed as exc:
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

    def _prefetch(self, wanted: list) -> float:
        protect = frozenset(wanted)
        seconds = 0.0
        for key in wanted:
            with self._lock:
                e = self._index.get(key)
                if e is None or e.moving or e.pins:
                    continue
                self._touch(e)
                if e.tier == "device":
                    continue
                e.moving = True
                src = e.tier
            moved = False
            with self._settles(e):
                for target in TIERS[:TIERS.index(src)]:
                    if not self._could_hold(target, e):
                        continue
                    room, s = self._make_room(target, e, protect)
                    seconds += s
                    if room is not None:
                        s, moved = self._move(e, src, target, room, e.storage, evicted=False)
                        seconds += s
                        break
                else:                             # no room above: it stays where it is
                    self._stop_moving(e)
            if moved:
                with self._lock:
                    self.prefetched += 1
        return seconds

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

    # -- reporting ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters and occupancy: hits per tier (restores served from it), misses, hit rates
        (over restores), bytes and seconds moved per pair ("device->host", "host->request", ...:
        "request" is a request's block), evictions per tier, drops by reason, entries, payload
        bytes and reserved bytes per tier, capacities."""
        self._drain()
        with self._queue.cond:
            background_errors = list(self._queue.errors)
        with self._lock:
            entries = dict.fromkeys(TIERS, 0)
            payload = dict.fromkeys(TIERS, 0)
            reserved = dict.fromkeys(TIERS, 0)
            for e in self._index.values():
                entries[e.tier] += 1
                payload[e.tier] += e.nbytes
                reserved[e.tier] += e.size
            restores = sum(self.hits.values()) + self.misses
            return {
                "device": None if self.device is None else self.device.spec,
                "host_memory": None if self._host_device is None else self._host_device.spec,
                "disk_dir": self._disk_dir,
                "bytes_per_token": self.bytes_per_token,
                "eviction": self.eviction,
                "verify": self.verify,
                "capacity_bytes": dict(self.capacity),
                "entries": entries,
                "bytes": payload,
                "reserved_bytes": reserved,
                "restores": restores,
                "hits": dict(self.hits),
                "misses": self.misses,
                "hit_rate": {t: (self.hits[t] / restores if restores else None) for t in TIERS},
                "covered_tokens": self.covered_tokens,
                "offers": self.offers,
                "promotions": self.promotions,
                "prefetched": self.prefetched,
                "evictions": dict(self.evictions),
                "drops": dict(self.drops),
                "moved_bytes": dict(self.moved_bytes),
                "moved_seconds": dict(self.moved_seconds),
                "background_seconds": self.background_seconds,
                "background_errors": background_errors,
                "reindexed": self.reindexed,
            }

    def check(self) -> None:
        """Verify the invariants (InvariantBroken if one fails): every indexed entry is in
        exactly its tier's order and holds a live block of its size (device, host) or a file path
        and a file size matching its payload (disk; the file itself is checked when read); each
        tier's reserved bytes match its pool (or the disk count) and stay within its capacity; no
        entry is left moving, pinned or doomed once calls return."""
        self._drain()
        with self._lock:
            members = {t: set(self._orders[t].members()) for t in TIERS}
            for key, e in self._index.items():
                require(e.key == key, f"index maps {key!r} to the entry of {e.key!r}")
                require(e.tier in TIERS, f"entry {key!r} has no tier")
                for t in TIERS:
                    require((e in members[t]) == (t == e.tier),
                            f"entry {key!r} ({e.tier}) is{'' if e in members[t] else ' not'} in "
                            f"the {t} order")
                require(e.nbytes == e.tokens * self.bytes_per_token,
                        f"entry {key!r}: {e.nbytes} B for {e.tokens} tokens")
                require(not e.moving and not e.pins and not e.doomed,
                        f"entry {key!r} is left moving/pinned/doomed")
                if e.tier == "disk":
                    require(e.size == disk.file_bytes(e.nbytes), f"entry {key!r}: disk size off")
                    if self.holds_bytes:        # disk reads are checked whatever `verify` says
                        require(isinstance(e.storage, str), f"entry {key!r} has no file")
                        require(e.checksum is not None, f"entry {key!r} on disk has no checksum")
                else:
                    pool = self._pools[e.tier]
                    require(pool is not None, f"entry {key!r} is in a {e.tier} tier of 0 B")
                    blk = e.storage
                    require(blk.live and pool.block(e.eid) is blk,
                            f"entry {key!r}: its block is not live in the {e.tier} pool")
                    require(blk.capacity_tokens == e.tokens and e.size == blk.nbytes,
                            f"entry {key!r}: block of {blk.capacity_tokens} tokens / "
                            f"{blk.nbytes} B")
                    if e.tier == "host" and self.holds_bytes:
                        require(e.checksum is not None, f"entry {key!r} in host has no checksum")
            total = sum(len(m) for m in members.values())
            require(total == len(self._index), f"{total} ordered entries, "
                                               f"{len(self._index)} indexed")
            for t in TIERS:
                for problem in self._orders[t].check():
                    require(False, problem)
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
