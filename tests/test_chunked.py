"""Chunked prefill and closed-loop load in the serving simulation: every step keeps to its token
budget, every prompt token is computed once per admission and in order, a closed loop never has
more than C requests in flight, a lone request costs what prefill-first costs, and the settings
no scheduler can run are refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

from allocator.serving.cards.presets import accelerator, model_spec
from allocator.serving.core.requests import RequestState
from allocator.serving.core.scheduler import Scheduler
from allocator.serving.sim.replica import ServingSetup, Simulation, run_policy
from allocator.serving.sim.timing import MeasuredTiming
from allocator.trace import RequestTrace
from odma_cli.main import main

QWEN = model_spec("deepseek-r1-distill-qwen-7b")
MLU = accelerator("mlu370-x4")
# a measured-like curve: short runs slow, long runs at the sequential rate
TIMING = MeasuredTiming("curve", {256: 40.0, 4096: 150.0, 65536: 260.0, 1 << 20: 290.0},
                        300.0, 250.0)


def requests(n, seed, long_prompts=False):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(5, 3000 if long_prompts else 400, n)
    gen = rng.integers(1, 300, n)
    arrival = np.sort(rng.uniform(0, n / 40.0, n))
    return [RequestState(i, int(p), int(g), float(a))
            for i, (p, g, a) in enumerate(zip(prompt, gen, arrival))]


def run(policy, reqs, **kw):
    kw.setdefault("max_model_len", 3400)
    sim = Simulation(ServingSetup(QWEN, MLU, TIMING, **kw), policy, reqs)
    try:
        return sim, sim.run()
    finally:
        sim.alloc.close()


@pytest.mark.parametrize("policy", ["odma", "paged", "static", "extent"])
@pytest.mark.parametrize("budget", [256, 512, 2048])
def test_every_step_keeps_to_its_budget_and_computes_each_prompt_once_in_order(
        policy, budget, monkeypatch):
    steps: list = []
    chunks = Scheduler._chunks

    def spy(self, now):
        out, admitted, restore = chunks(self, now)
        steps.append((len(self.running), [(c.id, c.start, c.tokens) for c in out]))
        return out, admitted, restore
    monkeypatch.setattr(Scheduler, "_chunks", spy)
    reqs = requests(150, seed=budget, long_prompts=True)
    # a pool of a few long requests: admissions wait and requests are preempted
    sim, _ = run(policy, reqs, max_batch=64, max_batched_tokens=budget, kv_pool_gb=0.5,
                 predictor="noisy")
    assert sim.sched.done == len(reqs) and all(r.made == r.gen for r in reqs)
    # reruns are chunked too (static and extent, which here never preempt, aside)
    assert sim.tot["preemptions"] > 0 or policy in ("static", "extent")
    done_to: dict = {}                       # request -> context tokens computed so far
    for nb, parts in steps:
        assert nb + sum(k for _, _, k in parts) <= budget
        for i, start, k in parts:
            assert k >= 1
            # a chunk starts where the last one ended, or at 0 again after a preemption
            assert start in (done_to.get(i, 0), 0)
            done_to[i] = start + k
    # every prompt computed to its end (a rerun: its prompt and what it had made)
    for r in reqs:
        assert done_to[r.rid] >= r.prompt


@pytest.mark.parametrize("concurrency", [1, 4, 32])
def test_a_closed_loop_keeps_at_most_c_in_flight_and_sends_the_next_at_a_completion(
        concurrency):
    reqs = requests(120, seed=concurrency)
    for r in reqs:
        r.arrival = 0.0                      # all ready: a slot decides when each is sent
    run("odma", reqs, max_batch=64, concurrency=concurrency, max_batched_tokens=512)
    events = sorted([(r.arrival, 1) for r in reqs] + [(r.finish, -1) for r in reqs],
                    key=lambda e: (e[0], e[1]))   # a completion frees its place first
    in_flight = peak = 0
    for _, d in events:
        in_flight += d
        peak = max(peak, in_flight)
    assert peak == min(concurrency, len(reqs))
    finishes = sorted(r.finish for r in reqs)
    order = sorted(reqs, key=lambda r: r.rid)
    for m, r in enumerate(order[concurrency:]):
        assert r.arrival == finishes[m]      # the m-th completion sent request m + C


def test_a_lone_request_costs_what_prefill_first_costs():
    out = {}
    for budget in (None, 4096):
        reqs = [RequestState(0, 1500, 200, 0.0)]
        sim, res = run("odma", reqs, max_batched_tokens=budget)
        out[budget] = (reqs[0].first_token, reqs[0].finish, res["totals"]["prefill"],
                       res["totals"]["decode"])
    assert out[None] == pytest.approx(out[4096], rel=1e-12)


def test_chunks_riding_with_decodes_keep_long_prompts_from_stalling_them():
    """What chunked prefill is for: a long prompt's prefill no longer stops every running
    request for its whole length, so the slowest decode steps are shorter."""
    rng = np.random.default_rng(5)
    n = 120
    prompt = np.where(rng.random(n) < 0.3, 3000, 50)
    trace = RequestTrace(prompt, rng.integers(100, 400, n), np.arange(n) * 0.5, name="mix")
    tpot = {}
    for budget in (None, 512):
        setup = ServingSetup(QWEN, MLU, TIMING, max_model_len=3400, max_batched_tokens=budget)
        r = run_policy(trace, np.arange(n) * 0.5, "odma", setup)
        assert r["completed"] == n
        tpot[budget] = r["tpot_s"]["p99"]
    assert tpot[512] < tpot[None]


@pytest.mark.parametrize("args, message", [
    (["--max-num-batched-tokens", "100"], "at least --max-batch"),
    (["--concurrency", "3", "--replicas", "2"], "split evenly"),
    (["--max-num-batched-tokens", "0"], "positive"),
])
def test_settings_no_scheduler_can_run_are_one_line(tmp_path, capsys, args, message):
    trace = tmp_path / "t.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n10,5\n20,3\n")
    try:
        code = main(["simulate", "--trace", str(trace), "--policy", "odma", *args])
    except SystemExit as exc:                 # argparse's own refusal
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
