"""Request-length traces: what `odma-hw replay` and `odma-hw simulate` read.

A trace is one row per request: num_prefill_tokens (prompt), num_decode_tokens (generated), and
optionally arrived_at (seconds). For prefix caching a row may also name the prefix its prompt
starts with: prefix_id (any text) and prefix_tokens (how many prompt tokens it covers), and
offer_id: the key under which the request's whole context (prompt + generated) is offered to the
cache when it completes (a chat turn offers the history the next turn starts with).

Everything is checked when the file is read, so a bad trace is one clear line before any work
starts: counts are whole numbers in [0, MAX_REQUEST_TOKENS] (a prompt's from MIN_PROMPT_TOKENS),
arrival times are finite and span at most MAX_SPAN_SECONDS (a span beyond that is a unit
mistake, and would overflow the step counters), each column appears once, and a file that is
not a trace (binary, without line breaks, a device that never ends) is refused after a bounded
read: lines are at most MAX_LINE_CHARS long, a trace has at most MAX_TRACE_REQUESTS rows.
"""

from __future__ import annotations

import array
import contextlib
import csv
import errno
import functools
import math
import os
import secrets
import stat

import numpy as np

from odma_cli.commands import ValueCheck
from odma_cli.errors import BadArgument, OutputError
from odma_cli.paths import folder_problem, refuse_device

# No model serves a request longer than this; a larger count is a corrupt trace.
MAX_REQUEST_TOKENS = 10_000_000
# A request's first token is computed at its prompt's last position: with no prompt there is
# none, and an engine would serve it the logits of whatever shares its step. (A generation of 0
# tokens is served as 1, as a server makes at least one.)
MIN_PROMPT_TOKENS = 1
# Thirty days of simulated time: the public traces span an hour; beyond this is a unit mistake.
MAX_SPAN_SECONDS = 30 * 24 * 3600.0
# Ten million rows load into about a gigabyte and hold a simulation for hours; a longer file is a
# mistake or not a trace at all (a stream that never ends), refused before memory runs out.
MAX_TRACE_REQUESTS = 10_000_000
# A trace row is a few numbers and two prefix names; a longer line is a file that is not a trace
# (binary, or no line breaks at all), refused before it is read into memory whole.
MAX_LINE_CHARS = 64 * 1024
PROMPT, GENERATED, ARRIVAL = "num_prefill_tokens", "num_decode_tokens", "arrived_at"
PREFIX_ID, PREFIX_TOKENS, OFFER_ID = "prefix_id", "prefix_tokens", "offer_id"
COLUMNS = (PROMPT, GENERATED, ARRIVAL, PREFIX_ID, PREFIX_TOKENS, OFFER_ID)


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
        for what, v, least in (("prompt", self.prompt, MIN_PROMPT_TOKENS),
                               ("generated", self.generated, 0)):
            if (v < least).any() or (v > MAX_REQUEST_TOKENS).any():
                i = int(np.flatnonzero((v < least) | (v > MAX_REQUEST_TOKENS))[0])
                why = " (a prompt needs at least one token)" if v[i] < least else ""
                raise BadArgument(f"{name}: request {i} has {v[i]} {what} tokens: {what} counts "
                                  f"must lie in [{least}, {MAX_REQUEST_TOKENS}]{why}")
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
                key, tokens = self.prefix_id[i], self.prefix_tokens[i]
                if not key:
                    raise BadArgument(f"{name}: request {i} gives {tokens} prefix tokens but no "
                                      f"prefix_id: a shared prefix is known by its name")
                raise BadArgument(f"{name}: request {i} has prefix {key!r} of {tokens} tokens "
                                  f"in a {self.prompt[i]}-token prompt (a named prefix covers "
                                  f"1..prompt tokens)")
            length = {}                 # a prefix_id names one prefix: one length, every row
            for i, (key, tokens) in enumerate(zip(self.prefix_id, self.prefix_tokens.tolist())):
                if key and length.setdefault(key, (tokens, i))[0] != tokens:
                    first, row = length[key]
                    raise BadArgument(f"{name}: request {i} gives prefix {key!r} {tokens} tokens "
                                      f"where request {row} gave it {first}: one prefix_id "
                                      f"names one prefix")

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


def _count_cell(text: str, path: str, line: int, column: str, least: int = 0) -> int:
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
    if not least <= v <= MAX_REQUEST_TOKENS:
        why = " (a prompt needs at least one token)" if column == PROMPT and v < least else ""
        raise BadArgument(f"{path} line {line}: {column} {v} is outside [{least}, "
                          f"{MAX_REQUEST_TOKENS}]{why}")
    return v


def _time_cell(text: str, path: str, line: int) -> float:
    try:
        v = float(text)
    except ValueError:
        raise BadArgument(f"{path} line {line}: {ARRIVAL} {text!r} is not a number") from None
    if not math.isfinite(v):
        raise BadArgument(f"{path} line {line}: {ARRIVAL} {text!r} is not finite")
    return v


def _lines(f, path: str):
    """The lines of text file `f`, each read with a bounded readline, so that a file without
    line breaks costs MAX_LINE_CHARS of memory before it is refused, not its whole size."""
    number = 0
    while True:
        line = f.readline(MAX_LINE_CHARS + 1)
        if not line:
            return
        number += 1
        if len(line) > MAX_LINE_CHARS and not line.endswith(("\n", "\r")):
            # a short line with a NUL byte goes on to the column and number checks, which name
            # the cell it spoils; a long one is most likely a binary file: say so
            nul = " and holds NUL bytes" if "\0" in line else ""
            raise BadArgument(f"trace {path} line {number} runs past {MAX_LINE_CHARS} "
                              f"characters without a line break{nul}: not a CSV trace")
        yield line


def _header(cols: list[str], path: str) -> dict[str, int]:
    """Column name -> index of the columns load_trace reads; BadArgument for a missing one, or
    for one that appears twice (csv.DictReader would silently keep the last)."""
    for name in COLUMNS:
        if cols.count(name) > 1:
            raise BadArgument(f"trace {path} has column {name!r} {cols.count(name)} times: "
                              f"which one holds the values is ambiguous")
    for need in (PROMPT, GENERATED):
        if need not in cols:
            shown = ", ".join(repr(c[:40]) for c in cols[:8]) or "none"
            raise BadArgument(f"trace {path} lacks column {need!r} (has {shown})")
    return {name: cols.index(name) for name in COLUMNS if name in cols}


def _cell(row: list[str], at: dict[str, int], name: str) -> str:
    """The text of column `name` in `row`; "" for a column the trace lacks or a short row."""
    i = at.get(name)
    return row[i] if i is not None and i < len(row) else ""


def load_trace(path) -> RequestTrace:
    """Read a trace CSV with columns num_prefill_tokens, num_decode_tokens [, arrived_at]
    (UTF-8, a byte-order mark allowed). BadArgument names the file, line and column of the
    first problem."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise BadArgument(f"trace {path} is a directory, not a CSV file")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            refuse_device(f, f"trace {path}", "a CSV file")
            reader = csv.reader(_lines(f, path))
            at = _header(next(reader, []), path)
            timed = ARRIVAL in at
            prefixed = PREFIX_ID in at or OFFER_ID in at
            if PREFIX_ID in at and PREFIX_TOKENS not in at:
                raise BadArgument(f"trace {path} has a {PREFIX_ID} column but no "
                                  f"{PREFIX_TOKENS}: how many prompt tokens each prefix covers")
            # typed arrays: 8 bytes a value, where a list of ints takes 36
            prompt, gen, arrival = array.array("q"), array.array("q"), array.array("d")
            pid, ptok, oid = [], array.array("q"), []
            names: dict[str, str] = {}     # one string per prefix name, however many rows
            for row in reader:
                if not row:                     # a blank line, as csv.DictReader skips them
                    continue
                line = reader.line_num
                if len(prompt) == MAX_TRACE_REQUESTS:
                    raise BadArgument(f"trace {path} has more than {MAX_TRACE_REQUESTS} "
                                      f"requests: serve a part of it")
                prompt.append(_count_cell(_cell(row, at, PROMPT), path, line, PROMPT,
                                          MIN_PROMPT_TOKENS))
                gen.append(_count_cell(_cell(row, at, GENERATED), path, line, GENERATED))
                if timed:
                    arrival.append(_time_cell(_cell(row, at, ARRIVAL), path, line))
                if prefixed:
                    name = _cell(row, at, PREFIX_ID).strip()
                    pid.append(names.setdefault(name, name))
                    ptok.append(_count_cell(_cell(row, at, PREFIX_TOKENS) or "0", path, line,
                                            PREFIX_TOKENS))
                    oid.append(_cell(row, at, OFFER_ID).strip())
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


# Failures of the storage itself rather than of the path the user named: exit 3, not 2.
_STORAGE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG}


@functools.lru_cache(maxsize=8)
def _trace_at(path: str, mtime_ns: int, size: int) -> RequestTrace:
    return load_trace(path)


def load_trace_once(path) -> RequestTrace:
    """load_trace(), read once per path, modification time and size however often it is asked
    for (a sweep's checks and cells name the same trace many times). Treat it as read-only."""
    st = os.stat(path)
    return _trace_at(os.path.realpath(path), st.st_mtime_ns, st.st_size)


def trace_check() -> ValueCheck:
    """A request trace that load_trace() reads (columns, numbers), as replay and simulate read
    it before any work."""
    return ValueCheck("trace", ("trace",), lambda a: load_trace_once(a.trace))


def _existing(path: str) -> os.stat_result | None:
    """What `path` names (through links), or None where nothing is there yet."""
    try:
        return os.stat(path)
    except OSError:
        return None


def check_output_path(path) -> None:
    """BadArgument unless a trace can be written at `path`: its folder exists and it is not a
    folder itself. Called before a trace is generated, so a typo costs no work."""
    path = os.fspath(path)
    if not path:
        raise BadArgument("cannot write a trace to an empty path: give a file name")
    st = _existing(path)
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise BadArgument(f"cannot write trace {path}: it is a directory")
    if st is None or stat.S_ISREG(st.st_mode):
        folder = os.path.dirname(os.path.realpath(path))
        problem = folder_problem(folder)
        if problem:
            raise BadArgument(f"cannot write trace {path}: {problem}")
    # a read-only file stays read-only: the new file would replace it by a rename, which only
    # asks the folder's permission
    if st is not None and not os.access(path, os.W_OK):
        raise BadArgument(f"cannot write trace {path}: permission denied")


def _write_rows(trace: RequestTrace, f) -> None:
    cols = [PROMPT, GENERATED] + ([ARRIVAL] if trace.arrival is not None else []) + (
        [PREFIX_ID, PREFIX_TOKENS, OFFER_ID] if trace.prefix_id is not None else [])
    w = csv.writer(f)
    w.writerow(cols)
    for i in range(len(trace)):
        row = [int(trace.prompt[i]), int(trace.generated[i])]
        if trace.arrival is not None:
            row.append(repr(float(trace.arrival[i])))
        if trace.prefix_id is not None:
            row += [trace.prefix_id[i], int(trace.prefix_tokens[i]), trace.offer_id[i]]
        w.writerow(row)


def write_trace(trace: RequestTrace, path) -> None:
    """Write `trace` as a CSV load_trace() reads back, with write_file(): a write that fails (a
    full disk) leaves `path` as it was, never a truncated trace that reads back as a shorter
    one."""
    check_output_path(path)
    write_file(path, lambda f: _write_rows(trace, f), "trace")


def write_file(path, write, what: str = "file", *, replace_links: bool = False) -> None:
    """Call write(f) on a text file that replaces `path` only once complete and on disk (in
    its folder, then renamed; through a link, its target; keeping a file's mode), so a write
    that fails leaves `path` as it was. replace_links: a link at `path` is itself replaced by
    the new file and its target left alone (for a file that names others beside it, which
    must then be beside the file, not beside the target). A pipe or a device (/dev/stdout)
    is written directly: there is nothing to replace. A path that cannot be written is a
    BadArgument (exit 2); storage that fails while writing, an OutputError (exit 3); `what`
    names the file in either."""
    path = os.fspath(path)
    if replace_links and os.path.islink(path):
        _replace(os.path.abspath(path), None, write, what, path)
        return
    st = _existing(path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        # replacing a device would put a plain file where it was
        try:
            f = open(path, "w", newline="")
        except OSError as exc:
            raise _write_error(what, path, exc, started=False) from None
        try:
            with f:
                write(f)
        except OSError as exc:
            raise _write_error(what, path, exc, started=True) from None
        return
    _replace(os.path.realpath(path), st, write, what, path)   # a link keeps its target


def _replace(target: str, st, write, what: str, path: str) -> None:
    """write_file's new file, written beside `target` and renamed over it, with the mode of
    `st` (what was there; None: a new file's)."""
    tmp = os.path.join(os.path.dirname(target),
                       f".{os.path.basename(target)}.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        raise _write_error(what, path, exc, started=False) from None
    done = False
    try:
        with os.fdopen(fd, "w", newline="") as f:
            if st is not None:
                os.fchmod(f.fileno(), stat.S_IMODE(st.st_mode))
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        done = True
    except OSError as exc:
        raise _write_error(what, path, exc, started=True) from None
    finally:
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _write_error(what: str, path: str, exc: OSError, started: bool) -> Exception:
    """An OSError of writing a file as the house's error: a path that cannot be opened is bad
    usage; storage that fails (or any failure once the file was being written) is an output
    failure."""
    message = f"cannot write {what} {path}: {exc.strerror or exc}"
    if started or exc.errno in _STORAGE_ERRORS:
        return OutputError(message)
    return BadArgument(message)


def arrival_seconds(trace: RequestTrace, rate: float | None = None, time_scale: float = 1.0,
                    seed: int = 0) -> np.ndarray:
    """Arrival time of each request in seconds from the first: a Poisson process at `rate`
    requests/s (seeded), else the trace's arrived_at x time_scale, else all at 0. A time_scale
    other than 1 where there is no arrived_at to scale (a rate replaces it) is refused: the
    load asked for would silently not be the load run."""
    n = len(trace)
    if time_scale != 1.0 and (rate is not None or trace.arrival is None):
        raise BadArgument("--time-scale scales arrived_at, which "
                          + ("--rate replaces: give one of them" if rate is not None
                             else "this trace does not have"))
    if rate is not None:
        if not (isinstance(rate, (int, float)) and rate > 0 and math.isfinite(rate)):
            raise BadArgument(f"--rate must be a positive number of requests per second, got "
                              f"{rate}")
        with np.errstate(over="ignore", invalid="ignore"):   # a rate so low its gaps overflow
            seconds = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))
            seconds -= seconds[0]
    elif trace.arrival is not None:
        if not (time_scale > 0 and math.isfinite(time_scale)):
            raise BadArgument(f"--time-scale must be a positive number, got {time_scale}")
        seconds = (trace.arrival - trace.arrival.min()) * time_scale
    else:
        return np.zeros(n)
    span = float(seconds.max()) if n else 0.0
    if math.isnan(span):                # inf - inf: gaps beyond any float
        span = math.inf
    if not span <= MAX_SPAN_SECONDS:
        raise BadArgument(f"{n} arrivals would span {span:.3g} s of simulated time, more than "
                          f"{MAX_SPAN_SECONDS:.0f} s (30 days): raise --rate or lower "
                          f"--time-scale")
    return seconds
