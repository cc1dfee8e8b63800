"""The numbers and keys of the small data files a user hands the simulator and the engine (device
cards, probe JSON files, engine profiles; odma_cli.docfile reads them), checked by one set of
rules, so that a card and a probe file refuse alike, in one line naming the file and the key.

A number must be a number of the file's format (not a boolean, not a string of digits) inside
the range its quantity allows. The ranges leave orders of magnitude to spare around any real
device, and keep every time the simulator derives from them a number of a few digits: a
bandwidth of 1e-300 GB/s would make one step last 1e300 seconds, and an integer of 400 digits
is no float at all. A table's keys (the rows of a matmul table, the run sizes of a probe file)
are positive integers written the one plain way ("64", not "064", "+64", " 64 " or "6_4"), so
no two keys of a table can name the same row.
"""

from __future__ import annotations

import dataclasses
import re

from odma_cli.errors import BadArgument

MAX_MATMUL_ROWS = 1 << 24           # rows (tokens) of one step's matrix products
MAX_RUN_BYTES = 1 << 40             # a run of contiguous reads no device memory exceeds


@dataclasses.dataclass(frozen=True)
class Range:
    """The numbers a quantity may take: low <= v <= high, v an int or a float (never a bool).
    Comparing an int with a float is exact in Python, so an integer too large for a float is
    simply out of range."""

    low: float
    high: float

    def __contains__(self, v) -> bool:
        return (isinstance(v, (int, float)) and not isinstance(v, bool)
                and self.low <= v <= self.high)         # NaN compares false: refused too

    def __str__(self) -> str:
        return f"a number in [{self.low:g}, {self.high:g}]"


BANDWIDTH_GBPS = Range(1e-3, 1e6)   # 1 MB/s .. 1 PB/s
TFLOPS = Range(1e-6, 1e6)           # 1 MFLOPS .. 1 EFLOPS
CAPACITY_GB = Range(1e-6, 1e6)      # 1 kB .. 1 PB
MICROSECONDS = Range(0.0, 1e6)      # an overhead or a latency: up to a second each
FRACTION = Range(1e-3, 1.0)         # an MFU: below a thousandth it measures nothing

_PLAIN_INTEGER = re.compile(r"[1-9][0-9]{0,17}")        # ASCII digits only, no sign or spaces


def shown(v) -> str:
    """`v` as a message quotes it: its repr, cut short where long (a 400-digit number)."""
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:24]}... ({len(text)} characters)"


def number(where: str, key: str, v, allowed: Range) -> float:
    """`v` (the value of `key` in the file `where` describes) as a float; BadArgument unless it
    is a number in `allowed`."""
    if v not in allowed:
        raise BadArgument(f"{where}: {key!r} must be {allowed}, got {shown(v)}")
    return float(v)


def table(where: str, key: str, v, max_key: int, allowed: Range) -> dict[int, float]:
    """`v`, a non-empty table of plain positive integer keys (at most `max_key`) to numbers in
    `allowed`, as {int: float} in the keys' order; BadArgument naming the key otherwise."""
    if not isinstance(v, dict) or not v:
        raise BadArgument(f"{where}: {key!r} must be a non-empty table of integer keys (quoted) "
                          f"to numbers, got {shown(v)}")
    out = {}
    for k, x in v.items():
        if not (isinstance(k, str) and _PLAIN_INTEGER.fullmatch(k) and int(k) <= max_key):
            raise BadArgument(f"{where}: {key!r} has key {shown(k)}: its keys must be integers "
                              f"from 1 to {max_key} written plainly (no sign, spaces, "
                              f"underscores or leading zeros)")
        if x not in allowed:
            raise BadArgument(f"{where}: {key!r} at {k}: must be {allowed}, got {shown(x)}")
        out[int(k)] = float(x)
    return dict(sorted(out.items()))
