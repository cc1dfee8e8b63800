"""Allocator invariants under random operation sequences (hypothesis) and under threads.

The state machine keeps a model of every live request (its length and the bytes it wrote) and,
after every step, checks: blocks never overlap, reserved + free == pool, every block holds its
request's length, every byte a request wrote is still there (across migrations), and the TLSF
heap walk. Bucket refreshes are among the random steps, so bounds change under live blocks.
"""

from __future__ import annotations

import random
import threading

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from allocator import (AllocatorConfig, OutOfMemory, PagedAllocator, RacmAllocator,
                       UnknownRequest)
from test_allocator_fakes import MemoryDevice

BPT = 64
MAX_TOKENS = 256
POOL = 48 * MAX_TOKENS * BPT


class AllocatorMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self):
        super().__init__()
        self.device = MemoryDevice()
        self.alloc = RacmAllocator(self.device, POOL, BPT, MAX_TOKENS, AllocatorConfig(
            background_refresh=False, refresh_every=7, window=40, n_buckets=4,
            token_alignment=8, large_share=0.2))
        self.model: dict = {}    # request id -> (tokens, bytes written)
        self.next_id = 0

    @rule(target=requests, prompt=st.integers(0, MAX_TOKENS - 1),
          predicted=st.floats(0, 400, allow_nan=False), u=st.sampled_from([0.0, 0.3, 1.0, 5.0]),
          fill=st.integers(0, 255))
    def reserve(self, prompt, predicted, u, fill):
        rid = self.next_id
        self.next_id += 1
        try:
            blk = self.alloc.reserve(rid, prompt, predicted, u)
        except OutOfMemory:
            return rid          # a request that was never admitted: operations on it must fail
        assert blk.capacity_tokens >= prompt + 1
        data = bytes([fill]) * (prompt * BPT)
        blk.write(data)
        self.model[rid] = (prompt, data)
        return rid

    @rule(rid=requests, extra=st.integers(0, 300), fill=st.integers(0, 255))
    def grow(self, rid, extra, fill):
        if rid not in self.model:
            try:
                self.alloc.grow(rid, 1)
            except UnknownRequest:
                return
            raise AssertionError("grow of a request that is not live succeeded")
        tokens, data = self.model[rid]
        total = min(MAX_TOKENS, tokens + extra)
        try:
            blk = self.alloc.grow(rid, total)
        except OutOfMemory:
            assert self.alloc.block(rid).tokens == tokens   # still valid in its old block
            return
        assert blk.tokens == total <= blk.capacity_tokens
        assert blk.read(len(data)) == data                  # bytes survived any migration
        new = bytes([fill]) * ((total - tokens) * BPT)      # "decode" the new tokens
        blk.write(new, offset=len(data))
        self.model[rid] = (total, data + new)

    @rule(rid=consumes(requests), realized=st.booleans())
    def release(self, rid, realized):
        if rid not in self.model:
            try:
                self.alloc.release(rid)
            except UnknownRequest:
                return
            raise AssertionError("release of a request that is not live succeeded")
        tokens, _ = self.model.pop(rid)
        prompt = self.alloc.block(rid).prompt_tokens
        self.alloc.release(rid, tokens - prompt if realized else None)
        try:
            self.alloc.release(rid)
        except UnknownRequest:
            pass
        else:
            raise AssertionError("a second release succeeded")

    @rule()
    def refresh(self):
        bounds = self.alloc.refresh_buckets()
        assert list(bounds) == sorted(set(bounds)) and bounds[-1] <= MAX_TOKENS

    @invariant()
    def heap_is_consistent(self):
        self.alloc.check()
        st_ = self.alloc.stats()
        assert st_["reserved_bytes"] + st_["free_bytes"] == POOL
        spans = sorted((b.offset, b.offset + b.nbytes) for b in self.alloc.live_blocks())
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert {b.request_id: b.tokens for b in self.alloc.live_blocks()} == \
            {rid: t for rid, (t, _) in self.model.items()}

    def teardown(self):
        for rid in list(self.model):
            self.alloc.release(rid)
        if self.alloc.stats()["reserved_bytes"] == 0:
            for region in self.alloc._regions:
                assert region.free_ranges() == [(region.base, region.size)]
        self.alloc.close()


AllocatorMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                              deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase


class PagedMachine(RuleBasedStateMachine):
    """The paged baseline keeps every page in exactly one place."""

    requests = Bundle("requests")

    def __init__(self):
        super().__init__()
        self.alloc = PagedAllocator(None, 40 * 16 * BPT, BPT, MAX_TOKENS)
        self.n = 0

    @rule(target=requests, prompt=st.integers(0, 100))
    def reserve(self, prompt):
        self.n += 1
        try:
            self.alloc.reserve(self.n, prompt, 0)
        except OutOfMemory:
            pass
        return self.n

    @rule(rid=requests, extra=st.integers(0, 100))
    def grow(self, rid, extra):
        try:
            blk = self.alloc.block(rid)
            self.alloc.grow(rid, min(MAX_TOKENS, blk.tokens + extra))
        except (UnknownRequest, OutOfMemory):
            pass

    @rule(rid=consumes(requests))
    def release(self, rid):
        try:
            self.alloc.release(rid)
        except UnknownRequest:
            pass

    @invariant()
    def pages_accounted(self):
        self.alloc.check()


PagedMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)
TestPagedMachine = PagedMachine.TestCase


def test_threads_reserving_growing_releasing_while_the_refresher_runs():
    dev = MemoryDevice()
    cfg = AllocatorConfig(background_refresh=True, refresh_every=10, window=100, n_buckets=4,
                          token_alignment=8)
    alloc = RacmAllocator(dev, POOL, BPT, MAX_TOKENS, cfg)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        mine = {}
        try:
            for i in range(300):
                rid = (seed, i)
                try:
                    blk = alloc.reserve(rid, rng.randint(0, 60), rng.uniform(0, 150), rng.random())
                except OutOfMemory:
                    continue
                tag = bytes([seed]) * (blk.prompt_tokens * BPT)
                blk.write(tag)
                mine[rid] = tag
                for _ in range(rng.randint(0, 2)):
                    try:
                        alloc.grow(rid, min(MAX_TOKENS, alloc.block(rid).tokens + rng.randint(1, 120)))
                    except OutOfMemory:
                        break
                assert alloc.block(rid).read(len(tag)) == tag
                if rng.random() < 0.8:
                    alloc.release(rid)
                    del mine[rid]
            for rid, tag in mine.items():
                assert alloc.block(rid).read(len(tag)) == tag
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    alloc.check()
    for _ in range(500):                      # the refresher was woken; wait for it, not a time
        if alloc.buckets.refreshes:
            break
        alloc.buckets._thread.join(0.01)
    assert alloc.buckets.refreshes >= 1
    for blk in alloc.live_blocks():
        alloc.release(blk.request_id)
    alloc.check()
    assert alloc.stats()["reserved_bytes"] == 0
    for region in alloc._regions:
        assert region.free_ranges() == [(region.base, region.size)]
    alloc.close()
