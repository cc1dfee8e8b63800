"""`odma-hw emulate`: run the timing engine on a preset and print a table or JSON."""

from __future__ import annotations

import json
import sys

from odma_hw.errors import BadArgument

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
    p.add_argument("--pattern", default="rand", choices=PATTERNS, help="traffic (default rand)")
    p.add_argument("--granularity", default="64", metavar="G",
                   help="bytes per request, a multiple of the burst (default 64)")
    p.add_argument("--write-ratio", type=float, default=None, metavar="R",
                   help="fraction of writes in [0, 1] (default 0; 0.5 for mixed)")
    p.add_argument("--requests", default="200000", metavar="N", help="requests (default 200000)")
    p.add_argument("--refresh", default="allbank", choices=("allbank", "perbank", "none"))
    p.add_argument("--mode", default=None, choices=("bg", "16b", "8b"),
                   help="LPDDR5 bank mode (default: the preset's)")
    p.add_argument("--bl", type=int, default=None, choices=(16, 32), help="LPDDR5 burst length")
    p.add_argument("--map", default="bg", choices=("bg", "rbc", "xor"),
                   help="address map: bank-group interleaving, row-bank-column, XOR hashing")
    p.add_argument("--queue", type=int, default=32, metavar="DEPTH",
                   help="controller queue depth per direction (default 32)")
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
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="threads for multi-channel runs")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="text trace: one 'ADDRESS R|W [SIZE]' per line (replaces --pattern)")
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


def run(args) -> int:
    d = compute(args)
    if args.json:
        print(json.dumps(d))
        return 0
    return _print_table(d)


def compute(args) -> dict:
    """The JSON object of `odma-hw emulate` for parsed arguments (what --json prints)."""
    from odma_hw.emu import simulate

    granularity = _int(args.granularity, "--granularity")
    requests = _int(args.requests, "--requests")
    footprint = _int(args.footprint, "--footprint") if args.footprint is not None else None
    wr = args.write_ratio
    if wr is not None and not 0.0 <= wr <= 1.0:
        raise BadArgument(f"--write-ratio must be in [0, 1], not {wr}")
    if args.channels is not None and args.channels < 1:
        raise BadArgument(f"--channels must be positive, not {args.channels}")
    if requests > 2_000_000 and not args.json:
        print(f"emulating {requests} requests on {args.spec} ...", file=sys.stderr, flush=True)
    stats = simulate(args.spec, args.pattern, granularity, requests,
                     write_ratio=0.0 if wr is None else wr, refresh=args.refresh, mode=args.mode,
                     bl=args.bl, address_map_name=args.map, queue=args.queue,
                     channels=args.channels, page_policy=args.page_policy,
                     scheduler=args.scheduler, footprint=footprint, seed=args.seed,
                     trace=args.trace, wck_always_on=args.wck_always_on,
                     interleave=args.interleave, threads=args.threads)
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
