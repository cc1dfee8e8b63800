"""What every KV allocator here stands on: the device pool, the table of live requests, and the
pin discipline that keeps bytes safe while requests move.

- DevicePool: one buffer of the pool's size on a Device (or none: accounting only). It opens the
  device when given a spec string and closes it again, frees the buffer on close() or when the
  pool is garbage collected, and never leaks an opened device when a constructor fails.
- PinnedBlock: a request's bytes. Every read or write pins the block for the length of its
  device transfer; a block being migrated refuses new writes (RequestBusy) and the migration
  waits for the writes already running, so a write either lands before the copy (and is copied)
  or is refused; it can never land in a block after its bytes were copied away. A block is freed
  only when no transfer is running on it, so a late read never sees another request's bytes.
- PoolAllocator: the part of the KVAllocator protocol that does not depend on how tokens map to
  bytes: the lock, the live table, release(), statistics counters, close().
"""

from __future__ import annotations

import math
import threading
import weakref

from odma_cli.errors import BadArgument
from odma_hw import devices as _devices
from odma_hw.devices.base import Device

from allocator.arguments import byte_data, count
from allocator.copier import StreamingCopier
from allocator.errors import (AllocatorClosed, DuplicateRequest, PoolTooLarge, RequestBusy,
                              StaleBlock, UnknownRequest)

LIVE, MIGRATING, DEAD = 0, 1, 2


def resolve_device(device) -> tuple[Device | None, bool]:
    """(the Device, whether we opened it and so must close it) for a Device, a spec string or
    None (accounting only: no bytes are stored)."""
    if isinstance(device, str):
        return _devices.open(device), True
    if device is not None and not isinstance(device, Device):
        raise BadArgument(f"device must be a Device, a spec string or None, got {device!r}")
    return device, False


def _release_device_memory(device, held: list, owns_device: bool) -> None:
    """Finalizer of a DevicePool: free the buffer, close a device the pool opened."""
    buf, held[0] = held[0], None
    try:
        if buf is not None and buf.nbytes:
            try:
                device.free(buf)
            except BadArgument:
                pass    # the device was closed first, and closing it freed the buffer
    finally:
        if owns_device and device is not None:
            device.close()


class DevicePool:
    """`nbytes` of device memory in one buffer. Offsets are bytes from the buffer's start."""

    def __init__(self, device, byte_alignment: int | None = None):
        self.device, owns = resolve_device(device)
        self.alignment = byte_alignment or (self.device.alignment if self.device else 64)
        self.nbytes = 0
        self._held: list = [None]
        self._close = weakref.finalize(self, _release_device_memory, self.device, self._held, owns)
        self._copier = None

    @property
    def buffer(self):
        return self._held[0]

    @property
    def holds_bytes(self) -> bool:
        return self._held[0] is not None

    def allocate(self, nbytes: int, copy_chunk_bytes: int | None = None) -> None:
        """Take the pool's memory (nothing on an accounting-only pool). On failure the pool is
        closed (a device it opened is closed again) and PoolTooLarge says why."""
        self.nbytes = nbytes
        dev = self.device
        if dev is None:
            return
        try:
            if nbytes > dev.info.total_bytes:
                raise PoolTooLarge(f"pool of {nbytes} B is larger than {dev.spec} "
                                   f"({dev.info.total_bytes} B)")
            try:
                self._held[0] = dev.alloc(nbytes)
            except BadArgument as exc:
                raise PoolTooLarge(f"pool of {nbytes} B does not fit on {dev.spec}: {exc}") from None
        except BaseException:
            self.close()
            raise
        self._copier = StreamingCopier(dev, copy_chunk_bytes)

    def write(self, at: int, data) -> None:
        self.device.write(self._held[0], at, data)

    def read(self, at: int, nbytes: int) -> bytes:
        return self.device.read(self._held[0], at, nbytes)

    def copy(self, dst: int, src: int, nbytes: int) -> float:
        """Streaming copy within the pool; the device's seconds (measured or modelled)."""
        buf = self._held[0]
        return self._copier.copy(buf, dst, buf, src, nbytes)

    def close(self) -> None:
        self._close()


class PinnedBlock:
    """Base of a request's block: the request's id and length, the high-water mark of bytes
    written, and the pins of running transfers. Subclasses say where bytes live (_spans)."""

    __slots__ = ("_owner", "request_id", "prompt_tokens", "tokens", "capacity_tokens", "written",
                 "_state", "_readers", "_writers")

    def __init__(self, owner, request_id, prompt_tokens: int, capacity_tokens: int):
        self._owner = owner
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.tokens = prompt_tokens
        self.capacity_tokens = capacity_tokens
        self.written = 0
        self._state = LIVE
        self._readers = 0
        self._writers = 0

    @property
    def device(self) -> Device | None:
        return self._owner.device

    @property
    def live(self) -> bool:
        return self._state == LIVE

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def _spans(self, offset: int, nbytes: int):
        """(pool offset, length, position in the caller's data) of each contiguous piece."""
        raise NotImplementedError

    def _usable(self, offset: int, nbytes: int, writing: bool, needs_bytes: bool = True) -> None:
        """Raise unless [offset, offset + nbytes) may be read (written) now. Lock held."""
        if self._owner._closed:
            raise AllocatorClosed(f"the allocator of request {self.request_id!r} is closed")
        if self._state == DEAD:
            raise StaleBlock(f"block of request {self.request_id!r} is stale (migrated or released)")
        if writing and self._state == MIGRATING:
            raise RequestBusy(f"request {self.request_id!r} is migrating; write after grow returns")
        if needs_bytes and not self._owner._pool.holds_bytes:
            raise BadArgument("this allocator is accounting-only (device=None): blocks hold no bytes")
        if offset + nbytes > self.nbytes:
            raise BadArgument(f"range [{offset}, {offset + nbytes}) is outside the "
                              f"{self.nbytes}-byte block")

    def _pin(self, offset: int, nbytes: int, writing: bool) -> None:
        """Check [offset, offset + nbytes) is usable and count a transfer on it."""
        owner = self._owner
        with owner._lock:
            self._usable(offset, nbytes, writing)
            if writing:
                self._writers += 1
            else:
                self._readers += 1
            owner._pinned += 1

    def pin(self, nbytes: int, writing: bool = False) -> "BlockPin":
        """Pin bytes [0, nbytes) for a transfer that bypasses read() and write() (a device copy
        into the block, a DMA out of it): while pinned the block is not freed (release waits)
        and, for a writer pin, not migrated away (grow waits; a block already migrating refuses
        the pin with RequestBusy). Release the pin exactly once, from any thread (`with` works).
        `location` is (Device, Buffer, offset) of the block's first byte."""
        return BlockPin(self, count("nbytes", nbytes), bool(writing))

    def _location(self):
        raise BadArgument(f"{type(self).__name__} is not one contiguous range: it cannot be pinned "
                          "for a raw transfer")

    def _unpin(self, writing: bool) -> None:
        """Lock held. Wake a migration or a release waiting for this block's transfers."""
        if writing:
            self._writers -= 1
        else:
            self._readers -= 1
        owner = self._owner
        owner._pinned -= 1
        if self._state != LIVE or owner._closed:
            owner._cond.notify_all()

    def write(self, data, offset: int = 0) -> None:
        """Copy bytes-like `data` into the block at `offset` (real bytes on the device). Raises
        RequestBusy while the request migrates (retry on the block grow() returns), StaleBlock
        after it migrated away or was released."""
        mv = byte_data(data)
        offset = count("offset", offset)
        n = mv.nbytes
        owner = self._owner
        self._pin(offset, n, writing=True)
        done = False
        try:
            pool = owner._pool
            for at, length, pos in self._spans(offset, n):
                pool.write(at, mv[pos:pos + length])
            done = True
        finally:
            with owner._lock:
                if done and offset + n > self.written:
                    self.written = offset + n
                self._unpin(writing=True)

    def read(self, nbytes: int, offset: int = 0) -> bytes:
        """`nbytes` bytes of the block from `offset`, read back from the device (allowed while the
        request migrates: the old block keeps its bytes until the switch)."""
        nbytes = count("nbytes", nbytes)
        offset = count("offset", offset)
        owner = self._owner
        self._pin(offset, nbytes, writing=False)
        try:
            pool = owner._pool
            return b"".join([pool.read(at, length) for at, length, _ in self._spans(offset, nbytes)])
        finally:
            with owner._lock:
                self._unpin(writing=False)

    def _tensor_at(self, at: int, room: int, dtype, shape):
        """A torch tensor of `dtype` and `shape` viewing pool bytes from `at`, which must lie in
        `room` bytes of this block's own storage (no copy; torch devices only)."""
        dev = self.device
        if dev is None or not hasattr(dev, "tensor"):
            raise BadArgument(f"tensor views need a torch device, not {getattr(dev, 'spec', None)}")
        import torch

        itemsize = torch.empty((), dtype=dtype).element_size()
        shape = tuple(count("shape", s) for s in shape)
        n = math.prod(shape) * itemsize
        owner = self._owner
        with owner._lock:
            self._usable(0, 0, writing=False)
        if n > room:
            raise BadArgument(f"a {n}-byte view does not fit the {room} bytes of request "
                              f"{self.request_id!r}'s range at {at}")
        if at % itemsize:
            raise BadArgument(f"pool offset {at} is not aligned to {dtype}")
        return dev.tensor(owner._pool.buffer, at, n).view(dtype).view(shape)

    def mark_written(self, nbytes: int) -> None:
        """Declare bytes [0, nbytes) written by other means (a tensor view, a kernel), so a
        migration copies them. Works on accounting-only pools too (a migration then counts the
        bytes it would have moved)."""
        nbytes = count("nbytes", nbytes)
        with self._owner._lock:
            self._usable(0, nbytes, writing=True, needs_bytes=False)
            if nbytes > self.written:
                self.written = nbytes


class BlockPin:
    """A transfer pin on a block (see PinnedBlock.pin)."""

    __slots__ = ("block", "writing", "location", "_held")

    def __init__(self, block: PinnedBlock, nbytes: int, writing: bool):
        block._location()             # a block that cannot be pinned raises before any count
        block._pin(0, nbytes, writing)
        self.block = block
        self.writing = writing
        self._held = True
        # read once pinned: a released or migrated-away block has refused the pin by now
        self.location = block._location()

    def release(self) -> None:
        with self.block._owner._lock:
            if not self._held:
                return
            self._held = False
            self.block._unpin(self.writing)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class PoolAllocator:
    """The shared half of a KV allocator: a DevicePool, the live table under one lock, release(),
    the completion counters, close(). Subclasses place blocks (reserve/grow) and free them
    (_free_storage), and may learn from completions (_completed)."""

    name = "?"

    def __init__(self, device, byte_alignment: int | None):
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._live: dict = {}
        self._closed = False
        self._pinned = 0              # transfers running on any block
        self._migrating = 0           # migrations whose copy is running
        self._pool = DevicePool(device, byte_alignment)
        self.completed = 0
        self.preemptions = 0          # releases with preempted=True
        self.used_tokens_sum = 0      # over completed requests: realized footprint
        self.reserved_tokens_sum = 0  # over completed requests: capacity of the final block
        self.oom_events = 0           # grow() found no room: the caller must preempt
        self.reserve_failures = 0     # reserve() found no room: admission must wait

    # -- shared state -------------------------------------------------------------------------
    @property
    def device(self) -> Device | None:
        return self._pool.device

    @property
    def alignment(self) -> int:
        return self._pool.alignment

    @property
    def holds_bytes(self) -> bool:
        """True when blocks hold real bytes on a device (False: accounting only)."""
        return self._pool.holds_bytes

    def pool_tensor(self):
        """The whole pool as a uint8 torch tensor (a view, no copy; torch devices only): what a
        paged kernel indexes with a block table."""
        dev = self.device
        if dev is None or not hasattr(dev, "tensor"):
            raise BadArgument(f"tensor views need a torch device, not {getattr(dev, 'spec', None)}")
        self._check_open()
        return dev.tensor(self._pool.buffer, 0, self._pool.nbytes)

    def _check_open(self) -> None:
        if self._closed:
            raise AllocatorClosed(f"this {self.name} allocator is closed")

    def _check_new(self, request_id) -> None:
        """Lock held: the allocator is open and `request_id` is a new, hashable id."""
        if self._closed:
            self._check_open()
        try:
            if request_id in self._live:
                raise DuplicateRequest(f"request {request_id!r} is already live")
        except TypeError:
            raise BadArgument(f"request id must be hashable, got {request_id!r}") from None

    def _lookup(self, request_id):
        """Lock held: the request's live block (RequestBusy while it migrates)."""
        if self._closed:
            self._check_open()
        try:
            blk = self._live.get(request_id)
        except TypeError:
            raise BadArgument(f"request id must be hashable, got {request_id!r}") from None
        if blk is None:
            raise UnknownRequest(f"request {request_id!r} is not live (never reserved or "
                                 f"already released)")
        if blk._state != LIVE:
            raise RequestBusy(f"request {request_id!r} is being migrated")
        return blk

    def _wait_idle(self, blk, writers_only: bool = False) -> None:
        """Lock held: wait until no transfer (no write, when writers_only) runs on `blk`."""
        while blk._writers or (not writers_only and blk._readers):
            self._cond.wait()

    def _check_growth(self, blk, total: int) -> None:
        """grow() may only lengthen a request, and never past max_tokens."""
        if total < blk.tokens:
            raise BadArgument(f"request {blk.request_id!r} holds {blk.tokens} tokens; cannot "
                              f"grow to {total}")
        if total > self.max_tokens:
            raise BadArgument(f"{total} tokens exceed max_tokens={self.max_tokens}")

    # -- the protocol's shared calls -------------------------------------------------------------
    def block(self, request_id):
        """The request's current block (after any migration)."""
        with self._lock:
            return self._lookup(request_id)

    def blocks(self, request_ids) -> list:
        """block() of each of `request_ids`, in order, looked up under one hold of the lock (a
        step looks up every running request's)."""
        with self._lock:
            return [self._lookup(i) for i in request_ids]

    def release(self, request_id, realized_tokens: int | None = None, *,
                preempted: bool = False) -> None:
        """Free the request's block. realized_tokens: tokens it generated (default: its length
        per the last grow minus its prompt); logged for learning. preempted=True: the request did
        not complete (it will be rerun), so its length is neither logged nor counted in
        utilization. Raises UnknownRequest (also on a second release), BadArgument."""
        realized = None if realized_tokens is None else count("realized_tokens", realized_tokens)
        with self._lock:
            blk = self._lookup(request_id)
            total = blk.tokens if realized is None else blk.prompt_tokens + realized
            if total > blk.capacity_tokens:
                raise BadArgument(f"request {request_id!r} cannot have generated {realized} "
                                  f"tokens: its block holds {blk.capacity_tokens} in all")
            del self._live[request_id]
            blk._state = DEAD
            if blk._readers or blk._writers:
                self._wait_idle(blk)      # a running read must not see the next owner's bytes
            self._free_storage(blk)
            if preempted:
                self.preemptions += 1
                return
            self.completed += 1
            self.used_tokens_sum += total
            self.reserved_tokens_sum += blk.capacity_tokens
        self._completed(blk, total)

    def _free_storage(self, blk) -> None:
        raise NotImplementedError

    def _completed(self, blk, total: int) -> None:
        """A request completed with `total` tokens (called outside the lock)."""

    def __len__(self) -> int:
        return len(self._live)

    def live_blocks(self) -> list:
        with self._lock:
            return list(self._live.values())

    def _counters(self) -> dict:
        """Lock held: the completion counters every allocator reports."""
        return {
            "completed": self.completed,
            "preemptions": self.preemptions,
            "utilization": (self.used_tokens_sum / self.reserved_tokens_sum
                            if self.reserved_tokens_sum else None),
            "oom_events": self.oom_events,
            "reserve_failures": self.reserve_failures,
        }

    # -- lifetime --------------------------------------------------------------------------------
    def _before_close(self) -> None:
        """Stop what the subclass runs (a refresher thread); called once, outside the lock."""

    def close(self) -> None:
        """Refuse new work, wait for running transfers and migrations, free the pool, close a
        device opened from a spec. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._pinned or self._migrating:
                self._cond.wait()
        try:
            self._before_close()
        finally:
            self._pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
