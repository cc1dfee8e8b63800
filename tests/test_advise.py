"""`odma-hw advise`: the SLO search finds the edge of what a policy sustains, the advice names
the policy with the most goodput, the memory verdict is the probe's, and bad input is refused
in one line before any run."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from odma_cli.main import main

from allocator.serving.sim import advise as adv
from allocator.serving.sim.simulation import simulate
from allocator.trace import RequestTrace

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ["odma", "paged", "elastic", "static"]
# a small pool, so that the policies differ in what they hold and so in goodput
PRESSED = {"slo": adv.parse_slo("ttft:1000,tpot:40"), "kv_pool_gb": 0.2, "requests": None}


def small_trace(n: int = 120) -> RequestTrace:
    rng = np.random.default_rng(0)
    return RequestTrace(rng.integers(100, 1500, n), rng.integers(10, 300, n), None,
                        name="small")


@pytest.fixture(scope="module")
def pressed():
    """One card's advice under KV pressure (every policy searched)."""
    return adv.advise(small_trace(), "qwen2.5-0.5b", ["mlu370-x4"], POLICIES, **PRESSED)


@pytest.fixture
def trace_csv(tmp_path):
    path = tmp_path / "t.csv"
    t = small_trace(60)
    path.write_text("num_prefill_tokens,num_decode_tokens\n"
                    + "".join(f"{p},{g}\n" for p, g in zip(t.prompt, t.generated)))
    return str(path)


# --- the search --------------------------------------------------------------------------------

@pytest.mark.parametrize("edge", [1, 7, 13, 100, 127, 128, 129, 500, 999])
@pytest.mark.parametrize("start", [1, 16, 128, 1000])
def test_the_search_returns_a_load_that_passes_and_a_next_one_that_fails(edge, start):
    tried = []

    def passes(load):
        tried.append(load)
        return load <= edge

    good, bad = adv.search_load(passes, start, 1000, resolution=0.0)
    assert (good, bad) == (edge, edge + 1) if edge < 1000 else (1000, None)
    assert len(tried) == len(set(tried))                 # no load is run twice
    assert len(tried) <= 24                              # doubling, then bisection


def test_the_search_stops_within_its_resolution():
    good, bad = adv.search_load(lambda load: load <= 300, 128, 1000)
    assert good <= 300 < bad and bad - good <= good * adv.RESOLUTION


def test_a_load_nothing_meets_and_a_trace_every_load_meets():
    assert adv.search_load(lambda load: False, 64, 1000) == (None, 1)
    assert adv.search_load(lambda load: True, 64, 200) == (200, None)


def test_another_policys_answer_costs_two_runs_when_it_holds():
    tried = []

    def passes(load):
        tried.append(load)
        return load <= 40

    assert adv.search_load(passes, 128, 1000, first=(40, 44)) == (40, 44)
    assert tried == [40, 44]


# --- the advice --------------------------------------------------------------------------------

def test_the_recommended_policy_has_the_best_goodput_in_the_json(pressed):
    card, = pressed["cards"]
    rows = {f["policy"]: f for f in card["policies"]}
    best = max(rows.values(), key=lambda f: f["goodput_tps"])
    rec = card["recommendation"]
    assert rec["policy"] == best["policy"] and rec["goodput_tps"] == best["goodput_tps"]
    for p, margin in rec["margins"].items():
        assert margin == pytest.approx(best["goodput_tps"] / rows[p]["goodput_tps"])
        assert f"{margin:.2f}x {p}" in rec["sentence"]
    # under this pressure the policies do differ: the advice is not a tie
    assert max(rec["margins"].values()) > 1 + adv.TIE


def test_the_goodput_load_meets_the_slo_and_the_failing_load_does_not(pressed):
    card, = pressed["cards"]
    slo = PRESSED["slo"]
    for f in card["policies"]:
        assert f["load"] is not None and f["fail_load"] is not None
        assert f["fail_load"] - f["load"] <= max(1, f["load"] * adv.RESOLUTION)
        for load, ok in ((f["load"], True), (f["fail_load"], False)):
            r, = simulate(small_trace(), (f["policy"],), model="qwen2.5-0.5b",
                          device="mlu370-x4", concurrency=load, kv_pool_gb=0.2)
            assert adv.meets(r, slo) is ok, (f["policy"], load)
            assert r["output_tps"] == pytest.approx(
                next(x for x in f["probes"] if x["load"] == load)["output_tps"])


def test_the_verdict_and_the_capacity_are_the_cards():
    doc = adv.advise(small_trace(30), "qwen2.5-0.5b", ["mlu370-x4", "h100-sxm"], ["odma"],
                     slo=adv.parse_slo("ttft:1000"), requests=None)
    lpddr, hbm = (c["memory"] for c in doc["cards"])
    # 16-token pages of 64-wide bf16 heads: 2 KiB runs, judged by the probe's rule
    assert lpddr["run_bytes"] == hbm["run_bytes"] == 16 * 64 * 2
    assert lpddr["verdict"] == "contiguous-recommended" and hbm["verdict"] == "paging-free"
    assert lpddr["summary"].startswith("16-token pages of qwen2.5-0.5b")
    for c in doc["cards"]:
        cap = c["kv_capacity"]
        assert cap["requests"] == int(cap["pool_tokens"] // cap["mean_request_tokens"])
        assert cap["mean_request_tokens"] == pytest.approx(
            np.mean(small_trace(30).prompt + small_trace(30).generated))


def test_the_answer_does_not_depend_on_the_processes():
    def strip(doc):
        for card in doc["cards"]:
            for f in card["policies"]:
                f.pop("wall_s")
                f["at_load"].pop("wall_s")
                for p in f["probes"]:
                    p.pop("wall_s")
        return doc
    args = (small_trace(40), "qwen2.5-0.5b", ["mlu370-x4", "a100-80gb"], ["odma", "paged"])
    kw = {"slo": adv.parse_slo("tpot:15"), "requests": None}
    assert strip(adv.advise(*args, jobs=1, **kw)) == strip(adv.advise(*args, jobs=2, **kw))


# --- the command -------------------------------------------------------------------------------

def test_several_cards_give_one_row_each(trace_csv, capsys):
    cards = ["mlu370-x4", "a100-80gb", "h100-sxm"]
    argv = ["advise", "--trace", trace_csv, "--model", "qwen2.5-0.5b", "--device",
            ",".join(cards), "--policy", "odma,paged", "--slo", "ttft:1000,tpot:20",
            "--jobs", "1"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == adv.SCHEMA and doc["load"] == "concurrency"
    assert [c["card"] for c in doc["cards"]] == cards
    assert main(argv) == 0
    text = capsys.readouterr().out
    table = text[text.index("cards side by side"):].splitlines()[3:]
    assert [row.split()[0] for row in table] == cards
    for c in doc["cards"]:
        assert f"advice: {c['recommendation']['sentence']}" in text


@pytest.mark.parametrize("bad, says", [
    (["--device", "mlu370-x4,no-such-card"], "unknown --device 'no-such-card'"),
    (["--slo", "ttft=500"], "--slo takes KEY:MS"),
    (["--slo", "ttft:500,tpot:-1"], "--slo tpot"),
    (["--slo", "speed:5"], "(e.g. ttft:500,tpot:50)"),     # the example in --slo's syntax
    (["--slo", "ttft:500,"], "--slo takes KEY:MS items joined by commas"),
    (["--slo", "ttft:500", "--slo", "tpot:50"], "--slo is given twice"),
    (["--policy", "odma,bogus"], "unknown policy bogus"),
    (["--engine-profile", "vllm-9"], "unknown --engine-profile 'vllm-9'"),
])
def test_bad_input_exits_2_with_one_line_before_any_run(bad, says, trace_csv, capsys,
                                                        monkeypatch):
    def no_run(*args, **kwargs):
        raise AssertionError("a search ran")
    monkeypatch.setattr(adv, "search_policy", no_run)
    try:
        status = main(["advise", "--trace", trace_csv, *bad])
    except SystemExit as exc:                 # argparse's refusal of an option's text
        status = exc.code
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1 and says in err, err


def test_an_engine_profile_prices_every_search_and_is_named(trace_csv, capsys):
    """--engine-profile replaces every card's overheads in the searches: vLLM 0.6's 114 us a
    layer and weights read at 0.879 make the same loads slower than the a100-80gb card's own
    terms; the profile is named in the JSON's settings and the page's head line."""
    argv = ["advise", "--trace", trace_csv, "--model", "qwen2.5-0.5b", "--device",
            "a100-80gb", "--policy", "odma", "--slo", "ttft:1000,tpot:20", "--jobs", "1"]
    own, heavy = [], []
    for out, extra in ((own, []), (heavy, ["--engine-profile", "vllm-0.6"])):
        assert main([*argv, *extra, "--json"]) == 0
        out.append(json.loads(capsys.readouterr().out))
    own, heavy = own[0], heavy[0]
    assert own["settings"]["engine_profile"] is None
    assert heavy["settings"]["engine_profile"] == "vllm-0.6"
    tpot = {}
    for name, doc in (("own", own), ("heavy", heavy)):
        tpot[name] = {p["load"]: p["tpot_ms"]["p50"]
                      for p in doc["cards"][0]["policies"][0]["probes"]}
    common = set(tpot["own"]) & set(tpot["heavy"])
    assert common and all(tpot["heavy"][c] > tpot["own"][c] for c in common)
    assert main([*argv, "--engine-profile", "vllm-0.6"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("; engine profile vllm-0.6")


def test_a_missing_trace_is_refused_in_one_line(capsys):
    assert main(["advise"]) == 2
    assert capsys.readouterr().err.strip() == "odma-hw: error: advise needs --trace CSV"


def test_the_plot_has_a_line_per_policy_at_the_same_loads(trace_csv, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "advise.png"
    assert main(["advise", "--trace", trace_csv, "--model", "qwen2.5-0.5b", "--policy",
                 "odma,paged", "--slo", "tpot:15", "--jobs", "1", "--json",
                 "--plot", str(png)]) == 0
    assert png.stat().st_size > 0
    lead, other = json.loads(capsys.readouterr().out)["cards"][0]["policies"]
    assert {p["load"] for p in lead["probes"]} <= {p["load"] for p in other["probes"]}
    assert min(p["load"] for p in lead["probes"]) < lead["load"] // 2    # it reaches light loads



@pytest.mark.skipif(not (ROOT.parent / "shared" / "traces" / "azure_conv_2023.csv").exists(),
                    reason="the shared traces are absent")
def test_the_example_in_the_docs_is_what_advise_prints_today(monkeypatch, capsys):
    """docs/advise.md shows the command's output on 1,000 requests (the first card, then the
    table): a change that moves a figure must show the page's reader the new one (the
    simulation is deterministic; ~10 s)."""
    page = (ROOT / "docs" / "advise.md").read_text()
    command = re.search(r"```sh\n(odma-hw advise .*?)\n```", page, re.S).group(1)
    argv = shlex.split(command.replace("\\\n", " "))[1:]
    assert "--requests" in argv and "1,000 requests (`--requests 1000`" in page
    argv[argv.index("--requests") + 1] = "1000"
    shown = re.search(r"```text\n(.*?)```", page, re.S).group(1)
    monkeypatch.chdir(ROOT)
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for part in shown.strip().split("\n\n"):    # the first card's lines, then the table
        assert part in printed, "rerun the command and paste its output into the page"
