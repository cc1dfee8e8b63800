"""Where a prefix cache's bytes live and how they move between devices.

- tier_devices: the memory the device and host tiers live in.
- host_tier_device: the memory the host tier lives in, for a serving device: the serving device
  itself when it is CPU tensors (`torch:cpu`), pinned CPU tensors for a torch accelerator,
  LazyHostMemory otherwise (the native `host` device included: its buffers are touched page by
  page when allocated, which for tiers of many GiB takes seconds per GiB).
- LazyHostMemory: host DRAM mapped but not touched, so a tier takes memory as prefixes fill it.
- move: one transfer between two (Device, Buffer, offset) places, with the checksum of the bytes
  moved computed in the same pass where both sides are host memory.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import time

import numpy as np

from odma_cli.errors import BadArgument, DeviceError
from odma_hw import devices as _devices
from odma_hw import native
from odma_hw.devices.host import HostDevice

from allocator.prefix.kernels import copy_digest, digest


def host_view(device, buf, offset: int, nbytes: int) -> np.ndarray | None:
    """A uint8 numpy view of bytes [offset, offset + nbytes) of `buf` when they are host memory
    the process can address (the native host device, CPU torch tensors); None otherwise. The
    caller keeps the buffer alive (pinned) while it uses the view."""
    if not is_host_memory(device):
        return None
    if device.info.kind == "host":
        ffi, _ = native.require()
        return np.frombuffer(ffi.buffer(ffi.cast("char *", buf.handle + offset), nbytes), np.uint8)
    return buf.handle[offset:offset + nbytes].numpy()


def is_host_memory(device) -> bool:
    """Whether `device`'s buffers are host memory this process addresses directly."""
    kind = device.info.kind
    return kind == "host" or (kind == "torch" and device.dev.type == "cpu")


def _pinned_torch_host():
    """A TorchDevice over page-locked CPU tensors (DMA-able by the accelerator without staging);
    plain CPU tensors where the runtime cannot pin."""
    from odma_hw.devices.base import Buffer
    from odma_hw.devices.torch_device import TorchDevice, torch

    class PinnedHostMemory(TorchDevice):
        def __init__(self):
            super().__init__(torch.device("cpu"))
            self.pinned = True
            self.info.spec = "torch:cpu(pinned)"
            self.info.name = "page-locked host memory (torch pin_memory)"

        def alloc(self, nbytes: int) -> Buffer:
            if not isinstance(nbytes, int) or nbytes <= 0:
                raise BadArgument(f"buffer size must be a positive integer, got {nbytes!r}")
            if self.pinned:
                try:
                    return Buffer(self, torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
                                  nbytes)
                except RuntimeError:
                    self.pinned = False     # no pinning runtime: pageable memory still works
                    self.info.details["pinned"] = False
            try:
                return Buffer(self, torch.empty(nbytes, dtype=torch.uint8), nbytes)
            except RuntimeError as exc:
                raise DeviceError(f"host tier: allocation of {nbytes} bytes failed: {exc}") from None

    return PinnedHostMemory()


class _Mappings:
    """Address -> anonymous mapping of every live LazyHostMemory buffer. The device's table of
    live buffers frees through unmap(), from finalizers too, so this must not reference the
    device."""

    def __init__(self):
        self._maps: dict[int, mmap.mmap] = {}
        self._lock = threading.Lock()

    def map(self, nbytes: int) -> int:
        try:
            m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError, OverflowError) as exc:
            raise DeviceError(f"host tier: mapping {nbytes} bytes failed: {exc}") from None
        with contextlib.suppress(AttributeError, OSError, ValueError):
            m.madvise(mmap.MADV_HUGEPAGE)    # what the native host buffers ask for too
        view = np.frombuffer(m, np.uint8)
        addr = view.ctypes.data
        del view                             # no export may be left, or close() cannot unmap
        with self._lock:
            self._maps[addr] = m
        return addr

    def unmap(self, addr: int, nbytes: int) -> None:
        with self._lock:
            m = self._maps.pop(addr, None)
        if m is not None:
            m.close()


class LazyHostMemory(HostDevice):
    """Host DRAM whose buffers are anonymous mappings nobody touches up front: the kernel gives a
    page on its first write, so a host tier of many GiB is ready at once and takes memory only as
    prefixes are stored in it. Everything else (addresses as handles, the native streaming copy,
    the size check against available memory) is the host device's."""

    def __init__(self):
        super().__init__()
        self.info.spec = "host(lazy)"
        self.info.details["pages"] = "mapped on first write"

    def _init_memory(self, free_fn) -> None:
        self._maps = _Mappings()
        super()._init_memory(self._maps.unmap)

    def _alloc_raw(self, nbytes: int) -> int:
        addr = self._maps.map(nbytes)
        self._live.add(addr, nbytes)
        return addr


def tier_devices(serving, device_tier: bool, host_tier: bool):
    """(Device of the device tier, Device of the host tier, devices opened here that the cache
    must close); None for a tier not asked for. The device tier is on the serving device, in
    LazyHostMemory when that is the native host device (the same DRAM, without touching every
    page when the tier is made); the host tier as host_tier_device says."""
    owned: list = []
    dev_tier = host = None
    try:
        if device_tier:
            if serving.info.kind == "host":
                dev_tier = LazyHostMemory()
                owned.append(dev_tier)
            else:
                dev_tier = serving
        if host_tier:
            if isinstance(dev_tier, LazyHostMemory):
                host = dev_tier
            else:
                host, owns = host_tier_device(serving)
                if owns:
                    owned.append(host)
    except BaseException:
        while owned:
            owned.pop().close()
        raise
    return dev_tier, host, owned


def host_tier_device(serving):
    """(Device for the host tier, whether the cache opened it and must close it)."""
    if is_host_memory(serving) and serving.info.kind != "host":
        return serving, False                # CPU tensors: torch.empty touches no page
    if serving.info.kind == "torch":
        return _pinned_torch_host(), True
    if native.available():
        return LazyHostMemory(), True
    return _devices.open("torch:cpu"), True


def move(src, dst, nbytes: int, checksum: bool) -> tuple[float, float | None, bytes | None]:
    """Copy `nbytes` from src to dst, each (Device, Buffer, offset), not overlapping. Returns
    (wall seconds, the device's own seconds when Device.copy did it (modelled on emulated
    devices), checksum of the bytes moved when `checksum` else None). Raises what the devices
    raise; a torch runtime failure of a cross-device copy as DeviceError."""
    sdev, sbuf, soff = src
    ddev, dbuf, doff = dst
    t0 = time.perf_counter()
    dev_seconds = None
    got = None
    sv = host_view(sdev, sbuf, soff, nbytes)
    dv = host_view(ddev, dbuf, doff, nbytes)
    if sv is not None and dv is not None and (checksum or sdev is not ddev):
        got = copy_digest(dv, sv)                   # one pass: streaming copy + checksum
        if not checksum:
            got = None
    elif sdev is ddev:                              # same device: both views or neither
        dev_seconds = sdev.copy(dbuf, doff, sbuf, soff, nbytes)
        if checksum:
            got = digest(dv if dv is not None else ddev.read(dbuf, doff, nbytes))
    elif sdev.info.kind == "torch" and ddev.info.kind == "torch":
        if checksum and sv is not None:
            got = digest(sv)                        # host -> accelerator: check before the DMA
        try:
            dbuf.handle[doff:doff + nbytes].copy_(sbuf.handle[soff:soff + nbytes])
        except RuntimeError as exc:                 # e.g. a CUDA error: the project's error
            raise DeviceError(f"copy of {nbytes} bytes from {sdev.spec} to {ddev.spec} "
                              f"failed: {exc}") from None
        if checksum and got is None:
            got = digest(dv if dv is not None else ddev.read(dbuf, doff, nbytes))
    else:                                           # through host memory: read, then write
        data = sv if sv is not None else sdev.read(sbuf, soff, nbytes)
        if checksum:
            got = digest(data)
        ddev.write(dbuf, doff, data)
    return time.perf_counter() - t0, dev_seconds, got
