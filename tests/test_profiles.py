"""Engine profiles (allocator/serving/profiles): loading, refusals in one line naming the file and
the key (exit 2 before any work), their effect on simulate, and the fit that made them."""

from __future__ import annotations

import json
import pathlib
import re

import numpy as np
import pytest

from allocator.serving.cards.presets import accelerator
from allocator.serving.cards.profiles import (PROFILE_DIR, TERMS, engine_profile, load_profile,
                                              model_path, profile_names)
from odma_cli.errors import BadArgument
from odma_cli.main import main

GOOD = """name = "mine"
engine = "vllm"
version = "9.9"
step_overhead_us = 100.0
layer_overhead_us = 40.0
request_overhead_us = 50.0
layer_request_overhead_us = 0.0
weight_read_efficiency = 0.9
"""
# a closed-loop serving point: 32 requests, 8 in flight, the median time per output token
POINT = """
[[fit_points]]
id = "served"
source = "a test"
measured = "median TPOT"
card = "a100-80gb"
model = "qwen2.5-0.5b"
input = 64
output = 32
batch = 32
concurrency = 8
metric = "tpot_p50_ms"
published = 5.0
scheduler = "v1-server-2048"
"""


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ODMA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "odma-cache"))


@pytest.fixture
def small_trace(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n100,40\n300,60\n50,200\n")
    return str(path)


def write(tmp_path, text, name="p.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("name", ["vllm-0.4", "vllm-0.6", "vllm-ci-9500", "vllm-v1-a100",
                                  "vllm-v1-h100"])
def test_the_presets_load_and_every_fitted_term_says_what_it_was_fitted_from(name):
    assert name in profile_names()
    p = engine_profile(name)
    assert p.engine == "vllm" and p.version and p.source
    assert set(p.terms) == set(TERMS)
    if p.fitted:
        assert p.fit_points
        for point in p.fit_points:
            assert point["source"] and point["measured"]
            accelerator(point["card"])                      # a preset card
            assert pathlib.Path(model_path(point["model"])).is_file() or point["model"] in (
                "llama-3.1-8b", "qwen2.5-0.5b", "qwen2.5-7b")


def test_no_fit_point_is_a_point_of_the_published_test_set(bench):
    fp = bench("fidelity_published")
    test_set = {(card, model, isl, osl)
                for _, _, card, model, isl, osl, *_ in fp.POINTS + fp.SATURATED}
    for name in profile_names():
        for p in engine_profile(name).fit_points:
            assert (p["card"], p["model"], p["input"], p["output"]) not in test_set, p["id"]
    assert set(fp.PROFILE.values()) <= set(profile_names())


def test_the_saturated_set_is_reported_beside_the_target_set_not_in_it(capsys, bench):
    """--set all prints both sets with a summary each; the JSON's `summary` stays the target
    set's (the targets are its), and every saturated point is simulated on all three metrics,
    its lengths the published totals over its requests."""
    fp = bench("fidelity_published")
    assert fp.main(["--set", "saturated", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["summaries"]) == {"saturated"} and "summary" not in doc
    assert {r["set"] for r in doc["rows"]} == {"saturated"}
    assert len(doc["rows"]) == 3 * len(fp.SATURATED) == doc["summaries"]["saturated"]["rows"]
    assert all(np.isfinite(r["simulated"]) and r["simulated"] > 0 for r in doc["rows"])
    medium = next(p for p in fp.SATURATED if p[0] == "qwen3-14b a100 1996")
    assert (medium[4], medium[5], medium[6]) == (1996 + fp.CHAT_TEMPLATE, 100, 500)
    assert fp.main(["--set", "all"]) == 0
    out = capsys.readouterr().out
    assert out.count("mean absolute error") == 2 and "### vllm-points" in out
    assert fp.main(["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"] == doc["summaries"]["vllm-points"]
    assert doc["summary"]["rows"] == sum(len(p[9]) for p in fp.POINTS)


def test_the_published_table_in_the_docs_is_what_the_bench_prints_today(capsys, bench):
    """docs/fidelity.md's table of published points and its summary line, and the saturated
    set's summary, are the bench's output: a change that moves a figure must show the page's
    reader the new one."""
    fp = bench("fidelity_published")
    assert fp.main([]) == 0
    printed = capsys.readouterr().out.splitlines()
    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "fidelity.md").read_text()
    rows = [line for line in printed if line.startswith("| P")]
    assert rows and rows == [line for line in page.splitlines() if line.startswith("| P")], (
        "rerun .venv/bin/python bench/fidelity_published.py and put its table into the page")
    summary = next(line for line in printed if line.startswith("mean absolute error"))
    assert f"\n{summary} " in page
    assert fp.main(["--set", "saturated", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)["summaries"]["saturated"]
    assert (f"mean absolute error {100 * m['mae']:.1f} % over {m['rows']} rows, "
            f"{m['beyond_20pct']} beyond 20 %") in page


def test_the_published_table_can_take_the_card_defaults_instead_of_the_profiles(bench):
    """--profiles v1-defaults drops only the V1 profiles (the table before they were fitted),
    --profiles none every profile (one set of overheads for every card)."""
    fp = bench("fidelity_published")
    sources = fp.PROFILE
    assert {fp.profile_of(s) for s in sources} == set(sources.values())
    assert {fp.profile_of(s, "none") for s in sources} == {None}
    kept = {fp.profile_of(s, "v1-defaults") for s in sources}
    assert None in kept and "vllm-0.6" in kept and not any(
        n and n.startswith("vllm-v1-") for n in kept)


def test_applying_a_profile_replaces_only_the_cards_overheads(tmp_path):
    card = accelerator("a100-80gb")
    p = load_profile(write(tmp_path, GOOD))
    out = p.apply(card)
    assert out.step_overhead_us == 100.0 and out.weight_read_efficiency == 0.9
    assert (out.bandwidth_gbps, out.tflops_bf16, out.timing) == (
        card.bandwidth_gbps, card.tflops_bf16, card.timing)


BAD = [
    (GOOD + 'color = "red"\n', "'color'"),                                   # unknown key
    (GOOD.replace("step_overhead_us = 100.0", "step_overhead_us = -1.0"), "'step_overhead_us'"),
    (GOOD.replace("layer_overhead_us = 40.0", 'layer_overhead_us = "40"'), "'layer_overhead_us'"),
    (GOOD.replace("layer_overhead_us = 40.0", "layer_overhead_us = nan"), "'layer_overhead_us'"),
    (GOOD.replace("request_overhead_us = 50.0", "request_overhead_us = inf"),
     "'request_overhead_us'"),
    (GOOD.replace("weight_read_efficiency = 0.9", "weight_read_efficiency = 1.5"),
     "'weight_read_efficiency'"),
    (GOOD.replace('version = "9.9"\n', ""), "'version'"),                     # missing key
    (GOOD + 'fitted = ["step_overhead_us"]\n', "'fitted'"),                   # no points
    (GOOD + '[[fit_points]]\nid = "x"\n', "'source'"),                        # a point's key
    (GOOD + 'fitted = ["layer_overhead_us"]\n' + POINT.replace("concurrency = 8",
                                                               "concurrency = 2.5"),
     "'concurrency'"),
    (GOOD + 'fitted = ["layer_overhead_us"]\n' + POINT.replace('"tpot_p50_ms"', '"tpot_p90_ms"'),
     "'metric'"),
    ("name = \n", "not valid TOML"),
]


@pytest.mark.parametrize("text, key", BAD)
def test_a_bad_profile_exits_2_in_one_line_naming_the_file_and_key_before_any_work(
        tmp_path, small_trace, capsys, text, key):
    path = write(tmp_path, text, "bad.toml")
    with pytest.raises(BadArgument, match=re.escape(key)):
        load_profile(path)
    assert main(["simulate", "--trace", small_trace, "--device", "a100-80gb",
                 "--engine-profile", path, "--policy", "paged"]) == 2
    out = capsys.readouterr()
    assert out.out == ""                                       # nothing simulated
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and path in lines[0] and key in lines[0]


def test_a_missing_or_unknown_profile_exits_2(tmp_path, small_trace, capsys):
    missing = str(tmp_path / "none.toml")
    for arg in (missing, "vllm-9"):
        assert main(["simulate", "--trace", small_trace, "--engine-profile", arg]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and arg in err[0]


def run(capsys, small_trace, *extra) -> dict:
    assert main(["simulate", "--trace", small_trace, "--device", "a100-80gb", "--policy",
                 "paged", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)["results"][0]


def test_a_profile_with_more_overhead_slows_simulate_and_is_named_in_the_result(
        tmp_path, small_trace, capsys):
    card = run(capsys, small_trace)
    slow = run(capsys, small_trace, "--engine-profile", "vllm-0.6")
    assert card["engine_profile"] is None and slow["engine_profile"] == "vllm-0.6"
    assert slow["tpot_s"]["p50"] > card["tpot_s"]["p50"] * 1.2     # 114 us a layer, 0.88 reads
    assert slow["output_tps"] < card["output_tps"]
    light = write(tmp_path, GOOD.replace("layer_overhead_us = 40.0", "layer_overhead_us = 0.0")
                  .replace("request_overhead_us = 50.0", "request_overhead_us = 0.0")
                  .replace("step_overhead_us = 100.0", "step_overhead_us = 0.0")
                  .replace("weight_read_efficiency = 0.9", "weight_read_efficiency = 1.0"))
    fast = run(capsys, small_trace, "--engine-profile", light)
    assert fast["tpot_s"]["p50"] < card["tpot_s"]["p50"]


def test_the_fit_script_reproduces_the_shipped_terms(capsys, bench):
    fit_profiles = bench("fit_profiles")
    assert fit_profiles.main(["--check"]) == 0
    out = capsys.readouterr().out
    for name in profile_names():
        assert f"{name} (vllm" in out
    # every fitted point within 10 % of its published figure
    errors = [float(e) for e in re.findall(r"simulated .* ([+-]\d+\.\d)%", out)]
    assert errors and max(map(abs, errors)) <= 10.0


def test_a_served_point_is_simulated_as_a_closed_loop_and_its_tpot_fitted(tmp_path, bench):
    """A point of a serving benchmark (`concurrency` requests in flight, TPOT p50) is simulated
    as it ran: more requests in flight make a longer decode step, and the fitted per-layer term
    brings the simulated TPOT to the published one."""
    fit_profiles = bench("fit_profiles")
    profile = load_profile(write(tmp_path, GOOD + 'fitted = ["layer_overhead_us"]\n' + POINT))
    point = profile.fit_points[0]
    assert point["concurrency"] == 8 and isinstance(point["concurrency"], int)
    one = dict(point, concurrency=1)
    assert fit_profiles.seconds(point, profile) > fit_profiles.seconds(one, profile)
    assert fit_profiles.published_seconds(point) == pytest.approx(5e-3)
    values, rows = fit_profiles.fit(profile)
    assert values["layer_overhead_us"] > 0
    (_, published, simulated), = rows
    assert simulated == pytest.approx(published, rel=0.02)


def test_profile_files_are_in_the_profile_folder():
    assert all((PROFILE_DIR / f"{n}.toml").is_file() for n in profile_names())
