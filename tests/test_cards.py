"""Card files (`odma-hw simulate --device CARD`): the presets are files with the numbers they
always had, a user's TOML or JSON card serves as a preset does, every timing source a card may
name works, every bad card is refused in one line before any work, and `simulate --list`."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest

from allocator.serving.engine import ServingSetup
from allocator.serving.presets import (CARD_KEYS, LAYER_OVERHEAD_US, REQUEST_OVERHEAD_US,
                                       accelerator, card_names, load_card, model_spec)
from allocator.serving.steptime import StepTimer
from allocator.serving.timing import IdealTiming, make_timing
from odma_hw.cli import main

QWEN = model_spec("deepseek-r1-distill-qwen-7b")

# the numbers the presets had when they were written in presets.py
PRESETS = {
    "mlu370-x4": dict(bandwidth_gbps=307.2, capacity_gb=24.0, tflops_bf16=96.0, tops_int8=256.0,
                      timing="emu:mlu370-x4", emu_channels=None, link_gbps=32.0,
                      link_latency_us=10.0, layer_overhead_us=40.0, request_overhead_us=50.0,
                      source_starts="24 GB LPDDR5, 384 bit x 6400 MT/s = 307.2 GB/s"),
    "a100-80gb": dict(bandwidth_gbps=2039.0, capacity_gb=80.0, tflops_bf16=312.0,
                      tops_int8=624.0, timing="emu:hbm2-2000", emu_channels=80, link_gbps=300.0,
                      link_latency_us=5.0, layer_overhead_us=40.0, request_overhead_us=50.0,
                      source_starts="NVIDIA A100 80GB SXM datasheet: 2,039 GB/s HBM2e"),
}

CARD = {"name": "test-card", "bandwidth_gbps": 200.0, "capacity_gb": 32.0, "tflops_bf16": 64.0,
        "timing": "emu:lpddr5-6400", "link_gbps": 32.0, "link_latency_us": 10.0,
        "emu_channels": 8}
REQUIRED = [k for k, (required, _) in CARD_KEYS.items() if required]


def plain(**changes) -> dict:
    """CARD without its emu-only key, with `changes`."""
    return {**{k: v for k, v in CARD.items() if k != "emu_channels"}, **changes}

NUMBERS = [k for k in REQUIRED if CARD_KEYS[k][1] in ("positive", "nonnegative")]


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    """One emulator efficiency cache for the module's tests (computed once, then read)."""
    monkeypatch.setenv("ODMA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "odma-cache"))


def toml_text(card: dict) -> str:
    """A TOML card: the values as JSON writes them are valid TOML, nan and inf aside."""
    def value(v):
        if isinstance(v, float) and not math.isfinite(v):
            return "nan" if v != v else ("inf" if v > 0 else "-inf")
        if isinstance(v, dict):                        # an inline table
            return "{" + ", ".join(f"{json.dumps(k)} = {value(x)}" for k, x in v.items()) + "}"
        return json.dumps(v)
    return "".join(f"{k} = {value(v)}\n" for k, v in card.items())


def write_card(folder, card: dict, name="card.toml"):
    path = folder / name
    path.write_text(json.dumps(card) if name.endswith(".json") else toml_text(card))
    return str(path)


@pytest.fixture
def small_trace(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n100,40\n300,60\n50,200\n")
    return str(path)


def run_json(capsys, argv) -> dict:
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def comparable(doc: dict) -> list[dict]:
    rows = []
    for r in doc["results"]:
        r = dict(r, settings=dict(r["settings"]))
        r.pop("wall_seconds")
        r["settings"].pop("device_file")
        rows.append(r)
    return rows


# ------------------------------------------------------------------------------ the presets
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_presets_are_files_with_the_numbers_they_had(name):
    # the GPUs of the published measurements (bench/fidelity_published.py) are presets too
    assert set(PRESETS) <= set(card_names())
    card = accelerator(name)
    want = dict(PRESETS[name])
    assert card.source.startswith(want.pop("source_starts"))
    assert {k: getattr(card, k) for k in want} == want
    assert card.name == name and card.path.endswith(f"cards/{name}.toml")
    assert card.tflops_fp32 is None and card.mfu is None and card.layer_request_overhead_us == 0
    assert card.file is None                                  # a preset is named, not a path
    assert (LAYER_OVERHEAD_US, REQUEST_OVERHEAD_US) == (40.0, 50.0)
    # the preset's own file, named by path, is the same card
    assert load_card(card.path) == card


# ------------------------------------------------------------------------------ user cards
def test_a_toml_card_and_the_same_as_json_simulate_alike(tmp_path, small_trace, capsys):
    toml_card = write_card(tmp_path, CARD, "card.toml")
    json_card = write_card(tmp_path, CARD, "card.json")
    assert dataclasses.replace(load_card(toml_card), path="") == \
        dataclasses.replace(load_card(json_card), path="")
    argv = ["simulate", "--trace", small_trace, "--policy", "odma,paged"]
    by_toml = run_json(capsys, argv + ["--device", toml_card])
    by_json = run_json(capsys, argv + ["--device", json_card])
    assert comparable(by_toml) == comparable(by_json)
    r = by_toml["results"][0]
    assert r["settings"]["device"] == "test-card"
    assert r["settings"]["device_file"] == toml_card
    assert r["timing"]["source"] == "emu:lpddr5-6400"
    assert r["timing"]["settings"]["channels"] == 8           # the card's emu_channels
    assert r["timing"]["card_bandwidth_gbps"] == 200.0
    assert r["settings"]["mfu"] == 0.5                        # no mfu in the card: the default


def test_the_cards_mfu_replaces_the_default_and_mfu_on_the_command_line_wins(
        tmp_path, small_trace, capsys):
    card = write_card(tmp_path, plain(timing="ideal", mfu=0.3))
    argv = ["simulate", "--trace", small_trace, "--policy", "odma", "--device", card]
    assert run_json(capsys, argv)["results"][0]["settings"]["mfu"] == 0.3
    assert run_json(capsys, argv + ["--mfu", "0.8"])["results"][0]["settings"]["mfu"] == 0.8


def test_a_probe_timing_is_read_relative_to_the_cards_folder(tmp_path, small_trace, capsys,
                                                           monkeypatch):
    folder = tmp_path / "cards"
    folder.mkdir()
    (folder / "rel.json").write_text(json.dumps({
        "schema": "odma-hw.probe/1",
        "devices": [{"device": "x", "rand_gbps": {"4096": 5.0, "65536": 9.0},
                     "seq_gbps": 10.0, "copy_gbps": 8.0}]}))
    card = write_card(folder, plain(timing="probe:rel.json", bandwidth_gbps=10.0))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)                        # not the card's folder
    assert accelerator(card).timing == f"probe:{folder / 'rel.json'}"
    r = run_json(capsys, ["simulate", "--trace", small_trace, "--policy", "odma",
                          "--device", card])["results"][0]
    assert r["timing"]["source"] == "probe:x"
    assert r["timing"]["run_gbps"]["4096"] == pytest.approx(5.0)
    assert r["timing"]["seq_gbps"] == 10.0


def ideal_card(tmp_path, **extra):
    return load_card(write_card(tmp_path, plain(timing="ideal", **extra)))


def test_ideal_timing_reads_paged_and_contiguous_kv_at_the_same_bandwidth(tmp_path):
    t = make_timing("ideal", 200.0)
    assert isinstance(t, IdealTiming) and t.source == "ideal"
    assert list(t.run_gbps([64, 4096, 1 << 20, 1 << 30])) == [200.0] * 4
    assert float(t.run_gbps(256)) == t.seq_gbps == t.copy_gbps == t.peak_gbps == 200.0
    assert make_timing("ideal", 200.0, check_only=True) is None
    setup = ServingSetup(QWEN, ideal_card(tmp_path), t, max_model_len=4096)
    per_byte = []
    # 1,000 tokens in 63 pages of 16, in two runs of consecutive pages (what nhd merges)
    pages = SimpleNamespace(pages=list(range(63)), runs=lambda: [(0, 40), (100, 23)])
    for layout in ("contiguous", "v06", "hnd", "nhd"):
        timer = StepTimer(setup, layout)
        r = SimpleNamespace()
        timer.linearize(r, 0, 1000, pages)
        assert r.ab == 1000 * setup.kv_bytes_per_token
        per_byte.append((r.a / r.ab, r.slope / r.sb))
    for seconds in per_byte:
        assert seconds == pytest.approx((1 / 200e9, 1 / 200e9))


def test_ideal_timing_gives_odma_and_paged_the_same_kv_time_per_byte(tmp_path, small_trace,
                                                                     capsys):
    path = write_card(tmp_path, plain(timing="ideal"))
    doc = run_json(capsys, ["simulate", "--trace", small_trace, "--policy", "odma,paged",
                            "--device", path])
    for r in doc["results"]:
        assert r["timing"]["source"] == "ideal"
        assert set(r["timing"]["run_gbps"].values()) == {200.0}


# ------------------------------------------------------------------------------ bad cards
def bad_cards():
    """(id, card dict or raw text, extra arguments, key the message must name)."""
    base = plain(timing="ideal")
    cases = []
    for key in REQUIRED:
        cases.append((f"missing-{key}", {k: v for k, v in base.items() if k != key}, [], key))
    for key in NUMBERS:
        cases.append((f"negative-{key}", dict(base, **{key: -1.0}), [], key))
        if CARD_KEYS[key][1] == "positive":
            cases.append((f"zero-{key}", dict(base, **{key: 0}), [], key))
        cases.append((f"nan-{key}", dict(base, **{key: math.nan}), [], key))
        cases.append((f"inf-{key}", dict(base, **{key: math.inf}), [], key))
        cases.append((f"text-{key}", dict(base, **{key: "fast"}), [], key))
        cases.append((f"bool-{key}", dict(base, **{key: True}), [], key))
    cases += [
        ("number-name", dict(base, name=3), [], "name"),
        ("empty-name", dict(base, name=" "), [], "name"),
        ("number-timing", dict(base, timing=1), [], "timing"),
        ("unknown-key", dict(base, bandwidth_tbps=1.0), [], "bandwidth_tbps"),
        ("unknown-timing", dict(base, timing="magic:x"), [], "timing"),
        ("live-timing", dict(base, timing="live:torch:cpu"), [], "timing"),
        ("unknown-emu-preset", dict(base, timing="emu:ddr9"), [], "timing"),
        ("missing-probe-file", dict(base, timing="probe:nowhere.json"), [], "timing"),
        ("channels-without-emu", dict(base, emu_channels=8), [], "emu_channels"),
        ("fractional-channels", dict(base, timing="emu:lpddr5-6400", emu_channels=2.5), [],
         "emu_channels"),
        ("too-many-channels", dict(base, timing="emu:lpddr5-6400", emu_channels=5000), [],
         "emu_channels"),
        ("mfu-above-1", dict(base, mfu=1.5), [], "mfu"),
        ("negative-overhead", dict(base, layer_request_overhead_us=-1), [],
         "layer_request_overhead_us"),
        ("matmul-zero-rows", dict(base, matmul_tflops={"0": 1.0}), [], "matmul_tflops"),
        ("matmul-negative", dict(base, matmul_tflops={"8": -1.0}), [], "matmul_tflops"),
        ("matmul-rows-not-a-number", dict(base, matmul_tflops={"x": 1.0}), [],
         "matmul_tflops"),
        ("matmul-empty", dict(base, matmul_tflops={}), [], "matmul_tflops"),
        ("int8-without-tops", base, ["--dtype", "int8"], "tops_int8"),
        ("fp32-without-tflops", base, ["--dtype", "fp32"], "tflops_fp32"),
        ("bad-toml", "name = \n", [], None),
        ("not-a-table", [1, 2], [], None),
    ]
    return cases


@pytest.mark.parametrize("case", bad_cards(), ids=lambda c: c[0])
@pytest.mark.parametrize("ext", ["toml", "json"])
def test_a_bad_card_exits_2_with_one_line_naming_file_and_key(case, ext, tmp_path, small_trace,
                                                              capsys, monkeypatch):
    name, card, extra, key = case
    if isinstance(card, list) and ext == "toml":
        pytest.skip("a TOML document is always a table")
    path = tmp_path / f"bad.{ext}"
    if isinstance(card, str):
        path.write_text(card if ext == "toml" else "{name: ")
    else:
        path.write_text(json.dumps(card) if ext == "json" else toml_text(card))
    fresh = tmp_path / "fresh-cache"
    monkeypatch.setenv("ODMA_CACHE_DIR", str(fresh))
    try:
        code = main(["simulate", "--trace", small_trace, "--device", str(path)] + extra)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in captured.err + captured.out
    assert f"bad.{ext}" in err
    if key is not None:
        assert repr(key) in err, err
    assert not fresh.exists()                             # the emulator never ran


def test_an_unknown_preset_and_a_missing_file_are_refused(small_trace, capsys, tmp_path):
    assert main(["simulate", "--trace", small_trace, "--device", "tpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--device" in err and "mlu370-x4" in err and len(err.splitlines()) == 1
    missing = str(tmp_path / "none.toml")
    assert main(["simulate", "--trace", small_trace, "--device", missing]) == 2
    err = capsys.readouterr().err.strip()
    assert missing in err and len(err.splitlines()) == 1


def test_a_card_with_the_dtypes_figure_serves_it(tmp_path, small_trace, capsys):
    path = write_card(tmp_path, plain(timing="ideal", tops_int8=128.0, tflops_fp32=16.0,
                                         capacity_gb=80.0))     # fp32 weights: 30 GB
    for dtype in ("int8", "fp32"):
        r = run_json(capsys, ["simulate", "--trace", small_trace, "--policy", "odma",
                              "--device", path, "--dtype", dtype])["results"][0]
        assert r["settings"]["dtype"] == dtype


def test_simulate_without_trace_nor_list_is_one_line(capsys):
    assert main(["simulate"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--trace" in err and len(err.splitlines()) == 1


# ------------------------------------------------------------------------------ --list
def test_list_prints_the_models_and_the_cards(capsys):
    assert main(["simulate", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("deepseek-r1-distill-qwen-7b", "qwen2.5-7b", "tiny-llama", "mlu370-x4",
                 "a100-80gb", "emu:hbm2-2000", "307.2", "mlu370-x4.toml"):
        assert name in out, name


def test_list_json_is_one_object(capsys):
    doc = run_json(capsys, ["simulate", "--list"])
    assert doc["schema"] == "odma-hw.simulate-list/1"
    models = {m["name"]: m for m in doc["models"]}
    assert {"deepseek-r1-distill-qwen-7b", "llama-3-8b", "llama-2-7b", "qwen2.5-7b",
            "tiny-llama"} <= set(models)
    assert models["qwen2.5-7b"]["alias_of"] == "deepseek-r1-distill-qwen-7b"
    cards = {c["name"]: c for c in doc["cards"]}
    assert set(cards) == set(card_names())
    assert cards["mlu370-x4"]["bandwidth_gbps"] == 307.2
    assert cards["a100-80gb"]["timing"] == "emu:hbm2-2000"
    assert cards["a100-80gb"]["path"].endswith("a100-80gb.toml")


# ------------------------------------------------------------------------------ the step model
def test_fp32_doubles_the_kv_bytes_per_token_of_bf16(tmp_path):
    card = ideal_card(tmp_path, tflops_fp32=16.0)
    t = IdealTiming(card.bandwidth_gbps)
    bf16 = ServingSetup(QWEN, card, t, max_model_len=4096)
    fp32 = ServingSetup(QWEN, card, t, dtype="fp32", max_model_len=4096)
    assert bf16.kv_bytes_per_token == QWEN.kv_bytes_per_token
    assert fp32.kv_bytes_per_token == 2 * bf16.kv_bytes_per_token
    assert fp32.weight_bytes == 2 * bf16.weight_bytes
    for layout in ("contiguous", "hnd", "nhd"):
        runs, unit, merge = fp32.run_layout(layout)
        assert (runs, unit // 2, merge) == bf16.run_layout(layout)
    int8 = ServingSetup(QWEN, dataclasses.replace(card, tops_int8=32.0), t, dtype="int8",
                        max_model_len=4096)
    assert int8.kv_bytes_per_token == bf16.kv_bytes_per_token      # KV stays bf16


@pytest.mark.parametrize("nb", [1, 7, 64])
def test_the_layer_request_overhead_adds_layers_x_batch_x_it_per_step(tmp_path, nb):
    base = ideal_card(tmp_path)
    per_launch = dataclasses.replace(base, layer_request_overhead_us=3.0)
    t = IdealTiming(base.bandwidth_gbps)

    def span(card):
        timer = StepTimer(ServingSetup(QWEN, card, t, max_model_len=4096), "contiguous")
        tot = {k: 0.0 for k in ("decode", "kv", "weights", "overheads", "allreduce", "compute",
                                "compute_bound_steps", "steps", "kv_bytes", "batch_seconds")}
        k, secs = timer.decode_span(nb, 0, 10, None, tot)
        return timer, k, secs, tot

    t0, k0, secs0, tot0 = span(base)
    t1, k1, secs1, tot1 = span(per_launch)
    assert k0 == k1 == 10
    extra = QWEN.layers * nb * 3.0e-6
    assert secs1 - secs0 == pytest.approx(k0 * extra)
    assert tot1["overheads"] - tot0["overheads"] == pytest.approx(k0 * extra)
    # the formula: layers x (layer overhead + batch x layer-request overhead)
    # + batch x request overhead
    want = (QWEN.layers * (base.layer_overhead_us + nb * 3.0) + nb * base.request_overhead_us)
    assert t1.overhead_seconds(nb) == pytest.approx(want * 1e-6)
    assert t0.overhead_seconds(nb) == pytest.approx(
        (QWEN.layers * base.layer_overhead_us + nb * base.request_overhead_us) * 1e-6)


def test_a_measured_matmul_table_sets_each_steps_compute_by_its_rows(tmp_path):
    """A CPU's matrix products at one row reach a few percent of their 256-row throughput: with
    a table, a decode step of nb requests computes at nb rows' throughput, a prefill at its
    tokens', and between the table's rows the throughput is interpolated in log rows."""
    table = {"1": 0.5, "16": 4.0, "256": 16.0}
    card = ideal_card(tmp_path, matmul_tflops=table)
    assert card.matmul_tflops == ((1, 0.5), (16, 4.0), (256, 16.0))
    again = load_card(write_card(tmp_path, plain(timing="ideal", matmul_tflops=table),
                                 name="card.json"))
    assert again.matmul_tflops == card.matmul_tflops
    timer = StepTimer(ServingSetup(QWEN, card, IdealTiming(card.bandwidth_gbps),
                                   max_model_len=4096), "contiguous")
    peak = card.tflops_bf16
    assert timer.efficiency(1) == pytest.approx(0.5 / peak)
    assert timer.efficiency(4) == pytest.approx((0.5 + 0.5 * (4.0 - 0.5)) / peak)
    assert timer.efficiency(4096) == pytest.approx(16.0 / peak)     # beyond: the nearest end
    for nb in (1, 16):
        _, _, _, f0, _ = timer._decode_lines(nb)
        assert f0 == pytest.approx(nb * timer.flops_per_request / (table[str(nb)] * 1e12))
    secs, flops, _ = timer.prefill([(256, 0)])
    assert secs >= flops / 16e12
    plain_timer = StepTimer(ServingSetup(QWEN, ideal_card(tmp_path), IdealTiming(200.0),
                                         max_model_len=4096), "contiguous")
    assert plain_timer.efficiency(1) == plain_timer.efficiency(256) == 0.5     # the MFU
