"""Card files (`odma-hw simulate --card CARD`): the presets are files with the numbers they
always had, a user's TOML or JSON card serves as a preset does, every timing source a card may
name works, every bad card is refused in one line before any work, and `simulate --list`."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from allocator.serving.cards.datafile import Range
from allocator.serving.cards.presets import (CARD_DIR, CARD_KEYS, LAYER_OVERHEAD_US,
                                             REQUEST_OVERHEAD_US, accelerator, card_names,
                                             load_card, model_spec)
from allocator.serving.sim.replica import ServingSetup
from allocator.serving.sim.steptime import StepTimer
from allocator.serving.sim.timing import IdealTiming, make_timing
from odma_cli.main import main

QWEN = model_spec("deepseek-r1-distill-qwen-7b")

# the numbers the presets had when they were written in presets.py (the A100's capacity since
# then what CUDA reports, 80 GiB less the driver's share, not the datasheet's 80)
PRESETS = {
    "mlu370-x4": dict(bandwidth_gbps=307.2, capacity_gb=24.0, tflops_bf16=96.0, tops_int8=256.0,
                      timing="emu:mlu370-x4", emu_channels=None, link_gbps=32.0,
                      link_latency_us=10.0, layer_overhead_us=40.0, request_overhead_us=50.0,
                      source_starts="24 GB LPDDR5, 384 bit x 6400 MT/s = 307.2 GB/s"),
    "a100-80gb": dict(bandwidth_gbps=2039.0, capacity_gb=85.1, tflops_bf16=312.0,
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

NUMBERS = [k for k in REQUIRED if isinstance(CARD_KEYS[k][1], Range)]


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
def test_the_h100_preset_holds_the_memory_a_calibration_on_an_h100_found():
    """Capacity is what the device reports, as calibrate writes it and as vLLM's
    --gpu-memory-utilization takes it: the preset and the card calibrated on the H100 of
    2026-11-26 agree (the datasheet's 80 is GiB: a pool 5 GB short at 0.9)."""
    import pathlib

    measured = load_card(str(pathlib.Path(__file__).parents[1] / "bench" / "results"
                             / "h100-2026-11-26-run4" / "card.toml"))
    for name in ("h100-sxm", "h100-sxm-emu"):
        assert accelerator(name).capacity_gb == pytest.approx(measured.capacity_gb, abs=0.01)


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


# ------------------------------------------------------------------------------ cards from measurements
def test_h100_sxm_reads_the_h100_probe_shipped_beside_it_with_its_provenance():
    card = accelerator("h100-sxm")
    probe = CARD_DIR / "h100-sxm.probe.json"
    assert card.timing == f"probe:{probe}" and card.emu_channels is None
    doc = json.loads(probe.read_text())
    prov = doc["provenance"]
    assert prov["card"].startswith("h100-sxm") and prov["date"] == "2026-11-26"
    assert prov["command"].startswith("odma-hw probe --device cuda:0 --json")
    assert "64e2cb4b76762e70893b0b9d77d7aa615556f75bc8c60cdf2f53b6ba429c7299" in prov["copied_from"]
    (entry,) = doc["devices"]
    assert entry["name"] == "NVIDIA H100 80GB HBM3" and entry["verdict"] == "racm"
    # the timing is the measurement, in GB/s as measured: streaming 3,059 GB/s, 32 B runs at
    # 0.34 of it, 4 KiB runs at full speed (1.04, capped at streaming)
    timing = make_timing(card.timing, card.bandwidth_gbps)
    assert timing.seq_gbps == pytest.approx(3058.73, abs=0.01)
    assert float(timing.run_gbps(32)) / timing.seq_gbps == pytest.approx(0.3415, abs=1e-3)
    assert float(timing.run_gbps(4096)) == pytest.approx(timing.seq_gbps)
    assert "probe:h100-sxm.probe.json" in card.source and "2026-11-26" in card.source


def test_the_emulated_h100_stays_selectable_with_the_numbers_it_had():
    emu, measured = accelerator("h100-sxm-emu"), accelerator("h100-sxm")
    assert (emu.timing, emu.emu_channels) == ("emu:hbm2-2000", 131)
    same = {f.name for f in dataclasses.fields(emu)} - {"name", "timing", "emu_channels",
                                                        "source", "path"}
    assert {k: getattr(emu, k) for k in same} == {k: getattr(measured, k) for k in same}
    assert (emu.bandwidth_gbps, emu.tflops_bf16, emu.link_gbps) == (3350.0, 989.4, 450.0)


@pytest.mark.parametrize("name", card_names())
def test_every_preset_card_says_which_timing_source_it_uses_and_an_emulated_one_why(name):
    card = accelerator(name)
    if card.timing.startswith("probe:"):
        assert f"probe:{card.timing.rsplit('/', 1)[-1]}" in card.source
    else:
        assert card.timing in card.source                     # emu:hbm2-2000, emu:mlu370-x4
        if name in ("h200", "a100-40gb", "a100-80gb", "a100-80gb-pcie"):
            assert "Why emulated: no" in card.source and "has been measured" in card.source


def test_every_file_a_preset_card_reads_ships_with_the_package():
    try:
        import tomllib
    except ModuleNotFoundError:                               # Python 3.10
        import tomli as tomllib
    import fnmatch
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["allocator.serving.cards"]
    needed = {pathlib.Path(load_card(CARD_DIR / f"{n}.toml").path).name for n in card_names()}
    needed |= {pathlib.Path(c.timing.partition(":")[2]).name
               for c in map(accelerator, card_names()) if c.timing.startswith("probe:")}
    assert "h100-sxm.probe.json" in needed
    for name in needed:
        assert any(fnmatch.fnmatch(name, g) for g in globs), name


def test_simulate_on_h100_sxm_times_the_kv_by_the_measured_probe(small_trace, capsys):
    r = run_json(capsys, ["simulate", "--trace", small_trace, "--policy", "odma",
                          "--device", "h100-sxm", "--model", "qwen2.5-0.5b"])["results"][0]
    assert r["timing"]["source"] == "probe:cuda:0"
    assert r["timing"]["seq_gbps"] == pytest.approx(3058.73, abs=0.01)


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


def test_a_card_from_a_pipe_serves_as_the_same_file_does(tmp_path, small_trace, capsys):
    """`--card <(...)`: the card is read when the arguments are checked and again where it is
    used, and a pipe gives its bytes once."""
    import os

    argv = ["simulate", "--trace", small_trace, "--policy", "odma,paged", "--card"]
    by_file = run_json(capsys, argv + [write_card(tmp_path, CARD, "card.toml")])
    read, write = os.pipe()
    try:
        os.write(write, toml_text(CARD).encode())
        os.close(write)
        by_pipe = run_json(capsys, argv + [f"/dev/fd/{read}"])
    finally:
        os.close(read)
    assert comparable(by_pipe) == comparable(by_file)
    assert by_pipe["results"][0]["settings"]["device"] == "test-card"


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
        assert r.kv_bytes_at_0 == 1000 * setup.kv_bytes_per_token
        per_byte.append((r.kv_seconds_at_0 / r.kv_bytes_at_0,
                         r.kv_seconds_per_step / r.kv_bytes_per_step))
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
        if 0 not in CARD_KEYS[key][1]:
            cases.append((f"zero-{key}", dict(base, **{key: 0}), [], key))
        cases.append((f"nan-{key}", dict(base, **{key: math.nan}), [], key))
        cases.append((f"inf-{key}", dict(base, **{key: math.inf}), [], key))
        cases.append((f"text-{key}", dict(base, **{key: "fast"}), [], key))
        cases.append((f"digits-{key}", dict(base, **{key: "5"}), [], key))
        cases.append((f"bool-{key}", dict(base, **{key: True}), [], key))
        # an integer no float holds, and numbers whose times would print 300 digits
        cases.append((f"huge-integer-{key}", dict(base, **{key: 10 ** 400}), [], key))
        cases.append((f"huge-{key}", dict(base, **{key: 1e300}), [], key))
        if 0 not in CARD_KEYS[key][1]:
            cases.append((f"tiny-{key}", dict(base, **{key: 1e-300}), [], key))
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
        ("negative-step-overhead", dict(base, step_overhead_us=-5.0), [], "step_overhead_us"),
        ("engine-reads-one-run", dict(base, engine_run_gbps={"4096": 10.0}), [],
         "engine_run_gbps"),
        ("engine-reads-zero-rate", dict(base, engine_run_gbps={"32": 0.0, "4096": 10.0}), [],
         "engine_run_gbps"),
        ("engine-reads-zero-bytes", dict(base, engine_run_gbps={"0": 1.0, "4096": 10.0}), [],
         "engine_run_gbps"),
        ("engine-reads-not-a-table", dict(base, engine_run_gbps=12.0), [], "engine_run_gbps"),
        ("matmul-zero-rows", dict(base, matmul_tflops={"0": 1.0}), [], "matmul_tflops"),
        ("matmul-negative", dict(base, matmul_tflops={"8": -1.0}), [], "matmul_tflops"),
        ("matmul-rows-not-a-number", dict(base, matmul_tflops={"x": 1.0}), [],
         "matmul_tflops"),
        ("matmul-empty", dict(base, matmul_tflops={}), [], "matmul_tflops"),
        ("matmul-one-row", dict(base, matmul_tflops={"256": 10.0}), [], "matmul_tflops"),
        ("matmul-duplicate-row", dict(base, matmul_tflops={"1": 1.0, "01": 2.0}), [],
         "matmul_tflops"),
        ("matmul-text-value", dict(base, matmul_tflops={"1": "5", "8": 1.0}), [],
         "matmul_tflops"),
        ("matmul-bool-value", dict(base, matmul_tflops={"1": True, "8": 1.0}), [],
         "matmul_tflops"),
        ("matmul-huge-value", dict(base, matmul_tflops={"1": 10 ** 400, "8": 1.0}), [],
         "matmul_tflops"),
        ("matmul-underscore-key", dict(base, matmul_tflops={"1_000": 1.0, "8": 1.0}), [],
         "matmul_tflops"),
        ("matmul-signed-key", dict(base, matmul_tflops={"+5": 1.0, "8": 1.0}), [],
         "matmul_tflops"),
        ("matmul-spaced-key", dict(base, matmul_tflops={" 7 ": 1.0, "8": 1.0}), [],
         "matmul_tflops"),
        ("matmul-huge-key", dict(base, matmul_tflops={"1" + "0" * 30: 1.0, "8": 1.0}), [],
         "matmul_tflops"),
        ("layer-matmul-alone", dict(base, layer_matmul_tflops={"1": 1.0, "8": 2.0}), [],
         "layer_matmul_tflops"),
        ("layer-matmul-one-row", dict(base, matmul_tflops={"1": 1.0, "8": 2.0},
                                      layer_matmul_tflops={"8": 2.0}), [], "layer_matmul_tflops"),
        ("layer-matmul-negative", dict(base, matmul_tflops={"1": 1.0, "8": 2.0},
                                       layer_matmul_tflops={"1": 1.0, "8": -2.0}), [],
         "layer_matmul_tflops"),
        ("mfu-tiny", dict(base, mfu=1e-300), [], "mfu"),
        ("huge-overhead", dict(base, layer_overhead_us=1e300), [], "layer_overhead_us"),
        ("huge-integer-channels", dict(base, timing="emu:lpddr5-6400", emu_channels=10 ** 400),
         [], "emu_channels"),
        ("int8-without-tops", base, ["--dtype", "int8"], "tops_int8"),
        ("unknown-dtype", dict(base, dtype="int4"), [], "dtype"),
        ("dtype-without-its-peak", dict(base, dtype="fp32"), [], "tflops_fp32"),
        ("dtype-not-text", dict(base, dtype=16), [], "dtype"),
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
    err = refused_in_one_line(["simulate", "--trace", small_trace, "--device", str(path)] + extra,
                              capsys, f"bad.{ext}")
    if key is not None:
        assert repr(key) in err, err
    assert not fresh.exists()                             # the emulator never ran


def test_a_cards_dtype_without_its_peak_is_refused_when_the_card_is_read(tmp_path):
    """Not later, as a --dtype the user never gave (--dtype auto takes the card's)."""
    from odma_cli.errors import BadArgument

    with pytest.raises(BadArgument, match=r"'dtype' fp32 .* needs 'tflops_fp32' beside it"):
        load_card(write_card(tmp_path, plain(dtype="fp32")))
    assert load_card(write_card(tmp_path, plain(dtype="fp32", tflops_fp32=10.0))).dtype == "fp32"


def refused_in_one_line(argv, capsys, *names) -> str:
    """Run simulate's `argv`: exit 2, one line on stderr that names each of `names`."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in captured.err + captured.out
    for name in names:
        assert name in err, (name, err)
    return err


# text a dict cannot make: a float literal beyond any float, a key twice, nesting no parser
# recurses through, a file far larger than any card
RAW_CARDS = {
    "toml-1e400": ("toml", toml_text(plain(timing="ideal", bandwidth_gbps=7.0)).replace(
        "7.0", "1e400"), "'bandwidth_gbps'"),
    "json-1e400": ("json", json.dumps(plain(timing="ideal", bandwidth_gbps=7.0)).replace(
        "7.0", "1e400"), "'bandwidth_gbps'"),
    "json-key-twice": ("json", json.dumps(plain(timing="ideal"))[:-1]
                       + ', "matmul_tflops": {"1": 1.0, "1": 2.0}}', "duplicate key '1'"),
    "toml-nested": ("toml", "source = " + "[" * 50000 + "]" * 50000 + "\n", "nested too deep"),
    "json-nested": ("json", "[" * 50000 + "]" * 50000, "nested too deep"),
    "huge-file": ("toml", "# " + "x" * (2 << 20) + "\n", "MiB"),
}


@pytest.mark.parametrize("name", sorted(RAW_CARDS))
def test_card_text_beyond_a_dicts_is_refused_in_one_line(name, tmp_path, small_trace, capsys):
    ext, text, says = RAW_CARDS[name]
    path = tmp_path / f"raw.{ext}"
    path.write_text(text)
    refused_in_one_line(["simulate", "--trace", small_trace, "--device", str(path)], capsys,
                        f"raw.{ext}", says)


GOOD_PROBE = {"device": "x", "rand_gbps": {"64": 2.0, "4096": 5.0, "65536": 9.0},
              "seq_gbps": 10.0, "copy_gbps": 8.0}


def bad_probes():
    """(id, device entry or raw text of the file, the key the message must name)."""
    cases = []
    for key in ("seq_gbps", "copy_gbps"):
        for label, value in (("true", True), ("digits", "5"), ("zero", 0), ("negative", -1.0),
                             ("huge-integer", 10 ** 400), ("huge", 1e300), ("tiny", 1e-300),
                             ("nan", math.nan), ("list", [5.0])):
            cases.append((f"{label}-{key}", dict(GOOD_PROBE, **{key: value}), key))
    for label, table in (("zero-size", {"0": 5.0}), ("negative-size", {"-64": 5.0}),
                         ("signed-size", {"+64": 5.0}), ("padded-size", {"064": 5.0}),
                         ("spaced-size", {" 64": 5.0}), ("underscore-size", {"6_4": 5.0}),
                         ("fraction-size", {"64.5": 5.0}), ("huge-size", {"9" * 30: 5.0}),
                         ("text-value", {"64": "5"}), ("true-value", {"64": True}),
                         ("huge-value", {"64": 10 ** 400}), ("empty", {}), ("list", [5.0])):
        cases.append((f"rand-{label}", dict(GOOD_PROBE, rand_gbps=table), "rand_gbps"))
    for key in ("rand_gbps", "seq_gbps"):
        cases.append((f"missing-{key}", {k: v for k, v in GOOD_PROBE.items() if k != key},
                      key))
    probe = json.dumps({"schema": "odma-hw.probe/1", "devices": [dict(GOOD_PROBE,
                                                                      copy_gbps=7.0)]})
    cases.append(("copy-1e400", probe.replace("7.0", "1e400"), "copy_gbps"))
    cases.append(("seq-1e400", probe.replace("10.0", "1e400"), "seq_gbps"))
    cases.append(("rand-key-twice", probe.replace('"4096"', '"64"'), "duplicate key '64'"))
    cases.append(("devices-not-a-list", json.dumps({"schema": "odma-hw.probe/1",
                                                    "devices": {"x": GOOD_PROBE}}), "devices"))
    return cases


@pytest.mark.parametrize("case", bad_probes(), ids=lambda c: c[0])
@pytest.mark.parametrize("via", ["card", "--timing"])
def test_a_bad_probe_file_exits_2_with_one_line_naming_file_and_key(case, via, tmp_path,
                                                                    small_trace, capsys):
    name, entry, key = case
    probe = tmp_path / "p.json"
    probe.write_text(entry if isinstance(entry, str) else json.dumps(
        {"schema": "odma-hw.probe/1", "devices": [entry]}))
    if via == "card":
        argv = ["--device", write_card(tmp_path, plain(timing="probe:p.json"))]
    else:
        argv = ["--device", write_card(tmp_path, plain(timing="ideal")),
                "--timing", f"probe:{probe}"]
    refused_in_one_line(["simulate", "--trace", small_trace] + argv, capsys, "p.json", key)


def test_a_good_probe_file_without_copy_gbps_streams_its_copies(tmp_path, small_trace,
                                                               capsys):
    (tmp_path / "p.json").write_text(json.dumps({
        "schema": "odma-hw.probe/1",
        "devices": [{k: v for k, v in GOOD_PROBE.items() if k != "copy_gbps"}]}))
    card = write_card(tmp_path, plain(timing="probe:p.json"))
    r = run_json(capsys, ["simulate", "--trace", small_trace, "--policy", "odma",
                          "--device", card])["results"][0]
    assert r["timing"]["copy_gbps"] == r["timing"]["seq_gbps"] == 10.0


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


def test_dtype_auto_serves_the_type_a_card_was_measured_at_else_bf16(tmp_path, small_trace,
                                                                     capsys):
    """--dtype auto (the default) is the card's `dtype`, which calibrate writes; a card without
    one serves bf16. Each card of a run takes its own."""
    measured = write_card(tmp_path, plain(name="cpu-card", timing="ideal", tflops_fp32=16.0,
                                          capacity_gb=80.0, dtype="float32"))
    doc = run_json(capsys, ["simulate", "--trace", small_trace, "--policy", "odma",
                            "--card", f"{measured},a100-80gb"])
    assert {r["settings"]["device"]: r["settings"]["dtype"] for r in doc["results"]} == {
        "cpu-card": "fp32", "a100-80gb": "bf16"}
    doc = run_json(capsys, ["simulate", "--trace", small_trace, "--policy", "odma",
                            "--card", measured, "--dtype", "bf16"])
    assert doc["results"][0]["settings"]["dtype"] == "bf16"      # named, it wins


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


def test_the_step_overhead_is_paid_once_a_step_whatever_its_batch_and_depth(tmp_path):
    base = ideal_card(tmp_path)
    t = IdealTiming(base.bandwidth_gbps)
    setup = ServingSetup(QWEN, base, t, max_model_len=4096)
    plus = ServingSetup(QWEN, dataclasses.replace(base, step_overhead_us=700.0), t,
                        max_model_len=4096)
    for nb in (1, 9):
        assert (StepTimer(plus, "contiguous").overhead_seconds(nb)
                - StepTimer(setup, "contiguous").overhead_seconds(nb)) == pytest.approx(700e-6)
    assert (StepTimer(plus, "contiguous").prefill([(100, 0)])[0]
            - StepTimer(setup, "contiguous").prefill([(100, 0)])[0]) == pytest.approx(700e-6)


def test_a_prompt_piece_after_cached_tokens_pays_the_chunk_term_per_layer(tmp_path):
    """chunk_layer_overhead_us: per layer, for each piece of a prompt that starts after tokens
    in the cache (a later chunk, a prompt after its cached prefix), in a prefill and in a
    chunked step alike; a prompt's first piece does not pay it."""
    base = ideal_card(tmp_path)
    t = IdealTiming(base.bandwidth_gbps)
    plain = StepTimer(ServingSetup(QWEN, base, t, max_model_len=4096), "contiguous")
    plus = StepTimer(ServingSetup(QWEN, dataclasses.replace(base, chunk_layer_overhead_us=10.0),
                                  t, max_model_len=4096), "contiguous")
    per_piece = QWEN.layers * 10e-6
    for parts, pieces in (([(100, 0)], 0), ([(300, 200)], 1), ([(100, 0), (300, 200)], 1),
                          ([(64, 32), (300, 200)], 2)):
        assert plus.prefill(parts)[0] - plain.prefill(parts)[0] == pytest.approx(
            pieces * per_piece)
    for timer in (plain, plus):          # two requests decoding at 500 tokens
        for _ in range(2):
            r = SimpleNamespace()
            timer.linearize(r, 0, 500, None)
            timer.add(r, +1)
    for chunks, pieces in (([(0, 128)], 0), ([(256, 128)], 1), ([(0, 64), (256, 128)], 1)):
        got = [timer.mixed_step(2, 0, chunks, collections.defaultdict(float))
               for timer in (plus, plain)]
        assert got[0] - got[1] == pytest.approx(pieces * per_piece)


def test_the_engines_read_table_prices_the_kv_in_place_of_the_memorys(tmp_path):
    """A card with engine_run_gbps reads each request's KV runs at the table's rate for their
    size (interpolated in log size), the memory's timing still reading the weights."""
    base = ideal_card(tmp_path)
    t = IdealTiming(base.bandwidth_gbps)
    table = ((64, 1.0), (65536, 4.0))
    engine = dataclasses.replace(base, engine_run_gbps=table)

    def kv_seconds(card, layout, ctx):
        timer = StepTimer(ServingSetup(QWEN, card, t, max_model_len=4096), layout)
        r = SimpleNamespace()
        blk = SimpleNamespace(pages=list(range(-(-ctx // 16))),
                              runs=lambda: [(0, 1)] * -(-ctx // 16))
        timer.linearize(r, 0, ctx, blk)
        return r.kv_seconds_at_0, timer
    ctx = 1024
    secs, timer = kv_seconds(engine, "contiguous", ctx)
    run = ctx * timer.run_unit_bytes
    rate = float(np.interp(np.log2(run), np.log2([64, 65536]), [1.0, 4.0]))
    assert secs == pytest.approx(timer.runs_per_unit * run / (rate * 1e9))
    assert timer.w_seconds == pytest.approx(
        ServingSetup(QWEN, base, t, max_model_len=4096).weight_bytes / (t.seq_gbps * 1e9))
    ideal, _ = kv_seconds(base, "contiguous", ctx)
    assert secs > 2 * ideal                     # 4 GB/s at most, where ideal reads at full
    # pages: runs of a page, slower than the whole context's in the table
    paged, _ = kv_seconds(engine, "hnd", ctx)
    assert paged > secs


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
        _, compute, _ = timer.decode_terms(nb, 0)
        assert compute == pytest.approx(nb * timer.flops_per_request / (table[str(nb)] * 1e12))
    secs, flops, _ = timer.prefill([(256, 0)])
    assert secs >= flops / 16e12
    plain_timer = StepTimer(ServingSetup(QWEN, ideal_card(tmp_path), IdealTiming(200.0),
                                         max_model_len=4096), "contiguous")
    assert plain_timer.efficiency(1) == plain_timer.efficiency(256) == 0.5     # the MFU


def test_a_prompts_tokens_go_through_the_layers_at_their_rate_and_only_its_last_through_the_head(
        tmp_path):
    """With the layers' products measured apart (layer_matmul_tflops), a prompt step's tokens
    run through the layers at their row count's rate and each sequence's last token through
    the LM head, whose time is the whole set's less the layers' at that row count: a slow head
    then costs a prompt step one row, where the whole set's rate charged it to every token."""
    whole = {"1": 0.5, "16": 4.0, "256": 8.0}
    layers = {"1": 0.6, "16": 5.0, "256": 12.0, "2048": 16.0}
    card = ideal_card(tmp_path, matmul_tflops=whole, layer_matmul_tflops=layers)
    assert card.layer_matmul_tflops == ((1, 0.6), (16, 5.0), (256, 12.0), (2048, 16.0))
    t = StepTimer(ServingSetup(QWEN, card, IdealTiming(card.bandwidth_gbps),
                               max_model_len=4096), "contiguous")
    layer_row = t.layer_flops
    assert layer_row == pytest.approx(2.0 * (QWEN.streamed_params - QWEN.vocab * QWEN.hidden))

    def head(rows):      # the whole set's time less the layers', at `rows` rows
        return rows * (t.flops_per_request / (float(whole[str(rows)]) * 1e12)
                       - layer_row / (float(layers[str(rows)]) * 1e12))
    for rows, heads in ((256, 1), (2048, 16), (4096, 1)):
        got, rate = t.prompt_products(rows, heads)
        at = float(layers[str(min(rows, 2048))]) * 1e12       # beyond the table: its end
        assert rate == pytest.approx(at)
        assert got == pytest.approx(rows * layer_row / at + head(heads))
    # a prompt of 256 tokens: the head once, at one row; the old pricing (no layer table) ran
    # every product of the step at the whole set's 256-row rate
    without = StepTimer(ServingSetup(QWEN, ideal_card(tmp_path, matmul_tflops=whole),
                                     IdealTiming(card.bandwidth_gbps), max_model_len=4096),
                        "contiguous")
    flops = QWEN.prefill_flops(256) - QWEN.prefill_attention_flops(256)
    assert without.prompt_products(256, 1)[0] == pytest.approx(flops / 8e12)
    assert t.prompt_products(256, 1)[0] < 0.75 * flops / 8e12
    # decode steps are unchanged: every token goes through the layers and the head
    assert t.decode_terms(16, 0)[1] == pytest.approx(without.decode_terms(16, 0)[1])
    # a chunked step: its decodes and its chunk through the layers, a row each of them
    # through the head
    for _ in range(16):
        r = SimpleNamespace()
        t.linearize(r, 0, 100, None)
        t.add(r, +1)
    calls = []
    real = t.prompt_products
    t.prompt_products = lambda rows, heads: calls.append((rows, heads)) or real(rows, heads)
    t.mixed_step(16, 0, [(0, 240)], collections.defaultdict(float))
    assert calls == [(16 + 240, 16 + 1)]


def test_a_steps_products_and_attention_each_take_their_own_roofline(tmp_path):
    """An engine runs a layer's products, then its attention: where the products are
    compute-bound (a CPU at a few rows) and the attention waits on the KV, the step takes the
    sum of the two, not the larger of the step's whole reads and whole FLOPs; where both are
    memory-bound (a GPU's decode) the two are the same."""
    def floor(table, context, nb=16):
        # a CPU's engine: its products at the table's rate, its attention reading at 20 GB/s
        card = (ideal_card(tmp_path, matmul_tflops=table,
                           engine_run_gbps={"64": 20.0, "1048576": 20.0})
                if table else ideal_card(tmp_path))
        timer = StepTimer(ServingSetup(QWEN, card, IdealTiming(card.bandwidth_gbps),
                                       max_model_len=context + 1), "contiguous")
        for _ in range(nb):
            r = SimpleNamespace()
            timer.linearize(r, 0, context, None)
            timer.add(r, +1)
        memory, compute, step = timer.decode_terms(nb, 0)
        kv = memory - timer.w_seconds
        attention = timer.flops_per_ctx * nb * context / (timer.card_flops
                                                          * timer.efficiency(nb))
        return memory, compute, step, kv, attention, timer

    slow = {"1": 0.1, "16": 2.0, "256": 4.0}     # TFLOPS: 16 rows compute-bound
    memory, compute, step, kv, attention, timer = floor(slow, 2048)
    products = compute - attention
    assert products > timer.w_seconds and kv > attention          # the CPU's case
    assert step == pytest.approx(products + kv)
    assert step > max(memory, compute) * 1.2                       # the old floor hid the KV
    memory, compute, step, *_ = floor(None, 2048)                 # MFU 0.5: memory-bound
    assert memory > compute and step == pytest.approx(memory)


# ------------------------------------------------------------------------------ fuzzed files
# Values of every kind a card or a probe file might hold by mistake. 1.2345e300 stands for the
# literal 1e400 (no float holds it, so no dict can): the writer swaps it in.
FUZZ_VALUES = [0, 1, -1, 0.5, 2.0, 1e-3, 1e6, 1e6 + 1, 1e-300, 1e300, 10 ** 400, -(10 ** 400),
               1.2345e300, math.nan, math.inf, True, False, "5", "", "x" * 500, [], [1.0], {},
               {"1": 1.0}, None]
FUZZ_KEYS = ["1", "8", "64", "256", "4096", "0", "-64", "+5", "01", " 7 ", "1_000", "1.5",
             "16777216", "16777217", "9" * 30, "\u0663", "", "x"]
FUZZ_CASES = 300


def _fuzz_value(rng):
    if rng.random() < 0.15:                     # a table of fuzzed keys and values
        return {rng.choice(FUZZ_KEYS): rng.choice(FUZZ_VALUES + [1.0, 4.0])
                for _ in range(rng.randint(0, 4))}
    return rng.choice(FUZZ_VALUES)


def _fuzz_mutate(rng, doc: dict, keys: list) -> None:
    for _ in range(rng.randint(0, 3)):
        what = rng.random()
        if what < 0.6:
            doc[rng.choice(keys)] = _fuzz_value(rng)
        elif what < 0.85 and doc:
            doc.pop(rng.choice(sorted(doc)))
        else:
            doc[rng.choice(["bandwidth_tbps", "x", ""])] = _fuzz_value(rng)


def _fuzz_text(doc, ext: str) -> str:
    text = json.dumps(doc) if ext == "json" else toml_text(doc)
    return text.replace("1.2345e+300", "1e400")


def _fuzz_files(rng, folder) -> list[str]:
    """A card file (and the probe file it may name) in `folder`; the simulate arguments that
    read them."""
    timing = rng.choice(["ideal", "probe:p.json", "emu:lpddr5-6400"])
    card = plain(timing=timing)
    if rng.random() < 0.5:
        card["matmul_tflops"] = {"1": 0.5, "16": 4.0, "256": 16.0}
    for key in ("mfu", "layer_overhead_us", "request_overhead_us", "tflops_fp32"):
        if rng.random() < 0.2:
            card[key] = rng.choice([0.5, 10.0])
    _fuzz_mutate(rng, card, list(CARD_KEYS))
    if isinstance(card.get("matmul_tflops"), dict) and rng.random() < 0.5:
        _fuzz_mutate(rng, card["matmul_tflops"], FUZZ_KEYS)
    ext = rng.choice(["toml", "json"])
    path = folder / f"card.{ext}"
    path.write_text(_fuzz_text(card, ext))
    entry = json.loads(json.dumps(GOOD_PROBE))
    _fuzz_mutate(rng, entry, ["rand_gbps", "seq_gbps", "copy_gbps", "device"])
    if isinstance(entry.get("rand_gbps"), dict) and rng.random() < 0.5:
        _fuzz_mutate(rng, entry["rand_gbps"], FUZZ_KEYS)
    (folder / "p.json").write_text(_fuzz_text({"schema": "odma-hw.probe/1",
                                               "devices": [entry]}, "json"))
    argv = ["--device", str(path)]
    if rng.random() < 0.15:
        argv += ["--timing", f"probe:{folder / 'p.json'}"]
    return argv


def test_fuzzed_cards_and_probe_files_end_in_0_2_or_3_and_never_a_traceback(
        tmp_path, small_trace, capsys):
    """A fixed seed: the same cases every run. Each simulate ends in exit 0, or 2 / 3 with one
    line on stderr, and the engine's reading of the card (`engine --card`: the extent knee it
    gives, computed before any weights are built) in a knee or an OdmaError of one line; every
    case that does otherwise is collected, so one run lists them all."""
    import random

    from allocator.serving.engine.cli import card_knee
    from odma_cli.errors import OdmaError

    rng = random.Random(20261127)
    failures, codes = [], []
    for case in range(FUZZ_CASES):
        folder = tmp_path / str(case)
        folder.mkdir()
        files = _fuzz_files(rng, folder)
        argv = ["simulate", "--trace", small_trace, "--policy", "odma", "--json"] + files
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        except Exception as exc:    # noqa: BLE001 - any escape is what this test looks for
            capsys.readouterr()
            failures.append(f"{folder}: {type(exc).__name__}: {exc}"[:300])
            continue
        err = capsys.readouterr().err.strip()
        codes.append(code)
        if code not in (0, 2, 3) or (code != 0 and len(err.splitlines()) != 1):
            failures.append(f"{folder}: exit {code}: {err[-300:]!r}")
        try:
            card_knee(files[1], 256, 4096)
        except OdmaError as exc:
            if len(str(exc).splitlines()) != 1:
                failures.append(f"{folder}: engine --card: {exc}"[:300])
        except Exception as exc:    # noqa: BLE001
            failures.append(f"{folder}: engine --card: {type(exc).__name__}: {exc}"[:300])
    assert not failures, f"{len(failures)} of {FUZZ_CASES} cases:\n" + "\n".join(failures)
    assert 0 in codes and 2 in codes                # some cards served, some refused


@pytest.mark.parametrize("measured", ["NVIDIA A100-SXM4-40GB", None])
def test_a_card_whose_probe_file_is_of_another_device_exits_2(measured, tmp_path, small_trace,
                                                               capsys):
    """A card that names its hardware (device_name) refuses a probe file measured on other
    hardware, or on hardware it cannot tell, in one line naming the card, the key and the file,
    before any work; the same card with its own device's probe serves."""
    entry = dict(GOOD_PROBE, **({"name": measured} if measured else {}))
    (tmp_path / "p.json").write_text(json.dumps({"schema": "odma-hw.probe/1",
                                                  "devices": [entry]}))
    card = write_card(tmp_path, plain(timing="probe:p.json", bandwidth_gbps=10.0,
                                      device_name="NVIDIA H100 80GB HBM3"))
    argv = ["simulate", "--trace", small_trace, "--policy", "odma", "--device", card]
    refused_in_one_line(argv, capsys, "device_name", "p.json")
    entry["name"] = "nvidia h100 80GB HBM3 "           # the driver's name, case and spaces aside
    (tmp_path / "p.json").write_text(json.dumps({"schema": "odma-hw.probe/1",
                                                  "devices": [entry]}))
    assert run_json(capsys, argv)["results"][0]["timing"]["source"] == "probe:x"


def test_the_h100_card_names_the_device_its_probe_measured():
    card = accelerator("h100-sxm")
    probe = json.loads((CARD_DIR / "h100-sxm.probe.json").read_text())
    assert card.device_name == probe["devices"][0]["name"] == "NVIDIA H100 80GB HBM3"


def test_a_card_file_with_a_comma_in_its_name_is_one_card(tmp_path, small_trace, capsys):
    path = write_card(tmp_path, CARD, "a,b.toml")
    doc = run_json(capsys, ["simulate", "--trace", small_trace, "--policy", "odma", "--card",
                            path])
    assert {r["settings"]["device"] for r in doc["results"]} == {"test-card"}
