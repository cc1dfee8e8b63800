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

import collections
import heapq
import itertools
import math

from odma_hw.errors import BadArgument

from allocator.errors import OutOfMemory
from allocator.predictors import Request, after_preemption

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


class Scheduler:
    """Every decision of one replica serving its requests, on a KV allocator, with an optional
    prefix cache, iteration level:
    - arrivals: a request is sent at its arrival time; with `concurrency` C (closed loop, as
      `vllm bench serve --max-concurrency C` makes it) at most C are in flight: request m
      (counting from 0 in arrival order) is sent no earlier than completion m - C (counting
      from 0 in the order completions come);
    - admission: waiting requests in the queue's order while the allocator can reserve their KV
      (the whole context: prompt and, after a preemption, what it made; no skipping) and the
      batch holds at most max_batch requests; a cached prefix is restored into the new block.
      Prefill-first (vLLM v0, max_batched_tokens None): the admitted prompts hold at most
      max_prefill tokens and run as one prefill iteration before decoding goes on. Chunked
      (vLLM v1's default): every step has a budget of max_batched_tokens tokens: one per running
      request's decode, then chunks of the prompts being prefilled in admission order, then
      new admissions while budget is left, each taking what is left (chunks()); a prefilling
      request joins the decodes after the step that computes its last prompt token;
    - after its prefill a request has made its first token; every decode step makes one more for
      every running request. A request making its j-th token holds prompt + j tokens of KV (the
      slot of the token being made included); when that outgrows its block it grows (the
      allocator may migrate it), and on OutOfMemory it is preempted: its KV is freed and it goes
      back to the front of the queue, to prefill its prompt and what it made again (recompute);
    - a request that has made all its tokens finishes: its KV is freed (and offered to the
      cache). A request done in its prefill never grows: its last token is output, never read;
    - an allocator whose `admission` is "demand" (ElasticAllocator) commits KV as tokens come, so
      admission also asks that the predicted remaining need of every admitted request (its
      predicted final footprint, prompt + L x (1 + demand_bound x u), beyond what it holds) and
      the new request's whole footprint fit the free pool; and a growth that finds no room
      preempts the running request with the least progress (fewest tokens of context; ties to
      the one admitted last), again until the growth fits or the grower is that request.
    - preemption "swap" (vLLM v0's preemption_mode): a preempted request that has made a token
      keeps its KV (prompt + made - 1 tokens, all written) in host memory while the host's
      swap space (swap_bytes) has room, else it is recomputed; a swapped request is readmitted
      at the front like any other, with room for its next token, and after the step that
      admitted it its KV is copied back (resume(): no prefill) and it joins the decodes. A copy
      that fails either way loses nothing: the request is recomputed.
    - co-batching by bucket tag (cobatch W > 0, the paper's task pool): admission tries, among
      the first W waiting requests, the oldest whose tag (the bucket its prediction places it
      in: the allocator's policy's, else its power-of-two class of predicted tokens) is the
      commonest in the batch; the head instead when none is, or when it was passed over W
      times already (so nothing waits forever). Predictions are made when a request enters
      the window, as the paper's predictor tags requests before they are pooled.
    What a decision costs in time is not decided here: the caller's executor (a timing model, or
    a real model's forward passes) costs or runs the steps. `tot` counts the decisions; `log`,
    when given, records each one as (what, request id) in the order made; `migrate`, when given,
    is the allocator's copy for a migration (see ContiguousPool.grow)."""

    def __init__(self, alloc, predictor, requests: list, *, max_batch: int, max_prefill: int,
                 bytes_per_token: int, cache=None, schedule: str = "fcfs", prefetch: int = 0,
                 tot=None, migrate=None, log: list | None = None,
                 max_batched_tokens: int | None = None, concurrency: int | None = None,
                 preemption: str = "recompute", swap_bytes: int = 0, cobatch: int = 0):
        check_scheduling(max_batch, max_batched_tokens, concurrency, preemption=preemption,
                         swap_bytes=swap_bytes, cobatch=cobatch)
        if cobatch and schedule != "fcfs":
            raise BadArgument(f"co-batching by bucket tag takes requests in arrival order: it "
                              f"does not combine with the {schedule} prefix schedule")
        self.alloc = alloc
        self.predictor = predictor
        self.reqs = requests
        self.max_batch = max_batch
        self.max_prefill = max_prefill
        self.max_batched_tokens = max_batched_tokens
        self.bpt = bytes_per_token
        self.cache = cache
        self.prefetch_depth = prefetch
        self.tot = collections.Counter() if tot is None else tot
        reqs = requests
        self.waiting = WaitingQueue(schedule, lambda i: reqs[i].arrival,
                                    lambda i: reqs[i].prefix or None,
                                    lambda key: DISTANCE[cache.lookup(key)[0]])
        self.running: dict = {}
        self.prefilling: dict = {}     # admitted, prompt not all computed (chunked): in order
        self.done = 0
        self.migrate = migrate
        self.log = log
        self.order = sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival, i))
        self.sent = 0                  # requests of `order` sent so far
        self.concurrency = concurrency
        self.finish_times: list = []   # of the completions, in the order they came
        self.demand = getattr(alloc, "admission", "reserve") == "demand"
        self.bound = getattr(getattr(alloc, "config", None), "demand_bound", 0.0)
        # the executor's view of a running request's context now (the simulation counts its
        # tokens lazily), and what it must do before one is preempted to make room
        self.context_of = lambda i, r: r.prompt + r.made
        self.evicting = lambda i, r: None
        # swap: the host's room, what it holds, and the executor's copies of a request's
        # first `tokens` of KV out of its block (before the block is freed) and back into it
        self.swap = preemption == "swap"
        self.swap_bytes = swap_bytes
        self.swapped_bytes = 0
        self.resuming: list = []       # swapped requests admitted, back after the step
        self.swap_out = lambda i, r, tokens: None
        self.swap_in = lambda i, r, tokens: None
        self.cobatch = cobatch
        self.passed_over = 0           # times the queue's head was passed over (co-batching)

    @property
    def chunked(self) -> bool:
        return self.max_batched_tokens is not None

    # -- arrivals ------------------------------------------------------------------------------
    def next_send(self) -> float | None:
        """When the next request is sent: its arrival, or later the completion that frees its
        place in a closed loop; None when none is left or its place is not free yet."""
        m = self.sent
        if m >= len(self.order):
            return None
        t = self.reqs[self.order[m]].arrival
        c = self.concurrency
        if c is not None and m >= c:
            if len(self.finish_times) <= m - c:
                return None
            t = max(t, self.finish_times[m - c])
        return t

    def arrive(self, now: float) -> None:
        """Queue every request sent by `now`; a closed loop's request arrives when sent."""
        while True:
            t = self.next_send()
            if t is None or t > now:
                return
            i = self.order[self.sent]
            self.reqs[i].arrival = t
            self.waiting.append(i)
            self.sent += 1

    def tier_of(self, r):
        """The cache tier holding r's prefix, or None."""
        return self.cache.lookup(r.prefix)[0] if self.cache is not None and r.prefix else None

    def admit(self, now: float, budget: int | None = None) -> tuple[list, float]:
        """Admit from the queue: ([(id, request, tokens held, tokens the cache covered)],
        seconds of the prefix restores). Prefill-first (budget None): while the prompts fit in
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
                r.predicted = self.predictor.predict(_request(i, r))
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
                tier = self.tier_of(r)
                tot[f"prefix_{tier or 'miss'}"] += 1
                if tier is not None:
                    covered, secs = cache.restore(r.prefix, blk, r.prefix_tokens)
                    restore += secs
                    waiting.moved(r.prefix)
            r.covered = covered
            admitted.append((i, r, held, covered))
            tokens += held - covered
        return admitted, restore

    def prefetch(self) -> float:
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

    def chunks(self, now: float) -> tuple[list, list, float]:
        """Chunked prefill: the prompt chunks of this step, [(id, request, first position,
        tokens)], within the tokens the running requests' decodes leave of the budget, admitting
        new requests while tokens are left; the admitted (as admit() gives them) and seconds of
        their prefix restores. Nothing when no token is left or no prompt waits."""
        budget = self.max_batched_tokens - len(self.running)
        if budget <= 0 or not (self.prefilling or self.waiting):
            return [], [], 0.0
        out = []
        for i, r in self.prefilling.items():
            if budget <= 0:
                break
            n = min(r.prompt + r.made - r.prefilled, budget)
            out.append((i, r, r.prefilled, n))
            self._note("chunk", i)
            budget -= n
        admitted, restore = [], 0.0
        if budget > 0 and self.waiting:
            admitted, restore = self.admit(now, budget)
            for i, r, held, covered in admitted:
                r.prefilled = covered
                self.prefilling[i] = r
                n = min(held - covered, budget)
                out.append((i, r, covered, n))
                self._note("chunk", i)
                budget -= n
        return out, admitted, restore

    def chunk_done(self, i, r, n: int) -> bool:
        """A step computed n more prompt tokens of request i: whether its prefill is complete
        (the caller then goes on as after a prefill: made_first_token, run_on)."""
        r.prefilled += n
        if r.prefilled < r.prompt + r.made:
            return False
        del self.prefilling[i]
        return True

    def made_first_token(self, i, r, t: float) -> bool:
        """Request i made its first token (of this admission) in a prefill ending at t; whether
        it is done (the caller then finishes it, and it never grows)."""
        if r.first_token is None:
            r.first_token = t
        r.made += 1
        return r.made >= r.gen

    def run_on(self, i, r):
        """Request i, admitted and not done, joins the batch with room for its next token's
        slot: (its block, bytes a migration copied). Raises OutOfMemory (the caller preempts)."""
        blk, moved = self.alloc.block(i), 0
        if r.prompt + r.made + 1 > blk.capacity_tokens:
            blk, moved = self.grow(i, r.prompt + r.made + 1)
        self.running[i] = r
        return blk, moved

    def grow(self, i, total: int):
        """Grow request i to `total` tokens: (its block, bytes a migration copied). Raises
        OutOfMemory (the request stays in its old block)."""
        alloc = self.alloc
        old = alloc.block(i)
        # the KV written so far (every token before this step's): what a migration copies
        old.mark_written(min((total - 1) * self.bpt, old.nbytes))
        before = alloc.migrated_bytes
        while True:
            try:
                blk = (alloc.grow(i, total) if self.migrate is None
                       else alloc.grow(i, total, copy=self.migrate))
                break
            except OutOfMemory:
                self._note("oom", i)
                victim = self._least_progress(i) if self.demand else i
                if victim == i:
                    raise
                self.evicting(victim, self.reqs[victim])
                self.preempt(victim, self.reqs[victim])
        if blk is not old:
            self._note("migrate", i)
        return blk, (0 if blk is old else alloc.migrated_bytes - before)

    def resume(self) -> list:
        """The swapped requests admission readmitted (`resuming`), after the step that admitted
        them: each one's KV back into its block, and it joins the batch (its next decode feeds
        its last token). [(id, request)] in admission order."""
        resuming, self.resuming = self.resuming, []
        out = []
        for i, r in resuming:
            self._note("resume", i)
            self.swapped_bytes -= r.swapped * self.bpt
            try:
                self.swap_in(i, r, r.swapped)
            except Exception:
                # a copy back that fails loses nothing but time: the request is recomputed
                self._note("swap_failed", i)
                self.tot["swap_failed"] += 1
                self.alloc.release(i, preempted=True)
                r.swapped = 0
                self.waiting.appendleft(i)
                continue
            self.tot["swap_ins"] += 1
            r.swapped = 0
            self.running[i] = r
            out.append((i, r))
        return out

    def preempt(self, i, r) -> None:
        """Free request i's KV and queue it at the front: swapped to the host (swap, when the
        request has made a token, all its context is written and the host has room), else
        to be recomputed."""
        self._note("preempt", i)
        self.running.pop(i, None)
        prefilling = self.prefilling.pop(i, None) is not None
        kv = r.prompt + r.made - 1
        if self.swap and r.made and not prefilling and \
                self.swapped_bytes + kv * self.bpt <= self.swap_bytes:
            try:
                self.swap_out(i, r, kv)
            except Exception:
                # a copy out that fails loses nothing: the request is recomputed
                self._note("swap_failed", i)
                self.tot["swap_failed"] += 1
            else:
                self._note("swap", i)
                r.swapped = kv
                self.swapped_bytes += kv * self.bpt
                self.tot["swap_outs"] += 1
        elif self.swap:
            self.tot["swap_refused"] += 1
        self.alloc.release(i, preempted=True)
        r.epoch += 1
        r.preemptions += 1
        self.tot["preemptions"] += 1
        r.predicted = after_preemption(r.predicted, r.made)
        self.waiting.appendleft(i)

    def finish(self, i, r, t: float) -> float:
        """Complete request i at time t; seconds of its offers to the cache (a copy into the
        device tier and the demotions that make room)."""
        self._note("finish", i)
        self.running.pop(i, None)
        blk = self.alloc.block(i)
        offered = 0.0
        cache = self.cache
        if cache is not None:
            if r.prefix and self.tier_of(r) is None:    # a prefix it computed: keep it
                offered += cache.offer(r.prefix, blk, r.prefix_tokens)
                self.waiting.moved(r.prefix)
            if r.offer:                                 # its whole context, for a next turn
                offered += cache.offer(r.offer, blk, r.prompt + r.gen)
                self.waiting.moved(r.offer)
            self.tot["prefix_offer"] += offered
        # the last token made is output, never read back: its KV slot need not exist, so a
        # request done in its prefill records what its block holds
        self.alloc.release(i, min(r.prompt + r.gen, blk.capacity_tokens) - blk.prompt_tokens)
        self.predictor.observe(_request(i, r), r.gen)
        r.made = r.gen
        r.finish = t
        self.done += 1
        self.finish_times.append(t)
        return offered

    def tag(self, i, r):
        """Request i's bucket tag (co-batching): where the allocator's policy would place its
        predicted length, else the power-of-two class of its predicted tokens."""
        if r.predicted is None:
            r.predicted = self.predictor.predict(_request(i, r))
        L, u = r.predicted
        place = getattr(getattr(self.alloc, "policy", None), "place", None)
        if place is None:
            return math.ceil(math.log2(L + 1)) if math.isfinite(L) else math.inf
        return place(r.prompt, L, u).bucket

    def _tagged(self, admitted) -> int:
        """The request admission tries next when co-batching (see the class docstring)."""
        window = self.waiting.first(self.cobatch)
        if self.passed_over >= self.cobatch:
            return window[0]
        counts = collections.Counter(self.tag(i, r) for group in (self.running, self.prefilling)
                                     for i, r in group.items())
        counts.update(self.tag(i, r) for i, r, *_ in admitted + self.resuming)
        if not counts:
            return window[0]
        target = max(counts.items(), key=lambda kv: kv[1])[0]
        reqs = self.reqs
        return next((i for i in window if self.tag(i, reqs[i]) == target), window[0])

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

    def _least_progress(self, grower) -> int:
        """The running request with the fewest tokens of context (the cheapest to recompute);
        ties to the one admitted last."""
        best, best_ctx = grower, self.context_of(grower, self.reqs[grower])
        for i, r in reversed(self.running.items()):
            ctx = self.context_of(i, r)
            if ctx < best_ctx:
                best, best_ctx = i, ctx
        return best

    def _note(self, what: str, i) -> None:
        if self.log is not None:
            self.log.append((what, i))


PREEMPTION = ("recompute", "swap")


def check_scheduling(max_batch: int, max_batched_tokens: int | None,
                     concurrency: int | None, replicas: int = 1, *,
                     preemption: str = "recompute", swap_bytes: int = 0,
                     cobatch: int = 0) -> None:
    """BadArgument for settings no scheduler can run: vLLM's rule that a step's token budget
    holds at least one decode token per running request; a closed loop's places split evenly
    over the replicas; a known preemption mode, a swap space of whole bytes >= 0 and a
    co-batching window of whole requests >= 0."""
    if not (isinstance(cobatch, int) and cobatch >= 0):
        raise BadArgument(f"the co-batching window must be a whole number of requests >= 0, "
                          f"got {cobatch!r}")
    if preemption not in PREEMPTION:
        raise BadArgument(f"unknown preemption mode {preemption!r}: expected one of "
                          f"{', '.join(PREEMPTION)}")
    if not (isinstance(swap_bytes, int) and swap_bytes >= 0):
        raise BadArgument(f"the swap space must be a whole number of bytes >= 0, got "
                          f"{swap_bytes!r}")
    if max_batched_tokens is not None and not (isinstance(max_batched_tokens, int)
                                               and max_batched_tokens >= max_batch):
        raise BadArgument(f"--max-num-batched-tokens {max_batched_tokens} must be an integer of "
                          f"at least --max-batch ({max_batch}): every running request decodes "
                          f"one token per step within that budget")
    if concurrency is not None and not (isinstance(concurrency, int) and concurrency >= 1):
        raise BadArgument(f"--concurrency must be a positive integer, got {concurrency!r}")
    if concurrency is not None and concurrency % replicas:
        raise BadArgument(f"--concurrency {concurrency} does not split evenly over {replicas} "
                          f"replicas (each keeps its share in flight)")


DISTANCE = {"device": 0, "host": 1, "disk": 2, None: 3}   # a tier's distance from the device


def _request(i, r) -> Request:
    return Request(i, r.prompt, r.gen)
