"""`simulate()`: trace -> address map -> timing engine over N channels -> statistics."""

from __future__ import annotations

import dataclasses
import math
import time

import numba
import numpy as np

from odma_hw.emu import engine as E
from odma_hw.emu.mapping import address_map, decompose
from odma_hw.emu.specs import DeviceSpec, derive, device_spec
from odma_hw.emu.traces import PATTERNS, Trace, generate, read_trace_file
from odma_hw.errors import BadArgument

REFRESH = {"allbank": E.REF_ALLBANK, "perbank": E.REF_PERBANK, "none": E.REF_NONE}
PAGE = {"open": E.PAGE_OPEN, "closed": E.PAGE_CLOSED}
SCHEDULERS = {"frfcfs": E.SCHED_FRFCFS, "fcfs": E.SCHED_FCFS}


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


def _options(dev: DeviceSpec, refresh: str, page_policy: str, scheduler: str, queue: int,
             wck_always_on: bool) -> np.ndarray:
    if refresh not in REFRESH:
        raise BadArgument(f"unknown refresh mode {refresh!r}: expected allbank, perbank or none")
    if refresh == "perbank" and derive(dev.channel).nRFCpb == 0:
        raise BadArgument(f"{dev.name} has no per-bank refresh in this model: use allbank or none")
    if page_policy not in PAGE:
        raise BadArgument(f"unknown page policy {page_policy!r}: expected open or closed")
    if scheduler not in SCHEDULERS:
        raise BadArgument(f"unknown scheduler {scheduler!r}: expected frfcfs or fcfs")
    if not isinstance(queue, (int, np.integer)) or not 1 <= queue <= 4096:
        raise BadArgument(f"queue depth must be an integer in [1, 4096], not {queue!r}")
    # write draining: start at 80 % of the write queue, stop at 20 % (DRAMSys/Ramulator habit)
    high = max(1, math.ceil(0.8 * queue))
    low = min(high - 1, int(0.2 * queue))
    return E.options(REFRESH[refresh], PAGE[page_policy], SCHEDULERS[scheduler], queue, high,
                     low, wck_always_on)


def simulate(spec: str = "lpddr5-6400", pattern: str = "rand", granularity: int = 64,
             requests: int = 100_000, *, write_ratio: float = 0.0, refresh: str = "allbank",
             mode: str | None = None, bl: int | None = None, address_map_name: str = "bg",
             queue: int = 32, channels: int | None = None, page_policy: str = "open",
             scheduler: str = "frfcfs", footprint: int | None = None, seed: int = 1,
             trace: Trace | str | None = None, wck_always_on: bool = False,
             interleave: int | None = None, threads: int | None = None, record: int = 0,
             **pattern_args) -> EmuStats:
    """Emulate `requests` requests of `pattern` (see traces.PATTERNS) at `granularity` bytes, or a
    user `trace` (a Trace or the path of a text trace), on preset `spec`.

    record > 0 keeps up to `record` commands of channel 0 in `.log` for the checker.
    """
    dev = device_spec(spec, mode=mode, bl=bl, channels=channels, interleave=interleave)
    ch = dev.channel
    burst = ch.burst_bytes
    amap = address_map(dev, address_map_name)
    opt = _options(dev, refresh, page_policy, scheduler, queue, wck_always_on)
    if trace is None:
        if pattern not in PATTERNS:
            raise BadArgument(f"unknown pattern {pattern!r}: expected one of {', '.join(PATTERNS)}")
        fp = dev.total_bytes if footprint is None else int(footprint)
        if fp > dev.total_bytes or fp <= 0:
            raise BadArgument(f"footprint {fp} must be in (0, {dev.total_bytes}] bytes")
        tr = generate(pattern, requests, granularity, footprint=fp, burst=burst,
                      write_ratio=write_ratio, seed=seed, **pattern_args)
    elif isinstance(trace, str):
        if not isinstance(granularity, int) or granularity < burst or granularity % burst:
            raise BadArgument(f"granularity {granularity} is not a multiple of the {burst}-byte burst")
        tr = read_trace_file(trace, granule=granularity, burst=burst, device_bytes=dev.total_bytes)
        pattern = "trace"
    else:
        tr = trace
        pattern = "trace"
        if len(tr) and int((tr.addr + tr.size).max()) > dev.total_bytes:
            raise BadArgument(f"trace addresses go beyond the {dev.total_bytes}-byte device")

    tp = E.pack(derive(ch))
    if threads is not None:
        numba.set_num_threads(max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS)))
    t0 = time.perf_counter()
    offsets, bank, row, bursts, wr = decompose(amap, tr.addr, tr.size, tr.write)
    stats = np.zeros((dev.channels, E.N_S), np.int64)
    hist = np.zeros((dev.channels, E.HIST_BINS), np.int64)
    log = None
    if record > 0:
        log = np.zeros((int(record), E.LOG_COLS), np.int64)
        empty = np.zeros((0, E.LOG_COLS), np.int64)
        for c in range(dev.channels):
            lo, hi = offsets[c], offsets[c + 1]
            E.run_channel(tp, opt, bank[lo:hi], row[lo:hi], bursts[lo:hi], wr[lo:hi],
                          stats[c], hist[c], log if c == 0 else empty)
        log = log[: stats[0, E.S_LOGGED]]
    elif dev.channels == 1:
        E.run_channel(tp, opt, bank, row, bursts, wr, stats[0], hist[0],
                      np.zeros((0, E.LOG_COLS), np.int64))
    else:
        E.run_channels(tp, opt, offsets, bank, row, bursts, wr, stats, hist)
    wall = time.perf_counter() - t0
    return _summarise(dev, tr, pattern, granularity, int(bank.shape[0]), stats, hist, wall, log,
                      dict(refresh=refresh, mode=ch.mode or None, bl=ch.org.burst_length,
                           map=address_map_name, queue=int(queue), page_policy=page_policy,
                           scheduler=scheduler, write_ratio=write_ratio,
                           wck_always_on=wck_always_on, interleave=dev.interleave_bytes,
                           seed=seed))


def _summarise(dev, tr, pattern, granularity, accesses, stats, hist, wall, log, config) -> EmuStats:
    ch = dev.channel
    d = derive(ch)
    tck = ch.timings.tCK_ns
    tot = stats.sum(axis=0)
    end_ck = int(stats[:, E.S_END].max())
    sim_ns = end_ck * tck
    nbytes = tr.bytes
    bw = nbytes / sim_ns if sim_ns > 0 else 0.0
    busy_ck = end_ck * dev.channels
    h = hist.sum(axis=0)
    nlat = int(h.sum())
    p99 = float(np.searchsorted(np.cumsum(h), math.ceil(0.99 * nlat)) * tck) if nlat else 0.0
    buses = 2 if d.split_row_col else 1
    reads = int(tr.write.size - int(tr.write.sum()))
    cmds = {"act": int(tot[E.S_ACT]), "pre": int(tot[E.S_PRE]), "rd": int(tot[E.S_RD]),
            "wr": int(tot[E.S_WR]), "cas": int(tot[E.S_CAS]), "auto_pre": int(tot[E.S_AUTOPRE]),
            "preab": int(tot[E.S_PREAB]), "refab": int(tot[E.S_REFAB]),
            "refpb": int(tot[E.S_REFPB])}
    hits, miss, conf = int(tot[E.S_HIT]), int(tot[E.S_MISS]), int(tot[E.S_CONFLICT])
    return EmuStats(
        preset=dev.name, device=ch.name + (f" x {dev.channels} channels" if dev.channels > 1 else ""),
        channels=dev.channels, pattern=pattern, granularity=int(granularity), requests=len(tr),
        accesses=accesses, reads=reads, writes=len(tr) - reads, bytes=nbytes,
        simulated_ns=sim_ns, bandwidth_gbps=bw, peak_gbps=dev.peak_gbps,
        efficiency=bw / dev.peak_gbps if sim_ns > 0 else 0.0,
        row_hits=hits, row_misses=miss, row_conflicts=conf,
        row_hit_rate=hits / max(1, hits + miss + conf), commands=cmds,
        data_bus_utilisation=(cmds["rd"] + cmds["wr"]) * d.nBL / busy_ck if busy_ck else 0.0,
        ca_bus_utilisation=int(tot[E.S_CA_BUSY]) / (busy_ck * buses) if busy_ck else 0.0,
        read_latency_mean_ns=(tot[E.S_LAT_SUM] / tot[E.S_LAT_N] * tck) if tot[E.S_LAT_N] else 0.0,
        read_latency_p99_ns=p99, wall_seconds=wall,
        requests_per_second=len(tr) / wall if wall > 0 else 0.0, config=config, log=log)
