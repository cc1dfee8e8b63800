"""The `devices` and `probe` commands: their parsers, the options checked before any device is
opened (kv_run_of), the table and plot of the results."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time

from odma_cli import argtypes, jsonout, plotting
from odma_cli.commands import model_head_dim
from odma_cli.errors import BadArgument
from odma_hw import devices as devmod
from odma_hw.devices.base import is_int
from odma_hw.probe.measure import (DEFAULT_ALPHA, DEFAULT_GRANULARITIES, MIB, PAPER_GRANULES,
                                   SCHEMA, ProbeResult, plan_probe, run_plan, uses_host_threads)
from odma_hw.probe.runs import (DEFAULT_KV_DTYPE, DEFAULT_PAGE_TOKENS, FULL_SPEED, KV_DTYPES, KVRun,
                                bytes_of, check_alpha, check_full_speed, parse_granularities,
                                parse_granule)
from odma_hw.probe.saved import load_saved, rejudge


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
        named = f"{r.name}; " if r.name else ""       # a saved entry may lack its name
        lines.append(f"{r.device}: {named}{peak}; seq by threads: {scaling}; {r.reason}")
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
        nbytes = bytes_of(args.run_bytes)
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
    p.add_argument("--plot", type=argtypes.nonempty, metavar="FILE",
                   help="write bandwidth and ratio vs granularity (format from the extension, e.g. "
                        ".png, .svg, .pdf; checked before measuring)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=run_probe)
