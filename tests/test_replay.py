"""`odma-hw replay` and run_replay(): every request completes, metrics mean what they say."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from allocator.replay import Trace, load_trace, run_replay
from odma_cli.main import main

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


def exit_code(argv) -> int:
    """The CLI's exit status, whether argparse or the command returned it."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("args, message", [
    (["--trace", "/no/such.csv"], "cannot read trace"),
    (["--policy", "magic"], "invalid choice"),
    (["--max-tokens", "5"], "below the longest request"),
    (["--rate", "-1"], "--rate"),
    (["--device", "nonsense"], "unknown device"),
    (["--pool-gib", "nan"], "--pool-gib"),
    (["--pool-gib", "inf"], "--pool-gib"),
    (["--pool-gib", "1e300"], "--pool-gib"),
    (["--kv-pool-gb", "1"], "--pool-gib is the older spelling of --kv-pool-gb"),
    (["--seed", "-1"], "--seed"),
    (["--rate", "1e-300"], "30 days"),
    (["--time-scale", "0"], "--time-scale"),
    (["--step-seconds", "nan"], "--step-seconds"),
    (["--buckets", "0"], "--buckets"),
    (["--large-share", "1"], "--large-share"),
    (["--alpha", "nan"], "--alpha"),
])
def test_cli_bad_usage_exits_2_with_one_line(tmp_path, capsys, args, message):
    path = tmp_path / "t.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n10,20\n5,5\n")
    argv = ["replay", "--trace", str(path), "--device", "none", "--pool-gib", "0.01"] + args
    assert exit_code(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_the_pool_is_given_in_gb_as_simulate_and_engine_take_it(tmp_path, capsys):
    """--kv-pool-gb (1e9 B) is the one name of the pool across commands; --pool-gib (2^30 B)
    stays as its older spelling and sizes the same pool."""
    path = tmp_path / "t.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n10,20\n5,5\n")
    base = ["replay", "--trace", str(path), "--device", "none", "--json"]
    runs = []
    for pool in (["--kv-pool-gb", str(2**30 / 1e9 / 64)], ["--pool-gib", str(1 / 64)]):
        assert main(base + pool) == 0
        run = json.loads(capsys.readouterr().out)
        run.pop("wall_seconds")
        runs.append(run)
    assert runs[0] == runs[1]
    assert exit_code(base + ["--kv-pool-gb", "1e300"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--kv-pool-gb must be in" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("content, message", [
    (b"num_prefill_tokens,num_decode_tokens\n99999999999999999999,5\n", "line 2"),
    (b"num_prefill_tokens,num_decode_tokens\ninf,5\n", "not a whole number"),
    (b"num_prefill_tokens,num_decode_tokens\n10.5,5\n", "not a whole number"),
    (b"num_prefill_tokens,num_decode_tokens\n10,x\n", "not a number"),
    (b"num_prefill_tokens,num_decode_tokens\n10\n", "not a number"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe binary", "not a UTF-8 text CSV"),
    (b"num_prefill_tokens,num_decode_tokens\x00\n1,2\n", "lacks column"),
    (b"arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,5\n1e300,10,5\n", "30 days"),
    (b"arrived_at,num_prefill_tokens,num_decode_tokens\nnan,10,5\n", "not finite"),
    (b"num_prefill_tokens,num_decode_tokens\n", "no rows"),
])
def test_a_bad_trace_file_is_one_line_before_any_work(tmp_path, capsys, content, message):
    path = tmp_path / "t.csv"
    path.write_bytes(content)
    assert exit_code(["replay", "--trace", str(path), "--device", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_directory_is_named_as_one_and_a_bom_is_fine(tmp_path, capsys):
    assert exit_code(["replay", "--trace", str(tmp_path), "--device", "none"]) == 2
    assert "is a directory" in capsys.readouterr().err
    path = tmp_path / "bom.csv"
    path.write_bytes("\ufeffnum_prefill_tokens,num_decode_tokens\n10,20\n".encode())
    assert len(load_trace(path)) == 1


def test_malformed_trace_is_bad_argument(tmp_path):
    from odma_cli.errors import BadArgument
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


@pytest.mark.parametrize("plot, message", [
    ("/nonexistent/dir/x.png", "does not exist"),
    ("x.xyz", "unknown image format"),
])
def test_a_bad_plot_path_is_refused_before_the_replay(tmp_path, capsys, monkeypatch, plot,
                                                      message):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "t.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n10,20\n")
    import allocator.replay as replay

    def must_not_run(*a, **k):
        raise AssertionError("the replay ran before the plot path was checked")
    monkeypatch.setattr(replay, "run_replay", must_not_run)
    assert exit_code(["replay", "--trace", str(path), "--device", "none", "--plot", plot]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("policy", ["odma", "s3", "paged", "extent"])
def test_a_pool_too_busy_for_every_growth_never_cycles(policy):
    """A pool of a few long requests: growth keeps failing. Preempting the request that failed
    to grow let s3 cycle forever (each rerun from scratch grew into the same wall); preempting
    the one with the least progress lets the most advanced always finish."""
    import signal

    rng = np.random.default_rng(0)
    n = 600
    trace = Trace(rng.integers(1, 301, n), rng.integers(1, 701, n), None, name="busy")

    def stuck(*_):
        raise AssertionError(f"{policy}: the replay did not finish in 60 s")
    old = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(60)
    try:
        r = run_replay(trace, policy, bytes_per_token=64, pool_bytes=800 * 64 * 2,
                       max_tokens=1000)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert r["completed"] == n
    assert r["preemptions"] > 0                  # growth did fail
