"""The elastic policy: extents committed a knee at a time, the first placement taken in pieces
when no range is long enough, admission by predicted demand, and a growth that finds no room
preempting the request with the least progress."""

from __future__ import annotations

import pytest

from allocator import AllocatorConfig, OutOfMemory, make_allocator
from allocator.buckets import align_up
from allocator.extent import ElasticAllocator
from allocator.policies import POLICY
from allocator.predictors import make_predictor
from allocator.serving.cards.presets import accelerator, model_spec
from allocator.serving.core.requests import RequestState
from allocator.serving.core.scheduler import Scheduler
from allocator.serving.sim.replica import ServingSetup, Simulation
from allocator.serving.sim.timing import MeasuredTiming
from test_allocator_fakes import pattern
from test_extent import assert_accounting, assert_disjoint, snapshot

BPT = 256
MAX_TOKENS = 1024
KNEE = 64
TOKENS = 2048                       # the pool
CFG = AllocatorConfig(background_refresh=False, extent_knee_tokens=KNEE, large_share=0.25)


def elastic(device=None, tokens=TOKENS, config=CFG):
    return ElasticAllocator(device, tokens * BPT, BPT, MAX_TOKENS, config)


def fragment(alloc, hole_tokens: int):
    """Fill the pool with knee-sized requests, then release every other one: the free space
    is holes of `hole_tokens`, none longer."""
    ids = []
    i = 0
    while True:
        try:
            alloc.reserve(f"f{i}", hole_tokens - KNEE, 0)
        except OutOfMemory:
            break
        ids.append(f"f{i}")
        i += 1
    for rid in ids[::2]:
        alloc.release(rid, 0)
    return ids[1::2]


def test_every_extent_is_whole_knees_and_growth_appends_one():
    with elastic() as alloc:
        blk = alloc.reserve("r", 100, 500, 0.1)       # a prediction does not size it
        assert blk.capacity_tokens == align_up(100 + KNEE, KNEE)   # prompt + knee, whole knees
        blk = alloc.grow("r", blk.capacity_tokens + 1)
        assert blk.extent_tokens()[-1] == KNEE
        assert alloc.name == "elastic" and make_allocator(
            "elastic", None, TOKENS * BPT, BPT, MAX_TOKENS, CFG).name == "elastic"


def test_a_fragmented_pool_takes_the_first_placement_in_pieces_of_a_knee_or_more(device):
    with elastic(device) as alloc:
        fragment(alloc, 2 * KNEE)                      # holes of two knees
        before = alloc.stats()["split_reserves"]
        blk = alloc.reserve("big", 4 * KNEE, 0)        # 5 knees: no hole holds it whole
        assert blk.capacity_tokens >= 5 * KNEE and len(blk.extents) > 1
        assert all(t % KNEE == 0 for t in blk.extent_tokens())
        assert alloc.stats()["split_reserves"] == before + 1
        data = pattern(3, blk.capacity_tokens * BPT)
        blk.write(data)                                # bytes cross the pieces
        assert blk.read(len(data)) == data
        assert_disjoint(alloc)
        assert_accounting(alloc)
        alloc.check()


def test_a_placement_that_fits_only_in_part_takes_nothing():
    """Three free holes of a knee each, a request of four knees: the pieces found are given
    back, the failure is counted, nothing else changes."""
    with elastic() as alloc:
        fragment(alloc, KNEE)
        holes = alloc.stats()["free_bytes"] // alloc.block_bytes(KNEE)
        for i in range(holes - 3):                     # leave three holes
            alloc.reserve(f"fill{i}", 0, 0)
        before = snapshot(alloc)
        failures = alloc.reserve_failures
        with pytest.raises(OutOfMemory):
            alloc.reserve("big", 3 * KNEE, 0)
        after = snapshot(alloc)
        assert after[1] == before[1] and alloc.reserve_failures == failures + 1
        assert after[0]["free_bytes"] == before[0]["free_bytes"]
        alloc.reserve("small", 2 * KNEE, 0)            # three knees do fit, in pieces
        alloc.check()


def test_the_free_space_stays_whole_knees_through_churn():
    """Prompts of any length, growth, releases in random order: every free range is a whole
    number of knees, so no hole is too short for a piece (paging's property, at knee size)."""
    import random

    rng = random.Random(7)
    with elastic() as alloc:
        live = {}
        for step in range(3000):
            op = rng.random()
            if op < 0.4 or not live:
                rid = f"r{step}"
                try:
                    alloc.reserve(rid, rng.randrange(1, 400), 0)
                except OutOfMemory:
                    continue
                live[rid] = alloc.block(rid).tokens
            elif op < 0.8:
                rid = rng.choice(list(live))
                total = min(live[rid] + rng.randrange(1, 90), MAX_TOKENS)
                try:
                    alloc.grow(rid, total)
                    live[rid] = total
                except OutOfMemory:
                    live.pop(rid)
                    alloc.release(rid, preempted=True)
            else:
                rid = rng.choice(list(live))
                live.pop(rid)
                alloc.release(rid, 0)
            for region in alloc._regions:
                assert all(size % alloc.block_bytes(KNEE) == 0
                           for size in region._free_start.values())
        alloc.check()


def scheduler(alloc, reqs):
    sched = Scheduler(alloc, make_predictor("oracle"), reqs, max_batch=8, max_prefill=4096,
                      bytes_per_token=BPT, log=[], policy=POLICY["elastic"])
    return sched


def start(sched, i):
    """Request i made its first token and joins the decodes."""
    sched._first_token(i, sched.reqs[i], 0.0)
    assert i in sched.running


class Unsure:
    """Knows each length, with an uncertainty of 0.5 (the 95 % bound is 1.5x the prediction)."""

    def predict(self, request):
        return float(request.generated_tokens), 0.5

    def observe(self, request, generated_tokens):
        pass


@pytest.mark.parametrize("bound, both", [(0.0, True), (1.0, False)])
def test_the_demand_bound_sets_the_quantile_admission_plans_for(bound, both):
    """A (100 + 600 predicted) runs; B (100 + 400) arrives; the pool holds 1,400 tokens. At the
    prediction itself A's remaining need and B fit the free pool; at the upper bound (x 1.5)
    they do not, though B's first extents would."""
    config = AllocatorConfig(background_refresh=False, extent_knee_tokens=KNEE,
                             demand_bound=bound, large_share=0.25)
    with elastic(tokens=1400, config=config) as alloc:
        reqs = [RequestState(0, 100, 600, 0.0), RequestState(1, 100, 400, 0.0)]
        sched = Scheduler(alloc, Unsure(), reqs, max_batch=8, max_prefill=100,
                          bytes_per_token=BPT, policy=POLICY["elastic"])
        admitted = sched.schedule(0.0).admitted
        assert [i for i, *_ in admitted] == [0]        # the prefill budget takes one
        start(sched, 0)
        admitted = sched.schedule(0.0).admitted
        assert bool(admitted) == both
        if not both:                                   # its first extents would have fitted
            assert alloc.pool_bytes - alloc.reserved_bytes >= alloc.block_bytes(
                align_up(100 + KNEE, alloc.token_alignment))


def fill(alloc, name):
    """Take every free byte with requests outside the scheduler (never its victims)."""
    n = 0
    while True:
        try:
            alloc.reserve(f"{name}{n}", 0, 0)
        except OutOfMemory:
            break
        n += 1
    while True:                        # and what is shorter than a first placement
        blk = alloc.block(f"{name}0")
        try:
            alloc.grow(f"{name}0", blk.capacity_tokens + 1)
        except OutOfMemory:
            return


def test_a_growth_without_room_preempts_the_request_with_the_least_progress():
    with elastic(tokens=1400) as alloc:
        reqs = [RequestState(0, 500, 400, 0.0), RequestState(1, 50, 30, 0.0),
                RequestState(2, 200, 300, 0.0)]
        sched = scheduler(alloc, reqs)
        sched.demand = False                           # admit all three, to meet the wall
        sched.schedule(0.0)
        for i in (0, 1, 2):
            start(sched, i)
        fill(alloc, "a")
        sched.demand = True
        sched.log.clear()
        grown = sched._grow(2, alloc.block(2).capacity_tokens + 1)[0]
        # contexts: 0 holds 501 tokens, 1 holds 51, the grower 2 holds 201: 1 goes
        assert [i for what, i in sched.log if what == "preempt"] == [1]
        assert grown.capacity_tokens > 200 + KNEE and set(sched.running) == {0, 2}
        assert sched.waiting.first(1) == [1] and reqs[1].preemptions == 1
        # the grower itself is the one to go when it has the least progress: it is not the
        # scheduler's to preempt then, the caller's (OutOfMemory, nothing preempted)
        fill(alloc, "b")
        sched.log.clear()
        with pytest.raises(OutOfMemory):
            sched._grow(2, alloc.block(2).capacity_tokens + 1)
        assert [what for what, _ in sched.log] == ["oom"] and set(sched.running) == {0, 2}
        alloc.check()


def test_simulate_serves_every_request_with_elastic_on_a_small_pool():
    spec = model_spec("deepseek-r1-distill-qwen-7b")
    timing = MeasuredTiming("curve", {256: 40.0, 4096: 150.0, 1 << 20: 290.0}, 300.0, 250.0)
    setup = ServingSetup(spec, accelerator("mlu370-x4"), timing, max_model_len=3000,
                         kv_pool_gb=0.4, predictor="noisy")
    import numpy as np
    rng = np.random.default_rng(4)
    reqs = [RequestState(i, int(p), int(g), float(a)) for i, (p, g, a) in enumerate(
        zip(rng.integers(5, 1500, 200), rng.integers(1, 1400, 200),
            np.sort(rng.uniform(0, 20, 200))))]
    sim = Simulation(setup, "elastic", reqs)
    try:
        sim.run()
    finally:
        sim.alloc.close()
    assert sim.sched.done == len(reqs) and all(r.made == r.gen for r in reqs)
    assert sim.layout == "extent"
