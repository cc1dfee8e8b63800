"""One device's probe: plan_probe() checks every argument and asks the device whether it would
accept each measurement, run_plan() measures, classify() turns the numbers into the verdict
(the rules are in the package's docstring), and ProbeResult holds it all (its to_json() is a
device entry of the schema odma-hw.probe/1)."""

from __future__ import annotations

import dataclasses
from typing import Callable

from odma_cli.errors import BadArgument
from odma_hw.devices.base import MIN_GRANULE, Device, DeviceInfo, Measurement, is_int
from odma_hw.probe.runs import (FULL_SPEED, KVRun, check_alpha, check_full_speed, check_granule,
                                judge_run, knee, size_text)

SCHEMA = "odma-hw.probe/1"
DEFAULT_GRANULARITIES = (32, 64, 128, 256, 512, 1024, 4096)
DEFAULT_ALPHA = 0.5
VERDICTS = ("racm", "not-racm", "inconclusive")      # what classify() returns
# bandwidth that grows by more than this from half the threads to all of them is still scaling
SCALING_TOLERANCE = 1.15
# a sequential stream below this fraction of the known peak did not load the memory system
MIN_PEAK_FRACTION = 0.3
# (median - best) / best above this means the repetitions disagree (a noisy or throttled run)
MAX_REP_DISAGREEMENT = 0.25
# STREAM's rule: a working set of at least 4 x the largest cache in front of the memory measures
# the memory; below it part of every pass can be served by the cache
CACHE_FACTOR = 4
MIB = 1 << 20
PAPER_GRANULES = ("the ODMA paper's RACM definition (section 2.2) speaks of \"the access "
                  "granularities typical of KV-cache paging (tens to hundreds of bytes)\"")


def _mib(nbytes: int) -> str:
    return f"{nbytes / MIB:g} MiB"


def cache_of(info: DeviceInfo) -> tuple[int | None, str, str]:
    """(bytes, name, where the size comes from) of the largest cache in front of a device's
    memory: the last-level cache the OS reports (host), the L2 the runtime reports (CUDA, MLU);
    0 for the emulator, which models no cache; None when the backend does not know."""
    if info.kind == "emu":
        return 0, "cache", "the emulator models none"
    if info.details.get("llc_reported_bytes"):
        return int(info.details["llc_reported_bytes"]), "last-level cache", (
            "as the OS reports it in /sys/devices/system/cpu/cpu0/cache; inside a VM that can be "
            "the host's whole L3")
    if info.details.get("l2_bytes"):
        return int(info.details["l2_bytes"]), "L2 cache", "as the device's runtime reports it"
    return None, "cache", "the backend does not report it"


def uses_host_threads(info: DeviceInfo) -> bool:
    """Whether `threads` means something for this device: the host's CPUs do the work. Other
    devices (max_threads 1) run on their own parallelism."""
    return info.kind == "host" or info.max_threads > 1


@dataclasses.dataclass
class ProbeResult:
    device: str
    kind: str
    name: str
    peak_gbps: float | None
    seq_gbps: float
    copy_gbps: float
    rand_gbps: dict[int, float]
    granularity: int
    ratio: float
    alpha: float
    verdict: str
    reason: str
    threads: int
    seq_scaling: dict[int, float]    # threads -> sequential read GB/s
    rand_scaling: dict[int, float]   # threads -> random GB/s at the decision granule
    buffer_bytes: int | None        # None: a saved result that does not say
    measurements: list[Measurement]
    details: dict
    full_speed: float = FULL_SPEED
    kv_run: dict | None = None       # judge_run() of the run asked about, if any
    saved: dict | None = None        # the device entry of a saved result this re-judges
    origin: str | None = None        # the file it was read from

    @property
    def ratios(self) -> dict[int, float]:
        return {g: v / self.seq_gbps for g, v in sorted(self.rand_gbps.items())}

    @property
    def knee_bytes(self) -> int | None:
        return knee(self.ratios, self.full_speed)

    def granule_note(self) -> str:
        """Which granule each verdict uses."""
        note = (f"verdict {self.verdict!r} is random/sequential at the {self.granularity} B "
                f"decision granule ({PAPER_GRANULES})")
        if self.kv_run:
            note += f"; kv_run's verdict is at the {size_text(self.kv_run['run_bytes'])} run size"
        return note

    def knee_text(self) -> str:
        k, fs = self.knee_bytes, self.full_speed
        if k is not None:
            return (f"knee {size_text(k)}: from it on every measured run reads at >= {fs:g} of "
                    f"streaming")
        top = max(self.rand_gbps)
        return (f"no knee: the largest measured run ({size_text(top)}) reads at "
                f"{self.ratios[top]:.2f} of streaming, below {fs:g}")

    def to_json(self) -> dict:
        added = {"knee_bytes": self.knee_bytes, "full_speed": self.full_speed,
                 "granule_note": self.granule_note(), "kv_run": self.kv_run}
        if self.saved is not None:       # re-judged: the saved fields as they were
            return {**self.saved, **added, "from_file": self.origin}
        return {
            "device": self.device, "kind": self.kind, "name": self.name,
            "peak_gbps": self.peak_gbps, "seq_gbps": self.seq_gbps, "copy_gbps": self.copy_gbps,
            "rand_gbps": {str(g): v for g, v in sorted(self.rand_gbps.items())},
            "ratios": {str(g): v / self.seq_gbps for g, v in sorted(self.rand_gbps.items())},
            "granularity": self.granularity, "ratio": self.ratio, "alpha": self.alpha,
            "verdict": self.verdict, "reason": self.reason, "threads": self.threads,
            "seq_scaling": {str(k): v for k, v in self.seq_scaling.items()},
            "rand_scaling": {str(k): v for k, v in self.rand_scaling.items()},
            "buffer_bytes": self.buffer_bytes,
            "convention": "GB = 1e9 B; copy counts read + write; random counts granule x accesses",
            "details": self.details,
            "measurements": [dict(dataclasses.asdict(m), gbps=m.gbps, median_gbps=m.median_gbps)
                             for m in self.measurements],
            **self._measures(),
            **added,
        }

    def _measures(self) -> dict:
        """What the figures are, where the device says they are not the memory's own rate (a
        torch device: torch's kernels; the native device that reads the memory instead)."""
        if not self.details.get("measures"):
            return {}
        return {"measures": self.details["measures"],
                "native_device": self.details.get("native_device")}


def classify(ratio: float, alpha: float, seq_scaling: dict[int, float],
             rand_scaling: dict[int, float], peak_gbps: float | None,
             measurements: list[Measurement], cache_note: str | None = None) -> tuple[str, str]:
    """(verdict, reason) from the measured numbers; see the module docstring for the rules.
    `cache_note` says why the working set may have fit in a cache (plan_probe decides)."""
    if cache_note:
        return "inconclusive", f"cache: {cache_note}, so the ratio {ratio:.2f} may describe the cache"
    for name, scaling in (("sequential", seq_scaling), ("random", rand_scaling)):
        counts = sorted(scaling)
        if len(counts) > 1:
            top, below = counts[-1], counts[-2]
            gain = scaling[top] / scaling[below]
            if gain > SCALING_TOLERANCE:
                return "inconclusive", (
                    f"unsaturated: {name} bandwidth still grows x{gain:.2f} from {below} to {top} "
                    f"threads, so the ratio {ratio:.2f} is a per-core limit, not a memory property")
    seq = seq_scaling[max(seq_scaling)]
    if peak_gbps and seq < MIN_PEAK_FRACTION * peak_gbps:
        return "inconclusive", (f"unsaturated: sequential {seq:.1f} GB/s is below "
                                f"{MIN_PEAK_FRACTION:.0%} of the {peak_gbps:.1f} GB/s peak")
    worst = max(measurements, key=lambda m: (m.median_s - m.best_s) / m.best_s)
    disagreement = (worst.median_s - worst.best_s) / worst.best_s
    if disagreement > MAX_REP_DISAGREEMENT:
        return "inconclusive", (f"repetitions disagree: {worst.pattern} {worst.granule} B median is "
                                f"{disagreement:.0%} slower than best (a noisy machine?)")
    if ratio < alpha:
        return "racm", f"random/sequential {ratio:.2f} < alpha {alpha:.2f}"
    return "not-racm", f"random/sequential {ratio:.2f} >= alpha {alpha:.2f}"


@dataclasses.dataclass
class ProbePlan:
    """One device's probe, validated: what run_plan() measures, in order."""

    device: Device
    granularities: list[int]
    decision_granule: int
    alpha: float
    threads: int
    thread_counts: list[int]
    buffer_bytes: int | None          # None: each measurement uses the backend's default
    reps: int
    steps: list[tuple[str, int, int]]  # (pattern, granule, threads)
    cache_note: str | None            # why the working set may fit in a cache (-> inconclusive)
    full_speed: float = FULL_SPEED
    run: KVRun | None = None          # the KV run whose cost is judged (its granules measured)


def _threads_for(info: DeviceInfo, threads: int | None) -> int:
    """Host threads for `info`'s measurements. Devices that run on their own parallelism
    (max_threads 1, not the host) always get 1: --threads is about host CPUs."""
    uses_cpus = uses_host_threads(info)
    if threads is None:
        return info.max_threads if uses_cpus else 1
    if not is_int(threads) or threads < 1:
        raise BadArgument(f"threads must be a positive integer, got {threads!r}")
    if not uses_cpus:
        return 1
    if threads > info.max_threads:
        raise BadArgument(
            f"threads {threads} is more than the {info.max_threads} CPU(s) {info.spec} can run on "
            f"here (this process's CPU affinity): more threads only take turns on the same cores; "
            f"use 1 to {info.max_threads}")
    return threads


def _cache_note(device: Device, buffer_bytes: int | None) -> str | None:
    """BadArgument for a buffer that would measure a known cache; otherwise why the working set
    may still fit in a cache (a note that makes the verdict inconclusive), or None."""
    info = device.info
    cache, what, source = cache_of(info)
    need = CACHE_FACTOR * cache if cache else 0
    if buffer_bytes is not None:
        if cache and buffer_bytes < need:
            raise BadArgument(
                f"buffer {_mib(buffer_bytes)} is below {CACHE_FACTOR} x the {_mib(cache)} {what} "
                f"of {info.spec}: it would time the cache, not the memory; use at least "
                f"{_mib(need)} ({_mib(cache)} {source})")
        default = device.default_buffer_bytes("read")
        if cache is None and buffer_bytes < default:
            return (f"{info.spec} reports no cache size and the {_mib(buffer_bytes)} buffer is "
                    f"below its {_mib(default)} default working set")
        return None
    if cache:  # the defaults: streaming follows the 4 x cache rule unless memory capped it
        small = [p for p in ("read", "copy") if device.default_buffer_bytes(p) < need]
        if small:
            return (f"the default {small[0]} buffer {_mib(device.default_buffer_bytes(small[0]))} "
                    f"(capped by free memory) is below {CACHE_FACTOR} x the {_mib(cache)} {what} "
                    f"({source})")
    return None


def plan_probe(device: Device, granularities=DEFAULT_GRANULARITIES, alpha=DEFAULT_ALPHA,
               threads: int | None = None, decision_granule: int | None = None,
               buffer_bytes: int | None = None, reps: int = 5, full_speed: float = FULL_SPEED,
               run: KVRun | None = None) -> ProbePlan:
    """Check every argument of a probe of `device` and return its plan; raise BadArgument for
    anything the probe or the device would refuse, before anything is allocated or measured.
    `threads` defaults to every CPU the host may use (devices: 1, they run on their own
    parallelism); sequential and decision-granule random bandwidth are also taken at half the
    threads (and 1) to see whether they still scale. `run`: a KV run whose cost to judge; the
    granules it needs (KVRun.granules) are measured too."""
    info = device.info
    check_alpha(alpha)
    check_full_speed(full_speed)
    threads = _threads_for(info, threads)
    if not is_int(reps) or reps < 1:
        raise BadArgument(f"reps must be a positive integer, got {reps!r}")
    gran = info.natural_granule if decision_granule is None else check_granule(decision_granule)
    grans = sorted({check_granule(g) for g in granularities} | {gran})
    if buffer_bytes is not None and (not is_int(buffer_bytes) or buffer_bytes <= 0):
        raise BadArgument(f"buffer size must be a positive integer of bytes, got {buffer_bytes!r}")
    if run is not None:
        size = device.check_measure("rand", MIN_GRANULE, threads, buffer_bytes=buffer_bytes,
                                    reps=reps)
        run.check_fits(size, info.spec)
        grans = sorted(set(grans) | set(run.granules(size)))
    cache_note = _cache_note(device, buffer_bytes)
    thread_counts = sorted({1, max(1, threads // 2), threads})
    steps = [("read", 64, t) for t in thread_counts] + [("copy", 64, threads)]
    steps += [("rand", gran, t) for t in thread_counts if t != threads]
    steps += [("rand", g, threads) for g in grans]
    for pattern, g, t in steps:  # the device's own rules (memory, granule vs buffer, limits)
        device.check_measure(pattern, g, t, buffer_bytes=buffer_bytes, reps=reps)
    return ProbePlan(device, grans, gran, alpha, threads, thread_counts, buffer_bytes, reps, steps,
                     cache_note, full_speed, run)


def run_plan(plan: ProbePlan,
             progress: Callable[[str, int, int], None] | None = None) -> ProbeResult:
    """Measure and classify one device as planned."""
    device, info, threads, gran = plan.device, plan.device.info, plan.threads, plan.decision_granule
    measured: dict[tuple[str, int, int], Measurement] = {}
    for i, key in enumerate(plan.steps):
        pattern, g, t = key
        if progress:
            progress(f"{info.spec}: {pattern} {g} B x{t} thread{'s' * (t > 1)}", i, len(plan.steps))
        measured[key] = device.measure(pattern, g, t, buffer_bytes=plan.buffer_bytes, reps=plan.reps)
    if progress:
        progress(f"{info.spec}: done", len(plan.steps), len(plan.steps))
    results = list(measured.values())

    def pick(pattern, g=64, t=threads):
        return measured[(pattern, g, t)]

    seq_scaling = {t: pick("read", t=t).gbps for t in plan.thread_counts}
    rand_scaling = {t: pick("rand", gran, t).gbps for t in plan.thread_counts}
    seq = seq_scaling[threads]
    rand = {g: pick("rand", g).gbps for g in plan.granularities}
    ratio = rand[gran] / seq
    verdict, reason = classify(ratio, plan.alpha, seq_scaling, rand_scaling, info.peak_gbps,
                               results, plan.cache_note)
    kv_run = None
    if plan.run is not None:
        kv_run = judge_run(plan.run, {g: v / seq for g, v in rand.items()}, plan.alpha,
                           plan.full_speed, info.spec)
    return ProbeResult(
        device=info.spec, kind=info.kind, name=info.name, peak_gbps=info.peak_gbps,
        seq_gbps=seq, copy_gbps=pick("copy").gbps, rand_gbps=rand, granularity=gran,
        ratio=ratio, alpha=plan.alpha, verdict=verdict, reason=reason, threads=threads,
        seq_scaling=seq_scaling, rand_scaling=rand_scaling,
        buffer_bytes=results[0].buffer_bytes, measurements=results,
        details=dict(info.details, **results[-1].extra), full_speed=plan.full_speed,
        kv_run=kv_run)


def probe_device(device: Device, granularities=DEFAULT_GRANULARITIES, alpha=DEFAULT_ALPHA,
                 threads: int | None = None, decision_granule: int | None = None,
                 buffer_bytes: int | None = None, reps: int = 5,
                 progress: Callable[[str, int, int], None] | None = None,
                 full_speed: float = FULL_SPEED, run: KVRun | None = None) -> ProbeResult:
    """Measure and classify one device (plan_probe, then run_plan)."""
    return run_plan(plan_probe(device, granularities, alpha, threads, decision_granule,
                               buffer_bytes, reps, full_speed, run), progress)
