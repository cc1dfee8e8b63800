"""`odma-hw emulate`: run the timing engine on a preset and print a table or JSON."""

from __future__ import annotations

import functools
import sys

from odma_cli import argtypes, jsonout
from odma_cli.commands import ValueCheck
from odma_cli.errors import BadArgument

DEFAULT_METRIC = "efficiency"           # what a sweep of emulate prints and plots
OPTION_UNITS = {"granularity": "B", "interleave": "B", "footprint": "B"}
# the generated traffic's options and their defaults (None on the command line: not given, so
# that one given beside --trace, which replaces them, is refused rather than ignored)
GENERATED_DEFAULTS = {"pattern": "rand", "requests": "200000", "footprint": None,
                      "write_ratio": None, "seed": 1}
# a run that times more accesses than this shows its progress. A generated run is judged before
# it starts, by its bytes counted in 64-byte accesses (a few requests of a large granularity are
# as long as millions of small ones); a trace file's run, whose size is known only once the file
# is read, by the accesses it times.
PROGRESS_ACCESSES = 2_000_000
PROGRESS_BYTES = PROGRESS_ACCESSES * 64


def warm_up() -> None:
    """Load (or compile) the emulator's Numba code in this process: a sweep's workers call it
    before their first cell, so that no cell's wall time includes compilation."""
    from odma_hw.emu import emulate

    emulate("lpddr5-6400", "rand", 64, 256)

SCHEMA = "odma-hw.emulate/1"


def register(subparsers) -> None:
    from odma_hw.emu.specs import PRESETS
    from odma_hw.emu.traces import PATTERNS

    p = subparsers.add_parser(
        "emulate", help="emulate LPDDR5-class DRAM timing for a traffic pattern",
        description="Emulate DRAM bank/burst timing (event-driven, Numba) and report bandwidth, "
                    "efficiency versus peak, row-buffer behaviour, bus utilisation and latency. "
                    "Presets: " + ", ".join(PRESETS))
    p.add_argument("--spec", default="lpddr5-6400", metavar="PRESET",
                   help="preset (default lpddr5-6400)")
    p.add_argument("--pattern", default=None, choices=PATTERNS, help="traffic (default rand)")
    p.add_argument("--granularity", default="64", metavar="G",
                   help="bytes per request, a multiple of the burst (default 64)")
    p.add_argument("--write-ratio", type=float, default=None, metavar="R",
                   help="fraction of writes in [0, 1] (default 0; 0.5 for mixed)")
    p.add_argument("--requests", default=None, metavar="N", help="requests (default 200000)")
    p.add_argument("--refresh", default="allbank", choices=("allbank", "perbank", "none"))
    p.add_argument("--mode", default=None, choices=("bg", "16b", "8b"),
                   help="LPDDR5 bank mode (default: the preset's)")
    p.add_argument("--bl", type=int, default=None, choices=(16, 32), help="LPDDR5 burst length")
    p.add_argument("--map", default="bg", choices=("bg", "rbc", "xor"),
                   help="address map: bank-group interleaving, row-bank-column, XOR hashing")
    p.add_argument("--queue", type=int, default=32, metavar="DEPTH",
                   help="controller queue entries per direction (default 32)")
    p.add_argument("--queue-unit", default="burst", choices=("burst", "access"),
                   help="what one queue entry holds: one burst (default, as gem5 and "
                        "Ramulator count) or one access, a request's bursts in one row (up "
                        "to 64 B with the bg and xor maps, a page with rbc)")
    p.add_argument("--write-high", type=float, default=0.8, metavar="F",
                   help="start draining writes above this fraction of the write queue "
                        "(default 0.8)")
    p.add_argument("--write-low", type=float, default=0.2, metavar="F",
                   help="stop draining writes below this fraction of the write queue "
                        "(default 0.2; 0 drains it empty)")
    p.add_argument("--scheduler", default="frfcfs", choices=("frfcfs", "fcfs"))
    p.add_argument("--channels", type=int, default=None, metavar="N",
                   help="channels (default: the preset's)")
    p.add_argument("--interleave", type=int, default=None, metavar="BYTES",
                   help="channel-interleave granule (default 256)")
    p.add_argument("--page-policy", default="open", choices=("open", "closed"))
    p.add_argument("--wck-always-on", action="store_true",
                   help="keep WCK running (no CAS sync commands)")
    p.add_argument("--footprint", default=None, metavar="BYTES",
                   help="address range of generated traffic (default: the whole device)")
    p.add_argument("--seed", type=int, default=None, help="random seed, >= 0 (default 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for multi-channel runs, >= 1 (default: all cores)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="text trace: one 'ADDRESS R|W [SIZE]' per line (replaces --pattern, "
                        "--requests, --footprint, --write-ratio and --seed)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _int(text: str, what: str) -> int:
    try:
        value = int(str(text).replace("_", ""), 0)
    except ValueError:
        raise BadArgument(f"{what} must be an integer, not {text!r}") from None
    if value <= 0:
        raise BadArgument(f"{what} must be positive, not {value}")
    return value


def _generated(a, names=tuple(GENERATED_DEFAULTS)) -> dict:
    """The generated traffic's options `names`, defaults filled in; BadArgument where one is
    given beside --trace."""
    defaults = {name: GENERATED_DEFAULTS[name] for name in names}
    given = argtypes.given(a, defaults)
    if a.trace is not None and given:
        raise BadArgument(f"--trace replaces the generated traffic: "
                          f"{argtypes.flag_names(given)} would do nothing beside it")
    return argtypes.with_defaults(a, defaults)


def _write_ratio(wr):
    if wr is not None and not 0.0 <= wr <= 1.0:         # NaN compares false: refused too
        raise BadArgument(f"--write-ratio must be in [0, 1], not {wr}")
    return wr


class _Progress:
    """How far a long run is, on stderr: a first line once the arguments are accepted, then the
    timing run's progress, one line updated in place on a terminal (each percent), otherwise one
    line per tenth of the accesses. `long_run` None: a trace file's run, long or not by the
    accesses it times (the first line then comes with the timing's start)."""

    def __init__(self, stream, spec: str, long_run: bool | None):
        self.stream = stream
        self.spec = spec
        self.long_run = long_run
        self.requests = 0
        self.tty = stream.isatty()
        self.shown = -1  # the last percent (terminal) or tenth (otherwise) shown

    def _announce(self) -> None:
        print(f"emulating {self.requests} requests on {self.spec} ...", file=self.stream,
              flush=True)

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage == "trace":
            self.requests = total
            if self.long_run:
                self._announce()
            return
        if self.long_run is None:
            self.long_run = total > PROGRESS_ACCESSES
            if self.long_run:
                self._announce()
        if not self.long_run:
            return
        percent = 100 * done // max(1, total)
        mark = percent if self.tty else percent // 10
        if mark > self.shown:
            self.shown = mark
            text = f"  timing: {percent} % of {total} accesses"
            if self.tty:
                print("\r" + text, end="", file=self.stream, flush=True)
            else:
                print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty and self.shown >= 0:
            print(file=self.stream, flush=True)


def run(args) -> int:
    d = compute(args)
    if args.json:
        print(jsonout.dumps(d))
        return 0
    return _print_table(d)


def compute(args) -> dict:
    """The JSON object of `odma-hw emulate` for parsed arguments (what --json prints)."""
    from odma_hw.emu import emulate

    g = _generated(args)
    granularity = _int(args.granularity, "--granularity")
    requests = _int(g["requests"], "--requests")
    footprint = _int(g["footprint"], "--footprint") if g["footprint"] is not None else None
    wr = _write_ratio(g["write_ratio"])
    long_run = None if args.trace is not None else requests * granularity > PROGRESS_BYTES
    progress = (_Progress(sys.stderr, args.spec, long_run)
                if long_run is not False and not args.json else None)
    try:
        stats = emulate(args.spec, g["pattern"], granularity, requests,
                        write_ratio=wr, refresh=args.refresh,
                        mode=args.mode, bl=args.bl, address_map_name=args.map,
                        queue=args.queue, queue_unit=args.queue_unit,
                        write_high=args.write_high, write_low=args.write_low,
                        channels=args.channels, page_policy=args.page_policy,
                        scheduler=args.scheduler, footprint=footprint, seed=g["seed"],
                        trace=args.trace, wck_always_on=args.wck_always_on,
                        interleave=args.interleave, threads=args.threads, progress=progress)
    finally:
        if progress is not None:
            progress.close()
    return {"schema": SCHEMA, **stats.as_dict()}


def _print_table(d: dict) -> int:
    rows = [
        ("preset", f"{d['preset']} ({d['device']})"),
        ("traffic", f"{d['pattern']}, {d['granularity']} B, {d['requests']} requests "
                    f"({d['reads']} reads, {d['writes']} writes), {d['accesses']} accesses"),
        ("simulated time", f"{d['simulated_ns'] / 1e3:.3f} us"),
        ("bandwidth", f"{d['bandwidth_gbps']:.2f} GB/s of {d['peak_gbps']:.2f} peak"),
        ("efficiency", f"{100 * d['efficiency']:.1f} %"),
        ("row hits/misses/conflicts", f"{d['row_hits']} / {d['row_misses']} / "
                                      f"{d['row_conflicts']} (hit rate {100 * d['row_hit_rate']:.1f} %)"),
        ("commands", ", ".join(f"{k} {v}" for k, v in d["commands"].items() if v)),
        ("data bus utilisation", f"{100 * d['data_bus_utilisation']:.1f} %"),
        ("command bus utilisation", f"{100 * d['ca_bus_utilisation']:.1f} %"),
        ("read latency", f"mean {d['read_latency_mean_ns']:.1f} ns, p99 {d['read_latency_p99_ns']:.1f} ns"),
        ("config", ", ".join(f"{k}={v}" for k, v in d["config"].items())),
        ("emulator speed", f"{d['wall_seconds']:.3f} s wall, "
                           f"{d['requests_per_second'] / 1e6:.2f} M requests/s"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def sweep_checks() -> list[ValueCheck]:
    """What compute() refuses before any work (see odma_cli/commands.py), each check reading
    only the options it needs, so that a grid's checks run per distinct value, not per cell."""
    from odma_hw.emu import model
    from odma_hw.emu.mapping import address_map
    from odma_hw.emu.specs import device_spec

    device_options = ("spec", "mode", "bl", "channels", "interleave")

    def device(a):
        return device_spec(a.spec, mode=a.mode, bl=a.bl, channels=a.channels,
                           interleave=a.interleave)

    def controller(a):
        model.controller_options(device(a), a.refresh, a.page_policy, a.scheduler, a.queue,
                                 a.wck_always_on, queue_unit=a.queue_unit,
                                 write_high=a.write_high, write_low=a.write_low)

    def traffic(a):
        dev = device(a)
        amap, granularity = address_map(dev, a.map), _int(a.granularity, "--granularity")
        g = _generated(a, ("pattern", "requests", "footprint"))
        if a.trace is not None:
            model.user_trace(dev, amap, a.trace, granularity)
            return
        footprint = None if g["footprint"] is None else _int(g["footprint"], "--footprint")
        model.check_generated(dev, amap, g["pattern"], granularity,
                              _int(g["requests"], "--requests"), footprint,
                              seed=0)        # the seed is checked on its own

    return [
        ValueCheck("spec", device_options, device),
        ValueCheck("queue", device_options + ("refresh", "page_policy", "scheduler", "queue",
                                              "wck_always_on", "queue_unit", "write_high",
                                              "write_low"), controller),
        ValueCheck("granularity", ("granularity",),
                   lambda a: _int(a.granularity, "--granularity")),
        ValueCheck("requests", ("requests",),
                   lambda a: a.requests is None or _int(a.requests, "--requests")),
        ValueCheck("footprint", ("footprint",),
                   lambda a: a.footprint is None or _int(a.footprint, "--footprint")),
        ValueCheck("seed", ("seed",), lambda a: a.seed is None or model.check_seed(a.seed)),
        ValueCheck("write-ratio", ("write_ratio",), lambda a: _write_ratio(a.write_ratio)),
        ValueCheck("threads", ("threads",), lambda a: model.check_threads(a.threads)),
        *(ValueCheck("trace", ("trace", name), functools.partial(_generated, names=(name,)))
          for name in GENERATED_DEFAULTS),
        ValueCheck("traffic", device_options + ("map", "pattern", "granularity", "requests",
                                                "footprint", "trace"), traffic)]
