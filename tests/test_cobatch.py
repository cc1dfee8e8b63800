"""Co-batching by bucket tag (the ODMA paper's task pool): admission takes, among the first W
waiting requests, the oldest whose tag is the batch's commonest, the head when none is or when
the head was passed over W times; every request is served; bad settings are refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from allocator import AllocatorConfig, make_allocator
from allocator.policies import POLICY
from allocator.predictors import make_predictor
from allocator.serving.cards.presets import accelerator, model_spec
from allocator.serving.core.requests import RequestState
from allocator.serving.core.scheduler import Scheduler
from allocator.serving.sim.replica import ServingSetup, Simulation
from allocator.serving.sim.timing import MeasuredTiming
from odma_cli.errors import BadArgument

BPT = 64


def scheduler(policy, gens, window, max_batch=64):
    """A scheduler over requests of 10 prompt tokens making gens[i] tokens, all waiting, with
    the oracle's predictions."""
    alloc = make_allocator(policy, None, 10**6 * BPT, BPT, 4096,
                           AllocatorConfig(background_refresh=False), page_tokens=16)
    reqs = [RequestState(i, 10, g, 0.0) for i, g in enumerate(gens)]
    sched = Scheduler(alloc, make_predictor("oracle"), reqs, max_batch=max_batch,
                      max_prefill=10**6, bytes_per_token=BPT, cobatch=window,
                      policy=POLICY[policy])
    return sched


def test_admission_prefers_the_batchs_commonest_tag_within_the_window():
    # paged has no buckets: tags are power-of-two classes of the predicted tokens
    gens = [100, 1000, 1000, 90, 1000, 80, 70]
    sched = scheduler("paged", gens, window=4, max_batch=2)
    first = sched.schedule(0.0).admitted
    # the head (100) starts the batch; the next is the oldest of its class (90), not 1000
    assert [i for i, *_ in first] == [0, 3]
    assert sched._tag(0, sched.reqs[0]) == sched._tag(3, sched.reqs[3]) != \
        sched._tag(1, sched.reqs[1])


def test_the_head_is_passed_over_at_most_window_times():
    sched = scheduler("paged", [100, 1000] + [100] * 12, window=3, max_batch=1)
    first = sched.schedule(0.0).admitted
    for i, r, *_ in first:
        sched.running[i] = r
    sched.max_batch = 64
    admitted = sched.schedule(0.0).admitted
    # a batch of short ones passes the long head over three times, and no more
    assert [i for i, *_ in admitted][:5] == [2, 3, 4, 1, 5]


@pytest.mark.parametrize("policy", ["odma", "elastic", "paged"])
def test_simulate_serves_every_request_co_batched_and_decides_otherwise(policy):
    spec = model_spec("deepseek-r1-distill-qwen-7b")
    timing = MeasuredTiming("curve", {256: 40.0, 4096: 150.0, 1 << 20: 290.0}, 300.0, 250.0)
    base = ServingSetup(spec, accelerator("mlu370-x4"), timing, max_model_len=3000,
                        kv_pool_gb=0.4, predictor="noisy")
    rng = np.random.default_rng(5)
    n = 150
    rows = list(zip(rng.integers(5, 1500, n), rng.integers(1, 1400, n),
                    np.sort(rng.uniform(0, 10, n))))
    logs = []
    for window in (0, 16):
        reqs = [RequestState(i, int(p), int(g), float(a)) for i, (p, g, a) in enumerate(rows)]
        sim = Simulation(dataclasses.replace(base, cobatch=window), policy, reqs)
        sim.sched.log = log = []
        try:
            sim.run()
        finally:
            sim.alloc.close()
        assert all(r.made == r.gen and r.finish is not None for r in reqs)
        logs.append([i for what, i in log if what == "admit"])
    assert logs[0] != logs[1]                       # the window changed the admission order


def test_bad_co_batching_settings_are_refused():
    with pytest.raises(BadArgument, match="co-batching window"):
        scheduler("paged", [1], window=-1)
    alloc = make_allocator("paged", None, 10**4 * BPT, BPT, 4096,
                           AllocatorConfig(background_refresh=False), page_tokens=16)
    with pytest.raises(BadArgument, match="prefix schedule"):
        Scheduler(alloc, make_predictor("oracle"), [], max_batch=4, max_prefill=100,
                  bytes_per_token=BPT, schedule="fpf", cobatch=4,
                  cache=None)
