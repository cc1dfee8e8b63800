"""Is a device's memory random-access-constrained (RACM), and by how much?

probe_device() measures sustained sequential-read bandwidth and random-read bandwidth across
granularities on one Device and classifies it: RACM when B_rand / B_seq at the device's natural
granule is below alpha (the ODMA paper's 0.3-0.7 range; default 0.5). The verdict is
"inconclusive" when the measurement cannot support one (devices.md rule 8): bandwidth still scales
with threads at the last core count (the memory system was not saturated, so the ratio is a
per-core limit), bandwidth sits far below the known peak, repetitions disagree too much, or the
working set may have fit in a cache.

That verdict answers "is this memory random-access-constrained at the decision granule?" (the
ODMA paper's definition, section 2.2, speaks of "the access granularities typical of KV-cache
paging (tens to hundreds of bytes)"). An allocator asks a narrower question: do the runs its KV
layout reads stream at full speed? So beside the verdict the probe reports the knee (the smallest
measured run from which on every measured run reads at >= FULL_SPEED of streaming) and, for a
model's KV pages (--model, --page-tokens, --dtype) or a run size (--run-bytes), what paging costs
on the device: the ratio at that run size, measured where it is a power of two, interpolated
between the two measured granules around it otherwise. `--from FILE` re-judges a saved result
(`probe --json`) without measuring.

Every argument is checked before anything is measured: plan_probe() validates one device's probe
(and asks the device whether it would accept every measurement of the plan), run_plan() measures.
The `probe` command plans every device it was given before it measures the first one.

Also the `devices` and `probe` subcommands of the CLI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from typing import Callable

from odma_hw import argtypes, jsonout, plotting
from odma_hw import devices as devmod
from odma_hw.commands import model_head_dim
from odma_hw.devices.base import MIN_GRANULE, Device, DeviceInfo, Measurement, is_int
from odma_hw.errors import BadArgument, one_line

SCHEMA = "odma-hw.probe/1"
DEFAULT_GRANULARITIES = (32, 64, 128, 256, 512, 1024, 4096)
DEFAULT_ALPHA = 0.5
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
# A run reading at this fraction of streaming or more reads at full speed: the knee is where runs
# reach it for good, and KV runs that reach it make paging free. It is not alpha: alpha marks a
# device as RACM at its decision granule, while a page read at 0.68 of streaming (an H100's 64 B
# runs) still makes paged KV reads take half as long again as a contiguous block's.
FULL_SPEED = 0.9
# bytes per KV element; bf16 is what GPU serving stacks keep their KV cache in by default
KV_DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
DEFAULT_KV_DTYPE = "bf16"
DEFAULT_PAGE_TOKENS = 16            # as `simulate` and `engine` page by default (vLLM's block)
PAPER_GRANULES = ("the ODMA paper's RACM definition (section 2.2) speaks of \"the access "
                  "granularities typical of KV-cache paging (tens to hundreds of bytes)\"")


def check_granule(g) -> int:
    """A granule: an integer power of two >= 8 bytes (the upper bound is the buffer)."""
    if not is_int(g) or g < MIN_GRANULE or g & (g - 1):
        raise BadArgument(f"granularity {g!r} is not a power of two >= {MIN_GRANULE}")
    return g


def _bytes_of(text: str) -> int | None:
    """'64' -> 64, '4K' -> 4096, '1M' -> 1048576, '1G' (a trailing B is allowed); None if
    malformed."""
    part = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(part[-1:], 1)
    if mult > 1:
        part = part[:-1]
    return int(part) * mult if part.isdigit() else None


def parse_granule(text: str) -> int:
    """One granule, as --decision-granularity takes it: '64' or '4K'."""
    g = _bytes_of(text)
    if g is None:
        raise BadArgument(f"malformed granularity {text!r}: expected e.g. 32, 64 or 4K")
    return check_granule(g)


def parse_granularities(text: str) -> list[int]:
    """'32,64,4K' -> [32, 64, 4096]; each a power of two >= 8 (the upper bound is the buffer)."""
    values = [_bytes_of(part) for part in text.split(",")]
    if None in values:
        raise BadArgument(f"malformed granularity {text!r}: expected e.g. 32,64,4K")
    return sorted({check_granule(g) for g in values})


def check_alpha(alpha: float) -> float:
    if not (isinstance(alpha, (int, float)) and 0.0 < alpha < 1.0):  # also refuses nan
        raise BadArgument(f"alpha must lie in (0, 1), got {alpha}")
    return alpha


def check_full_speed(fraction: float) -> float:
    if not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0):  # also refuses nan
        raise BadArgument(f"full speed must lie in (0, 1] (a fraction of streaming), got "
                          f"{fraction}")
    return fraction


def size_text(nbytes: int) -> str:
    """2048 -> '2 KiB', 96 -> '96 B', 3072 -> '3 KiB'."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


@dataclasses.dataclass(frozen=True)
class KVRun:
    """A contiguous run that a paged KV layout reads, whose cost the probe reports: one page of
    one (layer, K or V, KV head) in the head-major layout [layers, 2, kv_heads, tokens, head_dim]
    is page_tokens x head_dim x dtype bytes (a model's pages: of_model), or `nbytes` as given."""

    nbytes: int
    page_tokens: int | None = None
    model: str | None = None
    head_dim: int | None = None
    dtype: str | None = None

    @classmethod
    def of_model(cls, model: str, head_dim: int, page_tokens: int, dtype: str) -> "KVRun":
        if not is_int(page_tokens) or page_tokens < 1:
            raise BadArgument(f"--page-tokens must be a positive integer, got {page_tokens!r}")
        if dtype not in KV_DTYPES:
            raise BadArgument(f"unknown --dtype {dtype!r}: expected one of {', '.join(KV_DTYPES)}")
        return cls(page_tokens * head_dim * KV_DTYPES[dtype], page_tokens, model, head_dim, dtype)

    def label(self) -> str:
        """'16-token pages of M (head_dim 64, bf16) are 2 KiB runs', or '2 KiB runs'."""
        if self.model is None:
            return f"{size_text(self.nbytes)} runs"
        return (f"{self.page_tokens}-token pages of {self.model} (head_dim {self.head_dim}, "
                f"{self.dtype}) are {size_text(self.nbytes)} runs")

    def check_fits(self, buffer_bytes: int, where: str) -> None:
        """BadArgument when no random read of this run fits: below the smallest granule measured,
        or larger than the `buffer_bytes` buffer the probe reads on `where`."""
        what = "--run-bytes" if self.model is None else self.label().replace(" are ", ", ")
        if self.nbytes < MIN_GRANULE:
            raise BadArgument(f"{what}: {self.nbytes} B is below the smallest granule the probe "
                              f"measures ({MIN_GRANULE} B)")
        if self.nbytes > buffer_bytes:
            raise BadArgument(f"{what}: {self.nbytes} B is larger than the {buffer_bytes}-byte "
                              f"buffer the probe reads on {where}")

    def granules(self, buffer_bytes: int) -> list[int]:
        """The granules to measure for it: the run itself where it is a power of two, else the
        powers of two around it (the ratio is interpolated between them); none above the
        buffer (check_fits first)."""
        below = 1 << (self.nbytes.bit_length() - 1)
        if below == self.nbytes:
            return [below]
        return [g for g in (below, 2 * below) if MIN_GRANULE <= g <= buffer_bytes]


def knee(ratios: dict[int, float], full_speed: float = FULL_SPEED) -> int | None:
    """The smallest measured granule from which on every measured granule reads at >=
    `full_speed` of streaming (ratios: granule -> random/sequential); None when the largest does
    not."""
    found = None
    for g in sorted(ratios, reverse=True):
        if ratios[g] < full_speed:
            break
        found = g
    return found


def ratio_at(ratios: dict[int, float], nbytes: int, where: str) -> tuple[float, str, list[int]]:
    """(random/sequential for runs of `nbytes`, how it was found, the granules it comes from):
    "measured" at that granule; "interpolated" linearly in log2(size) between the two measured
    granules around it; "largest-measured" above the largest granule measured (a longer run
    reads no worse: a lower bound). BadArgument below the smallest granule `where` measured."""
    if nbytes in ratios:
        return ratios[nbytes], "measured", [nbytes]
    sizes = sorted(ratios)
    if nbytes < sizes[0]:
        raise BadArgument(f"a {nbytes} B run is below the smallest granule {where} measured "
                          f"({sizes[0]} B): probe the device for it rather than judging a saved "
                          f"result")
    if nbytes > sizes[-1]:
        return ratios[sizes[-1]], "largest-measured", [sizes[-1]]
    lo = max(g for g in sizes if g < nbytes)
    hi = min(g for g in sizes if g > nbytes)
    w = (math.log2(nbytes) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return ratios[lo] * (1 - w) + ratios[hi] * w, "interpolated", [lo, hi]


def judge_run(run: KVRun, ratios: dict[int, float], alpha: float, full_speed: float,
              where: str) -> dict:
    """What paging costs for runs like `run` on a device whose random/sequential ratios by
    granule are `ratios`: the JSON object `kv_run` of a probe result, its `summary` the sentence
    the table prints."""
    ratio, how, around = ratio_at(ratios, run.nbytes, where)
    basis = {"measured": f"measured at {size_text(run.nbytes)}",
             "interpolated": (f"interpolated between the measured {size_text(around[0])} and "
                              f"{size_text(around[-1])}"),
             "largest-measured": (f"the largest measured granule's ({size_text(around[0])}): "
                                  f"a longer run reads no worse")}[how]
    free = ratio >= full_speed
    if free and round(ratio, 2) >= 1.0:          # as the sentence prints it
        tail = "paging costs nothing on this device"
    elif free:
        tail = (f"paging costs little on this device (paged KV reads take {1 / ratio:.2f}x a "
                f"contiguous block's time; >= {full_speed:g} of streaming is full speed)")
    else:
        tail = (f"paging reads at {ratio:.2f}; contiguous blocks recommended (paged KV reads "
                f"take {1 / ratio:.2f}x a contiguous block's time")
        tail += f"; below alpha {alpha:.2f}: RACM at this run size)" if ratio < alpha else ")"
    return {"run_bytes": run.nbytes, "page_tokens": run.page_tokens, "model": run.model,
            "head_dim": run.head_dim, "dtype": run.dtype,
            "dtype_bytes": KV_DTYPES.get(run.dtype) if run.dtype else None,
            "ratio": ratio, "ratio_source": how, "ratio_granules": around,
            "full_speed": full_speed,
            "verdict": "paging-free" if free else "contiguous-recommended",
            "summary": f"{run.label()}: {ratio:.2f} of streaming here: {tail}",
            "basis": f"the verdict at the {size_text(run.nbytes)} run size; its ratio {basis}"}


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


def default_specs() -> list[str]:
    """Every device found plus emu:lpddr5-6400. torch:cpu and torch:cuda:N are left out: host and
    cuda:N measure the same memory with native kernels."""
    specs = []
    for status in devmod.discover():
        for spec in status.specs:
            if status.backend == "emu":
                continue
            if spec == "torch:cpu" or spec.startswith("torch:cuda"):
                continue
            specs.append(spec)
    return specs + ["emu:lpddr5-6400"]


# ------------------------------------------------------------------------ saved results
def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _saved_entry(entry, path: str, i: int) -> ProbeResult:
    """One device entry of a saved result, checked as far as re-judging it needs."""
    if not isinstance(entry, dict):
        raise BadArgument(f"{path}: devices[{i}] is not an object")
    name = entry.get("device")
    where = f"{path}: device {name!r}" if isinstance(name, str) else f"{path}: devices[{i}]"
    if not isinstance(name, str) or not name:
        raise BadArgument(f"{where} lacks a 'device' name")
    for key in ("verdict", "reason"):
        if not isinstance(entry.get(key), str):
            raise BadArgument(f"{where}: {key!r} must be text, got {entry.get(key)!r:.60}")
    for key in ("seq_gbps", "ratio", "alpha"):
        if not _positive(entry.get(key)):
            raise BadArgument(f"{where}: {key!r} must be a finite number > 0, got "
                              f"{entry.get(key)!r:.60}")
    gran = entry.get("granularity")
    if not is_int(gran) or gran < MIN_GRANULE:
        raise BadArgument(f"{where}: 'granularity' must be a granule in bytes, got {gran!r:.60}")
    rand = entry.get("rand_gbps")
    if not isinstance(rand, dict) or not rand:
        raise BadArgument(f"{where}: 'rand_gbps' must be an object of GB/s by granule")
    table = {}
    for g, v in rand.items():
        size = int(g) if isinstance(g, str) and g.isdigit() else None
        if size is None or size < MIN_GRANULE or not _positive(v):
            raise BadArgument(f"{where}: 'rand_gbps' {g!r}: {v!r:.60} is not a granule in bytes "
                              f"and a bandwidth > 0")
        table[size] = float(v)
    buffer_bytes = entry.get("buffer_bytes")
    if buffer_bytes is not None and (not is_int(buffer_bytes) or buffer_bytes <= 0):
        raise BadArgument(f"{where}: 'buffer_bytes' must be a positive integer, got "
                          f"{buffer_bytes!r:.60}")
    seq = float(entry["seq_gbps"])
    copy = entry.get("copy_gbps")
    threads = entry.get("threads") if is_int(entry.get("threads")) else 1

    def scaling(key):
        v = entry.get(key)
        ok = isinstance(v, dict) and v and all(k.isdigit() and _positive(x) for k, x in v.items())
        return {int(k): float(x) for k, x in v.items()} if ok else None

    peak = entry.get("peak_gbps")
    return ProbeResult(
        device=name, kind=str(entry.get("kind", "?")), name=str(entry.get("name", "")),
        peak_gbps=float(peak) if _positive(peak) else None, seq_gbps=seq,
        copy_gbps=float(copy) if _positive(copy) else seq, rand_gbps=table, granularity=gran,
        ratio=float(entry["ratio"]), alpha=float(entry["alpha"]), verdict=entry["verdict"],
        reason=entry["reason"], threads=threads,
        seq_scaling=scaling("seq_scaling") or {threads: seq},
        rand_scaling=scaling("rand_scaling") or {}, buffer_bytes=buffer_bytes, measurements=[],
        details=entry.get("details") if isinstance(entry.get("details"), dict) else {},
        saved={k: v for k, v in entry.items()
               if k not in ("knee_bytes", "full_speed", "granule_note", "kv_run", "from_file")},
        origin=path)


def load_saved(path: str, devices: list[str] | None = None) -> list[ProbeResult]:
    """The device entries of a saved `probe --json` (schema odma-hw.probe/1), or those named in
    `devices`, as ProbeResults that keep their saved fields; BadArgument in one line naming the
    file (and the key) for anything amiss."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as exc:
        raise BadArgument(f"--from {path}: cannot read it: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadArgument(f"--from {path}: not JSON ({one_line(exc, 120)})") \
            from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        schema = doc.get("schema") if isinstance(doc, dict) else None
        raise BadArgument(f"--from {path}: not an {SCHEMA} document (schema {schema!r:.60})")
    entries = doc.get("devices")
    if not isinstance(entries, list) or not entries:
        raise BadArgument(f"--from {path}: 'devices' must be a non-empty list")
    results = [_saved_entry(e, path, i) for i, e in enumerate(entries)]
    if devices:
        have = {r.device: r for r in results}
        missing = [d for d in devices if d not in have]
        if missing:
            raise BadArgument(f"--device {missing[0]!r} is not in {path}, which holds "
                              f"{', '.join(have)}")
        results = [have[d] for d in dict.fromkeys(devices)]
    return results


def rejudge(result: ProbeResult, full_speed: float = FULL_SPEED,
            run: KVRun | None = None) -> ProbeResult:
    """A saved result judged again: its knee at `full_speed` and what paging `run` costs (the
    saved verdict stands: it needs the measurements' spread and scaling, which were judged when
    they were taken)."""
    check_full_speed(full_speed)
    where = result.origin or result.device
    kv_run = None
    if run is not None:
        if result.buffer_bytes is not None:
            run.check_fits(result.buffer_bytes, f"{result.device} in {where}")
        kv_run = judge_run(run, result.ratios, result.alpha, full_speed, where)
    return dataclasses.replace(result, full_speed=full_speed, kv_run=kv_run)


# ------------------------------------------------------------------------------------- CLI
def _progress_printer(stream):
    """A one-line progress display on a terminal, plain lines otherwise."""
    tty = stream.isatty()
    start = time.perf_counter()

    def show(label, done, total):
        text = f"[{done}/{total}] {label} ({time.perf_counter() - start:.0f} s)"
        if tty:
            stream.write("\r\033[K" + text + ("\n" if done == total else ""))
        else:
            stream.write(text + "\n")
        stream.flush()
    return show


def format_table(results: list[ProbeResult]) -> str:
    grans = sorted({g for r in results for g in r.rand_gbps})
    head = ["device", "seq GB/s", "copy GB/s"] + [f"rand {g}" for g in grans] + ["ratio", "verdict"]
    rows = [head]
    for r in results:
        rows.append([r.device, f"{r.seq_gbps:.2f}", f"{r.copy_gbps:.2f}"]
                    + [f"{r.rand_gbps[g]:.2f}" if g in r.rand_gbps else "-" for g in grans]
                    + [f"{r.ratio:.2f}@{r.granularity}B", r.verdict])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    for r in results:
        peak = f"peak {r.peak_gbps:.1f} GB/s" if r.peak_gbps else "peak unknown"
        scaling = ", ".join(f"{t}T {v:.1f}" for t, v in r.seq_scaling.items())
        lines.append(f"{r.device}: {r.name}; {peak}; seq by threads: {scaling}; {r.reason}")
        if r.origin:
            lines.append(f"{r.device}: as measured in {r.origin}, judged again")
        lines.append(f"{r.device}: the {r.verdict} verdict is taken at the {r.granularity} B "
                     f"decision granule ({PAPER_GRANULES}); {r.knee_text()}")
        if r.kv_run:
            lines.append(f"{r.device}: {r.kv_run['summary']} [{r.kv_run['basis']}]")
        if r.details.get("measures"):
            lines.append(f"{r.device}: measures {r.details['measures']}")
    lines.append("GB = 1e9 B; copy counts read + write; random counts granule x accesses; "
                 "ratio = random/sequential at the decision granule")
    return "\n".join(lines)


def plot(results: list[ProbeResult], path: str) -> None:
    """Bandwidth and ratio against granularity, one line per device (check the path up front with
    plotting.check_plot_path: this only reports an I/O failure of the final write)."""
    plt = plotting.pyplot()
    fig, (ax_bw, ax_ratio) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        gs = sorted(r.rand_gbps)
        line, = ax_bw.plot(gs, [r.rand_gbps[g] for g in gs], marker="o", label=f"{r.device} random")
        ax_bw.axhline(r.seq_gbps, color=line.get_color(), ls="--", lw=1, label=f"{r.device} sequential")
        ax_ratio.plot(gs, [r.rand_gbps[g] / r.seq_gbps for g in gs], marker="o",
                      color=line.get_color(), label=f"{r.device} ({r.verdict})")
    alpha = results[0].alpha
    ax_ratio.axhline(alpha, color="k", ls=":", lw=1, label=f"alpha {alpha}")
    for ax in (ax_bw, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("granularity (bytes)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax_bw.set_ylabel("GB/s")
    ax_bw.set_title("sustained bandwidth")
    ax_ratio.set_ylabel("random / sequential")
    ax_ratio.set_title("RACM ratio")
    fig.tight_layout()
    plotting.save(fig, path)


def _unique_specs(specs: list[str]) -> list[str]:
    """Every spec well formed (BadArgument otherwise) and named once."""
    seen: dict[tuple[str, str], str] = {}
    for spec in specs:
        backend, arg = devmod.parse_spec(spec)
        key = (backend, arg.strip().lower())
        if key in seen:
            raise BadArgument(f"--device {spec!r} repeats {seen[key]!r}: name each device once")
        seen[key] = spec
    return specs


def kv_run_of(args) -> KVRun | None:
    """The run --model/--page-tokens/--dtype or --run-bytes ask about (None: neither), every
    option checked and the model read before any device is opened. The model is read as
    `simulate --model` reads it, by that command's module (commands.model_head_dim): one rule
    for a model's head size, and no import of the allocator from here."""
    if args.model is None:
        for flag, value in (("--page-tokens", args.page_tokens), ("--dtype", args.dtype)):
            if value is not None:
                raise BadArgument(f"{flag} sizes a model's KV pages: give --model too (or "
                                  f"--run-bytes alone)")
        if args.run_bytes is None:
            return None
        nbytes = _bytes_of(args.run_bytes)
        if nbytes is None or nbytes < 1:
            raise BadArgument(f"malformed --run-bytes {args.run_bytes!r}: expected a positive "
                              f"size in bytes, e.g. 2048 or 2K")
        run = KVRun(nbytes)
        run.check_fits(nbytes, "any device")   # only the lower bound: no buffer is known yet
        return run
    if args.run_bytes is not None:
        raise BadArgument("--run-bytes and --model both give the run size: give one of them")
    page_tokens = DEFAULT_PAGE_TOKENS if args.page_tokens is None else args.page_tokens
    dtype = args.dtype or DEFAULT_KV_DTYPE
    if dtype not in KV_DTYPES:  # argparse's choices refuse it first; a caller's namespace may not
        raise BadArgument(f"unknown --dtype {dtype!r}: expected one of {', '.join(KV_DTYPES)}")
    if not is_int(page_tokens) or page_tokens < 1:
        raise BadArgument(f"--page-tokens must be a positive integer, got {page_tokens!r}")
    name, head_dim = model_head_dim(args.model)
    run = KVRun.of_model(name, head_dim, page_tokens, dtype)
    run.check_fits(run.nbytes, "any device")
    return run


# options that shape a measurement: a saved result (--from) has had its own
MEASURING = (("granularity", "--granularity"), ("decision_granularity", "--decision-granularity"),
             ("alpha", "--alpha"), ("threads", "--threads"), ("buffer_mib", "--buffer-mib"),
             ("reps", "--reps"))


def _rejudge_saved(args, full_speed: float, run: KVRun | None) -> list[ProbeResult]:
    given = [flag for dest, flag in MEASURING if getattr(args, dest) is not None]
    if given:
        raise BadArgument(f"{given[0]} shapes a measurement: --from re-judges a saved one "
                          f"(its verdict stands); drop {given[0]} or probe the device")
    if args.device:
        _unique_specs(args.device)
    return [rejudge(r, full_speed, run) for r in load_saved(args.from_file, args.device)]


def run_probe(args) -> int:
    # everything the command line alone can refuse, before any device is opened
    full_speed = check_full_speed(args.full_speed)
    run = kv_run_of(args)
    if args.from_file is not None:
        if args.plot:
            plotting.check_plot_path(args.plot)
        _show(args, _rejudge_saved(args, full_speed, run))
        return 0
    alpha = check_alpha(DEFAULT_ALPHA if args.alpha is None else args.alpha)
    reps = 5 if args.reps is None else args.reps
    grans = (parse_granularities(args.granularity) if args.granularity is not None
             else list(DEFAULT_GRANULARITIES))
    decision = (parse_granule(args.decision_granularity) if args.decision_granularity is not None
                else None)
    buffer_bytes = None
    if args.buffer_mib is not None:  # a finite number > 0 (argtypes.positive_float)
        buffer_bytes = math.floor(args.buffer_mib * MIB)
        if buffer_bytes < 1:
            raise BadArgument(f"--buffer-mib {args.buffer_mib:g} is less than one byte")
        if max(grans) > buffer_bytes:
            raise BadArgument(f"granularity {max(grans)} exceeds the {buffer_bytes}-byte buffer")
        if run is not None:
            run.check_fits(buffer_bytes, "every device (--buffer-mib)")
    if args.plot:
        plotting.check_plot_path(args.plot)
    specs = _unique_specs(args.device or default_specs())

    with contextlib.ExitStack() as opened:  # every device closed on every exit, Ctrl-C included
        # open and plan every device (its memory, granules, threads, cache) before measuring any
        devs = [opened.enter_context(devmod.open(spec)) for spec in specs]
        if args.threads is not None and not any(uses_host_threads(d.info) for d in devs):
            raise BadArgument(f"--threads {args.threads}: none of {', '.join(specs)} runs on host "
                              f"threads (devices use their own parallelism); drop --threads")
        plans = [plan_probe(d, grans, alpha, args.threads, decision, buffer_bytes, reps,
                            full_speed, run) for d in devs]
        progress = None if args.quiet else _progress_printer(sys.stderr)
        results = [run_plan(plan, progress) for plan in plans]
    _show(args, results)
    return 0


def _show(args, results: list[ProbeResult]) -> None:
    # the results first: a plot that cannot be written at the end must not lose them
    if args.json:
        print(jsonout.dumps({"schema": SCHEMA, "devices": [r.to_json() for r in results]}, indent=1))
    else:
        print(format_table(results))
    if args.plot:
        sys.stdout.flush()
        plot(results, args.plot)


def run_devices(args) -> int:
    statuses = devmod.discover()
    if args.json:
        print(jsonout.dumps({"schema": "odma-hw.devices/1", "backends": [dataclasses.asdict(s) for s in statuses]},
                         indent=1))
        return 0
    for s in statuses:
        if s.specs:
            shown = s.specs if s.backend != "emu" else [f"emu:<preset> ({len(s.specs)} presets: "
                                                        + ", ".join(x[4:] for x in s.specs) + ")"]
            for spec in shown:
                print(f"{s.backend:6s} {spec}")
        else:
            print(f"{s.backend:6s} (none) {s.reason}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("devices", help="list the devices this machine has, and why a backend is absent",
                       description="List every backend: the device specs it finds, or the reason it "
                                   "finds none (missing library, stub driver, no device).")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_devices)

    p = sub.add_parser(
        "probe", help="measure streaming vs random bandwidth and classify RACM",
        description="Measure sustained sequential and random-read bandwidth on each device and "
                    "classify it as RACM (random-access-constrained) when random/sequential at the "
                    "device's natural granule (32 B on CUDA GPUs, the sector they fetch; 64 B, the line "
                    "their consumers request, on host, MLU and emulated memories) is below alpha. Beside that verdict: the knee (the smallest run from which on runs read "
                    "at >= --full-speed of streaming) and, with --model (or --run-bytes), what "
                    "paging costs for that model's KV pages on the device. --from FILE judges a "
                    "saved --json result instead of measuring. With no --device: every device "
                    "found plus emu:lpddr5-6400.")
    p.add_argument("--device", action="append", metavar="SPEC",
                   help="host, cuda:N, mlu:N, torch:<device>, emu:<preset> (repeatable)")
    p.add_argument("--granularity", metavar="G,...",
                   help="random-read granules in bytes, powers of two (default 32,64,...,1K,4K)")
    p.add_argument("--decision-granularity", metavar="G",
                   help="granule the verdict is taken at, a power of two >= 8 such as 64 or 4K "
                        "(default: the device's natural granule)")
    p.add_argument("--alpha", type=float,
                   help="RACM threshold on random/sequential, in (0, 1) (default 0.5)")
    p.add_argument("--full-speed", type=float, default=FULL_SPEED, metavar="F",
                   help=f"fraction of streaming at which a run reads at full speed, in (0, 1] "
                        f"(default {FULL_SPEED:g}): the knee is the smallest measured run from "
                        f"which on every run reaches it, and KV runs that reach it make paging "
                        f"free")
    p.add_argument("--model", metavar="MODEL",
                   help="judge the runs of this model's paged KV cache: what simulate --model "
                        "takes (a shipped config such as qwen2.5-0.5b, a config.json or a folder "
                        "holding one, a preset); a run is one (layer, K or V, KV head) page, "
                        "page-tokens x head_dim x dtype bytes (the head-major layout)")
    p.add_argument("--page-tokens", type=argtypes.positive_int, metavar="N",
                   help=f"tokens per KV page, with --model (default {DEFAULT_PAGE_TOKENS}, as "
                        f"simulate and engine page)")
    p.add_argument("--dtype", choices=list(KV_DTYPES),
                   help=f"KV element type, with --model (default {DEFAULT_KV_DTYPE}, what GPU "
                        f"serving keeps its KV cache in by default)")
    p.add_argument("--run-bytes", metavar="B",
                   help="judge runs of B bytes (e.g. 2048 or 2K) instead of a model's pages; at "
                        "most the probe's buffer. A power of two is measured; another size is "
                        "interpolated between the two measured granules around it")
    p.add_argument("--from", dest="from_file", metavar="FILE",
                   help="judge a saved `probe --json` result instead of measuring (the knee, "
                        "--model or --run-bytes; its verdict stands); --device picks its entries")
    p.add_argument("--threads", type=argtypes.positive_int,
                   help="host threads, at most the CPUs this process may run on (default: all of "
                        "them); devices other than host use their own parallelism")
    p.add_argument("--buffer-mib", type=argtypes.positive_float,
                   help="working-set size in MiB, at least 4 x the device's last-level cache where "
                        "that is known (default: per device, far above its caches)")
    p.add_argument("--reps", type=argtypes.positive_int,
                   help="timed repetitions after one warm-up (default 5)")
    p.add_argument("--json", action="store_true", help=f"print one JSON object (schema {SCHEMA})")
    p.add_argument("--plot", metavar="FILE",
                   help="write bandwidth and ratio vs granularity (format from the extension, e.g. "
                        ".png, .svg, .pdf; checked before measuring)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=run_probe)
