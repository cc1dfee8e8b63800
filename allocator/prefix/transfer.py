"""Moving a prefix's bytes between tiers and into request blocks, checked, and what that costs.

Integrity
---------
Bytes in host memory carry a checksum (kernels.py), computed in the pass that brings them there.
Disk reads are always checked; host-tier reads are checked when `verify` (default). A mismatch
drops the entry (counted as corrupt) and the restore returns 0 tokens: the caller recomputes, and
bad bytes are never reported as a prefix. Bytes bound for a request's block that holds bytes of
its own (Block.written) are checked before they are copied (one more read of them), so a bad entry
leaves the request's bytes as they were; bytes bound for a fresh block or a tier are checked in
the pass that copies them. A promotion copies from the request's block, whose bytes the restore
just checked, and does not check them again on the device.

Seconds
-------
A transfer's seconds are wall-clock on real devices (host, torch, CUDA, MLU); modelled from
TierBandwidth in accounting mode (device=None) and on emulated devices (whose own Device.copy
models device-internal copies).
"""

from __future__ import annotations

import dataclasses
import math
import time

from odma_cli.errors import BadArgument, DeviceError

from allocator.prefix import disk
from allocator.prefix.index import Entry
from allocator.prefix.kernels import copy_digest, digest
from allocator.prefix.memory import host_view


def _bandwidth(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
        raise BadArgument(f"{name} must be a finite number > 0 (GB/s), got {v!r}")
    return float(v)


@dataclasses.dataclass(frozen=True)
class TierBandwidth:
    """Bandwidths in GB/s (1e9 B/s) that modelled seconds are computed from (accounting mode,
    emulated devices). device_copy_gbps counts read + write, as a streaming copy's bandwidth is
    quoted here (odma-hw probe's `copy`, the serving timing's copy_gbps): copying n bytes within
    the device takes 2n / device_copy_gbps. Links count the bytes moved once."""

    device_copy_gbps: float
    host_to_device_gbps: float = 25.0    # PCIe 4.0 x16 effective (MLU370-X4)
    device_to_host_gbps: float = 25.0
    disk_read_gbps: float = 3.0          # an NVMe SSD
    disk_write_gbps: float = 2.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _bandwidth(f.name, getattr(self, f.name))

    def seconds(self, src: str, dst: str, nbytes: int) -> float:
        """Modelled seconds to move `nbytes` from `src` to `dst`, each a tier name or "request"
        (a request's block: device memory). Disk <-> device goes through host memory, one hop
        after the other."""
        on_device = ("request", "device")
        g = 1e9
        if src in on_device and dst in on_device:
            return 2 * nbytes / (self.device_copy_gbps * g)
        s = 0.0
        if src == "disk":
            s += nbytes / (self.disk_read_gbps * g)
        if dst == "disk":
            s += nbytes / (self.disk_write_gbps * g)
        if src in on_device:
            s += nbytes / (self.device_to_host_gbps * g)
        if dst in on_device:
            s += nbytes / (self.host_to_device_gbps * g)
        return s


class TransferFailed(Exception):
    """A transfer that failed for a reason the cache counts: args = (drop reason, seconds it
    spent)."""


class Transfers:
    """PrefixCache's byte moves (a mixin: the state is made by PrefixCache.__init__). They take no
    lock: the caller has marked the entry moving or pinned it, and pinned the request's block
    (BlockPin), so nothing else changes either side while the bytes move. holds_bytes is False in
    accounting mode (nothing moves, seconds are modelled); _modelled says seconds come from
    `bandwidth`; _copy (PrefixCache's) copies between two (Device, Buffer, offset) places."""

    def _transfer(self, e: Entry, src: str, src_storage, dst: str, dst_storage,
                  nbytes: int | None = None) -> float:
        """Move e's first `nbytes` (default all) from src to dst ("request", a tier name; the
        storage is a Block, a file path or a BlockPin of a request block). Returns seconds;
        raises TransferFailed(reason, seconds spent) when the bytes are bad or a device or file
        failed. Sets e.checksum when the bytes arrive in host memory."""
        n = e.nbytes if nbytes is None else nbytes
        if not self.holds_bytes:
            return self.bandwidth.seconds(src, dst, n)
        pins: list = []
        t0 = time.perf_counter()
        reason = None
        try:
            dev_s = self._transfer_bytes(e, src, src_storage, dst, dst_storage, n, pins)
        except TransferFailed as exc:
            reason, cause = exc.args[0], exc
        except (OSError, DeviceError) as exc:
            reason, cause = "io_error", exc
        except disk.CorruptFile as exc:
            reason, cause = "corrupt", exc
        finally:
            for pin in pins:
                pin.release()
        wall = time.perf_counter() - t0
        if reason is not None:
            raise TransferFailed(reason, self._seconds(src, dst, n, wall, None)) from cause
        return self._seconds(src, dst, n, wall, dev_s)

    def _seconds(self, src: str, dst: str, n: int, wall: float, dev_s: float | None) -> float:
        """What a transfer cost: wall-clock on real devices; on emulated ones the device's own
        model of an internal copy, TierBandwidth for the rest."""
        if not self._modelled:
            return wall
        if dev_s is not None and src in ("request", "device") and dst in ("request", "device"):
            return dev_s
        return self.bandwidth.seconds(src, dst, n)

    def _account(self, src: str, dst: str, nbytes: int, seconds: float) -> None:
        """Lock held. Count a transfer's bytes and seconds under its pair ("host->request")."""
        pair = f"{src}->{dst}"
        self.moved_bytes[pair] += nbytes
        self.moved_seconds[pair] += seconds

    @staticmethod
    def _place(kind: str, storage, n: int, pins: list, writing: bool):
        """(Device, Buffer, offset) of a request block (`storage` is its BlockPin) or of a tier
        block (pinned here; the pin goes to `pins`)."""
        if kind == "request":
            return storage.location
        pin = storage.pin(n, writing)
        pins.append(pin)
        return pin.location

    def _transfer_bytes(self, e, src, src_storage, dst, dst_storage, n, pins):
        """The byte-moving half of _transfer; returns the device's own seconds when one
        Device.copy did the move, else None."""
        whole = n == e.nbytes
        # Bytes bound for a request's block that holds bytes of its own (below its `written` mark,
        # which is also all a migration keeps) are checked before they are copied: a bad entry
        # must leave the request's bytes as they were. Into a fresh block, or a tier's fresh room,
        # the one-pass copy + checksum is enough: bad bytes there are never reported as a prefix.
        # A partial copy needs the whole entry's sum first in any case.
        check_first = not whole or (dst == "request" and dst_storage.block.written > 0)
        if src == "disk":
            expect = disk.FileHeader(e.key, e.tokens, e.nbytes, self.bytes_per_token, e.checksum)
            to = self._place(dst, dst_storage, n, pins, writing=True)

            def consume(payload):
                view = host_view(*to, n)
                if view is not None and not check_first:
                    return copy_digest(view, payload)      # one pass: copy + checksum
                got = digest(payload)
                if got == e.checksum:
                    if view is None:
                        to[0].write(to[1], to[2], payload[:n])
                    else:
                        copy_digest(view, payload[:n])     # for its parallel streaming copy
                return got

            if disk.read_payload(src_storage, expect, consume) != e.checksum:
                raise TransferFailed("corrupt")
            return None
        frm = self._place(src, src_storage, n, pins, writing=False)
        if dst == "disk":
            data = host_view(*frm, n)
            if data is None:
                data = frm[0].read(frm[1], frm[2], n)
            # host bytes keep their checksum (a host-side corruption fails the file's check on
            # read); bytes straight from the device are summed here, first time in host memory
            checksum = e.checksum if src == "host" else digest(data)
            header = disk.pack_header(e.key, e.tokens, e.nbytes, self.bytes_per_token, checksum)
            disk.write_file(dst_storage, header, data)
            e.checksum = checksum
            return None
        to = self._place(dst, dst_storage, n, pins, writing=True)
        check = src == "host" and self.verify and e.checksum is not None
        if check and check_first:
            entire = self._place(src, src_storage, e.nbytes, pins, False)
            if digest(host_view(*entire, e.nbytes)) != e.checksum:
                raise TransferFailed("corrupt")
            return self._copy(frm, to, n, checksum=False)[1]
        _, dev_s, got = self._copy(frm, to, n, checksum=check or dst == "host")
        if check and got != e.checksum:
            raise TransferFailed("corrupt")
        if dst == "host":
            e.checksum = got
        return dev_s
