"""Content hashes, the framed results log and what --resume reads from it.

A cell's hash is its identity for --resume: the command, its parsed arguments with defaults
(presentation options left out), the sha256 of every file an argument names (a trace,
`probe:FILE`), the odma-hw version, and the digest of the code the cell runs (code_digest:
every source file of the command's package and of odma_hw, the compiled native shim among
them, but the sweep's own). So a moved trace keeps its cells, and an edited trace, an edited
source file or a rebuilt shim reruns them, version bump or not.

results.jsonl holds one line per table row, appended as each cell finishes. Each line is framed
so that one cut short by a crash or a full disk is told from a whole one: it carries the number
of rows its cell's attempt wrote (`cell_rows`; a cell counts only once all of them are there)
and, as its last field, the start of the sha256 of the line before that field (`line_sha256`).
Lines are JSON objects still (`pandas.read_json(lines=True)` reads them).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import stat

from odma_cli.commands import registry
from odma_cli.errors import OutputError as _BaseOutputError

RESULTS, TABLE, PARQUET, META = "results.jsonl", "results.csv", "results.parquet", "sweep.json"
BOOKKEEPING = ("cell", "row", "hash", "status", "error", "wall_seconds", "warm_up_seconds",
               "worker", "command_line")
# options a cell cannot take (so none decides a result): the sweep prints nothing per cell and
# plots the whole grid
RESERVED_OPTIONS = {"json": "cells always return their JSON object",
                    "plot": "use the sweep's --plot", "series": "time series are not tabulated",
                    "help": "not a cell option"}
# what a package holds that decides what its code computes: source, package data (model
# configs), compiled extension modules (the native shim)
CODE_SUFFIXES = (".py", ".json", *importlib.machinery.EXTENSION_SUFFIXES)
# the sweep's own code decides how cells are run and shown, not what they compute: an edit to
# the printed table must not rerun every cell
SWEEP_FOLDER = os.path.dirname(os.path.realpath(__file__))


class OutputError(_BaseOutputError):
    """The sweep's results cannot be written (a read-only or full folder, a folder where a file
    goes); the cells already logged are kept. The command exits 3 with this one line."""


def reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


# ------------------------------------------------------------------------------ content hashes
@functools.lru_cache(maxsize=None)
def _file_sha256(path: str, mtime_ns: int, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_digest(path: str) -> str:
    """sha256 of a file's bytes (remembered per path, modification time and size)."""
    st = os.stat(path)
    return _file_sha256(os.path.realpath(path), st.st_mtime_ns, st.st_size)


def _package_files(top: str) -> list[tuple[str, str]]:
    spec = importlib.util.find_spec(top)
    if spec is None:
        return []
    if not spec.submodule_search_locations:     # a plain module: its one file
        return [(os.path.basename(spec.origin), spec.origin)] if spec.origin else []
    found = []
    for root in spec.submodule_search_locations:
        for folder, subfolders, names in os.walk(root):
            # a sweep's results folder inside a package is output, not code (and changes)
            if RESULTS in names:
                subfolders[:] = []
                continue
            subfolders[:] = [d for d in subfolders if d != "__pycache__" and d[0] != "."
                             and os.path.realpath(os.path.join(folder, d)) != SWEEP_FOLDER]
            found += [(f"{top}/{os.path.relpath(os.path.join(folder, n), root)}",
                       os.path.join(folder, n)) for n in names
                      if n.endswith(CODE_SUFFIXES) and n[0] != "."]
    return found


def code_files(command: str) -> list[tuple[str, str]]:
    """(name, path) of each file whose bytes decide what `command`'s cells compute, by name:
    the files of the package of the command's module and of odma_hw, which every command is
    built on (the hardware layer imports nothing above it, so an emulate cell does not depend
    on the allocator's files), but the sweep's own (SWEEP_FOLDER)."""
    tops = {registry()[command].partition(".")[0], "odma_hw"}
    return sorted(f for top in sorted(tops) for f in _package_files(top))


def code_digest(command: str) -> str:
    """The digest of code_files(command): names and contents, so an edited, added, removed or
    rebuilt file changes it. Cheap to repeat: each file's sha256 is remembered per path,
    modification time and size."""
    h = hashlib.sha256()
    for name, path in code_files(command):
        h.update(f"{name}\0{file_digest(path)}\n".encode())
    return h.hexdigest()[:20]


def _named_file(value):
    """The file an argument value names (`PATH` or `KIND:PATH`, e.g. probe:FILE), or None."""
    if not isinstance(value, str) or not value:
        return None
    for candidate in (value, value.partition(":")[2]):
        if candidate and os.path.isfile(candidate):
            return candidate
    return None


def hashed(key: str) -> bool:
    """Whether a parsed argument decides a cell's result (presentation options do not)."""
    return key not in ("func", "command") and key not in RESERVED_OPTIONS


def _normalised(value):
    path = _named_file(value)
    return {"sha256": file_digest(path)} if path else value


def normalised_arguments(args) -> dict:
    """The parsed arguments that decide a cell's result: defaults filled in, values converted
    by the parser, presentation options left out, files replaced by their content digest."""
    return {key: _normalised(value) for key, value in sorted(vars(args).items())
            if hashed(key)}


def hash_fragment(key: str, value) -> str:
    """One argument as content_hash's JSON writes it (`"key": value`), so that a cell's hash can
    be put together from pieces made once per axis value."""
    return json.dumps(key) + ": " + json.dumps(_normalised(value), sort_keys=True, default=str)


def hash_payload(command: str, fragments, code: str) -> str:
    """The text a cell's hash is taken of: its argument fragments, the command, the code digest
    and the odma-hw version, as JSON with sorted keys."""
    from odma_cli import __version__

    return ('{"arguments": {' + ", ".join(fragments) + '}, "code": ' + json.dumps(code)
            + ', "command": ' + json.dumps(command) + ', "odma_hw": ' + json.dumps(__version__)
            + "}")


def short_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def content_hash(command: str, args, code: str | None = None) -> str:
    """A cell's identity for --resume: command + normalised arguments + the digest of the code
    it runs (code_digest(command) unless given) + odma-hw version."""
    return short_sha256(hash_payload(
        command, [hash_fragment(k, v) for k, v in sorted(vars(args).items()) if hashed(k)],
        code_digest(command) if code is None else code))


# ------------------------------------------------------------------------ the framed log
FRAME_ROWS = "cell_rows"
FRAME_CHECK = "line_sha256"
FRAME_KEYS = (FRAME_ROWS, FRAME_CHECK)
_CHECK_HEAD = b', "' + FRAME_CHECK.encode() + b'": "'
_CHECK_DIGITS = 16
_CHECK_TAIL = len(_CHECK_HEAD) + _CHECK_DIGITS + len(b'"}')


def default_out(grid_path: str) -> str:
    stem = os.path.splitext(os.path.basename(grid_path))[0]
    return os.path.join(os.path.dirname(os.path.abspath(grid_path)), f"{stem}-sweep")


def _line_digest(body: bytes) -> bytes:
    return hashlib.sha256(body).hexdigest()[:_CHECK_DIGITS].encode()


def framed_lines(records: list[dict]) -> bytes:
    """The log lines of one attempt of a cell (its records, in row order)."""
    lines = []
    for r in records:
        body = json.dumps({**r, FRAME_ROWS: len(records)}, default=str).encode()
        lines.append(body[:-1] + _CHECK_HEAD + _line_digest(body) + b'"}\n')
    return b"".join(lines)


def unframe(line: bytes) -> dict | None:
    """The record of a whole log line (its newline may be missing), else None: a torn or
    altered line, or one written before lines were framed."""
    line = line[:-1] if line.endswith(b"\n") else line
    tail = line[-_CHECK_TAIL:]
    if len(line) <= _CHECK_TAIL or not (tail.startswith(_CHECK_HEAD) and tail.endswith(b'"}')):
        return None
    body = line[:-_CHECK_TAIL] + b"}"
    if _line_digest(body) != tail[len(_CHECK_HEAD):-2]:
        return None
    try:
        record = json.loads(body)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    rows, row = record.get(FRAME_ROWS), record.get("row")
    if not (isinstance(record.get("hash"), str) and type(rows) is int and type(row) is int
            and 0 <= row < rows):
        return None
    return record


def _regular_file(path: str) -> bool:
    """False where nothing is; OutputError where something that is no file is (a folder, a
    device: reading it could block or never end)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise OutputError(f"cannot read {path}: {reason(exc)}") from None
    if not stat.S_ISREG(mode):
        raise OutputError(f"cannot use {path}: it is a "
                          f"{'folder' if stat.S_ISDIR(mode) else 'special file'}, not a file")
    return True


def read_log(path: str):
    """(line offset, record or None) for each line of a results log: None for a line that is
    not whole (see unframe)."""
    if not _regular_file(path):
        return
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise OutputError(f"cannot read {path}: {reason(exc)}") from None
    with f:
        offset = 0
        for line in f:
            yield offset, unframe(line)
            offset += len(line)


def log_holds_anything(path: str) -> bool:
    return _regular_file(path) and os.path.getsize(path) > 0


def latest_attempts(path: str) -> dict:
    """hash -> (status, [line offsets]) of each cell's latest complete attempt in the log: its
    lines in row order, each whole, as many as it says. One attempt's lines are written
    together, so its rows follow each other; a line that is not whole ends the attempt it is
    in, which then does not count."""
    latest = {}
    attempt = None      # [hash, rows, status, offsets] of the attempt being read
    for offset, r in read_log(path):
        if r is None:
            attempt = None
            continue
        if r["row"] == 0:
            attempt = [r["hash"], r[FRAME_ROWS], r.get("status"), [offset]]
        elif attempt and (r["hash"], r[FRAME_ROWS], r["row"]) == (attempt[0], attempt[1],
                                                                 len(attempt[3])):
            attempt[3].append(offset)
        else:
            attempt = None
            continue
        if len(attempt[3]) == attempt[1]:
            latest[attempt[0]] = (attempt[2], attempt[3])
            attempt = None
    return latest


def flatten(obj: dict, prefix: str = "") -> dict:
    """Nested dicts -> 'a.b' keys; scalars kept, lists left out."""
    flat = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif value is None or isinstance(value, (bool, int, float, str)):
            flat[name] = value
    return flat


def output_rows(output: dict) -> list[dict]:
    """A command's JSON object as table rows: one per entry of a "results" list (with the
    object's other scalars repeated), else one."""
    results = output.get("results")
    if isinstance(results, list) and all(isinstance(r, dict) for r in results):
        top = flatten({k: v for k, v in output.items() if k != "results"})
        return [{**top, **flatten(r)} for r in results]
    return [flatten(output)]


def cell_records(cell, result: dict) -> list[dict]:
    """The table rows of one finished cell (a Cell and run_cell's result): the bookkeeping
    columns, the cell's axes, then the command's output, whose keys that collide with either
    become `out.KEY`."""
    base = {"cell": cell.index, "row": 0, "hash": cell.hash, "status": result["status"],
            "error": result["error"], "wall_seconds": result["wall_seconds"],
            "warm_up_seconds": result["warm_up_seconds"], "worker": result["worker"],
            "command_line": "odma-hw " + cell.command_line, **cell.axes}
    records = []
    for i, row in enumerate(result["rows"] or [{}]):
        r = dict(base, row=i)
        for key, value in row.items():
            r[f"out.{key}" if key in base or key in FRAME_KEYS else key] = value
        records.append(r)
    return records


class ResultLog:
    """The append-only results log: each cell's rows framed (see unframe) and written in one go
    as it finishes. An append always starts a line of its own, so a line torn by a crash or a
    full disk spoils only itself."""

    def __init__(self, path: str):
        self.path = path
        self._at_line_start = None      # whether the file ends in a newline; None: look
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as exc:
            raise OutputError(f"cannot write {path}: {reason(exc)}") from None
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            self.close()
            raise OutputError(f"cannot use {path}: it is not a file")

    def _ends_in_newline(self) -> bool:
        size = os.fstat(self.fd).st_size
        return size == 0 or os.pread(self.fd, 1, size - 1) == b"\n"

    def write(self, records: list[dict]) -> None:
        data = framed_lines(records)
        try:
            if not (self._at_line_start or self._ends_in_newline()):
                data = b"\n" + data
            self._at_line_start = None
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as exc:
            raise OutputError(f"cannot append to {self.path}: {reason(exc)}") from None
        self._at_line_start = True

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def prepare_out(out: str) -> None:
    """Create --out and make sure that the files the sweep writes can be written there, before
    any cell runs: OutputError for a folder that cannot be made or written, or a folder where
    a file goes (the log is checked when it is opened)."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create --out {out!r}: {reason(exc)}") from None
    for name in (TABLE, TABLE + ".tmp", PARQUET, META):
        path = os.path.join(out, name)
        if os.path.isdir(path):
            raise OutputError(f"cannot write {path}: it is a folder")
    probe = os.path.join(out, TABLE + ".tmp")   # made and replaced by write_table anyway
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise OutputError(f"cannot write in --out {out}: {reason(exc)}") from None
