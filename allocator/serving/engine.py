"""The serving simulation: continuous batching of a request trace on one card or a TP group,
with every KV decision made by a real allocator and every step timed by a memory timing source.

- ServingSetup: the model, the card, the timing source and the serving settings of a run.
- Simulation: one replica; its Scheduler (allocator.serving.scheduler) makes every admission,
  growth, preemption and completion decision, its StepTimer (allocator.serving.steptime) costs
  every prefill, decode step and migration, and its loop drives the two event by event.
- run_policy: a whole trace on one or more replicas, summarised by allocator.serving.metrics.
No request is lost: a run ends when every request has made all its tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import sys
import time

import numpy as np

from odma_hw.errors import BadArgument

from allocator.config import AllocatorConfig
from allocator.errors import OutOfMemory
from allocator.policies import make_allocator
from allocator.predictors import make_predictor
from allocator.serving.metrics import summarise
from allocator.serving.presets import DTYPE_BYTES, Accelerator, ModelSpec
from allocator.serving.scheduler import Scheduler, check_scheduling
from allocator.serving.steptime import StepTimer, extent_config

LAYOUTS = ("contiguous", "v06", "hnd", "nhd")
PAGED_LAYOUTS = LAYOUTS[1:]
RELINEARIZE = 64                 # steps between re-reads of a contiguous request's efficiency
SERIES_POINTS = 400
MAX_TIER_BYTES = 2**63 - 1


@dataclasses.dataclass
class ServingSetup:
    """Everything a run needs besides the trace and the policy."""

    model: ModelSpec
    device: Accelerator
    timing: object                  # a MemoryTiming
    dtype: str = "bf16"
    tp: int = 1
    max_model_len: int = 0          # set by the caller (static blocks are this long)
    max_batch: int = 256
    max_prefill_tokens: int = 0     # 0: max(max_model_len, 2048), vLLM v0's default
    mfu: float = 0.5
    memory_utilization: float = 0.9
    kv_pool_gb: float | None = None  # per card; None: utilization x capacity - weights
    paged_layout: str = "hnd"
    page_tokens: int = 16
    predictor: str = "online"
    noise_sigma: float = 0.3
    config: AllocatorConfig = AllocatorConfig(background_refresh=False)
    seed: int = 0
    max_batched_tokens: int | None = None   # chunked prefill's token budget per step; None:
                                            # prefill-first
    concurrency: int | None = None          # closed loop: requests in flight at most
    preemption: str = "recompute"           # or "swap": a preempted request's KV to the host
    swap_space_gb: float = 4.0              # host memory for swapped KV per card (vLLM's 4 GiB)
    swap_gbps: float = 25.0                 # device <-> host copies (PCIe 4.0 x16, effective)
    cobatch: int = 0                        # co-batching window by bucket tag; 0: off

    def __post_init__(self):
        if self.paged_layout not in PAGED_LAYOUTS:
            raise BadArgument(f"unknown paged layout {self.paged_layout!r}: expected one of "
                              f"{', '.join(PAGED_LAYOUTS)}")
        if self.dtype not in DTYPE_BYTES:
            raise BadArgument(f"unknown dtype {self.dtype!r}: expected one of "
                              f"{', '.join(DTYPE_BYTES)}")
        self.device.peak_tflops(self.dtype)   # a card without that dtype's figure: refused now
        if not (isinstance(self.tp, int) and 1 <= self.tp <= 64):
            raise BadArgument(f"tp must be an integer in [1, 64], got {self.tp!r}")
        m, tp = self.model, self.tp
        # vLLM's rule: query heads split evenly; KV heads split evenly, or, with more cards
        # than KV heads, each is replicated on tp / kv_heads cards
        if m.heads % tp or (m.kv_heads % tp if tp <= m.kv_heads else tp % m.kv_heads):
            raise BadArgument(f"--tp {tp} does not split {m.name}'s {m.heads} query and "
                              f"{m.kv_heads} KV heads evenly: use a TP that divides {m.heads} "
                              f"and divides or is a multiple of {m.kv_heads}")
        check_scheduling(self.max_batch, self.max_batched_tokens, self.concurrency,
                         preemption=self.preemption, swap_bytes=self.swap_bytes,
                         cobatch=self.cobatch)
        if not (self.swap_gbps > 0 and math.isfinite(self.swap_gbps)):
            raise BadArgument(f"swap_gbps must be a finite number > 0, got {self.swap_gbps}")
        if not 0 < self.mfu <= 1:
            raise BadArgument(f"mfu must be in (0, 1], got {self.mfu}")
        if not 0 < self.memory_utilization <= 1:
            raise BadArgument(f"memory utilization must be in (0, 1], got "
                              f"{self.memory_utilization}")

    @property
    def swap_bytes(self) -> int:
        gb = self.swap_space_gb
        if not (isinstance(gb, (int, float)) and 0 <= gb * 1e9 <= MAX_TIER_BYTES):
            raise BadArgument(f"the swap space must be a number of GB in [0, "
                              f"{MAX_TIER_BYTES / 1e9:.3g}], got {gb!r}")
        return int(gb * 1e9)

    # -- what one card holds and reads ---------------------------------------------------------
    @property
    def kv_heads_per_card(self) -> int:
        """KV heads split over TP cards; with fewer heads than cards each card keeps one (a
        replica of it)."""
        return max(1, self.model.kv_heads // self.tp)

    @property
    def kv_dtype_bytes(self) -> int:
        """Bytes of one KV element: fp32 weights serve fp32 KV (as odma-hw's engine does on
        CPU); bf16 and int8 weights keep the model's bf16 KV."""
        return DTYPE_BYTES["fp32"] if self.dtype == "fp32" else self.model.kv_dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        m = self.model
        return 2 * m.layers * self.kv_heads_per_card * m.head_dim * self.kv_dtype_bytes

    @property
    def weight_bytes(self) -> float:
        """Weights one card streams per step (its 1/TP share)."""
        return self.model.streamed_weight_bytes(self.dtype) / self.tp

    def pool_bytes(self) -> int:
        free = (self.memory_utilization * self.device.capacity_gb * 1e9
                - self.model.weight_bytes(self.dtype) / self.tp)
        if self.kv_pool_gb is not None:
            room = self.device.capacity_gb * 1e9 - self.model.weight_bytes(self.dtype) / self.tp
            if self.kv_pool_gb * 1e9 > room:
                raise BadArgument(
                    f"--kv-pool-gb {self.kv_pool_gb:g} does not fit on a {self.device.name} "
                    f"card: {self.device.capacity_gb:g} GB less {self.model.name}'s weights "
                    f"({self.dtype}, TP{self.tp}) leaves {max(room, 0) / 1e9:.2f} GB")
            return int(self.kv_pool_gb * 1e9)
        if free < self.max_model_len * self.kv_bytes_per_token:
            raise BadArgument(
                f"{self.model.name} ({self.dtype}) leaves {max(free, 0) / 1e9:.2f} GB per "
                f"{self.device.name} card at TP{self.tp}: not enough KV for one "
                f"{self.max_model_len}-token request")
        return int(free)

    def run_layout(self, layout: str):
        """(runs per token-run, bytes per token in one run, whether a request's consecutive
        pages merge into one run) for a layout on one card."""
        m, h = self.model, self.kv_heads_per_card
        g = m.head_dim * self.kv_dtype_bytes
        if layout == "contiguous":
            return 2 * m.layers * h, g, True
        if layout == "nhd":
            return 2 * m.layers, h * g, True
        return 2 * m.layers * h, g, h == 1          # v06, hnd: a run per (page, head)


class RequestState:
    __slots__ = ("rid", "prompt", "gen", "made", "arrival", "first_token", "finish",
                 "preemptions", "predicted", "start_step", "a", "slope", "ab",
                 "sb", "epoch", "cap", "prefix", "prefix_tokens", "offer", "covered",
                 "prefilled", "swapped")

    def __init__(self, rid, prompt, gen, arrival, prefix="", prefix_tokens=0, offer=""):
        self.rid = rid
        self.prompt = prompt        # tokens of the original prompt
        self.gen = gen              # tokens it makes in all
        self.made = 0               # tokens made so far (kept across preemptions)
        self.arrival = arrival
        self.first_token = None
        self.finish = None
        self.preemptions = 0
        self.predicted = None       # (L, u) made once, before the first admission
        self.start_step = 0         # decode step at which `made` holds
        self.a = 0.0                # KV seconds at step s = a + s x slope
        self.slope = 0.0
        self.ab = 0.0               # KV bytes at step s = ab + s x sb
        self.sb = 0.0
        self.epoch = 0
        self.cap = 0
        self.prefix = prefix        # key of the prefix its prompt starts with ("" for none)
        self.prefix_tokens = prefix_tokens
        self.offer = offer          # key its whole context is offered under when it completes
        self.covered = 0            # prompt tokens the cache covered at its last admission
        self.prefilled = 0          # chunked prefill: context tokens computed (or restored)
        self.swapped = 0            # preempted by swap: tokens of its KV the host holds


@dataclasses.dataclass(frozen=True)
class PrefixSettings:
    """A tiered prefix cache (allocator.prefix) in front of prefill. Capacities in GB; the
    device tier is carved out of the KV pool. Bandwidths in GB/s; the device tier's copies run
    at the timing source's copy bandwidth."""

    device_gb: float = 0.0
    host_gb: float = 0.0
    disk_gb: float = 0.0
    eviction: str = "lru"
    schedule: str = "fcfs"          # fcfs | fpf | relaxed-fpf
    prefetch: int = 0               # queued requests the prefetcher looks ahead at
    host_to_device_gbps: float = 25.0
    device_to_host_gbps: float = 25.0
    disk_read_gbps: float = 3.0
    disk_write_gbps: float = 2.0

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise BadArgument(f"unknown prefix schedule {self.schedule!r}: expected one of "
                              f"{', '.join(SCHEDULES)}")
        for name in ("device_gb", "host_gb", "disk_gb", "host_to_device_gbps",
                     "device_to_host_gbps", "disk_read_gbps", "disk_write_gbps"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise BadArgument(f"{name} must be a finite number >= 0, got {v}")
        for name in ("device_gb", "host_gb", "disk_gb"):
            if getattr(self, name) * 1e9 > MAX_TIER_BYTES:
                raise BadArgument(f"{name} must be at most {MAX_TIER_BYTES / 1e9:.3g} GB (a "
                                  f"64-bit byte offset), got {getattr(self, name):g}")
        if not (isinstance(self.prefetch, int) and self.prefetch >= 0):
            raise BadArgument(f"prefetch must be an integer >= 0, got {self.prefetch!r}")


SCHEDULES = ("fcfs", "fpf", "relaxed-fpf")


def kv_pool_bytes(setup: ServingSetup, prefix: PrefixSettings | None = None) -> int:
    """The KV pool of one card: what setup gives, less the prefix cache's device tier."""
    pool = setup.pool_bytes()
    if prefix is not None:
        device_bytes = int(prefix.device_gb * 1e9)
        if device_bytes >= pool:
            raise BadArgument(f"a device tier of {prefix.device_gb:g} GB leaves no KV pool "
                              f"(the card has {pool / 1e9:.2f} GB for KV)")
        pool -= device_bytes
    return pool


def check_policy(setup: ServingSetup, policy: str, prefix: PrefixSettings | None = None) -> None:
    """check_pool() of the pool a simulated run of `policy` starts with."""
    check_pool(policy, kv_pool_bytes(setup, prefix), setup.kv_bytes_per_token,
               setup.max_model_len, setup.config, setup.page_tokens)


def check_pool(policy: str, pool_bytes: int, bytes_per_token: int, max_model_len: int,
               config: AllocatorConfig, page_tokens: int) -> None:
    """Make (and close) the allocator a run of `policy` starts with, keeping no bytes: a pool
    too small for its pages (rounded to whole pages), buckets or one request is refused before
    any work, by the simulation and the engine alike."""
    make_allocator(policy, None, pool_bytes, bytes_per_token, max_model_len, config,
                   page_tokens=page_tokens).close()


class Simulation:
    """One replica (a card or a TP group) serving its share of the requests: the Scheduler
    decides, the StepTimer costs each step, and the loop here drives them event by event.
    Between two events (an arrival, a completion, a block outgrown, a page boundary) the batch
    does not change, so any number of decode steps is summed in closed form; a contiguous
    request's efficiency is re-read every RELINEARIZE steps."""

    def __init__(self, setup: ServingSetup, policy: str, requests: list[RequestState],
                 progress=None, prefix: PrefixSettings | None = None):
        self.s = setup
        self.policy = policy
        self.layout = ("extent" if policy in ("extent", "elastic") else
                       setup.paged_layout if policy == "paged" else "contiguous")
        self.requests = requests
        self.progress = progress
        bpt = setup.kv_bytes_per_token
        pool = kv_pool_bytes(setup, prefix)
        self.cache = None
        if prefix is not None:
            from allocator.prefix import PrefixCache, TierBandwidth

            self.cache = PrefixCache(
                None, bpt, device_bytes=int(prefix.device_gb * 1e9),
                host_bytes=int(prefix.host_gb * 1e9),
                disk_bytes=int(prefix.disk_gb * 1e9), eviction=prefix.eviction,
                seed=setup.seed, bandwidth=TierBandwidth(
                    device_copy_gbps=float(setup.timing.copy_gbps),
                    host_to_device_gbps=prefix.host_to_device_gbps,
                    device_to_host_gbps=prefix.device_to_host_gbps,
                    disk_read_gbps=prefix.disk_read_gbps,
                    disk_write_gbps=prefix.disk_write_gbps))
        self.prefix = prefix
        # extents grow by this card's knee, which only the timing source knows
        config = extent_config(setup) if self.layout == "extent" else setup.config
        self.alloc = make_allocator(policy, None, pool, bpt, setup.max_model_len,
                                    config, page_tokens=setup.page_tokens)
        predictor = make_predictor("oracle" if policy == "oracle" else setup.predictor,
                                   seed=setup.seed, sigma=setup.noise_sigma)
        self.tot = collections.Counter()      # seconds by component, and counts
        self.sched = Scheduler(
            self.alloc, predictor, requests, max_batch=setup.max_batch,
            max_prefill=setup.max_prefill_tokens or max(setup.max_model_len, 2048),
            bytes_per_token=bpt, cache=self.cache,
            schedule=prefix.schedule if prefix else "fcfs",
            prefetch=prefix.prefetch if prefix else 0, tot=self.tot,
            max_batched_tokens=setup.max_batched_tokens, concurrency=setup.concurrency,
            preemption=setup.preemption, swap_bytes=setup.swap_bytes, cobatch=setup.cobatch)
        self.timer = StepTimer(setup, self.layout)
        # a running request's tokens are counted lazily (made at start_step): what the
        # scheduler's least-progress rule reads, and what a request preempted to make room
        # for another's growth settles before it leaves the batch
        sched = self.sched

        def context_of(i, r):
            return r.prompt + r.made + (self.step - r.start_step if i in sched.running else 0)

        def evicting(i, r):
            r.made += self.step - r.start_step
            r.start_step = self.step
            self.timer.add(r, -1)
        sched.context_of, sched.evicting = context_of, evicting
        # swaps copy KV over the host link; the step that swaps waits for them
        self.swap_due = 0.0

        def swapping(i, r, tokens):
            self.swap_due += tokens * bpt / (setup.swap_gbps * 1e9)
        sched.swap_out = sched.swap_in = swapping
        self.events: list = []     # (step, kind, request, epoch): 0 done, 1 outgrown, 2 re-read
        self.step = 0              # decode steps done; the next one has this index
        self.dma_busy_until = 0.0  # prefetches and offers: the copy engine, beside compute

    def _schedule(self, i, r) -> None:
        """Events of a running request from its snapshot (made at start_step)."""
        e, base, events = r.epoch, r.start_step, self.events
        heapq.heappush(events, (base + r.gen - r.made, 0, i, e))
        if r.prompt + r.gen > r.cap:       # the step needing cap + 1 tokens
            heapq.heappush(events, (base + r.cap - r.prompt - r.made, 1, i, e))
        if self.layout == "contiguous" and r.gen - r.made > RELINEARIZE:
            heapq.heappush(events, (base + RELINEARIZE, 2, i, e))

    def _finish(self, i, r, t: float) -> None:
        # its offers to the cache run on the copy engine beside compute, as prefetches do:
        # they delay later restores and prefetches, not the decode steps
        offered = self.sched.finish(i, r, t)
        if offered:
            self.dma_busy_until = max(self.dma_busy_until, t) + offered

    def _prefill(self, now: float) -> float:
        """Admission, prefix restores and the prefill iteration of the admitted; its seconds
        (0 when nothing was admitted)."""
        sched, timer, tot = self.sched, self.timer, self.tot
        admitted, restore = sched.admit(now)
        if not admitted and not sched.resuming:
            return 0.0
        restore = self._restore_and_prefetch(now, admitted, restore)
        parts = [(h, c) for _, _, h, c in admitted]
        secs = 0.0
        if parts:
            secs, flops, nbytes = timer.prefill(parts)
            if self.cache is not None:
                tot["prefill_saved"] += timer.prefill([(h, 0) for h, _ in parts])[0] - secs
            timer.note_prefill(secs, flops, nbytes)
            tot["prefills"] += 1
        secs += restore
        end = now + secs
        stall = sum(self._prefilled(i, r, end) for i, r, _, _ in admitted)
        self._resumed()
        tot["prefill"] += secs
        tot["prefill_tokens"] += sum(h - c for h, c in parts)
        return secs + stall + self._swaps()

    def _resumed(self) -> None:
        """The swapped requests readmitted by this step join the decodes."""
        for i, r in self.sched.resume():
            self.timer.start(r, self.step, self.alloc.block(i))
            self._schedule(i, r)

    def _prefilled(self, i, r, end: float) -> float:
        """Request i's prefill completed at `end`: it finishes, or joins the decodes (growing
        for its next token's slot), or is preempted; seconds a migration stalled the step."""
        sched, timer = self.sched, self.timer
        if sched.made_first_token(i, r, end):
            self._finish(i, r, end)
            return 0.0
        try:
            blk, moved = sched.run_on(i, r)
        except OutOfMemory:
            sched.preempt(i, r)
            return 0.0
        extra = timer.migration_seconds(moved)
        self.tot["migration"] += extra
        timer.start(r, self.step, blk)
        self._schedule(i, r)
        return extra

    def _restore_and_prefetch(self, now: float, admitted, restore: float) -> float:
        """Prefix bookkeeping of an admission: a restore waits for the copy engine; the
        prefetches of the next queued prefixes start. The restore's seconds."""
        if self.cache is None:
            return restore
        if restore and self.dma_busy_until > now:
            restore += self.dma_busy_until - now
        tot = self.tot
        tot["prefix_restore"] += restore
        tot["prefix_covered_tokens"] += sum(c for _, _, _, c in admitted)
        ahead = self.sched.prefetch()
        if ahead:
            self.dma_busy_until = max(self.dma_busy_until, now) + ahead
        return restore

    def _chunked_step(self, now: float) -> float:
        """Chunked prefill: one step of every running request's decode and the prompt chunks
        that fit the token budget; its seconds (0 when there was no chunk to run, and decoding
        goes on in closed form)."""
        sched, timer, tot = self.sched, self.timer, self.tot
        nb = len(sched.running)
        chunks, admitted, restore = sched.chunks(now)
        if not chunks and not sched.resuming:
            return 0.0
        restore = self._restore_and_prefetch(now, admitted, restore)
        if self.cache is not None and admitted:
            whole = [(h, 0) for _, _, h, _ in admitted]
            part = [(h, c) for _, _, h, c in admitted]
            tot["prefill_saved"] += timer.prefill(whole)[0] - timer.prefill(part)[0]
        secs = restore
        if nb or chunks:                   # else only swapped requests came back
            secs += timer.mixed_step(nb, self.step, [(start, k) for _, _, start, k in chunks],
                                     tot)
        end = now + secs
        if nb:
            self.step += 1                 # every running request made a token
        stall = self._events(end)          # their completions and growth come first
        for i, r, _, k in chunks:
            if sched.chunk_done(i, r, k):
                stall += self._prefilled(i, r, end)
        self._resumed()
        return secs + stall + self._swaps()

    def _events(self, now: float) -> float:
        """Handle the events due by the current step; seconds migrations stalled it."""
        sched, timer, tot, events, reqs = self.sched, self.timer, self.tot, self.events, \
            self.requests
        stall = 0.0
        while events and events[0][0] <= self.step:
            at, kind, i, e = heapq.heappop(events)
            r = reqs[i]
            if e != r.epoch or i not in sched.running:
                continue
            if kind == 0:
                timer.add(r, -1)
                self._finish(i, r, now)
                continue
            r.made += at - r.start_step
            r.start_step = at
            if kind == 1:
                try:
                    blk, moved = sched.grow(i, r.prompt + r.made + 1)
                except OutOfMemory:
                    timer.add(r, -1)
                    sched.preempt(i, r)
                    continue
                extra = timer.migration_seconds(moved)
                stall += extra
                tot["migration"] += extra
                timer.relinearize(r, blk)
                if r.prompt + r.gen > r.cap:
                    heapq.heappush(events, (at + r.cap - r.prompt - r.made, 1, i, e))
            else:
                timer.relinearize(r, self.alloc.block(i))
                if r.gen - r.made > RELINEARIZE:
                    heapq.heappush(events, (at + RELINEARIZE, 2, i, e))
        return stall + self._swaps()

    def _swaps(self) -> float:
        """Seconds of the swaps since the last call (the step that made them waits)."""
        secs, self.swap_due = self.swap_due, 0.0
        self.tot["swap"] += secs
        return secs

    def run(self) -> dict:
        """Serve every request; returns the metrics (see summarise())."""
        s, alloc, reqs, sched, tot = self.s, self.alloc, self.requests, self.sched, self.tot
        n = len(reqs)
        running, waiting = sched.running, sched.waiting
        now = t_first = reqs[sched.order[0]].arrival
        self.dma_busy_until = now
        peak_batch = 0
        series: list = []
        next_sample = now
        pool = alloc.pool_bytes
        while sched.done < n:
            sched.arrive(now)
            if sched.chunked:
                secs = self._chunked_step(now)
            elif waiting and len(running) < s.max_batch:
                secs = self._prefill(now)
            else:
                secs = 0.0
            peak_batch = max(peak_batch, len(running))
            if secs:
                tot["occupancy_seconds"] += secs * alloc.reserved_bytes / pool
                now += secs
                if sched.chunked:          # a chunked step is a decode step too
                    next_sample = self._sample(now, t_first, next_sample, series)
                continue
            if not running:
                t = sched.next_send()
                if t is None:
                    raise RuntimeError("simulation stalled: requests wait and nothing runs")
                now = max(now, t)
                continue
            # decode steps up to the next event, or to the step during which a request arrives
            nb = len(running)
            t = sched.next_send()
            dt = t - now if t is not None and not waiting and nb < s.max_batch else None
            k, secs = self.timer.decode_span(nb, self.step, self.events[0][0] - self.step, dt,
                                             tot)
            tot["occupancy_seconds"] += secs * alloc.reserved_bytes / pool
            now += secs
            self.step += k
            now += self._events(now)
            next_sample = self._sample(now, t_first, next_sample, series)
        tot["peak_batch"] = peak_batch
        tot["floor_margin_min"] = self.timer.floor_margin
        tot["compute_floor_margin_min"] = self.timer.compute_margin
        tot["prefill_floor_margin_min"] = self.timer.prefill_margin
        return dict(totals=tot, series=series, t_first=t_first, t_end=now,
                    allocator=alloc.stats())

    def _sample(self, now: float, t_first: float, next_sample: float, series: list) -> float:
        """A point of the time series when one is due, and the progress line; the next due."""
        sched = self.sched
        if now >= next_sample:
            next_sample = now + max(1e-3, (now - t_first) / SERIES_POINTS)
            series.append((now, len(sched.running), len(sched.waiting),
                           self.alloc.reserved_bytes / self.alloc.pool_bytes))
        if self.progress:
            self.progress(sched.done, len(self.requests), now)
        return next_sample


# ----------------------------------------------------------------------------- whole runs
def fit_lengths(trace, max_model_len: int | None, model: ModelSpec, clip: bool):
    """(prompt, generated, kept indices, max_model_len, counts of dropped/truncated requests).
    Every request makes at least one token. A request longer than max_model_len (or than the
    model's context) is refused, unless clip: then a prompt that alone does not fit is dropped
    (a server rejects it) and a generation is cut where the length runs out (a server stops)."""
    prompt = trace.prompt.astype(np.int64)
    gen = np.maximum(trace.generated.astype(np.int64), 1)
    longest = int((prompt + gen).max())
    cap = longest if max_model_len is None else int(max_model_len)
    if cap > model.max_context:
        if max_model_len is not None:
            raise BadArgument(f"--max-model-len {cap} exceeds {model.name}'s context of "
                              f"{model.max_context} tokens")
        cap = model.max_context
    over = prompt + gen > cap
    if over.any() and not clip:
        i = int(np.flatnonzero(over)[0])
        raise BadArgument(f"{int(over.sum())} requests of {trace.name} exceed the "
                          f"{cap}-token limit (request {i}: {prompt[i]} + {gen[i]} tokens; "
                          f"{model.name} takes {model.max_context}): pass --clip to drop "
                          f"or truncate them, or raise --max-model-len")
    keep = np.flatnonzero(prompt < cap)
    dropped = len(prompt) - len(keep)
    truncated = int((over[keep]).sum())
    gen = np.minimum(gen, cap - prompt)
    if not len(keep):
        raise BadArgument(f"no request of {trace.name} fits in {cap} tokens")
    return prompt[keep], gen[keep], keep, cap, dropped, truncated


def run_policy(trace, arrivals, policy: str, setup: ServingSetup, *, replicas: int = 1,
               clip: bool = False, progress=None, prefix: PrefixSettings | None = None) -> dict:
    """Serve `trace` (arrival seconds given) with `policy` on `replicas` replicas (request i
    goes to replica i mod replicas), with a prefix cache per replica when `prefix` is given;
    the metrics of the whole run."""
    t_wall = time.perf_counter()
    prompt, gen, keep, cap, dropped, truncated = fit_lengths(trace, setup.max_model_len or None,
                                                             setup.model, clip)
    setup = dataclasses.replace(setup, max_model_len=cap)
    # a closed loop's places are split over the replicas (simulate checks they split evenly)
    rep_setup = setup if setup.concurrency is None else dataclasses.replace(
        setup, concurrency=max(1, setup.concurrency // replicas))
    arrive = np.asarray(arrivals, dtype=np.float64)[keep]
    results = []
    all_reqs = []
    for rep in range(replicas):
        idx = np.arange(rep, len(keep), replicas)
        if not len(idx):
            continue
        # one count over the replicas, which run one after the other
        show = progress and (lambda done, _, t, base=len(all_reqs):
                             progress(base + done, len(keep), t))
        named = trace.prefix_id is not None and prefix is not None
        reqs = [RequestState(int(j), int(prompt[j]), int(gen[j]), float(arrive[j]),
                             *((trace.prefix_id[keep[j]], int(trace.prefix_tokens[keep[j]]),
                                trace.offer_id[keep[j]]) if named else ()))
                for j in idx]
        sim = Simulation(rep_setup, policy, reqs, show, prefix)
        try:
            results.append(sim.run())
        finally:
            sim.alloc.close()
        results[-1]["used_tokens"] = sim.alloc.used_tokens_sum
        results[-1]["reserved_tokens"] = sim.alloc.reserved_tokens_sum
        results[-1]["layout"] = sim.layout
        results[-1]["pool_bytes"] = sim.alloc.pool_bytes
        if sim.cache is not None:
            results[-1]["prefix_cache"] = sim.cache.stats()
        all_reqs += reqs
    return summarise(trace, policy, setup, results, all_reqs, replicas, dropped, truncated,
                     time.perf_counter() - t_wall)


def progress_printer(label: str, stream=sys.stderr):
    """A progress callback that prints a line at most once a second on stderr, however often
    it is called."""
    start = last = time.perf_counter()

    def show(done, total, sim_time):
        nonlocal last
        now = time.perf_counter()
        if now - last < 1.0:
            return
        last = now
        stream.write(f"simulate {label}: {done}/{total} requests, {sim_time:.0f} s simulated, "
                     f"{time.perf_counter() - start:.0f} s\n")
        stream.flush()
    return show
