"""The policies ODMA is measured against, behind the RacmAllocator interface.

- StaticAllocator: every request reserves max_tokens at admission (Orca "Max", FasterTransformer,
  Cambricon-vLLM's static mode). Contiguous, never migrates, wastes the most.
- S3Allocator: static, equal-width buckets over (0, max_tokens] (S3, NeurIPS 2023) in the same
  bucket basis as ODMA; the request goes to the bucket of L (no inflation, no large bucket). S3 preempts a request that
  outgrows its bucket and reruns it bigger; here the overflow moves it to the smallest bucket
  that holds it (counted as a migration), which is the cheaper of the two.
- OracleAllocator: reserves exactly prompt + L tokens (with the oracle predictor: the realized
  length), the upper bound on utilization of any contiguous policy.
- PagedAllocator: vLLM-style pages of page_tokens tokens from one free list, taken as the
  sequence grows. No external fragmentation and < one page of waste per request, but a
  request's KV is scattered over `segments` separate runs of pages: the random access RACM
  devices punish.
"""

from __future__ import annotations

import bisect
import collections
import math
import threading

from odma_hw.errors import BadArgument

from allocator.buckets import QuantileBuckets, equal_width_bounds
from allocator.core import (AllocatorConfig, RacmAllocator, _amount, _count, check_growth,
                            find_live, resolve_device)
from allocator.errors import DuplicateRequest, OutOfMemory, PoolTooLarge, StaleBlock


class StaticAllocator(RacmAllocator):
    name = "static"

    def _large_share(self):
        return 0.0

    def _make_buckets(self):
        return None

    def _place(self, prompt, predicted, u):
        return "static", self.max_tokens, self._regular_only, None

    def _overflow(self, blk, need):  # unreachable: a block holds max_tokens
        return "static", self.max_tokens, self._regular_only


class OracleAllocator(RacmAllocator):
    name = "oracle"

    def _large_share(self):
        return 0.0

    def _make_buckets(self):
        return None

    def _place(self, prompt, predicted, u):
        cap = min(self.max_tokens, prompt + max(1, math.ceil(predicted)))
        return "exact", cap, self._regular_only, None

    def _overflow(self, blk, need):
        return "exact", need, self._regular_only


class S3Allocator(RacmAllocator):
    name = "s3"

    def _large_share(self):
        return 0.0

    def _make_buckets(self):
        c = self.config
        bounds = equal_width_bounds(self.max_tokens, c.n_buckets, c.token_alignment)
        return QuantileBuckets(self.max_tokens, c.n_buckets, alignment=c.token_alignment,
                               initial=bounds, frozen=True, background=False)

    def _place(self, prompt, predicted, u):
        bounds = self._buckets.bounds
        offset = 0 if self._by_generated else prompt
        key = offset + max(1.0, predicted)
        i = min(bisect.bisect_left(bounds, key), len(bounds) - 1)
        return i, min(self.max_tokens, bounds[i] + prompt - offset), self._regular_only, key

    def _overflow(self, blk, need):
        bounds = self._buckets.bounds
        offset = 0 if self._by_generated else blk.prompt_tokens
        i = min(bisect.bisect_left(bounds, need - blk.prompt_tokens + offset), len(bounds) - 1)
        return i, min(self.max_tokens, bounds[i] + blk.prompt_tokens - offset), self._regular_only


class PagedBlock:
    """A request's KV in pages: pages[i] holds tokens [i * page_tokens, (i + 1) * page_tokens).
    `segments` counts the separate contiguous runs of pages (1 = as good as contiguous)."""

    __slots__ = ("_owner", "request_id", "pages", "capacity_tokens", "prompt_tokens", "tokens",
                 "written", "live")
    bucket = "paged"

    def __init__(self, owner, request_id, pages, prompt_tokens):
        self._owner = owner
        self.request_id = request_id
        self.pages = pages
        self.capacity_tokens = len(pages) * owner.page_tokens
        self.prompt_tokens = prompt_tokens
        self.tokens = prompt_tokens
        self.written = 0
        self.live = True

    @property
    def device(self):
        return self._owner.device

    @property
    def offset(self) -> int:
        return self.pages[0] * self._owner.page_bytes

    @property
    def nbytes(self) -> int:
        return len(self.pages) * self._owner.page_bytes

    @property
    def segments(self) -> int:
        p = self.pages
        return 1 + sum(1 for a, b in zip(p, p[1:]) if b != a + 1)

    def _spans(self, offset, nbytes):
        """(pool offset, length, position in the caller's data) of each page piece."""
        if not self.live:
            raise StaleBlock(f"block of request {self.request_id!r} was released")
        if self._owner._buffer is None:
            raise BadArgument("this allocator is accounting-only (device=None): blocks hold no bytes")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise BadArgument(f"range [{offset}, {offset + nbytes}) is outside the "
                              f"{self.nbytes}-byte block")
        pb = self._owner.page_bytes
        pos = 0
        while pos < nbytes:
            page, within = divmod(offset + pos, pb)
            n = min(pb - within, nbytes - pos)
            yield self.pages[page] * pb + within, n, pos
            pos += n

    def write(self, data, offset: int = 0) -> None:
        mv = memoryview(data).cast("B")
        for at, n, pos in self._spans(offset, mv.nbytes):
            self._owner.device.write(self._owner._buffer, at, mv[pos:pos + n])
        self.written = max(self.written, offset + mv.nbytes)

    def read(self, nbytes: int, offset: int = 0) -> bytes:
        return b"".join(self._owner.device.read(self._owner._buffer, at, n)
                        for at, n, _ in self._spans(offset, nbytes))


class PagedAllocator:
    """vLLM-style paged KV: fixed pages from one FIFO free list (freed pages go to the tail).

    Invariants (check()): every page is either in the free list or in exactly one live request's
    page list; a request holds ceil(tokens / page_tokens) pages at least."""

    name = "paged"

    def __init__(self, device, pool_bytes: int, bytes_per_token: int, max_tokens: int,
                 config: AllocatorConfig | None = None, *, page_tokens: int = 16):
        for name, v in (("pool_bytes", pool_bytes), ("bytes_per_token", bytes_per_token),
                        ("max_tokens", max_tokens), ("page_tokens", page_tokens)):
            if _count(name, v) == 0:
                raise BadArgument(f"{name} must be > 0")
        self.config = config or AllocatorConfig()
        self.device, self._owns_device = resolve_device(device)
        device = self.device
        self.bytes_per_token = bytes_per_token
        self.max_tokens = max_tokens
        self.page_tokens = page_tokens
        align = self.config.byte_alignment or (device.alignment if device is not None else 64)
        self.page_bytes = -(-page_tokens * bytes_per_token // align) * align
        self.n_pages = pool_bytes // self.page_bytes
        self.pool_bytes = self.n_pages * self.page_bytes
        if self.n_pages * page_tokens < max_tokens:
            raise BadArgument(f"pool too small: {self.n_pages} pages of {page_tokens} tokens "
                              f"cannot hold one {max_tokens}-token request")
        self._buffer = None
        if device is not None:
            if self.pool_bytes > device.info.total_bytes:
                raise PoolTooLarge(f"pool of {self.pool_bytes} B is larger than {device.spec}")
            try:
                self._buffer = device.alloc(self.pool_bytes)
            except BadArgument as exc:
                raise PoolTooLarge(f"pool does not fit on {device.spec}: {exc}") from None
        self._free = collections.deque(range(self.n_pages))
        self._live: dict = {}
        self._lock = threading.Lock()
        self.completed = 0
        self.preemptions = 0
        self.used_tokens_sum = 0
        self.reserved_tokens_sum = 0
        self.segments_sum = 0
        self.segments_max = 0
        self.oom_events = 0
        self.reserve_failures = 0
        self.migrations = 0
        self.buckets = None

    def _take(self, n):
        free = self._free
        return [free.popleft() for _ in range(n)]

    def reserve(self, request_id, prompt_tokens, predicted_tokens=0.0, uncertainty=0.0):
        prompt = _count("prompt_tokens", prompt_tokens)
        _amount("predicted_tokens", predicted_tokens)
        _amount("uncertainty", uncertainty, allow_inf=True)
        if prompt >= self.max_tokens:
            raise BadArgument(f"prompt of {prompt} tokens leaves no room under max_tokens")
        n = max(1, -(-prompt // self.page_tokens))
        with self._lock:
            try:
                if request_id in self._live:
                    raise DuplicateRequest(f"request {request_id!r} is already live")
            except TypeError:
                raise BadArgument(f"request id must be hashable, got {request_id!r}") from None
            if n > len(self._free):
                self.reserve_failures += 1
                raise OutOfMemory(f"{n} pages wanted, {len(self._free)} free")
            blk = PagedBlock(self, request_id, self._take(n), prompt)
            self._live[request_id] = blk
        return blk

    def _lookup(self, request_id):
        return find_live(self._live, request_id)

    def block(self, request_id):
        with self._lock:
            return self._lookup(request_id)

    def grow(self, request_id, total_tokens):
        total = _count("total_tokens", total_tokens)
        with self._lock:
            blk = self._lookup(request_id)
            check_growth(request_id, blk.tokens, total, self.max_tokens)
            extra = -(-total // self.page_tokens) - len(blk.pages)
            if extra > 0:
                if extra > len(self._free):  # all or nothing, like vLLM's block pool
                    self.oom_events += 1
                    raise OutOfMemory(f"request {request_id!r} needs {extra} more pages, "
                                      f"{len(self._free)} free")
                blk.pages.extend(self._take(extra))
                blk.capacity_tokens = len(blk.pages) * self.page_tokens
            blk.tokens = total
            return blk

    def release(self, request_id, realized_tokens=None, *, preempted=False):
        realized = None if realized_tokens is None else _count("realized_tokens", realized_tokens)
        with self._lock:
            blk = self._lookup(request_id)
            total = blk.tokens if realized is None else blk.prompt_tokens + realized
            if total > blk.capacity_tokens:
                raise BadArgument(f"request {request_id!r} cannot have generated {realized} "
                                  f"tokens: its pages hold {blk.capacity_tokens} in all")
            del self._live[request_id]
            self._free.extend(reversed(blk.pages))
            blk.live = False
            if preempted:
                self.preemptions += 1
                return
            seg = blk.segments
            self.completed += 1
            self.used_tokens_sum += total
            self.reserved_tokens_sum += blk.capacity_tokens
            self.segments_sum += seg
            self.segments_max = max(self.segments_max, seg)

    def __len__(self):
        return len(self._live)

    def live_blocks(self):
        with self._lock:
            return list(self._live.values())

    def fragmentation(self) -> float:
        return 0.0  # any free page serves any request

    def stats(self) -> dict:
        with self._lock:
            blocks = list(self._live.values())
            used_pages = self.n_pages - len(self._free)
            tokens = sum(b.tokens for b in blocks)
            cap = sum(b.capacity_tokens for b in blocks)
            return {
                "policy": self.name,
                "device": None if self.device is None else self.device.spec,
                "pool_bytes": self.pool_bytes,
                "reserved_bytes": used_pages * self.page_bytes,
                "free_bytes": len(self._free) * self.page_bytes,
                "used_bytes": tokens * self.bytes_per_token,
                "live_blocks": len(blocks),
                "live_tokens": tokens,
                "live_capacity_tokens": cap,
                "occupancy": used_pages / self.n_pages,
                "live_utilization": tokens / cap if cap else None,
                "external_fragmentation": 0.0,
                "page_tokens": self.page_tokens,
                "live_segments_mean": (sum(b.segments for b in blocks) / len(blocks)
                                       if blocks else None),
                "segments_per_request_mean": (self.segments_sum / self.completed
                                              if self.completed else None),
                "segments_per_request_max": self.segments_max,
                "completed": self.completed,
                "preemptions": self.preemptions,
                "utilization": (self.used_tokens_sum / self.reserved_tokens_sum
                                if self.reserved_tokens_sum else None),
                "migrations": 0,
                "oom_events": self.oom_events,
                "reserve_failures": self.reserve_failures,
            }

    def check(self) -> None:
        with self._lock:
            seen = set(self._free)
            assert len(seen) == len(self._free), "a page is twice in the free list"
            for rid, b in self._live.items():
                assert b.live and b.request_id == rid
                assert b.tokens <= b.capacity_tokens == len(b.pages) * self.page_tokens
                for p in b.pages:
                    assert p not in seen, f"page {p} is used twice"
                    seen.add(p)
            assert seen == set(range(self.n_pages)), "a page is lost"

    def refresh_buckets(self):
        return None

    def close(self) -> None:
        if self._buffer is not None:
            buf, self._buffer = self._buffer, None
            self.device.free(buf)
            if self._owns_device:
                self.device.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


POLICIES = {"odma": RacmAllocator, "static": StaticAllocator, "s3": S3Allocator,
            "paged": PagedAllocator, "oracle": OracleAllocator}
