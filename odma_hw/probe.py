"""Is a device's memory random-access-constrained (RACM), and by how much?

probe_device() measures sustained sequential-read bandwidth and random-read bandwidth across
granularities on one Device and classifies it: RACM when B_rand / B_seq at the device's natural
granule is below alpha (the ODMA paper's 0.3-0.7 range; default 0.5). The verdict is
"inconclusive" when the measurement cannot support one (devices.md rule 8): bandwidth still scales
with threads at the last core count (the memory system was not saturated, so the ratio is a
per-core limit), bandwidth sits far below the known peak, repetitions disagree too much, or the
working set may have fit in a cache.

Every argument is checked before anything is measured: plan_probe() validates one device's probe
(and asks the device whether it would accept every measurement of the plan), run_plan() measures.
The `probe` command plans every device it was given before it measures the first one.

Also the `devices` and `probe` subcommands of the CLI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from typing import Callable

from odma_hw import argtypes, jsonout, plotting
from odma_hw import devices as devmod
from odma_hw.devices.base import MIN_GRANULE, Device, DeviceInfo, Measurement, is_int
from odma_hw.errors import BadArgument

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


def check_granule(g) -> int:
    """A granule: an integer power of two >= 8 bytes (the upper bound is the buffer)."""
    if not is_int(g) or g < MIN_GRANULE or g & (g - 1):
        raise BadArgument(f"granularity {g!r} is not a power of two >= {MIN_GRANULE}")
    return g


def _bytes_of(text: str) -> int | None:
    """'64' -> 64, '4K' -> 4096, '1M' -> 1048576 (a trailing B is allowed); None if malformed."""
    part = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20}.get(part[-1:], 1)
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
    buffer_bytes: int
    measurements: list[Measurement]
    details: dict

    def to_json(self) -> dict:
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
        }


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
               buffer_bytes: int | None = None, reps: int = 5) -> ProbePlan:
    """Check every argument of a probe of `device` and return its plan; raise BadArgument for
    anything the probe or the device would refuse, before anything is allocated or measured.
    `threads` defaults to every CPU the host may use (devices: 1, they run on their own
    parallelism); sequential and decision-granule random bandwidth are also taken at half the
    threads (and 1) to see whether they still scale."""
    info = device.info
    check_alpha(alpha)
    threads = _threads_for(info, threads)
    if not is_int(reps) or reps < 1:
        raise BadArgument(f"reps must be a positive integer, got {reps!r}")
    gran = info.natural_granule if decision_granule is None else check_granule(decision_granule)
    grans = sorted({check_granule(g) for g in granularities} | {gran})
    if buffer_bytes is not None and (not is_int(buffer_bytes) or buffer_bytes <= 0):
        raise BadArgument(f"buffer size must be a positive integer of bytes, got {buffer_bytes!r}")
    cache_note = _cache_note(device, buffer_bytes)
    thread_counts = sorted({1, max(1, threads // 2), threads})
    steps = [("read", 64, t) for t in thread_counts] + [("copy", 64, threads)]
    steps += [("rand", gran, t) for t in thread_counts if t != threads]
    steps += [("rand", g, threads) for g in grans]
    for pattern, g, t in steps:  # the device's own rules (memory, granule vs buffer, limits)
        device.check_measure(pattern, g, t, buffer_bytes=buffer_bytes, reps=reps)
    return ProbePlan(device, grans, gran, alpha, threads, thread_counts, buffer_bytes, reps, steps,
                     cache_note)


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
    return ProbeResult(
        device=info.spec, kind=info.kind, name=info.name, peak_gbps=info.peak_gbps,
        seq_gbps=seq, copy_gbps=pick("copy").gbps, rand_gbps=rand, granularity=gran,
        ratio=ratio, alpha=plan.alpha, verdict=verdict, reason=reason, threads=threads,
        seq_scaling=seq_scaling, rand_scaling=rand_scaling,
        buffer_bytes=results[0].buffer_bytes, measurements=results,
        details=dict(info.details, **results[-1].extra))


def probe_device(device: Device, granularities=DEFAULT_GRANULARITIES, alpha=DEFAULT_ALPHA,
                 threads: int | None = None, decision_granule: int | None = None,
                 buffer_bytes: int | None = None, reps: int = 5,
                 progress: Callable[[str, int, int], None] | None = None) -> ProbeResult:
    """Measure and classify one device (plan_probe, then run_plan)."""
    return run_plan(plan_probe(device, granularities, alpha, threads, decision_granule,
                               buffer_bytes, reps), progress)


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


def run_probe(args) -> int:
    # everything the command line alone can refuse, before any device is opened
    alpha = check_alpha(args.alpha)
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
    if args.plot:
        plotting.check_plot_path(args.plot)
    specs = _unique_specs(args.device or default_specs())

    with contextlib.ExitStack() as opened:  # every device closed on every exit, Ctrl-C included
        # open and plan every device (its memory, granules, threads, cache) before measuring any
        devs = [opened.enter_context(devmod.open(spec)) for spec in specs]
        if args.threads is not None and not any(uses_host_threads(d.info) for d in devs):
            raise BadArgument(f"--threads {args.threads}: none of {', '.join(specs)} runs on host "
                              f"threads (devices use their own parallelism); drop --threads")
        plans = [plan_probe(d, grans, alpha, args.threads, decision, buffer_bytes, args.reps)
                 for d in devs]
        progress = None if args.quiet else _progress_printer(sys.stderr)
        results = [run_plan(plan, progress) for plan in plans]

    # the results first: a plot that cannot be written at the end must not lose them
    if args.json:
        print(jsonout.dumps({"schema": SCHEMA, "devices": [r.to_json() for r in results]}, indent=1))
    else:
        print(format_table(results))
    if args.plot:
        sys.stdout.flush()
        plot(results, args.plot)
    return 0


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
                    "their consumers request, on host, MLU and emulated memories) is below alpha. With no --device: every device found plus emu:lpddr5-6400.")
    p.add_argument("--device", action="append", metavar="SPEC",
                   help="host, cuda:N, mlu:N, torch:<device>, emu:<preset> (repeatable)")
    p.add_argument("--granularity", metavar="G,...",
                   help="random-read granules in bytes, powers of two (default 32,64,...,1K,4K)")
    p.add_argument("--decision-granularity", metavar="G",
                   help="granule the verdict is taken at, a power of two >= 8 such as 64 or 4K "
                        "(default: the device's natural granule)")
    p.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                   help="RACM threshold on random/sequential, in (0, 1) (default 0.5)")
    p.add_argument("--threads", type=argtypes.positive_int,
                   help="host threads, at most the CPUs this process may run on (default: all of "
                        "them); devices other than host use their own parallelism")
    p.add_argument("--buffer-mib", type=argtypes.positive_float,
                   help="working-set size in MiB, at least 4 x the device's last-level cache where "
                        "that is known (default: per device, far above its caches)")
    p.add_argument("--reps", type=argtypes.positive_int, default=5,
                   help="timed repetitions after one warm-up (default 5)")
    p.add_argument("--json", action="store_true", help=f"print one JSON object (schema {SCHEMA})")
    p.add_argument("--plot", metavar="FILE",
                   help="write bandwidth and ratio vs granularity (format from the extension, e.g. "
                        ".png, .svg, .pdf; checked before measuring)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=run_probe)
