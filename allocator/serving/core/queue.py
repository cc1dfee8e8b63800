"""The queue of requests waiting for admission, and the order admission tries them in.

FCFS tries the head of the queue (arrival order; a preempted request goes back to the front).
The prefix schedules rank requests by how near the device their prefix's KV lies (tier
distance 0 device, 1 host, 2 disk, 3 not cached or no prefix): fastest-prefix-first (FPF) takes
the nearest first, oldest first among equals (later requests may starve); relaxed FPF the
highest (now - arrival) x (4 - distance). Ties go to the one nearer the front of the queue.

Every request waiting on one prefix shares its distance, so only the oldest of each prefix can
win: the queue keeps each prefix's requests in a heap by (arrival, queue position) and, per
distance, a heap of the prefixes by their oldest request. A pick looks at the top of the four
distance heaps, O(log n). Distances change as the cache moves prefixes: a demotion or eviction
(farther) is found when a stale top is checked against the cache and re-filed; a promotion
(nearer) comes only from what the engine does (a restore, an offer, a prefetch), which reports
it through moved().
"""

from __future__ import annotations

import heapq
import itertools

DISTANCES = 4                          # device, host, disk, none


_END = object()                        # the list's sentinel: next of the last, prev of the first


class WaitingQueue:
    """The waiting requests of one simulation, by id. `rule`: "fcfs", "fpf" or "relaxed-fpf";
    arrival_of(i) -> seconds; prefix_of(i) -> the request's prefix key or None; distance_of(key)
    -> its tier distance now, 0..3."""

    def __init__(self, rule: str, arrival_of, prefix_of=None, distance_of=None):
        self.rule = rule
        self._arrival = arrival_of
        self._prefix = prefix_of
        self._distance = distance_of
        # queue order: a doubly linked list through two dicts, so that a request leaves from
        # anywhere in O(1) and the first n are found without walking past removed ones
        self._next = {_END: _END}
        self._prev = {_END: _END}
        self._seq: dict = {}           # id -> its place: smaller is nearer the front
        self._back = itertools.count(0)
        self._front = itertools.count(-1, -1)
        self._groups: dict = {}        # prefix key -> heap of (arrival, seq, id)
        self._tops = [[] for _ in range(DISTANCES)]   # per distance: heap of (arrival, seq, key)

    def __len__(self) -> int:
        return len(self._seq)

    def append(self, i) -> None:
        """An arrival: at the back."""
        self._add(i, next(self._back))
        self._link(i, self._prev[_END], _END)

    def appendleft(self, i) -> None:
        """A preempted request: at the front."""
        self._add(i, next(self._front))
        self._link(i, _END, self._next[_END])

    def first(self, n: int) -> list:
        """The first n waiting requests in queue order (the ones a prefetch looks ahead to)."""
        out, i = [], self._next[_END]
        while i is not _END and len(out) < n:
            out.append(i)
            i = self._next[i]
        return out

    def head(self, now: float):
        """The request admission tries next (the queue must not be empty)."""
        if self.rule == "fcfs":
            return self._next[_END]
        best = best_rank = None
        for d in range(DISTANCES):
            top = self._top(d)
            if top is None:
                continue
            arrival, seq, key = top
            rank = (d if self.rule == "fpf" else -(now - arrival) * (DISTANCES - d), arrival, seq)
            if best_rank is None or rank < best_rank:
                best, best_rank = key, rank
            if self.rule == "fpf":
                break                  # the nearest distance holding a request wins outright
        return self._groups[best][0][2]

    def remove(self, i) -> None:
        """Take waiting request i out (admitted)."""
        seq = self._seq.pop(i)
        prev, nxt = self._prev.pop(i), self._next.pop(i)
        self._next[prev], self._prev[nxt] = nxt, prev
        if self.rule == "fcfs":
            return
        key = self._prefix(i)
        group = self._groups[key]
        if group[0][2] == i:
            heapq.heappop(group)
        else:                          # not the oldest of its prefix: rebuild (rare)
            group.remove((self._arrival(i), seq, i))
            heapq.heapify(group)
        if group:
            self._file(key)
        else:
            del self._groups[key]

    def moved(self, key) -> None:
        """The cache moved prefix `key` nearer the device (or may have): re-rank its requests."""
        if self.rule != "fcfs" and key in self._groups:
            self._file(key)

    # -- internals ----------------------------------------------------------------------------
    def _link(self, i, prev, nxt) -> None:
        self._prev[i], self._next[i] = prev, nxt
        self._next[prev] = self._prev[nxt] = i

    def _add(self, i, seq) -> None:
        if i in self._seq:
            raise ValueError(f"request {i} is already waiting")
        self._seq[i] = seq
        if self.rule == "fcfs":
            return
        key = self._prefix(i)
        group = self._groups.setdefault(key, [])
        entry = (self._arrival(i), seq, i)
        heapq.heappush(group, entry)
        if group[0] is entry:          # the new oldest of its prefix
            self._file(key)

    def _file(self, key) -> None:
        arrival, seq, _ = self._groups[key][0]
        heapq.heappush(self._tops[self._distance_of(key)], (arrival, seq, key))

    def _distance_of(self, key) -> int:
        return DISTANCES - 1 if key is None else self._distance(key)

    def _top(self, d: int):
        """The valid top of distance heap d, dropping and re-filing stale entries."""
        heap = self._tops[d]
        while heap:
            arrival, seq, key = heap[0]
            group = self._groups.get(key)
            if group is None or group[0][:2] != (arrival, seq):
                heapq.heappop(heap)    # that request left, or an older one came
                continue
            if self._distance_of(key) != d:
                heapq.heappop(heap)    # the cache moved the prefix farther
                self._file(key)
                continue
            return heap[0]
        return None


DISTANCE = {"device": 0, "host": 1, "disk": 2, None: 3}   # a tier's distance from the device
