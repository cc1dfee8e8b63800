"""Admission: which waiting requests a Scheduler admits into a step (prefill-first or chunked, by
reservation or by predicted demand, co-batched by bucket tag or in queue order), their prefix
restores and the prefetches of the queue's next prefixes. A mixin of Scheduler (core/scheduler.py),
whose state it reads and changes; see that class's docstring for the rules.
"""

from __future__ import annotations

import collections
import itertools
import math

from odma_cli.errors import BadArgument

from allocator.errors import OutOfMemory
from allocator.serving.core.plan import Admitted, Chunk
from allocator.serving.core.requests import predictor_request


class Admission:
    """Scheduler's admission half (see Scheduler)."""

    def _tier_of(self, r):
        """The cache tier holding r's prefix, or None."""
        return self.cache.lookup(r.prefix)[0] if self.cache is not None and r.prefix else None

    def _admit(self, now: float, budget: int | None = None) -> tuple[list, float]:
        """Admit from the queue: ([Admitted], seconds of the prefix restores). Prefill-first (budget None): while the prompts fit in
        max_prefill tokens; chunked: while the `budget` of tokens to compute is not spent.
        Raises BadArgument for a request that does not fit in an empty pool (it never could)."""
        admitted, tokens, restore = [], 0, 0.0
        waiting, cache, tot = self.waiting, self.cache, self.tot
        need = None                    # demand admission: the admitted requests' remaining need
        resuming = self.resuming
        while waiting and (len(self.running) + len(self.prefilling) + len(admitted)
                           + len(resuming) < self.max_batch):
            if budget is not None and tokens >= budget:
                break
            i = waiting.head(now) if not self.cobatch else self._tagged(admitted)
            r = self.reqs[i]
            # a rerun recomputes what it made; a swapped request gets its next token's slot
            held = r.prompt + r.made + (r.swapped > 0)
            if budget is None and admitted and not r.swapped and \
                    tokens + held > self.max_prefill:
                break
            if r.predicted is None:
                r.predicted = self.predictor.predict(predictor_request(i, r))
            L, u = r.predicted
            if self.demand:
                if need is None:
                    need = self._remaining_need()
                mine = self._footprint(r)
                free = self.alloc.pool_bytes - self.alloc.reserved_bytes
                if (self.running or self.prefilling or admitted or resuming) and \
                        (need + mine) * self.bpt > free:
                    break
            try:
                blk = self.alloc.reserve(i, held, max(0.0, L - r.made), u)
            except OutOfMemory:
                if not (self.running or self.prefilling or admitted or resuming):
                    raise BadArgument(
                        f"request {i} ({r.prompt} + {r.gen} tokens) does not fit in an empty KV "
                        f"pool of {self.alloc.pool_bytes / 1e9:.2f} GB") from None
                break
            if self.cobatch:
                self.passed_over = 0 if i == waiting.head(now) else self.passed_over + 1
            waiting.remove(i)
            self._note("admit", i)
            if need is not None:       # what it holds now is committed: the rest is need
                need += max(0, mine - blk.capacity_tokens)
            if r.swapped:              # nothing to compute: resumed after the step
                resuming.append((i, r))
                continue
            covered = 0
            if cache is not None and r.prefix:
                tier = self._tier_of(r)
                tot[f"prefix_{tier or 'miss'}"] += 1
                if tier is not None:
                    covered, secs = cache.restore(r.prefix, blk, r.prefix_tokens)
                    restore += secs
                    waiting.moved(r.prefix)
            r.covered = covered
            admitted.append(Admitted(i, r, held, covered))
            tokens += held - covered
        return admitted, restore

    def _prefetch(self) -> float:
        """Prefetch the prefixes of the next queued requests; seconds of the copies."""
        if self.cache is None or not self.prefetch_depth:
            return 0.0
        keys = [self.reqs[j].prefix for j in self.waiting.first(self.prefetch_depth)
                if self.reqs[j].prefix]
        if not keys:
            return 0.0
        secs = self.cache.prefetch(keys)
        for key in keys:
            self.waiting.moved(key)
        return secs

    def _chunks(self, now: float) -> tuple[list, list, float]:
        """Chunked prefill: the prompt chunks of this step (Chunk), within the tokens the running
        requests' decodes leave of the budget, admitting new requests while tokens are left; the
        admitted (as _admit() gives them) and seconds of their prefix restores. Nothing when no
        token is left or no prompt waits."""
        budget = self.max_batched_tokens - len(self.running)
        if budget <= 0 or not (self.prefilling or self.waiting):
            return [], [], 0.0
        out = []
        for i, r in self.prefilling.items():
            if budget <= 0:
                break
            n = min(r.prompt + r.made - r.prefilled, budget)
            out.append(Chunk(i, r, r.prefilled, n, r.prefilled + n >= r.prompt + r.made))
            self._note("chunk", i)
            budget -= n
        admitted, restore = [], 0.0
        if budget > 0 and self.waiting:
            admitted, restore = self._admit(now, budget)
            for i, r, held, covered in admitted:
                r.prefilled = covered
                self.prefilling[i] = r
                n = min(held - covered, budget)
                out.append(Chunk(i, r, covered, n, covered + n >= held))
                self._note("chunk", i)
                budget -= n
        return out, admitted, restore

    def _tag(self, i, r):
        """Request i's bucket tag (co-batching): where the allocator's policy would place its
        predicted length, else the power-of-two class of its predicted tokens."""
        if r.predicted is None:
            r.predicted = self.predictor.predict(predictor_request(i, r))
        L, u = r.predicted
        if not self.policy.places:
            return math.ceil(math.log2(L + 1)) if math.isfinite(L) else math.inf
        return self.alloc.policy.place(r.prompt, L, u).bucket

    def _tagged(self, admitted) -> int:
        """The request admission tries next when co-batching (see the class docstring)."""
        window = self.waiting.first(self.cobatch)
        if self.passed_over >= self.cobatch:
            return window[0]
        counts = collections.Counter(self._tag(i, r) for group in (self.running, self.prefilling)
                                     for i, r in group.items())
        counts.update(self._tag(i, r) for i, r, *_ in admitted + self.resuming)
        if not counts:
            return window[0]
        target = max(counts.items(), key=lambda kv: kv[1])[0]
        reqs = self.reqs
        return next((i for i in window if self._tag(i, reqs[i]) == target), window[0])

    def _footprint(self, r) -> int:
        """A request's predicted final footprint in tokens (demand admission): its prompt and
        L x (1 + demand_bound x u) generated, at least what it holds, at most max_tokens (with
        demand_bound None, what it holds and its next token)."""
        top = self.alloc.max_tokens
        if self.bound is None:         # no plan: what it holds and its next token
            return min(r.prompt + r.made + 1, top)
        L, u = r.predicted
        gen = L * (1.0 + self.bound * u) if self.bound else L
        if not gen < top:              # no idea (u infinite) or beyond any request: the most
            return top
        return min(max(r.prompt + r.made + 1, r.prompt + math.ceil(gen)), top)

    def _remaining_need(self) -> int:
        """Tokens the admitted requests are predicted to need beyond what they hold."""
        block = self.alloc.block
        return sum(max(0, self._footprint(r) - block(i).capacity_tokens)
                   for i, r in itertools.chain(self.running.items(), self.prefilling.items(),
                                               self.resuming))


