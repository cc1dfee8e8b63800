"""RacmAllocator specification, run on every backend this machine has.

Sizes are small (bytes_per_token = 256 B, pools of a few MiB) so the suite is quick everywhere.
"""

from __future__ import annotations

import collections
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator import (LARGE, AllocatorConfig, BadArgument, ClusterManager, DuplicateRequest,
                       MigrationFailed, OdmaError, OracleAllocator, OutOfMemory, PagedAllocator,
                       PoolTooLarge, RacmAllocator, RequestBusy, S3Allocator, StaleBlock,
                       StaticAllocator, TlsfFreeSpace, UnknownRequest)
from test_allocator_fakes import MemoryDevice, fill_grow_release, open_or_skip, pattern

BPT = 256           # bytes per token
MAX_TOKENS = 1024
POOL = 4 << 20      # 16k tokens
CFG = AllocatorConfig(background_refresh=False, refresh_every=25, window=200)


def assert_disjoint(alloc):
    spans = sorted((b.offset, b.offset + b.nbytes) for b in alloc.live_blocks())
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, "two live blocks overlap"
    assert all(0 <= s and e <= alloc.pool_bytes for s, e in spans)


def assert_accounting(alloc):
    st = alloc.stats()
    assert st["reserved_bytes"] + st["free_bytes"] == st["pool_bytes"] == alloc.pool_bytes
    assert st["reserved_bytes"] == sum(b.nbytes for b in alloc.live_blocks())


def assert_one_free_region(alloc):
    assert len(alloc) == 0
    st = alloc.stats()
    assert st["reserved_bytes"] == 0 and st["free_bytes"] == alloc.pool_bytes
    for region in alloc._regions:
        assert region.free_ranges() == ([(region.base, region.size)] if region.size else [])
    assert st["external_fragmentation"] == pytest.approx(
        1 - max(r.size for r in alloc._regions) / alloc.pool_bytes)


# ---------------------------------------------------------------- the same suite on every backend

def test_bytes_written_survive_migration_byte_for_byte(device):
    with RacmAllocator(device, POOL, BPT, MAX_TOKENS, CFG) as alloc:
        blk = alloc.reserve("r", prompt_tokens=40, predicted_tokens=10)
        assert blk.bucket != LARGE and blk.capacity_tokens < MAX_TOKENS
        data = pattern(1, (blk.capacity_tokens - 1) * BPT)
        blk.write(data)
        neighbour = alloc.reserve("n", 40, 10)           # a live neighbour must stay untouched
        neighbour.write(pattern(2, 40 * BPT))
        new = alloc.grow("r", blk.capacity_tokens + 1)
        assert new is not blk and new.offset != blk.offset
        assert new.capacity_tokens > blk.capacity_tokens and new.bucket == LARGE
        assert new.read(len(data)) == data
        assert new.written == len(data)
        assert neighbour.read(40 * BPT) == pattern(2, 40 * BPT)
        assert alloc.block("r") is new
        with pytest.raises(StaleBlock):
            blk.read(16)
        with pytest.raises(StaleBlock):
            blk.write(b"x")
        assert alloc.stats()["migrations"] == 1
        assert alloc.stats()["migrated_bytes"] == len(data)
        alloc.check()


def test_blocks_never_overlap_and_reserved_plus_free_is_capacity(device):
    rng = random.Random(7)
    with RacmAllocator(device, POOL, BPT, MAX_TOKENS, CFG) as alloc:
        live = {}
        for i in range(400):
            op = rng.random()
            if live and op < 0.4:
                rid = rng.choice(sorted(live))
                alloc.release(rid)
                del live[rid]
            elif live and op < 0.6:
                rid = rng.choice(sorted(live))
                blk = alloc.block(rid)
                try:
                    live[rid] = alloc.grow(rid, min(MAX_TOKENS, blk.tokens + rng.randint(1, 300)))
                except OutOfMemory:
                    pass
            else:
                try:
                    live[i] = alloc.reserve(i, rng.randint(0, 600), rng.uniform(0, 400),
                                            rng.choice([0.0, 0.2, 1.0, 9.0]))
                except OutOfMemory:
                    pass
            if i % 20 == 0:
                assert_disjoint(alloc)
                assert_accounting(alloc)
                alloc.check()
        assert_disjoint(alloc)
        assert_accounting(alloc)


def test_releasing_everything_returns_the_pool_to_one_free_region(device):
    with RacmAllocator(device, POOL, BPT, MAX_TOKENS, CFG) as alloc:
        fill_grow_release(alloc, 3, grow_every=3)
        assert_one_free_region(alloc)
        alloc.check()


def test_pool_larger_than_the_device_is_refused(device):
    too_big = device.info.total_bytes + (1 << 20)
    with pytest.raises(PoolTooLarge):
        RacmAllocator(device, too_big, BPT, MAX_TOKENS, CFG)
    with RacmAllocator(device, POOL, BPT, MAX_TOKENS, CFG) as alloc:  # the device still works
        alloc.reserve("r", 1, 1).write(b"ok")


def test_paged_baseline_moves_real_bytes_across_pages(device):
    with PagedAllocator(device, POOL, BPT, MAX_TOKENS) as paged:
        paged.reserve("a", 20, 0)
        paged.reserve("b", 20, 0)
        blk = paged.grow("a", 100)                      # pages of "b" sit in between
        assert blk.segments >= 2
        data = pattern(5, 100 * BPT)
        blk.write(data)
        assert blk.read(len(data)) == data
        paged.check()


# ---------------------------------------------------------------- placement policy

def test_policy_inflates_by_uncertainty_and_picks_the_smallest_bucket():
    cfg = AllocatorConfig(background_refresh=False, initial_bounds=(64, 128, 256, 512),
                          alpha=1.0, tau=2.0, large_share=0.25)
    with RacmAllocator(None, POOL, BPT, MAX_TOKENS, cfg) as alloc:
        assert alloc.reserve(1, 100, 60, 0.0).capacity_tokens == 100 + 64
        assert alloc.reserve(2, 100, 60, 0.5).capacity_tokens == 100 + 128   # L' = 90
        assert alloc.reserve(3, 100, 60, 1.5).capacity_tokens == 100 + 256   # L' = 150
        high = alloc.reserve(4, 100, 60, 2.5)                                # u > tau
        assert high.bucket == LARGE and high.offset >= alloc._large.base
        beyond = alloc.reserve(5, 100, 600, 0.0)                             # above the top bound
        assert beyond.bucket == LARGE
        assert high.capacity_tokens == MAX_TOKENS                            # no data yet
        assert [alloc.block(i).bucket for i in (1, 2, 3)] == [0, 1, 2]


def test_bounds_follow_realized_lengths_and_apply_only_to_later_reservations():
    for rule in ("occupancy", "min-waste"):
        # the paper's cold start: one refresh, after refresh_every completions
        cfg = AllocatorConfig(background_refresh=False, refresh_every=100, window=100,
                              n_buckets=4, bucket_rule=rule, cold_start="equal-width")
        with RacmAllocator(None, 64 << 20, BPT, MAX_TOKENS, cfg) as alloc:
            early = alloc.reserve("early", 10, 100)
            before = alloc.buckets.bounds
            rng = random.Random(1)
            for i in range(100):
                g = rng.randint(20, 200)
                alloc.reserve(i, 10, g)
                alloc.release(i, g)
            after = alloc.buckets.bounds
            assert after != before and len(after) <= 4
            assert all(b % 16 == 0 and b <= MAX_TOKENS for b in after)
            assert list(after) == sorted(set(after))
            assert after[-1] <= 208                  # learned from lengths <= 200, aligned to 16
            assert alloc.block("early").capacity_tokens == early.capacity_tokens
            assert alloc.buckets.history[-1] == (100, after)


def test_a_cold_pool_learns_early_and_follows_predictions_until_refresh_every():
    cfg = AllocatorConfig(background_refresh=False, refresh_every=1000, n_buckets=4)
    with RacmAllocator(None, 64 << 20, BPT, MAX_TOKENS, cfg) as alloc:
        assert alloc.reserve("big", 10, 0, math.inf).capacity_tokens == MAX_TOKENS  # no data
        alloc.release("big")
        rng = random.Random(2)
        for i in range(300):
            g = rng.randint(20, 200)
            alloc.reserve(i, 10, g)
            alloc.release(i, g)
        assert alloc.buckets.refreshes == 3          # at 64, 128 and 256, not only at 1000
        large = alloc.reserve("large", 10, 0, math.inf)
        assert large.capacity_tokens == 224          # 10 + longest generation (<= 200), aligned
        assert alloc.reserve("small", 10, 30).capacity_tokens == 48  # still the prediction
    paper = AllocatorConfig(background_refresh=False, refresh_every=1000, n_buckets=4,
                            cold_start="equal-width")
    with RacmAllocator(None, 64 << 20, BPT, MAX_TOKENS, paper) as alloc:
        for i in range(300):
            alloc.reserve(i, 10, 50)
            alloc.release(i, 50)
        assert alloc.buckets.refreshes == 0
        assert alloc.reserve("large", 10, 0, math.inf).capacity_tokens == MAX_TOKENS


def test_background_refresher_publishes_bounds():
    cfg = AllocatorConfig(background_refresh=True, refresh_every=50, window=500)
    with RacmAllocator(None, 16 << 20, BPT, MAX_TOKENS, cfg) as alloc:
        for i in range(50):
            alloc.reserve(i, 5, 50)
            alloc.release(i, 30 + i % 20)
        thread = alloc.buckets._thread
        assert thread is not None and thread.is_alive()
        for _ in range(200):                          # wait for the thread, not for a time
            if alloc.buckets.refreshes:
                break
            thread.join(0.01)
        assert alloc.buckets.refreshes == 1
        assert alloc.buckets.bounds[-1] <= 64


# ---------------------------------------------------------------- failures keep state unchanged

def test_blocks_are_each_requests_block_in_order_none_while_it_migrates():
    with RacmAllocator(MemoryDevice(), POOL, BPT, MAX_TOKENS, CFG) as alloc:
        for rid in ("a", "b", "c"):
            alloc.reserve(rid, 10, 10)
        alloc.grow("b", 200)                                 # b moves to a larger block
        assert alloc.blocks(["c", "a", "b"]) == [alloc.block(r) for r in ("c", "a", "b")]
        assert alloc.blocks([]) == []
        # while a request migrates, neither lookup hands out its old block
        seen = []

        def copy(old, new):
            for look in (lambda: alloc.block("a"), lambda: alloc.blocks(["c", "a"])):
                with pytest.raises(RequestBusy):
                    look()
                seen.append(look)
        alloc.grow("a", 300, copy=copy)
        assert len(seen) == 2 and alloc.blocks(["a"])[0].capacity_tokens >= 300


def snapshot(alloc):
    st = alloc.stats()
    blocks = sorted((str(b.request_id), b.offset, b.nbytes, b.tokens) for b in alloc.live_blocks())
    return st, blocks


@pytest.mark.parametrize("call, error", [
    (lambda a: a.reserve("live", 10, 10), DuplicateRequest),
    (lambda a: a.grow("ghost", 20), UnknownRequest),
    (lambda a: a.release("ghost"), UnknownRequest),
    (lambda a: a.release("gone"), UnknownRequest),                      # double release
    (lambda a: a.reserve("new", -1, 10), BadArgument),
    (lambda a: a.reserve("new", 10, -5), BadArgument),
    (lambda a: a.reserve("new", 10, math.nan), BadArgument),
    (lambda a: a.reserve("new", 10, math.inf), BadArgument),
    (lambda a: a.reserve("new", 10, 10, math.nan), BadArgument),
    (lambda a: a.reserve("new", 10, 10, -0.1), BadArgument),
    (lambda a: a.reserve("new", 10.5, 10), BadArgument),
    (lambda a: a.reserve("new", True, 10), BadArgument),
    (lambda a: a.reserve("new", MAX_TOKENS, 10), BadArgument),
    (lambda a: a.reserve(["unhashable"], 10, 10), BadArgument),
    (lambda a: a.grow("live", 5), BadArgument),                         # below current length
    (lambda a: a.grow("live", MAX_TOKENS + 1), BadArgument),
    (lambda a: a.grow("live", -3), BadArgument),
    (lambda a: a.release("live", realized_tokens=-1), BadArgument),
    (lambda a: a.release("live", realized_tokens=10 ** 6), BadArgument),  # more than the block
    (lambda a: a.block("live").write(b"x", offset=10 ** 9), BadArgument),
    (lambda a: a.block("live").read(-1), BadArgument),
    (lambda a: a.blocks(["live", "gone"]), UnknownRequest),             # one of them released
    (lambda a: a.blocks(["live", ["unhashable"]]), BadArgument),
])
def test_bad_input_raises_a_specific_error_and_changes_nothing(call, error):
    dev = MemoryDevice()
    with RacmAllocator(dev, POOL, BPT, MAX_TOKENS, CFG) as alloc:
        alloc.reserve("live", 10, 10).write(b"kv")
        alloc.grow("live", 12)
        alloc.reserve("gone", 10, 10)
        alloc.release("gone")
        before = snapshot(alloc)
        with pytest.raises(error) as info:
            call(alloc)
        assert isinstance(info.value, OdmaError)
        assert snapshot(alloc) == before
        assert alloc.block("live").read(2) == b"kv"
        alloc.check()


def test_out_of_memory_on_grow_keeps_the_request_in_its_old_block():
    dev = MemoryDevice()
    cfg = AllocatorConfig(background_refresh=False, initial_bounds=(64,), large_share=0.0)
    pool = 8 * 1024 * BPT                       # 8 blocks of max size
    with RacmAllocator(dev, pool, BPT, MAX_TOKENS, cfg) as alloc:
        blk = alloc.reserve("r", 0, 10)
        blk.write(b"abc")
        filler = []
        while True:
            try:
                filler.append(alloc.reserve(len(filler), 0, 10))
            except OutOfMemory:
                break
        before = snapshot(alloc)
        with pytest.raises(OutOfMemory):
            alloc.grow("r", 65)
        st_before, blocks_before = before
        st_after, blocks_after = snapshot(alloc)
        assert blocks_after == blocks_before
        assert st_after["oom_events"] == st_before["oom_events"] + 1   # the only change: counted
        assert alloc.block("r") is blk and blk.live and blk.read(3) == b"abc"
        for f in filler[:16]:                          # room for a 1024-token block again
            alloc.release(f.request_id)
        assert alloc.grow("r", 65).read(3) == b"abc"
        alloc.check()


def test_reserve_out_of_memory_changes_nothing_but_the_failure_count():
    with RacmAllocator(None, 4 * MAX_TOKENS * BPT, BPT, MAX_TOKENS,
                       AllocatorConfig(background_refresh=False, large_share=0.0)) as alloc:
        n = 0
        while True:
            try:
                alloc.reserve(n, 100, 900)
                n += 1
            except OutOfMemory:
                break
        st, blocks = snapshot(alloc)
        with pytest.raises(OutOfMemory):
            alloc.reserve("more", 100, 900)
        st2, blocks2 = snapshot(alloc)
        assert blocks2 == blocks and st2["reserve_failures"] == st["reserve_failures"] + 1
        alloc.check()


def test_failed_migration_copy_frees_the_new_block_and_keeps_the_old():
    dev = MemoryDevice()
    with RacmAllocator(dev, POOL, BPT, MAX_TOKENS, CFG) as alloc:
        blk = alloc.reserve("r", 10, 10)
        data = pattern(9, blk.capacity_tokens * BPT)
        blk.write(data)
        st, blocks = snapshot(alloc)
        dev.fail_copies = True
        with pytest.raises(MigrationFailed):
            alloc.grow("r", blk.capacity_tokens + 1)
        assert snapshot(alloc) == (st, blocks)
        assert alloc.block("r") is blk and blk.live and blk.read(len(data)) == data
        alloc.check()
        dev.fail_copies = False
        assert alloc.grow("r", blk.capacity_tokens + 1).read(len(data)) == data


def test_pool_bad_arguments():
    dev = MemoryDevice(total_bytes=1 << 20)
    with pytest.raises(PoolTooLarge):
        RacmAllocator(dev, 2 << 20, BPT, 16, CFG)
    with pytest.raises(BadArgument):
        RacmAllocator(dev, 1 << 20, BPT, 10 ** 6, CFG)       # cannot hold one max-size block
    with pytest.raises(BadArgument):
        RacmAllocator(dev, 0, BPT, 16, CFG)
    with pytest.raises(BadArgument):
        RacmAllocator(dev, 1 << 20, BPT, 16, "not a config")
    with pytest.raises(BadArgument):
        AllocatorConfig(alpha=math.nan)
    with pytest.raises(BadArgument):
        AllocatorConfig(bucket_rule="magic")
    with pytest.raises(BadArgument):
        AllocatorConfig(byte_alignment=48)
    with pytest.raises(BadArgument):
        RacmAllocator("nonsense:device", 1 << 20, BPT, 16, CFG)


def test_accounting_only_mode_has_no_bytes():
    with RacmAllocator(None, POOL, BPT, MAX_TOKENS, CFG) as alloc:
        blk = alloc.reserve("r", 1, 1)
        with pytest.raises(BadArgument):
            blk.write(b"x")


def test_tensor_view_on_torch():
    torch = pytest.importorskip("torch")
    dev = open_or_skip("torch:cpu")
    with RacmAllocator(dev, POOL, BPT, MAX_TOKENS, CFG) as alloc:
        blk = alloc.reserve("r", 32, 32)
        kv = blk.tensor(torch.bfloat16, (2, 64, BPT // 4))    # (K/V, tokens, bytes/2/2)
        kv.fill_(2.0)
        blk.mark_written(kv.numel() * 2)
        raw = blk.read(4)
        assert raw == torch.tensor([2.0, 2.0], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
        moved = alloc.grow("r", blk.capacity_tokens + 1)
        assert torch.equal(moved.tensor(torch.bfloat16, (2, 64, BPT // 4)), kv)
        with pytest.raises(BadArgument):
            moved.tensor(torch.float32, (moved.nbytes,))      # larger than the block


# ---------------------------------------------------------------- baselines and cluster

def test_baselines_size_blocks_by_their_rule():
    with StaticAllocator(None, POOL, BPT, MAX_TOKENS, CFG) as st:
        assert st.reserve(1, 10, 5).capacity_tokens == MAX_TOKENS
    with OracleAllocator(None, POOL, BPT, MAX_TOKENS, CFG) as orc:
        assert orc.reserve(1, 10, 5).capacity_tokens == 15
        assert orc.grow(1, 16).capacity_tokens == 16
    cfg = AllocatorConfig(n_buckets=4, background_refresh=False)
    with S3Allocator(None, POOL, BPT, MAX_TOKENS, cfg) as s3:
        assert s3.buckets.bounds == (256, 512, 768, 1024)
        blk = s3.reserve(1, 10, 100)
        assert blk.capacity_tokens == 10 + 256 and blk.bucket == 0
        assert s3.grow(1, 10 + 257).capacity_tokens == 10 + 512
        for i in range(2000):
            s3.reserve(f"x{i}", 1, 1)
            s3.release(f"x{i}", 200)
        assert s3.buckets.bounds == (256, 512, 768, 1024)    # S3's buckets never move


def test_paged_baseline_counts_segments_and_never_loses_a_page():
    with PagedAllocator(None, 32 * 16 * BPT, BPT, 512) as paged:
        paged.reserve("a", 16, 0)
        paged.reserve("b", 16, 0)
        paged.grow("a", 48)
        assert paged.block("a").pages == [0, 2, 3] and paged.block("a").segments == 2
        with pytest.raises(OutOfMemory):
            paged.grow("b", 512)                     # needs 31 more pages, 29 are free
        assert len(paged.block("b").pages) == 1                # all or nothing
        paged.release("a", 32)
        paged.release("b")
        st = paged.stats()
        assert st["segments_per_request_mean"] == 1.5 and st["free_bytes"] == paged.pool_bytes
        assert st["utilization"] == (48 + 16) / (48 + 16)
        paged.check()


def test_cluster_places_by_free_capacity_and_shares_one_bucket_configuration():
    devs = [MemoryDevice(), MemoryDevice()]
    cluster = ClusterManager(devs, POOL, BPT, MAX_TOKENS, CFG)
    try:
        assert cluster.allocators[0].buckets is cluster.allocators[1].buckets is cluster.buckets
        for i in range(20):
            cluster.reserve(i, 100, 100)
        placed = [cluster.device_of(i) for i in range(20)]
        assert placed.count(0) == placed.count(1) == 10       # balanced by free bytes and load
        with pytest.raises(DuplicateRequest):
            cluster.reserve(3, 1, 1)
        for i in range(20):
            cluster.release(i, 50)
        assert cluster.buckets.completions == 20
        assert cluster.stats()["completed"] == 20
        cluster.check()
    finally:
        cluster.close()


# ---------------------------------------------------------------- the free-space manager itself

def test_tlsf_coalesces_immediately_and_reuses_exact_sizes():
    t = TlsfFreeSpace(0, 1 << 20, 64)
    a, b, c = t.alloc(1000), t.alloc(5000), t.alloc(64)
    assert (a, b, c) == (0, 1024, 6080)
    t.free(b)
    assert t.alloc(5000) == b                  # the exact-size range is reused, no split
    t.free(a)
    t.free(b)
    assert t.free_ranges() == [(0, 6080), (6144, (1 << 20) - 6144)]
    t.free(c)
    assert t.free_ranges() == [(0, 1 << 20)]
    assert t.alloc((1 << 20) + 64) == -1
    t.check()


def test_tlsf_refuses_only_when_no_free_range_fits():
    t = TlsfFreeSpace(0, 64 * 100, 64)
    offs = [t.alloc(64) for _ in range(100)]
    for o in offs[::2]:
        t.free(o)
    assert t.free_bytes == 64 * 50 and t.largest_free() == 64
    assert t.alloc(128) == -1                  # 50 free ranges, none of two units
    assert t.external_fragmentation() == pytest.approx(1 - 1 / 50)
    t.free(offs[1])
    assert t.alloc(192) == 0                   # ranges 0..2 coalesced
    t.check()


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.integers(-6, 6), max_size=60))
def test_paged_free_pages_come_out_in_fifo_order_and_hold_only_freed_pages(ops):
    """FreePages against the plain FIFO deque(range(n)) it replaces: the same pages in the same
    order, while it stores only pages once freed."""
    from allocator.paged import FreePages

    n = 40
    lazy, plain, held = FreePages(n), collections.deque(range(n)), []
    for k in ops:
        if k > 0 and k <= len(plain):
            got = lazy.take(k)
            assert got == [plain.popleft() for _ in range(k)]
            held += got
        elif k < 0 and held:
            back = held[:-k]
            del held[:-k]
            lazy.extend(back)
            plain.extend(back)
        assert len(lazy) == len(plain) and list(lazy) == list(plain)
        assert len(lazy.freed) <= n - len(held) - (n - lazy.fresh)


def test_a_huge_paged_pool_costs_no_memory_until_used():
    from allocator.paged import PagedAllocator

    with PagedAllocator(None, 1 << 50, 256, 256) as p:        # 2^34 pages of 16 tokens
        p.reserve("r", 100)
        assert p.stats()["live_capacity_tokens"] == 112 and len(p._free.freed) == 0
