"""Inputs that are not what a command expects: a trace that is not a trace, an output that
cannot be written, option values at their extremes. Each ends in one line and exit 2 (bad usage,
before any work) or 3 (the output failed), never in a traceback or gigabytes of memory."""

from __future__ import annotations

import csv
import errno
import json
import os
import random
import subprocess
import sys
import textwrap
import warnings

import pytest

from allocator.config import MAX_BUCKETS, AllocatorConfig
from allocator.serving import workloads
from allocator.trace import MAX_LINE_CHARS, load_trace, write_trace
from odma_cli.errors import BadArgument
from odma_cli.main import main


def exit_code(argv) -> int:
    """The CLI's exit status, whether argparse or the command returned it."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# ------------------------------------------------------------------------ writing a workload
class _DiskFillsUp:
    """csv.writer whose rows stop fitting after `rows` of them, as on a nearly full disk."""

    def __init__(self, real, rows):
        self._real, self._left = real, rows

    def writerow(self, row):
        if self._left == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._left -= 1
        return self._real.writerow(row)


@pytest.fixture
def full_disk(monkeypatch):
    real = csv.writer
    monkeypatch.setattr(csv, "writer", lambda f, *a, **k: _DiskFillsUp(real(f, *a, **k), 50))


def test_a_workload_the_disk_cannot_hold_exits_3_and_keeps_the_old_file(tmp_path, capsys,
                                                                        full_disk):
    old = "num_prefill_tokens,num_decode_tokens\n10,20\n"
    (tmp_path / "real.csv").write_text(old)
    (tmp_path / "ta.csv").symlink_to("real.csv")
    out = tmp_path / "ta.csv"
    assert exit_code(["workload", "text-analysis", "--requests", "500", "--out", str(out)]) == 3
    assert "No space left on device" in one_line(capsys)
    assert out.is_symlink() and out.read_text() == old
    assert sorted(os.listdir(tmp_path)) == ["real.csv", "ta.csv"]   # no temporary file left


def test_a_failed_workload_write_leaves_no_file_at_all(tmp_path, capsys, full_disk):
    out = tmp_path / "chat.csv"
    assert exit_code(["workload", "chat", "--conversations", "100", "--out", str(out)]) == 3
    one_line(capsys)
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_a_workload_written_to_a_full_device_exits_3(capsys):
    assert exit_code(["workload", "chat", "--conversations", "5", "--out", "/dev/full"]) == 3
    assert "No space left on device" in one_line(capsys)


def test_a_workload_path_that_cannot_be_written_is_bad_usage_before_any_work(
        tmp_path, capsys, monkeypatch):
    def must_not_run(*a, **k):
        raise AssertionError("the workload was generated before --out was checked")
    monkeypatch.setattr(workloads, "text_analysis", must_not_run)
    for out, message in ((tmp_path / "no" / "t.csv", "does not exist"),
                         (tmp_path, "is a directory"), ("", "must not be empty")):
        assert exit_code(["workload", "text-analysis", "--out", str(out)]) == 2
        assert message in one_line(capsys)
    with pytest.raises(BadArgument, match="empty path"):       # the function, called directly
        write_trace(workloads.chat(1, seed=1), "")


# ------------------------------------------------------------------------ workload options
@pytest.mark.parametrize("args, message", [
    (["text-analysis", "--requests", "1000000000"], "--requests"),
    (["text-analysis", "--prefixes", "1000000000000"], "--prefixes"),
    (["chat", "--conversations", "100000000"], "--conversations"),
    (["chat", "--system-tokens", "16384"], "--system-tokens"),
    (["chat", "--system-tokens", "99999999999999999999"], "--system-tokens"),
])
def test_a_workload_too_large_to_generate_is_refused_before_any_work(tmp_path, capsys,
                                                                     monkeypatch, args, message):
    def must_not_run(*a, **k):
        raise AssertionError("the workload was generated before its options were checked")
    monkeypatch.setattr(workloads, "text_analysis", must_not_run)
    monkeypatch.setattr(workloads, "chat", must_not_run)
    assert exit_code(["workload"] + args + ["--out", str(tmp_path / "w.csv")]) == 2
    assert message in one_line(capsys)
    assert not (tmp_path / "w.csv").exists()


@pytest.mark.parametrize("make, message", [
    (lambda: workloads.chat(20, system_tokens=16382), "system prompt"),
    (lambda: workloads.chat(20, system_tokens=20000), "system prompt"),
    (lambda: workloads.chat(20, rate=1e-310), "rate"),
    (lambda: workloads.chat(20, think_seconds=1e300), "think_seconds"),
    (lambda: workloads.chat(1.5), "conversations"),
    (lambda: workloads.text_analysis(1, rate=1e-310), "rate"),
    (lambda: workloads.text_analysis(10**8), "requests"),
    (lambda: workloads.text_analysis(100, 10**12), "prefixes"),
])
def test_workload_generators_refuse_what_they_cannot_make_in_one_bad_argument(make, message):
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # an overflow on the way is not a refusal
        with pytest.raises(BadArgument, match=message):
            make()


# ------------------------------------------------------------------------ reading a trace
def test_a_duplicate_column_is_refused_by_name(tmp_path, capsys):
    path = tmp_path / "dup.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens,num_prefill_tokens\n10,5,20\n")
    with pytest.raises(BadArgument, match="'num_prefill_tokens' 2 times"):
        load_trace(path)
    assert exit_code(["replay", "--trace", str(path), "--device", "none"]) == 2
    assert "num_prefill_tokens" in one_line(capsys)


@pytest.mark.parametrize("text, says", [
    ("prefix_id,prefix_tokens\n10,5,,5\n", "request 0 gives 5 prefix tokens but no prefix_id"),
    ("prefix_id,prefix_tokens\n10,5,a,20\n", "prefix 'a' of 20 tokens in a 10-token prompt"),
    ("prefix_id,prefix_tokens\n10,5,a,\n", "prefix 'a' of 0 tokens"),
    ("prefix_id\n10,5,a\n", "a prefix_id column but no prefix_tokens"),
])
def test_a_prefix_that_is_not_one_says_what_is_missing(tmp_path, capsys, text, says):
    path = tmp_path / "px.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens," + text)
    assert exit_code(["simulate", "--trace", str(path), "--prefix-cache"]) == 2
    assert says in one_line(capsys)


def test_a_prefix_id_given_two_lengths_is_refused_by_row(tmp_path, capsys):
    path = tmp_path / "px.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens,prefix_id,prefix_tokens,offer_id\n"
                    "100,5,a,50,\n120,5,b,60,\n200,5,a,150,\n")
    with pytest.raises(BadArgument, match="request 2 gives prefix 'a' 150 tokens where "
                                          "request 0 gave it 50"):
        load_trace(path)
    assert exit_code(["simulate", "--trace", str(path), "--prefix-cache"]) == 2
    assert "one prefix_id names one prefix" in one_line(capsys)
    path.write_text(path.read_text().replace("a,150", "a,50"))
    assert load_trace(path).prefix_tokens.tolist() == [50, 60, 50]


def _load_in_one_gib(path):
    """load_trace(path) in a child whose address space is capped at 1 GiB: a reader that
    takes a line without line breaks into memory whole dies there of MemoryError."""
    code = textwrap.dedent("""
        import resource, sys
        from allocator.trace import load_trace
        from odma_cli.errors import BadArgument
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        try:
            load_trace(sys.argv[1])
        except BadArgument as exc:
            print(exc)
            sys.exit(2)
    """)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True, timeout=300, env=env)


def test_a_sparse_file_without_line_breaks_is_refused_after_a_bounded_read(tmp_path):
    path = tmp_path / "sparse.csv"
    with open(path, "wb") as f:
        f.truncate(2 * 1024**3)                      # 2 GB of NUL bytes, no disk used
    done = _load_in_one_gib(path)
    assert done.returncode == 2, done.stderr
    assert "NUL" in done.stdout


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
def test_a_device_that_never_ends_is_refused():
    done = _load_in_one_gib("/dev/zero")
    assert done.returncode == 2, done.stderr
    assert "is a device" in done.stdout


def test_a_line_longer_than_any_trace_row_is_refused(tmp_path):
    path = tmp_path / "long.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens,prefix_id,prefix_tokens\n"
                    f"10,5,{'p' * (MAX_LINE_CHARS + 10)},1\n")
    with pytest.raises(BadArgument, match="line 2 runs past"):
        load_trace(path)


def test_a_trace_longer_than_any_simulation_is_refused_while_it_is_read(tmp_path, monkeypatch):
    import allocator.trace as trace_mod

    monkeypatch.setattr(trace_mod, "MAX_TRACE_REQUESTS", 3)
    path = tmp_path / "t.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n" + "10,5\n" * 4)
    with pytest.raises(BadArgument, match="more than 3 requests"):
        load_trace(path)


# ------------------------------------------------------------- reading a JSON or TOML document
def _as_model(path, tmp_path):
    """simulate's argv reading `path` as --model (a folder whose config.json is `path`)."""
    trace = tmp_path / "t.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n10,5\n")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").symlink_to(path)
    return ["simulate", "--trace", str(trace), "--model", str(folder)]


def _as_saved_probe(path, tmp_path):
    return ["probe", "--from", str(path)]


def _as_grid(path, tmp_path):
    grid = tmp_path / "grid.json"
    grid.symlink_to(path)
    return ["sweep", str(grid), "--dry-run"]


READERS = {"model config": _as_model, "probe --from": _as_saved_probe, "sweep grid": _as_grid}
RAW_DOCUMENTS = {"nested": ("[" * 100000 + "]" * 100000, "nested too deep"),
                 "over a MiB": (" " * (2 << 20) + "{}", "over 1 MiB")}


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("raw", sorted(RAW_DOCUMENTS))
def test_a_document_no_parser_takes_is_refused_in_one_line(reader, raw, tmp_path, capsys):
    text, says = RAW_DOCUMENTS[raw]
    path = tmp_path / "doc.json"
    path.write_text(text)
    argv = READERS[reader](path, tmp_path)
    assert exit_code(argv) == 2
    line = one_line(capsys)
    if reader != "sweep grid":          # a grid's parser is not Python's: it says its own words
        assert says in line
    else:
        assert "grid" in line


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_document_that_never_ends_is_refused_after_a_bounded_read(reader, tmp_path, capsys):
    assert exit_code(READERS[reader]("/dev/zero", tmp_path)) == 2
    assert "over 1 MiB" in one_line(capsys)


def test_a_byte_order_mark_before_a_document_is_read_past(tmp_path, capsys):
    from allocator.serving.models import CONFIG_DIR

    config = tmp_path / "bom.json"
    config.write_bytes(b"\xef\xbb\xbf" + (CONFIG_DIR / "tiny-qwen2.json").read_bytes())
    argv = _as_model(config, tmp_path) + ["--json"]
    assert exit_code(argv) == 0
    with_mark = json.loads(capsys.readouterr().out)["results"][0]
    argv[argv.index("--model") + 1] = "tiny-qwen2"
    assert exit_code(argv) == 0
    plain = json.loads(capsys.readouterr().out)["results"][0]
    for key in ("kv_pool_tokens", "duration_s", "output_tps"):
        assert with_mark[key] == plain[key], key


# ------------------------------------------------------------------------ allocator options
def test_a_bucket_count_no_refresh_could_learn_is_refused_at_once():
    AllocatorConfig(n_buckets=MAX_BUCKETS)
    with pytest.raises(BadArgument, match="--buckets"):
        AllocatorConfig(n_buckets=100_000_000)


def test_simulate_refuses_too_many_buckets_before_any_work(tmp_path, capsys, monkeypatch):
    import allocator.serving.sim.cli as simulate_cli

    def must_not_run(*a, **k):
        raise AssertionError("the simulation started before --buckets was checked")
    monkeypatch.setattr(simulate_cli, "simulate", must_not_run)
    path = tmp_path / "t.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n10,20\n")
    assert exit_code(["simulate", "--trace", str(path), "--buckets", "100000000"]) == 2
    assert "--buckets" in one_line(capsys)


@pytest.mark.parametrize("field, value", [
    ("large_share", "0.5"), ("initial_bounds", ("x",)),
    ("initial_bounds", (0,)), ("byte_alignment", True),
])
def test_allocator_config_values_of_the_wrong_kind_are_bad_arguments(field, value):
    with pytest.raises(BadArgument, match=field):
        AllocatorConfig(**{field: value})


# ------------------------------------------------------------------------ fuzz
CELLS = ["0", "1", "7", "16", "300", "4096", "-1", "-0", "1.0", "2.5", "1e3", "1e30",
         "99999999999999999999999", "10000001", "nan", "inf", "-inf", "NaN", "", " ", " 12 ",
         "0x10", "١٢", "abc", '"5"', "'5'", "1,2", "\t3", "None", "True"]
HEADERS = [
    ["num_prefill_tokens", "num_decode_tokens"],
    ["num_prefill_tokens", "num_decode_tokens", "arrived_at"],
    ["arrived_at", "num_decode_tokens", "num_prefill_tokens"],
    ["num_prefill_tokens", "num_decode_tokens", "prefix_id", "prefix_tokens", "offer_id"],
    ["num_prefill_tokens", "num_decode_tokens", "arrived_at", "prefix_id", "prefix_tokens"],
    ["num_prefill_tokens", "num_decode_tokens", "num_prefill_tokens"],
    ["num_prefill_tokens", "num_decode_tokens", "arrived_at", "arrived_at"],
    ["num_prefill_tokens"],
    ["prompt", "output"],
    [" num_prefill_tokens", "num_decode_tokens "],
    [],
]


def _fuzz_trace(rng: random.Random, prefixed: bool = False) -> bytes:
    """Random trace bytes; mostly a sane trace (naming prefixes when `prefixed`), so that runs
    get to the simulation, else junk of every kind."""
    shape = rng.random()
    if shape < 0.05:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300)))
    if shape < 0.08:
        return b"" if rng.random() < 0.5 else b"\x00" * rng.randint(1, 5000)
    sane = shape < 0.7
    header = list(rng.choice(HEADERS[3:5] if prefixed else HEADERS[:5] if sane else HEADERS))
    rows = []
    for _ in range(rng.randint(1 if sane else 0, 8)):
        row = [str(rng.randint(1, 400)), str(rng.randint(1, 200))]
        row += [str(round(rng.uniform(0, 20), 3)) for _ in header[2:]]
        if "prefix_id" in header:
            name = rng.choice(["", "sys", "a"])
            row[header.index("prefix_id")] = name
            if "prefix_tokens" in header:
                row[header.index("prefix_tokens")] = str(rng.randint(1, 5) if name else 0)
        if not sane and rng.random() < 0.5:
            row = [rng.choice(CELLS) for _ in range(max(1, len(header) + rng.randint(-1, 1)))]
        rows.append(row)
    newline = rng.choice(["\n", "\r\n", "\r"])
    text = newline.join(",".join(r) for r in [header] + rows)
    if rng.random() < 0.7:
        text += newline                                     # else: no final line break
    if not sane and rng.random() < 0.2:
        text = text.replace(",", ";")
    if not sane and rng.random() < 0.2:
        text = '"' + text                                   # an unclosed quote
    data = text.encode()
    if rng.random() < 0.15:
        data = b"\xef\xbb\xbf" + data                       # a byte-order mark
    if not sane and rng.random() < 0.1:
        data = data.replace(b"1", b"\xff", 1)               # not UTF-8
    return data


# option -> (ordinary values, extreme values the parser takes, values it must refuse)
SIMULATE_OPTIONS = {
    "--requests": (["1", "3", "6"], [], ["0", "-1", "nan", "1e3"]),
    "--rate": (["1", "0.5,2"], ["1e-300", "5e-324", "1e300", "1e-9,1e9"],
               ["0", "-1", "nan", "1,inf", ""]),
    "--time-scale": (["1", "0.1"], ["1e-300", "1e300"], ["0", "nan", "inf"]),
    "--seed": (["0", "7"], [str(2**63 - 1)], ["-1", str(2**63), "1.5"]),
    "--policy": (["odma", "static", "paged", "s3", "oracle", "elastic", "odma,paged"], [],
                 ["magic", "", ","]),
    "--max-model-len": (["512", "4096"], ["1", "16", "131072"], ["0", "100000000"]),
    "--buckets": (["1", "8"], [str(MAX_BUCKETS)], [str(MAX_BUCKETS + 1), "100000000", "0"]),
    "--alpha": (["0", "1"], ["1e308"], ["-1", "nan", "inf"]),
    "--tau": (["0", "4"], ["1e308"], ["-1", "nan", "inf"]),
    "--large-share": (["0", "0.1"], ["0.999999"], ["1", "nan", "-0.1"]),
    "--predictor": (["online", "oracle", "noisy"], [], ["magic"]),
    "--bucket-rule": (["min-waste", "occupancy"], [], ["x"]),
    "--cold-start": (["prediction", "equal-width"], [], ["x"]),
    "--max-batch": (["1", "2", "256"], ["1000000000"], ["0"]),
    "--page-tokens": (["1", "16"], ["4096", "1000000000"], ["0"]),
    "--kv-pool-gb": (["0.5", "4"], ["1e-9", "8.7", "1e9"], ["0", "nan", "-1"]),
    "--mfu": (["0.5", "1"], ["0.001"], ["2", "0", "nan", "1e-300", "5e-324"]),
    "--memory-utilization": (["0.9", "1"], ["0.01"], ["2", "0"]),
    "--tp": (["1", "2"], ["64", "1000000"], ["0"]),
    "--replicas": (["1", "3"], ["100000"], ["0"]),
    "--model": (["deepseek-r1-distill-qwen-7b", "llama-2-7b", "qwen2.5-7b"], [], ["gpt-5"]),
    "--dtype": (["bf16", "int8"], [], ["fp4"]),
    "--preemption": (["recompute", "swap"], [], ["offload"]),
    "--swap-space": (["0", "4"], ["1e-300", "1e9", "9.2e9"], ["-1", "nan", "inf", "1e300"]),
    "--cobatch": (["0", "4"], ["1000000000"], ["-1", "1.5"]),
    "--demand-bound": (["0", "1", "none"], ["1e308"], ["-1", "nan", "inf", "some"]),
}
PREFIX_OPTIONS = {
    "--cache-device-gb": (["0", "0.01", "1"], ["1e9", "1e300"], ["nan", "-1"]),
    "--cache-host-gb": (["0", "16"], ["1e20", "1e300"], ["inf"]),
    "--cache-disk-gb": (["0", "64"], ["1e20", "1e300"], ["inf"]),
    "--prefetch": (["0", "2"], ["1000000000"], ["-1"]),
    "--eviction": (["lru", "fifo", "random"], [], ["x"]),
    "--pcie-gbps": (["25"], ["0.001", "1e6"], ["0", "1e-300", "1e300"]),
    "--disk-read-gbps": (["3"], ["0.001", "1e6"], ["0", "1e-300", "1e300"]),
    "--disk-write-gbps": (["2"], ["0.001", "1e6"], ["0", "1e-320"]),
}
REPLAY_OPTIONS = {name: SIMULATE_OPTIONS[name] for name in (
    "--policy", "--buckets", "--alpha", "--tau", "--large-share", "--predictor",
    "--bucket-rule", "--cold-start")}
REPLAY_OPTIONS["--policy"] = (["odma", "static", "s3", "paged", "oracle"], [], ["magic"])
REPLAY_OPTIONS["--step-seconds"] = (["0.05"], ["1e-9", "1e-30", "1e300"], ["0", "nan", "inf"])
REPLAY_OPTIONS["--rate"] = (["1"], ["1e-300", "5e-324", "1e300"], ["0", "nan"])
WORKLOAD_OPTIONS = {    # ordinary sizes stay small: a fuzz case is quick
    "--requests": (["1", "50"], [], ["0", "-5", "nan", "1e3", "10000001", "1000000000"]),
    "--prefixes": (["1", "3"], ["10000000"], ["0", "1000000000000"]),
    "--conversations": (["1", "5"], [], ["0", "1000001", "100000000"]),
    "--system-tokens": (["1", "512"], ["16000", "16382"], ["16383", "16384", "0", "1e9"]),
    "--turns": (["1", "3"], ["1e300"], ["0.5", "nan", "inf", "-2"]),
    "--rate": (["1", "100"], ["1e-310", "1e-300", "1e-6", "1e300"], ["nan", "inf", "0"]),
    "--seed": (["0", "3"], [str(2**63 - 1)], [str(2**63), "-1"]),
}


def _options(rng: random.Random, table: dict, most: int) -> list[str]:
    argv = []
    for name in rng.sample(sorted(table), rng.randint(0, most)):
        ordinary, extreme, refused = table[name]
        group = rng.choices([ordinary, extreme or ordinary, refused], [0.55, 0.3, 0.15])[0]
        argv += [name, rng.choice(group)]
    return argv


def _fuzz_simulate(rng: random.Random, trace: str) -> list[str]:
    argv = ["simulate", "--trace", trace, "--json", "--requests", str(rng.randint(1, 6))]
    argv += _options(rng, SIMULATE_OPTIONS, 4)
    if rng.random() < 0.3:
        argv.append("--clip")
    if rng.random() < 0.25:
        argv += ["--prefix-cache"] + _options(rng, PREFIX_OPTIONS, 3)
    return argv


def _fuzz_replay(rng: random.Random, trace: str) -> list[str]:
    return ["replay", "--trace", trace, "--device", "none", "--json"] + _options(
        rng, REPLAY_OPTIONS, 4)


def _fuzz_workload(rng: random.Random, out: str) -> list[str]:
    # --prefixes 10000000 with few requests is quick: the templates are one array
    return ["workload", rng.choice(["text-analysis", "chat"]), "--out", out] + _options(
        rng, WORKLOAD_OPTIONS, 4)


def _ends_in_one_line(argv, capsys) -> str | None:
    """None when `argv` exits 0, or 2 / 3 with one line on stderr; else what happened."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            code = exit_code(argv)
    except Exception as exc:    # noqa: BLE001 - any escape is what these tests look for
        capsys.readouterr()
        return f"{argv}: {type(exc).__name__}: {exc}"[:400]
    err = capsys.readouterr().err.strip()
    if code not in (0, 2, 3) or (code != 0 and len(err.splitlines()) != 1):
        return f"{argv}: exit {code}, stderr {err[-300:]!r}"
    return None


@pytest.fixture(scope="module")
def chat_trace(tmp_path_factory):
    from allocator.trace import write_trace

    path = tmp_path_factory.mktemp("chat") / "chat.csv"
    write_trace(workloads.chat(4, seed=1), path)
    return str(path)


EXTREME_RUNS = [
    [option, value] + (["--prefix-cache"] if table is PREFIX_OPTIONS else [])
    for table in (SIMULATE_OPTIONS, PREFIX_OPTIONS)
    for option, (_, extreme, _) in table.items() for value in extreme] + [
    ["--predictor", "noisy", "--alpha", "1e308"],      # uncertain predictions inflated to inf
]


@pytest.mark.parametrize("args", EXTREME_RUNS, ids=" ".join)
def test_each_extreme_option_value_alone_ends_in_0_2_or_3(args, chat_trace, capsys,
                                                          tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ODMA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "odma-cache"))
    argv = ["simulate", "--trace", chat_trace, "--json", "--requests", "4"] + args
    assert _ends_in_one_line(argv, capsys) is None


FUZZ_CASES = 200


def test_fuzzed_traces_and_options_end_in_0_2_or_3_and_never_a_traceback(tmp_path, capsys,
                                                                        monkeypatch):
    """A fixed seed: the same cases every run. Every case that ends otherwise than 0, or 2 / 3
    with one line on stderr, is collected, so that one run lists them all."""
    monkeypatch.setenv("ODMA_CACHE_DIR", str(tmp_path / "cache"))
    rng = random.Random(20240611)
    failures = []
    for case in range(FUZZ_CASES):
        trace = tmp_path / f"t{case}.csv"
        which = rng.random()
        if which < 0.6:
            argv = _fuzz_simulate(rng, str(trace))
        elif which < 0.8:
            argv = _fuzz_replay(rng, str(trace))
        else:
            argv = _fuzz_workload(rng, str(tmp_path / f"w{case}.csv"))
        trace.write_bytes(_fuzz_trace(rng, prefixed="--prefix-cache" in argv))
        failure = _ends_in_one_line(argv, capsys)
        if failure:
            failures.append(failure)
    assert not failures, f"{len(failures)} of {FUZZ_CASES} cases:\n" + "\n".join(failures)


@pytest.mark.parametrize("command", ["simulate", "engine"])
def test_a_swap_space_no_byte_count_holds_is_refused_as_it_is_parsed(command, chat_trace,
                                                                    capsys):
    """Both take int(GB x 1e9) bytes: 1e300 GB overflowed it only once the engine had built its
    model. The largest that fits (2**63 - 1 bytes) is taken."""
    from odma_cli.main import build_parser

    argv = [command, "--trace", chat_trace, "--preemption", "swap", "--swap-space"]
    assert exit_code(argv + ["1e300"]) == 2
    assert "--swap-space" in one_line(capsys)
    assert build_parser().parse_args(argv + ["9.2e9"]).swap_space == 9.2e9


@pytest.mark.parametrize("option, value", [("--mfu", "1e-300"), ("--mfu", "5e-324"),
                                           ("--pcie-gbps", "1e-300"),
                                           ("--disk-read-gbps", "1e-320")])
def test_an_efficiency_or_bandwidth_no_card_may_hold_is_refused_as_it_is_parsed(
        option, value, chat_trace, capsys):
    """A card file refuses an MFU below 0.001 and a bandwidth below 1 MB/s; the same figure
    given as an option once made every latency 1e300 s or NaN, with exit 0."""
    argv = ["simulate", "--trace", chat_trace, "--prefix-cache", option, value]
    assert exit_code(argv) == 2
    assert option in one_line(capsys)


def test_a_replay_step_finer_than_a_count_of_steps_holds_is_refused(tmp_path, capsys):
    path = tmp_path / "t.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens,arrived_at\n10,5,0\n20,5,100\n")
    argv = ["replay", "--trace", str(path), "--device", "none", "--json"]
    assert exit_code(argv + ["--step-seconds", "1e-30"]) == 2
    assert "--step-seconds 1e-30" in one_line(capsys)
    assert exit_code(argv + ["--step-seconds", "1e-9"]) == 0       # 1e11 steps: still a count
    assert json.loads(capsys.readouterr().out)["steps"] > 10**11


@pytest.mark.parametrize("argv", [
    ["replay", "--trace", "{trace}", "--device", "none", "--plot", ""],
    ["replay", "--trace", "{trace}", "--device", ""],
    ["simulate", "--trace", "{trace}", "--plot", " "],
    ["simulate", "--trace", "{trace}", "--timing", ""],
    ["advise", "--trace", "{trace}", "--plot", ""],
    ["probe", "--device", "emu:lpddr5-6400", "--plot", ""],
    ["workload", "chat", "--out", ""],
    ["calibrate", "--out", ""],
    ["sweep", "g.toml", "--out", ""],
], ids=lambda argv: " ".join(argv[:1] + argv[-2:-1]))
def test_an_empty_path_or_name_is_refused_not_taken_for_the_default(argv, chat_trace, capsys):
    """An empty --plot drew no plot, an empty --timing took the card's, an empty sweep --out
    wrote to the default folder: each said nothing."""
    argv = [a.format(trace=chat_trace) for a in argv]
    assert exit_code(argv) == 2
    line = one_line(capsys)
    assert argv[-2] in line and "must not be empty" in line


@pytest.mark.parametrize("command", ["simulate", "advise", "engine"])
def test_a_kv_pool_no_card_may_hold_is_refused_naming_the_option(command, chat_trace, capsys):
    assert exit_code([command, "--trace", chat_trace, "--kv-pool-gb", "1e-300"]) == 2
    assert "--kv-pool-gb: must be a number in [1e-06, 1e+06]" in one_line(capsys)
