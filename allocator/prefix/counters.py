"""What a PrefixCache counts and reports: the counters (hits and misses of restores, offers,
promotions, prefetches, evictions, drops by reason, bytes and seconds moved per tier pair) and
stats(), which reports them with each tier's occupancy. A mixin of PrefixCache (cache.py), like
EntryIndex, TierSpace, Transfers and Promotions: the other mixins add to the counters."""

from __future__ import annotations

import collections

from allocator.prefix.index import DROP_REASONS
from allocator.prefix.tiers import TIERS


class CacheCounters:
    """The counters of a PrefixCache and their report (see the module docstring)."""

    def _start_counting(self) -> None:
        """Every counter at zero (construction)."""
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

