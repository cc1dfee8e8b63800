"""The tiered prefix cache (allocator.prefix): prefixes' KV bytes kept in device, host and disk
tiers as exact-size contiguous blocks, restored byte-exact into new requests' blocks, never
served when their bytes are bad."""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import os
import random
import struct
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

from allocator import OracleAllocator
from allocator.errors import AllocatorClosed, InvariantBroken, StaleBlock
from allocator.prefix import EVICTIONS, TIERS, PrefixCache, TierBandwidth, prefix_key
from allocator.prefix import cache as cache_module
from allocator.prefix import disk as disk_module
from allocator.prefix.kernels import copy_digest, digest
from odma_cli.errors import BadArgument, DeviceError
from odma_hw import devices

BPT = 256                           # bytes per token: small, so every test runs in milliseconds
BW = TierBandwidth(device_copy_gbps=100.0)
SPECS = ["host", "torch:cpu", "emu:lpddr5-6400", None]   # None: accounting only


def kv(key: str, tokens: int) -> bytes:
    """The KV bytes a request computes for prefix `key` (deterministic per key)."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return np.random.default_rng(seed).bytes(tokens * BPT)


def open_device(spec):
    if spec is None:
        return None
    backend = spec.split(":")[0]
    found = {s.backend: s for s in devices.discover()}[backend]
    if spec not in found.specs:
        pytest.skip(f"{spec} unavailable here: {found.reason}")
    return devices.open(spec)


class Rig:
    """A serving device, a request pool on it, and a prefix cache in front of it."""

    def __init__(self, spec, tmp_path=None, **cache_args):
        self.dev = open_device(spec)
        self.bytes = self.dev is not None
        self.requests = OracleAllocator(self.dev, 8 << 20, BPT, 4096)
        if tmp_path is not None and self.bytes and cache_args.get("disk_bytes"):
            cache_args.setdefault("disk_dir", str(tmp_path))
        if not self.bytes:
            cache_args.setdefault("bandwidth", BW)
        self.cache = PrefixCache(self.dev, BPT, **cache_args)
        self._ids = iter(range(10 ** 9))

    def block(self, tokens: int):
        return self.requests.reserve(next(self._ids), tokens - 1, 1)

    def offer(self, key: str, tokens: int) -> float:
        blk = self.block(tokens)
        if self.bytes:
            blk.write(kv(key, tokens))
        try:
            return self.cache.offer(key, blk, tokens)
        finally:
            self.requests.release(blk.request_id)

    def restore(self, key: str, tokens: int | None, capacity: int = 64):
        """(tokens covered, seconds, bytes of the block's covered part or None)."""
        blk = self.block(capacity)
        try:
            covered, secs = self.cache.restore(key, blk, tokens)
            got = blk.read(covered * BPT) if self.bytes and covered else None
            return covered, secs, got
        finally:
            self.requests.release(blk.request_id)

    def close(self):
        self.cache.close()
        self.requests.close()
        if self.dev is not None:
            self.dev.close()


@pytest.fixture
def rigs():
    made = []

    def make(spec, tmp_path=None, **cache_args):
        rig = Rig(spec, tmp_path, **cache_args)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.close()


def ids(spec):
    return spec or "accounting"


# -- keys and the checksum ------------------------------------------------------------------------

def test_prefix_key_is_sha256_of_int64_little_endian_token_ids():
    assert prefix_key([1, 2, 3]) == hashlib.sha256(struct.pack("<3q", 1, 2, 3)).hexdigest()
    assert prefix_key(np.array([1, 2, 3], np.int32)) == prefix_key((1, 2, 3))
    assert prefix_key([1, 2]) != prefix_key([2, 1])
    for bad in ([1.5, 2.0], "abc", [[1, 2]], [True, False]):
        with pytest.raises(BadArgument):
            prefix_key(bad)


def reference_digest(data: bytes) -> bytes:
    """The checksum as kernels.py defines it, computed the slow, obvious way."""
    n = len(data)
    words = np.frombuffer(data + bytes(-n % 64), np.uint64).reshape(-1, 8)
    lines = words.shape[0]
    a = words.sum(axis=0, dtype=np.uint64)
    weights = (lines - np.arange(lines, dtype=np.uint64))[:, None]
    b = (words * weights).sum(axis=0, dtype=np.uint64)
    return hashlib.blake2b(a.tobytes() + b.tobytes() + n.to_bytes(8, "little"),
                           digest_size=16).digest()


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 4095, 100_003, (9 << 20) + 5])
def test_copy_and_checksum_kernel_copies_exactly_and_matches_the_definition(n):
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    for misalign in (0, 8, 3):               # streaming stores need 64-byte alignment; others not
        dst = np.zeros(n + 64, np.uint8)[misalign:misalign + n]
        assert copy_digest(dst, src) == reference_digest(src.tobytes()) == digest(src)
        assert np.array_equal(dst, src)


def test_checksum_catches_a_flipped_byte_and_swapped_lines():
    data = bytearray(np.random.default_rng(0).bytes(1 << 16))
    base = digest(bytes(data))
    flipped = bytearray(data)
    flipped[12345] ^= 0x40
    swapped = data[64:128] + data[:64] + data[128:]
    assert digest(bytes(flipped)) != base
    assert digest(bytes(swapped)) != base


# -- round trips ------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS, ids=ids)
@pytest.mark.parametrize("tier", TIERS)
def test_round_trip_through_each_tier_is_byte_exact_and_promotes_to_device(rigs, tmp_path, spec,
                                                                        tier):
    rig = rigs(spec, tmp_path, device_bytes=64 * BPT, host_bytes=64 * BPT,
               disk_bytes=1 << 20)
    rig.offer("p", 37)
    assert rig.cache.lookup("p") == ("device", 37)
    for upper in TIERS[:TIERS.index(tier)]:
        rig.cache.evict(upper, 1)             # push it down one tier at a time
    assert rig.cache.lookup("p") == (tier, 37)
    covered, secs, got = rig.restore("p", 37, capacity=50)
    assert covered == 37 and secs > 0
    if rig.bytes:
        assert got == kv("p", 37)
    assert rig.cache.lookup("p") == ("device", 37)      # swapped up straight to the device
    covered, _, got = rig.restore("p", 37)               # and served from there
    assert covered == 37 and (got is None or got == kv("p", 37))
    st = rig.cache.stats()
    assert st["hits"] == {t: (t == tier) + (t == "device") for t in TIERS}
    assert st["drops"] == dict.fromkeys(st["drops"], 0)
    rig.cache.check()


def scripted_run(rig, steps: int = 150, seed: int = 7) -> list:
    """A fixed random mix of offers, restores, evictions and prefetches; what each step saw."""
    rng = random.Random(seed)
    keys = [f"k{i}" for i in range(14)]
    length = {k: rng.randint(1, 24) for k in keys}
    trace = []
    for _ in range(steps):
        op = rng.random()
        k = rng.choice(keys)
        if op < 0.4:
            rig.offer(k, length[k])
            trace.append(("offer", k))
        elif op < 0.8:
            covered, _, got = rig.restore(k, length[k])
            assert got is None or got == kv(k, length[k])
            trace.append(("restore", k, covered))
        elif op < 0.9:
            tier = rng.choice(TIERS)
            rig.cache.evict(tier, rng.randint(1, 30 * BPT))
            trace.append(("evict", tier))
        else:
            rig.cache.prefetch(rng.sample(keys, 3))
            trace.append(("prefetch",))
        trace.append(tuple(rig.cache.lookup(x)[0] for x in keys))
        rig.cache.check()
    st = rig.cache.stats()
    keep = ("entries", "bytes", "reserved_bytes", "hits", "misses", "evictions", "drops",
            "moved_bytes", "promotions", "prefetched", "covered_tokens")
    return trace + [{k: st[k] for k in keep}]


@pytest.mark.parametrize("eviction", EVICTIONS)
def test_accounting_mode_makes_the_same_decisions_as_real_bytes(rigs, tmp_path, eviction):
    args = dict(device_bytes=40 * BPT, host_bytes=50 * BPT, disk_bytes=6 * (4096 + 24 * BPT),
                eviction=eviction, seed=3)
    runs = {}
    for spec in ("host", "torch:cpu", None):
        d = tmp_path / str(spec)
        d.mkdir()
        runs[spec] = scripted_run(rigs(spec, d, **args))
    assert runs["host"] == runs[None]
    assert runs["torch:cpu"] == runs[None]
    assert runs[None][-1]["evictions"]["device"] > 0 and runs[None][-1]["hits"]["disk"] > 0


def test_emulated_device_makes_the_same_decisions_and_models_seconds(rigs, tmp_path):
    args = dict(device_bytes=40 * BPT, host_bytes=50 * BPT, disk_bytes=4 * (4096 + 24 * BPT))
    emu = rigs("emu:lpddr5-6400", tmp_path, **args)
    acct = rigs(None, **args)
    assert scripted_run(emu, steps=25) == scripted_run(acct, steps=25)
    # disk -> request: a disk read then a host -> device hop, at the TierBandwidth defaults
    emu.cache.evict("device", 1 << 30)
    emu.cache.evict("host", 1 << 30)
    emu.offer("x", 10)
    for tier in ("device", "host"):
        emu.cache.evict(tier, 1)
    assert emu.cache.lookup("x")[0] == "disk"
    _, secs, got = emu.restore("x", 10)
    assert got == kv("x", 10)
    assert secs == pytest.approx(10 * BPT / 3e9 + 10 * BPT / 25e9)


def test_accounting_seconds_follow_the_bandwidths():
    bw = TierBandwidth(device_copy_gbps=200.0, host_to_device_gbps=20.0, device_to_host_gbps=10.0,
                       disk_read_gbps=4.0, disk_write_gbps=1.0)
    c = PrefixCache(None, 1000, device_bytes=10 ** 6, host_bytes=10 ** 6, disk_bytes=10 ** 7,
                    bandwidth=bw)
    blk = type("B", (), {"capacity_tokens": 500})()
    n = 500 * 1000
    assert c.offer("a", blk, 500) == pytest.approx(2 * n / 200e9)      # read + write counted
    assert c.restore("a", blk, 500) == (500, pytest.approx(2 * n / 200e9))
    c.evict("device", 1)
    assert c.stats()["moved_seconds"]["device->host"] == pytest.approx(n / 10e9)
    c.evict("host", 1)
    assert c.stats()["moved_seconds"]["host->disk"] == pytest.approx(n / 1e9)
    assert c.restore("a", blk, 500) == (500, pytest.approx(n / 4e9 + n / 20e9))
    assert c.lookup("a") == ("device", 500)
    c.check()


# -- eviction ---------------------------------------------------------------------------------------

def device_victim(eviction: str, seed: int = 0) -> str:
    """Offer a, b, c into a device tier that holds three, use a, offer d: who went to host?"""
    c = PrefixCache(None, BPT, device_bytes=3 * 8 * BPT, host_bytes=10 * 8 * BPT,
                    eviction=eviction, seed=seed, bandwidth=BW)
    blk = type("B", (), {"capacity_tokens": 8})()
    for k in "abc":
        c.offer(k, blk, 8)
    c.restore("a", blk, 8)
    c.offer("d", blk, 8)
    moved = [k for k in "abcd" if c.lookup(k)[0] == "host"]
    assert len(moved) == 1 and c.lookup("d")[0] == "device"
    c.check()
    return moved[0]


def test_lru_evicts_the_least_recently_used_fifo_the_first_in_random_any_seeded():
    assert device_victim("lru") == "b"        # a was used after b and c arrived
    assert device_victim("fifo") == "a"       # use does not reorder a FIFO
    victims = [device_victim("random", seed) for seed in range(30)]
    assert victims == [device_victim("random", seed) for seed in range(30)]   # reproducible
    assert set(victims) == {"a", "b", "c"}    # and not a disguised LRU or FIFO


def test_lru_order_survives_demotion_to_the_next_tier():
    c = PrefixCache(None, BPT, device_bytes=2 * 8 * BPT, host_bytes=2 * 8 * BPT,
                    disk_bytes=10 * (4096 + 8 * BPT), bandwidth=BW)
    blk = type("B", (), {"capacity_tokens": 8})()
    for k in "abcd":          # a, b demoted to host (in that order)
        c.offer(k, blk, 8)
    assert [c.lookup(k)[0] for k in "abcd"] == ["host", "host", "device", "device"]
    c.offer("e", blk, 8)      # c demoted; host full: the least recently used of a, b, c spills
    assert [c.lookup(k)[0] for k in "abcde"] == ["disk", "host", "host", "device", "device"]


def test_prefetch_brings_keys_up_and_never_evicts_one_of_them():
    c = PrefixCache(None, BPT, device_bytes=2 * 8 * BPT, host_bytes=2 * 8 * BPT,
                    disk_bytes=10 * (4096 + 8 * BPT), bandwidth=BW)
    blk = type("B", (), {"capacity_tokens": 8})()
    for k in "abcdef":
        c.offer(k, blk, 8)
    assert [c.lookup(k)[0] for k in "abcdef"] == ["disk", "disk", "host", "host", "device",
                                                 "device"]
    secs = c.prefetch(["a", "f", "b", "zzz"])
    assert secs > 0
    assert c.lookup("a")[0] == "device" and c.lookup("f")[0] == "device"
    assert c.lookup("b")[0] == "host"         # no device room left without evicting a or f
    assert c.lookup("e")[0] in ("host", "disk")
    assert c.stats()["prefetched"] == 2
    c.check()


# -- capacities -------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["host", None], ids=ids)
def test_capacities_are_respected_in_bytes(rigs, tmp_path, spec):
    caps = dict(device_bytes=30 * BPT + 100, host_bytes=45 * BPT, disk_bytes=3 * 4096 + 60 * BPT)
    rig = rigs(spec, tmp_path, **caps)
    rng = random.Random(1)
    for i in range(120):
        k = f"k{rng.randint(0, 40)}"
        if rng.random() < 0.6:
            rig.offer(k, rng.randint(1, 29))
        else:
            rig.restore(k, None)
        st = rig.cache.stats()
        for tier in TIERS:
            assert st["reserved_bytes"][tier] <= caps[f"{tier}_bytes"]
            assert st["bytes"][tier] <= st["reserved_bytes"][tier]
        if spec is not None:
            on_disk = sum(f.stat().st_size for f in tmp_path.glob("*.kv"))
            assert on_disk == st["reserved_bytes"]["disk"] <= caps["disk_bytes"]
    assert rig.cache.stats()["evictions"]["disk"] > 0
    rig.cache.check()


def test_a_prefix_larger_than_every_tier_is_dropped_as_full_not_raised(rigs):
    rig = rigs(None, device_bytes=10 * BPT, host_bytes=10 * BPT)
    assert rig.offer("big", 11) == 0.0
    assert rig.cache.lookup("big") == (None, 0)
    assert rig.cache.stats()["drops"]["full"] == 1


def test_a_prefix_too_large_for_the_device_tier_goes_straight_to_host(rigs):
    rig = rigs("host", device_bytes=4 * BPT, host_bytes=20 * BPT)
    rig.offer("p", 10)
    assert rig.cache.lookup("p") == ("host", 10)
    covered, _, got = rig.restore("p", 10)
    assert covered == 10 and got == kv("p", 10)
    assert rig.cache.lookup("p") == ("host", 10)          # no device room: it stays
    assert rig.cache.stats()["moved_bytes"] == {"request->host": 10 * BPT,
                                                "host->request": 10 * BPT}


# -- integrity --------------------------------------------------------------------------------------

def spill_to_disk(rig, key: str, tokens: int):
    rig.offer(key, tokens)
    rig.cache.evict("device", 1)
    rig.cache.evict("host", 1)
    assert rig.cache.lookup(key)[0] == "disk"
    (path,) = [p for p in rig.cache_dir.glob("*.kv")]
    return path


@pytest.fixture
def disk_rig(rigs, tmp_path):
    rig = rigs("host", tmp_path, device_bytes=64 * BPT, host_bytes=64 * BPT, disk_bytes=1 << 20)
    rig.cache_dir = tmp_path
    return rig


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_corrupted_disk_file_is_dropped_counted_and_never_served(disk_rig, where):
    path = spill_to_disk(disk_rig, "p", 30)
    raw = bytearray(path.read_bytes())
    at = disk_module.HEADER_BYTES + 1000 if where == "payload" else 40
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))
    covered, secs, got = disk_rig.restore("p", 30)
    assert (covered, got) == (0, None) and secs > 0     # the time spent finding out counts
    assert disk_rig.cache.stats()["drops"]["corrupt"] == 1
    assert disk_rig.cache.lookup("p") == (None, 0) and not path.exists()
    disk_rig.offer("p", 30)                   # the request recomputed it: cached again
    assert disk_rig.restore("p", 30)[2] == kv("p", 30)
    disk_rig.cache.check()


def test_a_truncated_disk_file_is_dropped(disk_rig):
    path = spill_to_disk(disk_rig, "p", 30)
    with open(path, "r+b") as f:
        f.truncate(disk_module.HEADER_BYTES + 100)
    assert disk_rig.restore("p", 30)[0] == 0
    assert disk_rig.cache.stats()["drops"]["corrupt"] == 1


def test_a_missing_disk_file_is_an_io_error_drop(disk_rig):
    spill_to_disk(disk_rig, "p", 30).unlink()
    assert disk_rig.restore("p", 30)[0] == 0
    assert disk_rig.cache.stats()["drops"]["io_error"] == 1
    disk_rig.cache.check()


@pytest.mark.parametrize("verify", [True, False])
def test_host_tier_bytes_are_checked_on_restore_when_verify(rigs, verify):
    rig = rigs("host", device_bytes=64 * BPT, host_bytes=64 * BPT, verify=verify)
    rig.offer("p", 20)
    rig.cache.evict("device", 1)
    host_block = rig.cache._index["p"].storage          # flip a byte where the host tier keeps it
    byte = host_block.read(1, offset=777)
    host_block.write(bytes([byte[0] ^ 1]), offset=777)
    covered, _, got = rig.restore("p", 20)
    if verify:
        assert covered == 0 and rig.cache.stats()["drops"]["corrupt"] == 1
        assert rig.cache.lookup("p") == (None, 0)
    else:                                     # documented: unchecked host bytes are served
        assert covered == 20 and got != kv("p", 20)
    rig.cache.check()


def corrupt_entry(rig, tmp_path, key: str, tokens: int, where: str) -> None:
    """Offer `key`, move it to the `where` tier and flip one byte of its bytes there."""
    rig.offer(key, tokens)
    rig.cache.evict("device", 1)
    if where == "host":
        host_block = rig.cache._index[key].storage
        byte = host_block.read(1, offset=777)
        host_block.write(bytes([byte[0] ^ 1]), offset=777)
        return
    rig.cache.evict("host", 1)
    (path,) = tmp_path.glob("*.kv")
    raw = bytearray(path.read_bytes())
    raw[disk_module.HEADER_BYTES + 777] ^= 1
    path.write_bytes(bytes(raw))


# host views of the block: the one-pass copy + checksum; emu: the copy through host memory (a disk
# read into a block that is no host memory was always checked before its copy)
@pytest.mark.parametrize("spec,where", [("host", "host"), ("host", "disk"),
                                        ("torch:cpu", "host"), ("torch:cpu", "disk"),
                                        ("emu:lpddr5-6400", "host")])
def test_a_corrupted_entry_leaves_the_requests_block_as_it_was(rigs, tmp_path, spec, where):
    rig = rigs(spec, tmp_path, device_bytes=64 * BPT, host_bytes=64 * BPT, disk_bytes=1 << 20)
    corrupt_entry(rig, tmp_path, "p", 20, where)
    blk = rig.block(20)
    own = kv("the request's own", 20)
    blk.write(own)
    covered, _ = rig.cache.restore("p", blk, 20)
    assert covered == 0 and rig.cache.stats()["drops"]["corrupt"] == 1
    assert blk.read(20 * BPT) == own
    rig.requests.release(blk.request_id)
    rig.cache.check()


def test_a_different_length_under_one_key_is_a_collision(rigs):
    rig = rigs("host", device_bytes=64 * BPT)
    rig.offer("p", 20)
    assert rig.restore("p", 21) == (0, 0.0, None)
    assert rig.cache.lookup("p") == (None, 0)
    assert rig.cache.stats()["drops"]["collision"] == 1
    rig.offer("p", 20)
    rig.offer("p", 25)                        # re-offered with another length: replaced
    assert rig.cache.lookup("p") == ("device", 25)
    assert rig.restore("p", 25)[2] == kv("p", 25)
    assert rig.cache.stats()["drops"]["collision"] == 2
    rig.cache.check()


def test_restore_into_a_smaller_block_covers_what_fits_and_does_not_promote(rigs):
    rig = rigs("host", device_bytes=64 * BPT, host_bytes=64 * BPT)
    rig.offer("p", 40)
    rig.cache.evict("device", 1)
    covered, _, got = rig.restore("p", 40, capacity=25)
    assert covered == 25 and got == kv("p", 40)[:25 * BPT]
    assert rig.cache.lookup("p") == ("host", 40)


# -- the disk directory -------------------------------------------------------------------------

def test_disk_dir_must_exist_be_a_directory_and_be_writable(tmp_path):
    with pytest.raises(BadArgument, match="does not exist"):
        PrefixCache("host", BPT, disk_bytes=1 << 20, disk_dir=str(tmp_path / "nope"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(BadArgument, match="not a directory"):
        PrefixCache("host", BPT, disk_bytes=1 << 20, disk_dir=str(tmp_path / "file"))
    with pytest.raises(BadArgument, match="needs disk_dir"):
        PrefixCache("host", BPT, disk_bytes=1 << 20)


def _refuses_files(path) -> bool:
    try:
        (path / ".odma-write-test").write_text("x")
    except OSError:
        return True
    (path / ".odma-write-test").unlink()
    return False


def test_a_read_only_disk_dir_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        # root writes into a 0555 directory; sysfs refuses new files even to root
        target = ro if _refuses_files(ro) else Path("/sys")
        if not (target.is_dir() and _refuses_files(target)):
            pytest.skip("no directory here refuses new files (root, and no sysfs)")
        with pytest.raises(BadArgument, match="not writable"):
            PrefixCache("host", BPT, disk_bytes=1 << 20, disk_dir=str(target))
    finally:
        ro.chmod(0o755)


def test_disk_full_mid_spill_drops_the_entry_and_leaves_no_partial_file(disk_rig, monkeypatch):
    real_write = disk_module._os_write
    calls = []

    def write_then_fail(fd, data):
        calls.append(len(data))
        if len(calls) == 2:                   # the header went through; the payload half does
            real_write(fd, bytes(data)[:len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(disk_module, "_os_write", write_then_fail)
    disk_rig.offer("p", 30)
    disk_rig.cache.evict("device", 1)
    disk_rig.cache.evict("host", 1)           # the spill fails: nothing raises
    assert len(calls) == 2
    assert disk_rig.cache.lookup("p") == (None, 0)
    st = disk_rig.cache.stats()
    assert st["drops"]["io_error"] == 1 and st["reserved_bytes"]["disk"] == 0
    assert list(disk_rig.cache_dir.iterdir()) == []
    disk_rig.cache.check()


def test_disk_files_outlive_the_cache_and_are_reindexed(tmp_path):
    dev = devices.open("host")
    requests = OracleAllocator(dev, 1 << 20, BPT, 1024)
    args = dict(device_bytes=64 * BPT, disk_bytes=1 << 20, disk_dir=str(tmp_path))
    try:
        with PrefixCache(dev, BPT, **args) as c:
            for i, k in enumerate("abc"):
                blk = requests.reserve(k, 9 + i, 1)
                blk.write(kv(k, 10 + i))
                c.offer(k, blk, 10 + i)
                requests.release(k)
            c.evict("device", 1 << 20)
        (tmp_path / ("0" * 32 + ".00000000.kv")).write_bytes(b"torn")   # a torn file of ours
        (tmp_path / ".leftover.kv.tmp").write_bytes(b"x")               # not ours: kept
        tmp_name = "." + "1" * 32 + ".00000000.kv.tmp"
        (tmp_path / tmp_name).write_bytes(b"half")                       # a crashed spill
        (tmp_path / "notes.txt").write_text("kept")
        with PrefixCache(dev, BPT, **args) as c:
            assert [c.lookup(k) for k in "abc"] == [("disk", 10), ("disk", 11), ("disk", 12)]
            st = c.stats()
            assert st["reindexed"] == 3 and st["drops"]["corrupt"] == 1
            blk = requests.reserve("r", 63, 1)
            assert c.restore("b", blk, 11)[0] == 11 and blk.read(11 * BPT) == kv("b", 11)
            requests.release("r")
            c.check()
        names = sorted(p.name for p in tmp_path.iterdir())
        assert "notes.txt" in names and ".leftover.kv.tmp" in names and tmp_name not in names
        assert len(list(tmp_path.glob("*.kv"))) == 2      # a and c (b was promoted, then closed)
        one_file = disk_module.file_bytes(12 * BPT)
        with PrefixCache(dev, BPT, device_bytes=64 * BPT, disk_bytes=one_file,
                         disk_dir=str(tmp_path)) as c:   # a smaller disk tier: trimmed to fit
            assert sum(c.lookup(k)[0] is not None for k in "abc") == 1
            assert len(list(tmp_path.glob("*.kv"))) == 1
            st = c.stats()
            assert st["reindexed"] == 1 and st["drops"]["full"] == 1
            c.check()
    finally:
        requests.close()
        dev.close()


def test_ten_thousand_prefixes_round_trip_through_disk_without_a_wrong_byte(rigs, tmp_path):
    bpt = 16
    dev = devices.open("host")
    cache = PrefixCache(dev, bpt, host_bytes=64 * bpt, disk_bytes=10_000 * (4096 + 8 * bpt),
                        disk_dir=str(tmp_path))
    pool = OracleAllocator(dev, 1 << 20, bpt, 64)
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 9, 10_000)
    blob = rng.bytes(int(lengths.sum()) * bpt)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * bpt
    blk = pool.reserve("req", 7, 1)
    for i, t in enumerate(lengths):
        blk.write(blob[starts[i]:starts[i] + t * bpt])
        cache.offer(f"p{i}", blk, int(t))
    assert cache.stats()["entries"]["disk"] >= 9_900
    wrong = 0
    for i in rng.permutation(10_000):
        t = int(lengths[i])
        covered, _ = cache.restore(f"p{i}", blk, t)
        assert covered == t
        wrong += blk.read(t * bpt) != blob[starts[i]:starts[i] + t * bpt]
    st = cache.stats()
    assert wrong == 0
    assert st["drops"] == dict.fromkeys(st["drops"], 0)
    assert st["hits"]["disk"] >= 9_900
    cache.check()
    cache.close()
    pool.close()
    dev.close()


# -- threads ----------------------------------------------------------------------------------------

def test_an_entry_being_restored_is_not_evicted_mid_copy(rigs, monkeypatch):
    rig = rigs("host", device_bytes=40 * BPT, host_bytes=200 * BPT)
    rig.offer("p", 30)
    entered, go = threading.Event(), threading.Event()
    real_move = cache_module.move

    def slow_move(src, dst, nbytes, checksum):
        if threading.current_thread().name == "restorer":
            entered.set()
            go.wait(5)
        return real_move(src, dst, nbytes, checksum)

    monkeypatch.setattr(cache_module, "move", slow_move)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=rig.restore("p", 30)), name="restorer")
    t.start()
    assert entered.wait(5)
    rig.cache.evict("device", 1 << 20)        # p is pinned: not a victim
    rig.offer("q", 35)                        # needs p's room: p stays, q goes to host
    assert rig.cache.lookup("p")[0] == "device" and rig.cache.lookup("q")[0] == "host"
    go.set()
    t.join(5)
    covered, _, got = out["r"]
    assert covered == 30 and got == kv("p", 30)
    rig.cache.check()


def test_threads_offering_restoring_and_evicting_never_see_a_wrong_byte(rigs, tmp_path):
    rig = rigs("host", tmp_path, device_bytes=60 * BPT, host_bytes=90 * BPT,
               disk_bytes=8 * (4096 + 32 * BPT))
    keys = {f"k{i}": 1 + (i * 7) % 32 for i in range(24)}
    errors, served = [], [0]

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(120):
                k = rng.choice(list(keys))
                op = rng.random()
                if op < 0.35:
                    rig.offer(k, keys[k])
                elif op < 0.8:
                    covered, _, got = rig.restore(k, keys[k])
                    if covered:
                        assert got == kv(k, keys[k]), f"wrong bytes for {k}"
                        served[0] += 1
                elif op < 0.9:
                    rig.cache.evict(rng.choice(TIERS), rng.randint(1, 40 * BPT))
                else:
                    rig.cache.prefetch(rng.sample(list(keys), 3))
                time.sleep(rng.random() * 0.001)
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert served[0] > 50
    rig.cache.check()
    st = rig.cache.stats()
    assert st["drops"]["corrupt"] == st["drops"]["io_error"] == 0
    for k, t in keys.items():                 # whatever is cached is still right
        covered, _, got = rig.restore(k, t)
        assert covered in (0, t) and (not covered or got == kv(k, t))


# -- invariants, validation, lifetime ------------------------------------------------------------

def test_check_reports_broken_bookkeeping():
    c = PrefixCache(None, BPT, device_bytes=64 * BPT, bandwidth=BW)
    blk = type("B", (), {"capacity_tokens": 8})()
    c.offer("a", blk, 8)
    c.check()
    c._index["a"].tokens = 9                  # the index no longer matches the pool's block
    with pytest.raises(InvariantBroken):
        c.check()


def test_arguments_are_validated_with_one_line_reasons(rigs):
    with pytest.raises(BadArgument, match="eviction"):
        PrefixCache(None, BPT, eviction="mru", bandwidth=BW)
    with pytest.raises(BadArgument, match="bandwidth"):
        PrefixCache(None, BPT, device_bytes=1 << 20)
    with pytest.raises(BadArgument, match="device_bytes"):
        PrefixCache(None, BPT, device_bytes=-1, bandwidth=BW)
    with pytest.raises(BadArgument, match="cannot hold one token"):
        PrefixCache(None, 1 << 20, device_bytes=1000, bandwidth=BW)
    with pytest.raises(BadArgument, match="disk_dir"):
        PrefixCache(None, BPT, disk_bytes=1 << 20, disk_dir="/tmp", bandwidth=BW)
    with pytest.raises(BadArgument):
        TierBandwidth(device_copy_gbps=0.0)
    rig = rigs("host", device_bytes=64 * BPT)
    blk = rig.block(10)
    with pytest.raises(BadArgument, match="cannot offer"):
        rig.cache.offer("p", blk, 11)
    with pytest.raises(BadArgument, match="string"):
        rig.cache.lookup(42)
    with pytest.raises(BadArgument):
        rig.cache.offer("p", blk, 0)
    with pytest.raises(BadArgument, match="Block"):
        rig.cache.restore("p", type("B", (), {"capacity_tokens": 8})())
    with pytest.raises(BadArgument, match="tier"):
        rig.cache.evict("gpu", 1)


def test_sizes_beyond_a_64_bit_byte_offset_are_refused_with_one_line_reasons():
    for args in (dict(bytes_per_token=10 ** 300), dict(device_bytes=10 ** 300),
                 dict(host_bytes=10 ** 300), dict(disk_bytes=10 ** 300),
                 dict(device_bytes=1 << 63)):
        name = next(iter(args))
        bpt = args.pop("bytes_per_token", BPT)
        with pytest.raises(BadArgument, match=f"{name} must be at most 2\\*\\*63 - 1 bytes") as err:
            PrefixCache(None, bpt, bandwidth=BW, **args)
        assert "\n" not in str(err.value) and len(str(err.value)) < 100
    with PrefixCache(None, BPT, device_bytes=(1 << 63) - 1, bandwidth=BW) as c:
        assert c.capacity["device"] == (1 << 63) - 1


def test_a_bytes_disk_dir_is_refused_with_one_line_reason(tmp_path):
    with pytest.raises(BadArgument, match="disk_dir must be a str path, not bytes"):
        PrefixCache("host", BPT, disk_bytes=1 << 20, disk_dir=os.fsencode(tmp_path))


def finishes(call, seconds: float = 30.0, unblock=None):
    """call() in a thread: what it returned, or a failure if it is still blocked after `seconds`
    (then unblock() lets it go, so no thread is left hanging)."""
    out: dict = {}

    def run():
        try:
            out["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        if unblock is not None:
            unblock()
        t.join(seconds)
        pytest.fail(f"still blocked after {seconds} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


def open_fifo_writer(path):
    """Open a FIFO for writing: a reader blocked opening it returns."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_named_like_a_prefix_file_is_skipped_without_blocking(tmp_path):
    fifo = tmp_path / f"{disk_module.key_digest('p')}.00000000{disk_module.SUFFIX}"
    os.mkfifo(fifo)
    cache = finishes(lambda: PrefixCache("host", BPT, device_bytes=64 * BPT, disk_bytes=1 << 20,
                                         disk_dir=str(tmp_path)),
                     unblock=lambda: open_fifo_writer(fifo))
    try:
        st = cache.stats()
        assert st["reindexed"] == 0 and st["drops"] == dict.fromkeys(st["drops"], 0)
        assert fifo.exists() and cache.lookup("p") == (None, 0)    # not ours: left alone
        cache.check()
    finally:
        cache.close()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_spilled_file_replaced_by_a_fifo_is_an_io_error_not_a_hang(disk_rig):
    path = spill_to_disk(disk_rig, "p", 30)
    path.unlink()
    os.mkfifo(path)
    covered, _, _ = finishes(lambda: disk_rig.restore("p", 30),
                             unblock=lambda: open_fifo_writer(path))
    assert covered == 0 and disk_rig.cache.stats()["drops"]["io_error"] == 1
    disk_rig.cache.check()


def test_a_closed_cache_refuses_calls_and_close_is_idempotent():
    c = PrefixCache("host", BPT, device_bytes=64 * BPT, host_bytes=64 * BPT)
    c.close()
    c.close()
    with pytest.raises(AllocatorClosed):
        c.lookup("p")


def test_bad_input_raises_one_clear_error_and_changes_nothing(rigs):
    rig = rigs("host", device_bytes=64 * BPT)
    rig.offer("p", 20)
    before = rig.cache.stats()
    with pytest.raises(BadArgument, match="UTF-8"):
        rig.cache.lookup("\ud800")            # a lone surrogate cannot name a disk file
    blk = rig.block(25)
    with pytest.raises(BadArgument):          # 0 tokens is no prefix, not a collision
        rig.cache.restore("p", blk, 0)
    rig.requests.release(blk.request_id)
    with pytest.raises(StaleBlock):           # a released block: the entry stays, nothing counted
        rig.cache.offer("p", blk, 25)
    with pytest.raises(StaleBlock):
        rig.cache.restore("p", blk, 20)
    assert rig.cache.lookup("p") == ("device", 20)
    assert rig.cache.stats() == before
    rig.cache.check()


@pytest.mark.parametrize("spec", ["host", None], ids=ids)
def test_an_entry_dropped_while_a_prefetch_finds_no_room_is_freed(rigs, monkeypatch, spec):
    rig = rigs(spec, device_bytes=8 * BPT, host_bytes=64 * BPT)
    rig.offer("p", 8)
    rig.offer("x", 8)                         # p demoted to host; x fills the device tier
    assert rig.cache.lookup("p") == ("host", 8)
    real_make_room = rig.cache._make_room
    dropped = []

    def make_room_after_a_collision(tier, e, protect):
        if e.key == "p" and e.tokens == 8 and not dropped:
            dropped.append(True)
            rig.offer("p", 5)                 # another request re-offers p: the moving p is dropped
        return real_make_room(tier, e, protect)

    monkeypatch.setattr(rig.cache, "_make_room", make_room_after_a_collision)
    rig.cache.prefetch(["p", "x"])            # no device room without evicting p or x
    assert dropped and rig.cache.lookup("p")[1] == 5
    assert rig.cache.stats()["prefetched"] == 0
    rig.cache.check()                         # the old p's host block was given back


def test_a_promotion_runs_in_the_callers_thread_when_no_thread_can_start(rigs, monkeypatch):
    rig = rigs("host", device_bytes=64 * BPT, host_bytes=64 * BPT)
    rig.offer("p", 20)
    rig.cache.evict("device", 1)

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(cache_module.threading.Thread, "start", no_thread)
    covered, _, got = rig.restore("p", 20)
    assert covered == 20 and got == kv("p", 20)
    assert rig.cache.lookup("p") == ("device", 20)       # promoted, and nothing left waiting
    assert rig.cache.stats()["promotions"] == 1
    rig.cache.check()


@pytest.mark.parametrize("spec", ["host", "torch:cpu"])
def test_a_failed_promotion_leaves_the_entry_where_it_was(rigs, monkeypatch, spec):
    rig = rigs(spec, device_bytes=64 * BPT, host_bytes=64 * BPT)
    rig.offer("p", 20)
    rig.cache.evict("device", 1)
    real = rig.cache._transfer_bytes

    def device_fails_on_promotion(e, src, *rest):
        if src == "request":
            raise DeviceError("the device tier's copy failed")
        return real(e, src, *rest)

    monkeypatch.setattr(rig.cache, "_transfer_bytes", device_fails_on_promotion)
    covered, _, got = rig.restore("p", 20)
    assert covered == 20 and got == kv("p", 20)
    assert rig.cache.lookup("p") == ("host", 20)         # not dropped: its bytes were never at fault
    st = rig.cache.stats()
    assert st["promotions"] == 0 and st["drops"] == dict.fromkeys(st["drops"], 0)
    monkeypatch.undo()
    assert rig.restore("p", 20)[2] == kv("p", 20)
    assert rig.cache.lookup("p") == ("device", 20)
    rig.cache.check()


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="no /proc/self/statm here")
def test_tiers_take_host_memory_as_prefixes_fill_them_not_when_made():
    tier = 512 << 20
    before = resident_bytes()
    with PrefixCache("host", BPT, device_bytes=tier, host_bytes=tier) as c:
        assert resident_bytes() - before < tier // 8          # nowhere near the tiers' 1 GiB
        dev = devices.open("host")
        requests = OracleAllocator(dev, 1 << 20, BPT, 1024)
        try:
            blk = requests.reserve("r", 19, 1)
            blk.write(kv("p", 20))
            c.offer("p", blk, 20)
            c.evict("device", 1)
            blk.write(bytes(20 * BPT))
            assert c.restore("p", blk, 20)[0] == 20 and blk.read(20 * BPT) == kv("p", 20)
            assert c.lookup("p") == ("device", 20)
            c.check()
        finally:
            requests.close()
            dev.close()


def promotion_workers() -> list:
    return [t for t in threading.enumerate() if t.name == "odma-prefix-promote"]


def test_caches_dropped_without_close_free_their_memory_and_worker_at_once(monkeypatch):
    # an idle worker that nothing stops would outlive the whole test
    monkeypatch.setattr(cache_module, "WORKER_IDLE_S", 3600.0)
    dev = devices.open("host")
    requests = OracleAllocator(dev, 1 << 20, BPT, 1024)
    threads = threading.active_count()
    gc.disable()                              # freed by reference counting, not by a collection
    try:
        for i in range(50):
            c = PrefixCache("host", BPT, device_bytes=64 * BPT, host_bytes=64 * BPT)
            blk = requests.reserve(i, 19, 1)
            blk.write(kv("p", 20))
            c.offer("p", blk, 20)
            c.evict("device", 1)
            assert c.restore("p", blk, 20)[0] == 20        # its promotion starts the worker
            requests.release(i)
            assert c.lookup("p") == ("device", 20) and promotion_workers()
            pools, ref = c._pools, weakref.ref(c)
            del c
            assert ref() is None and pools == {"device": None, "host": None}
            for t in promotion_workers():
                t.join(60)
            assert not promotion_workers() and threading.active_count() <= threads
    finally:
        gc.enable()
        requests.close()
        dev.close()
