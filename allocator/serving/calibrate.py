"""`odma-hw calibrate`: measure a torch device for a card file, so that `odma-hw simulate
--device CARD` predicts `odma-hw engine` on that device.

What it measures, in this order (each phase prints one progress line on stderr):

1. bandwidth: reads of random contiguous runs of S bytes (64 B .. 4 MiB), one long read and a
   streaming copy of the device's memory. By default (--memory auto) odma-hw's native probe
   measures them on the native device behind the torch device (torch:cpu -> host,
   torch:cuda:N -> cuda:N, torch:mlu:N -> mlu:N; measure_native_bandwidth), as the engine's
   own attention kernels read as those kernels do; where there is no native backend, or it is
   absent or fails here, torch's gather (index_select) measures them (measure_bandwidth,
   allocator/serving/live.py's measure_run_bandwidth), and one line says so. --memory native
   or torch picks one. Written beside the card as an `odma-hw probe --json` document
   (CARD.probe.json, its "memory_source" naming what measured it); the card's timing is
   `probe:CARD.probe.json`, its bandwidth_gbps the sequential figure, and its source (and the
   output) say which measured them.
2. matmul throughput: F.linear over every shape of --model's matrix products (q, k, v, o, the
   gated MLP's three, the LM head) at the engine's dtype, weights cycled through enough copies
   to come from memory, not a cache; at each row count, all the products' FLOPs over the time
   they take together, each shape as often as a step runs it: at a prefill shape
   (--prefill-tokens rows) and at decode shapes (1 .. 64 rows). The prefill shape's throughput
   is the card's peak at that dtype with mfu = 1 (what the engine's matrix products reach);
   every row count's goes into the card's matmul_tflops table, by which the simulator costs
   each step's compute.
3. overheads: Runner.decode steps of the engine (allocator/serving/torch_engine.py) on the
   tiny-llama config at 2 and 6 layers, several batch sizes, 16-token contexts in static
   blocks. From each step's median time the simulator's own memory and compute terms at that
   shape (with the bandwidths and throughput just measured) are taken away; what remains is
   fitted as per_step + layers x per_layer + layers x batch x per_layer_request + batch x
   per_request, each >= 0 (nnls), least squares relative to each step's time. A card has no
   per-step key, so layer_overhead_us = per_layer + per_step / (--model's layers): the card's
   overheads are the fitted ones exactly at that depth.

Not measured: link_gbps and link_latency_us (one device has no peer here); the card carries
placeholders and says so.

There is no compute(): a sweep would run calibrations side by side on shared cores, and every
figure would measure the neighbours.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import math
import os
import secrets
import statistics
import sys
import time

import numpy as np

from odma_hw.errors import BadArgument, DeviceError, DeviceUnavailable, one_line

SCHEMA = "odma-hw.calibrate/1"
PROBE_SCHEMA = "odma-hw.probe/1"
FIT_MODEL = "tiny-llama"               # shipped config the overheads are fitted on
FIT_LAYERS = (2, 6)                    # two depths of it: per-layer vs per-step costs
FIT_CONTEXT = 16                       # prompt tokens of every request in the fitted steps
FIT_POLICY = "static"                  # contiguous blocks, as the engine's odma and static keep
# Weights of a matmul measurement are cycled through copies of at least this many bytes in all,
# so each call reads its weight from memory as a decode step of a real model does (its layers
# never fit in a cache), not from the cache the previous call left it in.
COLD_WEIGHT_BYTES = 256 << 20
MAX_WEIGHT_COPIES = 64
# Steps of one shape on a quiet machine stay within about 10 % of each other (2-core VM, torch
# 2.13): twice these spreads means something else was running.
BUSY_MEDIAN_OVER_MIN = 1.5
BUSY_Q3_OVER_Q1 = 1.4
# ... and so does other processes' taking more than this share of the CPUs during a phase
BUSY_OTHER_SHARE = 0.15
MAX_PREFILL_TOKENS = 65536             # a longer prompt is a chunked prefill's business
# Placeholders for what one device cannot measure: PCIe 4.0 x16 per direction, and the
# per-hop latency the shipped mlu370-x4 card assumes. They matter only for simulate --tp > 1.
LINK_GBPS_PLACEHOLDER = 32.0
LINK_LATENCY_US_PLACEHOLDER = 10.0


@dataclasses.dataclass(frozen=True)
class Effort:
    """How long each phase measures."""

    run_sizes: tuple                   # bytes of the random runs read
    buffer_bytes: int | None           # bandwidth working set (None: the device's default)
    bandwidth_reps: int
    decode_rows: tuple                 # batch rows of the decode-shape matmuls
    matmul_reps: int
    matmul_seconds: float              # least time of one timed batch of matmul calls
    fit_batches: tuple
    fit_warmup: int
    fit_reps: int


FULL = Effort(run_sizes=(64, 256, 1024, 4096, 16384, 65536, 262144, 1 << 20, 4 << 20),
              buffer_bytes=None, bandwidth_reps=7,
              decode_rows=(1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64),
              matmul_reps=7, matmul_seconds=0.03, fit_batches=(1, 2, 4, 8, 16, 32),
              fit_warmup=5, fit_reps=31)
# --quick: a quarter of the working set (still far above this machine's 32 MiB L3), fewer
# repetitions; for tests, where fit quality matters and absolute figures do not
QUICK = Effort(run_sizes=(64, 256, 1024, 4096, 16384, 65536, 262144, 1 << 20),
               buffer_bytes=256 << 20, bandwidth_reps=3, decode_rows=(1, 8, 64),
               matmul_reps=3, matmul_seconds=0.02, fit_batches=(1, 4, 16),
               fit_warmup=3, fit_reps=9)


# ----------------------------------------------------------------------------- the fit
def nnls(A, y) -> np.ndarray:
    """argmin ||A x - y|| over x >= 0, for a few columns: the least-squares solution on every
    subset of the columns (the others held at 0), the best of those that are nonnegative. The
    optimum is among them (on its own support it is the unconstrained least-squares solution),
    so this is exact for a matrix of full column rank; 2^n solves, meant for n <= 8 (scipy is
    not a dependency)."""
    A = np.asarray(A, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if A.ndim != 2 or y.shape != (A.shape[0],) or not 1 <= A.shape[1] <= 8:
        raise BadArgument(f"nnls needs an (m, n) matrix with 1 <= n <= 8 and m values, got "
                          f"{A.shape} and {y.shape}")
    if not (np.isfinite(A).all() and np.isfinite(y).all()):
        raise BadArgument("nnls: the matrix and the values must be finite")
    n = A.shape[1]
    best, best_cost = np.zeros(n), float(y @ y)
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = list(cols)
            x_sub = np.linalg.lstsq(A[:, sub], y, rcond=None)[0]
            if (x_sub < 0).any():
                continue
            x = np.zeros(n)
            x[sub] = x_sub
            r = A @ x - y
            cost = float(r @ r)
            if cost < best_cost * (1 - 1e-12):   # ties: the sparser solution found first
                best, best_cost = x, cost
    return best


def fit_overheads(layers, batch, overhead, step) -> dict:
    """Fit overhead ~ k + layers x a + layers x batch x c + batch x b (seconds, each >= 0), with
    each point's error relative to its whole step time `step` (a 1 ms step and a 10 ms step
    count alike: a plain fit would give the small batches, where the overheads are most of the
    step, almost no say). k is the step's own work outside the layers (embedding, rotary
    tables, final norm, LM head, the argmaxes), which a card has no key for: without it the fit
    would pass it off as per-layer and per-request cost, each then wrong for any other depth.
    Returns the coefficients in seconds and each point's fitted overhead."""
    L = np.asarray(layers, dtype=np.float64)
    B = np.asarray(batch, dtype=np.float64)
    o = np.asarray(overhead, dtype=np.float64)
    s = np.asarray(step, dtype=np.float64)
    if not (L.shape == B.shape == o.shape == s.shape and L.ndim == 1 and L.size >= 4):
        raise BadArgument("the overhead fit needs at least 4 points, each with layers, batch, "
                          "overhead and step time")
    if not (s > 0).all():
        raise BadArgument("step times must be positive")
    A = np.column_stack([np.ones_like(L), L, L * B, B])
    x = nnls(A / s[:, None], o / s)
    k, a, c, b = (float(v) for v in x)
    return {"step_s": k, "layer_s": a, "layer_request_s": c, "request_s": b,
            "fitted_s": A @ x}


def card_overheads(fit: dict, layers: int) -> dict:
    """The card's three overheads (microseconds) for a model of `layers` layers: the per-step
    constant, for which a card has no key, shared out over the layers (exact at that depth)."""
    return {"layer_overhead_us": (fit["layer_s"] + fit["step_s"] / layers) * 1e6,
            "request_overhead_us": fit["request_s"] * 1e6,
            "layer_request_overhead_us": fit["layer_request_s"] * 1e6}


# ----------------------------------------------------------------------------- checks
def card_paths(out: str) -> tuple[str, str]:
    """(the card, its probe file beside it) for --out; BadArgument unless both can be written
    there (the folder exists and takes new files: each is written as a new file renamed over
    the old, which asks only the folder's permission; a link at --out is replaced, not
    followed, so that the card and the probe file it names stay side by side) and --out names a
    card simulate reads: CARD.toml, or CARD.json for a card in JSON (simulate tells them by
    the suffix). Called before anything is measured."""
    if not isinstance(out, str) or not out.strip():
        raise BadArgument("--out needs a file name")
    card = os.path.abspath(out)
    stem, suffix = os.path.splitext(card)
    if suffix.lower() not in (".toml", ".json"):
        raise BadArgument(f"--out must name a .toml or a .json card (simulate reads a card by "
                          f"its suffix), not {out!r}")
    probe = stem + ".probe.json"
    folder = os.path.dirname(card)
    for path in (card, probe):
        if os.path.isdir(path) and not os.path.islink(path):
            raise BadArgument(f"cannot write {path}: it is a directory")
    if not os.path.isdir(folder):
        raise BadArgument(f"cannot write card {out}: folder {folder} does not exist")
    trial = os.path.join(folder, f".calibrate-{secrets.token_hex(6)}.tmp")
    try:
        os.close(os.open(trial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(trial)
    except OSError as exc:
        raise BadArgument(f"cannot write card {out}: {exc.strerror or exc}") from None
    return card, probe


def _need_torch():
    try:
        import torch
    except ImportError:
        raise DeviceUnavailable("calibrate needs torch; pip install 'odma-hw[torch]'") from None
    return torch


def open_torch_device(spec: str) -> dict:
    """What calibrate needs to know of a torch device before measuring: its normalised spec
    (torch:cuda -> torch:cuda:0), torch device, name and memory. BadArgument for a spec that is
    not a torch device, DeviceUnavailable for one that is not here."""
    from odma_hw import devices

    if not isinstance(spec, str) or not spec.startswith("torch:"):
        raise BadArgument(f"calibrate measures a torch device, as the engine runs on one "
                          f"(torch:cpu, torch:cuda:0, torch:mlu:0), not {spec!r}")
    torch = _need_torch()
    with devices.open(spec) as dev:           # DeviceUnavailable for torch:cuda without CUDA
        tdev = dev.dev
        name = dev.info.name
        norm = dev.info.spec
        free = dev.info.free_bytes            # host: available RAM; an accelerator: free now
    if tdev.type == "cpu":
        # the engine's tensors live in host memory: all of it, not what is free now
        capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        name = _cpu_name() or name
    else:
        mod = getattr(torch, tdev.type)       # torch.cuda, or torch.mlu (torch_mlu mirrors it)
        try:
            capacity = mod.get_device_properties(tdev).total_memory
        except (AttributeError, RuntimeError):
            capacity = mod.mem_get_info(tdev)[1]
    return {"spec": norm, "device": tdev, "name": name, "capacity_bytes": int(capacity),
            "free_bytes": int(free)}


def _cpu_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def engine_dtype(device_type: str, dtype: str | None) -> str:
    """--dtype, or the engine's own on that device: float32 on a CPU (bf16 matmuls there are an
    extension some CPUs lack), bfloat16 on an accelerator."""
    if dtype is not None:
        return dtype
    return "float32" if device_type == "cpu" else "bfloat16"


class OtherLoad:
    """The share of this machine's CPU time that other processes took between its making and
    share(): all CPUs' busy time (/proc/stat, steal included: a hypervisor's other guests
    count) less this process's own, over wall time x CPUs. None where /proc/stat is not there.
    On a few cores a little of it ruins a measurement: each of torch's parallel regions waits
    for whichever of its threads was descheduled."""

    def __init__(self):
        self._start = self._snapshot()

    @staticmethod
    def _snapshot():
        try:
            import resource

            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (ImportError, OSError, ValueError):
            return None
        # user nice system idle iowait irq softirq steal ...: busy is all but idle and iowait
        busy = sum(fields[:8]) - fields[3] - fields[4]
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), ru.ru_utime + ru.ru_stime

    def share(self) -> float | None:
        end = self._snapshot()
        if self._start is None or end is None:
            return None
        wall = end[0] - self._start[0]
        other = (end[1] - self._start[1]) - (end[2] - self._start[2])
        cpus = os.cpu_count() or 1
        return max(0.0, other / (wall * cpus)) if wall > 0 else None


# ----------------------------------------------------------------------------- measurements
def _synchronizer(torch, device):
    if device.type == "cpu":
        return lambda: None
    mod = getattr(torch, device.type)
    return lambda: mod.synchronize(device)


def measure_bandwidth(spec: str, effort: Effort, seed: int) -> dict:
    """Run-read, sequential and copy bandwidth through torch on the device: random runs gathered
    by index_select, torch's sum and copy_ (allocator/serving/live.py, measure_run_bandwidth).
    What --memory torch measures, and what auto falls back to; see measure_memory for why the
    native probe is preferred."""
    from allocator.serving.live import measure_run_bandwidth

    return measure_run_bandwidth(spec, list(effort.run_sizes), buffer_bytes=effort.buffer_bytes,
                                 reps=effort.bandwidth_reps, seed=seed)


def measure_native_bandwidth(native: str, effort: Effort, torch_name: str | None = None) -> dict:
    """Run-read, sequential and copy bandwidth of the memory behind a torch device, measured by
    odma-hw's native probe on `native` (host, cuda:N, mlu:N): the measurement `odma-hw probe
    --device NATIVE --granularity <the run sizes>` makes (odma_hw.probe.plan_probe and run_plan:
    the device's default working sets, every host thread on host, effort.bandwidth_reps
    repetitions), its random reads at each of effort.run_sizes. `torch_name`: the torch
    device's name, which the native device must share (the same ordinal names the same card to
    both), else DeviceUnavailable. DeviceUnavailable, DeviceError or BadArgument
    when the native backend is absent or refuses."""
    from odma_hw import devices, probe

    with devices.open(native) as d:
        if torch_name is not None and d.info.name != torch_name:
            raise DeviceUnavailable(f"{native} is {d.info.name!r}, not the torch device's "
                                    f"{torch_name!r}")
        plan = probe.plan_probe(d, granularities=effort.run_sizes,
                                reps=effort.bandwidth_reps)
        result = probe.run_plan(plan)
    by_granule = {(m.pattern, m.granule, m.threads): m for m in result.measurements}
    method = by_granule[("rand", effort.run_sizes[0], result.threads)].method
    kernel = method.split(" (")[0]
    return {"device": native, "seq_gbps": result.seq_gbps, "copy_gbps": result.copy_gbps,
            "runs_gbps": {s: result.rand_gbps[s] for s in effort.run_sizes},
            "runs_in_order_gbps": {}, "buffer_bytes": int(result.buffer_bytes),
            "reps": effort.bandwidth_reps,
            "method": (f"odma-hw probe of {native}: " + "; ".join(
                f"{pattern}: {m.method}" for pattern, m in (
                    ("runs", by_granule[("rand", effort.run_sizes[0], result.threads)]),
                    ("seq", by_granule[("read", 64, result.threads)]),
                    ("copy", by_granule[("copy", 64, result.threads)])))
                       + f"; {result.threads} thread(s), median of {effort.bandwidth_reps}"),
            "memory": "native", "native_device": native,
            "source": f"native probe of {native} ({kernel})",
            "probe_entry": result.to_json()}


TORCH_SOURCE = "torch gather (index_select)"
MEMORY_MODES = ("auto", "native", "torch")


def memory_plan(spec: str, mode: str) -> str | None:
    """The native device whose probe gives the card's memory figures under --memory `mode` for
    torch device `spec` (None: torch's own gather measures them). BadArgument for an unknown
    mode, or --memory native where odma-hw has no native backend for that memory."""
    from odma_hw.devices.torch_device import native_spec

    if mode not in MEMORY_MODES:
        raise BadArgument(f"unknown --memory {mode!r}: expected one of {', '.join(MEMORY_MODES)}")
    if mode == "torch":
        return None
    native = native_spec(spec)
    if native is None and mode == "native":
        raise BadArgument(f"--memory native: odma-hw has no native backend for {spec}'s memory "
                          f"(it has host, cuda:N, mlu:N); use --memory torch")
    return native


def measure_memory(dev: dict, mode: str, effort: Effort, seed: int, show) -> dict:
    """The card's memory figures (measure_bandwidth's dict, plus "memory": native or torch,
    "source": what measured them, "native_device" and "fallback": why a native probe the mode
    asked for was not used, or None).

    Why the native probe by default: the engine reads its KV through its own run-table attention
    kernels (Triton on CUDA), not through a torch gather, and those read as the native probe's
    hand-written kernels do: on an H100 (bench/results/h100-2026-11-26) contiguous KV at
    0.82-0.90 of the native probe's sequential 3,059 GB/s and 16-token pages at 0.87-0.95 of
    it, while torch's index_select read every run from 1 KiB to 4 MiB at 0.29-0.31 of
    streaming, so a card from torch's gather believed HBM3 random-access-constrained at every
    size. Torch's gather is
    still what --memory torch measures, and what auto falls back to, in one line on `show`,
    where there is no native backend for the device's memory (a torch device type odma-hw has
    no shim for) or it is absent or fails here (no native shim built, no driver)."""
    native = memory_plan(dev["spec"], mode)
    fallback = None
    if native is not None:
        try:
            # a CUDA ordinal names the same card to torch and to the driver unless
            # CUDA_DEVICE_ORDER differs between them: the names tell
            bw = measure_native_bandwidth(
                native, effort, dev["name"] if dev["device"].type == "cuda" else None)
            return dict(bw, fallback=None)
        except KeyboardInterrupt:
            raise
        except Exception as exc:          # noqa: BLE001 - any failure of the probe: torch instead
            if mode == "native":
                if isinstance(exc, (BadArgument, DeviceUnavailable, DeviceError)):
                    raise
                raise DeviceError(f"the native probe of {native} failed: "
                                  f"{type(exc).__name__}: {exc}") from None
            fallback = one_line(exc) or type(exc).__name__
            show(f"calibrate {dev['spec']}: the native probe of {native} failed ({fallback}): "
                 f"memory figures from {TORCH_SOURCE} instead")
    elif mode == "auto":
        fallback = f"odma-hw has no native backend for {dev['spec']}'s memory"
    bw = measure_bandwidth(dev["spec"], effort, seed)
    return dict(bw, memory="torch", native_device=native, fallback=fallback,
                source=TORCH_SOURCE + (f" (the native probe of {native} failed: {fallback})"
                                       if native and fallback else
                                       f" ({fallback})" if fallback else ""))


def matmul_tflops(torch, device, dtype, rows_list, products: dict, effort: Effort,
                  seed: int) -> tuple[dict, dict]:
    """(TFLOPS of the whole set at each row count, TFLOPS of each product at each row count).
    `products` is {(k, n): how many} (ModelSpec.decode_products): each shape is timed as
    F.linear(x, W), x (rows, k) and W (n, k) (nn.Linear's own kernel), and the set's figure is
    all its FLOPs (2 rows k n each) over its summed time, so each shape weighs as much as a step
    spends in it. At a few rows the rate is steep and uneven from shape to shape (2x between
    Qwen2.5-0.5B's shapes at 6 rows on a 2-core CPU), so no one shape stands for the model."""
    seconds = {shape: _linear_seconds(torch, device, dtype, rows_list, *shape, effort, seed)
               for shape in products}
    each = {shape: {r: 2.0 * r * shape[0] * shape[1] / t / 1e12 for r, t in by_rows.items()}
            for shape, by_rows in seconds.items()}
    whole = {r: sum(2.0 * r * k * n * c for (k, n), c in products.items())
             / sum(seconds[shape][r] * c for shape, c in products.items()) / 1e12
             for r in rows_list}
    return whole, each


def weight_copies(k: int, n: int, elsize: int) -> int:
    """How many copies of an (n, k) weight a matmul measurement cycles through: enough to add
    up to COLD_WEIGHT_BYTES, at most MAX_WEIGHT_COPIES."""
    return max(1, min(MAX_WEIGHT_COPIES, math.ceil(COLD_WEIGHT_BYTES / (k * n * elsize))))


def matmul_bytes(products, rows: int, elsize: int) -> int:
    """The most memory the measurement of one of `products` ({(k, n): count}) holds at once: its
    weight's copies, and its input and output at `rows` rows."""
    return max(weight_copies(k, n, elsize) * k * n * elsize + rows * (k + n) * elsize
               for k, n in products)


def _linear_seconds(torch, device, dtype, rows_list, k: int, n: int, effort: Effort,
                    seed: int) -> dict:
    """{rows: seconds of one F.linear(x, W)}: the median of batches of calls lasting at least
    effort.matmul_seconds, W cycled through copies that add up to COLD_WEIGHT_BYTES."""
    F = torch.nn.functional
    sync = _synchronizer(torch, device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    elsize = torch.empty((), dtype=dtype).element_size()
    copies = weight_copies(k, n, elsize)
    weights = [(torch.randn((n, k), generator=gen) / math.sqrt(k)).to(device=device, dtype=dtype)
               for _ in range(copies)]
    out = {}
    for rows in rows_list:
        x = torch.randn((rows, k), generator=gen).to(device=device, dtype=dtype)

        def run(calls, start=0):
            for i in range(start, start + calls):
                F.linear(x, weights[i % copies])

        sync()
        run(copies)                           # warm-up: every copy once
        sync()
        t0 = time.perf_counter()
        run(1)
        sync()
        one = max(time.perf_counter() - t0, 1e-7)
        calls = max(1, min(100_000, math.ceil(effort.matmul_seconds / one)))
        times = []
        for r in range(effort.matmul_reps):
            sync()
            t0 = time.perf_counter()
            run(calls, start=r * calls)
            sync()
            times.append(time.perf_counter() - t0)
        out[rows] = statistics.median(times) / calls
    return out


def measure_steps(torch, dev: dict, dtype: str, effort: Effort, seed: int) -> list[dict]:
    """Median seconds of one engine decode step (Runner.decode, then the argmax of every row, read
    back once, as the engine's serving loop takes the step's tokens) at each FIT_LAYERS x batch size, every
    request FIT_CONTEXT tokens into its static block. Each request re-decodes the same position,
    so every timed step has the same shape. The shapes take turns, one step each per round: a
    burst of load from elsewhere on the machine then slows every shape alike instead of all the
    steps of one, which would bend the fit."""
    from allocator.config import AllocatorConfig
    from allocator.policies import make_allocator
    from allocator.serving.models import kv_bytes_per_token, load_config
    from allocator.serving.kv_runs import KVPool
    from allocator.serving.models import head_dim
    from allocator.serving.runner import Runner
    from allocator.serving.torch_engine import build_model

    sync = _synchronizer(torch, dev["device"])
    most = max(effort.fit_batches)
    max_len = FIT_CONTEXT + 1
    rng = np.random.default_rng(seed)
    allocs, shapes = [], []
    try:
        for layers in FIT_LAYERS:
            config, _ = load_config(FIT_MODEL)
            config.num_hidden_layers = layers
            model = build_model(config, dtype, str(dev["device"]), seed)
            bpt = kv_bytes_per_token(config, dtype)
            alloc = make_allocator(FIT_POLICY, dev["spec"], 2 * most * max_len * bpt, bpt,
                                   max_len, AllocatorConfig(background_refresh=False))
            allocs.append(alloc)
            runner = Runner(model, KVPool(alloc, config, getattr(torch, dtype), head_dim(config)))
            prompts = [torch.from_numpy(rng.integers(3, config.vocab_size, FIT_CONTEXT))
                       for _ in range(most)]
            for i in range(most):
                alloc.reserve(i, FIT_CONTEXT, 1, 0.0)
            # the prompts' KV, so attention reads real numbers (not uninitialised memory)
            runner.prefill(list(enumerate(prompts)))
            for batch in effort.fit_batches:
                tokens = rng.integers(3, config.vocab_size, batch).tolist()
                shapes.append((layers, batch, _decode_step(torch, runner, tokens)))
        for _, _, step in shapes:
            for _ in range(effort.fit_warmup):
                step()
        times = [[] for _ in shapes]
        for _ in range(effort.fit_reps):
            for (_, _, step), t in zip(shapes, times):
                sync()
                t0 = time.perf_counter()
                step()
                sync()
                t.append(time.perf_counter() - t0)
    finally:
        for alloc in allocs:
            alloc.close()
    out = []
    for (layers, batch, _), t in zip(shapes, times):
        q1, _, q3 = statistics.quantiles(t, n=4) if len(t) > 1 else (t[0], t[0], t[0])
        out.append({"layers": layers, "batch": batch, "context": FIT_CONTEXT + 1,
                    "step_s": statistics.median(t), "step_min_s": min(t), "step_max_s": max(t),
                    "step_q1_s": q1, "step_q3_s": q3})
    return out


def disturbed(points) -> list[dict]:
    """The points whose steps varied more than a quiet machine's do: a median above
    BUSY_MEDIAN_OVER_MIN x the fastest step, or a third quartile above BUSY_Q3_OVER_Q1 x the
    first. Other work on the machine (on a few cores, every thread of torch's pool waits for
    the one that was descheduled) makes them so; their medians then measure that work."""
    return [p for p in points if p["step_s"] > BUSY_MEDIAN_OVER_MIN * p["step_min_s"]
            or p["step_q3_s"] > BUSY_Q3_OVER_Q1 * p["step_q1_s"]]


def _decode_step(torch, runner, tokens):
    """One decode step of requests 0 .. len(tokens) - 1, each at position FIT_CONTEXT."""
    batch = len(tokens)
    ids = list(range(batch))
    positions = [FIT_CONTEXT] * batch

    def step():
        runner.decode(tokens, positions, ids).argmax(-1).tolist()
    return step


def predicted_floor(spec, layers: int, batch: int, context: int, dtype: str, timing,
                    tflops: float, matmul: dict) -> dict:
    """The simulator's own max(memory, compute) of one decode step (StepTimer.decode_terms) of
    `spec` at `layers` layers, `batch` requests of `context` tokens each in contiguous blocks,
    on a card of the figures just measured (`tflops` at the engine's `dtype`, the matmul table
    by rows) and no overheads: what remains of a measured step is the overheads."""
    from types import SimpleNamespace

    from allocator.serving.engine import ServingSetup
    from allocator.serving.presets import Accelerator
    from allocator.serving.steptime import StepTimer

    sim_dtype = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    card = Accelerator("calibrating", timing.seq_gbps, 1e3, tflops, "ideal", 1.0, 0.0,
                       tflops_fp32=tflops, layer_overhead_us=0.0, request_overhead_us=0.0,
                       mfu=1.0, matmul_tflops=tuple(sorted(matmul.items())))
    setup = ServingSetup(dataclasses.replace(spec, layers=layers), card, timing, dtype=sim_dtype,
                         max_model_len=context + 1, mfu=1.0)
    timer = StepTimer(setup, "contiguous")
    for _ in range(batch):
        r = SimpleNamespace()
        timer.linearize(r, 0, context, None)
        timer.add(r, +1)
    memory, compute = timer.decode_terms(batch, 0)
    return {"memory_s": memory, "compute_s": compute, "floor_s": max(memory, compute)}


# ----------------------------------------------------------------------------- the card
def toml_string(text: str) -> str:
    """A TOML basic string: quotes and backslashes escaped, control characters as \\uXXXX."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def card_number(v: float) -> float:
    """A card's number: six significant digits, as a float."""
    v = float(v)
    if not math.isfinite(v):
        raise BadArgument(f"a card value must be finite, got {v}")
    return float(f"{v:.6g}")


def toml_float(v: float) -> str:
    """card_number(v), always a TOML float (1e-05, 33.1, 100000.0: never an integer)."""
    return repr(card_number(v))


def card_text(values: dict, comments: dict, header: list[str]) -> str:
    """The card as TOML: one `key = value` per line, in `values`' order, each preceded by its
    comment lines (comments[key]) where it has some."""
    lines = [f"# {h}" for h in header] + [""]
    for key, v in values.items():
        for c in comments.get(key, ()):
            lines.append(f"# {c}")
        if isinstance(v, str):
            lines.append(f"{key} = {toml_string(v)}")
        elif isinstance(v, dict):           # an inline table, its keys quoted
            inner = ", ".join(f"{toml_string(str(k))} = {toml_float(x)}" for k, x in v.items())
            lines.append(f"{key} = {{ {inner} }}")
        else:
            lines.append(f"{key} = {toml_float(v)}")
    return "\n".join(lines) + "\n"


def card_json(values: dict) -> str:
    """The card as JSON (a CARD.json), its numbers as card_text writes them; JSON has no
    comments, so its `source` alone says where each figure comes from."""
    import json

    def value(v):
        if isinstance(v, str):
            return v
        if isinstance(v, dict):
            return {str(k): card_number(x) for k, x in v.items()}
        return card_number(v)
    return json.dumps({k: value(v) for k, v in values.items()}, indent=1,
                      ensure_ascii=False) + "\n"


def check_card(path: str, text: str) -> None:
    """DeviceError unless simulate accepts the card `text` about to be written at `path`: a
    figure measured outside the range a card may hold (allocator/serving/datafile.py) is a
    measurement gone wrong, and writing it would only move the refusal to simulate."""
    import json

    from odma_hw import tomlread

    from allocator.serving.presets import card_fields, card_is_json

    data = json.loads(text) if card_is_json(path) else tomlread.loads(text)
    try:
        card_fields(path, data)
    except BadArgument as exc:
        raise DeviceError(f"calibrate measured what no card may hold, so wrote nothing: {exc}") \
            from None


def probe_document(dev: dict, bw: dict, run_sizes) -> dict:
    """The bandwidths as `odma-hw probe --json` writes a device (allocator/serving/timing.py,
    probe_timing, reads rand_gbps, seq_gbps and copy_gbps). From the native probe: its own
    entry (the native device, with its verdict), plus what it was measured for; from torch's
    gather: an entry of the torch device, with no RACM verdict, which needs the probe's
    saturation checks. Either way "memory_source" names what measured the figures."""
    import odma_hw

    if bw.get("memory") == "native" and bw.get("probe_entry"):
        return {"schema": PROBE_SCHEMA, "devices": [dict(
            bw["probe_entry"], measured_for=dev["spec"], memory_source=bw["source"],
            measured_by="odma-hw calibrate (the native probe of the memory behind "
                        f"{dev['spec']})")]}
    runs = {str(s): float(bw["runs_gbps"][s]) for s in run_sizes}
    seq = float(bw["seq_gbps"])
    return {"schema": PROBE_SCHEMA, "devices": [{
        "device": dev["spec"], "kind": "torch", "name": dev["name"], "peak_gbps": None,
        "seq_gbps": seq, "copy_gbps": float(bw["copy_gbps"]), "rand_gbps": runs,
        "ratios": {k: v / seq for k, v in runs.items()},
        "granularity": int(run_sizes[0]), "ratio": runs[str(run_sizes[0])] / seq,
        "verdict": "inconclusive",
        "reason": "measured by odma-hw calibrate for a card (run reads through torch); it makes "
                  "no saturation check: classify the device with odma-hw probe",
        "runs_in_order_gbps": {str(s): float(bw["runs_in_order_gbps"][s]) for s in run_sizes},
        "buffer_bytes": int(bw["buffer_bytes"]), "reps": int(bw["reps"]),
        "memory_source": bw.get("source", TORCH_SOURCE), "measures": TORCH_SOURCE + (
            ", torch sum and copy_: the rate torch's kernels reach on this memory, not the "
            "memory's rate"),
        "convention": "GB = 1e9 B; copy counts read + write; random counts run bytes x runs",
        "details": {"method": bw["method"], "odma_hw": odma_hw.__version__}}]}


# ----------------------------------------------------------------------------- the command
def check(args) -> dict:
    """Every refusal before anything is measured or written: (paths, device, dtype, model
    shape)."""
    from allocator.serving.models import DTYPES, check_memory, load_config
    from allocator.serving.presets import model_spec

    if args.name is not None and (not args.name.strip() or
                                  any(ord(c) < 0x20 or ord(c) == 0x7F for c in args.name)):
        raise BadArgument(f"--name must be a non-empty line of text, got {args.name!r}")
    if args.dtype is not None and args.dtype not in DTYPES:
        raise BadArgument(f"unknown --dtype {args.dtype!r}: expected one of {', '.join(DTYPES)}")
    if not 1 <= args.prefill_tokens <= MAX_PREFILL_TOKENS:
        raise BadArgument(f"--prefill-tokens must be in [1, {MAX_PREFILL_TOKENS}], got "
                          f"{args.prefill_tokens}")
    memory = getattr(args, "memory", "auto")
    if memory not in MEMORY_MODES:
        raise BadArgument(f"unknown --memory {memory!r}: expected one of "
                          f"{', '.join(MEMORY_MODES)}")
    card, probe = card_paths(args.out)
    load_config(args.model)              # a model the engine runs
    load_config(FIT_MODEL)
    spec = model_spec(args.model)
    dev = open_torch_device(args.device)
    dtype = engine_dtype(dev["device"].type, args.dtype)
    native = memory_plan(dev["spec"], memory)     # --memory native needs a native backend...
    if memory == "native":
        from odma_hw import devices

        with devices.open(native):                 # ... that is here (auto falls back instead)
            pass
    # the largest product's measurement, before any of its weights exists (the model's own
    # weights are never built: the products are timed one at a time)
    rows = max(args.prefill_tokens, *FULL.decode_rows)
    check_memory({f"{args.model}'s largest matmul measurement":
                  matmul_bytes(spec.decode_products, rows, DTYPES[dtype])},
                 dev["free_bytes"], dev["spec"])
    return {"card": card, "probe": probe, "device": dev, "dtype": dtype,
            "products": spec.decode_products, "layers": spec.layers, "memory": memory}


def calibrate(args, progress=None) -> dict:
    """Measure, fit, write the probe file and the card; the result object (SCHEMA)."""
    from allocator.serving.presets import card_is_json, model_spec
    from allocator.serving.timing import MeasuredTiming
    from allocator.trace import write_file

    started = time.perf_counter()
    p = check(args)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    effort = QUICK if args.quick else FULL
    torch = _need_torch()
    dev, dtype = p["device"], p["dtype"]
    show = progress or (lambda text: None)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    native = memory_plan(dev["spec"], p["memory"])
    show(f"calibrate {dev['spec']}: bandwidth of random runs of "
         f"{_bytes(effort.run_sizes[0])} .. {_bytes(effort.run_sizes[-1])}, sequential read, copy"
         f" ({'the native probe of ' + native if native else TORCH_SOURCE})")
    other = {}
    load = OtherLoad()
    bw = measure_memory(dev, p["memory"], effort, args.seed, show)
    other["bandwidth"] = load.share()
    timing = MeasuredTiming(f"probe:{dev['spec']}", bw["runs_gbps"], bw["seq_gbps"],
                            bw["copy_gbps"])

    products = p["products"]
    rows = (args.prefill_tokens,) + tuple(effort.decode_rows)
    show(f"calibrate {dev['spec']}: matmul {dtype}, the {len(products)} shapes of "
         f"{args.model}'s layers and LM head, at {args.prefill_tokens} rows (prefill) and "
         f"{', '.join(map(str, effort.decode_rows))} (decode)")
    load = OtherLoad()
    mm, each = {}, {}
    mm[dtype], each[dtype] = matmul_tflops(torch, dev["device"], getattr(torch, dtype), rows,
                                           products, effort, args.seed)
    if dtype != "bfloat16":
        # a card needs its bf16 peak whatever the engine runs
        show(f"calibrate {dev['spec']}: matmul bfloat16 at {args.prefill_tokens} rows")
        mm["bfloat16"], each["bfloat16"] = matmul_tflops(
            torch, dev["device"], torch.bfloat16, (args.prefill_tokens,), products, effort,
            args.seed)
    other["matmul"] = load.share()
    peak = mm[dtype][args.prefill_tokens]
    tflops_bf16 = mm["bfloat16"][args.prefill_tokens]

    show(f"calibrate {dev['spec']}: engine decode steps of {FIT_MODEL} at "
         f"{' and '.join(map(str, FIT_LAYERS))} layers, batch "
         f"{', '.join(map(str, effort.fit_batches))}, {effort.fit_reps} steps each")
    load = OtherLoad()
    points = measure_steps(torch, dev, dtype, effort, args.seed)
    other["steps"] = load.share()
    spec = model_spec(FIT_MODEL)
    for pt in points:
        pt.update(predicted_floor(spec, pt["layers"], pt["batch"], pt["context"], dtype, timing,
                                  peak, mm[dtype]))
        pt["overhead_s"] = pt["step_s"] - pt["floor_s"]
    fit = fit_overheads([q["layers"] for q in points], [q["batch"] for q in points],
                        [q["overhead_s"] for q in points], [q["step_s"] for q in points])
    for pt, f in zip(points, fit.pop("fitted_s")):
        pt["fitted_s"] = pt["floor_s"] + float(f)
        pt["residual_s"] = pt["step_s"] - pt["fitted_s"]
        pt["relative_residual"] = pt["residual_s"] / pt["step_s"]
    rel = np.array([q["relative_residual"] for q in points])
    fit["rms_relative_residual"] = float(np.sqrt(np.mean(rel ** 2)))
    fit["max_relative_residual"] = float(np.abs(rel).max())
    busy = [[q["layers"], q["batch"]] for q in disturbed(points)]
    if busy:
        show(f"calibrate {dev['spec']}: warning: the steps of {len(busy)} of {len(points)} "
             f"shapes varied as on a busy machine: calibrate again when nothing else runs")
    loaded = {k: v for k, v in other.items() if v is not None and v > BUSY_OTHER_SHARE}
    if loaded:
        show(f"calibrate {dev['spec']}: warning: other processes took "
             + ", ".join(f"{v:.0%} of the CPUs during {k}" for k, v in loaded.items())
             + ": calibrate again when nothing else runs")

    over = card_overheads(fit, p["layers"])
    decode = mm[dtype]
    name = args.name or f"calibrated-{dev['spec'].replace(':', '-')}"
    probe_name = os.path.basename(p["probe"])
    source = (
        f"odma-hw calibrate on {dev['spec']} ({dev['name']}), torch {torch.__version__}, {when}. "
        f"Bandwidth (memory: {bw['source']}): reads of random runs, sequential read and copy "
        f"({probe_name}). Matmul {dtype} over {args.model}'s layer and LM-head shapes, each "
        f"weighed by the time a step spends in it, at {args.prefill_tokens} rows: "
        f"{peak:.4g} TFLOPS (mfu 1: the engine's matrix products reach this)"
        + (f"; bfloat16 {tflops_bf16:.4g}" if dtype != "bfloat16" else "")
        + "; at decode rows " + ", ".join(f"{r}: {decode[r]:.3g}" for r in effort.decode_rows)
        + f" TFLOPS. Overheads fitted on {FIT_MODEL} engine decode steps at "
        f"{'/'.join(map(str, FIT_LAYERS))} layers, batch "
        f"{'/'.join(map(str, effort.fit_batches))}, {FIT_CONTEXT + 1}-token contexts: per "
        f"layer {fit['layer_s'] * 1e6:.4g} us + a per-step {fit['step_s'] * 1e6:.4g} us shared "
        f"over the {p['layers']} layers of {args.model}, per request "
        f"{fit['request_s'] * 1e6:.4g} us, per request per layer "
        f"{fit['layer_request_s'] * 1e6:.4g} us; rms relative residual "
        f"{fit['rms_relative_residual']:.3f}, max {fit['max_relative_residual']:.3f}"
        + (f" (WARNING: the steps of {len(busy)} of {len(points)} shapes varied as on a busy "
           f"machine)" if busy else "")
        + (" (WARNING: other processes ran during " + ", ".join(loaded) + ")" if loaded else "")
        + ". link_gbps and link_latency_us are placeholders, not measured."
        + (" (--quick: fewer repetitions)" if args.quick else ""))
    values = {"name": name, "bandwidth_gbps": float(bw["seq_gbps"]),
              "capacity_gb": dev["capacity_bytes"] / 1e9, "tflops_bf16": tflops_bf16}
    if dtype == "float32":
        values["tflops_fp32"] = peak
    values.update({"mfu": 1.0,
                   "matmul_tflops": {r: mm[dtype][r] for r in sorted(mm[dtype])},
                   "timing": f"probe:{probe_name}",
                   "link_gbps": LINK_GBPS_PLACEHOLDER,
                   "link_latency_us": LINK_LATENCY_US_PLACEHOLDER,
                   **over, "source": source})
    comments = {
        "bandwidth_gbps": [f"sequential read, GB/s (1e9 B/s); memory figures: {bw['source']}"],
        "capacity_gb": ["the device's whole memory, GB" + (" (host memory)" if
                                                          dev["device"].type == "cpu" else "")],
        "tflops_bf16": [f"matmul throughput of {args.model}'s products at "
                        f"{args.prefill_tokens} rows, TFLOPS"],
        "mfu": ["the figures above are what the engine's matmuls reach, not a datasheet peak"],
        "matmul_tflops": [f"{dtype} matmul throughput by rows (tokens) in the products, TFLOPS, "
                          f"over {args.model}'s", "shapes, each as often as a step runs it: a "
                          "step's compute runs at its row count's"],
        "timing": [f"run-read bandwidth by run size, measured with the card ({bw['source']})"],
        "link_gbps": ["placeholders, NOT measured (one device has no peer): PCIe 4.0 x16 per",
                      "direction and a 10 us hop; they matter only for simulate --tp > 1"],
        "layer_overhead_us": ["fitted overheads, microseconds per step: per layer (with the step's",
                              f"own cost shared over the {p['layers']} layers of {args.model}), "
                              f"per running", "request, per running request per layer"],
    }
    header = [f"device card of {dev['spec']}, written by odma-hw calibrate on {when}",
              f"engine dtype {dtype}; `odma-hw simulate --device THIS_FILE` reads it"]
    text = card_json(values) if card_is_json(p["card"]) else card_text(values, comments, header)
    check_card(p["card"], text)
    doc = probe_document(dev, bw, effort.run_sizes)
    from odma_hw import jsonout

    # the probe file first: a card never names a file that is not there yet
    # each written whole, then renamed into place: a failure leaves the old files as they were;
    # a link at either path is replaced, not followed, so the card's probe:NAME (relative to
    # the card's folder) names the probe file written beside it
    probe_text = jsonout.dumps(doc, indent=1) + "\n"
    write_file(p["probe"], lambda f: f.write(probe_text), "probe file", replace_links=True)
    write_file(p["card"], lambda f: f.write(text), "card", replace_links=True)
    return {
        "schema": SCHEMA, "card": p["card"], "probe": p["probe"], "device": dev["spec"],
        "device_name": dev["name"], "dtype": dtype, "quick": bool(args.quick),
        "memory": p["memory"],
        "model": args.model, "card_values": values,
        "bandwidth": {"seq_gbps": float(bw["seq_gbps"]), "copy_gbps": float(bw["copy_gbps"]),
                      "runs_gbps": {str(s): float(v) for s, v in bw["runs_gbps"].items()},
                      "runs_in_order_gbps": {str(s): float(v)
                                             for s, v in bw["runs_in_order_gbps"].items()},
                      "buffer_bytes": int(bw["buffer_bytes"]), "method": bw["method"],
                      "memory": bw["memory"], "source": bw["source"],
                      "native_device": bw["native_device"], "fallback": bw["fallback"]},
        "matmul": {"products": [{"k": k, "n": n, "count": c} for (k, n), c in products.items()],
                   "prefill_rows": args.prefill_tokens,
                   "tflops": {d: {str(r): v for r, v in t.items()} for d, t in mm.items()},
                   "tflops_by_product": {d: {f"{k}x{n}": {str(r): v for r, v in t.items()}
                                             for (k, n), t in e.items()}
                                         for d, e in each.items()}},
        "overheads": {"step_us": fit["step_s"] * 1e6, "layer_us": fit["layer_s"] * 1e6,
                      "request_us": fit["request_s"] * 1e6,
                      "layer_request_us": fit["layer_request_s"] * 1e6,
                      "model_layers": p["layers"], "card": over,
                      "rms_relative_residual": fit["rms_relative_residual"],
                      "max_relative_residual": fit["max_relative_residual"],
                      "fit_model": FIT_MODEL, "disturbed": busy, "points": points},
        "other_cpu_share": other, "busy_phases": sorted(loaded),
        "load_average_before": load_before,
        "seconds": time.perf_counter() - started,
    }


def _bytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def format_summary(r: dict) -> str:
    v = r["card_values"]
    bw = r["bandwidth"]
    lines = [f"{r['device']} ({r['device_name']}), engine dtype {r['dtype']}"
             + (" (--quick)" if r["quick"] else ""),
             f"memory figures: {bw['source']}"
             + (f" (--memory {r['memory']})" if r.get("memory") else ""),
             f"bandwidth: sequential {bw['seq_gbps']:.2f} GB/s, copy {bw['copy_gbps']:.2f} GB/s; "
             "random runs: " + ", ".join(f"{_bytes(int(s))} {g:.2f}"
                                         for s, g in bw["runs_gbps"].items()) + " GB/s"]
    mm = r["matmul"]
    shapes = ", ".join(f"{q['count']} x {q['k']} -> {q['n']}" for q in mm["products"])
    for dtype, t in mm["tflops"].items():
        parts = [f"{rows} rows {x:.4g}" for rows, x in t.items()]
        lines.append(f"matmul {dtype} ({shapes}): " + ", ".join(parts) + " TFLOPS")
    o = r["overheads"]
    c = o["card"]
    lines.append(f"overheads fitted on {o['fit_model']} decode steps: per step "
                 f"{o['step_us']:.1f} us, per layer {o['layer_us']:.1f} us, per request "
                 f"{o['request_us']:.2f} us, per request per layer {o['layer_request_us']:.2f} us; "
                 f"rms relative residual {o['rms_relative_residual']:.3f}, max "
                 f"{o['max_relative_residual']:.3f}"
                 + (f"; WARNING: {len(o['disturbed'])} shapes measured on a busy machine"
                    if o["disturbed"] else ""))
    lines.append(f"card overheads ({o['model_layers']} layers of {r['model']}): "
                 f"layer_overhead_us {c['layer_overhead_us']:.1f}, request_overhead_us "
                 f"{c['request_overhead_us']:.2f}, layer_request_overhead_us "
                 f"{c['layer_request_overhead_us']:.2f}")
    head = ["layers", "batch", "step ms", "floor ms", "fitted ms", "residual"]
    rows = [head] + [[str(q["layers"]), str(q["batch"]), f"{q['step_s'] * 1e3:.3f}",
                      f"{q['floor_s'] * 1e3:.3f}", f"{q['fitted_s'] * 1e3:.3f}",
                      f"{q['relative_residual'] * 100:+.1f}%"] for q in o["points"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        lines.append("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)))
    lines.append(f"card: {r['card']} (name {v['name']!r}; capacity {v['capacity_gb']:.1f} GB, "
                 f"tflops_bf16 {v['tflops_bf16']:.4g}"
                 + (f", tflops_fp32 {v['tflops_fp32']:.4g}" if "tflops_fp32" in v else "")
                 + f"; link_gbps {v['link_gbps']:g} and link_latency_us "
                   f"{v['link_latency_us']:g} are placeholders)")
    lines.append(f"probe: {r['probe']}; {r['seconds']:.0f} s")
    shares = {k: v for k, v in r["other_cpu_share"].items() if v is not None}
    if shares:
        lines.append("other processes' share of the CPUs: "
                     + ", ".join(f"{k} {v:.0%}" for k, v in shares.items())
                     + ("; WARNING: " + ", ".join(r["busy_phases"]) + " measured on a busy "
                        "machine" if r["busy_phases"] else ""))
    return "\n".join(lines)


def _cmd(args) -> int:
    from odma_hw import jsonout

    def progress(text):
        if not args.quiet:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    result = calibrate(args, progress)
    print(jsonout.dumps(result, indent=1) if args.json else format_summary(result))
    return 0


def register(subparsers) -> None:
    from odma_hw import argtypes

    from allocator.serving.models import DTYPES, shipped_configs

    p = subparsers.add_parser(
        "calibrate", help="measure a torch device and write a card file for simulate --device",
        description="Measure on a torch device what a card file needs, so that `odma-hw "
                    "simulate --device CARD` predicts `odma-hw engine` there: the bandwidth of "
                    "random contiguous runs by size, sequential and copy bandwidth (by the "
                    "native probe of the same memory where odma-hw has one, else torch's gather: "
                    "--memory; written beside the card as an `odma-hw probe --json` file, "
                    "CARD.probe.json); matmul "
                    "throughput at the engine's dtype over --model's layer and LM-head shapes, at "
                    "a prefill row count and at decode row counts; and the per-layer, "
                    "per-request and per-request-per-layer overheads of the engine's decode "
                    "steps, fitted on the tiny-llama config at "
                    "2 and 6 layers. link_gbps and link_latency_us are not measured: the card "
                    "carries placeholders and says so. About 2 minutes on a quiet 2-core CPU "
                    "(--quick: about a minute, most of it the LM head at the prefill rows); "
                    "other processes running meanwhile make every figure wrong, and a warning "
                    "says so.")
    p.add_argument("--device", default="torch:cpu", metavar="torch:DEV",
                   help="the torch device the engine runs on (default torch:cpu; torch:cuda:0, "
                        "torch:mlu:0)")
    p.add_argument("--out", required=True, metavar="CARD.toml",
                   help="the card to write, TOML (CARD.toml) or JSON (CARD.json); its probe "
                        "file goes beside it (CARD.probe.json), and a link at either is "
                        "replaced, not followed. Checked before anything is measured")
    p.add_argument("--name", default=None,
                   help="the card's name (default calibrated-<device>, e.g. "
                        "calibrated-torch-cpu)")
    p.add_argument("--model", default="qwen2.5-0.5b", metavar="CONFIG",
                   help=f"the model the card is for: its matrix products (every layer's "
                        f"and the LM head's shapes) are timed, and its layers share the "
                        f"per-step overhead in layer_overhead_us. A config.json, a directory "
                        f"holding one, or one of {', '.join(shipped_configs())} (default "
                        f"qwen2.5-0.5b)")
    p.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help="the engine's dtype (default: float32 on a CPU, bfloat16 on a GPU or "
                        "MLU); bfloat16 throughput is measured in any case")
    p.add_argument("--prefill-tokens", type=argtypes.positive_int, default=256, metavar="N",
                   help="rows of the prefill-shape matmul (default 256)")
    p.add_argument("--quick", action="store_true",
                   help="fewer repetitions, shapes and run sizes, and a quarter of the working "
                        "set (for tests)")
    p.add_argument("--memory", default="auto", choices=list(MEMORY_MODES),
                   help="what measures the card's memory figures (run reads, sequential read, "
                        "copy): native, odma-hw's native probe of the same memory (host for "
                        "torch:cpu, cuda:N for torch:cuda:N, mlu:N for torch:mlu:N), whose "
                        "kernels read as the engine's own attention kernels do; torch, torch's "
                        "gather (index_select), sum and copy_; auto (default), native where "
                        "there is a native backend, torch's gather, said in one line, where it "
                        "is absent or fails")
    p.add_argument("--seed", type=argtypes.seed, default=0,
                   help="seeds the random runs, weights and tokens (default 0)")
    p.add_argument("--json", action="store_true", help=f"print one JSON object ({SCHEMA})")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_cmd)
