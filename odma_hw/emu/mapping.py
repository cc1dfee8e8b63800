"""Physical address -> (channel, bank, row), and requests -> per-channel accesses.

Channels: the controller interleaves every `interleave_bytes` across N channels (N need not be a
power of two: MLU370-X4 has 24). Inside a channel the burst index is split into fields, LSB first:

- ``bg`` (default, bank-group interleaving, like Ramulator's MOP4CLXOR without the XOR):
  column-chunk | bank group | bank | rest of column | row. A `chunk` (64 B by default: two BL16
  or one BL32) stays in one row, so consecutive chunks rotate through the bank groups and a
  sequential stream never waits for tCCD_L.
- ``rbc`` (row-bank-column): column | bank | bank group | row. A whole page stays in one bank and
  consecutive pages stay in one bank group (the "sequential kept in one bank group" case).
- ``xor``: ``bg`` with the bank-group and bank fields XORed with the low row bits (permutation
  interleaving), which spreads strided conflicts.

A request of G bytes is cut into *accesses*: maximal runs of consecutive bursts in the same
channel, bank and row. The engine queues accesses.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numba import njit

from odma_cli.errors import BadArgument
from odma_hw.emu.specs import DeviceSpec

MAP_BG, MAP_RBC, MAP_XOR = 0, 1, 2
MAPS = {"bg": MAP_BG, "rbc": MAP_RBC, "xor": MAP_XOR}


@dataclasses.dataclass(frozen=True)
class AddressMap:
    kind: int
    channels: int
    interleave: int
    burst_bytes: int
    chunk_bits: int   # bursts per chunk = 2**chunk_bits
    bg_bits: int
    ba_bits: int
    col_bits: int     # bursts per page = 2**col_bits
    row_bits: int


def _log2(x: int) -> int:
    return x.bit_length() - 1


def address_map(dev: DeviceSpec, name: str = "bg", chunk_bytes: int = 64) -> AddressMap:
    if name not in MAPS:
        raise BadArgument(f"unknown address map {name!r}: expected one of {', '.join(MAPS)}")
    org = dev.channel.org
    burst = org.burst_bytes
    chunk = max(chunk_bytes, burst)
    if chunk & (chunk - 1) or chunk > org.page_bytes:
        raise BadArgument(f"column chunk must be a power of two between the burst and the page, "
                          f"not {chunk_bytes}")
    for what, v in (("channel interleave", dev.interleave_bytes), ("burst", burst)):
        if v & (v - 1):
            raise BadArgument(f"{what} must be a power of two bytes, not {v}")
    return AddressMap(MAPS[name], dev.channels, dev.interleave_bytes, burst,
                      _log2(chunk // burst), _log2(org.bank_groups), _log2(org.banks_per_group),
                      _log2(org.page_bytes // burst), _log2(org.rows))


@njit(cache=True, inline="always")
def _locate(a, kind, nch, gran_shift, burst_shift, chunk_bits, bg_bits, ba_bits, col_bits,
            row_bits):
    """byte address -> (channel, bank, row). Granule and burst are powers of two (shifts); the
    channel count need not be (MLU370-X4 has 24), so one division remains."""
    g = a >> gran_shift
    q = g // nch
    ch = g - q * nch
    la = (q << gran_shift) | (a & ((1 << gran_shift) - 1))
    bi = la >> burst_shift
    ngm = (1 << bg_bits) - 1
    nbm = (1 << ba_bits) - 1
    if kind == MAP_RBC:
        x = bi >> col_bits
        ba = x & nbm
        x >>= ba_bits
        bg = x & ngm
        x >>= bg_bits
        row = x
    else:
        x = bi >> chunk_bits
        bg = x & ngm
        x >>= bg_bits
        ba = x & nbm
        x >>= ba_bits
        row = x >> (col_bits - chunk_bits)
        if kind == MAP_XOR:
            bg ^= row & ngm
            ba ^= (row >> bg_bits) & nbm
    row &= (1 << row_bits) - 1
    return ch, (bg << ba_bits) + ba, row


def segment_bytes(amap: AddressMap) -> int:
    """Channel, bank and row are constant over each aligned piece of this many bytes: the
    smaller of the channel granule and the run of bursts that share a row (a column chunk, or
    the whole page for the row-bank-column map)."""
    run_bits = amap.col_bits if amap.kind == MAP_RBC else amap.chunk_bits
    return min(amap.interleave, amap.burst_bytes << run_bits)


def max_accesses(amap: AddressMap, nbytes: int, aligned: bool) -> int:
    """The most accesses one request of `nbytes` bytes becomes: one per segment it touches
    (`aligned`: the request starts on a multiple of its power-of-two size)."""
    seg = segment_bytes(amap)
    pieces = -(-nbytes // seg)
    if aligned and (nbytes % seg == 0 or seg % nbytes == 0):
        return pieces
    return pieces + 1


@njit(cache=True)
def _decompose(addr, size, write, kind, nch, gran_shift, burst_shift, chunk_bits, bg_bits,
               ba_bits, col_bits, row_bits, seg_shift, count_only, fill, out_bank, out_row,
               out_bursts, out_write, counts):
    # Step segment by segment (segment_bytes()), not burst by burst. count_only: add each
    # channel's accesses to `counts`; else write them at fill[channel] onwards and advance fill.
    seg = np.int64(1) << seg_shift
    burst_mask = (np.int64(1) << burst_shift) - 1
    for i in range(addr.shape[0]):
        # the device moves whole bursts: an unaligned request costs every burst it touches
        a = addr[i] & ~burst_mask
        stop = (addr[i] + size[i] + burst_mask) & ~burst_mask
        pch, pb, pr = -1, -1, -1
        k = -1
        while a < stop:
            nxt = min(((a >> seg_shift) << seg_shift) + seg, stop)
            nb = (nxt - a) >> burst_shift
            ch, b, r = _locate(a, kind, nch, gran_shift, burst_shift, chunk_bits, bg_bits,
                               ba_bits, col_bits, row_bits)
            if ch != pch or b != pb or r != pr:
                if count_only:
                    counts[ch] += 1
                else:
                    k = fill[ch]
                    fill[ch] = k + 1
                    out_bank[k] = b
                    out_row[k] = r
                    out_bursts[k] = nb
                    out_write[k] = write[i]
                pch, pb, pr = ch, b, r
            elif not count_only:
                out_bursts[k] += nb
            a = nxt


# Requests per call of the Numba pass: each call takes well under 0.1 s, so Ctrl-C during the
# decomposition of a very long trace is honoured at once (it is raised between calls).
_CHUNK = 1 << 22


def decompose(amap: AddressMap, addr: np.ndarray, size: np.ndarray, write: np.ndarray):
    """Requests (byte address, size, is-write) -> CSR per channel: offsets (channels + 1) and
    access arrays bank, row, bursts, write (channel-major, trace order within a channel)."""
    args = (amap.kind, amap.channels, _log2(amap.interleave), _log2(amap.burst_bytes),
            amap.chunk_bits, amap.bg_bits, amap.ba_bits, amap.col_bits, amap.row_bits,
            _log2(segment_bytes(amap)))
    counts = np.zeros(amap.channels, np.int64)
    z32 = np.zeros(0, np.int32)
    z8 = np.zeros(0, np.uint8)
    n = addr.shape[0]
    for lo in range(0, n, _CHUNK):
        hi = min(n, lo + _CHUNK)
        _decompose(addr[lo:hi], size[lo:hi], write[lo:hi], *args, True, counts, z32, z32, z32,
                   z8, counts)
    offsets = np.zeros(amap.channels + 1, np.int64)
    offsets[1:] = np.cumsum(counts)
    total = int(offsets[-1])
    bank = np.empty(total, np.int32)
    row = np.empty(total, np.int32)
    bursts = np.empty(total, np.int32)
    wr = np.empty(total, np.uint8)
    fill = offsets[:-1].copy()
    for lo in range(0, n, _CHUNK):
        hi = min(n, lo + _CHUNK)
        _decompose(addr[lo:hi], size[lo:hi], write[lo:hi], *args, False, fill, bank, row,
                   bursts, wr, counts)
    return offsets, bank, row, bursts, wr
