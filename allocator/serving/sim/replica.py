"""The serving simulation: continuous batching of a request trace on one card or a TP group,
with every KV decision made by a real allocator and every step timed by a memory timing source.

- ServingSetup: the model, the card, the timing source and the serving settings of a run.
- Simulation: one replica; its Scheduler (allocator.serving.core) makes every admission,
  growth, preemption and completion decision, its TimedExecutor (allocator.serving.sim.timed)
  costs every prefill, decode step and migration, and the core's loop drives the two.
- run_policy: a whole trace on one or more replicas, summarised by allocator.serving.core.metrics.
No request is lost: a run ends when every request has made all its tokens.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time

import numpy as np

from odma_cli.errors import BadArgument

from allocator.config import AllocatorConfig
from allocator.policies import make_allocator
from allocator.policies import policy as policy_spec
from allocator.serving.cards.datafile import BANDWIDTH_GBPS, FRACTION
from allocator.serving.cards.presets import DTYPE_BYTES, Accelerator, ModelSpec, auto_dtype
from allocator.serving.core.build import SchedulingOptions, build_scheduler
from allocator.serving.core.checks import check_scheduling
from allocator.serving.core.drive import drive
from allocator.serving.core.metrics import summarise
from allocator.serving.core.requests import RequestState, fit_lengths
from allocator.serving.sim.steptime import extent_config
from allocator.serving.sim.timed import TimedExecutor

LAYOUTS = ("contiguous", "v06", "hnd", "nhd")
PAGED_LAYOUTS = LAYOUTS[1:]
MAX_TIER_BYTES = 2**63 - 1


@dataclasses.dataclass
class ServingSetup:
    """Everything a run needs besides the trace and the policy."""

    model: ModelSpec
    device: Accelerator
    timing: object                  # a MemoryTiming
    dtype: str = "auto"             # the card's (cards.presets.auto_dtype), else named
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
        self.dtype = auto_dtype(self.dtype, self.device.dtype)
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
        if self.swap_gbps not in BANDWIDTH_GBPS:
            raise BadArgument(f"swap_gbps must be {BANDWIDTH_GBPS}, got {self.swap_gbps}")
        if self.mfu not in FRACTION:
            raise BadArgument(f"mfu must be {FRACTION}, got {self.mfu}")
        if not 0 < self.memory_utilization <= 1:
            raise BadArgument(f"memory utilization must be in (0, 1], got "
                              f"{self.memory_utilization}")

    @property
    def scheduling(self) -> SchedulingOptions:
        """The Scheduler's options of this setup."""
        return SchedulingOptions(self.max_batch, self.max_model_len, self.max_prefill_tokens,
                                 self.max_batched_tokens, self.concurrency, self.preemption,
                                 self.swap_bytes, self.cobatch)

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
                f"{self.model.name} ({self.dtype}) leaves {max(free, 0) / 1e9:.2f} GB of "
                f"--memory-utilization {self.memory_utilization:g} of card {self.device.name} "
                f"at TP{self.tp}: not enough KV for one {self.max_model_len}-token request")
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
        for name in ("device_gb", "host_gb", "disk_gb"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise BadArgument(f"{name} must be a finite number >= 0, got {v}")
            if v * 1e9 > MAX_TIER_BYTES:
                raise BadArgument(f"{name} must be at most {MAX_TIER_BYTES / 1e9:.3g} GB (a "
                                  f"64-bit byte offset), got {v:g}")
        for name in ("host_to_device_gbps", "device_to_host_gbps", "disk_read_gbps",
                     "disk_write_gbps"):
            if getattr(self, name) not in BANDWIDTH_GBPS:
                raise BadArgument(f"{name} must be {BANDWIDTH_GBPS}, got {getattr(self, name)}")
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
    (allocator.serving.core) decides and the TimedExecutor (allocator.serving.sim.timed) costs each
    step, under the core's one loop (core.drive)."""

    def __init__(self, setup: ServingSetup, policy: str, requests: list[RequestState],
                 progress=None, prefix: PrefixSettings | None = None):
        self.s = setup
        self.policy = policy
        spec = policy_spec(policy)
        self.layout = setup.paged_layout if spec.layout == "paged" else spec.layout
        self.requests = requests
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
        config = extent_config(setup) if spec.knee else setup.config
        self.alloc = make_allocator(policy, None, pool, bpt, setup.max_model_len,
                                    config, page_tokens=setup.page_tokens)
        self.sched = build_scheduler(
            spec, self.alloc, requests, setup.scheduling, predictor=setup.predictor,
            bytes_per_token=bpt, seed=setup.seed, sigma=setup.noise_sigma, cache=self.cache,
            schedule=prefix.schedule if prefix else "fcfs",
            prefetch=prefix.prefetch if prefix else 0)
        self.tot = self.sched.tot             # seconds by component, and counts
        self.executor = TimedExecutor(setup, self.sched, self.layout, progress)
        self.timer = self.executor.timer

    def run(self) -> dict:
        """Serve every request; returns the metrics (see summarise())."""
        drive(self.sched, self.executor)
        return self.executor.result()


# ----------------------------------------------------------------------------- whole runs
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
