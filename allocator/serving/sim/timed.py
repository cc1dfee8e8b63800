"""The simulation's executor: the StepTimer (allocator/serving/sim/steptime.py) costs every step the
Scheduler plans, and the simulation's clock advances by the timed step.

A running request's tokens are counted lazily: between two events (a completion, a block
outgrown, a re-read of a contiguous request's efficiency, an arrival that can join the batch)
the batch does not change, so a decode plan runs every step up to the next event in closed form
(StepTimer.decode_span) and a request's `made` holds at its `start_step`. The events are kept
in a heap of (step, kind, request, epoch): kind 0 done, 1 outgrown, 2 re-read; an event of an
older epoch (the request was preempted since) is stale.
"""

from __future__ import annotations

import heapq

from allocator.serving.core.plan import DECODE, MIXED, PREFILL, Executor, Outcome, Plan
from allocator.serving.sim.steptime import StepTimer

RELINEARIZE = 64                 # steps between re-reads of a contiguous request's efficiency
SERIES_POINTS = 400


class TimedExecutor(Executor):
    """Times the plans of `sched` on `setup`'s card with KV in `layout`; its clock starts at the
    first arrival. `progress(done, total, now)` is called after every decode."""

    name = "simulation"

    def __init__(self, setup, sched, layout: str, progress=None):
        self.s = setup
        self.sched = sched
        self.alloc = sched.alloc
        self.tot = sched.tot              # seconds by component, and the scheduler's counts
        self.layout = layout
        self.progress = progress
        self.timer = StepTimer(setup, layout)
        self.events: list = []
        self.step = 0                     # decode steps done; the next one has this index
        self.clock = self.t_first = sched.reqs[sched.order[0]].arrival
        self.dma_busy_until = self.clock  # prefetches and offers: the copy engine, beside compute
        self.swap_due = 0.0               # seconds of swaps the step waits for
        self.stall = 0.0                  # seconds migrations (and swaps) stalled the step
        self.reread: list = []            # kind-2 events due at this step
        self.peak_batch = 0
        self.series: list = []
        self.next_sample = self.clock

    # -- the step ----------------------------------------------------------------------------
    def now(self) -> float:
        return self.clock

    def wait(self, until: float) -> None:
        self.clock = max(self.clock, until)

    def execute(self, plan: Plan) -> Outcome:
        self.stall = 0.0
        if plan.kind == DECODE:
            return self._decode(plan)
        restore = self._restore_and_prefetch(plan)
        if plan.kind == PREFILL:
            secs = self._prefill(plan)
            secs += restore
            self.tot["prefill"] += secs
            self.tot["prefill_tokens"] += sum(a.held - a.covered for a in plan.admitted)
            return Outcome(self.clock + secs, secs)
        timer, tot, nb = self.timer, self.tot, len(plan.decodes)
        if self.sched.cache is not None and plan.admitted:
            whole = [(a.held, 0) for a in plan.admitted]
            part = [(a.held, a.covered) for a in plan.admitted]
            tot["prefill_saved"] += timer.prefill(whole)[0] - timer.prefill(part)[0]
        secs = restore
        if nb or plan.chunks:             # else only swapped requests came back
            secs += timer.mixed_step(nb, self.step, [(c.start, c.tokens) for c in plan.chunks],
                                     tot)
        if nb:
            self.step += 1                # every running request made a token
        return self._due(Outcome(self.clock + secs, secs))

    def _prefill(self, plan: Plan) -> float:
        """Seconds of the prefill iteration over the admitted prompts (0 when only swapped
        requests were readmitted)."""
        parts = [(a.held, a.covered) for a in plan.admitted]
        if not parts:
            return 0.0
        timer, tot = self.timer, self.tot
        secs, flops, nbytes = timer.prefill(parts)
        if self.sched.cache is not None:
            tot["prefill_saved"] += timer.prefill([(h, 0) for h, _ in parts])[0] - secs
        timer.note_prefill(secs, flops, nbytes)
        tot["prefills"] += 1
        return secs

    def _decode(self, plan: Plan) -> Outcome:
        """Decode steps up to the next event, or to the step during which a request arrives."""
        tot, alloc = self.tot, self.alloc
        nb = len(plan.decodes)
        self.peak_batch = max(self.peak_batch, nb)
        dt = plan.horizon - self.clock if plan.horizon is not None else None
        k, secs = self.timer.decode_span(nb, self.step, self.events[0][0] - self.step, dt, tot)
        tot["occupancy_seconds"] += secs * alloc.reserved_bytes / alloc.pool_bytes
        self.clock += secs
        self.step += k
        return self._due(Outcome(self.clock, secs))

    def _due(self, out: Outcome) -> Outcome:
        """The events due at this step: completions and growths into `out`, re-reads kept for
        decodes_done(). An outgrown request's tokens are counted up to its event."""
        events, reqs, running = self.events, self.sched.reqs, self.sched.running
        while events and events[0][0] <= self.step:
            at, kind, i, e = heapq.heappop(events)
            r = reqs[i]
            if e != r.epoch or i not in running:
                continue
            if kind == 0:
                out.finished.append(i)
            elif kind == 1:
                r.made += at - r.start_step
                r.start_step = at
                out.outgrown.append(i)
            else:
                self.reread.append((at, i, e))
        return out

    def settle(self, plan: Plan, outcome: Outcome) -> None:
        alloc, tot = self.alloc, self.tot
        if plan.kind == DECODE:
            self.clock += self.stall
        else:
            secs = outcome.seconds + self.stall + self._swaps()
            self.peak_batch = max(self.peak_batch, len(self.sched.running))
            tot["occupancy_seconds"] += secs * alloc.reserved_bytes / alloc.pool_bytes
            self.clock += secs
            if plan.kind != MIXED:            # a chunked step is a decode step too
                return
        self._sample()

    def result(self) -> dict:
        tot, timer = self.tot, self.timer
        tot["peak_batch"] = self.peak_batch
        tot["floor_margin_min"] = timer.floor_margin
        tot["compute_floor_margin_min"] = timer.compute_margin
        tot["prefill_floor_margin_min"] = timer.prefill_margin
        return dict(totals=tot, series=self.series, t_first=self.t_first, t_end=self.clock,
                    allocator=self.alloc.stats())

    # -- the Scheduler's decisions -----------------------------------------------------------
    def unsettled(self, i, r) -> int:
        return self.step - r.start_step

    def evict(self, i, r) -> None:
        r.made += self.step - r.start_step
        r.start_step = self.step
        self.timer.add(r, -1)

    def swap_out(self, i, r, tokens: int) -> None:
        # swaps copy KV over the host link; the step that swaps waits for them
        self.swap_due += tokens * self.sched.bpt / (self.s.swap_gbps * 1e9)

    swap_in = swap_out

    def finished(self, i, r, t: float, offered: float, decoding: bool) -> None:
        if decoding:
            self.timer.add(r, -1)
        # its offers to the cache run on the copy engine beside compute, as prefetches do:
        # they delay later restores and prefetches, not the decode steps
        if offered:
            self.dma_busy_until = max(self.dma_busy_until, t) + offered

    def joined(self, i, r, blk, moved) -> None:
        if moved is not None:             # after its prefill: a migration stalls the step
            extra = self.timer.migration_seconds(moved)
            self.tot["migration"] += extra
            self.stall += extra
        self.timer.start(r, self.step, blk)
        self._schedule(i, r)

    def grew(self, i, r, blk, moved: int) -> None:
        extra = self.timer.migration_seconds(moved)
        self.stall += extra
        self.tot["migration"] += extra
        self.timer.relinearize(r, blk)
        if r.prompt + r.gen > r.block_tokens:
            heapq.heappush(self.events,
                           (r.start_step + r.block_tokens - r.prompt - r.made, 1, i, r.epoch))

    def decodes_done(self) -> None:
        running, reqs, events = self.sched.running, self.sched.reqs, self.events
        for at, i, e in self.reread:
            r = reqs[i]
            if e != r.epoch or i not in running:
                continue
            r.made += at - r.start_step
            r.start_step = at
            self.timer.relinearize(r, self.alloc.block(i))
            if r.gen - r.made > RELINEARIZE:
                heapq.heappush(events, (at + RELINEARIZE, 2, i, e))
        self.reread = []
        self.stall += self._swaps()

    # -- internals ---------------------------------------------------------------------------
    def _schedule(self, i, r) -> None:
        """Events of a running request from its snapshot (made at start_step)."""
        e, base, events = r.epoch, r.start_step, self.events
        heapq.heappush(events, (base + r.gen - r.made, 0, i, e))
        if r.prompt + r.gen > r.block_tokens:       # the step needing block_tokens + 1
            heapq.heappush(events, (base + r.block_tokens - r.prompt - r.made, 1, i, e))
        if self.layout == "contiguous" and r.gen - r.made > RELINEARIZE:
            heapq.heappush(events, (base + RELINEARIZE, 2, i, e))

    def _restore_and_prefetch(self, plan: Plan) -> float:
        """Prefix bookkeeping of an admission: a restore waits for the copy engine; the
        prefetches the plan started take it next. The restore's seconds."""
        restore = plan.restore
        if self.sched.cache is None:
            return restore
        now = self.clock
        if restore and self.dma_busy_until > now:
            restore += self.dma_busy_until - now
        tot = self.tot
        tot["prefix_restore"] += restore
        tot["prefix_covered_tokens"] += sum(a.covered for a in plan.admitted)
        if plan.prefetch:
            self.dma_busy_until = max(self.dma_busy_until, now) + plan.prefetch
        return restore

    def _swaps(self) -> float:
        """Seconds of the swaps since the last call (the step that made them waits)."""
        secs, self.swap_due = self.swap_due, 0.0
        self.tot["swap"] += secs
        return secs

    def _sample(self) -> None:
        """A point of the time series when one is due, and the progress line."""
        sched, now = self.sched, self.clock
        if now >= self.next_sample:
            self.next_sample = now + max(1e-3, (now - self.t_first) / SERIES_POINTS)
            self.series.append((now, len(sched.running), len(sched.waiting),
                                self.alloc.reserved_bytes / self.alloc.pool_bytes))
        if self.progress:
            self.progress(sched.done, len(sched.reqs), now)
