"""Prefix cache benchmarks (pytest-benchmark; figures in benchmark.extra_info, never asserted).

    .venv/bin/python -m pytest bench/bench_prefix.py --benchmark-only \
        --benchmark-columns=min,median,max

One prefix of 1,000 tokens of DeepSeek-R1-Distill-Qwen-7B (28 layers x 4 KV heads x 128 dims x
K and V x 2 B = 57,344 B/token: 57 MB), on `host` and `torch:cpu`:

- GB/s per tier pair, each move timed alone through the public API: device->host (evict from
  the device tier: copy + checksum), host->device (prefetch: copy + verify), host->disk (evict
  from the host tier: one file written, page cache, no fsync), disk->host (prefetch with no
  device tier: mapped read + verify), and restores into a request's block from each tier
  (device->request is one device copy);
- the target: restoring the prefix from the device tier and from the host tier, side by side with
  the native streaming copier (`host` Device.copy of the same bytes, timed in the same rounds);
  `ratio` = native seconds / restore seconds (1.0: the restore costs what the copy alone costs).
  A restore from the host tier returns once the request's block holds checked bytes; its
  promotion to the device tier runs in the background (`restore_plus_promotion_s` waits for it).
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest

from allocator import OracleAllocator
from allocator.prefix import TIERS, PrefixCache
from odma_hw import devices

BPT = 57_344          # DeepSeek-R1-Distill-Qwen-7B, bf16 KV
TOKENS = 1_000
NBYTES = BPT * TOKENS
ROUNDS = 15
FLUSH_BYTES = 1 << 30  # written before every timed call: no side starts with its bytes in a cache


@functools.cache
def _scratch() -> np.ndarray:
    return np.empty(FLUSH_BYTES, np.uint8)


def flush_caches() -> None:
    """Evict the CPU caches (a VM may report, and share, a large L3): a timed copy right after
    set-up would otherwise read bytes the set-up just touched and win against one that does not."""
    _scratch().fill(1)


def _open(spec: str):
    backend = spec.split(":")[0]
    found = {s.backend: s for s in devices.discover()}[backend]
    if spec not in found.specs:
        pytest.skip(f"{spec} unavailable: {found.reason}")
    return devices.open(spec)


class Rig:
    """A serving device, a request pool, a cache holding the one prefix `p`."""

    def __init__(self, spec, tmp_path, device_tier=True, verify=True):
        self.dev = _open(spec)
        room = 2 * NBYTES + (1 << 20)
        self.requests = OracleAllocator(self.dev, room, BPT, 2 * TOKENS)
        self.cache = PrefixCache(self.dev, BPT, device_bytes=room if device_tier else 0,
                                 host_bytes=room, disk_bytes=room + 8192, disk_dir=str(tmp_path),
                                 verify=verify)
        self.block = self.requests.reserve("req", TOKENS - 1, 1)
        self.block.write(np.random.default_rng(0).bytes(NBYTES))
        self.cache.offer("p", self.block, TOKENS)

    def put(self, tier: str) -> None:
        """Move `p` to `tier` (untimed set-up)."""
        where = self.cache.lookup("p")[0]
        if TIERS.index(where) > TIERS.index(tier):
            self.cache.prefetch(["p"])
            where = self.cache.lookup("p")[0]
        while where != tier and TIERS.index(where) < TIERS.index(tier):
            self.cache.evict(where, 1)
            where = self.cache.lookup("p")[0]
        assert where == tier, (where, tier)

    def close(self):
        self.cache.close()
        self.requests.close()
        self.dev.close()


@pytest.fixture
def rigs(tmp_path):
    made = []

    def make(spec, **kw):
        d = tmp_path / f"disk{len(made)}"
        d.mkdir()
        made.append(Rig(spec, d, **kw))
        return made[-1]

    yield make
    for rig in made:
        rig.close()


PAIRS = {  # pair -> (tier the prefix starts in, the timed call, needs a device tier)
    "device->host": ("device", lambda r: r.cache.evict("device", 1), True),
    "host->device": ("host", lambda r: r.cache.prefetch(["p"]), True),
    "host->disk": ("host", lambda r: r.cache.evict("host", 1), True),
    "disk->host": ("disk", lambda r: r.cache.prefetch(["p"]), False),
    "device->request": ("device", lambda r: r.cache.restore("p", r.block, TOKENS), True),
    "host->request": ("host", lambda r: r.cache.restore("p", r.block, TOKENS), False),
    "disk->request": ("disk", lambda r: r.cache.restore("p", r.block, TOKENS), False),
}


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("spec", ["host", "torch:cpu"])
def test_tier_pair_bandwidth(benchmark, timings, rigs, spec, pair):
    start, call, device_tier = PAIRS[pair]
    rig = rigs(spec, device_tier=device_tier)

    def setup():
        rig.put(start)
        flush_caches()
        return (), {}

    benchmark.pedantic(lambda: call(rig), setup=setup, rounds=ROUNDS, iterations=1,
                       warmup_rounds=1)
    if timings():
        med = timings().median
        benchmark.extra_info.update(device=spec, pair=pair, nbytes=NBYTES, median_s=med,
                                    gbps=NBYTES / med / 1e9,
                                    best_gbps=NBYTES / timings().min / 1e9)
    rig.cache.check()


@pytest.mark.parametrize("source", ["device", "host", "host-unverified"])
def test_restore_1000_token_prefix_vs_native_copier(benchmark, timings, rigs, source):
    """The target: a restore of the 57 MB prefix vs the native streaming copier on the same
    bytes. Each round copies natively in its set-up, then restores: `ratio` is the median over
    rounds of native / restore seconds (paired, so load drifting on a shared machine cancels),
    `ratio_of_medians` the plain one."""
    rig = rigs("host", verify=source != "host-unverified")
    dev = rig.dev
    a, b = dev.alloc(NBYTES), dev.alloc(NBYTES)
    native = []
    tier = source.split("-")[0]
    warmup, rounds = 2, 2 * ROUNDS
    try:
        dev.write(a, 0, rig.block.read(NBYTES))
        dev.copy(b, 0, a, 0, NBYTES)               # fault both in

        def setup():
            rig.put(tier)
            flush_caches()
            t0 = time.perf_counter()
            dev.copy(b, 0, a, 0, NBYTES)
            native.append(time.perf_counter() - t0)
            flush_caches()
            return (), {}

        def restore():
            covered, _ = rig.cache.restore("p", rig.block, TOKENS)
            assert covered == TOKENS

        benchmark.pedantic(restore, setup=setup, rounds=rounds, iterations=1,
                           warmup_rounds=warmup)
        settled = []
        for _ in range(5):                         # restore + its background promotion
            rig.put(tier)
            flush_caches()
            t0 = time.perf_counter()
            rig.cache.restore("p", rig.block, TOKENS)
            rig.cache.lookup("p")                  # waits for the promotion
            settled.append(time.perf_counter() - t0)
        if timings():
            restores = list(timings().data)
            paired = np.array(native[-len(restores):]) / np.array(restores)
            rst = timings().median
            nat = float(np.median(native[warmup:]))
            benchmark.extra_info.update(
                source=source, nbytes=NBYTES, restore_median_s=rst, native_median_s=nat,
                restore_gbps=NBYTES / rst / 1e9, native_copy_gbps=NBYTES / nat / 1e9,
                ratio=float(np.median(paired)), ratio_of_medians=nat / rst,
                best_ratio=min(native[warmup:]) / timings().min,
                restore_plus_promotion_s=float(np.median(settled)))
    finally:
        dev.free(a)
        dev.free(b)
