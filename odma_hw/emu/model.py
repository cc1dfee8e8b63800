"""`emulate()`: trace -> address map -> timing engine over N channels -> statistics."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from fractions import Fraction

import numba
import numpy as np

from odma_cli.errors import BadArgument
from odma_hw.emu import state, timing_loop
from odma_hw.emu.mapping import address_map, decompose, max_accesses, segment_bytes
from odma_hw.emu.specs import DeviceSpec, derive, device_spec
from odma_hw.emu.traces import (PATTERNS, Trace, check_shape, default_write_ratio, generate,
                                read_trace_file)

REFRESH = {"allbank": state.REF_ALLBANK, "perbank": state.REF_PERBANK, "none": state.REF_NONE}
PAGE = {"open": state.PAGE_OPEN, "closed": state.PAGE_CLOSED}
SCHEDULERS = {"frfcfs": state.SCHED_FRFCFS, "fcfs": state.SCHED_FCFS}
# EmuStats.commands: engine command counts, in the order the CLI prints them
_COMMAND_STATS = ("act", "pre", "rd", "wr", "cas", "auto_pre", "preab", "refab", "refpb")


@dataclasses.dataclass
class EmuStats:
    """What one emulation produced. Times in ns, bandwidth in GB/s (1e9 B/s)."""

    preset: str
    device: str
    channels: int
    pattern: str
    granularity: int
    requests: int
    accesses: int
    reads: int
    writes: int
    bytes: int
    simulated_ns: float
    bandwidth_gbps: float
    peak_gbps: float
    efficiency: float
    row_hits: int
    row_misses: int
    row_conflicts: int
    row_hit_rate: float
    commands: dict
    data_bus_utilisation: float
    ca_bus_utilisation: float
    read_latency_mean_ns: float
    read_latency_p99_ns: float
    wall_seconds: float
    requests_per_second: float
    config: dict
    log: np.ndarray | None = None  # recorded command stream of channel 0 (record > 0)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("log")
        return d


QUEUE_UNITS = {"burst": state.QUEUE_BURSTS, "access": state.QUEUE_ACCESSES}

# Memory a run needs, per request and per access: a generator's peak (addresses, sizes and write
# flags with their temporaries; kvscan's is the highest, 41 B), what a trace keeps (8 + 8 + 1)
# and the decomposition's access arrays (bank, row, bursts as int32, write as uint8).
_GENERATOR_BYTES = 48
_TRACE_BYTES = 17
_ACCESS_BYTES = 13


def controller_options(dev: DeviceSpec, refresh: str, page_policy: str, scheduler: str,
                       queue: int, wck_always_on: bool, *, queue_unit: str = "burst",
                       write_high: float = 0.8, write_low: float = 0.2) -> np.ndarray:
    """The controller's options as the timing loop takes them, every one checked: BadArgument
    otherwise."""
    if refresh not in REFRESH:
        raise BadArgument(f"unknown refresh mode {refresh!r}: expected allbank, perbank or none")
    if refresh == "perbank" and derive(dev.channel).nRFCpb == 0:
        raise BadArgument(f"{dev.name} has no per-bank refresh in this model: use allbank or none")
    if wck_always_on and not derive(dev.channel).cas_sync:
        raise BadArgument(f"WCK always on applies to LPDDR5 presets only (their WCK2CK sync), "
                          f"not {dev.name}")
    if page_policy not in PAGE:
        raise BadArgument(f"unknown page policy {page_policy!r}: expected open or closed")
    if scheduler not in SCHEDULERS:
        raise BadArgument(f"unknown scheduler {scheduler!r}: expected frfcfs or fcfs")
    if not _is_int(queue) or not 1 <= queue <= 4096:
        raise BadArgument(f"queue depth must be an integer in [1, 4096], not {queue!r}")
    if queue_unit not in QUEUE_UNITS:
        raise BadArgument(f"unknown queue unit {queue_unit!r}: expected burst or access")
    for name, x in (("write high watermark", write_high), ("write low watermark", write_low)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0.0 <= x <= 1.0:
            raise BadArgument(f"{name} must be a fraction of the write queue in [0, 1], not {x!r}")
    if not write_low < write_high:
        raise BadArgument(f"write low watermark {write_low} must be below the high watermark "
                          f"{write_high}")
    # Write draining starts when the write queue holds more than write_high x depth entries and
    # stops when it holds fewer than write_low x depth (Ramulator's and DRAMSys's convention);
    # the engine compares counts: >= high entries, <= low entries.
    high = math.floor(Fraction(str(write_high)) * queue) + 1
    low = math.ceil(Fraction(str(write_low)) * queue) - 1
    return state.options(REFRESH[refresh], PAGE[page_policy], SCHEDULERS[scheduler], queue,
                         high, low, wck_always_on, QUEUE_UNITS[queue_unit])


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_memory(what: str, accesses: int, peak_bytes: int) -> None:
    """Refuse, before any work, a run whose trace and decomposition cannot fit in memory."""
    from odma_hw.devices import host

    available = host.mem_available()
    if peak_bytes > 0.9 * available:
        raise BadArgument(
            f"{what} need about {peak_bytes / 1e9:,.1f} GB of memory for the trace and its up to "
            f"{accesses} accesses; {available / 1e9:,.1f} GB is available: use fewer requests or "
            f"a smaller granularity")


def emulate(spec: str = "lpddr5-6400", pattern: str = "rand", granularity: int = 64,
            requests: int = 100_000, *, write_ratio: float | None = None,
            refresh: str = "allbank",
            mode: str | None = None, bl: int | None = None, address_map_name: str = "bg",
            queue: int = 32, queue_unit: str = "burst", write_high: float = 0.8,
            write_low: float = 0.2, channels: int | None = None, page_policy: str = "open",
            scheduler: str = "frfcfs", footprint: int | None = None, seed: int = 1,
            trace: Trace | str | None = None, wck_always_on: bool = False,
            interleave: int | None = None, threads: int | None = None, record: int = 0,
            progress=None, **pattern_args) -> EmuStats:
    """Emulate `requests` requests of `pattern` (see traces.PATTERNS) at `granularity` bytes, or a
    user `trace` (a Trace or the path of a text trace), on preset `spec`; write_ratio: the
    share of a generated trace's writes (None: half for "mixed", else none).

    queue: entries per direction, each holding one burst (`queue_unit="burst"`, as gem5 and
    Ramulator count, so that the bytes a queue holds do not depend on the address map) or one
    access of up to a column chunk (`"access"`). Writes are drained from more than
    `write_high` x queue queued write entries down to fewer than `write_low` x queue (0: until
    the write queue is empty).
    record > 0 keeps up to `record` commands of channel 0 in `.log` for the checker.
    Everything is validated, and the memory the run needs checked, before any work starts;
    then progress("trace", 0, requests) is called once, and progress("timing", admitted
    accesses, total accesses) between slices of the timing run.
    """
    dev = device_spec(spec, mode=mode, bl=bl, channels=channels, interleave=interleave)
    ch = dev.channel
    amap = address_map(dev, address_map_name)
    opt = controller_options(dev, refresh, page_policy, scheduler, queue, wck_always_on,
                   queue_unit=queue_unit, write_high=write_high, write_low=write_low)
    check_threads(threads)
    if not _is_int(record) or record < 0:
        raise BadArgument(f"record must be a non-negative integer, not {record!r}")
    if trace is None:
        write_ratio = default_write_ratio(pattern, write_ratio)
        tr = _generated_trace(dev, amap, pattern, granularity, requests, footprint, seed,
                              write_ratio, progress, pattern_args)
    else:
        tr = user_trace(dev, amap, trace, granularity, progress)
        pattern = "trace"

    tp = state.pack(derive(ch))
    if threads is not None:
        numba.set_num_threads(min(int(threads), numba.config.NUMBA_NUM_THREADS))
    t0 = time.perf_counter()
    offsets, bank, row, bursts, wr = decompose(amap, tr.addr, tr.size, tr.write)
    stats = np.zeros((dev.channels, state.N_S), np.int64)
    hist = np.zeros((dev.channels, state.HIST_BINS), np.int64)
    log = np.zeros((int(record), state.LOG_COLS), np.int64) if record > 0 else None
    timing = None if progress is None else functools.partial(progress, "timing")
    timing_loop.run(tp, opt, offsets, bank, row, bursts, wr, stats, hist, log, progress=timing)
    if log is not None:
        log = log[: stats[0, state.S.logged]]
    wall = time.perf_counter() - t0
    return _summarise(dev, tr, pattern, granularity, int(bank.shape[0]), stats, hist, wall, log,
                      dict(refresh=refresh, mode=ch.mode or None, bl=ch.org.burst_length,
                           map=address_map_name, queue=int(queue), queue_unit=queue_unit,
                           write_high=write_high, write_low=write_low, page_policy=page_policy,
                           scheduler=scheduler, write_ratio=write_ratio,
                           wck_always_on=wck_always_on, interleave=dev.interleave_bytes,
                           seed=seed))


def check_threads(threads) -> None:
    if threads is not None and (not _is_int(threads) or threads < 1):
        raise BadArgument(f"threads must be a positive integer, not {threads!r}")


def check_seed(seed) -> None:
    if not _is_int(seed) or seed < 0:
        raise BadArgument(f"seed must be a non-negative integer, not {seed!r}")


def check_generated(dev, amap, pattern, granularity, requests, footprint, seed) -> tuple:
    """(requests, footprint in bytes) of a generated trace of `pattern`, every argument and the
    memory its run needs checked: BadArgument otherwise."""
    burst = dev.channel.burst_bytes
    if pattern not in PATTERNS:
        raise BadArgument(f"unknown pattern {pattern!r}: expected one of {', '.join(PATTERNS)}")
    check_seed(seed)
    fp = dev.total_bytes if footprint is None else int(footprint)
    if fp > dev.total_bytes or fp <= 0:
        raise BadArgument(f"footprint {fp} must be in (0, {dev.total_bytes}] bytes")
    check_shape(requests, granularity, fp, burst)
    n = int(requests)
    accesses = n * max_accesses(amap, int(granularity), aligned=True)
    _check_memory(f"{n} requests of {granularity} B", accesses,
                  max(_GENERATOR_BYTES * n, _TRACE_BYTES * n + _ACCESS_BYTES * accesses))
    return n, fp


def _generated_trace(dev, amap, pattern, granularity, requests, footprint, seed, write_ratio,
                     progress, pattern_args) -> Trace:
    """The trace of `requests` requests of `pattern` that emulate() runs (check_generated's
    checks first)."""
    n, fp = check_generated(dev, amap, pattern, granularity, requests, footprint, seed)
    if progress is not None:
        progress("trace", 0, n)
    return generate(pattern, n, granularity, footprint=fp, burst=dev.channel.burst_bytes,
                    write_ratio=write_ratio, seed=seed, **pattern_args)


def user_trace(dev, amap, trace, granularity, progress=None) -> Trace:
    """A user's trace (a Trace or the path of a text trace) as emulate() runs it, checked
    against the device and the memory it needs first."""
    burst = dev.channel.burst_bytes
    if isinstance(trace, str):
        if not _is_int(granularity) or granularity < burst or granularity % burst:
            raise BadArgument(f"granularity {granularity} is not a multiple of the "
                              f"{burst}-byte burst")
        tr = read_trace_file(trace, granule=granularity, burst=burst,
                             device_bytes=dev.total_bytes)
    else:
        tr = trace
        if len(tr) and int((tr.addr + tr.size).max()) > dev.total_bytes:
            raise BadArgument(f"trace addresses go beyond the {dev.total_bytes}-byte device")
    seg = segment_bytes(amap)
    accesses = int((-(-tr.size // seg) + 1).sum())
    _check_memory(f"the trace's {len(tr)} requests", accesses,
                  _ACCESS_BYTES * accesses)
    if progress is not None:
        progress("trace", 0, len(tr))
    return tr


def _summarise(dev, tr, pattern, granularity, accesses, stats, hist, wall, log, config) -> EmuStats:
    ch = dev.channel
    d = derive(ch)
    tck = ch.timings.tCK_ns
    tot = stats.sum(axis=0)
    end_ck = int(stats[:, state.S.end].max())
    sim_ns = end_ck * tck
    nbytes = tr.bytes
    bw = nbytes / sim_ns if sim_ns > 0 else 0.0
    busy_ck = end_ck * dev.channels
    h = hist.sum(axis=0)
    nlat = int(h.sum())
    p99 = float(np.searchsorted(np.cumsum(h), math.ceil(0.99 * nlat)) * tck) if nlat else 0.0
    buses = 2 if d.split_row_col else 1
    reads = int(tr.write.size - int(tr.write.sum()))
    cmds = {name: int(tot[getattr(state.S, name)]) for name in _COMMAND_STATS}
    hits, miss, conf = int(tot[state.S.hit]), int(tot[state.S.miss]), int(tot[state.S.conflict])
    return EmuStats(
        preset=dev.name, device=ch.name + (f" x {dev.channels} channels" if dev.channels > 1 else ""),
        channels=dev.channels, pattern=pattern, granularity=int(granularity), requests=len(tr),
        accesses=accesses, reads=reads, writes=len(tr) - reads, bytes=nbytes,
        simulated_ns=sim_ns, bandwidth_gbps=bw, peak_gbps=dev.peak_gbps,
        efficiency=bw / dev.peak_gbps if sim_ns > 0 else 0.0,
        row_hits=hits, row_misses=miss, row_conflicts=conf,
        row_hit_rate=hits / max(1, hits + miss + conf), commands=cmds,
        data_bus_utilisation=(cmds["rd"] + cmds["wr"]) * d.nBL / busy_ck if busy_ck else 0.0,
        ca_bus_utilisation=int(tot[state.S.ca_busy]) / (busy_ck * buses) if busy_ck else 0.0,
        read_latency_mean_ns=((tot[state.S.lat_sum] / tot[state.S.lat_n] * tck)
                              if tot[state.S.lat_n] else 0.0),
        read_latency_p99_ns=p99, wall_seconds=wall,
        requests_per_second=len(tr) / wall if wall > 0 else 0.0, config=config, log=log)
