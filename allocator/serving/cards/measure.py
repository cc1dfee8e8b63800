"""What calibrate measures of a device's memory and compute: run reads, sequential read and copy
(the native probe of the memory, else torch's gather), and matrix-product throughput by rows;
how long each measurement runs (Effort), and whether other work on the machine disturbed it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time

from odma_cli.errors import BadArgument, DeviceError, DeviceUnavailable, one_line

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


@dataclasses.dataclass(frozen=True)
class Effort:
    """How long each phase measures, and at which shapes."""

    run_sizes: tuple                   # bytes of the random runs read
    buffer_bytes: int | None           # bandwidth working set (None: the device's default)
    bandwidth_reps: int
    # batch rows of the decode-shape matmuls: every count up to 32, where the libraries switch
    # kernels (on a 2-core Xeon, torch's float32 products at 15 rows took 1.3x as long as at 16:
    # a table interpolated between 12 and 16 priced a batch of 15 a quarter too cheap)
    decode_rows: tuple
    # more rows, the layers' products alone (a prompt's tokens; the LM head takes only each
    # sequence's last): Qwen2.5-0.5B's layers ran 5-10 % faster at 512 rows than at 256 on a
    # 2-core EPYC, and a GPU's small products gain far more up to a few thousand rows
    prompt_rows: tuple
    matmul_reps: int
    matmul_seconds: float              # least time of one timed batch of matmul calls
    # depths of --model the engine's steps are timed at; None: the model's own (at least
    # engine_steps.DEEP_ENOUGH), as deep as the memory holds. Fitted at 2 and 6 layers, the
    # terms are extrapolated 4x to Qwen2.5-0.5B's 24, and so is the noise of the two depths'
    # difference: on a 2-core CPU, two processes that timed the steps at 2, 6 and 24 layers
    # found the (2, 6) fit's price of the 24-layer steps 9 % too high on average (rms 13 %)
    # in one, 12 % too low (rms 14 %) in the other; fitted at 2 and 24, -1 % (rms 7 %) in both
    fit_layers: tuple
    fit_batches: tuple                 # decode batches ...
    fit_contexts: tuple                # ... at each of these contexts (tokens)
    # whole-prompt prefills: (requests, prompt tokens). Many short prompts beside few long
    # ones: with 4 x 128 the only step of several prompts, the cost a prompt adds to a layer
    # came out at 0, 175 and 2,152 us in three calibrations of Qwen2.5-0.5B on one 2-core CPU
    prefill_shapes: tuple
    # chunked-prefill steps: (decodes, their context, chunk tokens, the chunk's first
    # position), the decodes those of the decode steps at that context (one of fit_contexts);
    # a chunk at 0 is a prompt's first, attended as a whole prompt, a later one reads the
    # prompt's cached tokens over the run tables
    chunk_shapes: tuple
    fit_warmup: int
    fit_reps: int
    read_run_tokens: tuple             # the engine attention's reads: runs (pages) of these
    read_contexts: tuple               # ... at two contexts: the rate is the difference's
    read_batch: int


FULL = Effort(run_sizes=(64, 256, 1024, 4096, 16384, 65536, 262144, 1 << 20, 4 << 20),
              buffer_bytes=None, bandwidth_reps=7,
              decode_rows=tuple(range(1, 33)) + (48, 64, 96, 128),
              prompt_rows=(512, 1024, 2048), matmul_reps=7, matmul_seconds=0.03,
              fit_layers=(2, None),
              fit_batches=(1, 2, 4, 8, 16, 32), fit_contexts=(16, 256, 1024),
              prefill_shapes=((1, 64), (1, 512), (4, 128), (16, 16)),
              chunk_shapes=((4, 256, 128, 0), (8, 256, 256, 256), (16, 1024, 64, 512)),
              fit_warmup=5,
              fit_reps=21,
              read_run_tokens=(1, 4, 16, 64, 256), read_contexts=(512, 2048), read_batch=16)
# --quick: a quarter of the working set (still far above this machine's 32 MiB L3), fewer
# repetitions and shapes; for tests, where fit quality matters and absolute figures do not
QUICK = Effort(run_sizes=(64, 256, 1024, 4096, 16384, 65536, 262144, 1 << 20),
               buffer_bytes=256 << 20, bandwidth_reps=3, decode_rows=(1, 8, 64),
               prompt_rows=(512,),
               matmul_reps=3, matmul_seconds=0.02, fit_layers=(2, 6), fit_batches=(1, 4, 16),
               fit_contexts=(16, 256), prefill_shapes=((1, 64), (4, 32)),
               chunk_shapes=((4, 256, 32, 32),), fit_warmup=3,
               fit_reps=9, read_run_tokens=(1, 16, 64), read_contexts=(128, 512),
               read_batch=8)


def need_torch():
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
    torch = need_torch()
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
def synchronizer(torch, device):
    if device.type == "cpu":
        return lambda: None
    mod = getattr(torch, device.type)
    return lambda: mod.synchronize(device)


def measure_bandwidth(spec: str, effort: Effort, seed: int) -> dict:
    """Run-read, sequential and copy bandwidth through torch on the device: random runs gathered
    by index_select, torch's sum and copy_ (allocator/serving/sim/live.py, measure_run_bandwidth).
    What --memory torch measures, and what auto falls back to; see measure_memory for why the
    native probe is preferred."""
    from allocator.serving.sim.live import measure_run_bandwidth

    return measure_run_bandwidth(spec, list(effort.run_sizes), buffer_bytes=effort.buffer_bytes,
                                 reps=effort.bandwidth_reps, seed=seed)


def measure_native_bandwidth(native: str, effort: Effort, torch_name: str | None = None) -> dict:
    """Run-read, sequential and copy bandwidth of the memory behind a torch device, measured by
    odma-hw's native probe on `native` (host, cuda:N, mlu:N): the measurement `odma-hw probe
    --device NATIVE --granularity <the run sizes>` makes (odma_hw.probe.measure's plan_probe
    and run_plan: the device's default working sets, every host thread on host,
    effort.bandwidth_reps repetitions), its random reads at each of effort.run_sizes.
    `torch_name`: the torch device's name, which the native device must share (the same ordinal
    names the same card to both), else DeviceUnavailable. DeviceUnavailable, DeviceError or BadArgument
    when the native backend is absent or refuses."""
    from odma_hw import devices
    from odma_hw.probe.measure import plan_probe, run_plan

    with devices.open(native) as d:
        if torch_name is not None and d.info.name != torch_name:
            raise DeviceUnavailable(f"{native} is {d.info.name!r}, not the torch device's "
                                    f"{torch_name!r}")
        plan = plan_probe(d, granularities=effort.run_sizes, reps=effort.bandwidth_reps)
        result = run_plan(plan)
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
    seconds = linear_seconds(torch, device, dtype, rows_list, products, effort, seed)
    each = {shape: {r: 2.0 * r * shape[0] * shape[1] / t / 1e12 for r, t in by_rows.items()}
            for shape, by_rows in seconds.items()}
    return set_tflops(each, products), each


def set_tflops(each: dict, products: dict) -> dict:
    """{rows: TFLOPS} of the set `products` ({(k, n): how many}) from each product's own rates
    ({(k, n): {rows: TFLOPS}}), at every row count all of them have: all the set's FLOPs over
    the time its products take together. The mix decides it: Qwen2.5-0.5B cut to 2 layers
    spends most of its step in the LM head, at 24 layers most in the layers' products."""
    rows_list = sorted(set.intersection(*(set(each[shape]) for shape in products)))
    return {r: sum(2.0 * r * k * n * c for (k, n), c in products.items())
            / sum(2.0 * r * k * n * c / each[(k, n)][r] for (k, n), c in products.items())
            for r in rows_list}


def weight_copies(k: int, n: int, elsize: int) -> int:
    """How many copies of an (n, k) weight a matmul measurement cycles through: enough to add
    up to COLD_WEIGHT_BYTES, at most MAX_WEIGHT_COPIES."""
    return max(1, min(MAX_WEIGHT_COPIES, math.ceil(COLD_WEIGHT_BYTES / (k * n * elsize))))


def matmul_bytes(products, rows_list, elsize: int) -> int:
    """The memory the measurement of `products` ({(k, n): count}) at each of `rows_list` holds
    at once (linear_seconds times them all in turns): every product's weight copies, and an
    input and an output at each row count (on CUDA each graph keeps its own)."""
    rows = sum(rows_list)
    return sum(weight_copies(k, n, elsize) * k * n * elsize + rows * (k + n) * elsize
               for k, n in products)


def graphed(torch, device, fn):
    """fn, or on CUDA the replay of a CUDA graph of it: the GPU's time for fn's kernels without
    a host launch each (a small product's launch takes longer than its kernel), as the engine's
    decode steps run them, captured. fn as it is where capture fails (one line says nothing:
    the figures are then the eager ones, launches included) or off CUDA."""
    if device.type != "cuda":
        return fn
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()                                  # compile and allocate outside the capture
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        return fn

    def replay(graph=graph, fn=fn):   # fn's tensors live as long as the graph reads them
        graph.replay()
    return replay


def linear_seconds(torch, device, dtype, rows_list, products, effort: Effort,
                   seed: int) -> dict:
    """{(k, n): {rows: seconds of one F.linear(x, W)}} for each of `products` at each of
    `rows_list` (linear_calls), every (shape, rows) one batch a round in turns (time_in_turns),
    effort.matmul_reps rounds, the median. Timed one row count after another, a burst of load
    elsewhere on the machine bent a stretch of neighbouring rows: four tables of Qwen2.5-0.5B's
    products on a 2-core VM, the two ways alternating in one process, moved a row count's
    figure by 17.5 % on average (37 % at most) one row after another, 11.6 % (21 %) in turns,
    the two ways' medians alike (1.01x on average)."""
    calls, keys = linear_calls(torch, device, dtype, rows_list, products, effort, seed)
    return per_linear(keys, time_in_turns(synchronizer(torch, device), calls, 0,
                                          effort.matmul_reps))


def linear_calls(torch, device, dtype, rows_list, products, effort: Effort,
                 seed: int) -> tuple[list, list]:
    """(calls, keys): for each of `products` ({(k, n): ...}) at each of `rows_list`, a call
    running a batch of passes of F.linear(x, W) lasting at least effort.matmul_seconds, W
    cycled through copies that add up to COLD_WEIGHT_BYTES (on CUDA each pass over the copies
    one graph replay, graphed); its key (k, n, rows, the F.linear calls in a batch)."""
    F = torch.nn.functional
    sync = synchronizer(torch, device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    elsize = torch.empty((), dtype=dtype).element_size()
    calls, keys = [], []
    for k, n in products:
        weights = [(torch.randn((n, k), generator=gen) / math.sqrt(k)).to(device=device,
                                                                       dtype=dtype)
                   for _ in range(weight_copies(k, n, elsize))]
        for rows in rows_list:
            x = torch.randn((rows, k), generator=gen).to(device=device, dtype=dtype)

            def every_copy(x=x, weights=weights):
                for w in weights:
                    F.linear(x, w)

            sync()
            every_copy()                          # warm-up: every copy once
            passes = graphed(torch, device, every_copy)
            sync()
            t0 = time.perf_counter()
            passes()
            sync()
            one = max(time.perf_counter() - t0, 1e-7)
            batch = max(1, min(100_000, math.ceil(effort.matmul_seconds / one)))

            def timed(passes=passes, batch=batch):
                for _ in range(batch):
                    passes()
            calls.append(timed)
            keys.append((k, n, rows, batch * len(weights)))
    return calls, keys


def per_linear(keys: list, times: list) -> dict:
    """{(k, n): {rows: the median seconds of one F.linear}} of linear_calls' keys and the
    seconds each call took, a list each."""
    out: dict = {}
    for (k, n, rows, linears), t in zip(keys, times):
        out.setdefault((k, n), {})[rows] = statistics.median(t) / linears
    return out


def steps_speed(each: dict, anchors: dict) -> float:
    """How many times as fast the products ran when timed among the engine's steps (`anchors`,
    per_linear's seconds of a few (shape, rows)) as in the matmul phase (`each`, TFLOPS by
    shape and rows): the median of the (shape, rows) ratios. On a shared host the two phases
    can run minutes apart at different speeds: three calibrations on a 2-core VM put the
    whole model's products at 256 rows at 0.163, 0.211 and 0.147 TFLOPS while its steps took
    the same time within 5 %."""
    ratios = [2.0 * rows * k * n / seconds / 1e12 / each[(k, n)][rows]
              for (k, n), by_rows in anchors.items() for rows, seconds in by_rows.items()]
    return float(statistics.median(ratios))


def time_in_turns(sync, calls: list, warmup: int, reps: int, settle: list = ()) -> list[list]:
    """The seconds of each of `calls`, `reps` times each, timed one call each per round: a burst
    of load from elsewhere on the machine then slows every shape alike instead of all the calls
    of one, which would bend a fit, a slope or a table. `settle`: calls run untimed at the end
    of every round, so that the next round's first call finds the machine as the others do."""
    for call in calls:
        for _ in range(warmup):
            call()
    times = [[] for _ in calls]
    for _ in range(reps):
        for call, t in zip(calls, times):
            sync()
            t0 = time.perf_counter()
            call()
            sync()
            t.append(time.perf_counter() - t0)
        for call in settle:
            call()
    return times


def disturbed(points) -> list[dict]:
    """The points whose steps varied more than a quiet machine's do: a median above
    BUSY_MEDIAN_OVER_MIN x the fastest step, or a third quartile above BUSY_Q3_OVER_Q1 x the
    first. Other work on the machine (on a few cores, every thread of torch's pool waits for
    the one that was descheduled) makes them so; their medians then measure that work."""
    return [p for p in points if p["step_s"] > BUSY_MEDIAN_OVER_MIN * p["step_min_s"]
            or p["step_q3_s"] > BUSY_Q3_OVER_Q1 * p["step_q1_s"]]
