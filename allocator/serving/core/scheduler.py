"""The Scheduler: every decision of one replica serving its requests, one step at a time, behind
the step contract of core/plan.py (schedule() -> Plan; update(Plan, Outcome, executor)).
Admission is its mixin in core/admission.py; the waiting queue is core/queue.py.
"""

from __future__ import annotations

import collections

from odma_cli.errors import BadArgument

from allocator.errors import OutOfMemory
from allocator.policies import PolicySpec
from allocator.predictors import after_preemption
from allocator.serving.core.admission import Admission
from allocator.serving.core.checks import check_scheduling
from allocator.serving.core.plan import DECODE, IDLE, MIXED, PREFILL, Executor, Plan
from allocator.serving.core.queue import DISTANCE, WaitingQueue
from allocator.serving.core.requests import predictor_request

_RESERVE = PolicySpec("reserve", None)      # a Scheduler given no policy: reservation admission


class Scheduler(Admission):
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
    What a decision costs in time is not decided here: an executor (core/plan.py: a timing model,
    or a real model's forward passes) costs or runs each step the Scheduler plans (schedule()),
    and the Scheduler decides what follows from what the step made (update()), telling the
    executor each decision through its hooks. `policy` is the allocator's PolicySpec (its
    admission rule and its co-batching tag). `tot` counts the decisions; `log`,
    when given, records each one as (what, request id) in the order made; `migrate`, when given,
    is the allocator's copy for a migration (see ContiguousPool.grow)."""


    def __init__(self, alloc, predictor, requests: list, *, max_batch: int, max_prefill: int,
                 bytes_per_token: int, policy: PolicySpec | None = None, cache=None,
                 schedule: str = "fcfs", prefetch: int = 0, tot=None, migrate=None,
                 log: list | None = None, max_batched_tokens: int | None = None,
                 concurrency: int | None = None, preemption: str = "recompute",
                 swap_bytes: int = 0, cobatch: int = 0):
        check_scheduling(max_batch, max_batched_tokens, concurrency, preemption=preemption,
                         swap_bytes=swap_bytes, cobatch=cobatch)
        if cobatch and schedule != "fcfs":
            raise BadArgument(f"co-batching by bucket tag takes requests in arrival order: it "
                              f"does not combine with the {schedule} prefix schedule")
        self.alloc = alloc
        self.policy = policy = policy or _RESERVE
        self.predictor = predictor
        self.reqs = reqs = requests
        self.max_batch = max_batch
        self.max_prefill = max_prefill
        self.max_batched_tokens = max_batched_tokens
        self.bpt = bytes_per_token
        self.cache = cache
        self.prefetch_depth = prefetch
        self.tot = collections.Counter() if tot is None else tot
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
        self.demand = policy.demand
        self.bound = alloc.config.demand_bound if policy.demand else 0.0
        # swap: the host's room and what it holds
        self.swap = preemption == "swap"
        self.swap_bytes = swap_bytes
        self.swapped_bytes = 0
        self.resuming: list = []       # swapped requests admitted, back after the step
        self.cobatch = cobatch
        self.passed_over = 0           # times the queue's head was passed over (co-batching)
        # the executor the update tells its decisions (the default counts tokens at once)
        self._ex = Executor()

    @property
    def chunked(self) -> bool:
        return self.max_batched_tokens is not None

    # -- the step contract -----------------------------------------------------------------------
    def schedule(self, now: float) -> Plan:
        """Queue the requests sent by `now` and plan the next step: a prefill of the admitted
        (prefill-first), a mixed step of decodes and prompt chunks (chunked), a decode of the
        running requests, or, with nothing to run, an idle wait."""
        self._arrive(now)
        if self.chunked:
            chunks, admitted, restore = self._chunks(now)
            if chunks or self.resuming:
                return Plan(MIXED, admitted, chunks, sorted(self.running), list(self.resuming),
                            restore, self._prefetch())
        elif self.waiting and len(self.running) < self.max_batch:
            admitted, restore = self._admit(now)
            if admitted or self.resuming:
                return Plan(PREFILL, admitted, resuming=list(self.resuming), restore=restore,
                            prefetch=self._prefetch())
        t = self._next_send()
        if not self.running:
            return Plan(IDLE, wake=t)
        # an arrival can change the batch only while nothing waits and the batch has room
        open_batch = t is not None and not self.waiting and len(self.running) < self.max_batch
        return Plan(DECODE, decodes=sorted(self.running), horizon=t if open_batch else None)

    def update(self, plan: Plan, outcome, executor: Executor) -> None:
        """Decide what follows from the step `plan` ran and `outcome` says it made, in this
        order: the decodes' completions and growths (a growth without room preempts), then the
        first tokens of the prompts completed (each finishes, or joins the decodes, or is
        preempted), then the swapped requests readmitted come back. `executor` is told each
        decision as it is made (core/plan.py's hooks)."""
        self._ex = executor
        t = outcome.time
        if plan.kind == PREFILL:
            for a in plan.admitted:
                self._first_token(a.id, a.req, t)
        else:
            reqs, running = self.reqs, self.running
            for i in outcome.finished:
                if i in running:
                    self._finish(i, reqs[i], t)
            for i in outcome.outgrown:
                if i in running:
                    self._grow_or_preempt(i, reqs[i])
            executor.decodes_done()
            for c in plan.chunks:
                c.req.prefilled += c.tokens
                if c.last:
                    del self.prefilling[c.id]
                    self._first_token(c.id, c.req, t)
        self._resume()

    # -- arrivals ------------------------------------------------------------------------------
    def _next_send(self) -> float | None:
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

    def _arrive(self, now: float) -> None:
        """Queue every request sent by `now`; a closed loop's request arrives when sent."""
        while True:
            t = self._next_send()
            if t is None or t > now:
                return
            i = self.order[self.sent]
            self.reqs[i].arrival = t
            self.waiting.append(i)
            self.sent += 1

    # -- after a step ----------------------------------------------------------------------------
    def _first_token(self, i, r, t: float) -> None:
        """Request i made its first token (of this admission) in a step ending at t: it
        finishes (and never grows), or joins the decodes with room for its next token's slot,
        or, finding no room, is preempted."""
        if r.first_token is None:
            r.first_token = t
        r.made += 1
        if r.made >= r.gen:
            self._finish(i, r, t)
            return
        try:
            blk, moved = self._run_on(i, r)
        except OutOfMemory:
            self._preempt(i, r)
            return
        self._ex.joined(i, r, blk, moved)

    def _grow_or_preempt(self, i, r) -> None:
        """Running request i needs its next token's slot: it grows, or is preempted."""
        try:
            blk, moved = self._grow(i, r.prompt + r.made + 1)
        except OutOfMemory:
            self._ex.evict(i, r)
            self._preempt(i, r)
            return
        self._ex.grew(i, r, blk, moved)

    def _run_on(self, i, r):
        """Request i, admitted and not done, joins the batch with room for its next token's
        slot: (its block, bytes a migration copied). Raises OutOfMemory (the caller preempts)."""
        blk, moved = self.alloc.block(i), 0
        if r.prompt + r.made + 1 > blk.capacity_tokens:
            blk, moved = self._grow(i, r.prompt + r.made + 1)
        self.running[i] = r
        return blk, moved

    def _grow(self, i, total: int):
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
                self._ex.evict(victim, self.reqs[victim])
                self._preempt(victim, self.reqs[victim])
        if blk is not old:
            self._note("migrate", i)
        return blk, (0 if blk is old else alloc.migrated_bytes - before)

    def _resume(self) -> None:
        """The swapped requests admission readmitted (`resuming`), after the step that admitted
        them, in admission order: each one's KV back into its block, and it joins the batch (its
        next decode feeds its last token)."""
        resuming, self.resuming = self.resuming, []
        for i, r in resuming:
            self._note("resume", i)
            self.swapped_bytes -= r.swapped * self.bpt
            try:
                self._ex.swap_in(i, r, r.swapped)
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
            self._ex.joined(i, r, self.alloc.block(i), None)

    def _preempt(self, i, r) -> None:
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
                self._ex.swap_out(i, r, kv)
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

    def _finish(self, i, r, t: float) -> None:
        """Complete request i at time t; the executor is told the seconds of its offers to the
        cache (a copy into the device tier and the demotions that make room)."""
        self._note("finish", i)
        decoding = self.running.pop(i, None) is not None
        blk = self.alloc.block(i)
        offered = 0.0
        cache = self.cache
        if cache is not None:
            if r.prefix and self._tier_of(r) is None:    # a prefix it computed: keep it
                offered += cache.offer(r.prefix, blk, r.prefix_tokens)
                self.waiting.moved(r.prefix)
            if r.offer:                                 # its whole context, for a next turn
                offered += cache.offer(r.offer, blk, r.prompt + r.gen)
                self.waiting.moved(r.offer)
            self.tot["prefix_offer"] += offered
        # the last token made is output, never read back: its KV slot need not exist, so a
        # request done in its prefill records what its block holds
        self.alloc.release(i, min(r.prompt + r.gen, blk.capacity_tokens) - blk.prompt_tokens)
        self.predictor.observe(predictor_request(i, r), r.gen)
        r.made = r.gen
        r.finish = t
        self.done += 1
        self.finish_times.append(t)
        self._ex.finished(i, r, t, offered, decoding)

    def _least_progress(self, grower) -> int:
        """The running request with the fewest tokens of context (the cheapest to recompute);
        ties to the one admitted last."""
        best, best_ctx = grower, self._context(grower, self.reqs[grower])
        for i, r in reversed(self.running.items()):
            ctx = self._context(i, r)
            if ctx < best_ctx:
                best, best_ctx = i, ctx
        return best

    def _context(self, i, r) -> int:
        """Request i's tokens of context now (a running request's, as its executor counts)."""
        return r.prompt + r.made + (self._ex.unsettled(i, r) if i in self.running else 0)

    def _note(self, what: str, i) -> None:
        if self.log is not None:
            self.log.append((what, i))
