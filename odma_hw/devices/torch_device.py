"""`torch:<device>`: device memory through PyTorch (torch:cpu, torch:cuda:0, torch:mlu:0 with
torch_mlu). Memory is a uint8 tensor; copies go through tensor slices; random access is an
index_select of G-byte rows, which is a real kernel-driven gather on accelerators."""

from __future__ import annotations

import statistics
import time

from odma_cli.errors import BadArgument, DeviceError, DeviceUnavailable
from odma_hw.devices.base import Buffer, Device, DeviceInfo, Measurement
from odma_hw.devices.host import mem_available

try:
    import torch
except ImportError as exc:  # reported by discover(); the rest of odma-hw keeps working
    torch = None
    _TORCH_MISSING = f"torch not installed ({exc}); pip install 'odma-hw[torch]'"


def _load_plugin(kind: str) -> None:
    """Out-of-tree devices register themselves when their plugin is imported."""
    if kind == "mlu":
        try:
            import torch_mlu  # noqa: F401
        except ImportError as exc:
            raise DeviceUnavailable(f"torch:mlu needs torch_mlu ({exc})") from None


def discover():
    if torch is None:
        return [], _TORCH_MISSING
    specs = ["torch:cpu"]
    for kind in ("cuda", "mlu"):
        try:
            _load_plugin(kind)
            mod = getattr(torch, kind, None)
            if mod is not None and mod.is_available():
                specs += [f"torch:{kind}:{i}" for i in range(mod.device_count())]
        except DeviceUnavailable:
            pass
    return specs, None


# torch device type -> the native backend (odma_hw's own kernels, the C shim) reading the same memory
NATIVE_BACKENDS = {"cpu": "host", "cuda": "cuda", "mlu": "mlu"}


def native_spec(spec: str) -> str | None:
    """The native device spec that reads the same memory as the torch device `spec` (with or
    without its 'torch:' prefix): torch:cpu -> host, torch:cuda -> cuda:0, torch:cuda:1 ->
    cuda:1, torch:mlu:0 -> mlu:0; None where odma-hw has no native backend for that memory."""
    if not isinstance(spec, str):
        return None
    kind, _, index = spec.strip().removeprefix("torch:").partition(":")
    backend = NATIVE_BACKENDS.get(kind)
    if backend is None or (index and not index.isdigit()):
        return None
    return "host" if backend == "host" else f"{backend}:{int(index or 0)}"


def measures_text(spec: str) -> str:
    """What a torch device's probe figures are, in one sentence: torch's kernels on the memory,
    not the memory's own rate (on an H100, 2026-11-26, index_select read random 32 B runs at 53
    GB/s and 4 KiB runs at 1,423, where the native probe streamed 3,059 GB/s and read 256 B - 4
    KiB runs at full speed), and the native device to probe instead, where odma-hw has one."""
    native = native_spec(spec)
    tail = (f"probe --device {native} measures the memory itself (odma-hw's native kernels)"
            if native else "odma-hw has no native backend for this memory")
    return (f"torch gather (index_select), torch sum and copy_: the rate torch's own kernels "
            f"reach on this memory, not the memory's rate; {tail}")


def open_device(arg: str) -> "TorchDevice":
    if torch is None:
        raise DeviceUnavailable(_TORCH_MISSING)
    kind = arg.split(":")[0]
    _load_plugin(kind)
    try:
        dev = torch.device(arg)
    except (RuntimeError, ValueError) as exc:
        raise BadArgument(f"unknown torch device {arg!r}: {exc}") from None
    if dev.type != "cpu":
        mod = getattr(torch, dev.type, None)
        if mod is None or not mod.is_available():
            raise DeviceUnavailable(f"torch:{arg}: torch reports no {dev.type} device")
        index = dev.index or 0
        if index >= mod.device_count():
            raise DeviceUnavailable(f"torch:{arg}: only {mod.device_count()} {dev.type} device(s)")
        dev = torch.device(dev.type, index)
    return TorchDevice(dev)


class TorchDevice(Device):
    alignment = 256  # what the CUDA caching allocator and most device kernels assume

    def __init__(self, dev):
        self.dev = dev
        self._mod = None if dev.type == "cpu" else getattr(torch, dev.type)
        if self._mod is None:
            total = free = mem_available()
            name = "torch CPU tensors"
        else:
            free, total = self._mod.mem_get_info(dev)
            name = self._mod.get_device_name(dev)
        self.info = DeviceInfo(
            spec=f"torch:{dev}", kind="torch", name=name, total_bytes=int(total),
            free_bytes=int(free), peak_gbps=None,
            natural_granule=32 if dev.type == "cuda" else 64, max_threads=1,
            details={"torch": torch.__version__, "device_type": dev.type,
                     "measures": measures_text(f"torch:{dev}"),
                     "native_device": native_spec(f"torch:{dev}")})

    # -- memory ------------------------------------------------------------------------------
    def _free_bytes(self) -> int:
        if self._mod is None:
            return mem_available()
        return int(self._mod.mem_get_info(self.dev)[0])

    def alloc(self, nbytes: int) -> Buffer:
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise BadArgument(f"buffer size must be a positive integer, got {nbytes!r}")
        if nbytes > self._free_bytes():
            raise BadArgument(f"{nbytes} bytes requested but only {self._free_bytes()} free on {self.spec}")
        try:
            t = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
        except RuntimeError as exc:  # the device's allocator refused
            raise DeviceError(f"{self.spec}: allocation of {nbytes} bytes failed: {exc}") from None
        return Buffer(self, t, nbytes)

    def free(self, buf: Buffer) -> None:
        self._check_range(buf, 0, 0)
        buf.handle = None
        buf.nbytes = 0

    def write(self, buf: Buffer, offset: int, data) -> None:
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else None
        self._check_range(buf, offset, 0 if src is None else src.numel())
        if src is not None:
            buf.handle[offset:offset + src.numel()].copy_(src)

    def read(self, buf: Buffer, offset: int, nbytes: int) -> bytes:
        self._check_range(buf, offset, nbytes)
        return buf.handle[offset:offset + nbytes].cpu().numpy().tobytes()

    def copy(self, dst: Buffer, dst_offset: int, src: Buffer, src_offset: int, nbytes: int) -> float:
        self._check_range(dst, dst_offset, nbytes)
        self._check_range(src, src_offset, nbytes)
        s = src.handle[src_offset:src_offset + nbytes]
        d = dst.handle[dst_offset:dst_offset + nbytes]
        if dst.handle is src.handle and abs(dst_offset - src_offset) < nbytes:
            s = s.clone()  # overlapping ranges: copy_ has no memmove guarantee
        return self._timed(lambda: d.copy_(s))

    def tensor(self, buf: Buffer, offset: int, nbytes: int):
        """The bytes [offset, offset+nbytes) of `buf` as a uint8 tensor view (no copy)."""
        self._check_range(buf, offset, nbytes)
        return buf.handle[offset:offset + nbytes]

    # -- timing ------------------------------------------------------------------------------
    def _sync(self):
        if self._mod is not None:
            self._mod.synchronize(self.dev)

    def _timed(self, fn) -> float:
        """Seconds for fn(): device events on accelerators, a synchronised clock on CPU."""
        if self._mod is not None and hasattr(self._mod, "Event"):
            start, end = self._mod.Event(enable_timing=True), self._mod.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        self._sync()
        t0 = time.perf_counter()
        fn()
        self._sync()
        return time.perf_counter() - t0

    def default_buffer_bytes(self, pattern: str) -> int:
        # devices.md rule 1: far above the last-level cache; capped so the probe fits in memory
        return min(1 << 30, self._free_bytes() // 4)

    def measure(self, pattern: str, granule: int = 64, threads: int = 1, *,
                buffer_bytes: int | None = None, reps: int = 5, seed: int = 1) -> Measurement:
        if pattern not in ("read", "copy", "rand"):
            raise BadArgument(f"unknown pattern {pattern!r}: expected read, copy or rand")
        if reps < 1:
            raise BadArgument("reps must be >= 1")
        size = buffer_bytes or self.default_buffer_bytes(pattern)
        if granule < 8 or granule & (granule - 1) or granule > size:
            raise BadArgument(f"granularity {granule} must be a power of two in [8, {size}]")
        buf = self.alloc(size)
        try:
            t = buf.handle
            t.fill_(1)
            if pattern == "read":
                # sum over int64 words reads every byte once; the result is kept
                words = t[: size // 8 * 8].view(torch.int64)
                fn, useful = (lambda: words.sum()), size // 8 * 8
            elif pattern == "copy":
                half = size // 2
                a, b = t[:half], t[half:2 * half]
                fn, useful = (lambda: b.copy_(a)), 2 * half
            else:
                rows = t[: size // granule * granule].view(-1, granule)
                n = rows.shape[0]
                count = min(n, max(1, (size // 4) // granule))
                gen = torch.Generator(device="cpu").manual_seed(seed)
                idx = torch.randint(0, n, (count,), generator=gen).to(self.dev)
                fn, useful = (lambda: torch.index_select(rows, 0, idx)), count * granule
            fn()  # untimed warm-up
            times = sorted(self._timed(fn) for _ in range(reps))
        finally:
            self.free(buf)
        method = {"read": "torch-sum", "copy": "torch-copy_", "rand": "torch-index_select"}[pattern]
        return Measurement(pattern, granule, torch.get_num_threads() if self._mod is None else 0,
                           size, float(useful), times[0], statistics.median(times), times[-1],
                           reps, method, {"torch": torch.__version__})
