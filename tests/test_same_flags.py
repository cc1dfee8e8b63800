"""One vocabulary: the engine and simulate take the same option names, units and spellings for
what they share, so that one command line with `simulate` replaced by `engine` describes the same
run. bench/fidelity_engine.py runs exactly that; here both parsers read its command line and
must agree on every value they share."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")

from odma_cli.main import build_parser  # noqa: E402

SHORT = {"float32": "fp32", "bfloat16": "bf16"}

ROOT = Path(__file__).resolve().parents[1]
# what both commands have under one name but mean differently, and why
MEANS_ANOTHER_THING = {
    "device": "engine: the torch device it runs on; simulate: the older spelling of --card",
    "func": "each command's own entry",
    "command": "the command's own name",
}


def fidelity_bench():
    spec = importlib.util.spec_from_file_location("fidelity_engine",
                                                  ROOT / "bench" / "fidelity_engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parsed(command: str, argv: list) -> dict:
    """The parsed options, a dtype by one spelling (each command keeps its own: float32 / fp32)."""
    args = vars(build_parser().parse_args([command, *argv]))
    if args.get("dtype") in SHORT:
        args["dtype"] = SHORT[args["dtype"]]
    return args


@pytest.mark.parametrize("chunked", [False, True], ids=["prefill-first", "chunked"])
def test_the_fidelity_bench_runs_one_command_line_that_both_read_alike(chunked):
    bench = fidelity_bench()
    a = bench.parser().parse_args(["--card", "cpu.toml"])
    argv = bench.run_args(a, "trace.csv", ["--max-num-batched-tokens", "256"] if chunked else [])
    engine, simulate = parsed("engine", argv), parsed("simulate", argv)
    shared = (set(engine) & set(simulate)) - set(MEANS_ANOTHER_THING)
    differ = {k: (engine[k], simulate[k]) for k in shared if engine[k] != simulate[k]}
    assert not differ, f"one command line, two readings: {differ}"
    # what the line names, both read: the card, the pool in GB, the caps, the type, the batch
    for key in ("card", "kv_pool_gb", "prompt_cap", "output_cap", "dtype", "max_batch",
                "requests", "policy", "max_num_batched_tokens"):
        assert key in shared
    assert engine["card"] == simulate["card"] == "cpu.toml" and engine["kv_pool_gb"] == 0.064


def test_the_older_spellings_still_read_and_say_so(capsys):
    """--kv-pool-mb (engine), --device CARD (simulate, advise) and --pool-gib (replay) stay as
    aliases whose help says what they are the older spelling of."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {(cmd, opt): action.help for cmd in ("engine", "simulate", "advise", "replay")
             for action in sub.choices[cmd]._actions for opt in action.option_strings}
    assert "alias of --kv-pool-gb" in helps[("engine", "--kv-pool-mb")]
    for cmd in ("simulate", "advise"):
        assert "older spelling of --card" in helps[(cmd, "--device")]
    assert "older spelling of --kv-pool-gb" in helps[("replay", "--pool-gib")]


def test_the_step_bench_times_both_commands_over_the_same_plans(capsys):
    """bench/fidelity_steps.py: one row, every step of the core's loop timed in the engine and
    costed in the simulation; both serve the same plans with prompts (the same decisions)."""
    spec = importlib.util.spec_from_file_location("fidelity_steps",
                                                  ROOT / "bench" / "fidelity_steps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--card", "h100-sxm", "--model", "tiny-qwen2", "--requests", "6",
                        "--prompt-cap", "40", "--output-cap", "6", "--max-batch", "4",
                        "--policy", "odma", "--budget", "32",
                        "--trace", "azure_conv_2023.csv"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()]
    prompts = {r[1]: int(r[4]) for r in rows if r[2:4] == ["with", "prompts"]}
    assert set(prompts) == {"engine", "simulate"} and prompts["engine"] == prompts["simulate"] > 0


def test_a_preset_stands_for_its_flags_in_every_command_and_the_lines_own_flags_win():
    """--preset vllm-v1 reads as vLLM v1's flags placed first: simulate and advise take all of
    them, the engine those it has (no --layout); a flag given on the line wins, before or after
    the preset."""
    from odma_cli.main import parse

    for command in ("simulate", "advise", "engine"):
        command = [command, "--trace", "t.csv"]
        args = vars(parse([*command, "--preset", "vllm-v1"])[1])
        assert (args["max_num_batched_tokens"], args["max_batch"]) == (8192, 1024), command
        assert args.get("layout", "nhd") == "nhd", command
        for line in (["--max-batch", "64", "--preset", "vllm-v1"],
                     ["--preset", "vllm-v1", "--max-batch", "64"]):
            args = vars(parse([*command, *line])[1])
            assert (args["max_num_batched_tokens"], args["max_batch"]) == (8192, 64), line
    assert vars(parse(["simulate"])[1])["layout"] == "hnd"      # the paper's, without a preset


def test_an_unknown_preset_is_refused_in_one_line(capsys):
    from odma_cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--preset", "vllm-v9"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown preset 'vllm-v9'" in err and "vllm-v1" in err


def test_dtype_auto_is_one_rule_in_both_commands(tmp_path):
    """--dtype auto, both commands' default: the type the card was measured at, else the
    device's (float32 on a CPU); simulate's cards without one serve bf16 (test_cards.py)."""
    from odma_cli.main import parse

    from allocator.serving.engine.cli import prepare

    trace = tmp_path / "t.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n20,4\n30,2\n")
    card = tmp_path / "bf16.toml"
    card.write_text('name = "bf16-card"\nbandwidth_gbps = 100.0\ncapacity_gb = 16.0\n'
                    'tflops_bf16 = 10.0\ntiming = "ideal"\nlink_gbps = 32.0\n'
                    'link_latency_us = 10.0\ndtype = "bfloat16"\n')
    for extra, engine_dtype in (([], "float32"), (["--card", str(card)], "bfloat16"),
                                (["--card", str(card), "--dtype", "fp32"], "float32")):
        args = parse(["engine", "--trace", str(trace), "--policy", "odma", *extra])[1]
        prepare(args)
        assert args.dtype == engine_dtype, extra
    assert parse(["simulate", "--trace", str(trace)])[1].dtype == "auto"
