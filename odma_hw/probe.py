"""Is a device's memory random-access-constrained (RACM), and by how much?

probe_device() measures sustained sequential-read bandwidth and random-read bandwidth across
granularities on one Device and classifies it: RACM when B_rand / B_seq at the device's natural
granule is below alpha (the ODMA paper's 0.3-0.7 range; default 0.5). The verdict is
"inconclusive" when the measurement cannot support one (devices.md rule 8): bandwidth still scales
with threads at the last core count (the memory system was not saturated, so the ratio is a
per-core limit), bandwidth sits far below the known peak, or repetitions disagree too much.

Also the `devices` and `probe` subcommands of the CLI.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Callable

from odma_hw import devices as devmod
from odma_hw.devices.base import Device, Measurement
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


def parse_granularities(text: str) -> list[int]:
    """'32,64,4K' -> [32, 64, 4096]; each a power of two >= 8 (the upper bound is the buffer)."""
    out = []
    for part in text.split(","):
        part = part.strip().upper().removesuffix("B")
        mult = {"K": 1 << 10, "M": 1 << 20}.get(part[-1:], 1)
        if mult > 1:
            part = part[:-1]
        if not part.isdigit():
            raise BadArgument(f"malformed granularity {text!r}: expected e.g. 32,64,4K")
        g = int(part) * mult
        if g < 8 or g & (g - 1):
            raise BadArgument(f"granularity {g} is not a power of two >= 8")
        out.append(g)
    return sorted(set(out))


def check_alpha(alpha: float) -> float:
    if not (0.0 < alpha < 1.0):
        raise BadArgument(f"alpha must lie in (0, 1), got {alpha}")
    return alpha


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
             measurements: list[Measurement]) -> tuple[str, str]:
    """(verdict, reason) from the measured numbers; see the module docstring for the rules."""
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


def probe_device(device: Device, granularities=DEFAULT_GRANULARITIES, alpha=DEFAULT_ALPHA,
                 threads: int | None = None, decision_granule: int | None = None,
                 buffer_bytes: int | None = None, reps: int = 5,
                 progress: Callable[[str, int, int], None] | None = None) -> ProbeResult:
    """Measure and classify one device. `threads` defaults to every core the backend may use;
    sequential and decision-granule random bandwidth are also taken at half the threads (and 1)
    to see whether they still scale."""
    info = device.info
    check_alpha(alpha)
    threads = threads or info.max_threads
    if threads < 1:
        raise BadArgument(f"threads must be >= 1, got {threads}")
    if reps < 1:
        raise BadArgument(f"reps must be >= 1, got {reps}")
    gran = decision_granule or info.natural_granule
    grans = sorted(set(granularities) | {gran})
    for g in grans:
        if g < 8 or g & (g - 1):
            raise BadArgument(f"granularity {g} is not a power of two >= 8")
    thread_counts = sorted({1, max(1, threads // 2), threads})

    plan = [("read", 64, t) for t in thread_counts] + [("copy", 64, threads)]
    plan += [("rand", gran, t) for t in thread_counts if t != threads]
    plan += [("rand", g, threads) for g in grans]
    measured: dict[tuple[str, int, int], Measurement] = {}
    for i, key in enumerate(plan):
        pattern, g, t = key
        if progress:
            progress(f"{info.spec}: {pattern} {g} B x{t} thread{'s' * (t > 1)}", i, len(plan))
        measured[key] = device.measure(pattern, g, t, buffer_bytes=buffer_bytes, reps=reps)
    if progress:
        progress(f"{info.spec}: done", len(plan), len(plan))
    results = list(measured.values())

    def pick(pattern, g=64, t=threads):
        return measured[(pattern, g, t)]

    seq_scaling = {t: pick("read", t=t).gbps for t in thread_counts}
    rand_scaling = {t: pick("rand", gran, t).gbps for t in thread_counts}
    seq = seq_scaling[threads]
    rand = {g: pick("rand", g).gbps for g in grans}
    ratio = rand[gran] / seq
    verdict, reason = classify(ratio, alpha, seq_scaling, rand_scaling, info.peak_gbps, results)
    return ProbeResult(
        device=info.spec, kind=info.kind, name=info.name, peak_gbps=info.peak_gbps,
        seq_gbps=seq, copy_gbps=pick("copy").gbps, rand_gbps=rand, granularity=gran,
        ratio=ratio, alpha=alpha, verdict=verdict, reason=reason, threads=threads,
        seq_scaling=seq_scaling, rand_scaling=rand_scaling,
        buffer_bytes=results[0].buffer_bytes, measurements=results,
        details=dict(info.details, **results[-1].extra))


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
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BadArgument(f"--plot needs matplotlib ({exc}); pip install 'odma-hw[plot]'") from None
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
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise BadArgument(f"cannot write plot {path!r}: {exc.strerror}") from None
    finally:
        plt.close(fig)


def run_probe(args) -> int:
    alpha = check_alpha(args.alpha)
    grans = parse_granularities(args.granularity) if args.granularity else list(DEFAULT_GRANULARITIES)
    if args.threads is not None and args.threads < 1:
        raise BadArgument(f"--threads must be >= 1, got {args.threads}")
    if args.buffer_mib is not None and args.buffer_mib <= 0:
        raise BadArgument(f"--buffer-mib must be positive, got {args.buffer_mib}")
    buffer_bytes = int(args.buffer_mib * (1 << 20)) if args.buffer_mib else None
    if buffer_bytes is not None and max(grans) > buffer_bytes:
        raise BadArgument(f"granularity {max(grans)} exceeds the {buffer_bytes}-byte buffer")
    specs = args.device or default_specs()
    for spec in specs:  # reject a malformed spec before measuring anything
        devmod.parse_spec(spec)
    progress = None if args.quiet else _progress_printer(sys.stderr)
    results = []
    for spec in specs:
        with devmod.open(spec) as dev:
            if buffer_bytes is not None and buffer_bytes > dev.info.free_bytes:
                raise BadArgument(f"--buffer-mib {args.buffer_mib} exceeds the "
                                  f"{dev.info.free_bytes >> 20} MiB free on {spec}")
            threads = args.threads or dev.info.max_threads
            results.append(probe_device(dev, grans, alpha, threads, args.decision_granularity,
                                        buffer_bytes, args.reps, progress))
    if args.plot:
        plot(results, args.plot)
    if args.json:
        print(json.dumps({"schema": SCHEMA, "devices": [r.to_json() for r in results]}, indent=1))
    else:
        print(format_table(results))
    return 0


def run_devices(args) -> int:
    statuses = devmod.discover()
    if args.json:
        print(json.dumps({"schema": "odma-hw.devices/1", "backends": [dataclasses.asdict(s) for s in statuses]},
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
                    "device's natural granule (64 B host and MLU, 32 B CUDA and LPDDR5 BL16) is "
                    "below alpha. With no --device: every device found plus emu:lpddr5-6400.")
    p.add_argument("--device", action="append", metavar="SPEC",
                   help="host, cuda:N, mlu:N, torch:<device>, emu:<preset> (repeatable)")
    p.add_argument("--granularity", metavar="G,...",
                   help="random-read granules in bytes, powers of two (default 32,64,...,1K,4K)")
    p.add_argument("--decision-granularity", type=int, metavar="G",
                   help="granule the verdict is taken at (default: the device's natural granule)")
    p.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                   help="RACM threshold on random/sequential, in (0, 1) (default 0.5)")
    p.add_argument("--threads", type=int, help="host threads (default: all cores)")
    p.add_argument("--buffer-mib", type=float, help="working-set size (default per devices.md rule 1)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions after one warm-up (default 5)")
    p.add_argument("--json", action="store_true", help=f"print one JSON object (schema {SCHEMA})")
    p.add_argument("--plot", metavar="PNG", help="write bandwidth and ratio vs granularity")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=run_probe)
