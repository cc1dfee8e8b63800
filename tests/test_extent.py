"""The extent allocator: a request in a few contiguous extents, the first sized as ODMA sizes its
block, growth appending an extent (no copy), a merge (migration) once a request holds
extent_max extents; and its place in replay and in the serving simulation.

The protocol's behaviours the other allocators' suites check (bytes survive, no overlap,
accounting, bad input changes nothing, OutOfMemory changes nothing, a failed copy changes
nothing, closing, pins) run here on the extent allocator, on every backend where they concern
real memory; random operation sequences (hypothesis) run on host memory.
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
import time
import types

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from allocator import (AllocatorConfig, BadArgument, DuplicateRequest, InvariantBroken,
                       MigrationFailed, OdmaError, OutOfMemory, PoolTooLarge, RacmAllocator,
                       RequestBusy, StaleBlock, UnknownRequest, make_allocator)
from allocator.extent import ExtentAllocator
from allocator.replay import run_replay
from allocator.serving.cards.presets import accelerator, model_spec
from allocator.serving.core.requests import RequestState
from allocator.serving.sim.replica import ServingSetup, Simulation, run_policy
from allocator.serving.sim.steptime import StepTimer, extent_config, knee_tokens
from allocator.serving.sim.timing import MeasuredTiming
from allocator.trace import RequestTrace, arrival_seconds
from test_allocator_fakes import MemoryDevice, fill_grow_release, pattern
from test_allocator_trust import SlowWriteDevice

BPT = 256           # bytes per token
MAX_TOKENS = 1024
POOL = 4 << 20      # 16k tokens
KNEE = 64
# most tests pin the first extent to ODMA's block, the rule they compare against
CFG = AllocatorConfig(background_refresh=False, refresh_every=25, window=200,
                      extent_knee_tokens=KNEE, extent_first="prediction")


def extents(blk):
    return blk.extent_tokens()


def assert_disjoint(alloc):
    spans = sorted((off, off + nbytes) for b in alloc.live_blocks()
                   for off, nbytes, _, _ in b.extents)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, "two live extents overlap"
    assert all(0 <= s and e <= alloc.pool_bytes for s, e in spans)


def assert_accounting(alloc):
    st_ = alloc.stats()
    assert st_["reserved_bytes"] + st_["free_bytes"] == st_["pool_bytes"] == alloc.pool_bytes
    assert st_["reserved_bytes"] == sum(nbytes for b in alloc.live_blocks()
                                        for _, nbytes, _, _ in b.extents)
    assert st_["live_capacity_tokens"] == sum(sum(extents(b)) for b in alloc.live_blocks())


def snapshot(alloc):
    return alloc.stats(), sorted((str(b.request_id), tuple(b.extents), b.tokens, b.written)
                                 for b in alloc.live_blocks())


# ------------------------------------------------------------------ sizes: first extent, growth
def test_the_first_extent_is_the_block_odma_gives_before_and_after_learning():
    rng = random.Random(4)
    with RacmAllocator(None, POOL, BPT, MAX_TOKENS, CFG) as odma, \
            ExtentAllocator(None, POOL, BPT, MAX_TOKENS, CFG) as ext:
        for i in range(120):                   # past refresh_every: the buckets are learned
            prompt, pred, u = rng.randint(0, 500), rng.uniform(0, 400), rng.choice([0, .3, 9])
            a, b = odma.reserve(i, prompt, pred, u), ext.reserve(i, prompt, pred, u)
            assert extents(b) == [a.capacity_tokens] and b.bucket == a.bucket
            assert b.predicted == a.predicted and b.nbytes == a.capacity_tokens * BPT
            done = rng.randint(1, MAX_TOKENS - prompt)
            odma.release(i, min(done, a.capacity_tokens - prompt))
            ext.release(i, min(done, b.capacity_tokens - prompt))
        assert odma.stats()["bucket_bounds"] == ext.stats()["bucket_bounds"]
        assert ext.stats()["bucket_refreshes"] >= 1


@pytest.mark.parametrize("growth, sizes", [
    # prompt 100, first extent 128; grown one token past each capacity in turn
    ("generated", [128, 64, 96, 192]),         # max(knee 64, generated so far), aligned to 16
    ("footprint", [128, 144, 288, 576]),       # max(knee, every token held)
    ("knee", [128, 64, 64, 64]),               # knee-sized extents
])
def test_growth_appends_extents_of_max_knee_and_the_rule_then_merges(growth, sizes):
    cfg = AllocatorConfig(background_refresh=False, extent_first="prediction", extent_knee_tokens=KNEE, extent_growth=growth)
    with ExtentAllocator(None, 64 << 20, BPT, 4096, cfg) as alloc:
        blk = alloc.reserve("r", 100, 20)
        assert extents(blk) == [128]               # 100 + 20, aligned to 16: ODMA's cold start
        for _ in range(3):
            assert alloc.grow("r", blk.capacity_tokens + 1) is blk    # appended: same block
        assert extents(blk) == sizes and blk.capacity_tokens == sum(sizes)
        assert alloc.stats()["migrations"] == 0 and alloc.stats()["extent_appends"] == 3
        blk.mark_written(blk.capacity_tokens * BPT)
        merged = alloc.grow("r", blk.capacity_tokens + 1)           # a 5th extent: merge
        assert merged is not blk and not blk.live and len(merged.extents) == 1
        grown = merged.capacity_tokens - blk.capacity_tokens
        assert grown >= KNEE and grown % 16 == 0
        st_ = alloc.stats()
        assert st_["migrations"] == 1 and st_["migrated_bytes"] == blk.capacity_tokens * BPT
        alloc.check()


def test_growth_never_passes_max_tokens_and_a_tiny_knee_defaults_to_the_alignment():
    with ExtentAllocator(None, 1 << 20, BPT, 200, AllocatorConfig(background_refresh=False, extent_first="prediction")) as a:
        assert a.knee_tokens == 16                                  # knee unknown: alignment
        blk = a.reserve("r", 150, 10)
        assert extents(blk) == [160]
        a.grow("r", 161)
        assert extents(blk) == [160, 16]                           # max(16, 11 generated)
        a.grow("r", 200)                                            # 64 wanted, 24 left
        assert blk.capacity_tokens == 200 and extents(blk) == [160, 16, 24]
        a.check()


def test_extent_max_one_migrates_on_every_growth_like_a_contiguous_block():
    cfg = AllocatorConfig(background_refresh=False, extent_first="prediction", extent_knee_tokens=KNEE, extent_max=1)
    with ExtentAllocator(MemoryDevice(), POOL, BPT, MAX_TOKENS, cfg) as alloc:
        blk = alloc.reserve("r", 10, 10)
        data = pattern(1, blk.capacity_tokens * BPT)
        blk.write(data)
        for k in range(3):
            new = alloc.grow("r", blk.capacity_tokens + 1)
            assert new is not blk and len(new.extents) == 1
            assert new.read(len(data)) == data
            blk = new
        assert alloc.stats()["migrations"] == 3 and alloc.stats()["extent_appends"] == 0


# ------------------------------------------------------------ the protocol, on every backend
def test_bytes_survive_appends_and_merges_byte_for_byte(device):
    with ExtentAllocator(device, POOL, BPT, MAX_TOKENS, CFG) as alloc:
        blk = alloc.reserve("r", prompt_tokens=40, predicted_tokens=10)
        neighbour = alloc.reserve("n", 40, 10)           # a live neighbour must stay untouched
        neighbour.write(pattern(2, 40 * BPT))
        data = pattern(1, 40 * BPT)
        blk.write(data)
        seed = 10
        while True:
            total = blk.capacity_tokens + 1
            grown = alloc.grow("r", total)
            more = pattern(seed, (total - len(data) // BPT) * BPT)   # "decode" up to total
            grown.write(more, offset=len(data))
            data += more
            seed += 1
            assert grown.read(len(data)) == data            # across every span boundary
            if grown is not blk:                            # merged
                with pytest.raises(StaleBlock):
                    blk.read(16)
                with pytest.raises(StaleBlock):
                    blk.write(b"x")
                assert len(grown.extents) == 1 and grown.written == len(data)
                break
            blk = grown
        assert alloc.block("r") is grown
        assert neighbour.read(40 * BPT) == pattern(2, 40 * BPT)
        st_ = alloc.stats()
        assert st_["migrations"] == 1 and st_["extent_appends"] == CFG.extent_max - 1
        alloc.check()


def test_extents_never_overlap_and_reserved_plus_free_is_capacity(device):
    rng = random.Random(7)
    with ExtentAllocator(device, POOL, BPT, MAX_TOKENS, CFG) as alloc:
        live = set()
        for i in range(400):
            op = rng.random()
            if live and op < 0.4:
                rid = rng.choice(sorted(live))
                alloc.release(rid)
                live.discard(rid)
            elif live and op < 0.6:
                rid = rng.choice(sorted(live))
                blk = alloc.block(rid)
                try:
                    alloc.grow(rid, min(MAX_TOKENS, blk.tokens + rng.randint(1, 300)))
                except OutOfMemory:
                    pass
            else:
                try:
                    alloc.reserve(i, rng.randint(0, 600), rng.uniform(0, 400),
                                  rng.choice([0.0, 0.2, 1.0, 9.0]))
                    live.add(i)
                except OutOfMemory:
                    pass
            if i % 20 == 0:
                assert_disjoint(alloc)
                assert_accounting(alloc)
                alloc.check()
        assert_disjoint(alloc)
        assert_accounting(alloc)
        assert alloc.stats()["extent_appends"] > 0


def test_releasing_everything_returns_the_pool_to_one_free_region(device):
    with ExtentAllocator(device, POOL, BPT, MAX_TOKENS, CFG) as alloc:
        ids = fill_grow_release(alloc, 3, grow_every=2, grows=6)
        st_ = alloc.stats()
        assert len(alloc) == 0 and st_["reserved_bytes"] == 0
        for region in alloc._regions:
            assert region.free_ranges() == ([(region.base, region.size)] if region.size else [])
        assert st_["completed"] == len(ids) and st_["extents_per_request_max"] >= 2
        assert 1 <= st_["extents_per_request_mean"] <= st_["extents_per_request_max"]
        alloc.check()


def test_pool_larger_than_the_device_is_refused(device):
    with pytest.raises(PoolTooLarge):
        ExtentAllocator(device, device.info.total_bytes + (1 << 20), BPT, MAX_TOKENS, CFG)
    with ExtentAllocator(device, POOL, BPT, MAX_TOKENS, CFG) as alloc:   # the device still works
        alloc.reserve("r", 1, 1).write(b"ok")


# ----------------------------------------------------------- failures keep the state unchanged
@pytest.mark.parametrize("call, error", [
    (lambda a: a.reserve("live", 10, 10), DuplicateRequest),
    (lambda a: a.grow("ghost", 20), UnknownRequest),
    (lambda a: a.release("ghost"), UnknownRequest),
    (lambda a: a.release("gone"), UnknownRequest),                      # double release
    (lambda a: a.reserve("new", -1, 10), BadArgument),
    (lambda a: a.reserve("new", 10, math.nan), BadArgument),
    (lambda a: a.reserve("new", 10, math.inf), BadArgument),
    (lambda a: a.reserve("new", 10, 10, -0.1), BadArgument),
    (lambda a: a.reserve("new", True, 10), BadArgument),
    (lambda a: a.reserve("new", MAX_TOKENS, 10), BadArgument),
    (lambda a: a.reserve(["unhashable"], 10, 10), BadArgument),
    (lambda a: a.grow("live", 5), BadArgument),                         # below current length
    (lambda a: a.grow("live", MAX_TOKENS + 1), BadArgument),
    (lambda a: a.release("live", realized_tokens=-1), BadArgument),
    (lambda a: a.release("live", realized_tokens=10 ** 6), BadArgument),  # more than the block
    (lambda a: a.block("live").write(b"x", offset=10 ** 9), BadArgument),
    (lambda a: a.block("live").read(-1), BadArgument),
    (lambda a: a.block("live").pin(10 ** 6), BadArgument),              # past the first extent
    (lambda a: a.block("live").tensor("float16", (4,)), BadArgument),
])
def test_bad_input_raises_a_specific_error_and_changes_nothing(call, error):
    with ExtentAllocator(MemoryDevice(), POOL, BPT, MAX_TOKENS, CFG) as alloc:
        blk = alloc.reserve("live", 10, 10)
        blk.write(b"kv")
        alloc.grow("live", blk.capacity_tokens + 1)                    # two extents
        alloc.reserve("gone", 10, 10)
        alloc.release("gone")
        before = snapshot(alloc)
        with pytest.raises(error) as info:
            call(alloc)
        assert isinstance(info.value, OdmaError)
        assert snapshot(alloc) == before
        assert alloc.block("live").read(2) == b"kv"
        alloc.check()


def fill_pool(alloc, prompt=0, predicted=10):
    filler = []
    while True:
        try:
            filler.append(alloc.reserve(("f", len(filler)), prompt, predicted))
        except OutOfMemory:
            return filler


def test_out_of_memory_on_grow_leaves_the_extents_and_bytes_intact():
    cfg = AllocatorConfig(background_refresh=False, extent_first="prediction", initial_bounds=(64,), large_share=0.0,
                          extent_knee_tokens=KNEE, extent_growth="knee")
    with ExtentAllocator(MemoryDevice(), 8 * MAX_TOKENS * BPT, BPT, MAX_TOKENS, cfg) as alloc:
        blk = alloc.reserve("r", 0, 10)
        alloc.grow("r", 65)                                  # two extents of 64 tokens
        data = pattern(3, 65 * BPT)
        blk.write(data)
        filler = fill_pool(alloc)                            # 126 more: the pool is full
        assert alloc.stats()["free_bytes"] == 0
        before = snapshot(alloc)
        held = blk.extents
        with pytest.raises(OutOfMemory):
            alloc.grow("r", blk.capacity_tokens + 1)
        st_before, blocks_before = before
        st_after, blocks_after = snapshot(alloc)
        assert blocks_after == blocks_before and blk.extents is held
        assert st_after["oom_events"] == st_before["oom_events"] + 1   # the only change
        assert {k: v for k, v in st_after.items() if k != "oom_events"} == \
            {k: v for k, v in st_before.items() if k != "oom_events"}
        assert alloc.block("r") is blk and blk.live and blk.read(len(data)) == data
        for f in filler[:2]:                                 # room for one more extent
            alloc.release(f.request_id)
        assert alloc.grow("r", blk.capacity_tokens + 1).read(len(data)) == data
        alloc.check()


def test_a_merge_without_room_keeps_the_extents_and_appends_past_the_bound():
    cfg = AllocatorConfig(background_refresh=False, extent_first="prediction", initial_bounds=(64,), large_share=0.0,
                          extent_knee_tokens=KNEE, extent_max=2, extent_growth="knee")
    with ExtentAllocator(MemoryDevice(), 8 * MAX_TOKENS * BPT, BPT, MAX_TOKENS, cfg) as alloc:
        blk = alloc.reserve("r", 0, 10)
        alloc.grow("r", 65)
        data = pattern(4, 128 * BPT)
        blk.write(data)
        filler = fill_pool(alloc)
        for f in filler[::2]:                   # 64-token holes, none large enough to merge into
            alloc.release(f.request_id)
        grown = alloc.grow("r", blk.capacity_tokens + 1)
        assert grown is blk and extents(blk) == [64, 64, 64]
        st_ = alloc.stats()
        assert st_["merge_failures"] == 1 and st_["migrations"] == 0
        assert blk.read(len(data)) == data
        alloc.check()


def test_a_failed_merge_copy_frees_the_target_and_keeps_the_extents():
    dev = MemoryDevice()
    cfg = AllocatorConfig(background_refresh=False, extent_first="prediction", extent_knee_tokens=KNEE, extent_max=2)
    with ExtentAllocator(dev, POOL, BPT, MAX_TOKENS, cfg) as alloc:
        blk = alloc.reserve("r", 10, 10)
        alloc.grow("r", blk.capacity_tokens + 1)
        data = pattern(9, blk.capacity_tokens * BPT)
        blk.write(data)
        before = snapshot(alloc)
        dev.fail_copies = True
        with pytest.raises(MigrationFailed):
            alloc.grow("r", blk.capacity_tokens + 1)
        assert snapshot(alloc) == before
        assert alloc.block("r") is blk and blk.live and blk.read(len(data)) == data
        alloc.check()
        dev.fail_copies = False
        merged = alloc.grow("r", blk.capacity_tokens + 1)
        assert len(merged.extents) == 1 and merged.read(len(data)) == data


def test_reserve_out_of_memory_changes_nothing_but_the_failure_count():
    with ExtentAllocator(None, 4 * MAX_TOKENS * BPT, BPT, MAX_TOKENS,
                         AllocatorConfig(background_refresh=False, extent_first="prediction", large_share=0.0)) as alloc:
        fill_pool(alloc, 100, 900)
        st_, blocks = snapshot(alloc)
        with pytest.raises(OutOfMemory):
            alloc.reserve("more", 100, 900)
        st2, blocks2 = snapshot(alloc)
        assert blocks2 == blocks and st2["reserve_failures"] == st_["reserve_failures"] + 1
        alloc.check()


def test_check_raises_an_explicit_error_on_broken_bookkeeping():
    with ExtentAllocator(None, POOL, BPT, MAX_TOKENS, CFG) as alloc:
        a = alloc.reserve("a", 10, 10)
        b = alloc.reserve("b", 10, 10)
        alloc.check()
        a.capacity_tokens += 1                                # not the sum of its extents
        with pytest.raises(InvariantBroken):
            alloc.check()
        a.capacity_tokens -= 1
        b.extents = b.extents + a.extents[:1]                 # one range held twice
        b.capacity_tokens += a.extents[0][2]
        with pytest.raises(InvariantBroken):
            alloc.check()


def test_a_pin_addresses_the_first_extent():
    dev = MemoryDevice()
    with ExtentAllocator(dev, POOL, BPT, MAX_TOKENS, CFG) as alloc:
        blk = alloc.reserve("r", 10, 10)
        first = blk.capacity_tokens * BPT
        alloc.grow("r", blk.capacity_tokens + 1)
        with blk.pin(first, writing=True) as pin:
            device, buf, offset = pin.location
            assert device is dev and offset == blk.offset == blk.extents[0][0]
            dev.write(buf, offset, b"p" * 64)
        assert blk.read(64) == b"p" * 64
        with pytest.raises(BadArgument):
            blk.pin(first + 1)


@pytest.mark.parametrize("policy, config, totals, merges", [
    # extent: appends and a merge every other growth (extent_max 2)
    ("extent", AllocatorConfig(background_refresh=False, extent_first="prediction",
                               extent_knee_tokens=16, extent_max=2),
     (33, 60, 200, 400, 1000, 3000), 10),
    # elastic: a knee at a time, a merge every 16 extents
    ("elastic", AllocatorConfig(background_refresh=False, extent_knee_tokens=16),
     tuple(range(48, 1200, 16)), 6),
])
def test_a_write_racing_appends_and_merges_lands_or_is_refused(policy, config, totals, merges):
    """A writer thread writes 64 B at token offsets of the request's first 32 tokens through
    alloc.block(rid) while the main thread grows it (appends and merges): every write that
    returned normally is in the final block."""
    rng = random.Random(5)
    with make_allocator(policy, SlowWriteDevice(seed=2), 256 << 20, 4096, 4096,
                        config) as alloc:
        for trial in range(10):
            rid = ("r", trial)
            alloc.reserve(rid, 16, 16)
            last: dict = {}
            stop = threading.Event()

            def write_loop(seed):
                wr = random.Random(seed)
                k = 0
                while not stop.is_set():
                    off = wr.randrange(32) * 4096
                    data = k.to_bytes(8, "little") * 8
                    k += 1
                    try:
                        alloc.block(rid).write(data, off)
                    except (RequestBusy, StaleBlock):
                        continue
                    last[off] = data

            t = threading.Thread(target=write_loop, args=(rng.random(),))
            t.start()
            for total in totals:
                if total > alloc.block(rid).tokens:
                    time.sleep(rng.random() * 2e-3 * min(1.0, 6 / len(totals)))
                    alloc.grow(rid, total)
            time.sleep(rng.random() * 2e-3)
            stop.set()
            t.join()
            final = alloc.block(rid)
            assert all(final.read(64, off) == data for off, data in last.items())
            alloc.release(rid)
        assert alloc.stats()["migrations"] >= merges
        alloc.check()


# -------------------------------------------- random sequences on host memory (hypothesis)
EBPT = 64
EMAX = 256
EPOOL = 48 * EMAX * EBPT


class ExtentMachine(RuleBasedStateMachine):
    """Keeps a model of every live request (its length and the bytes it wrote); after every
    step: check(), no overlap, reserved + free == pool, every request's length, and every byte
    it wrote is still there across appends and merges."""

    requests = Bundle("requests")

    def __init__(self):
        super().__init__()
        self.alloc = ExtentAllocator("host", EPOOL, EBPT, EMAX, AllocatorConfig(
            extent_first="prediction", background_refresh=False, refresh_every=7, window=40,
            n_buckets=4, token_alignment=8, large_share=0.2, extent_knee_tokens=16,
            extent_max=3))
        self.model: dict = {}     # request id -> (tokens, bytes written)
        self.next_id = 0

    @rule(target=requests, prompt=st.integers(0, EMAX - 1),
          predicted=st.floats(0, 400, allow_nan=False), u=st.sampled_from([0.0, 0.3, 1.0, 5.0]),
          fill=st.integers(0, 255))
    def reserve(self, prompt, predicted, u, fill):
        rid = self.next_id
        self.next_id += 1
        try:
            blk = self.alloc.reserve(rid, prompt, predicted, u)
        except OutOfMemory:
            return rid
        assert blk.capacity_tokens >= prompt + 1 and len(blk.extents) == 1
        data = bytes([fill]) * (prompt * EBPT)
        blk.write(data)
        self.model[rid] = (prompt, data)
        return rid

    @rule(rid=requests, extra=st.integers(0, 300), fill=st.integers(0, 255))
    def grow(self, rid, extra, fill):
        if rid not in self.model:
            with pytest.raises(UnknownRequest):
                self.alloc.grow(rid, 1)
            return
        tokens, data = self.model[rid]
        total = min(EMAX, tokens + extra)
        old = self.alloc.block(rid)
        held = old.extents
        try:
            blk = self.alloc.grow(rid, total)
        except OutOfMemory:
            assert self.alloc.block(rid) is old and old.extents is held   # nothing changed
            assert old.read(len(data)) == data
            return
        assert blk.tokens == total <= blk.capacity_tokens
        assert blk is old or len(blk.extents) == 1                       # append, or merge
        assert blk.read(len(data)) == data
        new = bytes([fill]) * ((total - tokens) * EBPT)
        blk.write(new, offset=len(data))
        self.model[rid] = (total, data + new)

    @rule(rid=consumes(requests), realized=st.booleans())
    def release(self, rid, realized):
        if rid not in self.model:
            with pytest.raises(UnknownRequest):
                self.alloc.release(rid)
            return
        tokens, _ = self.model.pop(rid)
        prompt = self.alloc.block(rid).prompt_tokens
        self.alloc.release(rid, tokens - prompt if realized else None)
        with pytest.raises(UnknownRequest):
            self.alloc.release(rid)

    @rule()
    def refresh(self):
        bounds = self.alloc.refresh_buckets()
        assert list(bounds) == sorted(set(bounds)) and bounds[-1] <= EMAX

    @invariant()
    def consistent(self):
        self.alloc.check()
        assert_accounting(self.alloc)
        assert_disjoint(self.alloc)
        live = {b.request_id: b for b in self.alloc.live_blocks()}
        assert {rid: b.tokens for rid, b in live.items()} == \
            {rid: t for rid, (t, _) in self.model.items()}
        for rid, (_, data) in self.model.items():
            assert live[rid].read(len(data)) == data

    def teardown(self):
        for rid in list(self.model):
            self.alloc.release(rid)
        assert self.alloc.stats()["reserved_bytes"] == 0
        for region in self.alloc._regions:
            assert region.free_ranges() == [(region.base, region.size)]
        self.alloc.close()


ExtentMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                           deadline=None)
TestExtentMachine = ExtentMachine.TestCase


# ------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize("field, value", [
    ("extent_max", 0), ("extent_max", 2.5), ("extent_growth", "triple"),
    ("extent_knee_tokens", 0), ("extent_knee_tokens", True), ("extent_knee_fraction", 0.0),
    ("extent_knee_fraction", 1.5), ("extent_knee_fraction", math.nan),
])
def test_bad_extent_options_are_refused(field, value):
    with pytest.raises(BadArgument):
        AllocatorConfig(**{field: value})


def test_make_allocator_builds_extent_and_replay_completes_every_request():
    with make_allocator("extent", None, POOL, BPT, MAX_TOKENS, CFG) as alloc:
        assert isinstance(alloc, ExtentAllocator) and alloc.name == "extent"
    rng = np.random.default_rng(0)
    n = 600
    prompt = rng.integers(1, 300, n)
    gen = np.minimum(rng.lognormal(4.0, 0.8, n).astype(int) + 1, 700)
    trace = RequestTrace(prompt, gen, np.cumsum(rng.exponential(0.2, n)), name="synthetic")
    for pool in (8 << 20, 800 * 64 * 2):                     # roomy, then a few requests
        r = run_replay(trace, "extent", "online", bytes_per_token=64, pool_bytes=pool,
                       device="host")
        assert r["requests"] == r["completed"] == n and r["lost"] == 0
        assert 0 < r["utilization"] <= 1
        assert r["tokens_per_step"] * r["steps"] == pytest.approx(trace.generated.sum())


# -------------------------------------------------------------------------- the simulation
QWEN = model_spec("deepseek-r1-distill-qwen-7b")
MLU = accelerator("mlu370-x4")
# a device whose 256 B runs read at half the sequential bandwidth, 64 KiB runs at 0.9
KNEED = MeasuredTiming("kneed", {256: 100.0, 4096: 140.0, 65536: 180.0, 1 << 20: 196.0},
                       200.0, 180.0)


PREDICTED_FIRST = AllocatorConfig(background_refresh=False, extent_first="prediction")


def sim_setup(**kw):
    kw.setdefault("max_model_len", 4096)
    return ServingSetup(QWEN, MLU, KNEED, **kw)


def test_the_knee_is_the_shortest_run_at_the_fraction_of_streaming():
    assert knee_tokens(KNEED, 256, 0.9, 8192) == 256            # 64 KiB = 256 tokens of 256 B
    assert 256 < knee_tokens(KNEED, 256, 0.95, 8192) < 4096
    assert knee_tokens(KNEED, 256, 0.5, 8192) == 1
    assert knee_tokens(KNEED, 256, 1.0, 8192) == 8192           # never: max_tokens
    s = sim_setup()
    # the default fraction 0.8: runs of 64 tokens (16 KiB, head_dim 128 x 2 B per token) read
    # at 160 of KNEED's 200 GB/s
    assert knee_tokens(KNEED, 256, 0.8, 8192) == 64
    assert extent_config(s).extent_knee_tokens == 64
    given = dataclasses.replace(s, config=AllocatorConfig(background_refresh=False, extent_first="prediction",
                                                          extent_knee_tokens=48))
    assert extent_config(given).extent_knee_tokens == 48
    sim = Simulation(s, "extent", [RequestState(0, 100, 10, 0.0)])
    assert sim.layout == "extent" and sim.alloc.knee_tokens == 64
    sim.alloc.close()


def test_where_no_run_reaches_streaming_the_knee_is_where_the_plateau_starts():
    """Streams interleaved at the controller cap every run below the sequential rate: the knee
    is then the fraction of the fastest run, not a whole request."""
    capped = types.SimpleNamespace(                 # 200 GB/s at most, streaming at 300
        seq_gbps=300.0, run_gbps=lambda nbytes: np.minimum(200.0, 100.0 + nbytes / 655.36))
    assert knee_tokens(capped, 256, 0.9, 8192) == 205              # 100 + t x 256 / 655.36 = 180
    assert knee_tokens(capped, 256, 1.0, 8192) == 256               # the plateau's first run
    assert knee_tokens(KNEED, 256, 0.9, 8192) == 256              # a curve that gets there


def test_an_extent_is_read_as_a_contiguous_block_of_its_filled_tokens():
    s = sim_setup()
    ext, cont = StepTimer(s, "extent"), StepTimer(s, "contiguous")
    n, unit = ext.runs_per_unit, ext.run_unit_bytes
    assert (n, unit) == (cont.runs_per_unit, cont.run_unit_bytes) == (2 * 28 * 4, 256)

    def read(tokens):
        return n * tokens * unit / (float(KNEED.run_gbps(tokens * unit)) * 1e9)

    one = types.SimpleNamespace(extent_tokens=lambda: [2048])
    r, c = types.SimpleNamespace(), types.SimpleNamespace()
    ext.linearize(r, 10, 1000, one)
    cont.linearize(c, 10, 1000, None)
    # the same read at ctx
    assert r.kv_seconds_at_0 + 10 * r.kv_seconds_per_step == pytest.approx(
        c.kv_seconds_at_0 + 10 * c.kv_seconds_per_step)
    assert r.kv_seconds_per_step == pytest.approx((read(2048) - read(1000)) / 1048)  # chord to full
    assert (r.kv_bytes_at_0, r.kv_bytes_per_step) == (c.kv_bytes_at_0, c.kv_bytes_per_step)
    many = types.SimpleNamespace(extent_tokens=lambda: [1200, 256, 512, 64])
    ext.linearize(r, 0, 1200 + 256 + 100, many)                # the third one partly filled
    assert r.kv_seconds_at_0 == pytest.approx(read(1200) + read(256) + read(100))
    assert r.kv_seconds_per_step == pytest.approx((read(512) - read(100)) / 412)


def test_one_long_request_appends_extents_and_reports_only_merges_as_migrations():
    """100 + 3,000 tokens predicted as 100 + 10: a first extent of 112 tokens, then extents of
    max(knee 256, generated so far): 256, 272, 544; the 5th merges the four (1,184 tokens, all
    written) into one of 2,272; the last append is cut at max_model_len (1,824)."""
    req = RequestState(0, 100, 3000, 0.0)
    req.predicted = (10.0, 0.0)
    # a knee of 256 tokens: 0.9 of KNEED's streaming
    config = dataclasses.replace(PREDICTED_FIRST, extent_knee_fraction=0.9)
    sim = Simulation(sim_setup(config=config), "extent", [req])
    res = sim.run()
    st_ = res["allocator"]
    assert req.finish is not None and req.made == 3000
    assert st_["extent_appends"] == 4 and st_["migrations"] == 1
    assert st_["extents_per_request_max"] == 2 and st_["completed"] == 1
    assert st_["migrated_bytes"] == 1184 * QWEN.kv_bytes_per_token   # the 4 extents, full
    assert res["totals"]["migration"] == pytest.approx(
        sim.timer.migration_seconds(st_["migrated_bytes"]))
    assert sim.alloc.reserved_tokens_sum == 4096
    sim.alloc.close()


def synthetic(n=400, seed=1):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(20, 600, n)
    gen = np.minimum(rng.lognormal(4.5, 0.9, n).astype(int) + 1, 1500)
    return RequestTrace(prompt, gen, None, name="synthetic")


@pytest.mark.parametrize("kv_pool_gb", [0.4, 2.0])
def test_every_request_completes_with_extent_on_a_small_pool(kv_pool_gb):
    trace = synthetic()
    s = sim_setup(kv_pool_gb=kv_pool_gb)            # 0.4 GB: ~7k tokens
    r = run_policy(trace, arrival_seconds(trace, 50.0, seed=2), "extent", s)
    assert r["layout"] == "extent"
    assert r["completed"] == r["requests"] == 400 and r["lost"] == 0
    assert r["output_tokens"] == int(np.maximum(trace.generated, 1).sum())
    assert r["ttft_s"]["p50"] > 0 and r["e2e_s"]["p99"] >= r["e2e_s"]["p50"]
    assert 0 < r["utilization"] <= 1
    assert r["floor_margin_min"] >= 1.0


def test_every_request_completes_with_extent_even_under_preemption():
    """Every request predicted to make one token: first extents hold little more than the
    prompts, admission packs the pool and growth runs out of memory, so requests are preempted
    (and rerun in ODMA's large bucket); none is lost."""
    trace = synthetic(200, seed=3)
    arrive = arrival_seconds(trace, 50.0, seed=4)
    reqs = [RequestState(i, int(p), int(g), float(t))
            for i, (p, g, t) in enumerate(zip(trace.prompt, trace.generated, arrive))]
    for r in reqs:
        r.predicted = (1.0, 0.0)
    sim = Simulation(sim_setup(kv_pool_gb=0.4, config=PREDICTED_FIRST), "extent", reqs)
    res = sim.run()
    assert all(r.finish is not None and r.made == r.gen for r in reqs)
    assert res["totals"]["preemptions"] > 0 and res["allocator"]["oom_events"] > 0
    assert res["allocator"]["completed"] == 200 and len(sim.alloc) == 0
    sim.alloc.check()
    sim.alloc.close()


def test_a_knee_first_extent_holds_the_prompt_and_one_knee_and_grows_by_extents():
    """The default first extent commits memory as tokens come: the prompt and one knee of room,
    whatever the prediction; growth appends extents as for the prediction rule."""
    cfg = AllocatorConfig(background_refresh=False, extent_knee_tokens=KNEE)
    assert cfg.extent_first == "knee"
    with ExtentAllocator(None, 64 << 20, BPT, 4096, cfg) as alloc:
        blk = alloc.reserve("r", 100, 2000.0, 0.3)          # a long prediction changes nothing
        assert extents(blk) == [176]                          # 100 + 64, aligned to 16
        blk = alloc.grow("r", 177)
        assert extents(blk) == [176, 80] and alloc.migrations == 0
        alloc.check()
