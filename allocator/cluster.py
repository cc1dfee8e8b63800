"""Cluster manager: one RacmAllocator per device, one bucket configuration for all of them.

Placement: a request goes to the device with the best score = free fraction of its pool minus
load_weight x its share of the live requests (compute load grows with the requests decoding
there), trying the next best when the first cannot reserve. All pools share one QuantileBuckets,
fed by completions on every device, so a request gets the same bucket wherever it lands and
scheduling decisions stay stable (paper section 3.5).

The cluster lock guards only the request -> device map; grow() (which may migrate: a streaming
copy) and release() run on the owning device's allocator outside it, so one device's migration
never holds up the others.
"""

from __future__ import annotations

import threading

from allocator.buckets import QuantileBuckets
from allocator.config import check_config
from allocator.errors import DuplicateRequest, OutOfMemory, UnknownRequest, require
from allocator.placement import RacmAllocator
from odma_cli.errors import BadArgument


class ClusterManager:
    """Invariant: every live request id is in exactly one device's allocator, and `where` names
    it (a request is entered in `where` before its reservation and removed after its release)."""

    def __init__(self, devices, pool_bytes: int, bytes_per_token: int, max_tokens: int,
                 config=None, *, load_weight: float = 0.5):
        devices = list(devices)
        if not devices:
            raise BadArgument("a cluster needs at least one device")
        self.config = config = check_config(config)
        self.load_weight = load_weight
        self.buckets = QuantileBuckets.from_config(max_tokens, config)
        self.allocators: list[RacmAllocator] = []
        try:
            for d in devices:
                self.allocators.append(RacmAllocator(d, pool_bytes, bytes_per_token, max_tokens,
                                                     config, buckets=self.buckets))
        except BaseException:
            self.close()
            raise
        self._where: dict = {}
        self._lock = threading.Lock()

    def _order(self) -> list[int]:
        total_live = max(1, len(self._where))
        scores = []
        for i, a in enumerate(self.allocators):
            free = 1.0 - a.reserved_bytes / a.pool_bytes
            scores.append((free - self.load_weight * len(a) / total_live, -i))
        return [-i for _, i in sorted(scores, reverse=True)]

    def reserve(self, request_id, prompt_tokens, predicted_tokens, uncertainty=0.0):
        """Reserve on the best device that has room; OutOfMemory when none has."""
        with self._lock:
            try:
                if request_id in self._where:
                    raise DuplicateRequest(f"request {request_id!r} is already live")
            except TypeError:
                raise BadArgument(f"request id must be hashable, got {request_id!r}") from None
            for i in self._order():
                try:
                    blk = self.allocators[i].reserve(request_id, prompt_tokens, predicted_tokens,
                                                     uncertainty)
                except OutOfMemory:
                    continue
                self._where[request_id] = i
                return blk
            raise OutOfMemory(f"no device has room for request {request_id!r}")

    def _owner(self, request_id) -> RacmAllocator:
        with self._lock:
            try:
                i = self._where.get(request_id)
            except TypeError:
                raise BadArgument(f"request id must be hashable, got {request_id!r}") from None
            if i is None:
                raise UnknownRequest(f"request {request_id!r} is not live on any device")
            return self.allocators[i]

    def device_of(self, request_id) -> int:
        return self.allocators.index(self._owner(request_id))

    def block(self, request_id):
        return self._owner(request_id).block(request_id)

    def blocks(self, request_ids) -> list:
        return [self.block(i) for i in request_ids]

    def grow(self, request_id, total_tokens, copy=None):
        return self._owner(request_id).grow(request_id, total_tokens, copy)

    def release(self, request_id, realized_tokens=None, *, preempted=False):
        self._owner(request_id).release(request_id, realized_tokens, preempted=preempted)
        with self._lock:
            self._where.pop(request_id, None)

    def stats(self) -> dict:
        per = [a.stats() for a in self.allocators]
        out = {k: sum(s[k] for s in per) for k in
               ("pool_bytes", "reserved_bytes", "free_bytes", "used_bytes", "live_blocks",
                "completed", "migrations", "oom_events", "reserve_failures")}
        used = sum(a.used_tokens_sum for a in self.allocators)
        reserved = sum(a.reserved_tokens_sum for a in self.allocators)
        out["utilization"] = used / reserved if reserved else None
        out["bucket_bounds"] = list(self.buckets.bounds)
        out["devices"] = per
        return out

    def check(self) -> None:
        with self._lock:
            where = dict(self._where)
        for i, a in enumerate(self.allocators):
            a.check()
            for b in a.live_blocks():
                require(where.get(b.request_id) == i,
                        f"request {b.request_id!r} lives on device {i}, the map says "
                        f"{where.get(b.request_id)}")
        require(len(where) == sum(len(a) for a in self.allocators),
                "the request map and the devices disagree on the live requests")

    def close(self) -> None:
        for a in self.allocators:
            a.close()
        self.buckets.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
