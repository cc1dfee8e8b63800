"""What `odma-hw engine` (and, where they share a rule, simulate, calibrate and replay) makes of
inputs that are not what it expects: a model config, its weights, a trace row, an option no
policy uses, a pool too small for one policy, a run or a check that fails.

Specification:
- a config.json is checked once, by one function, for all three commands that read one, before
  any weight exists: counts whole and positive, heads in whole groups, a positive epsilon and
  rope base, known activation and rope type (the engine's transformers), no sliding window the
  engine would ignore; the model and its KV pool must fit the device's free memory;
- weights are safetensors files whose headers read, with no tensor in two files, none that is
  not floating point or not finite, and a tied LM head that is the embedding;
- a prompt of 0 tokens is refused, row named, by every command, before any work;
- an option no policy of the run uses is refused; a card that is not there is refused;
- a policy whose pool cannot hold one request is refused before any weight is built; a policy
  that fails at run time leaves the others' results printed, and exit 3;
- a --check that finds mismatches (non-finite logits among them: NaN equals nothing) prints the
  results and exits 3;
- what a run used that its options do not say (--clip's dropped requests, hf's own KV cache) is
  said.
Every refusal is exit 2 with one line on stderr; no input ends in a traceback.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct
import subprocess
import sys
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from allocator.serving import models  # noqa: E402
from allocator.serving.cards import cli as calibrate_module  # noqa: E402
from allocator.serving.cards.presets import model_from_config  # noqa: E402
from allocator.serving.engine import serve as te  # noqa: E402
from allocator.trace import RequestTrace  # noqa: E402
from odma_cli.errors import BadArgument, RunFailed  # noqa: E402
from odma_hw.devices import torch_device  # noqa: E402
from test_inputs_robust import exit_code, one_line  # noqa: E402

TINY = json.loads((models.CONFIG_DIR / "tiny-llama.json").read_text())
HEADER = "num_prefill_tokens,num_decode_tokens\n"




def write(path, text) -> str:
    pathlib.Path(path).write_text(text)
    return str(path)


def config_file(folder, **changes) -> str:
    """tiny-llama's config.json with `changes` (a value of ... drops the key), in `folder`."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = {k: v for k, v in {**TINY, **changes}.items() if v is not ...}
    return write(folder / "config.json", json.dumps(data))


@pytest.fixture
def trace(tmp_path):
    return write(tmp_path / "t.csv", HEADER + "5,3\n10,3\n12,4\n7,2\n")


@pytest.fixture
def no_build(monkeypatch):
    """Records every model built (and builds none): a refusal must come before any weight."""
    built = []
    monkeypatch.setattr(te, "build_model", lambda *a, **k: built.append(a))
    return built


@pytest.fixture(scope="module")
def tiny_state():
    cfg, _ = models.load_config("tiny-llama")
    model = te.build_model(cfg, "float32", "cpu", seed=0)
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def weights_folder(folder, state, **config) -> str:
    """A model folder: tiny-llama's config.json (with `config`) and `state` as one
    safetensors file (a list of states: one shard each)."""
    folder = pathlib.Path(folder)
    folder.mkdir(exist_ok=True)
    config_file(folder, **config)
    for k, part in enumerate(state if isinstance(state, list) else [state]):
        safetensors_torch.save_file(part, str(folder / f"model-{k}.safetensors"))
    return str(folder)


# ---------------------------------------------------------------------------------------- the check
def test_non_finite_logits_are_counted_as_mismatches_and_named():
    """NaN compares equal to nothing: a check that let NaN logits through checked nothing."""
    cfg, _ = models.load_config("tiny-llama")
    model = te.build_model(cfg, "float32", "cpu", seed=0)
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    prompts = te.prompt_ids(3, [4, 6, 5], cfg.vocab_size, 0)
    run = te.serve(model, prompts, [3, 2, 4], np.zeros(3), "static", pool_bytes=1 << 20,
                   max_model_len=16, keep_logits=True)
    got = te.check_tokens(model, prompts, run["tokens"], run["top_logits"])
    assert got["mismatches"] == 3 and got["non_finite"] == 3
    assert math.isnan(got["max_logit_diff"])          # not a difference of 0.0


@pytest.mark.parametrize("eps", [-1.0, -1, 0.0, "1e-6", True])
def test_a_norm_epsilon_that_is_not_positive_is_refused_before_any_weight(
        tmp_path, trace, capsys, no_build, eps):
    cfg = config_file(tmp_path, rms_norm_eps=eps)
    assert exit_code(["engine", "--trace", trace, "--model", cfg, "--check"]) == 2
    assert "'rms_norm_eps' must be a finite number > 0" in one_line(capsys)
    assert not no_build


def test_a_check_that_finds_mismatches_prints_the_results_and_exits_3(trace, capsys,
                                                                       monkeypatch):
    real = te.build_model

    def broken(*a, **k):                # a model whose every logit is NaN
        model = real(*a, **k)
        with torch.no_grad():
            model.model.norm.weight.fill_(float("nan"))
        return model
    monkeypatch.setattr(te, "build_model", broken)
    assert exit_code(["engine", "--trace", trace, "--model", "tiny-llama", "--policy", "odma",
                      "--check", "--json"]) == 3
    out, err = capsys.readouterr()
    (r,) = json.loads(out)["results"]
    assert r["mismatches"] == r["non_finite"] == 4 and r["max_logit_diff"] is None
    assert len(err.strip().splitlines()) == 1
    assert "odma: --check found 4 of 4 requests mismatching (4 with non-finite logits)" in err


# ------------------------------------------------------------------------------------ empty prompts
@pytest.mark.parametrize("argv", [
    ["engine", "--policy", "odma,paged"], ["engine", "--policy", "odma", "--check"],
    ["engine", "--policy", "hf"], ["simulate", "--timing", "ideal"],
    ["replay", "--device", "none"]], ids=lambda a: " ".join(a[:2]))
def test_a_prompt_of_no_tokens_is_refused_by_every_command_naming_its_row(
        tmp_path, capsys, no_build, argv):
    trace = write(tmp_path / "t.csv", HEADER + "0,5\n10,3\n")
    assert exit_code([argv[0], "--trace", trace, *argv[1:]]) == 2
    err = one_line(capsys)
    assert "line 2: num_prefill_tokens 0" in err and "at least one token" in err
    assert not no_build


def test_a_trace_built_in_python_refuses_an_empty_prompt_too():
    with pytest.raises(BadArgument, match="request 1 has 0 prompt tokens"):
        RequestTrace([4, 0], [5, 3])
    assert len(RequestTrace([4, 1], [0, 3])) == 2       # no generated tokens: served as one


# ---------------------------------------------------------------------------- pools and failed runs
def test_a_pool_that_whole_pages_cannot_fill_is_refused_before_any_weight(tmp_path, capsys,
                                                                          no_build):
    """0.011 MB holds 42 tokens of tiny-llama's KV, enough for static and odma's 38-token
    blocks, but only 2 pages of 16 tokens: paged is refused up front, not after the others."""
    rows = [f"{3 + i},{1 + i % 5}\n" for i in range(15)] + ["30,8\n"]
    trace = write(tmp_path / "t16.csv", HEADER + "".join(rows))
    assert exit_code(["engine", "--trace", trace, "--model", "tiny-llama", "--kv-pool-mb",
                      "0.011", "--policy", "static,odma,paged"]) == 2
    err = one_line(capsys)
    assert "--kv-pool-mb 0.011 for paged" in err and "2 pages of 16 tokens" in err
    assert not no_build


def fail_policy(monkeypatch, failing_policy: str, error: Exception) -> None:
    """serve() raises `error` for `failing_policy` and serves every other policy."""
    real = te.serve

    def failing(model, prompts, gen, arrivals, policy, **kw):
        if policy == failing_policy:
            raise error
        return real(model, prompts, gen, arrivals, policy, **kw)
    monkeypatch.setattr(te, "serve", failing)


def test_a_policy_failing_at_run_time_keeps_the_others_results(trace, capsys, monkeypatch):
    fail_policy(monkeypatch, "paged",
                RuntimeError("engine stalled: requests wait and nothing runs"))
    assert exit_code(["engine", "--trace", trace, "--model", "tiny-llama", "--policy",
                      "odma,paged,static", "--json"]) == 3
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert [r["policy"] for r in doc["results"]] == ["odma", "static"]
    assert all(r["completed"] == 4 for r in doc["results"])
    assert doc["failed"] == [{"policy": "paged",
                              "error": "engine stalled: requests wait and nothing runs"}]
    assert len(err.strip().splitlines()) == 1 and "paged: engine stalled" in err


# ---------------------------------------------------------------------------------- sliding windows
def test_a_sliding_window_shorter_than_the_requests_is_refused_by_the_engine(
        tmp_path, trace, capsys, no_build):
    cfg = config_file(tmp_path, model_type="mistral", sliding_window=4)
    assert exit_code(["engine", "--trace", trace, "--model", cfg, "--check"]) == 2
    assert "a sliding window of 4 tokens" in one_line(capsys)
    assert not no_build
    # simulate sizes the KV whole, as the engine keeps it: the window changes nothing there
    assert exit_code(["simulate", "--trace", trace, "--model", cfg, "--timing", "ideal",
                      "--json"]) == 0
    capsys.readouterr()


def test_a_window_as_long_as_the_requests_changes_nothing(tmp_path, trace, capsys):
    cfg = config_file(tmp_path, model_type="mistral", sliding_window=16)
    assert exit_code(["engine", "--trace", trace, "--model", cfg, "--policy", "odma",
                      "--check", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["mismatches"] == 0


# ------------------------------------------------------------------------------------------ configs
BAD_CONFIGS = [
    (dict(hidden_size=65), "multiple of num_attention_heads"),
    (dict(hidden_size=65, head_dim=...), "multiple of num_attention_heads"),
    (dict(num_attention_heads=0), "'num_attention_heads' must be a whole number"),
    (dict(num_hidden_layers=2.5), "'num_hidden_layers' must be a whole number"),
    (dict(num_hidden_layers=2**31 - 1), "1048576], got 2147483647"),
    (dict(vocab_size="512"), "'vocab_size' must be a whole number"),
    (dict(vocab_size=-5), "'vocab_size' must be a whole number"),
    (dict(vocab_size=0), "'vocab_size' must be a whole number"),
    (dict(num_key_value_heads=0), "'num_key_value_heads' must be a whole number"),
    (dict(num_key_value_heads=3), "a divisor of num_attention_heads"),
    (dict(intermediate_size=0), "'intermediate_size' must be a whole number"),
    (dict(head_dim=0), "'head_dim' must be a whole number"),
    (dict(max_position_embeddings=...), "missing 'max_position_embeddings'"),
    (dict(rope_scaling="linear"), "'rope_scaling' must be null or a table"),
    (dict(rope_scaling=[1, 2]), "'rope_scaling' must be null or a table"),
    (dict(rope_scaling={"type": "linear", "factor": -2}), "factor -2"),
    (dict(rope_theta=0), "'rope_theta' must be a finite number > 0"),
    (dict(tie_word_embeddings="yes"), "'tie_word_embeddings' must be true or false"),
    (dict(hidden_act=7), "'hidden_act' must be the name of an activation"),
    (dict(num_experts=8), "mixture of experts"),
]
# what only the engine and calibrate refuse: they build the model with transformers (simulate
# sizes it, whatever its activation, rope type or vocabulary)
BUILD_ONLY = [
    (dict(rope_scaling={"type": "bogus"}), "names rope type 'bogus'"),
    (dict(hidden_act="bogus"), "'hidden_act' 'bogus' is not an activation"),
    (dict(vocab_size=3), "leaves no token for the engine's prompts"),
]


@pytest.mark.parametrize("change, message", BAD_CONFIGS + BUILD_ONLY,
                         ids=lambda x: str(x)[:40] if isinstance(x, dict) else None)
def test_a_bad_config_is_one_refusal_for_every_command_before_any_weight(
        tmp_path, trace, capsys, no_build, change, message):
    cfg = config_file(tmp_path, **change)
    with pytest.raises(BadArgument, match=message):
        models.load_config(cfg)                    # the engine's and calibrate's reading
    argv = {"engine": ["engine", "--trace", trace, "--model", cfg],
            "calibrate": ["calibrate", "--model", cfg, "--out", str(tmp_path / "c.toml")],
            "simulate": ["simulate", "--trace", trace, "--model", cfg, "--timing", "ideal"]}
    for command in ("engine", "calibrate") + (() if (change, message) in BUILD_ONLY
                                               else ("simulate",)):
        assert exit_code(argv[command]) == 2, command
        assert message in one_line(capsys), command
    assert not no_build
    assert not list(tmp_path.glob("c*.toml"))


def test_the_counts_every_command_reads_are_the_checked_ones(tmp_path):
    cfg = config_file(tmp_path, num_hidden_layers=3.0, rms_norm_eps=1, head_dim=...)
    config, _ = models.load_config(cfg)            # 3.0 and 1: what transformers takes
    assert config.num_hidden_layers == 3 and config.rms_norm_eps == 1.0
    spec = model_from_config(cfg)
    assert (spec.layers, spec.head_dim) == (3, 64 // 8)


@pytest.mark.parametrize("argv, message", [
    (["--model", "{vocab}"], "weights 512 GB"),
    (["--model", "{layers}", "--kv-pool-mb", "1e6"], "KV pool 1e+03 GB"),
])
def test_a_model_and_pool_larger_than_free_memory_are_refused_before_any_weight(
        tmp_path, trace, capsys, no_build, argv, message):
    files = {"vocab": config_file(tmp_path / "v", vocab_size=10**9),
             "layers": config_file(tmp_path / "l", num_hidden_layers=100_000)}
    argv = [a.format(**files) for a in argv]
    assert exit_code(["engine", "--trace", trace, *argv, "--policy", "odma"]) == 2
    err = one_line(capsys)
    assert message in err and "free on torch:cpu" in err
    assert not no_build


def test_calibrate_refuses_a_matmul_larger_than_free_memory(tmp_path, capsys):
    cfg = config_file(tmp_path, vocab_size=10**9)
    assert exit_code(["calibrate", "--model", cfg, "--out", str(tmp_path / "c.toml")]) == 2
    assert "matmul measurement" in one_line(capsys)


# ------------------------------------------------------------------------------------------ weights
def _truncated(folder, state):
    f = pathlib.Path(weights_folder(folder, state)) / "model-0.safetensors"
    f.write_bytes(f.read_bytes()[:-100])


def _replaced(data):
    def make(folder, state):
        f = pathlib.Path(weights_folder(folder, state)) / "model-0.safetensors"
        f.write_bytes(data)
    return make


def _directory(folder, state):
    config_file(folder)
    (folder / "x.safetensors").mkdir()


def _pytorch_bin(folder, state):
    config_file(folder)
    torch.save(state, folder / "pytorch_model.bin")


def _two_shards_one_key(folder, state):
    keys = sorted(state)
    weights_folder(folder, [{k: state[k] for k in keys[:10]},
                            {k: state[k] for k in keys[9:]}])


def _int32(folder, state):
    weights_folder(folder, {**state, "model.norm.weight":
                            state["model.norm.weight"].to(torch.int32)})


WEIGHT_HEADERS = [
    (_truncated, "file not fully covered"),
    (_replaced(b""), "header too small"),
    (_replaced(bytes(range(256)) * 20), "cannot read weights"),
    (_replaced(struct.pack("<Q", 10**12) + b"{}"), "header too large"),
    (_directory, "x.safetensors are not a file"),
    (_pytorch_bin, "holds pytorch_model.bin but no .safetensors file"),
    (_two_shards_one_key, "is in both model-0.safetensors and model-1.safetensors"),
    (_int32, "'model.norm.weight' is I32, not a floating-point weight"),
]


@pytest.mark.parametrize("make, message", WEIGHT_HEADERS, ids=lambda x: getattr(x, "__name__",
                                                                                None))
def test_weights_whose_headers_are_wrong_are_refused_before_any_weight(
        tmp_path, trace, capsys, no_build, tiny_state, make, message):
    folder = tmp_path / "model"
    make(folder, tiny_state)
    assert exit_code(["engine", "--trace", trace, "--model", str(folder)]) == 2
    assert message in one_line(capsys)
    assert not no_build


@pytest.mark.parametrize("state, config, message", [
    ({"model.norm.weight": float("nan")}, {}, "'model.norm.weight' holds values that are not"),
    ({"lm_head.weight": 2.0}, {"tie_word_embeddings": True}, "lm_head.weight differs"),
])
def test_weights_whose_values_would_be_dropped_or_poison_every_logit_are_refused(
        tmp_path, trace, capsys, tiny_state, state, config, message):
    changed = {k: v.clone() for k, v in tiny_state.items()}
    for key, value in state.items():
        changed[key].fill_(value)
    folder = weights_folder(tmp_path / "model", changed, **config)
    assert exit_code(["engine", "--trace", trace, "--model", folder, "--check"]) == 2
    assert message in one_line(capsys)


def test_loaded_weights_serve_and_pass_the_check(tmp_path, trace, capsys, tiny_state):
    folder = weights_folder(tmp_path / "model", tiny_state)
    assert exit_code(["engine", "--trace", trace, "--model", folder, "--policy", "odma",
                      "--check", "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["results"]
    assert r["settings"]["weights"] == "loaded" and r["mismatches"] == 0


# ----------------------------------------------------------------------------------- unused options
@pytest.mark.parametrize("argv, message", [
    (["engine", "--card", "/nonexistent.toml", "--policy", "odma"],
     "cannot read card /nonexistent.toml"),
    (["engine", "--demand-bound", "1", "--policy", "odma,paged"],
     "--demand-bound changes only elastic runs"),
    (["engine", "--demand-bound", "none", "--policy", "hf"],
     "--demand-bound changes only elastic runs"),
    (["engine", "--cobatch", "4", "--policy", "static"], "--cobatch changes only"),
    (["engine", "--extent-knee-tokens", "5", "--policy", "odma,paged"],
     "--extent-knee-tokens changes only extent, elastic runs"),
    (["simulate", "--demand-bound", "1", "--policy", "odma,static", "--timing", "ideal"],
     "--demand-bound changes only elastic runs"),
    (["simulate", "--cobatch", "4", "--policy", "static", "--timing", "ideal"],
     "--cobatch changes only"),
], ids=lambda a: " ".join(a[:3]) if isinstance(a, list) else None)
def test_an_option_no_policy_of_the_run_uses_is_refused(trace, capsys, no_build, argv,
                                                        message):
    assert exit_code([argv[0], "--trace", trace, *argv[1:]]) == 2
    assert message in one_line(capsys)
    assert not no_build


def test_an_option_some_policy_uses_is_taken(trace, capsys):
    assert exit_code(["simulate", "--trace", trace, "--timing", "ideal", "--policy",
                      "static,elastic", "--demand-bound", "1", "--cobatch", "2"]) == 0
    capsys.readouterr()


# ---------------------------------------------------------------------------------- what a run used
def test_the_table_says_what_clip_dropped_and_what_cache_hf_used(trace, capsys):
    assert exit_code(["engine", "--trace", trace, "--model", "tiny-llama", "--policy",
                      "hf,paged", "--kv-pool-mb", "0.011", "--clip", "--max-model-len",
                      "12"]) == 0
    out = capsys.readouterr().out
    assert "--clip: 1 of 4 requests dropped (prompt alone >= max model len 12), 1 " \
           "generations cut at that length" in out
    assert "hf: transformers' own KV cache of" in out and "(not the KV pool)" in out


# ----------------------------------------------------------------------------------------- the fuzz
MISSING = ...
COUNTS = st.sampled_from([0, 1, 2, 3, 4, 8, 16, 64, 65, 2**31, 10**9, 10**12, -1])
NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3))
ODD = st.one_of(st.none(), st.booleans(), st.text(max_size=6), st.lists(st.integers(), max_size=2),
                st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
                st.just(MISSING))
FUZZ_KEYS = {
    "model_type": st.sampled_from(["llama", "qwen2", "mistral", "gpt2", ""]),
    "vocab_size": COUNTS, "hidden_size": COUNTS, "intermediate_size": COUNTS,
    "num_hidden_layers": st.one_of(COUNTS, st.just(2.5), st.just(2.0)),
    "num_attention_heads": COUNTS, "num_key_value_heads": COUNTS, "head_dim": COUNTS,
    "max_position_embeddings": COUNTS, "rms_norm_eps": NUMBERS, "rope_theta": NUMBERS,
    "rope_scaling": st.sampled_from([{"type": "linear", "factor": 2.0}, {"type": "bogus"},
                                     {"rope_type": "dynamic", "factor": 0}, "linear", [1, 2]]),
    "tie_word_embeddings": st.booleans(), "attention_bias": st.booleans(),
    "hidden_act": st.sampled_from(["silu", "gelu", "bogus"]),
    "sliding_window": st.sampled_from([None, 0, 4, 4096]),
    "use_sliding_window": st.booleans(), "mlp_bias": st.booleans(),
    "layer_types": st.sampled_from([["full_attention"] * 2, ["sliding_attention"] * 2, ["x"]]),
    "initializer_range": NUMBERS, "bos_token_id": COUNTS, "_name_or_path": st.integers(),
}
FUZZ_CONFIG = st.dictionaries(st.sampled_from(sorted(FUZZ_KEYS)), st.none(), max_size=4).flatmap(
    lambda keys: st.fixed_dictionaries({k: st.one_of(FUZZ_KEYS[k], ODD) for k in keys}))
DEVICE_FREE_BYTES = 256 << 20     # what the fuzz's device reports free: nothing larger is built


@pytest.fixture
def small_device(monkeypatch):
    """A torch:cpu device with DEVICE_FREE_BYTES free, and calibrate stopping after its checks
    (its measurements take a minute)."""
    monkeypatch.setattr(torch_device, "mem_available", lambda: DEVICE_FREE_BYTES)

    def stop(*a, **k):
        raise RunFailed("stopped after the checks")
    monkeypatch.setattr(calibrate_module, "measure_memory", stop)


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(change=FUZZ_CONFIG)
def test_fuzzed_configs_end_in_0_2_or_3_with_one_line_through_every_command(
        small_device, capsys, change):
    with tempfile.TemporaryDirectory() as tmp:
        trace = write(os.path.join(tmp, "t.csv"), HEADER + "3,2\n5,1\n")
        cfg = config_file(tmp, **change)
        runs = [["engine", "--trace", trace, "--model", cfg, "--policy", "static", "--check",
                 "--json"],
                ["calibrate", "--model", cfg, "--out", os.path.join(tmp, "c.toml"), "--quiet"],
                ["simulate", "--trace", trace, "--model", cfg, "--timing", "ideal", "--json"]]
        for argv in runs:
            code = exit_code(argv)
            out, err = capsys.readouterr()
            assert code in (0, 2, 3), (argv[0], change, err)
            assert "Traceback" not in err
            # transformers' own warnings (an unknown rope key, say) are its log, not ours
            ours = [line for line in err.splitlines() if not line.startswith("[transformers]")]
            assert len(ours) == (code != 0), (argv[0], change, err)
            if argv[0] == "calibrate":
                assert code == 2 or "stopped after the checks" in err, (change, err)


def test_models_too_large_for_memory_are_refused_in_well_under_2_gb(tmp_path):
    """With the machine's real free memory, in a child whose peak memory is its own (VmHWM, the
    peak of its own address space: ru_maxrss would keep the parent's through the exec): a
    vocabulary of 10^9 (256 GB of embedding), 100,000 layers with a terabyte pool, an MLP of
    2^31 - 1 (each refused in one line before any weight)."""
    trace = write(tmp_path / "t.csv", HEADER + "5,3\n")
    cases = [(config_file(tmp_path / name, **change), extra)
             for name, change, extra in (
                 ("v", dict(vocab_size=10**9), []),
                 ("l", dict(num_hidden_layers=100_000), ["--kv-pool-mb", "1e6"]),
                 ("f", dict(intermediate_size=2**31 - 1), []))]
    script = (
        "import json, sys\n"
        "from odma_cli.main import main\n"
        "codes = [main(['engine', '--trace', sys.argv[1], '--model', m, '--policy', 'odma',"
        " *extra]) for m, extra in json.loads(sys.argv[2])]\n"
        "codes.append(main(['calibrate', '--model', json.loads(sys.argv[2])[0][0], '--out',"
        " sys.argv[3]]))\n"
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
        "print(json.dumps([codes, int(hwm.split()[1])]))\n")
    proc = subprocess.run([sys.executable, "-c", script, trace, json.dumps(cases),
                           str(tmp_path / "c.toml")], capture_output=True, text=True,
                          timeout=300)
    codes, peak_kib = json.loads(proc.stdout)
    assert codes == [2, 2, 2, 2], proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 4 and "Traceback" not in proc.stderr
    assert peak_kib * 1024 < 2 << 30


def test_a_library_error_is_one_line_in_a_run_and_in_the_warm_up(trace, capsys, monkeypatch):
    """On an H200 Triton's compiler failed in the engine's warm-up: a traceback. A library's
    error is now one line, named by its type: a policy's run fails alone (exit 3, the others
    printed), the warm-up's failure stops the command before any policy (exit 3)."""
    fail_policy(monkeypatch, "paged", TypeError("failed to specialize argument of type: str"))
    assert exit_code(["engine", "--trace", trace, "--model", "tiny-llama", "--policy",
                      "odma,paged", "--json"]) == 3
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert [r["policy"] for r in doc["results"]] == ["odma"]
    assert doc["failed"] == [{"policy": "paged",
                              "error": "TypeError: failed to specialize argument of type: str"}]
    assert exit_code(["engine", "--trace", trace, "--model", "tiny-llama", "--policy",
                      "paged,odma", "--json"]) == 3
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "warm-up through paged failed" in err and "TypeError: failed to specialize" in err
