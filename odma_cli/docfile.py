"""The small JSON and TOML documents a user hands the tool (cards, probe files, engine profiles,
model configs, sweep grids): read with a bound on their size and parsed, any failure one line
naming the file.

The bound keeps a path to a device that never ends (/dev/zero) or a file that is no such
document from being read into memory whole. A leading UTF-8 byte-order mark is dropped, as
the trace readers drop it.
"""

from __future__ import annotations

import json
import os
import stat

from odma_cli.errors import BadArgument, one_line

MAX_FILE_BYTES = 1 << 20            # such a document is a few KB; a MiB is none of them
# a pipe's bytes by the pipe (`--card <(...)`): a pipe reads once, and a command reads its
# documents more than once (a card when the arguments are checked, again where it is used)
_PIPE_BYTES: dict[tuple[int, int], bytes] = {}


def read_bounded(path, what: str, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of file `path`; BadArgument in one line naming it (`what`: "card", "grid")
    when it cannot be read or holds more than `limit` bytes."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
        pipe = (st.st_dev, st.st_ino) if stat.S_ISFIFO(st.st_mode) else None
        if pipe in _PIPE_BYTES:
            return _PIPE_BYTES[pipe]
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise BadArgument(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(raw) > limit:
        article = "an" if what[0] in "aeiou" else "a"
        raise BadArgument(f"{what} {path} is over {limit >> 20} MiB: not {article} {what}")
    if pipe:
        _PIPE_BYTES[pipe] = raw
    return raw


def refuse_duplicates(pairs) -> dict:
    """json's object_pairs_hook that refuses a key given twice (json.loads keeps the last)."""
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):
        twice = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"duplicate key {twice!r}")
    return dict(pairs)


def load_document(path, what: str, as_json: bool):
    """The JSON (as_json) or TOML document of file `path`; `what` names the file in messages
    ("card", "probe JSON"). BadArgument in one line for a file that read_bounded refuses or
    that does not parse; a JSON object that names a key twice does not parse."""
    from odma_cli import tomlread

    path = os.fspath(path)
    raw = read_bounded(path, what)
    try:
        text = raw.decode("utf-8-sig")
        if as_json:
            return json.loads(text, object_pairs_hook=refuse_duplicates)
        return tomlread.loads(text)
    except RecursionError:              # JSON arrays nested thousands deep
        raise BadArgument(f"{what} {path} is not valid JSON: nested too deep") from None
    except (UnicodeDecodeError, ValueError) as exc:     # TOMLDecodeError is a ValueError
        raise BadArgument(f"{what} {path} is not valid "
                          f"{'JSON' if as_json else 'TOML'}: {one_line(exc)}") from None
