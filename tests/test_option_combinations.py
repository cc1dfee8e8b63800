"""Options that do nothing in the combination given, lists with a stray comma, paths whose
folder is a file, and the emulator's text traces at their edges: each is refused in one line
naming what is wrong (exit 2, before any work), or, where a sweep's grid may cross an option
with the one that enables it, run and told in a warning line."""

from __future__ import annotations

import json
import re

import pytest

from allocator.replay import pool_bytes
from odma_cli.errors import BadArgument
from odma_cli.main import main
from test_emu_cli import no_work  # noqa: F401  (a fixture: no trace made, none decomposed)
from test_inputs_robust import exit_code, one_line


def refused(argv, capsys) -> str:
    """The one error line of a command that must exit 2."""
    assert exit_code(argv) == 2
    return one_line(capsys)


@pytest.fixture
def timed_trace(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens,arrived_at\n10,5,0\n20,5,1.5\n")
    return str(path)


@pytest.fixture
def text_trace(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("0x0 R 64\n0x40 W 64\n")
    return str(path)


# ------------------------------------------------------------------ the emulator's --trace
@pytest.mark.parametrize("option, value", [("--pattern", "seq"), ("--requests", "1000"),
                                           ("--footprint", "4096"), ("--write-ratio", "0.5"),
                                           ("--seed", "3")])
def test_generated_traffic_options_beside_a_trace_are_refused_by_name(
        option, value, text_trace, capsys, no_work):
    err = refused(["emulate", "--trace", text_trace, option, value], capsys)
    assert f"--trace replaces the generated traffic: {option} would do nothing" in err


def test_a_trace_alone_runs_and_the_generated_defaults_still_hold(text_trace, capsys):
    assert main(["emulate", "--trace", text_trace, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["pattern"], d["requests"], d["writes"]) == ("trace", 2, 1)
    assert main(["emulate", "--requests", "3000", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["pattern"], d["requests"], d["config"]["seed"]) == ("rand", 3000, 1)


def test_a_sweep_crossing_a_trace_with_a_pattern_is_refused_before_any_cell(
        tmp_path, text_trace, capsys, monkeypatch):
    from odma_cli import sweep

    monkeypatch.setattr(sweep, "import_ray", lambda: pytest.fail("a cell was about to run"))
    grid = tmp_path / "g.toml"
    grid.write_text(f'command = "emulate"\n[fixed]\ntrace = "{text_trace}"\n'
                    f'[axes]\npattern = ["seq", "rand"]\n')
    err = refused(["sweep", str(grid), "--out", str(tmp_path / "out")], capsys)
    assert "--pattern would do nothing beside it" in err and "cell 0" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, says", [
    ("0x0 R 0\n", "line 1: size 0 must be a positive multiple of the 32-byte burst"),
    ("0x0 R -32\n", "line 1: size -32 must be a positive multiple of the 32-byte burst"),
    ("0x0 R 48\n", "line 1: size 48 is not a multiple of the 32-byte burst"),
])
def test_a_text_trace_size_is_refused_for_what_is_wrong_with_it(text, says, tmp_path, capsys):
    path = tmp_path / "t.txt"
    path.write_text(text)
    assert says in refused(["emulate", "--trace", str(path)], capsys)


def test_a_folder_given_as_a_text_trace_is_called_one(tmp_path, capsys):
    assert "is a directory" in refused(["emulate", "--trace", str(tmp_path)], capsys)


def test_a_byte_order_mark_before_a_text_trace_is_read_past(tmp_path, capsys):
    path = tmp_path / "t.txt"
    path.write_bytes(b"\xef\xbb\xbf0x0 R 64\n0x40 R 64\n")
    assert main(["emulate", "--trace", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 2


# ------------------------------------------------------------------------ arrivals
@pytest.mark.parametrize("command", ["simulate", "replay"])
def test_a_time_scale_beside_a_rate_is_refused(command, timed_trace, capsys):
    err = refused([command, "--trace", timed_trace, "--rate", "2", "--time-scale", "0.5"],
                  capsys)
    assert "--time-scale scales arrived_at, which --rate replaces: give one of them" in err


@pytest.mark.parametrize("command", ["simulate", "replay"])
def test_a_time_scale_on_a_trace_without_arrivals_is_refused(command, tmp_path, capsys):
    untimed = tmp_path / "u.csv"
    untimed.write_text("num_prefill_tokens,num_decode_tokens\n10,5\n20,5\n")
    err = refused([command, "--trace", str(untimed), "--time-scale", "0.5"], capsys)
    assert "--time-scale scales arrived_at, which this trace does not have" in err


def test_a_time_scale_of_one_beside_a_rate_changes_nothing_and_runs(timed_trace, capsys):
    argv = ["simulate", "--trace", timed_trace, "--rate", "2", "--policy", "paged", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)["results"][0]["output_tps"]
    assert main(argv + ["--time-scale", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["output_tps"] == plain


@pytest.mark.parametrize("command", ["simulate", "replay"])
def test_series_without_json_is_refused(command, timed_trace, capsys):
    err = refused([command, "--trace", timed_trace, "--series"], capsys)
    assert "--series adds the time series to --json's output: give --json too" in err
    assert main([command, "--trace", timed_trace, "--series", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "series" in (out["results"][0] if command == "simulate" else out)


# ------------------------------------------------------------------ lists with a stray comma
@pytest.mark.parametrize("option, value, says", [
    ("--card", "a100-80gb,", "--card: expected CARD[,CARD...], not 'a100-80gb,'"),
    ("--card", "a100-80gb,,h100-sxm", "not 'a100-80gb,,h100-sxm'"),
    ("--policy", "odma,", "unknown policy 'odma,'"),
    ("--rate", "1,", "expected numbers separated by commas, not '1,'"),
])
def test_a_list_with_an_empty_item_is_refused_whole(option, value, says, timed_trace, capsys):
    assert says in refused(["simulate", "--trace", timed_trace, option, value], capsys)


# --------------------------------------------------------- output folders that are files
@pytest.mark.parametrize("argv", [
    ["simulate", "--trace", "{trace}", "--plot", "{file}/sub/p.png"],
    ["workload", "chat", "--out", "{file}/w.csv"],
    ["calibrate", "--device", "emu:lpddr5-6400", "--out", "{file}/c.toml"],
    ["sweep", "{grid}", "--out", "{file}/sweep"],
], ids=lambda a: a[0])
def test_a_file_where_the_output_folder_should_be_is_named_as_one(argv, tmp_path, timed_trace,
                                                                  capsys):
    pytest.importorskip("matplotlib")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    grid = tmp_path / "g.toml"
    grid.write_text('command = "emulate"\n[axes]\nrequests = [1000]\n')
    argv = [a.format(trace=timed_trace, file=blocker, grid=grid) for a in argv]
    assert f"{blocker} is a file, not a folder" in refused(argv, capsys)


def test_a_missing_output_folder_is_still_named_missing(tmp_path, capsys):
    err = refused(["workload", "chat", "--out", str(tmp_path / "no" / "w.csv")], capsys)
    assert f"folder {tmp_path / 'no'} does not exist" in err


@pytest.mark.parametrize("argv, says", [
    (["text-analysis", "--turns", "5"], "--turns shapes chat traces: text-analysis takes "
                                        "--requests, --prefixes"),
    (["chat", "--requests", "5", "--prefixes", "2"],
     "--requests, --prefixes shape text-analysis traces: chat takes --conversations"),
])
def test_a_workload_refuses_the_other_kinds_options_and_writes_nothing(argv, says, tmp_path,
                                                                       capsys):
    out = tmp_path / "w.csv"
    assert says in refused(["workload", *argv, "--out", str(out)], capsys)
    assert not out.exists()
    assert exit_code(["workload", argv[0], "--out", str(out)]) == 0 and out.exists()


# ---------------------------------------------------- options a combination leaves idle
def _tps(capsys) -> tuple[float, str]:
    captured = capsys.readouterr()
    return json.loads(captured.out)["results"][0]["output_tps"], captured.err


@pytest.mark.parametrize("base, extra, says", [
    ([], ["--chunk-bytes", "4096"], "--chunk-bytes does nothing with one stream"),
    ([], ["--cache-host-gb", "3"], "--cache-host-gb does nothing without --prefix-cache"),
    ([], ["--eviction", "fifo", "--prefetch", "2"],
     "--eviction, --prefetch do nothing without --prefix-cache"),
    (["--card", "h100-sxm"], ["--channels", "4", "--address-map", "xor", "--queue", "2"],
     "--channels, --address-map, --queue do nothing here: no card is timed by the emulator"),
    (["--timing", "ideal"], ["--streams", "4"], "--streams does nothing here"),
    (["--policy", "odma"], ["--layout", "nhd", "--page-tokens", "64"],
     "--layout, --page-tokens do nothing without the paged policy"),
    ([], ["--swap-space", "10"], "--swap-space does nothing without --preemption swap"),
    (["--kv-pool-gb", "1"], ["--memory-utilization", "0.5"],
     "--memory-utilization does nothing beside --kv-pool-gb"),
])
def test_an_option_the_combination_leaves_idle_is_warned_of_and_changes_nothing(
        base, extra, says, timed_trace, capsys):
    argv = ["simulate", "--trace", timed_trace, "--policy", "paged", "--json"] + base
    assert main(argv) == 0
    plain, err = _tps(capsys)
    assert "warning" not in err
    assert main(argv + extra) == 0
    tps, err = _tps(capsys)
    assert tps == plain
    assert re.search(rf"^odma-hw simulate: warning: {re.escape(says)}", err, re.M), err


def test_bad_input_beside_an_idle_option_is_one_line_and_no_warning(timed_trace, capsys):
    assert main(["simulate", "--trace", timed_trace, "--eviction", "fifo",
                 "--demand-bound", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--demand-bound changes only" in err, err


@pytest.mark.parametrize("given", [
    ["--card", "mlu370-x4", "--channels", "4"],           # an emulated card
    ["--card", "h100-sxm", "--timing", "emu:lpddr5-6400", "--queue", "8"],
    ["--layout", "nhd"],                                 # the paged policy is run
    ["--policy", "odma", "--preset", "vllm-v1"],         # the preset's layout, not the user's
    ["--preemption", "swap", "--swap-space", "10"],
])
def test_an_option_that_does_something_is_not_warned_of(given, timed_trace, capsys):
    assert main(["simulate", "--trace", timed_trace, "--policy", "paged", "--json"] + given) == 0
    assert "warning" not in capsys.readouterr().err


def test_the_prefix_cache_takes_its_stated_defaults_and_the_tiers_given(tmp_path, capsys):
    trace = tmp_path / "p.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens,prefix_id,prefix_tokens\n"
                     + "".join(f"{300 + i},8,{i % 2},256\n" for i in range(8)))
    argv = ["simulate", "--trace", str(trace), "--policy", "paged", "--prefix-cache", "--json"]

    def cache(extra):
        assert main(argv + extra) == 0
        captured = capsys.readouterr()
        assert "warning" not in captured.err
        c = json.loads(captured.out)["results"][0]["prefix_cache"]["caches"][0]
        return c["capacity_bytes"], c["eviction"]

    assert cache([]) == ({"device": 10**9, "host": 16 * 10**9, "disk": 64 * 10**9}, "lru")
    assert cache(["--cache-device-gb", "0.5", "--cache-host-gb", "0", "--cache-disk-gb", "2",
                  "--eviction", "fifo"]) == ({"device": 5 * 10**8, "host": 0,
                                              "disk": 2 * 10**9}, "fifo")


# ------------------------------------------------------------------ bounds as printed
def test_the_kv_pool_bound_a_refusal_prints_is_taken():
    with pytest.raises(BadArgument) as exc:
        pool_bytes(kv_pool_gb=1e12)
    bound = float(re.search(r"\(0, ([\d.]+)\]", str(exc.value)).group(1))
    assert pool_bytes(kv_pool_gb=bound) > 0


def test_a_saved_probe_without_a_name_prints_no_empty_name(tmp_path, capsys):
    assert main(["probe", "--device", "emu:lpddr5-6400", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    del doc["devices"][0]["name"]
    saved = tmp_path / "p.json"
    saved.write_text(json.dumps(doc))
    assert main(["probe", "--from", str(saved)]) == 0
    out = capsys.readouterr().out
    assert ": ;" not in out and "emu:lpddr5-6400: peak 12.8 GB/s;" in out


def test_a_few_requests_of_a_large_granularity_show_their_progress(capsys):
    # 3 x 64 MiB: 3 million 64-byte accesses, as long as 3 million requests of 64 B
    assert main(["emulate", "--requests", "3", "--granularity", str(64 << 20)]) == 0
    err = capsys.readouterr().err
    assert err.startswith("emulating 3 requests on lpddr5-6400 ...")
    assert "timing: 100 % of" in err


def test_a_long_trace_file_shows_its_progress_and_a_short_one_none(tmp_path, capsys):
    # a trace's size is known once it is read: 3 x 64 MiB shows its progress as the generated
    # run above does, 2 x 64 B prints its table alone
    long, short = tmp_path / "long.trace", tmp_path / "short.trace"
    long.write_text("".join(f"{i << 26:#x} R {64 << 20}\n" for i in range(3)))
    short.write_text("0x0 R 64\n0x1000 W 64\n")
    assert main(["emulate", "--trace", str(long), "--granularity", "64"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("emulating 3 requests on lpddr5-6400 ...")
    assert "timing: 100 % of" in err
    assert main(["emulate", "--trace", str(short), "--granularity", "64"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["emulate", "--trace", str(long), "--granularity", "64", "--json"]) == 0
    assert capsys.readouterr().err == ""
