"""Moving prefixes up: promotion after a restore, on a worker thread, and prefetch.

Promotion goes straight to the device tier, skipping host on the way up from disk: a prefix just
reused is the likeliest to be reused next, and a restore from the device tier is one device copy.
A whole restore from host or disk queues the entry's move to the device tier, copied from the
request's freshly restored block (a device-internal copy); a failed promotion leaves the entry
where it was. A prefetch moves entries up synchronously, to the device tier where room can be made
there, else (from disk) to the host tier.

The worker holds no reference to the cache while it waits for work: a cache dropped without
close() is freed when its last reference goes, memory and worker thread with it.
"""

from __future__ import annotations

import collections
import threading
import time

from allocator.pool import BlockPin
from allocator.prefix.index import Entry
from allocator.prefix.tiers import TIERS


class PromotionQueue:
    """A cache's background promotions: jobs (callables) and the worker thread that runs them.
    The cache and its worker share this and it references no cache, so an idle worker keeps no
    cache alive: a cache dropped without close() is freed at once, and its finalizer stops the
    worker. A queued job references its cache, which therefore lives until its jobs ran.

    jobs counts jobs queued or running; errors keeps what the latest failed jobs raised (bounded,
    as a long run may fail many). The worker exits after `idle_s` seconds without work, so an idle
    cache holds no thread."""

    def __init__(self, idle_s: float):
        # reentrant: the finalizer that calls stop() runs in whichever thread drops the cache or
        # collects it, the worker included, possibly while that thread holds this lock
        self.cond = threading.Condition(threading.RLock())
        self.pending: collections.deque = collections.deque()
        self.jobs = 0
        self.errors: collections.deque = collections.deque(maxlen=10)
        self.idle_s = idle_s
        self._running = False
        self._stopped = False

    def submit(self, job) -> None:
        """Queue `job` for the worker (started on first use, and again after it went idle)."""
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
            idle_s = self.idle_s
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


class Promotions:
    """PrefixCache's moves up (a mixin: the state is made by PrefixCache.__init__): _queue is its
    PromotionQueue; promotions, prefetched and background_seconds count what they did. No lock is
    held on entry."""

    def _drain(self) -> None:
        """Wait for queued promotions (so decisions follow the calls' order)."""
        self._queue.drain()

    def _promote(self, e: Entry, source) -> float:
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

    def _promote_in_background(self, e: Entry, source) -> None:
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

    def _prefetch(self, wanted: list) -> float:
        """Bring the entries of `wanted` (keys, nearest need first) up, evicting only entries not
        in it. Returns seconds."""
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
