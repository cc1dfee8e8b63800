"""One validation rule for every argument the allocators take from a caller.

- a *count* (tokens, bytes, offsets) is an integer >= 0: a Python int or a numpy integer; never a
  bool, a float (not even 10.0), a string or bytes;
- an *amount* (a predicted length, an uncertainty) is a real number >= 0: an int, a float or a
  numpy number; never a bool, a string or bytes; NaN never, infinity only where it means
  something (an uncertainty of inf = "no idea");
- *data* is a bytes-like object (anything with the buffer protocol: bytes, bytearray, memoryview,
  a numpy array).

Every refusal is a BadArgument naming the argument, so a caller's mistake never surfaces as a raw
TypeError or ValueError from deep inside, and never changes state.
"""

from __future__ import annotations

import math
import numbers
import operator

from odma_cli.errors import BadArgument

_INF = math.inf


def count(name: str, v) -> int:
    """A non-negative integer."""
    if type(v) is int:                 # the hot path: a plain int
        if v >= 0:
            return v
        raise BadArgument(f"{name} must be >= 0, got {v}")
    if isinstance(v, (bool, float, str, bytes, bytearray)):
        raise BadArgument(f"{name} must be an integer, got {v!r}")
    try:
        v = operator.index(v)
    except TypeError:
        raise BadArgument(f"{name} must be an integer, got {_show(v)}") from None
    if v < 0:
        raise BadArgument(f"{name} must be >= 0, got {v}")
    return v


def positive_count(name: str, v) -> int:
    """An integer > 0."""
    v = count(name, v)
    if v == 0:
        raise BadArgument(f"{name} must be > 0")
    return v


def amount(name: str, v, allow_inf: bool = False) -> float:
    """A real number >= 0 (NaN refused; infinity only when allowed)."""
    t = type(v)
    if t is int:
        v = float(v)
    elif t is not float:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise BadArgument(f"{name} must be a number, got {_show(v)}")
        v = float(v)
    if v >= 0 and (v != _INF or allow_inf):   # NaN fails `v >= 0`
        return v
    raise BadArgument(f"{name} must be a {'' if allow_inf else 'finite '}number >= 0, got {v!r}")


def byte_data(data) -> memoryview:
    """`data` as a flat byte view."""
    if isinstance(data, str):
        raise BadArgument("data must be bytes-like, not str (encode it first)")
    try:
        mv = memoryview(data)
    except TypeError:
        raise BadArgument(f"data must be bytes-like, got {_show(data)}") from None
    try:
        return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    except TypeError:
        raise BadArgument("data must be a contiguous bytes-like object") from None


def _show(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else f"a {type(v).__name__}"
