"""`odma-hw replay` and run_replay(): every request completes, metrics mean what they say."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from allocator.replay import Trace, load_trace, run_replay
from odma_hw.cli import main

TRACES = Path(os.environ.get("ODMA_TRACES",
                             Path(__file__).resolve().parents[1].parent / "shared" / "traces"))
POLICIES = ["odma", "static", "s3", "paged", "oracle"]


def synthetic(n=600, seed=0, arrivals=True):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, 300, n)
    gen = np.minimum(rng.lognormal(4.0, 0.8, n).astype(int) + 1, 700)
    arrival = np.cumsum(rng.exponential(0.2, n)) if arrivals else None
    return Trace(prompt, gen, arrival, name="synthetic")


SMALL = dict(bytes_per_token=64, pool_bytes=8 << 20)   # 128k tokens


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_completes_and_utilization_is_token_level(policy):
    trace = synthetic()
    r = run_replay(trace, policy, "online", **SMALL)
    assert r["requests"] == r["completed"] == len(trace) and r["lost"] == 0
    assert 0 < r["utilization"] <= 1
    assert r["peak_concurrency"] >= r["mean_concurrency"] > 0
    total = int((trace.prompt + trace.generated).sum())
    if policy == "static":
        assert r["utilization"] == pytest.approx(total / (len(trace) * r["settings"]["max_tokens"]))
    if policy == "oracle":
        assert r["utilization"] == 1.0 and r["migrations"] == 0
    if policy == "paged":
        assert r["utilization"] > 0.95 and r["segments_per_request_mean"] >= 1
    assert r["tokens_per_step"] * r["steps"] == pytest.approx(trace.generated.sum())


def test_odma_beats_static_and_migrates_rarely_on_a_synthetic_trace():
    trace = synthetic(3000, seed=1)
    odma = run_replay(trace, "odma", "online", **SMALL)
    static = run_replay(trace, "static", "online", **SMALL)
    assert odma["utilization"] > 2 * static["utilization"]
    assert odma["migration_rate"] < 0.1               # 95 % coverage, plus a learning phase
    assert len(odma["bucket_bounds_history"]) >= 2     # the bounds were learned


def test_a_tiny_pool_forces_preemption_but_loses_nothing():
    trace = synthetic(300, seed=2, arrivals=False)
    r = run_replay(trace, "paged", "online", bytes_per_token=64, pool_bytes=800 * 64 * 2)
    assert r["preemptions"] > 0 and r["completed"] == 300


@pytest.mark.parametrize("spec", ["torch:cpu", "host"])
def test_replay_on_real_memory_copies_real_bytes(spec):
    from test_allocator_fakes import open_or_skip
    open_or_skip(spec).close()
    trace = synthetic(1000, seed=3)
    real = run_replay(trace, "odma", "online", device=spec, **SMALL)
    accounting = run_replay(trace, "odma", "online", device="none", **SMALL)
    assert real["settings"]["device"] == spec
    assert real["migrations"] > 0 and real["migrated_bytes"] > 0
    for key in ("utilization", "migrations", "oom_events", "peak_concurrency"):
        assert real[key] == accounting[key]              # same decisions, real bytes moved


def test_poisson_arrivals_are_seeded():
    trace = synthetic(200, arrivals=False)
    a = run_replay(trace, "odma", "noisy", rate=5.0, seed=4, **SMALL)
    b = run_replay(trace, "odma", "noisy", rate=5.0, seed=4, **SMALL)
    assert a["steps"] == b["steps"] and a["utilization"] == b["utilization"]


def test_cli_json_has_the_contract_keys(tmp_path, capsys):
    path = tmp_path / "t.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,20\n0.1,30,5\n1,7,70\n")
    png = tmp_path / "r.png"
    assert main(["replay", "--trace", str(path), "--policy", "odma", "--device", "none",
                 "--pool-gib", "0.01", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("policy", "requests", "completed", "utilization", "migrations", "oom_events",
                "mean_concurrency", "peak_concurrency", "time_avg_occupancy", "tokens_per_step",
                "external_fragmentation_mean", "bucket_bounds_history"):
        assert key in out
    assert out["requests"] == out["completed"] == 3
    assert png.stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (["--trace", "/no/such.csv"], "cannot read trace"),
    (["--policy", "magic"], "invalid choice"),
    (["--max-tokens", "5"], "below the longest request"),
    (["--rate", "-1"], "--rate"),
    (["--device", "nonsense"], "unknown device"),
])
def test_cli_bad_usage_exits_2_with_one_line(tmp_path, capsys, args, message):
    path = tmp_path / "t.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n10,20\n")
    argv = ["replay", "--trace", str(path), "--device", "none", "--pool-gib", "0.01"] + args
    with pytest.raises(SystemExit) if "invalid choice" in message else _nothing():
        code = main(argv)
        assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_malformed_trace_is_bad_argument(tmp_path):
    from odma_hw.errors import BadArgument
    path = tmp_path / "t.csv"
    path.write_text("num_prefill_tokens,other\n1,2\n")
    with pytest.raises(BadArgument, match="num_decode_tokens"):
        load_trace(path)
    path.write_text("num_prefill_tokens,num_decode_tokens\n1,-2\n")
    with pytest.raises(BadArgument):
        load_trace(path)


@pytest.mark.parametrize("name", ["azure_conv_2023", "sharegpt_8k"])
def test_issue_targets_on_the_real_traces(name):
    path = TRACES / f"{name}.csv"
    if not path.exists():
        pytest.skip(f"{path} absent (set ODMA_TRACES to the folder of the shared traces)")
    odma = run_replay(path, "odma", "online")
    static = run_replay(path, "static", "online")
    assert odma["lost"] == 0 and odma["completed"] == odma["requests"]
    assert odma["utilization"] >= 0.6
    assert odma["utilization"] >= 2 * static["utilization"]
    assert odma["migrations"] <= 0.05 * odma["requests"]
