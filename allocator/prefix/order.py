"""Eviction order of one tier: which entry leaves first.

- lru: the entry used longest ago (an entry keeps its last use when it is demoted, so a tier's
  order is by last use across the whole cache, not by arrival in the tier);
- fifo: the entry that arrived in this tier first (use does not reorder);
- random: any entry, uniformly, from the cache's seeded generator (so a run repeats exactly).

lru and fifo keep a heap of (key, sequence, entry) with lazy deletion: a heap item is stale when its
entry left the tier or was re-keyed since; the heap is rebuilt when stale items outnumber live
ones. victim() skips entries the caller cannot move now (pinned by a restore, being moved,
protected by a prefetch) and leaves the order unchanged.
"""

from __future__ import annotations

import heapq
import itertools
import random

EVICTIONS = ("lru", "fifo", "random")


class TierOrder:
    """The members of one tier in the order `policy` (one of EVICTIONS) evicts them."""

    def __init__(self, policy: str, rng: random.Random):
        self.policy = policy
        self._rng = rng
        self._members: dict = {}          # entry -> order key (lru/fifo) or list position (random)
        self._heap: list = []
        self._list: list = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, entry) -> bool:
        return entry in self._members

    def members(self):
        return list(self._members)

    def add(self, entry, tick: int) -> None:
        """`entry` arrives in this tier at `tick` (its last use is entry.last_use)."""
        if self.policy == "random":
            self._members[entry] = len(self._list)
            self._list.append(entry)
            return
        key = tick if self.policy == "fifo" else entry.last_use
        self._members[entry] = key
        self._push(key, entry)

    def touch(self, entry) -> None:
        """`entry` (a member) was just used (entry.last_use is the new tick)."""
        if self.policy == "lru" and entry in self._members:
            self._members[entry] = entry.last_use
            self._push(entry.last_use, entry)

    def remove(self, entry) -> None:
        if entry not in self._members:
            return
        pos = self._members.pop(entry)
        if self.policy == "random":
            last = self._list.pop()
            if last is not entry:
                self._list[pos] = last
                self._members[last] = pos

    def _push(self, key, entry) -> None:
        heapq.heappush(self._heap, (key, next(self._seq), entry))
        if len(self._heap) > 2 * len(self._members) + 64:
            self._heap = [(k, next(self._seq), e) for e, k in self._members.items()]
            heapq.heapify(self._heap)

    def victim(self, movable):
        """The member to evict first among those for which movable(entry) holds, or None."""
        if self.policy == "random":
            n = len(self._list)
            if not n:
                return None
            for _ in range(8):
                e = self._list[self._rng.randrange(n)]
                if movable(e):
                    return e
            start = self._rng.randrange(n)
            for i in range(n):
                e = self._list[(start + i) % n]
                if movable(e):
                    return e
            return None
        skipped = []
        found = None
        heap = self._heap
        while heap:
            item = heapq.heappop(heap)
            key, _, e = item
            if self._members.get(e, None) != key:
                continue                      # stale: the entry left or was re-keyed
            skipped.append(item)
            if movable(e):
                found = e
                break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def check(self) -> list[str]:
        """Descriptions of broken invariants (empty when sound)."""
        problems = []
        if self.policy == "random":
            if len(self._list) != len(self._members):
                problems.append("random order: list and index differ in size")
            for i, e in enumerate(self._list):
                if self._members.get(e) != i:
                    problems.append(f"random order: entry {e.key!r} is not at its position")
        else:
            live = {(k, id(e)) for k, _, e in self._heap if self._members.get(e, None) == k}
            for e, k in self._members.items():
                if (k, id(e)) not in live:
                    problems.append(f"{self.policy} order: entry {e.key!r} has no heap item")
        return problems
