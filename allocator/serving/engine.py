"""The serving simulation: continuous batching of a request trace on one card or a TP group,
with every KV decision made by a real allocator and every step timed by a memory timing source.

Scheduler (vLLM v0 style, iteration level):
- Between steps, waiting requests are admitted first-come first-served while the allocator can
  reserve their KV (no skipping), the batch holds at most max_batch requests and their prompts
  at most max_prefill_tokens. Admitted prompts are prefilled whole, in one prefill iteration that
  runs before the next decode step (decoding pauses), and each produces its first token there.
- Every decode step produces one token for every running request. A request making its j-th
  token holds prompt + j tokens of KV (the slot of the token being made included) and reads all
  of them. When that outgrows its block the allocator grows it: a contiguous policy migrates
  (the copy stalls the step), paging appends pages. On OutOfMemory the request is preempted:
  its KV is freed and it goes back to the head of the queue; when readmitted its prompt and the
  tokens it already made are prefilled again (recompute) and it carries on where it stopped.
- No request is lost: the simulation ends when every request has made all its tokens.

Step time (one card of the group; TP cards work in parallel on their shares):
    decode = max(memory, compute) + layers x layer overhead + batch x request overhead
             + all-reduce (TP > 1), where
      memory = weights / (seq GB/s) + sum over running requests of their KV runs / (run GB/s),
      compute = the batch's FLOPs (weights and attention over each context) / (peak x MFU)
    prefill = max(FLOPs / (peak x MFU), bytes / seq GB/s) + layers x layer overhead + all-reduce
    migration = 2 x bytes copied / copy GB/s (the copy counts read + write)
KV runs by layout, per card with h KV heads, head_dim x 2 B = g bytes per token per run:
    contiguous: 2 x layers x h runs of ctx x g bytes;
    paged "v06" and "hnd" (vLLM 0.6 / vllm-mlu): one run of page_tokens x g per page, layer,
      K or V and head; with one KV head per card, consecutive pages of a request merge;
    paged "nhd" (vLLM v1): one run of page_tokens x h x g per page, layer, K or V; consecutive
      pages merge.

Event driven: between two events (an arrival, a completion, a block outgrown, a page boundary)
the batch does not change and each request's KV time grows linearly with its context, so step
times are linear in the step index and any number of steps is summed in closed form; efficiencies
are re-read from the timing source at every event of the request (and every RELINEARIZE steps).
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
from allocator.predictors import Request, make_predictor
from allocator.serving.presets import DTYPE_BYTES, Accelerator, ModelSpec
from allocator.serving.scheduler import WaitingQueue

LAYOUTS = ("contiguous", "v06", "hnd", "nhd")
PAGED_LAYOUTS = LAYOUTS[1:]
RELINEARIZE = 64                 # steps between re-reads of a contiguous request's efficiency
SERIES_POINTS = 400


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

    def __post_init__(self):
        if self.paged_layout not in PAGED_LAYOUTS:
            raise BadArgument(f"unknown paged layout {self.paged_layout!r}: expected one of "
                              f"{', '.join(PAGED_LAYOUTS)}")
        if self.dtype not in DTYPE_BYTES:
            raise BadArgument(f"unknown dtype {self.dtype!r}: expected bf16 or int8")
        if not (isinstance(self.tp, int) and 1 <= self.tp <= 64):
            raise BadArgument(f"tp must be an integer in [1, 64], got {self.tp!r}")
        m, tp = self.model, self.tp
        # vLLM's rule: query heads split evenly; KV heads split evenly, or, with more cards
        # than KV heads, each is replicated on tp / kv_heads cards
        if m.heads % tp or (m.kv_heads % tp if tp <= m.kv_heads else tp % m.kv_heads):
            raise BadArgument(f"--tp {tp} does not split {m.name}'s {m.heads} query and "
                              f"{m.kv_heads} KV heads evenly: use a TP that divides {m.heads} "
                              f"and divides or is a multiple of {m.kv_heads}")
        if not 0 < self.mfu <= 1:
            raise BadArgument(f"mfu must be in (0, 1], got {self.mfu}")
        if not 0 < self.memory_utilization <= 1:
            raise BadArgument(f"memory utilization must be in (0, 1], got "
                              f"{self.memory_utilization}")

    # -- what one card holds and reads ---------------------------------------------------------
    @property
    def kv_heads_per_card(self) -> int:
        """KV heads split over TP cards; with fewer heads than cards each card keeps one (a
        replica of it)."""
        return max(1, self.model.kv_heads // self.tp)

    @property
    def kv_bytes_per_token(self) -> int:
        m = self.model
        return 2 * m.layers * self.kv_heads_per_card * m.kv_run_bytes_per_token

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
        g = m.kv_run_bytes_per_token
        if layout == "contiguous":
            return 2 * m.layers * h, g, True
        if layout == "nhd":
            return 2 * m.layers, h * g, True
        return 2 * m.layers * h, g, h == 1          # v06, hnd: a run per (page, head)


class RequestState:
    __slots__ = ("rid", "prompt", "gen", "made", "arrival", "first_token", "finish",
                 "preemptions", "predicted", "start_step", "a", "slope", "ab",
                 "sb", "epoch", "cap", "prefix", "prefix_tokens", "offer", "covered")

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
        if not (isinstance(self.prefetch, int) and self.prefetch >= 0):
            raise BadArgument(f"prefetch must be an integer >= 0, got {self.prefetch!r}")


SCHEDULES = ("fcfs", "fpf", "relaxed-fpf")
TIER_DISTANCE = {"device": 0, "host": 1, "disk": 2, None: 3}


class Simulation:
    """One replica (a card or a TP group) serving its share of the requests."""

    def __init__(self, setup: ServingSetup, policy: str, requests: list[RequestState],
                 progress=None, prefix: PrefixSettings | None = None):
        self.s = setup
        self.policy = policy
        self.layout = "contiguous" if policy != "paged" else setup.paged_layout
        self.requests = requests
        self.progress = progress
        self.bpt = setup.kv_bytes_per_token
        pool = setup.pool_bytes()
        self.cache = None
        if prefix is not None:
            from allocator.prefix import PrefixCache, TierBandwidth

            device_bytes = int(prefix.device_gb * 1e9)
            if device_bytes >= pool:
                raise BadArgument(f"a device tier of {prefix.device_gb} GB leaves no KV pool "
                                  f"(the card has {pool / 1e9:.2f} GB for KV)")
            pool -= device_bytes
            self.cache = PrefixCache(
                None, self.bpt, device_bytes=device_bytes, host_bytes=int(prefix.host_gb * 1e9),
                disk_bytes=int(prefix.disk_gb * 1e9), eviction=prefix.eviction,
                seed=setup.seed, bandwidth=TierBandwidth(
                    device_copy_gbps=float(setup.timing.copy_gbps),
                    host_to_device_gbps=prefix.host_to_device_gbps,
                    device_to_host_gbps=prefix.device_to_host_gbps,
                    disk_read_gbps=prefix.disk_read_gbps,
                    disk_write_gbps=prefix.disk_write_gbps))
        self.prefix = prefix
        self.alloc = make_allocator(policy, None, pool, self.bpt, setup.max_model_len,
                                    setup.config, page_tokens=setup.page_tokens)
        self.predictor = make_predictor("oracle" if policy == "oracle" else setup.predictor,
                                        seed=setup.seed, sigma=setup.noise_sigma)
        t = setup.timing
        self.seq_gbps = float(t.seq_gbps)
        self.copy_gbps = float(t.copy_gbps)
        self.runs_per_unit, self.run_unit_bytes, self.merge = setup.run_layout(self.layout)
        m, d = setup.model, setup.device
        # per step, independent of the batch: weights and per-layer overheads
        self.w_seconds = setup.weight_bytes / (self.seq_gbps * 1e9)
        self.layer_seconds = m.layers * d.layer_overhead_us * 1e-6
        # all-reduce: 2 per layer of batch x hidden x 2 B, ring over TP cards
        tp = setup.tp
        if tp > 1:
            ring = 2 * (tp - 1) / tp
            self.ar_const = 2 * m.layers * 2 * (tp - 1) * d.link_latency_us * 1e-6
            self.ar_per_token = 2 * m.layers * ring * m.hidden * 2 / (d.link_gbps * 1e9)
        else:
            self.ar_const = self.ar_per_token = 0.0
        self.req_seconds = d.request_overhead_us * 1e-6
        self.card_flops = d.peak_tflops(setup.dtype) * 1e12
        # decode FLOPs per step on one card: per request, and per token of context (attention)
        self.flops_per_request = 2.0 * m.streamed_params / tp
        self.flops_per_ctx = 4.0 * m.layers * m.heads * m.head_dim / tp
        self.flops_rate = self.card_flops * setup.mfu
        self.per_token = self.runs_per_unit * self.run_unit_bytes   # KV bytes per context token
        self.max_prefill = setup.max_prefill_tokens or max(setup.max_model_len, 2048)

    # -- KV time of one request, linear in the step index --------------------------------------
    def _linearize(self, r: RequestState, step: int, ctx: int, blk) -> None:
        """Set r.a/r.slope (seconds) and r.ab/r.sb (bytes) so that at decode step s its KV read
        takes a + s x slope, with ctx tokens at `step`."""
        unit = self.run_unit_bytes
        n = self.runs_per_unit
        per_token = n * unit
        gbps = self.s.timing.run_gbps
        if self.layout == "contiguous":
            run = ctx * unit
            bw = float(gbps(run)) * 1e9
            secs = n * run / bw
            slope = per_token / bw
        else:
            pt = self.s.page_tokens
            if self.merge:
                runs = blk.runs()
                pages = np.array([k for _, k in runs], dtype=np.float64)
                full = pages * pt
                full[-1] -= len(blk.pages) * pt - ctx      # the last page is partly filled
                run_bytes = np.maximum(full, 1) * unit
                bws = gbps(run_bytes) * 1e9
                secs = float(n * (run_bytes / bws).sum())
                slope = per_token / float(bws[-1])
            else:
                bw = float(gbps(pt * unit)) * 1e9
                secs = n * ctx * unit / bw
                slope = per_token / bw
        r.slope = slope
        r.a = secs - step * slope
        r.sb = per_token
        r.ab = ctx * per_token - step * per_token

    def _grow(self, i: int, total: int) -> tuple[object, float]:
        """Grow request i to `total` tokens: (its block, seconds a migration stalled the step).
        Raises OutOfMemory (the request stays in its old block)."""
        alloc = self.alloc
        old = alloc.block(i)
        # the KV written so far (every token before this step's): what a migration copies
        old.mark_written(min((total - 1) * self.bpt, old.nbytes))
        moved = alloc.migrated_bytes
        blk = alloc.grow(i, total)
        if blk is old:
            return blk, 0.0
        return blk, 2.0 * (alloc.migrated_bytes - moved) / (self.copy_gbps * 1e9)

    @staticmethod
    def _steps_until(dt: float, c0: float, slope: float, step: int) -> int:
        """Smallest K >= 1 such that steps step .. step + K - 1, the k-th taking
        c0 + slope x k seconds, last at least dt seconds in all."""
        if dt <= 0:
            return 1
        b = c0 + slope * (step - 0.5)
        if slope <= 1e-18 * max(b, 1e-30):
            k = math.ceil(dt / b)
        else:
            a = slope / 2
            k = math.ceil((-b + math.sqrt(b * b + 4 * a * dt)) / (2 * a))
        k = max(1, k)
        while k > 1 and (k - 1) * c0 + slope * ((k - 1) * step + (k - 1) * (k - 2) / 2) >= dt:
            k -= 1
        while k * c0 + slope * (k * step + k * (k - 1) / 2) < dt:
            k += 1
        return k

    def run(self) -> dict:
        """Serve every request; returns the metrics (see summarise())."""
        s = self.s
        alloc = self.alloc
        reqs = self.requests
        n = len(reqs)
        order = sorted(range(n), key=lambda i: (reqs[i].arrival, i))
        running: dict[int, RequestState] = {}
        cache = self.cache
        waiting = WaitingQueue(self.prefix.schedule if self.prefix else "fcfs",
                               lambda i: reqs[i].arrival, lambda i: reqs[i].prefix or None,
                               lambda key: TIER_DISTANCE[cache.lookup(key)[0]])
        events: list = []       # (step, kind, request, epoch): 0 done, 1 outgrown, 2 re-read
        sums = [0.0, 0.0, 0.0, 0.0]   # over running requests: a, slope, ab, sb
        step = 0                # decode steps done; the next one has this index
        now = t_first = reqs[order[0]].arrival
        next_arrival = 0
        done = 0
        tot = collections.Counter()   # seconds by component, and counts
        peak_batch = 0
        floor_margin = math.inf       # min over steps of step seconds / (bytes / peak)
        compute_margin = math.inf     # min over steps of step seconds / (FLOPs / peak)
        series: list = []
        next_sample = now
        last_progress = time.perf_counter()
        pool = alloc.pool_bytes
        peak_bw = s.timing.peak_gbps * 1e9

        def add(r, sign):
            sums[0] += sign * r.a
            sums[1] += sign * r.slope
            sums[2] += sign * r.ab
            sums[3] += sign * r.sb

        def relinearize(i, r, blk):
            add(r, -1)
            r.cap = blk.capacity_tokens
            self._linearize(r, r.start_step, r.prompt + r.made + 1, blk)
            add(r, +1)

        def schedule(i, r):
            """Events of a running request from its snapshot (made at start_step)."""
            e, base = r.epoch, r.start_step
            heapq.heappush(events, (base + r.gen - r.made, 0, i, e))
            if r.prompt + r.gen > r.cap:       # the step needing cap + 1 tokens
                heapq.heappush(events, (base + r.cap - r.prompt - r.made, 1, i, e))
            if self.layout == "contiguous" and r.gen - r.made > RELINEARIZE:
                heapq.heappush(events, (base + RELINEARIZE, 2, i, e))

        def finish(i, r, t) -> None:
            """Complete request i at time t. Its offers to the cache (a copy into the device
            tier and the demotions that make room) run on the copy engine beside compute, as
            prefetches do: they delay later restores and prefetches, not the decode steps."""
            nonlocal done
            blk = alloc.block(i)
            if cache is not None:
                offered = 0.0
                if r.prefix and tier_of(r) is None:    # a prefix it computed: keep it
                    offered += cache.offer(r.prefix, blk, r.prefix_tokens)
                    waiting.moved(r.prefix)
                if r.offer:                            # its whole context, for a next turn
                    offered += cache.offer(r.offer, blk, r.prompt + r.gen)
                    waiting.moved(r.offer)
                tot["prefix_offer"] += offered
                dma_busy_until[0] = max(dma_busy_until[0], t) + offered
            # the last token made is output, never read back: its KV slot need not exist, so a
            # request done in its prefill records what its block holds
            alloc.release(i, min(r.prompt + r.gen, blk.capacity_tokens) - blk.prompt_tokens)
            self.predictor.observe(Request(i, r.prompt, r.gen), r.gen)
            r.made = r.gen
            r.finish = t
            done += 1

        def preempt(i, r):
            if i in running:
                add(r, -1)
                del running[i]
            alloc.release(i, preempted=True)
            r.epoch += 1
            r.preemptions += 1
            tot["preemptions"] += 1
            L, _ = r.predicted
            # mispredicted, as seen: it makes more than that, and nobody knows how much more
            # (u = inf sends it to ODMA's large bucket, as the paper routes overflows)
            r.predicted = (max(L, r.made + 1.0), math.inf)
            waiting.appendleft(i)

        dma_busy_until = [now]          # prefetches and offers: the copy engine, beside compute

        def tier_of(r):
            return cache.lookup(r.prefix)[0] if cache is not None and r.prefix else None

        def prefill_seconds(parts) -> tuple[float, float, float]:
            """(seconds, FLOPs, bytes) of one prefill iteration over (tokens held, tokens
            covered by the cache) pairs."""
            flops = sum(s.model.prefill_flops(h - c, cached=c) for h, c in parts) / s.tp
            computed = sum(h - c for h, c in parts)
            nbytes = s.weight_bytes + sum(h for h, _ in parts) * self.bpt
            secs = (max(flops / (self.card_flops * s.mfu), nbytes / (self.seq_gbps * 1e9))
                    + self.layer_seconds + self.ar_const + computed * self.ar_per_token)
            return secs, flops, nbytes

        def admit() -> float:
            """Admission (FCFS, or the prefix schedule), prefix restores, and the prefill
            iteration of the admitted; its seconds."""
            admitted = []
            tokens = 0
            restore = 0.0
            while waiting and len(running) + len(admitted) < s.max_batch:
                i = waiting.head(now)
                r = reqs[i]
                held = r.prompt + r.made               # a rerun recomputes what it made
                if admitted and tokens + held > self.max_prefill:
                    break
                if r.predicted is None:
                    r.predicted = self.predictor.predict(Request(i, r.prompt, r.gen))
                L, u = r.predicted
                try:
                    blk = alloc.reserve(i, held, max(0.0, L - r.made), u)
                except OutOfMemory:
                    if not running and not admitted:
                        raise BadArgument(
                            f"request {i} ({r.prompt} + {r.gen} tokens) does not fit in an "
                            f"empty KV pool of {pool / 1e9:.2f} GB") from None
                    break
                waiting.remove(i)
                covered = 0
                if cache is not None and r.prefix:
                    tier = tier_of(r)
                    tot[f"prefix_{tier or 'miss'}"] += 1
                    if tier is not None:
                        covered, secs = cache.restore(r.prefix, blk, r.prefix_tokens)
                        restore += secs
                        waiting.moved(r.prefix)
                r.covered = covered
                admitted.append((i, r, held, covered))
                tokens += held - covered
            if not admitted:
                return 0.0
            if restore and dma_busy_until[0] > now:    # a restore waits for the copy engine
                restore += dma_busy_until[0] - now
            parts = [(h, c) for _, _, h, c in admitted]
            secs, flops, nbytes = prefill_seconds(parts)
            if cache is not None:
                tot["prefill_saved"] += prefill_seconds([(h, 0) for h, _ in parts])[0] - secs
                tot["prefix_restore"] += restore
                tot["prefix_covered_tokens"] += sum(c for _, c in parts)
                if self.prefix.prefetch:
                    keys = [reqs[j].prefix for j in waiting.first(self.prefix.prefetch)
                            if reqs[j].prefix]
                    if keys:
                        dma_busy_until[0] = max(dma_busy_until[0], now) + cache.prefetch(keys)
                        for key in keys:
                            waiting.moved(key)
            tot["prefill_floor_margin_min"] = min(
                tot.get("prefill_floor_margin_min", math.inf),
                secs / max(flops / self.card_flops, nbytes / peak_bw))
            secs += restore
            end = now + secs
            stall = 0.0
            for i, r, _, _ in admitted:
                if r.first_token is None:
                    r.first_token = end
                r.made += 1
                if r.made >= r.gen:
                    # done: it never grows (a failed grow would preempt a finished request,
                    # whose rerun then needs the whole max-model-len)
                    finish(i, r, end)
                    continue
                # the slot of the token just made, and of the next one
                need = r.prompt + r.made + 1
                try:
                    blk = alloc.block(i)
                    if need > blk.capacity_tokens:
                        blk, extra = self._grow(i, need)
                        stall += extra
                        tot["migration"] += extra
                except OutOfMemory:
                    preempt(i, r)
                    continue
                r.start_step = step
                r.cap = blk.capacity_tokens
                self._linearize(r, step, need, blk)
                add(r, +1)
                running[i] = r
                schedule(i, r)
            tot["prefill"] += secs
            tot["prefills"] += 1
            tot["prefill_tokens"] += tokens
            return secs + stall

        while done < n:
            while next_arrival < n and reqs[order[next_arrival]].arrival <= now:
                waiting.append(order[next_arrival])
                next_arrival += 1
            if waiting and len(running) < s.max_batch:
                secs = admit()
                peak_batch = max(peak_batch, len(running))
                if secs:
                    tot["occupancy_seconds"] += secs * alloc.reserved_bytes / pool
                    now += secs
                    continue
            if not running:
                if next_arrival >= n:
                    raise RuntimeError("simulation stalled: requests wait and nothing runs")
                now = max(now, reqs[order[next_arrival]].arrival)
                continue
            # decode steps up to the next event, or to the step during which a request arrives
            nb = len(running)
            a, sl, ab, sb = sums
            # a step is max(memory, compute) + overheads; memory and compute are each linear in
            # the step index: m0 + m1 s (weights and KV reads), f0 + f1 s (FLOPs of the batch)
            over = self.layer_seconds + nb * (self.req_seconds + self.ar_per_token) + self.ar_const
            m0, m1 = self.w_seconds + a, sl
            f0 = (nb * self.flops_per_request + self.flops_per_ctx * ab / self.per_token) \
                / self.flops_rate
            f1 = self.flops_per_ctx * sb / self.per_token / self.flops_rate
            compute_bound = f0 + f1 * step > m0 + m1 * step
            k = events[0][0] - step
            if m1 != f1:                               # memory and compute trade places there
                cross = (f0 - m0) / (m1 - f1)
                if cross > step:
                    k = min(k, max(1, math.ceil(cross - step)))
            c0, c1 = (f0, f1) if compute_bound else (m0, m1)
            if next_arrival < n and not waiting and nb < s.max_batch:
                dt = reqs[order[next_arrival]].arrival - now
                k = min(k, self._steps_until(dt, c0 + over, c1, step))
            k = max(1, k)
            tri = k * step + k * (k - 1) / 2          # sum of the step indices
            kv = k * a + sl * tri
            secs = k * (c0 + over) + c1 * tri
            for at in (step, step + k - 1):           # both ends: time, bytes, FLOPs are linear
                t_step = max(m0 + m1 * at, f0 + f1 * at) + over
                floor_margin = min(floor_margin, t_step * peak_bw / (s.weight_bytes + ab + sb * at))
                compute_margin = min(compute_margin, t_step / ((f0 + f1 * at) * s.mfu))
            tot["decode"] += secs
            tot["kv"] += kv
            tot["weights"] += k * self.w_seconds
            tot["overheads"] += k * (self.layer_seconds + nb * self.req_seconds)
            tot["allreduce"] += k * (self.ar_const + nb * self.ar_per_token)
            if compute_bound:
                tot["compute"] += k * (f0 - m0) + (f1 - m1) * tri   # beyond the memory time
                tot["compute_bound_steps"] += k
            tot["steps"] += k
            tot["kv_bytes"] += k * ab + sb * tri
            tot["batch_seconds"] += nb * secs
            tot["occupancy_seconds"] += secs * alloc.reserved_bytes / pool
            now += secs
            step += k
            stall = 0.0
            while events and events[0][0] <= step:
                at, kind, i, e = heapq.heappop(events)
                r = reqs[i]
                if e != r.epoch or i not in running:
                    continue
                if kind == 0:
                    add(r, -1)
                    del running[i]
                    finish(i, r, now)
                    continue
                r.made += at - r.start_step
                r.start_step = at
                if kind == 1:
                    try:
                        blk, extra = self._grow(i, r.prompt + r.made + 1)
                    except OutOfMemory:
                        preempt(i, r)
                        continue
                    stall += extra
                    tot["migration"] += extra
                    relinearize(i, r, blk)
                    if r.prompt + r.gen > r.cap:
                        heapq.heappush(events, (at + r.cap - r.prompt - r.made, 1, i, e))
                else:
                    relinearize(i, r, alloc.block(i))
                    if r.gen - r.made > RELINEARIZE:
                        heapq.heappush(events, (at + RELINEARIZE, 2, i, e))
            now += stall
            if now >= next_sample:
                next_sample = now + max(1e-3, (now - t_first) / SERIES_POINTS)
                series.append((now, len(running), len(waiting), alloc.reserved_bytes / pool))
            if self.progress and time.perf_counter() - last_progress > 1.0:
                last_progress = time.perf_counter()
                self.progress(done, n, now)
        tot["peak_batch"] = peak_batch
        tot["floor_margin_min"] = floor_margin
        tot["compute_floor_margin_min"] = compute_margin
        return dict(totals=tot, series=series, t_first=t_first, t_end=now,
                    allocator=alloc.stats())


# ----------------------------------------------------------------------------- whole runs
def _percentiles(values) -> dict:
    if not len(values):
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    v = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {"mean": float(v.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


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
    arrive = np.asarray(arrivals, dtype=np.float64)[keep]
    results = []
    all_reqs = []
    for rep in range(replicas):
        idx = np.arange(rep, len(keep), replicas)
        if not len(idx):
            continue
        named = trace.prefix_id is not None and prefix is not None
        reqs = [RequestState(int(j), int(prompt[j]), int(gen[j]), float(arrive[j]),
                             *((trace.prefix_id[keep[j]], int(trace.prefix_tokens[keep[j]]),
                                trace.offer_id[keep[j]]) if named else ()))
                for j in idx]
        sim = Simulation(setup, policy, reqs, progress, prefix)
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


def summarise(trace, policy, setup, results, reqs, replicas, dropped, truncated, wall) -> dict:
    tot = collections.Counter()
    for r in results:
        for k, v in r["totals"].items():
            if k.endswith("_min"):
                tot[k] = min(tot.get(k, math.inf), v)
            elif k == "peak_batch":
                tot[k] = max(tot[k], v)
            else:
                tot[k] += v
    t0 = min(r["t_first"] for r in results)
    t1 = max(r["t_end"] for r in results)
    span = max(t1 - t0, 1e-12)
    made = sum(q.gen for q in reqs)
    ttft = [q.first_token - q.arrival for q in reqs]
    e2e = [q.finish - q.arrival for q in reqs]
    tpot = [(q.finish - q.first_token) / (q.gen - 1) for q in reqs if q.gen > 1]
    decode = tot["decode"] or 1e-30
    busy = tot["decode"] + tot["prefill"] + tot["migration"]
    used = sum(r["used_tokens"] for r in results)
    reserved = sum(r["reserved_tokens"] for r in results)
    alloc_stats = [r["allocator"] for r in results]
    weight_bytes = tot["steps"] * setup.weight_bytes
    out = {
        "schema": "odma-hw.simulate/1",
        "policy": policy,
        "layout": results[0]["layout"],
        "trace": trace.name,
        "requests": len(reqs),
        "completed": sum(q.finish is not None for q in reqs),
        "lost": sum(q.finish is None for q in reqs),
        "dropped_over_length": dropped,
        "truncated_over_length": truncated,
        "duration_s": span,
        "output_tokens": made,
        "output_tps": made / span,
        "requests_per_s": len(reqs) / span,
        "ttft_s": _percentiles(ttft),
        "tpot_s": _percentiles(tpot),
        "e2e_s": _percentiles(e2e),
        "utilization": used / reserved if reserved else None,
        "mean_batch": tot["batch_seconds"] / decode,
        "peak_batch": int(tot["peak_batch"]),
        "preemptions": int(tot["preemptions"]),
        "migrations": sum(a.get("migrations", 0) for a in alloc_stats),
        "migrated_bytes": sum(a.get("migrated_bytes", 0) for a in alloc_stats),
        "migration_s": tot["migration"],
        "steps": int(tot["steps"]),
        "mean_step_s": decode / tot["steps"] if tot["steps"] else None,
        "step_time_share": {k: tot[k] / decode for k in ("kv", "weights", "overheads",
                                                         "allreduce", "compute")},
        "compute_bound_step_share": tot["compute_bound_steps"] / tot["steps"]
        if tot["steps"] else None,
        "busy_time_share": {k: tot[k] / busy if busy else None
                            for k in ("decode", "prefill", "migration")},
        "kv_read_bytes_share": (tot["kv_bytes"] / (tot["kv_bytes"] + weight_bytes)
                                if tot["steps"] else None),
        "time_avg_occupancy": tot["occupancy_seconds"] / busy if busy else None,
        "floor_margin_min": tot.get("floor_margin_min"),
        "compute_floor_margin_min": tot.get("compute_floor_margin_min"),
        "prefill_floor_margin_min": tot.get("prefill_floor_margin_min"),
        "kv_pool_gb_per_card": results[0]["pool_bytes"] / 1e9,
        "kv_pool_tokens": results[0]["pool_bytes"] // setup.kv_bytes_per_token,
        "wall_seconds": wall,
        "settings": {
            "model": setup.model.name, "dtype": setup.dtype, "device": setup.device.name,
            "tp": setup.tp, "replicas": replicas, "max_model_len": setup.max_model_len,
            "max_batch": setup.max_batch, "mfu": setup.mfu, "page_tokens": setup.page_tokens,
            "predictor": "oracle" if policy == "oracle" else setup.predictor,
            "prefill": "whole prompts, prefill-first (vLLM v0)",
            "dispatch": "round robin" if replicas > 1 else None,
            "kv_bytes_per_token_per_card": setup.kv_bytes_per_token,
            "weight_bytes_per_card": setup.weight_bytes, "seed": setup.seed,
        },
        "timing": setup.timing.describe(),
        "prefix_cache": _prefix_summary(tot, results, reqs),
        "series": [{"t": t, "running": nr, "waiting": nw, "occupancy": o}
                   for t, nr, nw, o in results[0]["series"]],
    }
    return out


def _prefix_summary(tot, results, reqs) -> dict | None:
    """What the prefix cache did: lookups by where the prefix was, tokens and prefill seconds
    saved, restore and offer seconds, and the caches' own statistics."""
    caches = [r["prefix_cache"] for r in results if "prefix_cache" in r]
    if not caches:
        return None
    found = {t: int(tot[f"prefix_{t}"]) for t in ("device", "host", "disk", "miss")}
    lookups = sum(found.values())
    return {
        "lookups": lookups,
        "found": found,
        "hit_rate": {t: (v / lookups if lookups else None) for t, v in found.items()},
        "covered_tokens": int(tot["prefix_covered_tokens"]),
        "prompt_tokens": int(sum(q.prompt for q in reqs)),
        "prefill_saved_s": tot["prefill_saved"],
        "restore_s": tot["prefix_restore"],
        "offer_s": tot["prefix_offer"],
        "caches": caches,
    }


def progress_printer(label: str, stream=sys.stderr):
    """A progress callback: one line per second on stderr."""
    start = time.perf_counter()

    def show(done, total, sim_time):
        stream.write(f"simulate {label}: {done}/{total} requests, {sim_time:.0f} s simulated, "
                     f"{time.perf_counter() - start:.0f} s\n")
        stream.flush()
    return show
