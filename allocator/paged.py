"""PagedAllocator: vLLM-style paged KV over the same device pool as the contiguous allocators.

Fixed pages of page_tokens tokens come from one FIFO free list (freed pages go to the tail, as
vLLM v1's block pool does) as a sequence grows. No external fragmentation and less than one page
of waste per request, but a request's KV is scattered over `segments` separate runs of pages:
the random access RACM devices punish. grow() is all or nothing: a request that needs more pages
than are free gets OutOfMemory and keeps what it had (the scheduler preempts it).
"""

from __future__ import annotations

import collections

from odma_cli.errors import BadArgument

from allocator.arguments import amount, count, positive_count
from allocator.config import check_config
from allocator.errors import OutOfMemory, require
from allocator.pool import LIVE, PinnedBlock, PoolAllocator


class PagedBlock(PinnedBlock):
    """A request's KV in pages: pages[i] holds tokens [i * page_tokens, (i + 1) * page_tokens).
    `segments` counts the separate contiguous runs of pages (1 = as good as contiguous).

    Pages are only ever appended (grow() extends the list), so the runs of consecutive pages are
    kept as they grow, from the pages added since they were last counted, instead of rescanned:
    a long request in a fragmented pool holds hundreds of runs, and the simulation's step timer
    reads them every time a page is added. `timer_line` is room for that timer's own record of
    the runs it has costed (allocator/serving/sim/steptime.py); the allocator never reads it."""

    __slots__ = ("pages", "_run_first", "_run_pages", "_counted", "timer_line")
    bucket = "paged"

    def __init__(self, owner, request_id, pages, prompt_tokens):
        super().__init__(owner, request_id, prompt_tokens, len(pages) * owner.page_tokens)
        self.pages = pages
        self._run_first: list = []     # first page of each run
        self._run_pages: list = []     # pages in each run
        self._counted = 0              # pages[:_counted] are in the runs
        self.timer_line = None

    @property
    def offset(self) -> int:
        return self.pages[0] * self._owner.page_bytes

    @property
    def nbytes(self) -> int:
        return len(self.pages) * self._owner.page_bytes

    @property
    def segments(self) -> int:
        return len(self.run_pages())

    def runs(self) -> list[tuple[int, int]]:
        """(first page, pages) of each run of consecutive pages, in token order."""
        lens = self.run_pages()
        return list(zip(self._run_first, lens))

    def run_pages(self) -> list[int]:
        """The pages in each run of consecutive pages, in token order (the block's own list:
        read it, never change it)."""
        pages, done = self.pages, self._counted
        if done != len(pages):
            first, lens = self._run_first, self._run_pages
            if done > len(pages) or (done and pages[done - 1] != first[-1] + lens[-1] - 1):
                first.clear()                  # not appended to: count the runs afresh
                lens.clear()
                done = 0
                self.timer_line = None
            end = first[-1] + lens[-1] if first else None
            for p in pages[done:] if done else pages:
                if p == end:
                    lens[-1] += 1
                else:
                    first.append(p)
                    lens.append(1)
                end = p + 1
            self._counted = len(pages)
        return self._run_pages

    def _spans(self, offset, nbytes):
        pb = self._owner.page_bytes
        pos = 0
        while pos < nbytes:
            page, within = divmod(offset + pos, pb)
            n = min(pb - within, nbytes - pos)
            yield self.pages[page] * pb + within, n, pos
            pos += n


class FreePages:
    """The FIFO free list of pages 0..n-1 that holds only pages once freed: the pages never used
    are the range [fresh, n), and they come before every freed page (a freed page goes to the
    tail, behind them), so pages come out in the order deque(range(n)) gives, while memory
    follows the pages used, not the pool's size."""

    def __init__(self, n: int):
        self.n = n
        self.fresh = 0
        self.freed: collections.deque = collections.deque()

    def __len__(self) -> int:
        return self.n - self.fresh + len(self.freed)

    def __iter__(self):
        yield from range(self.fresh, self.n)
        yield from self.freed

    def take(self, k: int) -> list:
        fresh = self.fresh
        if fresh + k <= self.n:
            self.fresh = fresh + k
            return list(range(fresh, fresh + k))
        new = range(fresh, self.n)
        self.fresh = self.n
        popleft = self.freed.popleft
        return [*new, *[popleft() for _ in range(k - len(new))]]

    def extend(self, pages) -> None:
        self.freed.extend(pages)


class PagedAllocator(PoolAllocator):
    """Invariants (check()): every page is either in the free list or in exactly one live
    request's page list; a request holds ceil(tokens / page_tokens) pages at least."""

    name = "paged"
    buckets = None
    migrations = 0
    migrated_bytes = 0
    migration_seconds = 0.0

    def __init__(self, device, pool_bytes: int, bytes_per_token: int, max_tokens: int,
                 config=None, *, page_tokens: int = 16):
        pool_bytes = positive_count("pool_bytes", pool_bytes)
        self.bytes_per_token = positive_count("bytes_per_token", bytes_per_token)
        self.max_tokens = positive_count("max_tokens", max_tokens)
        self.page_tokens = positive_count("page_tokens", page_tokens)
        self.config = check_config(config)
        super().__init__(device, self.config.byte_alignment)
        try:
            align = self.alignment
            self.page_bytes = -(-page_tokens * bytes_per_token // align) * align
            self.n_pages = pool_bytes // self.page_bytes
            self.pool_bytes = self.n_pages * self.page_bytes
            if self.n_pages * page_tokens < max_tokens:
                raise BadArgument(f"pool too small: {self.n_pages} pages of {page_tokens} tokens "
                                  f"cannot hold one {max_tokens}-token request")
            self._pool.allocate(self.pool_bytes, self.config.copy_chunk_bytes)
        except BaseException:
            self._pool.close()
            raise
        self._free = FreePages(self.n_pages)
        self.segments_sum = 0
        self.segments_max = 0

    def _take(self, n):
        return self._free.take(n)

    def reserve(self, request_id, prompt_tokens, predicted_tokens=0.0, uncertainty=0.0):
        """Pages for the prompt (at least one); the prediction is not used. Raises as
        ContiguousPool.reserve does."""
        prompt = count("prompt_tokens", prompt_tokens)
        amount("predicted_tokens", predicted_tokens)
        amount("uncertainty", uncertainty, allow_inf=True)
        if prompt >= self.max_tokens:
            raise BadArgument(f"prompt of {prompt} tokens leaves no room under max_tokens="
                              f"{self.max_tokens}")
        n = max(1, -(-prompt // self.page_tokens))
        with self._lock:
            self._check_new(request_id)
            if n > len(self._free):
                self.reserve_failures += 1
                raise OutOfMemory(f"{n} pages wanted, {len(self._free)} free")
            blk = PagedBlock(self, request_id, self._take(n), prompt)
            self._live[request_id] = blk
        return blk

    def grow(self, request_id, total_tokens, copy=None):
        """Append pages as the request grows; never migrates (`copy` is never called)."""
        total = count("total_tokens", total_tokens)
        with self._lock:
            blk = self._lookup(request_id)
            self._check_growth(blk, total)
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

    def _free_storage(self, blk):
        self._free.extend(reversed(blk.pages))

    def _completed(self, blk, total):
        seg = blk.segments
        with self._lock:
            self.segments_sum += seg
            self.segments_max = max(self.segments_max, seg)

    @property
    def reserved_bytes(self) -> int:
        return (self.n_pages - len(self._free)) * self.page_bytes

    def fragmentation(self) -> float:
        return 0.0  # any free page serves any request

    def refresh_buckets(self):
        return None

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
                "migrations": 0,
                "migrated_bytes": 0,
                "migration_seconds": 0.0,
                **self._counters(),
            }

    def check(self) -> None:
        with self._lock:
            seen = set(self._free)
            require(len(seen) == len(self._free), "a page is twice in the free list")
            for rid, b in self._live.items():
                require(b._state == LIVE and b.request_id == rid,
                        f"the live table maps {rid!r} to a block of {b.request_id!r}")
                require(b.tokens <= b.capacity_tokens == len(b.pages) * self.page_tokens,
                        f"request {rid!r} holds {b.tokens} tokens in {len(b.pages)} pages")
                for p in b.pages:
                    require(p not in seen, f"page {p} is used twice")
                    seen.add(p)
            require(seen == set(range(self.n_pages)), "a page is lost")
