"""The disk tier's file format: one file per prefix in a directory the cache owns.

    offset 0     header (HEADER_BYTES, zero-padded): magic, format version, header size, key length,
                 tokens, payload bytes, bytes per token, payload checksum (16 B), the key (UTF-8),
                 then a CRC-32 of everything before it (so a re-index trusts no torn header)
    HEADER_BYTES payload: the prefix's KV bytes (page-aligned, so a mapping of it is too)

Files are named <BLAKE2b-128 of the key>.<8 random hex digits>.kv (a fresh name per spill, so a
late delete of a dropped entry can never remove a newer file of the same key). A file is written
under a temporary name (.<name>.tmp) and renamed into place, so a crash leaves a temporary file
(removed at the next start) but never a half file under a real name. No fsync: after a power loss
a renamed file may lack its payload, and its checksum then fails on read (never served).

Reads map the file (mmap) after checking its size against the header, and the payload is copied
out and checksummed in one pass. The directory must belong to the cache: a file truncated by
another process while mapped would fault the reader.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import re
import stat
import struct
import tempfile
import zlib
from typing import NamedTuple

import numpy as np

from odma_cli.errors import BadArgument

MAGIC = b"ODMAPFX\x00"
VERSION = 1
HEADER_BYTES = 4096
MAX_KEY_BYTES = 1024
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
_FIXED = struct.Struct("<8sIIIIQQQ16s")   # magic, version, header bytes, key length, 0, tokens,
#                                           payload bytes, bytes per token, checksum
_CRC = struct.Struct("<I")
WRITE_CHUNK = 64 << 20                    # os.write moves at most ~2 GiB per call on Linux
_os_write = os.write                      # the one write call (tests fail it on purpose)
_NAME = re.compile(r"([0-9a-f]{32})\.[0-9a-f]{8}" + re.escape(SUFFIX))


class CorruptFile(Exception):
    """A file whose header or size does not describe a valid prefix (internal: the cache drops
    the entry and counts it)."""


class NotRegularFile(OSError):
    """A path named like a prefix file that is no regular file (a FIFO, a device, a directory):
    never ours, never read (a re-index skips it, a restore counts it as an I/O error)."""


class FileHeader(NamedTuple):
    key: str
    tokens: int
    nbytes: int
    bytes_per_token: int
    checksum: bytes


def key_digest(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


def file_bytes(nbytes: int) -> int:
    """Bytes a prefix of `nbytes` payload takes on disk (what the disk capacity counts)."""
    return HEADER_BYTES + nbytes


def check_dir(path) -> str:
    """The absolute path of a directory the cache can write files in; BadArgument otherwise."""
    try:
        path = os.fspath(path)
    except TypeError:
        raise BadArgument(f"disk_dir must be a path, got {path!r}") from None
    if isinstance(path, bytes):    # file names are made as str and joined to it
        raise BadArgument(f"disk_dir must be a str path, not bytes ({path!r}): decode it, e.g. "
                          "with os.fsdecode")
    if not os.path.exists(path):
        raise BadArgument(f"disk_dir {path!r} does not exist: create it first (the cache "
                          f"does not make folders)")
    if not os.path.isdir(path):
        raise BadArgument(f"disk_dir {path!r} is not a directory")
    try:       # os.access says yes to root on a read-only mode; only a real write tells
        fd, probe = tempfile.mkstemp(prefix=".odma-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise BadArgument(f"disk_dir {path!r} is not writable: {exc.strerror or exc}") from None
    return os.path.abspath(path)


def new_path(directory: str, key: str) -> str:
    return os.path.join(directory, f"{key_digest(key)}.{os.urandom(4).hex()}{SUFFIX}")


def pack_header(key: str, tokens: int, nbytes: int, bytes_per_token: int, checksum: bytes) -> bytes:
    k = key.encode()
    head = _FIXED.pack(MAGIC, VERSION, HEADER_BYTES, len(k), 0, tokens, nbytes, bytes_per_token,
                       checksum) + k
    head += _CRC.pack(zlib.crc32(head))
    return head + bytes(HEADER_BYTES - len(head))


def parse_header(raw: bytes) -> FileHeader:
    """The header in the first HEADER_BYTES of a file; CorruptFile if it is not one of ours."""
    if len(raw) < _FIXED.size:
        raise CorruptFile("short header")
    magic, version, hbytes, klen, _, tokens, nbytes, bpt, checksum = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptFile("bad magic")
    if version != VERSION or hbytes != HEADER_BYTES:
        raise CorruptFile(f"format version {version} / header {hbytes} B not understood")
    end = _FIXED.size + klen
    if klen > MAX_KEY_BYTES or end + _CRC.size > len(raw):
        raise CorruptFile("bad key length")
    (crc,) = _CRC.unpack_from(raw, end)
    if zlib.crc32(raw[:end]) != crc:
        raise CorruptFile("header checksum mismatch")
    try:
        key = raw[_FIXED.size:end].decode()
    except UnicodeDecodeError:
        raise CorruptFile("key is not UTF-8") from None
    if bpt <= 0 or tokens <= 0 or nbytes != tokens * bpt:
        raise CorruptFile("inconsistent sizes")
    return FileHeader(key, tokens, nbytes, bpt, checksum)


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = _os_write(fd, view[:WRITE_CHUNK])
        if n <= 0:
            raise OSError(errno.EIO, "write returned nothing")
        view = view[n:]


def write_file(path: str, header: bytes, payload) -> None:
    """Write header + payload (bytes-like) to `path` through a temporary name. On any error the
    temporary file is removed and the error raised (nothing is left under either name)."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        try:
            _write_all(fd, header)
            _write_all(fd, payload)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _open_regular(path: str):
    """`path` opened for reading, and its size; NotRegularFile when it is not a regular file.
    O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer (a regular file
    ignores the flag)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file", path)
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def read_header(path: str) -> tuple[FileHeader, int]:
    """(header, file size); CorruptFile when the file is not a whole prefix file, OSError when it
    cannot be read (NotRegularFile when it is no regular file)."""
    f, size = _open_regular(path)
    with f:
        h = parse_header(f.read(HEADER_BYTES))
    if size != file_bytes(h.nbytes):
        raise CorruptFile(f"file has {size} B, its header says {file_bytes(h.nbytes)}")
    return h, size


def read_payload(path: str, expect: FileHeader, consume):
    """consume(payload) where payload is a read-only uint8 array over a mapping of the file, after
    checking that the file's header and size are what the index expects (CorruptFile if not);
    returns what consume returns. The array must not outlive the call."""
    f, size = _open_regular(path)
    with f:
        if size != file_bytes(expect.nbytes):
            raise CorruptFile(f"file has {size} B, expected {file_bytes(expect.nbytes)}")
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    try:
        if parse_header(mm[:HEADER_BYTES]) != expect:
            raise CorruptFile("header does not match the index")
        with contextlib.suppress(AttributeError, OSError, ValueError):
            mm.madvise(mmap.MADV_SEQUENTIAL)
        return consume(np.frombuffer(mm, np.uint8, count=expect.nbytes, offset=HEADER_BYTES))
    finally:
        try:
            mm.close()
        except BufferError:      # a view escaped consume(): the mapping goes when it does
            pass


def scan(directory: str, bytes_per_token: int):
    """The prefix files of `directory` for a cache of `bytes_per_token`: (valid, bad) where valid
    is a list of (mtime, path, header, size) and bad the paths of our files that are not valid
    (a torn header, a wrong size, a name that does not match its key). Leftover temporary files
    are removed; files of another bytes_per_token (another model) are left alone and not
    listed."""
    valid, bad = [], []
    try:
        names = os.listdir(directory)
    except OSError:
        return valid, bad
    for name in names:
        path = os.path.join(directory, name)
        if (name.startswith(".") and name.endswith(TMP_SUFFIX)
                and _NAME.fullmatch(name[1:-len(TMP_SUFFIX)])):
            with contextlib.suppress(OSError):
                os.unlink(path)
            continue
        match = _NAME.fullmatch(name)
        if match is None:                     # not a file of ours: leave it alone
            continue
        try:
            h, size = read_header(path)
            mtime = os.stat(path).st_mtime_ns
        except CorruptFile:
            bad.append(path)
            continue
        except OSError:                       # unreadable, or no regular file: not ours to judge
            continue
        if match.group(1) != key_digest(h.key):
            bad.append(path)
            continue
        if h.bytes_per_token != bytes_per_token:
            continue
        valid.append((mtime, path, h, size))
    valid.sort(key=lambda v: (v[0], v[1]))
    return valid, bad


def remove(path: str) -> None:
    """Remove the file of an entry the cache no longer holds. A failure is not raised: the cache's
    state already changed, and a leftover file is never served unchecked. It takes disk space the
    tier no longer counts until the next cache on the directory re-indexes it (or trims it)."""
    with contextlib.suppress(OSError):
        os.unlink(path)
