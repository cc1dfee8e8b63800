"""vllm bench serve's summary in simulate and the engine (throughputs, TTFT / TPOT / ITL mean,
median and p99, goodput), the options both commands share (--prompt-cap, --output-cap,
--kv-pool-gb, both spellings of --dtype), the table's first line and load column, and a sweep's
--metric checked against the names a command says it makes."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from allocator.serving import options as cli

from allocator.serving.core.metrics import (ITL_MEAN_GAPS, ITL_TOKEN_TIMES, parse_goodput,
                                            request_metrics, weighted_percentiles)
from allocator.serving.core.requests import RequestState
from allocator.serving.engine import cli as engine_cli
from allocator.serving.sim import cli as simulate_cli
from odma_cli.errors import BadArgument
from odma_cli.main import main
from odma_cli.sweep import report
from odma_cli.sweep.grid import Grid
from odma_cli.sweep.log import flatten


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ODMA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "odma-cache"))


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "t.csv"
    rng = np.random.default_rng(1)
    rows = [f"{p},{g},{t:.3f}" for p, g, t in zip(rng.integers(20, 400, 40),
                                                   rng.integers(1, 120, 40),
                                                   np.cumsum(rng.exponential(0.2, 40)))]
    path.write_text("num_prefill_tokens,num_decode_tokens,arrived_at\n" + "\n".join(rows) + "\n")
    return str(path)


def exit_code(argv):
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def run_json(capsys, argv) -> dict:
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ------------------------------------------------------------------------------ the metrics
@pytest.mark.parametrize("seed", range(5))
def test_weighted_percentiles_are_those_of_the_repeated_values(seed):
    rng = np.random.default_rng(seed)
    values, counts = rng.random(30), rng.integers(0, 9, 30)
    got = weighted_percentiles(values, counts)
    whole = np.repeat(values, counts)
    assert got["mean"] == pytest.approx(whole.mean())
    for name, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        assert got[name] == pytest.approx(np.percentile(whole, q))
    assert weighted_percentiles([1.0], [0]) == {"mean": None, "p50": None, "p90": None,
                                                "p99": None}


def requests():
    # (arrival, token times): TTFT 1, 2; gaps 1, 3 and 0.5
    out = []
    for i, (arrival, times) in enumerate([(0.0, [1.0, 2.0, 5.0]), (1.0, [3.0, 3.5]),
                                          (2.0, [2.5])]):
        r = RequestState(i, 10, len(times), arrival)
        r.first_token, r.finish = times[0], times[-1]
        out.append((r, times))
    return out


def test_itl_is_every_gap_of_every_request_from_token_times_and_its_mean_without():
    reqs, times = zip(*requests())
    m = request_metrics(list(reqs), 5.0, 6, list(times))
    assert m["itl_basis"] == ITL_TOKEN_TIMES
    assert m["itl_s"]["mean"] == pytest.approx(4.5 / 3)
    assert m["itl_s"]["p50"] == pytest.approx(1.0)
    assert m["input_tokens"] == 30 and m["total_tps"] == pytest.approx(36 / 5)
    # without token times (simulate): the mean is still exact, each gap at its request's mean
    m = request_metrics(list(reqs), 5.0, 6)
    assert m["itl_basis"] == ITL_MEAN_GAPS
    assert m["itl_s"]["mean"] == pytest.approx(4.5 / 3)
    assert m["itl_s"]["p50"] == pytest.approx(2.0)            # gaps taken as 2, 2, 0.5
    assert m["tpot_s"]["mean"] == pytest.approx((2.0 + 0.5) / 2)   # one-token request left out


def test_goodput_counts_the_requests_within_every_slo():
    reqs = [r for r, _ in requests()]
    # TTFT 1, 2, 0.5 s; TPOT 2, 0.5, 0 (one token counts as 0, as vLLM counts it)
    m = request_metrics(reqs, 4.0, 6, slo=parse_goodput(["ttft:1500", "tpot:1000"]))
    assert m["goodput"] == {"slo_ms": {"ttft": 1500.0, "tpot": 1000.0}, "good_requests": 1,
                            "requests_per_s": 0.25}
    assert request_metrics(reqs, 4.0, 6, slo={"e2el": 3.0})["goodput"]["good_requests"] == 2
    assert request_metrics(reqs, 4.0, 6)["goodput"] is None


@pytest.mark.parametrize("items, message", [
    (["ttft"], "KEY:MS"), (["ttfb:5"], "KEY:MS"), (["ttft:-1"], "milliseconds > 0"),
    (["tpot:nan"], "milliseconds > 0"), (["ttft:5", "ttft:6"], "twice")])
def test_bad_goodput_is_refused(items, message):
    with pytest.raises(BadArgument, match=message):
        parse_goodput(items)


@pytest.mark.parametrize("args", [["--goodput", "ttft:abc"], ["--goodput", "itl:5"],
                                  ["--goodput", "ttft:5", "ttft:6"], ["--goodput"],
                                  ["--dtype", "fp8"]])
def test_bad_goodput_and_dtype_exit_2_in_one_line(trace, capsys, args):
    assert exit_code(["simulate", "--trace", trace] + args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("odma-hw: error:"), err


# ------------------------------------------------------------------------------ simulate
def test_simulate_reports_the_summary_beside_every_key_it_had(trace, capsys):
    doc = run_json(capsys, ["simulate", "--trace", trace, "--policy", "odma,paged",
                            "--goodput", "ttft:2000", "tpot:60"])
    for r in doc["results"]:
        for key in ("policy", "rate", "output_tps", "requests_per_s", "ttft_s", "tpot_s",
                    "e2e_s", "utilization", "settings", "timing", "output_tokens"):
            assert key in r
        assert set(r["itl_s"]) == {"mean", "p50", "p90", "p99"}
        assert r["itl_basis"] == ITL_MEAN_GAPS and r["load"] == "trace arrivals"
        assert r["total_tps"] == pytest.approx((r["input_tokens"] + r["output_tokens"])
                                               / r["duration_s"])
        v = r["vllm_summary"]
        assert v["median_ttft_ms"] == pytest.approx(r["ttft_s"]["p50"] * 1e3)
        assert v["p99_itl_ms"] == pytest.approx(r["itl_s"]["p99"] * 1e3)
        g = r["goodput"]
        assert g["slo_ms"] == {"ttft": 2000.0, "tpot": 60.0}
        assert 0 <= g["good_requests"] <= r["completed"]
        assert v["request_goodput"] == pytest.approx(g["requests_per_s"])
        assert r["settings"]["max_num_batched_tokens"] is None


def test_the_table_names_device_model_layout_scheduler_and_load(trace, capsys):
    assert main(["simulate", "--trace", trace, "--policy", "odma,paged",
                 "--max-num-batched-tokens", "512", "--goodput", "ttft:500"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("mlu370-x4 TP1 x 1 replica(s), deepseek-r1-distill-qwen-7b bf16;")
    assert "odma contiguous, paged hnd (16-token pages)" in out[0]
    assert out[0].endswith("scheduler: chunked 512 tokens/step, max batch 256")
    assert out[1].split()[0] == "load" and "trace arrivals" in out[3]
    assert any(line.startswith("as vllm bench serve reports it") for line in out)
    head = next(line for line in out if "TTFT median" in line)
    for word in ("req/s", "out tok/s", "total tok/s", "TPOT p99", "ITL mean", "goodput req/s"):
        assert word in head
    assert "goodput = requests/s within every SLO: ttft <= 500 ms" in out


@pytest.mark.parametrize("args, load", [([], "trace arrivals"), (["--rate", "2"], "2 req/s"),
                                        (["--concurrency", "4"], "closed loop 4"),
                                        (["--time-scale", "0.5"], "trace arrivals x0.5")])
def test_the_load_says_what_it_is(trace, capsys, args, load):
    doc = run_json(capsys, ["simulate", "--trace", trace, "--policy", "odma",
                            "--requests", "10"] + args)
    assert doc["results"][0]["load"] == load


def test_all_at_once_without_arrival_times(tmp_path, capsys):
    path = tmp_path / "t.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n10,20\n30,5\n")
    doc = run_json(capsys, ["simulate", "--trace", str(path), "--policy", "odma"])
    assert doc["results"][0]["load"] == "all at once"


def test_caps_cut_simulate_as_the_engine_and_dtype_takes_both_spellings(trace, capsys):
    base = ["simulate", "--trace", trace, "--policy", "odma"]
    capped = run_json(capsys, base + ["--prompt-cap", "50", "--output-cap", "8"])["results"][0]
    assert capped["output_tokens"] <= 8 * 40 and capped["input_tokens"] <= 50 * 40
    # the same cut as the engine's (cap_lengths): simulate of a trace cut by hand
    src = np.loadtxt(trace, delimiter=",", skiprows=1)
    cut = trace + ".cut.csv"
    with open(cut, "w") as f:
        f.write("num_prefill_tokens,num_decode_tokens,arrived_at\n")
        for p, g, t in src:
            f.write(f"{min(int(p), 50)},{min(int(g), 8)},{t:.3f}\n")
    by_hand = run_json(capsys, ["simulate", "--trace", cut, "--policy", "odma"])["results"][0]
    for key in ("output_tokens", "input_tokens", "output_tps", "ttft_s", "e2e_s"):
        assert capped[key] == by_hand[key]
    fp32 = run_json(capsys, base + ["--requests", "10", "--device", "a100-40gb",
                                    "--dtype", "fp32"])["results"][0]
    float32 = run_json(capsys, base + ["--requests", "10", "--device", "a100-40gb",
                                       "--dtype", "float32"])["results"][0]
    assert fp32["settings"]["dtype"] == float32["settings"]["dtype"] == "fp32"
    assert fp32["output_tps"] == float32["output_tps"]


def test_caps_do_not_combine_with_the_prefix_cache(tmp_path, capsys):
    path = tmp_path / "t.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens,prefix_id,prefix_tokens\n"
                    "100,20,a,50\n120,5,a,50\n")
    assert exit_code(["simulate", "--trace", str(path), "--prefix-cache", "--prompt-cap",
                      "40"]) == 2
    assert "--prefix-cache" in capsys.readouterr().err


def test_cap_lengths_leaves_the_trace_given_as_it_was():
    from allocator.trace import RequestTrace

    t = RequestTrace([100, 5], [30, 2], None, name="x", prefix_id=["a", ""],
                     prefix_tokens=[80, 0])
    c = cli.cap_lengths(t, 50, 10)
    assert list(c.prompt) == [50, 5] and list(c.generated) == [10, 2]
    assert list(c.prefix_tokens) == [50, 0] and list(t.prompt) == [100, 5]
    assert cli.cap_lengths(t, None, None) is t


# ------------------------------------------------------------------------------ the engine
@pytest.mark.parametrize("gb, mb, expected", [(0.5, None, 500_000_000), (None, 0.5, 500_000),
                                              (1e-3, None, 1_000_000)])
def test_the_engine_pool_in_gb_with_mb_as_its_alias(gb, mb, expected):
    args = types.SimpleNamespace(kv_pool_gb=gb, kv_pool_mb=mb, memory_utilization=0.9)
    pool, option = engine_cli.kv_pool(args, 10**9, "card x", 10**8)
    assert pool == expected
    assert option.startswith("--kv-pool-mb" if mb is not None else "--kv-pool-gb")
    with pytest.raises(BadArgument, match="alias"):
        engine_cli.kv_pool(types.SimpleNamespace(kv_pool_gb=1.0, kv_pool_mb=1.0))


def test_the_engines_default_pool_is_simulates_rule_on_the_card_or_the_device():
    """What the weights leave of --memory-utilization of --card's capacity (at most the
    device's free memory), else of the device's free memory, never below nothing."""
    from allocator.serving.cards.presets import accelerator

    args = types.SimpleNamespace(kv_pool_gb=None, kv_pool_mb=None, memory_utilization=0.5)
    card = accelerator("a100-80gb")                                   # 85.1 GB
    assert engine_cli.pool_room(card, 200 * 10**9, "torch:cuda:0") == (int(85.1e9),
                                                                         "card a100-80gb")
    assert engine_cli.pool_room(card, 20 * 10**9, "torch:cpu")[0] == 20 * 10**9
    assert engine_cli.pool_room(None, 7, "torch:cpu") == (7, "torch:cpu's free memory")
    pool, how = engine_cli.kv_pool(args, 10 * 10**9, "card x", 10**9)
    assert pool == 4 * 10**9 and "0.5 of card x" in how
    assert engine_cli.kv_pool(args, 10**9, "card x", 10**9)[0] == 0
    with pytest.raises(BadArgument, match="unknown: give --kv-pool-gb"):
        engine_cli.kv_pool(args, None, "torch:x")
    with pytest.raises(BadArgument, match="memory-utilization"):
        engine_cli.kv_pool(types.SimpleNamespace(kv_pool_gb=None, kv_pool_mb=None,
                                                 memory_utilization=1.5), 10, "card x")


def test_the_engine_parser_takes_the_shared_options():
    from odma_cli.main import build_parser

    parser = build_parser()
    a = parser.parse_args(["engine", "--trace", "t.csv", "--dtype", "bf16", "--kv-pool-gb",
                           "0.5", "--goodput", "ttft:100", "tpot:10", "--prompt-cap", "8"])
    assert a.dtype == "bfloat16" and a.kv_pool_gb == 0.5 and a.kv_pool_mb is None
    assert engine_cli.goodput_slo(a.goodput) == {"ttft": 0.1, "tpot": 0.01}
    assert parser.parse_args(["engine", "--trace", "t.csv", "--dtype", "fp32"]).dtype == "float32"
    assert parser.parse_args(["simulate", "--dtype", "bfloat16"]).dtype == "bf16"


def test_the_engine_summary_takes_itl_from_token_times():
    from allocator.serving.core.metrics import summarise_engine

    reqs, times = zip(*requests())
    run = {"requests": list(reqs), "tokens": [[0] * len(t) for t in times],
           "token_times": list(times), "seconds": 5.0, "used_tokens": 1, "reserved_tokens": 2,
           "allocator": {}, "preemptions": 0, "batch_sum": 3, "steps": 3, "peak_batch": 2}
    r = summarise_engine("odma", run, {}, {"ttft": 1.5})
    assert r["itl_basis"] == ITL_TOKEN_TIMES and r["itl_s"]["mean"] == pytest.approx(1.5)
    assert r["goodput"]["good_requests"] == 2
    assert r["vllm_summary"]["request_goodput"] == pytest.approx(0.4)
    table = engine_cli.summary_table([r], ["odma"])
    assert "ITL (simulated)" not in "\n".join(table)


# ------------------------------------------------------------------------------ the sweep
def test_an_unknown_sweep_metric_is_refused_with_the_known_ones():
    grid = Grid("g.toml", "simulate", {}, {"rate": ["2", "8"]})
    with pytest.raises(BadArgument) as e:
        report.check_metric(grid, "tpot_p99")
    text = str(e.value)
    assert "\n" not in text and "tpot_s.{mean,p50,p90,p99}" in text and "output_tps" in text
    for ok in ("tpot_s.p99", "out.rate", "itl_s.p50", "vllm_summary.p99_itl_ms", "rate",
               "wall_seconds", "goodput.requests_per_s"):
        report.check_metric(grid, ok)
    with pytest.raises(BadArgument, match="no metric of engine"):
        report.check_metric(Grid("g.toml", "engine", {}, {"max-batch": [1]}), "tpot_p99")


def test_the_sweep_cli_exits_2_before_any_cell(tmp_path, capsys, trace):
    grid = tmp_path / "g.toml"
    grid.write_text(f'command = "simulate"\n[fixed]\ntrace = "{trace}"\n'
                    f'[axes]\npage-tokens = [16, 32]\n')
    assert exit_code(["sweep", str(grid), "--metric", "tpot_p99"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tpot_s.{mean,p50,p90,p99}" in err
    assert not (tmp_path / "g-sweep").exists()


def test_every_numeric_column_of_simulate_is_a_known_metric(trace, capsys):
    doc = run_json(capsys, ["simulate", "--trace", trace, "--policy", "odma,paged",
                            "--goodput", "ttft:100"])
    names = simulate_cli.METRICS
    for r in doc["results"]:
        for key, value in flatten(r).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                assert report._known(key, names), key
    plain = [n for n in names if not n.endswith(".*")]
    flat = flatten(doc["results"][0])
    assert [n for n in plain if n not in flat] == []
