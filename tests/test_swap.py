"""Preemption by swap in the serving simulation: a preempted request's KV goes to the host while
the swap space has room and comes back without a prefill; the host never holds more than its
space; each swap is costed both ways over the host link; a swap space of 0 is recompute."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from allocator.serving.cards.presets import accelerator, model_spec
from allocator.serving.core.requests import RequestState
from allocator.serving.sim.replica import ServingSetup, Simulation
from allocator.serving.sim.timing import MeasuredTiming
from odma_cli.errors import BadArgument
from odma_cli.main import main

SPEC = model_spec("deepseek-r1-distill-qwen-7b")
TIMING = MeasuredTiming("curve", {256: 40.0, 4096: 150.0, 1 << 20: 290.0}, 300.0, 250.0)
# the online predictor's early underestimates make every policy preempt
BASE = ServingSetup(SPEC, accelerator("mlu370-x4"), TIMING, max_model_len=3000, kv_pool_gb=0.4,
                    predictor="online")


def requests(n=200, seed=4):
    rng = np.random.default_rng(seed)
    return [RequestState(i, int(p), int(g), float(a)) for i, (p, g, a) in enumerate(
        zip(rng.integers(5, 1500, n), rng.integers(1, 1400, n),
            np.sort(rng.uniform(0, 20, n))))]


def run(policy, **changes):
    """A simulation of `policy`: (its metrics, its requests, the host's fill after every
    swap-out, KV tokens swapped out)."""
    setup = dataclasses.replace(BASE, **changes)
    reqs = requests()
    sim = Simulation(setup, policy, reqs)
    sched, fills, swapped = sim.sched, [], []
    out = sim.executor.swap_out

    def watched(i, r, tokens):
        out(i, r, tokens)
        swapped.append(tokens)
        fills.append(sched.swapped_bytes + tokens * sched.bpt)
    sim.executor.swap_out = watched
    try:
        result = sim.run()
    finally:
        sim.alloc.close()
    return result, reqs, fills, swapped


@pytest.mark.parametrize("policy", ["odma", "paged", "elastic"])
@pytest.mark.parametrize("mode", [{}, dict(max_batched_tokens=512)], ids=("v0", "chunked"))
def test_swapped_requests_complete_without_recomputing_and_the_host_never_overflows(policy,
                                                                                   mode):
    space = 0.15                                       # GB: some victims find it full
    swap, reqs, fills, swapped = run(policy, preemption="swap", swap_space_gb=space, **mode)
    tot = swap["totals"]
    assert all(r.made == r.gen and r.finish is not None for r in reqs)
    assert tot["swap_outs"] == tot["swap_ins"] == len(swapped) > 0
    assert max(fills) <= space * 1e9
    if policy != "elastic":                            # elastic preempts a few short ones
        assert tot["swap_refused"] > 0
    # every swap is a copy out and a copy back of its KV over the host link
    bpt = BASE.kv_bytes_per_token
    assert tot["swap"] == pytest.approx(2 * sum(swapped) * bpt / (BASE.swap_gbps * 1e9))
    # and it saved the prefill a recompute runs: fewer prompt tokens computed
    recompute, *_ = run(policy, **mode)
    assert tot["prefill_tokens"] < recompute["totals"]["prefill_tokens"]


def test_no_swap_space_is_recompute():
    swap, reqs_s, _, swapped = run("paged", preemption="swap", swap_space_gb=0.0)
    recompute, reqs_r, _, _ = run("paged")
    assert not swapped and swap["totals"]["swap_refused"] == recompute["totals"]["preemptions"] > 0
    assert [(r.first_token, r.finish) for r in reqs_s] == [(r.first_token, r.finish)
                                                          for r in reqs_r]


@pytest.mark.parametrize("change, message", [
    (dict(preemption="offload"), "unknown preemption mode 'offload'"),
    (dict(swap_space_gb=-1.0), "swap space"),
    (dict(swap_space_gb=float("nan")), "swap space"),
    (dict(swap_gbps=0.0), "swap_gbps"),
])
def test_bad_swap_settings_are_refused(change, message):
    with pytest.raises(BadArgument, match=message):
        dataclasses.replace(BASE, **change)


def test_simulate_reports_swaps(tmp_path, capsys):
    import json

    trace = tmp_path / "t.csv"
    rng = np.random.default_rng(2)
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(
        f"{p},{g}\n" for p, g in zip(rng.integers(100, 1500, 80), rng.integers(50, 1500, 80))))
    argv = ["simulate", "--trace", str(trace), "--policy", "paged", "--kv-pool-gb", "0.5",
            "--timing", "ideal", "--json"]
    assert main(argv + ["--preemption", "swap", "--swap-space", "2"]) == 0
    r = json.loads(capsys.readouterr().out)["results"][0]
    assert r["swaps"] == r["preemptions"] > 0 and r["swap_s"] > 0
    assert r["settings"]["preemption"].startswith("swap (2 GB host")
    with pytest.raises(SystemExit) as exit_:
        main(argv + ["--preemption", "offload"])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err
