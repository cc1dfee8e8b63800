"""`odma-hw engine`: a real transformer decoding from allocator blocks makes exactly the tokens
transformers' generate() makes, for every policy, through migrations and preemptions; it never
reads a released block; and it makes the same scheduling decisions `simulate` makes."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from allocator.config import AllocatorConfig  # noqa: E402
from allocator.serving import models  # noqa: E402
from allocator.serving.cards.presets import ModelSpec, accelerator  # noqa: E402
from allocator.serving.core.requests import RequestState  # noqa: E402
from allocator.serving.engine import run_attention  # noqa: E402
from allocator.serving.engine import serve as te  # noqa: E402
from allocator.serving.engine.kv_runs import KVPool  # noqa: E402
from allocator.serving.sim.replica import ServingSetup, Simulation  # noqa: E402
from allocator.serving.sim.timing import MeasuredTiming  # noqa: E402
from odma_cli.main import main  # noqa: E402

CONFIGS = ("tiny-llama", "tiny-qwen2", "tiny-mistral")
POLICIES = ("odma", "static", "s3", "oracle", "paged", "extent", "elastic")
# extents of 4 tokens, at most 2 before a merge: requests of up to 94 tokens hold several
EXTENTS = dict(token_alignment=4, extent_knee_tokens=4, extent_max=2)


def allocator_config(policy, **kw):
    """The allocator config of a test run: small extents for the extent policies."""
    return AllocatorConfig(background_refresh=False, **kw,
                           **(EXTENTS if policy in ("extent", "elastic") else {}))


def requests(n=14, seed=1, vocab=512):
    rng = np.random.default_rng(seed)
    plen = rng.integers(3, 50, n)
    gen = rng.integers(1, 45, n)
    return te.prompt_ids(n, plen, vocab, seed), [int(g) for g in gen]


@pytest.fixture(scope="module", params=CONFIGS)
def tiny(request):
    cfg, _ = models.load_config(request.param)
    model = te.build_model(cfg, "float32", "cpu", seed=0)
    prompts, gen = requests(vocab=cfg.vocab_size)
    reference = []
    for p, g in zip(prompts, gen):
        out = model.generate(p[None], max_new_tokens=g, min_new_tokens=g, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        reference.append(out[0, p.numel():].tolist())
    return request.param, cfg, model, prompts, gen, reference


def bytes_per_token(cfg, dtype_bytes=4):
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


def test_every_policy_makes_generates_tokens_through_migrations_and_preemptions(tiny):
    name, cfg, model, prompts, gen, reference = tiny
    seen = {"migrate": 0, "preempt": 0}
    for policy in POLICIES:
        log: list = []
        # a pool of ~3 longest requests: blocks migrate and requests are preempted
        run = te.serve(model, prompts, gen, np.zeros(len(gen)), policy,
                       pool_bytes=300 * bytes_per_token(cfg), max_model_len=100, max_batch=8,
                       page_tokens=4, predictor="noisy", log=log)
        assert run["tokens"] == reference, f"{name} {policy}"
        assert all(r.finish is not None and r.made == g for r, g in zip(run["requests"], gen))
        for what, _ in log:
            seen[what] = seen.get(what, 0) + 1
    assert seen["migrate"] > 0 and seen["preempt"] > 0      # both paths were exercised


@pytest.mark.parametrize("sched", [{}, dict(max_batched_tokens=8)], ids=("v0", "chunked"))
def test_extents_merges_and_elastic_preemptions_make_generates_tokens(tiny, sched):
    """KV in several extents, read as one run per extent and joined; merges (the engine's copy
    from extents into one); elastic's growth preempting another request than the grower."""
    name, cfg, model, prompts, gen, reference = tiny
    for policy, predictor, pool in (("extent", "noisy", 300), ("elastic", "online", 120)):
        log: list = []
        run = te.serve(model, prompts, gen, np.zeros(len(gen)), policy,
                       pool_bytes=pool * bytes_per_token(cfg), max_model_len=100, max_batch=8,
                       predictor=predictor, log=log, config=allocator_config(policy), **sched)
        assert run["tokens"] == reference, f"{name} {policy} {sched}"
        assert run["allocator"]["extents_per_request_max"] > 2
        if policy == "extent":
            assert any(w == "migrate" for w, _ in log)
        else:                           # an "oom" of one request preempting another
            assert any(a[0] == "oom" and b[0] == "preempt" and a[1] != b[1]
                       for a, b in zip(log, log[1:]))


# chunked prefill with budgets below the longest prompt (prompts split over several steps,
# the first chunk of a rerun after a preemption included), a closed loop, and co-batching by
# bucket tag
SCHEDULING = [dict(max_batched_tokens=8), dict(max_batched_tokens=21),
              dict(concurrency=3), dict(concurrency=5, max_batched_tokens=9),
              dict(cobatch=4, max_batched_tokens=21)]


@pytest.mark.parametrize("sched", SCHEDULING, ids=lambda d: ",".join(f"{k}={v}" for k, v in
                                                                      d.items()))
def test_chunked_prefill_and_closed_loop_make_generates_tokens(tiny, sched):
    name, cfg, model, prompts, gen, reference = tiny
    seen: dict = {}
    for policy in POLICIES:
        log: list = []
        run = te.serve(model, prompts, gen, np.zeros(len(gen)), policy,
                       pool_bytes=300 * bytes_per_token(cfg), max_model_len=100, max_batch=8,
                       page_tokens=4, predictor="noisy", log=log, **sched)
        assert run["tokens"] == reference, f"{name} {policy} {sched}"
        for what, _ in log:
            seen[what] = seen.get(what, 0) + 1
    if "concurrency" not in sched:          # closed loops of 3-5 leave the pool room enough
        assert seen.get("preempt", 0) > 0
    assert seen.get("migrate", 0) > 0


def test_the_check_agrees_with_the_reference_and_catches_a_corrupted_kv(tiny, monkeypatch):
    name, cfg, model, prompts, gen, _ = tiny
    run = te.serve(model, prompts, gen, np.zeros(len(gen)), "odma",
                   pool_bytes=300 * bytes_per_token(cfg), max_model_len=100, max_batch=8,
                   keep_logits=True)
    ok = te.check_tokens(model, prompts, run["tokens"], run["top_logits"])
    assert ok["mismatches"] == 0 and ok["max_logit_diff"] < 1e-3
    # a KV store that loses one token's keys a step: the logits must give it away
    real_store = run_attention.store_kv

    def forgetful(pool, k, v, *args, **kw):
        k = k.clone()
        k[0] = 0.0
        return real_store(pool, k, v, *args, **kw)

    monkeypatch.setattr(run_attention, "store_kv", forgetful)
    bad = te.serve(model, prompts, gen, np.zeros(len(gen)), "odma",
                   pool_bytes=300 * bytes_per_token(cfg), max_model_len=100, max_batch=8,
                   keep_logits=True)
    assert te.check_tokens(model, prompts, bad["tokens"], bad["top_logits"])["mismatches"] > 0


class _FixedLogits(torch.nn.Module):
    """A 'model' whose every position scores four tokens as given, in bfloat16."""

    def __init__(self, scores):
        super().__init__()
        self.scores = torch.nn.Parameter(torch.tensor(scores, dtype=torch.bfloat16))

    def forward(self, seq):
        logits = self.scores.expand(seq.shape[1], -1)[None]
        return type("Out", (), {"logits": logits})()


@pytest.mark.parametrize("engine_scores, kept, verdict", [
    ((4.96875, 5.0, 1.0, 0.0), 4, "near tie"),  # each logit one bf16 ulp off: the two swap
    ((5.0, 4.96875, 1.0, 0.0), 4, "agrees"),
    ((4.96875, 5.0, 1.0, 0.0), 1, "mismatch"),  # the reference's best not among those kept
    ((4.75, 5.0, 1.0, 0.0), 4, "mismatch"),     # token 0 moved 0.25: beyond 3e-2 x (1 + 5)
])
def test_the_check_excuses_a_flip_its_logit_differences_explain(engine_scores, kept, verdict):
    """In bfloat16 the engine's logits and the reference's differ by an ulp (0.03125 near 5):
    two tokens an ulp apart swap, a flip the logit tolerance allows. Such a flip is a near
    tie; one the kept logits cannot account for, or whose logits moved beyond the tolerance,
    is a mismatch."""
    model = _FixedLogits([5.0, 4.96875, 1.0, 0.0])
    top = torch.topk(torch.tensor(engine_scores), kept)
    chosen = int(top.indices[0])
    got = te.check_tokens(model, [torch.tensor([1, 2])], [[chosen]],
                          [[(top.values, top.indices)]])
    assert got["mismatches"] == (verdict == "mismatch")
    if verdict != "mismatch":
        assert got["near_ties"] == (verdict == "near tie")


def test_no_kv_is_read_from_a_released_or_stale_block(tiny, monkeypatch):
    """Every run table is built from the request's live block (or, for a migration's copy,
    the block named), and a cached region list is never stale: it equals one built afresh."""
    name, cfg, model, prompts, gen, _ = tiny
    real = KVPool.regions
    reads = []

    def checked(self, i, blk=None):
        held = self.alloc.block(i) if blk is None else blk
        assert held.live or blk is not None, f"request {i} read a released block"
        got = real(self, i, blk)
        self._regions.pop(i, None)
        fresh = real(self, i, blk)
        assert all(np.array_equal(a, b) for a, b in zip(got, fresh)), f"request {i}: stale"
        reads.append(i)
        return got

    monkeypatch.setattr(KVPool, "regions", checked)
    for policy in ("odma", "s3", "paged", "elastic"):
        te.serve(model, prompts, gen, np.zeros(len(gen)), policy,
                 pool_bytes=300 * bytes_per_token(cfg), max_model_len=100, max_batch=8,
                 page_tokens=4, predictor="noisy")
    assert reads


@pytest.mark.parametrize("sched", [{}] + SCHEDULING,
                         ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "v0")
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("preemption", ("recompute", "swap"))
def test_the_engine_and_simulate_make_the_same_decisions(policy, sched, preemption):
    """One Scheduler: admissions, migrations, preemptions (recomputed, or swapped to a host
    that holds some of them) and completions in the same order for the same requests, pool
    and model shape (bf16 KV: the simulation's bytes per token), prefill-first or chunked,
    open or closed loop."""
    cfg, _ = models.load_config("tiny-qwen2")
    model = te.build_model(cfg, "bfloat16", "cpu", seed=0)
    prompts, gen = requests(n=24, seed=3, vocab=cfg.vocab_size)
    pool = 280 * bytes_per_token(cfg, 2)
    swap = dict(preemption=preemption)
    if preemption == "swap":
        swap["swap_bytes"] = 60 * bytes_per_token(cfg, 2)
    # the torch device aligns blocks to 256 B, the simulation's device-less pool to 64 B: one
    # alignment for both, or a block's size (and so an admission) may differ
    config = allocator_config(policy, byte_alignment=256)
    # elastic with the online predictor: its early underestimates make growths preempt others
    predictor = "online" if policy == "elastic" else "noisy"
    engine_log: list = []
    te.serve(model, prompts, gen, np.zeros(len(gen)), policy, pool_bytes=pool,
             max_model_len=100, max_batch=8, page_tokens=4, predictor=predictor,
             log=engine_log, config=config, **swap, **sched)
    spec = ModelSpec("tiny-qwen2", cfg.num_hidden_layers, cfg.hidden_size,
                     cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                     cfg.intermediate_size, cfg.vocab_size, False, cfg.max_position_embeddings,
                     qkv_bias=True)
    timing = MeasuredTiming("flat", {4096: 100.0}, 100.0, 50.0)
    setup = ServingSetup(spec, accelerator("mlu370-x4"), timing, max_model_len=100,
                         max_batch=8, kv_pool_gb=pool / 1e9, page_tokens=4,
                         predictor=predictor, config=config, preemption=preemption,
                         swap_space_gb=swap.get("swap_bytes", 0) / 1e9, **sched)
    reqs = [RequestState(i, int(p.numel()), g, 0.0) for i, (p, g) in enumerate(zip(prompts, gen))]
    sim = Simulation(setup, policy, reqs)
    sim.sched.log = sim_log = []
    try:
        sim.run()
    finally:
        sim.alloc.close()
    assert engine_log == sim_log
    if policy in ("s3", "paged") and not sched:    # the pool is small enough to preempt
        assert any(w == "preempt" for w, _ in sim_log)
        if preemption == "swap":
            assert any(w == "swap" for w, _ in sim_log)
    if policy == "extent":
        assert any(w == "migrate" for w, _ in sim_log)
    if policy == "elastic" and "concurrency" not in sched:
        assert any(a[0] == "oom" and b[0] == "preempt" and a[1] != b[1]
                   for a, b in zip(sim_log, sim_log[1:]))


def test_engine_command_prints_the_contract_json(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" +
                     "".join(f"{5 + 3 * i},{2 + i}\n" for i in range(6)))
    assert main(["engine", "--trace", str(trace), "--model", "tiny-llama", "--kv-pool-mb",
                 "0.05", "--policy", "odma,paged", "--check", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "odma-hw.engine/1"
    for r in doc["results"]:
        for key in ("policy", "requests", "completed", "output_tokens", "output_tps",
                    "requests_per_s", "ttft_s", "tpot_s", "e2e_s", "preemptions", "migrations",
                    "utilization", "mean_batch", "peak_batch", "mismatches", "max_logit_diff",
                    "near_ties", "decode_step_us", "settings"):
            assert key in r
        assert r["completed"] == 6 and r["mismatches"] == 0
        assert r["output_tokens"] == sum(2 + i for i in range(6))


def test_the_decode_step_breakdown_times_each_part(monkeypatch):
    """decode_step_us: a decode-only step's issue (forward), wait (tokens read back) and the
    rest until the next step, medians over the decode-only steps another one follows; here
    each part is held up by a known sleep."""
    import time

    from allocator.serving.engine.runner import Runner

    forward, pick = Runner.forward, te.RunnerExecutor.pick

    def slow_forward(self, batch):
        if all(start and len(ids) == 1 for _, ids, start in batch):      # a decode-only step
            time.sleep(0.02)
        return forward(self, batch)

    def slow_pick(self, logits):
        time.sleep(0.005)
        return pick(self, logits)

    monkeypatch.setattr(Runner, "forward", slow_forward)
    monkeypatch.setattr(te.RunnerExecutor, "pick", slow_pick)
    cfg, _ = models.load_config("tiny-llama")
    model = te.build_model(cfg, "float32", "cpu", seed=0)
    bpt = models.kv_bytes_per_token(cfg, "float32")
    prompts = te.prompt_ids(1, [6], cfg.vocab_size, 0)
    run = te.serve(model, prompts, [5], np.zeros(1), "odma", pool_bytes=64 * bpt,
                   max_model_len=16, max_batch=2)
    steps = run["decode_step_us"]
    assert steps["steps"] == 3              # 4 decode steps after the prefill: 3 followed
    assert steps["issue"] >= 20000 and 5000 <= steps["wait"] < 20000 and steps["other"] >= 0


@pytest.mark.parametrize("share", [0.6, 0.05, None])
def test_a_busy_host_is_said_beside_the_run_it_slowed(tmp_path, capsys, monkeypatch, share):
    """The engine's times are the host's as much as the device's: when other processes took
    more than a small share of the CPUs during a policy's run, one warning line says so, and
    the JSON row carries the share (None where /proc/stat cannot tell)."""
    from allocator.serving.engine import cli as engine_cli

    monkeypatch.setattr(engine_cli, "OtherLoad", type("Load", (), {"share": lambda self: share}))
    trace = tmp_path / "t.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n5,2\n7,3\n")
    assert main(["engine", "--trace", str(trace), "--model", "tiny-llama", "--kv-pool-mb",
                 "0.05", "--policy", "odma", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["results"][0]["other_cpu_share"] == share
    warned = [line for line in out.err.splitlines() if "busy host" in line]
    assert len(warned) == (1 if share == 0.6 else 0)
    if warned:
        assert "warning: other processes took 60% of the CPUs during odma's run" in warned[0]


def test_engine_serves_extents_with_the_knee_of_a_card(tmp_path, capsys):
    """--card's probe timing gives extent and elastic the knee simulate would derive;
    --extent-knee-tokens overrides it; both policies' tokens pass the check."""
    from allocator.serving.sim.steptime import knee_tokens
    from allocator.serving.sim.timing import make_timing

    (tmp_path / "probe.json").write_text(json.dumps({
        "schema": "odma-hw.probe/1",
        "devices": [{"device": "x", "rand_gbps": {"64": 1.0, "4096": 5.0, "65536": 9.0},
                     "seq_gbps": 10.0, "copy_gbps": 8.0}]}))
    card = tmp_path / "card.toml"
    card.write_text('name = "c"\nbandwidth_gbps = 10.0\ncapacity_gb = 1.0\ntflops_bf16 = 1.0\n'
                    'timing = "probe:probe.json"\nlink_gbps = 1.0\nlink_latency_us = 1.0\n')
    trace = tmp_path / "t.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" +
                     "".join(f"{40 + 9 * i},{30 + 7 * i}\n" for i in range(6)))
    argv = ["engine", "--trace", str(trace), "--model", "tiny-llama", "--kv-pool-mb", "0.5",
            "--policy", "extent,elastic", "--check", "--json", "--card", str(card)]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    cfg, _ = models.load_config("tiny-llama")
    unit = te.head_dim(cfg) * 4                        # float32
    want = knee_tokens(make_timing(f"probe:{tmp_path / 'probe.json'}", 10.0, None), unit, 0.8,
                       doc["results"][0]["settings"]["max_model_len"])
    assert want > 16                                   # not the default alignment
    for r in doc["results"]:
        assert r["settings"]["extent_knee_tokens"] == want
        assert r["completed"] == 6 and r["mismatches"] == 0
    assert main(argv + ["--extent-knee-tokens", "32"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {r["settings"]["extent_knee_tokens"] for r in doc["results"]} == {32}


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt-5"], "shipped config"),
    (["--kv-pool-mb", "0.0001"], "less than one"),
    (["--device", "torch:cuda:7"], "cuda"),
    (["--max-model-len", "10"], "--clip"),
    (["--policy", "odma,magic"], "unknown policy"),
    (["--predictor", "bogus"], "--predictor: invalid choice: 'bogus'"),
    (["--policy", "odma,elastic", "--card", "nosuch"], "unknown --card 'nosuch'"),
    (["--policy", "odma,hf", "--preemption", "swap"], "transformers' own scheduler"),
])
def test_bad_engine_input_is_one_line_before_any_weights(tmp_path, capsys, monkeypatch, args,
                                                         message):
    built = []
    monkeypatch.setattr(te, "build_model", lambda *a, **k: built.append(a))
    trace = tmp_path / "t.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n20,10\n")
    try:
        code = main(["engine", "--trace", str(trace), *args])
    except SystemExit as exc:           # argparse's refusals
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not built


def test_an_unsupported_architecture_is_refused(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    trace = tmp_path / "t.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n20,10\n")
    assert main(["engine", "--trace", str(trace), "--model", str(cfg)]) == 2
    assert "not supported" in capsys.readouterr().err


@pytest.mark.parametrize("sched", [{}, dict(max_batched_tokens=8), dict(max_batched_tokens=21)],
                         ids=("v0", "chunked8", "chunked21"))
def test_swapped_requests_make_generates_tokens(tiny, sched):
    """Preemption by swap: a preempted request's KV goes to host memory and comes back into a
    new block (contiguous, paged, extents); with a host too small for every victim, the rest
    are recomputed. The tokens are generate()'s either way."""
    name, cfg, model, prompts, gen, reference = tiny
    bpt = bytes_per_token(cfg)
    seen: dict = {}
    for policy in POLICIES:
        log: list = []
        run = te.serve(model, prompts, gen, np.zeros(len(gen)), policy, pool_bytes=300 * bpt,
                       max_model_len=100, max_batch=8, page_tokens=4, predictor="noisy",
                       log=log, config=allocator_config(policy), preemption="swap",
                       swap_bytes=60 * bpt, **sched)
        assert run["tokens"] == reference, f"{name} {policy} {sched}"
        for what, i in log:
            seen[what] = seen.get(what, 0) + 1
    assert seen.get("swap", 0) > 0 and seen.get("resume", 0) == seen["swap"]
    assert seen["preempt"] > seen["swap"]          # some found the host full: recomputed


@pytest.mark.parametrize("failing", ["save", "load"])
def test_a_failed_swap_copy_is_recomputed_and_loses_nothing(tiny, monkeypatch, failing):
    """A copy to the host that fails leaves the request to be recomputed; a copy back that fails
    gives its new block back and queues it for recompute: the tokens are generate()'s."""
    name, cfg, model, prompts, gen, reference = tiny
    real = getattr(KVPool, failing)
    calls = []

    def flaky(self, *args):
        calls.append(args[0])
        if len(calls) % 2:                  # every other copy fails
            raise RuntimeError("host copy failed")
        return real(self, *args)

    monkeypatch.setattr(KVPool, failing, flaky)
    bpt = bytes_per_token(cfg)
    log: list = []
    run = te.serve(model, prompts, gen, np.zeros(len(gen)), "paged", pool_bytes=300 * bpt,
                   max_model_len=100, max_batch=8, page_tokens=4, predictor="noisy", log=log,
                   preemption="swap", swap_bytes=10**6 * bpt)
    assert run["tokens"] == reference, name
    assert len(calls) >= 2
    swaps = sum(w == "swap" for w, _ in log)
    resumed = sum(w == "resume" for w, _ in log)
    if failing == "save":                   # half the preemptions were not swapped
        assert sum(w == "preempt" for w, _ in log) > swaps > 0
    else:                                   # half the resumes went back to the queue
        assert resumed == swaps > 0
