"""Memory timing sources: how fast a card reads its KV and weights, by the size of the contiguous
runs the reads come in.

Every source answers the same three questions, in GB/s (1e9 B/s) of one card:
- run_gbps(S): sustained bandwidth of reads that come as contiguous runs of S bytes, each at a
  random place (a paged KV cache: runs of a page; a contiguous block: runs of a whole context);
- seq_gbps: one long stream (weights);
- copy_gbps: a streaming copy, counting read + write (a migration).

Sources:
- EmuTiming ("emu:PRESET"): the LPDDR5/HBM timing emulator, as efficiencies (fraction of the
  emulated device's peak) times the simulated card's bandwidth. Efficiencies are computed once
  per point of a half-octave grid of run sizes (256 B .. 4 MiB; a longer run is as efficient as
  a 4 MiB one), on first use, and cached in memory and on disk (ODMA_CACHE_DIR, default
  ~/.cache/odma-hw), never per step.
- ProbeTiming ("probe:FILE"): the measured bandwidths of a real device from `odma-hw probe
  --json`: random reads by granule up to the largest granule probed; beyond it each run costs a
  fixed start-up (fitted at the largest granule) plus streaming at the sequential bandwidth.
- LiveTiming ("live:torch:DEVICE"): run reads measured now on a torch device.
- IdealTiming ("ideal"): every read, of any run size, at the card's full bandwidth: the bound
  no layout beats, under which contiguity is worth nothing.

How concurrent reads interleave at the memory controller decides how much contiguity is worth,
so it is a stated knob of EmuTiming: by default (streams=1) runs reach the controller one after
another, each in order, in 64 B requests, with the controller's queue supplying the parallelism
(the model a DMA engine that streams one run at a time fits). With streams=N, N runs are in
flight at once and the controller sees chunk_bytes of one, then of a random other; with many
streams at fine chunks, a long run is no better than random 64 B reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import tempfile
import threading

import numpy as np

from odma_cli import docfile
from odma_cli.errors import BadArgument

from allocator.serving.cards import datafile

GRID_MIN_LOG2, GRID_MAX_LOG2 = 8, 22         # 256 B .. 4 MiB
GRID_LOG2 = np.arange(2 * GRID_MIN_LOG2, 2 * GRID_MAX_LOG2 + 1) / 2.0   # half octaves
REQUEST_BYTES = 64                            # what reaches the controller per request
MIN_TRACE_BYTES = 8 << 20                     # bytes simulated per grid point (steady state)
MAX_TRACE_BYTES = 32 << 20                    # a stream over a coarser interleave stays in
                                              # fewer channels at once, which this already shows
MAX_STREAMS = 1 << 16
CACHE_VERSION = 2


def _interp_log2(sizes_log2: np.ndarray, values: np.ndarray, run_bytes) -> np.ndarray:
    x = np.log2(np.maximum(np.asarray(run_bytes, dtype=np.float64), 1.0))
    return np.interp(x, sizes_log2, values)


def rate_table(table):
    """run_gbps(run_bytes) of a table ((bytes, GB/s), ...): interpolated in log2 of the run
    size, the nearest end's rate beyond the table (a card's engine_run_gbps)."""
    x = np.log2(np.array([b for b, _ in table], dtype=np.float64))
    y = np.array([g for _, g in table], dtype=np.float64)
    return lambda run_bytes: _interp_log2(x, y, run_bytes)


class MemoryTiming:
    """Base of the timing sources; subclasses fill a table of (log2 run size, GB/s)."""

    source = "?"
    seq_gbps: float
    copy_gbps: float
    peak_gbps: float    # no read is faster: the physical floor of a step is bytes / this

    def run_gbps(self, run_bytes) -> np.ndarray:
        raise NotImplementedError

    def describe(self) -> dict:
        """What to print beside results: the source and the numbers it gives."""
        sizes = [4096, 16384, 65536, 1 << 20]
        return {"source": self.source, "seq_gbps": self.seq_gbps, "copy_gbps": self.copy_gbps,
                "run_gbps": {str(s): float(g) for s, g in zip(sizes, self.run_gbps(sizes))}}


# ------------------------------------------------------------------------------ the emulator
def cache_dir() -> pathlib.Path:
    base = os.environ.get("ODMA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "odma-hw")
    return pathlib.Path(base)


def _emulator_fingerprint() -> str:
    """A hash of the emulator's source, so cached efficiencies die with the model they came
    from."""
    import odma_hw.emu as emu

    h = hashlib.sha1()
    for path in sorted(pathlib.Path(emu.__file__).parent.glob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def run_trace(total_bytes: int, run_bytes: int, footprint: int, *, streams: int = 1,
              chunk_bytes: int | None = None, align: int = 256, seed: int = 1):
    """An emulator trace of random runs of `run_bytes` at random `align`-aligned places in
    [0, footprint), read in REQUEST_BYTES requests: ceil(total / run) whole runs one after
    another, or (streams > 1) a window of total_bytes of the steady state of that many runs in
    flight, the controller seeing chunk_bytes of one stream, then of a random other, each
    stream's chunks in order. The window, not the runs, sets the size, so the trace stays
    total_bytes long however many streams there are."""
    from odma_hw.emu.traces import Trace

    rng = np.random.default_rng(seed)
    run_bytes = max(REQUEST_BYTES, run_bytes // REQUEST_BYTES * REQUEST_BYTES)
    chunk = run_bytes if streams == 1 else min(run_bytes, max(REQUEST_BYTES, chunk_bytes or
                                                              REQUEST_BYTES))
    chunk = chunk // REQUEST_BYTES * REQUEST_BYTES
    per_run = -(-run_bytes // chunk)
    if streams == 1:
        n_runs = -(-total_bytes // run_bytes)
        chunk_run = np.repeat(np.arange(n_runs), per_run)
        chunk_idx = np.tile(np.arange(per_run), n_runs)
    else:
        stream = rng.integers(0, streams, max(1, -(-total_bytes // chunk)))
        counts = np.bincount(stream, minlength=streams)
        order = np.argsort(stream, kind="stable")
        k = np.empty_like(order)                               # chunk number within its stream
        k[order] = np.arange(order.size) - np.repeat(np.cumsum(counts) - counts, counts)
        runs = -(-counts // per_run)                           # runs each stream touches
        chunk_run = (np.cumsum(runs) - runs)[stream] + k // per_run
        chunk_idx = k % per_run
        n_runs = int(runs.sum())
    starts = rng.integers(0, max(1, (footprint - run_bytes) // align), n_runs) * align
    offs = chunk_idx * chunk
    lens = np.minimum(chunk, run_bytes - offs)
    per_req = lens // REQUEST_BYTES
    base = np.repeat(starts[chunk_run] + offs, per_req)
    within = np.arange(base.size) - np.repeat(np.cumsum(per_req) - per_req, per_req)
    addr = base + within * REQUEST_BYTES
    return Trace(addr.astype(np.int64), np.full(addr.size, REQUEST_BYTES, np.int64),
                 np.zeros(addr.size, np.uint8))


@dataclasses.dataclass(frozen=True)
class EmuSettings:
    """The emulated memory and how reads reach it; every field is part of the cache key."""

    preset: str = "mlu370-x4"
    channels: int | None = None
    interleave: int | None = None
    address_map: str = "bg"
    queue: int = 32
    refresh: str = "allbank"
    streams: int = 1
    chunk_bytes: int | None = None
    footprint: int = 4 << 30
    seed: int = 1


class EmuTiming(MemoryTiming):
    """Emulated efficiencies x the card's bandwidth (see the module docstring)."""

    def __init__(self, bandwidth_gbps: float, settings: EmuSettings = EmuSettings()):
        self.settings = s = settings
        self.bandwidth_gbps = float(bandwidth_gbps)
        self.dev = check_emu(s)
        self.footprint = min(s.footprint, self.dev.total_bytes)
        self.source = f"emu:{s.preset}"
        key = json.dumps(dataclasses.asdict(s), sort_keys=True)
        self._key = hashlib.sha1(f"{CACHE_VERSION}|{_emulator_fingerprint()}|{key}".encode()
                                 ).hexdigest()[:16]
        self._path = cache_dir() / f"efficiency-{self._key}.json"
        self._lock = threading.Lock()
        self._eff: dict[str, float] = self._load()
        self._table = np.full(len(GRID_LOG2), np.nan)
        self.seq_efficiency = self._point("seq", self._emulate_seq)
        self.copy_efficiency = self._point("copy", self._simulate_copy)
        self.seq_gbps = self.bandwidth_gbps * self.seq_efficiency
        self.copy_gbps = self.bandwidth_gbps * self.copy_efficiency
        self.peak_gbps = self.bandwidth_gbps

    # -- the on-disk cache ------------------------------------------------------------------
    def _load(self) -> dict:
        try:
            with open(self._path) as f:
                data = json.load(f)
            return {k: float(v) for k, v in data.get("efficiency", {}).items()}
        except (OSError, ValueError, AttributeError):
            return {}

    def _save(self) -> None:
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self._path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"settings": dataclasses.asdict(self.settings),
                           "efficiency": self._eff}, f)
            os.replace(tmp, self._path)
        except OSError:
            pass  # an unwritable cache only costs recomputation

    def _point(self, name: str, compute) -> float:
        with self._lock:
            if name not in self._eff:
                self._eff[name] = float(compute())
                self._save()
            return self._eff[name]

    # -- the emulator runs --------------------------------------------------------------------
    def _emulate(self, trace) -> float:
        from odma_hw.emu import emulate

        s = self.settings
        st = emulate(s.preset, trace=trace, granularity=REQUEST_BYTES, channels=s.channels,
                     interleave=s.interleave, address_map_name=s.address_map, queue=s.queue,
                     refresh=s.refresh)
        return min(1.0, st.efficiency)

    def _emulate_seq(self) -> float:
        total = min(MAX_TRACE_BYTES,
                    max(MIN_TRACE_BYTES, 64 * self.dev.channels * self.dev.interleave_bytes))
        return self._emulate(run_trace(total, total, self.footprint, seed=self.settings.seed))

    def _simulate_copy(self) -> float:
        """A streaming copy: tiles of 1 KiB read, then written elsewhere."""
        from odma_hw.emu.traces import Trace

        n = MIN_TRACE_BYTES // 2
        offs = np.arange(0, n, REQUEST_BYTES, dtype=np.int64)
        tile = (offs // 1024) * 2
        order = np.argsort(np.concatenate([tile, tile + 1]), kind="stable")
        addr = np.concatenate([offs, self.footprint // 2 + offs])[order]
        write = np.repeat(np.array([0, 1], np.uint8), offs.size)[order]
        return self._emulate(Trace(addr, np.full(addr.size, REQUEST_BYTES, np.int64), write))

    def _grid_efficiency(self, i: int) -> float:
        size = int(round(2 ** GRID_LOG2[i]))
        size = max(REQUEST_BYTES, size // REQUEST_BYTES * REQUEST_BYTES)
        s = self.settings

        def compute():
            total = max(MIN_TRACE_BYTES, 4 * size)
            return self._emulate(run_trace(total, size, self.footprint, streams=s.streams,
                                            chunk_bytes=s.chunk_bytes, seed=s.seed))
        return self._point(f"run:{size}", compute)

    def _efficiency_at(self, x):
        """Efficiency at log2(run bytes) = x (a number or an array), interpolated between the
        two grid points around each value (each point computed on first use)."""
        pos = (np.clip(x, GRID_MIN_LOG2, GRID_MAX_LOG2) - GRID_MIN_LOG2) * 2
        lo = np.minimum(np.asarray(pos).astype(np.int64), len(GRID_LOG2) - 2)
        w = pos - lo
        table = self._table
        for i in np.unique([lo, lo + 1]):
            if table[i] != table[i]:                  # NaN: not computed yet
                table[i] = self._grid_efficiency(int(i))
        return table[lo] * (1 - w) + table[lo + 1] * w

    def run_efficiency(self, run_bytes):
        """Efficiency (fraction of peak) of runs of `run_bytes` (a number or an array)."""
        if np.ndim(run_bytes) == 0:
            return float(self._efficiency_at(math.log2(max(float(run_bytes), 1.0))))
        return self._efficiency_at(np.log2(np.maximum(np.asarray(run_bytes, dtype=np.float64),
                                                      1.0)))

    def run_gbps(self, run_bytes) -> np.ndarray:
        return self.bandwidth_gbps * self.run_efficiency(run_bytes)

    def describe(self) -> dict:
        d = super().describe()
        d.update(settings=dataclasses.asdict(self.settings), seq_efficiency=self.seq_efficiency,
                 copy_efficiency=self.copy_efficiency, card_bandwidth_gbps=self.bandwidth_gbps,
                 run_efficiency={k: v / self.bandwidth_gbps for k, v in d["run_gbps"].items()})
        return d


# ------------------------------------------------------------------------- measured tables
class MeasuredTiming(MemoryTiming):
    """Measured bandwidths: GB/s of random runs at some sizes, sequential and copy GB/s. Runs
    longer than the longest measured size cost a fixed start-up (fitted there) plus streaming."""

    def __init__(self, source: str, runs_gbps: dict, seq_gbps: float, copy_gbps: float):
        sizes = sorted(int(s) for s in runs_gbps)
        if not sizes or not all(runs_gbps[s] > 0 for s in runs_gbps) or not seq_gbps > 0:
            raise BadArgument(f"{source}: needs positive bandwidths for at least one run size "
                              f"and for sequential reads")
        self.source = source
        self.seq_gbps = float(seq_gbps)
        self.copy_gbps = float(copy_gbps) if copy_gbps and copy_gbps > 0 else self.seq_gbps
        top = sizes[-1]
        bw_top = min(float(runs_gbps[top]), self.seq_gbps)
        startup = max(0.0, top / bw_top - top / self.seq_gbps)   # ns-free: bytes / (GB/s)
        ext = [s for s in (2 ** np.arange(math.ceil(math.log2(top)) + 1, GRID_MAX_LOG2 + 8))
               if s > top]
        self._log2 = np.log2(np.array(sizes + ext, dtype=np.float64))
        self._gbps = np.array([min(float(runs_gbps[s]), self.seq_gbps) for s in sizes]
                              + [s / (s / self.seq_gbps + startup) for s in ext])
        self.peak_gbps = max(self.seq_gbps, self.copy_gbps / 2)

    def run_gbps(self, run_bytes) -> np.ndarray:
        return _interp_log2(self._log2, self._gbps, run_bytes)


def probe_timing(path: str, device: str | None = None) -> MeasuredTiming:
    """A timing source from `odma-hw probe --json` output (schema odma-hw.probe/1): the first
    device entry (or the one named `device`), its rand_gbps (GB/s by run size in bytes),
    seq_gbps and copy_gbps (optional: the sequential figure where absent). BadArgument in one
    line naming the file and the key for anything amiss, by the rules cards follow
    (allocator/serving/cards/datafile.py)."""
    data = docfile.load_document(path, "probe JSON", as_json=True)
    if not isinstance(data, dict) or data.get("schema") != "odma-hw.probe/1":
        schema = data.get("schema") if isinstance(data, dict) else None
        raise BadArgument(f"{path} is not an odma-hw.probe/1 document (schema "
                          f"{datafile.shown(schema)})")
    entries = data.get("devices") or []
    if not isinstance(entries, list):
        raise BadArgument(f"{path}: 'devices' must be a list of device entries")
    if device is not None:
        entries = [e for e in entries if isinstance(e, dict) and e.get("device") == device]
    if not entries or not isinstance(entries[0], dict):
        raise BadArgument(f"{path} has no device{' ' + device if device else ''} entry")
    e = entries[0]
    for key in ("rand_gbps", "seq_gbps"):
        if key not in e:
            raise BadArgument(f"{path}: the device entry lacks {key!r}")
    runs = datafile.table(path, "rand_gbps", e["rand_gbps"], datafile.MAX_RUN_BYTES,
                          datafile.BANDWIDTH_GBPS)
    seq = datafile.number(path, "seq_gbps", e["seq_gbps"], datafile.BANDWIDTH_GBPS)
    copy = e.get("copy_gbps")
    if copy is not None:
        copy = datafile.number(path, "copy_gbps", copy, datafile.BANDWIDTH_GBPS)
    name = e.get("device")
    return MeasuredTiming(f"probe:{name if isinstance(name, str) else '?'}", runs, seq, copy)


class IdealTiming(MemoryTiming):
    """Every run, stream and copy at the card's full bandwidth, whatever its size."""

    source = "ideal"

    def __init__(self, bandwidth_gbps: float):
        self.seq_gbps = self.copy_gbps = self.peak_gbps = float(bandwidth_gbps)

    def run_gbps(self, run_bytes) -> np.ndarray:
        return np.full(np.shape(run_bytes), self.seq_gbps)


def live_timing(spec: str, sizes=(4096, 16384, 65536, 262144, 1 << 20),
                buffer_bytes: int | None = None) -> MeasuredTiming:
    """Run-read bandwidths measured now on a torch device (`live:torch:cpu`)."""
    from allocator.serving.sim.live import measure_run_bandwidth

    m = measure_run_bandwidth(spec, list(sizes), buffer_bytes=buffer_bytes)
    return MeasuredTiming(f"live:{m['device']}", m["runs_gbps"], m["seq_gbps"], m["copy_gbps"])


def check_emu(s: EmuSettings):
    """The emulated device of settings `s` (its DeviceSpec); BadArgument for what EmuTiming
    would refuse."""
    from odma_hw.emu.specs import device_spec

    dev = device_spec(s.preset, channels=s.channels, interleave=s.interleave)
    if not 1 <= s.streams <= MAX_STREAMS:
        raise BadArgument(f"streams must be between 1 and {MAX_STREAMS}, got {s.streams}")
    return dev


def make_timing(source: str, bandwidth_gbps: float, settings: EmuSettings | None = None, *,
                check_only: bool = False) -> MemoryTiming | None:
    """`emu:PRESET`, `probe:FILE`, `live:torch:DEVICE` or `ideal` (every run at
    `bandwidth_gbps`) -> a timing source. check_only: make only the checks that need no
    measurement (the emulator settings, the probe file, that the torch device is there) and
    return None."""
    kind, _, arg = source.partition(":")
    if kind == "emu" and arg:
        s = dataclasses.replace(settings or EmuSettings(), preset=arg)
        if check_only:
            check_emu(s)
            return None
        return EmuTiming(bandwidth_gbps, s)
    if kind == "probe" and arg:
        t = probe_timing(arg)
        return None if check_only else t
    if kind == "live" and arg.startswith("torch:"):
        if check_only:
            from allocator.pool import resolve_device

            dev, owned = resolve_device(arg)
            if owned:
                dev.close()
            return None
        return live_timing(arg)
    if source == "ideal":
        return None if check_only else IdealTiming(bandwidth_gbps)
    raise BadArgument(f"unknown timing source {source!r}: expected emu:PRESET, probe:FILE, "
                      f"live:torch:DEVICE or ideal")
