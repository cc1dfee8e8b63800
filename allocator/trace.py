"""Request-length traces: what `odma-hw replay` and `odma-hw simulate` read.

A trace is one row per request: num_prefill_tokens (prompt), num_decode_tokens (generated), and
optionally arrived_at (seconds). For prefix caching a row may also name the prefix its prompt
starts with: prefix_id (any text) and prefix_tokens (how many prompt tokens it covers), and
offer_id: the key under which the request's whole context (prompt + generated) is offered to the
cache when it completes (a chat turn offers the history the next turn starts with). Everything is checked when the file is read, so a bad trace is
one clear line before any work starts: counts are whole numbers in [0, MAX_REQUEST_TOKENS],
arrival times are finite and span at most MAX_SPAN_SECONDS (a span beyond that is a unit mistake,
and would overflow the step counters).
"""

from __future__ import annotations

import csv
import math
import os

import numpy as np

from odma_hw.errors import BadArgument

# No model serves a request longer than this; a larger count is a corrupt trace.
MAX_REQUEST_TOKENS = 10_000_000
# Thirty days of simulated time: the public traces span an hour; beyond this is a unit mistake.
MAX_SPAN_SECONDS = 30 * 24 * 3600.0
PROMPT, GENERATED, ARRIVAL = "num_prefill_tokens", "num_decode_tokens", "arrived_at"
PREFIX_ID, PREFIX_TOKENS, OFFER_ID = "prefix_id", "prefix_tokens", "offer_id"


class RequestTrace:
    """Token counts of a request trace: prompt[i], generated[i], arrival[i] (seconds, or None
    when the trace has no arrival times); prefix_id[i] / prefix_tokens[i] / offer_id[i] when the
    trace names prefixes (None, or "" for a request without one)."""

    def __init__(self, prompt, generated, arrival=None, name="trace", *, prefix_id=None,
                 prefix_tokens=None, offer_id=None):
        self.name = name
        try:
            self.prompt = _counts(prompt, "prompt")
            self.generated = _counts(generated, "generated")
            self.arrival = None if arrival is None else np.asarray(arrival, dtype=np.float64)
        except (TypeError, ValueError, OverflowError) as exc:
            raise BadArgument(f"{name}: token counts and arrival times must be numbers ({exc})") \
                from None
        n = len(self.prompt)
        if n == 0 or len(self.generated) != n or (self.arrival is not None
                                                  and len(self.arrival) != n):
            raise BadArgument(f"{name}: a trace needs the same, non-zero number of prompt, "
                              f"generated (and arrival) values")
        for what, v in (("prompt", self.prompt), ("generated", self.generated)):
            if (v < 0).any() or (v > MAX_REQUEST_TOKENS).any():
                i = int(np.flatnonzero((v < 0) | (v > MAX_REQUEST_TOKENS))[0])
                raise BadArgument(f"{name}: request {i} has {v[i]} {what} tokens: counts must lie "
                                  f"in [0, {MAX_REQUEST_TOKENS}]")
        if self.arrival is not None:
            if not np.isfinite(self.arrival).all():
                raise BadArgument(f"{name}: arrival times must be finite numbers")
            span = float(self.arrival.max() - self.arrival.min())
            if span > MAX_SPAN_SECONDS:
                raise BadArgument(f"{name}: arrival times span {span:.3g} s, more than the "
                                  f"{MAX_SPAN_SECONDS:.0f} s (30 days) a simulation covers: "
                                  f"are they in seconds?")
        self.prefix_id = self.prefix_tokens = self.offer_id = None
        if prefix_id is not None or offer_id is not None:
            self.prefix_id = [str(x) if x else "" for x in (prefix_id or [""] * n)]
            self.offer_id = [str(x) if x else "" for x in (offer_id or [""] * n)]
            self.prefix_tokens = _counts([0] * n if prefix_tokens is None else prefix_tokens,
                                         "prefix")
            if len(self.prefix_id) != n or len(self.offer_id) != n or len(self.prefix_tokens) != n:
                raise BadArgument(f"{name}: prefix columns need one value per request")
            bad = np.flatnonzero((self.prefix_tokens > self.prompt)
                                 | ((self.prefix_tokens > 0) != np.array([bool(x) for x in
                                                                          self.prefix_id])))
            if bad.size:
                i = int(bad[0])
                raise BadArgument(f"{name}: request {i} has prefix {self.prefix_id[i]!r} of "
                                  f"{self.prefix_tokens[i]} tokens in a {self.prompt[i]}-token "
                                  f"prompt (a named prefix covers 1..prompt tokens)")

    def __len__(self):
        return len(self.prompt)

    def head(self, n: int) -> "RequestTrace":
        """The first n requests."""
        cut = (lambda v: None if v is None else v[:n])
        return RequestTrace(self.prompt[:n], self.generated[:n], cut(self.arrival),
                            f"{self.name}[:{n}]", prefix_id=cut(self.prefix_id),
                            prefix_tokens=cut(self.prefix_tokens), offer_id=cut(self.offer_id))


def _counts(values, what) -> np.ndarray:
    a = np.asarray(values)
    if a.dtype.kind == "f":
        if not np.isfinite(a).all() or (a != np.floor(a)).any():
            raise BadArgument(f"{what} token counts must be whole numbers")
    elif a.dtype.kind not in "iu":
        raise BadArgument(f"{what} token counts must be whole numbers")
    if a.dtype.kind == "f" and (np.abs(a) > MAX_REQUEST_TOKENS).any():
        raise BadArgument(f"{what} token counts must lie in [0, {MAX_REQUEST_TOKENS}]")
    return a.astype(np.int64)


def _count_cell(text: str, path: str, line: int, column: str) -> int:
    try:
        v = int(text)
    except ValueError:
        try:
            f = float(text)
        except ValueError:
            raise BadArgument(f"{path} line {line}: {column} {text!r} is not a number") from None
        if not math.isfinite(f) or not f.is_integer():
            raise BadArgument(f"{path} line {line}: {column} {text!r} is not a whole number of "
                              f"tokens") from None
        v = int(f)
    if not 0 <= v <= MAX_REQUEST_TOKENS:
        raise BadArgument(f"{path} line {line}: {column} {v} is outside [0, "
                          f"{MAX_REQUEST_TOKENS}]")
    return v


def _time_cell(text: str, path: str, line: int) -> float:
    try:
        v = float(text)
    except ValueError:
        raise BadArgument(f"{path} line {line}: {ARRIVAL} {text!r} is not a number") from None
    if not math.isfinite(v):
        raise BadArgument(f"{path} line {line}: {ARRIVAL} {text!r} is not finite")
    return v


def load_trace(path) -> RequestTrace:
    """Read a trace CSV with columns num_prefill_tokens, num_decode_tokens [, arrived_at]
    (UTF-8, a byte-order mark allowed). BadArgument names the file, line and column of the
    first problem."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise BadArgument(f"trace {path} is a directory, not a CSV file")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            cols = reader.fieldnames or []
            for need in (PROMPT, GENERATED):
                if need not in cols:
                    shown = ", ".join(repr(c) for c in cols[:8]) or "none"
                    raise BadArgument(f"trace {path} lacks column {need!r} (has {shown})")
            timed = ARRIVAL in cols
            prefixed = PREFIX_ID in cols or OFFER_ID in cols
            prompt, gen, arrival, pid, ptok, oid = [], [], [], [], [], []
            for row in reader:
                line = reader.line_num
                prompt.append(_count_cell(row[PROMPT] or "", path, line, PROMPT))
                gen.append(_count_cell(row[GENERATED] or "", path, line, GENERATED))
                if timed:
                    arrival.append(_time_cell(row[ARRIVAL] or "", path, line))
                if prefixed:
                    pid.append((row.get(PREFIX_ID) or "").strip())
                    ptok.append(_count_cell(row.get(PREFIX_TOKENS) or "0", path, line,
                                            PREFIX_TOKENS))
                    oid.append((row.get(OFFER_ID) or "").strip())
    except UnicodeDecodeError:
        raise BadArgument(f"trace {path} is not a UTF-8 text CSV file") from None
    except csv.Error as exc:
        raise BadArgument(f"trace {path} is not a readable CSV file: {exc}") from None
    except OSError as exc:
        raise BadArgument(f"cannot read trace {path}: {exc.strerror or exc}") from None
    if not prompt:
        raise BadArgument(f"trace {path} has no rows")
    extra = dict(prefix_id=pid, prefix_tokens=ptok, offer_id=oid) if prefixed else {}
    return RequestTrace(prompt, gen, arrival if timed else None, name=os.path.basename(path),
                        **extra)


def write_trace(trace: RequestTrace, path) -> None:
    """Write `trace` as a CSV load_trace() reads back."""
    cols = [PROMPT, GENERATED] + ([ARRIVAL] if trace.arrival is not None else []) + (
        [PREFIX_ID, PREFIX_TOKENS, OFFER_ID] if trace.prefix_id is not None else [])
    try:
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(cols)
            for i in range(len(trace)):
                row = [int(trace.prompt[i]), int(trace.generated[i])]
                if trace.arrival is not None:
                    row.append(repr(float(trace.arrival[i])))
                if trace.prefix_id is not None:
                    row += [trace.prefix_id[i], int(trace.prefix_tokens[i]), trace.offer_id[i]]
                w.writerow(row)
    except OSError as exc:
        raise BadArgument(f"cannot write trace {path}: {exc.strerror or exc}") from None


def arrival_seconds(trace: RequestTrace, rate: float | None = None, time_scale: float = 1.0,
                    seed: int = 0) -> np.ndarray:
    """Arrival time of each request in seconds from the first: a Poisson process at `rate`
    requests/s (seeded), else the trace's arrived_at x time_scale, else all at 0."""
    n = len(trace)
    if rate is not None:
        if not (isinstance(rate, (int, float)) and rate > 0 and math.isfinite(rate)):
            raise BadArgument(f"--rate must be a positive number of requests per second, got "
                              f"{rate}")
        seconds = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))
        seconds -= seconds[0]
    elif trace.arrival is not None:
        if not (time_scale > 0 and math.isfinite(time_scale)):
            raise BadArgument(f"--time-scale must be a positive number, got {time_scale}")
        seconds = (trace.arrival - trace.arrival.min()) * time_scale
    else:
        return np.zeros(n)
    span = float(seconds.max()) if n else 0.0
    if not span <= MAX_SPAN_SECONDS:
        raise BadArgument(f"{n} arrivals would span {span:.3g} s of simulated time, more than "
                          f"{MAX_SPAN_SECONDS:.0f} s (30 days): raise --rate or lower "
                          f"--time-scale")
    return seconds
