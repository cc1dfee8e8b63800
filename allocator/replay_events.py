"""The event-driven replay behind `odma-hw replay` (allocator/replay.py gives the model and the
metrics): replay_requests() runs the requests of a trace through an allocator, step by step
only where something happens (an arrival, a completion, a block outgrown), integrating the
token counts between events in closed form, and returns the metrics dict."""

from __future__ import annotations

import collections
import heapq
import sys
import time

import numpy as np

from odma_cli.errors import BadArgument

from allocator.errors import OutOfMemory
from allocator.placement import LARGE
from allocator.predictors import Request, after_preemption


# event kinds, in the order a step handles them: blocks outgrown at step T grow before the token
# of step T is generated; requests finish at the end of their last step
_OUTGROWN = 0
_FINISHED = 1


def replay_requests(trace, alloc, pred, prompt, gen, arrive, policy, predictor, samples,
                    progress, t_wall, settings) -> dict:
    """Replay the requests through `alloc` and return run_replay's metrics dict."""
    replay = _Replay(alloc, pred, prompt, gen, arrive, samples,
                     f"{policy}/{predictor}" if progress else None)
    replay.run()
    out = _summary(replay, trace.name, policy, predictor, settings)
    out["wall_seconds"] = time.perf_counter() - t_wall
    return out


class _RunningSet:
    """The running requests in aggregate, and their sums over steps. Between two events only
    token counts change: a request admitted at step s with prompt p holds p + t - s tokens at
    step t, so the set holds held_offset + count * t, with held_offset the sum of p - s, and a
    span of steps integrates in closed form."""

    def __init__(self):
        self.count = 0
        self.peak = 0
        self.held_offset = 0           # sum over running requests of prompt - admission step
        self.reserved = 0              # sum over running requests of their block's capacity
        self.sum_running = 0.0         # over steps: running requests
        self.sum_held = 0.0            # over steps: tokens in use
        self.sum_reserved = 0.0        # over steps: tokens reserved
        self.sum_utilization = 0.0     # over steps with something reserved: in use / reserved
        self.utilization_steps = 0

    def join(self, prompt: int, start: int, capacity: int) -> None:
        self.count += 1
        if self.count > self.peak:
            self.peak = self.count
        self.held_offset += prompt - start
        self.reserved += capacity

    def leave(self, prompt: int, start: int, capacity: int) -> None:
        self.count -= 1
        self.held_offset -= prompt - start
        self.reserved -= capacity

    def resize(self, old_capacity: int, new_capacity: int) -> None:
        self.reserved += new_capacity - old_capacity

    def integrate(self, a: int, b: int) -> None:
        """Account steps a..b (inclusive) with the running set unchanged."""
        if b < a:
            return
        k = b - a + 1
        self.sum_running += self.count * k
        self.sum_reserved += self.reserved * k
        held = self.held_offset * k + self.count * (a + b) * k / 2
        self.sum_held += held
        if self.reserved:
            self.sum_utilization += held / self.reserved
            self.utilization_steps += k


class _Replay:
    """One replay's state and its steps (see the module doc for the model). Each request keeps
    the admission step and block capacity of its current attempt, and an epoch that a preemption
    bumps, so that the events scheduled for an abandoned attempt are skipped when they come."""

    def __init__(self, alloc, pred, prompt: list, gen: list, arrive, samples: int,
                 progress_label: str | None):
        n = self.n = len(prompt)
        self.alloc = alloc
        self.pred = pred
        self.prompt = prompt
        self.gen = gen
        self.arrival_order = sorted(range(n), key=lambda i: (arrive[i], i))
        self.arrive = arrive.tolist()
        self.bytes_per_token = alloc.bytes_per_token
        self.pool_tokens = alloc.pool_bytes / alloc.bytes_per_token
        self.real_bytes = alloc.holds_bytes    # a real pool: a migration copies what was written
        self.requests = [Request(i, prompt[i], gen[i]) for i in range(n)]
        self.predicted: list = [None] * n  # (L, u) made once, before the first admission
        self.start = [0] * n               # admission step of the current attempt
        self.cap = [0] * n                 # capacity (tokens) of the current block
        self.epoch = [0] * n               # bumps on preemption: stale events are skipped
        self.first_admit = [-1] * n
        self.went_large = [False] * n
        self.overflowed = [False] * n
        self.events: list = []             # heap of (step, _OUTGROWN / _FINISHED, request, epoch)
        self.waiting: collections.deque = collections.deque()
        self.next_arrival = 0              # index into arrival_order of the next to arrive
        self.running = _RunningSet()
        self.live: dict = {}               # running requests, in the order of their admission
        self.preemptions = 0               # every OutOfMemory preempts: also the OOM count
        self.completed = 0
        self.used_total = 0                # over completed requests: prompt + generated
        self.reserved_total = 0            # over completed requests: their final block
        self.generated_total = 0
        self.first_step = self.arrive[self.arrival_order[0]]
        self.last_step = self.first_step - 1   # the last step integrated
        # allocator samples, every sample_every completions and at the last one
        self.sample_every = max(1, n // max(1, samples))
        self.next_sample = self.sample_every
        self.fragmentation: list = []
        self.series: list = []             # (step, running, reserved / pool, fragmentation)
        self.progress_label = progress_label
        self.last_progress = time.perf_counter()

    def run(self) -> None:
        """Replay event to event until every request has completed."""
        while self.completed < self.n:
            T = self._next_event_step()
            self.running.integrate(self.last_step + 1, T - 1)
            batch = []
            while self.events and self.events[0][0] == T:
                batch.append(heapq.heappop(self.events))
            for _, kind, i, e in batch:
                if kind == _OUTGROWN and e == self.epoch[i]:
                    self._grow_or_preempt(i, T)
            self.running.integrate(T, T)
            for _, kind, i, e in batch:
                if kind == _FINISHED and e == self.epoch[i]:
                    self._complete(i)
            self._enqueue_arrivals(T)
            self._admit(T)
            self.last_step = T
            if self.completed >= self.next_sample or self.completed == self.n:
                self._sample(T)

    def _next_event_step(self) -> int:
        """The next step where something happens: an event or an arrival."""
        T = self.events[0][0] if self.events else None
        if self.next_arrival < self.n:
            ta = self.arrive[self.arrival_order[self.next_arrival]]
            if T is None or ta < T:
                T = ta
        if T is None:
            raise RuntimeError("replay stalled: requests wait but nothing runs")  # cannot happen
        return T

    def _enqueue_arrivals(self, T: int) -> None:
        """Requests arriving by step T join the back of the queue."""
        order = self.arrival_order
        while self.next_arrival < self.n and self.arrive[order[self.next_arrival]] <= T:
            self.waiting.append(order[self.next_arrival])
            self.next_arrival += 1

    def _admit(self, T: int) -> None:
        """FCFS, no skipping: admit from the head of the queue while the policy can reserve."""
        waiting, prompt = self.waiting, self.prompt
        while waiting:
            i = waiting[0]
            if self.predicted[i] is None:
                self.predicted[i] = self.pred.predict(self.requests[i])
            L, u = self.predicted[i]
            try:
                blk = self.alloc.reserve(i, prompt[i], L, u)
            except OutOfMemory:
                if self.running.count == 0:
                    raise BadArgument(f"request {i} ({prompt[i]} + {self.gen[i]} tokens) does "
                                      f"not fit in an empty pool: enlarge --kv-pool-gb") from None
                return
            waiting.popleft()
            if self.first_admit[i] < 0:
                self.first_admit[i] = T
            if blk.bucket == LARGE:
                self.went_large[i] = True
            self.start[i] = T
            self.cap[i] = c = blk.capacity_tokens
            self.running.join(prompt[i], T, c)
            self.live[i] = None
            self._schedule_outgrowing(i)
            heapq.heappush(self.events, (T + self.gen[i], _FINISHED, i, self.epoch[i]))

    def _schedule_outgrowing(self, i: int) -> None:
        """Schedule the step at which request i outgrows its current block, if it ever does:
        the step whose token would be the block's (capacity + 1)-th."""
        c = self.cap[i]
        if self.prompt[i] + self.gen[i] > c:
            heapq.heappush(self.events, (self.start[i] + c - self.prompt[i] + 1, _OUTGROWN, i,
                                         self.epoch[i]))

    def _grow_or_preempt(self, i: int, T: int) -> None:
        """Request i outgrew its block at step T: grow it (the allocator may migrate it); on
        OutOfMemory preempt the running request admitted last (not one that completes at T)
        and try again, until i itself is that request and is preempted."""
        total = self.prompt[i] + T - self.start[i]
        while True:
            try:
                if self.real_bytes:  # the KV written so far is what a migration must copy
                    self.alloc.block(i).mark_written((total - 1) * self.bytes_per_token)
                blk = self.alloc.grow(i, total)
                break
            except OutOfMemory:
                # least progress loses least; ties to the one admitted last
                victim = min((v for v in reversed(self.live)
                              if v == i or self.start[v] + self.gen[v] != T),
                             key=lambda v: T - self.start[v])
                self._preempt(victim, T)
                if victim == i:
                    return
        self.overflowed[i] = True
        if blk.bucket == LARGE:
            self.went_large[i] = True
        self.running.resize(self.cap[i], blk.capacity_tokens)
        self.cap[i] = blk.capacity_tokens
        self._schedule_outgrowing(i)

    def _preempt(self, i: int, T: int) -> None:
        """Free request i's block and requeue it at the head, to rerun from scratch."""
        self.preemptions += 1
        self.alloc.release(i, preempted=True)
        self.epoch[i] += 1
        self.running.leave(self.prompt[i], self.start[i], self.cap[i])
        del self.live[i]
        # rerun from scratch, knowing it makes more than the tokens it reached
        self.predicted[i] = after_preemption(self.predicted[i], T - 1 - self.start[i])
        self.waiting.appendleft(i)

    def _complete(self, i: int) -> None:
        """Request i made its last token: free its block and tell the predictor its length."""
        gen = self.gen[i]
        self.alloc.release(i, gen)
        self.pred.observe(self.requests[i], gen)
        self.running.leave(self.prompt[i], self.start[i], self.cap[i])
        del self.live[i]
        self.completed += 1
        self.used_total += self.prompt[i] + gen
        self.reserved_total += self.cap[i]
        self.generated_total += gen

    def _sample(self, T: int) -> None:
        """Sample the allocator's fragmentation and a --series point (and maybe report)."""
        self.next_sample += self.sample_every
        frag = self.alloc.fragmentation()
        self.fragmentation.append(frag)
        self.series.append((T, self.running.count, self.running.reserved / self.pool_tokens,
                            frag))
        if self.progress_label and time.perf_counter() - self.last_progress > 2:
            self.last_progress = time.perf_counter()
            print(f"replay {self.progress_label}: {self.completed}/{self.n} requests, step {T}, "
                  f"{self.running.count} running, {len(self.waiting)} waiting", file=sys.stderr)


def _summary(replay: _Replay, trace_name: str, policy: str, predictor: str,
             settings: dict) -> dict:
    """The metrics dict of a finished replay (wall_seconds left for the caller to fill in)."""
    n = replay.n
    steps = replay.last_step - replay.first_step + 1
    running = replay.running
    pool_tokens = replay.pool_tokens
    st = replay.alloc.stats()
    buckets = getattr(replay.alloc, "buckets", None)
    migrations = st.get("migrations", 0)
    overflowed = sum(replay.overflowed)
    frag = replay.fragmentation
    out = {
        "schema": "odma-hw.replay/1",
        "policy": policy,
        "predictor": predictor,
        "trace": trace_name,
        "requests": n,
        "completed": replay.completed,
        "lost": n - replay.completed,
        "utilization": replay.used_total / replay.reserved_total,
        "migrations": migrations,
        "migration_rate": migrations / n,
        "migrated_bytes": st.get("migrated_bytes", 0),
        "migration_seconds": st.get("migration_seconds", 0.0),
        "oom_events": replay.preemptions,
        "preemptions": replay.preemptions,
        "overflowed_requests": overflowed,
        "large_bucket_requests": sum(replay.went_large),
        "bucket_accuracy": 1.0 - overflowed / n,
        "mean_concurrency": running.sum_running / steps,
        "peak_concurrency": running.peak,
        "steps": steps,
        "tokens_per_step": replay.generated_total / steps,
        "mean_wait_steps": sum(replay.first_admit[i] - replay.arrive[i] for i in range(n)) / n,
        "time_avg_occupancy": running.sum_reserved / steps / pool_tokens,
        "time_avg_kv_fill": running.sum_held / steps / pool_tokens,
        "time_avg_utilization": (running.sum_utilization / running.utilization_steps
                                 if running.utilization_steps else None),
        "external_fragmentation_mean": float(np.mean(frag)) if frag else 0.0,
        "external_fragmentation_max": float(np.max(frag)) if frag else 0.0,
        "bucket_bounds": st.get("bucket_bounds"),
        "bucket_bounds_history": ([{"completions": c, "bounds": list(b)}
                                   for c, b in buckets.history] if buckets is not None else []),
        "settings": settings,
        "wall_seconds": None,
        "series": [{"step": s, "running": r, "occupancy": o, "fragmentation": f}
                   for s, r, o, f in replay.series],
    }
    if "segments_per_request_mean" in st:
        out["segments_per_request_mean"] = st["segments_per_request_mean"]
        out["segments_per_request_max"] = st["segments_per_request_max"]
    return out

