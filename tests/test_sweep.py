"""`odma-hw sweep GRID`: grid files, cells checked before anything runs (per axis value, so a
million cells take no time), content hashes (arguments, the files they name, the code), the
results table and log, the printed table, --plot, output that cannot be written, --resume (no
Ray when nothing is left), Ctrl-C, and sweeps on a local two-worker Ray. The log's framing is
in test_sweep_log.py.

The Ray tests share one local Ray (a module fixture: starting Ray costs seconds) and a `fake`
command defined in this module, whose cells can fail or kill their own worker on demand.
"""

from __future__ import annotations

import collections
import csv
import errno
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from odma_cli import sweep
from odma_cli.commands import registry
from odma_cli.errors import BadArgument
from odma_cli.main import main

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


# --------------------------------------------------------------------- the fake command
def register(subparsers):
    """`fake`: a command for sweeps under test (cells that fail or kill their worker)."""
    p = subparsers.add_parser("fake")
    p.add_argument("--x", type=int, default=0)
    p.add_argument("--label", default="a", choices=["a", "b", "c"])
    p.add_argument("--rows", action="store_true", help="return two results, as simulate does")
    p.add_argument("--fail-while", default=None, metavar="DIR",
                   help="raise while this folder exists")
    p.add_argument("--die-while", default=None, metavar="DIR",
                   help="kill the worker process while this folder exists")
    p.add_argument("--input", default=None, metavar="FILE")
    p.add_argument("--json", action="store_true")


DEFAULT_METRIC = "square"           # the fake command's, as a real command says its own


def compute(args) -> dict:
    if args.die_while and os.path.isdir(args.die_while):
        os._exit(1)
    if args.fail_while and os.path.isdir(args.fail_while):
        raise BadArgument(f"fake failure for x={args.x}")
    if args.rows:
        return {"schema": "fake/1", "results": [
            {"policy": "odma", "tps": 10.0 * args.x, "x": args.x},
            {"policy": "paged", "tps": 5.0 * args.x, "x": args.x}]}
    return {"schema": "fake/1", "x": args.x, "square": args.x ** 2,
            "nested": {"pid": os.getpid(), "deep": {"label": args.label}},
            "series": [1, 2, 3]}


@pytest.fixture
def fake_command(monkeypatch):
    monkeypatch.setitem(registry(), "fake", __name__)


def write_grid(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_log(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# --------------------------------------------------------------------- grids and cells
def test_cells_are_the_product_of_the_axes_last_axis_fastest(tmp_path, fake_command):
    grid = sweep.load_grid(write_grid(tmp_path / "g.toml", """
        command = "fake"
        [fixed]
        label = "b"
        [axes]
        x = [1, 2]
        rows = [false, true]
        """))
    assert grid.cells() == [{"x": 1, "rows": False}, {"x": 1, "rows": True},
                            {"x": 2, "rows": False}, {"x": 2, "rows": True}]
    cells = sweep.plan(grid).cells
    assert [c.argv for c in cells[:2]] == [
        ("fake", "--label", "b", "--x", "1", "--json"),
        ("fake", "--label", "b", "--x", "1", "--rows", "--json")]


def test_zipped_axes_vary_together(tmp_path, fake_command):
    grid = sweep.load_grid(write_grid(tmp_path / "g.toml", """
        command = "fake"
        zip = [["x", "label"]]
        [axes]
        x = [1, 2, 3]
        label = ["a", "b", "c"]
        rows = [false, true]
        """))
    assert grid.dimensions() == [("x", "label"), ("rows",)]
    cells = grid.cells()
    assert len(cells) == 6
    assert {(c["x"], c["label"]) for c in cells} == {(1, "a"), (2, "b"), (3, "c")}


def test_yaml_and_json_grids_mean_the_same_as_toml(tmp_path, fake_command):
    pytest.importorskip("yaml", reason="YAML grids need PyYAML (installed with Ray)")
    toml = sweep.load_grid(write_grid(tmp_path / "g.toml", 'command = "fake"\n'
                                      '[axes]\nx = [1, 2]\ntime_scale = [0.5]\n'))
    yaml = sweep.load_grid(write_grid(tmp_path / "g.yaml",
                                      "command: fake\naxes:\n  x: [1, 2]\n  time-scale: [0.5]\n"))
    js = sweep.load_grid(write_grid(tmp_path / "g.json", json.dumps(
        {"command": "fake", "axes": {"x": [1, 2], "--time-scale": [0.5]}})))
    assert toml.cells() == yaml.cells() == js.cells() == [
        {"x": 1, "time-scale": 0.5}, {"x": 2, "time-scale": 0.5}]


def test_a_folder_given_as_the_grid_is_named_a_folder(tmp_path):
    with pytest.raises(BadArgument, match="is a folder: give the grid file"):
        sweep.load_grid(str(tmp_path))


@pytest.mark.parametrize("name, text", [
    ("g.json", '{"command": "fake", "axes": {"x": [1]}, "axes": {"x": [2]}}'),
    ("g.yaml", "command: fake\naxes:\n  x: [1]\naxes:\n  x: [2]\n"),
    ("g.yaml", "command: fake\naxes:\n  x: [1]\n  x: [2]\n"),
])
def test_a_key_given_twice_in_a_json_or_yaml_grid_is_refused(tmp_path, fake_command, name,
                                                              text):
    if name.endswith(".yaml"):
        pytest.importorskip("yaml", reason="YAML grids need PyYAML (installed with Ray)")
    with pytest.raises(BadArgument, match="duplicate key") as exc:
        sweep.load_grid(write_grid(tmp_path / name, text))     # not the last one, silently
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("text,match", [
    ('command = "fake"\nsweep = 1\n', "unknown key 'sweep'"),
    ('command = "probe"\n', "command must be one of"),
    ('command = "fake"\n[axes]\nx = []\n', "axis 'x' must be a non-empty list"),
    ('command = "fake"\n[fixed]\nx = [1, 2]\n', "fixed 'x' is a list"),
    ('command = "fake"\n[fixed]\nx = 1\n[axes]\nx = [2]\n', "'x' is given twice"),
    ('command = "fake"\nzip = [["x", "y"]]\n[axes]\nx = [1]\n', "'y', which is not an axis"),
    ('command = "fake"\nzip = [["x", "label"]]\n[axes]\nx = [1, 2]\nlabel = ["a"]\n',
     "equal lengths, not x 2, label 1"),
    ('command = "fake"\n[axes\n', "malformed TOML"),
])
def test_malformed_grids_are_refused_in_one_line(tmp_path, fake_command, text, match):
    with pytest.raises(BadArgument, match=match) as exc:
        sweep.load_grid(write_grid(tmp_path / "g.toml", text))
    assert "\n" not in str(exc.value)


@pytest.fixture
def no_ray(monkeypatch):
    """Refusals must come before Ray is even imported (so before any cell runs)."""
    def refuse():
        raise AssertionError("the sweep reached Ray before refusing its grid")
    monkeypatch.setattr(sweep, "import_ray", refuse)


@pytest.mark.parametrize("axes,match", [
    ('spec = ["lpddr5-6400"]\ngran = [64]',
     r"cell 0 \(spec=lpddr5-6400 gran=64\): gran: `odma-hw emulate` has no option --gran"),
    ('pattern = ["seq", "rand", "zigzag"]',
     r"cell 2 \(pattern=zigzag\): argument --pattern: invalid choice: 'zigzag'"),
    ('spec = ["lpddr5-6400", "lpddr9"]',
     r"cell 1 \(spec=lpddr9\): spec: unknown emulator preset 'lpddr9'"),
    ('granularity = [64, "lots"]',
     r"cell 1 \(granularity=lots\): granularity: --granularity must be an integer"),
    ('seed = [1, 2.5]', r"cell 1 \(seed=2.5\): argument --seed: invalid int value: '2.5'"),
    ('wck-always-on = [1]', r"cell 0 \(wck-always-on=1\): wck-always-on: --wck-always-on is a "
                            r"flag: give true or false"),
    ('plot = ["a.png"]', r"cell 0 \(plot=a.png\): plot: a cell takes no --plot"),
])
def test_unknown_options_and_values_are_refused_before_any_cell_runs(
        tmp_path, capsys, no_ray, axes, match):
    grid = write_grid(tmp_path / "g.toml", f'command = "emulate"\n[axes]\n{axes}\n')
    out = tmp_path / "out"
    assert main(["sweep", grid, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("odma-hw: error: ")
    assert __import__("re").search(match, err), err
    assert not out.exists()


# what each command refuses only once it looks at all its values together (a queue depth, a TP
# the model's heads do not split into, a --max-tokens below the trace's longest request)
CELL_CHECKS = [
    ("emulate", 'queue = [32, 0]', "cell 1 (queue=0): queue: queue depth"),
    ("emulate", 'seed = [-1]', "cell 0 (seed=-1): seed: seed must be a non-negative"),
    ("emulate", 'write-high = [2.0]', "write high watermark must be a fraction"),
    ("emulate", 'write-ratio = ["nan"]', "--write-ratio must be in [0, 1]"),
    ("emulate", 'threads = [0]', "threads must be a positive integer"),
    ("emulate", 'granularity = [64, 3]', "cell 1 (granularity=3): traffic: granularity 3"),
    ("emulate", 'footprint = [3]', "footprint 3 is smaller"),
    ("simulate", 'tp = [3]', "cell 0 (tp=3): simulate: --tp 3 does not split"),
    ("simulate", 'memory-utilization = [2.0]', "memory utilization must be in (0, 1]"),
    ("simulate", 'kv-pool-gb = [1000]', "does not fit on a mlu370-x4 card"),
    ("simulate", 'prefix-cache = [true]', "names no prefixes"),
    ("simulate", 'rate = [2.0]\ntime-scale = [0.5]', "which --rate replaces: give one"),
    ("replay", 'rate = [2.0]\ntime-scale = [0.5]', "which --rate replaces: give one"),
    ("replay", 'max-tokens = [1]', "cell 0 (max-tokens=1): replay: --max-tokens 1 is below"),
    ("replay", 'device = ["none", "bogus"]', "cell 1 (device=bogus): replay: unknown device"),
    ("replay", 'step-seconds = [1e-30]', "more steps than a count holds"),
]


@pytest.mark.parametrize("command, axes, says", CELL_CHECKS, ids=lambda x: x[:24])
def test_what_a_cell_refuses_as_a_whole_is_refused_before_any_cell_runs(
        tmp_path, capsys, no_ray, command, axes, says):
    trace = tmp_path / "t.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens,arrived_at\n10,5,0\n20,5,100\n")
    fixed = "" if command == "emulate" else f'[fixed]\ntrace = "{trace}"\n'
    grid = write_grid(tmp_path / "g.toml", f'command = "{command}"\n{fixed}[axes]\n{axes}\n')
    out = tmp_path / "out"
    assert main(["sweep", grid, "--out", str(out), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert not out.exists()


def test_a_missing_trace_is_refused_naming_the_cell(tmp_path, capsys, no_ray):
    grid = write_grid(tmp_path / "g.toml", 'command = "replay"\n[axes]\n'
                      f'trace = ["{REPO}/nowhere.csv"]\npolicy = ["odma"]\n')
    assert main(["sweep", grid]) == 2
    assert "cell 0 (trace=" in capsys.readouterr().err


PLOT_GRID = """
    command = "emulate"
    zip = [["spec", "channels"]]
    [axes]
    spec = ["lpddr5-6400", "lpddr4-4266"]
    channels = [1, 2]
    pattern = ["seq", "rand"]
    granularity = [32, 64]
    """


@pytest.mark.parametrize("options,match", [
    (["--plot-x", "gran"], r"--plot-x 'gran' is not an axis of .*g.toml \(its axes: spec, "
                           r"channels, pattern, granularity\)"),
    (["--plot-series", "seed"], r"--plot-series 'seed' is not an axis"),
    (["--plot-fix", "spec=lpddr9"], r"--plot-fix 'spec=lpddr9': spec has no value 'lpddr9' "
                                    r"\(its values: lpddr5-6400, lpddr4-4266\)"),
    (["--plot-fix", "spec"], r"--plot-fix 'spec': expected AXIS=VALUE"),
    (["--plot-fix", "spec=lpddr4-4266", "--plot-fix", "channels=1"],
     r"--plot-fix 'channels=1': spec/channels is held twice"),
    (["--plot-x", "pattern", "--plot-fix", "pattern=seq"],
     r"--plot-x pattern is also held by --plot-fix"),
    (["--plot-x", "spec", "--plot-series", "channels"],
     r"--plot-series channels varies with --plot-x spec \(a zip group"),
    (["--plot-fix", "spec=lpddr5-6400", "--plot-fix", "pattern=seq", "--plot-fix",
      "granularity=64"], r"--plot-fix holds every axis"),
])
def test_plot_axes_and_values_are_checked_before_any_cell_runs(tmp_path, capsys, no_ray,
                                                                options, match):
    pytest.importorskip("matplotlib")
    grid = write_grid(tmp_path / "g.toml", PLOT_GRID)
    png = tmp_path / "p.png"
    assert main(["sweep", grid, "--out", str(tmp_path / "out"), "--plot", str(png),
                 *options]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and __import__("re").search(match, err), err
    assert not png.exists() and not (tmp_path / "out").exists()


def test_a_grid_of_three_axes_plots_and_the_plot_is_checked_up_front(tmp_path, capsys, no_ray):
    pytest.importorskip("matplotlib")
    grid = write_grid(tmp_path / "g.toml", PLOT_GRID)
    png = str(tmp_path / "p.png")
    # the other axes are held (at their first value, or where --plot-fix says)
    assert main(["sweep", grid, "--dry-run", "--plot", png]) == 0
    assert main(["sweep", grid, "--dry-run", "--plot", png, "--plot-x", "granularity",
                 "--plot-series", "pattern", "--plot-fix", "channels=2"]) == 0
    capsys.readouterr()
    assert main(["sweep", grid, "--plot", str(tmp_path / "no" / "p.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["sweep", grid, "--plot-x", "granularity"]) == 2
    assert "--plot-x shapes the plot: give --plot PNG too" in capsys.readouterr().err


def test_without_ray_the_sweep_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    grid = write_grid(tmp_path / "g.toml", 'command = "emulate"\n[axes]\nrequests = [10]\n')
    assert main(["sweep", grid, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "pip install 'odma-hw[sweep]'" in err and err.count("\n") == 1


def test_an_unreachable_address_fails_in_one_line(tmp_path, capsys, no_ray):
    with socket.socket() as s:      # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    grid = write_grid(tmp_path / "g.toml", 'command = "emulate"\n[axes]\nrequests = [10]\n')
    assert main(["sweep", grid, "--address", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert f"no Ray cluster answers at 127.0.0.1:{port}" in err and err.count("\n") == 1
    assert main(["sweep", grid, "--address", "nonsense"]) == 2
    assert "expected auto, HOST:PORT or ray://HOST:PORT" in capsys.readouterr().err


def test_dry_run_lists_every_cell_with_its_command_line(tmp_path, capsys):
    grid = write_grid(tmp_path / "g.toml", 'command = "emulate"\n[fixed]\nrequests = 100\n'
                      '[axes]\npattern = ["seq", "rand"]\n')
    assert main(["sweep", grid, "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[2:] for line in lines] == [
        ["todo", "odma-hw emulate --requests 100 --pattern seq --json"],
        ["todo", "odma-hw emulate --requests 100 --pattern rand --json"]]
    assert sweep.default_out(grid) == str(tmp_path / "g-sweep")   # next to the grid, named for it


def _million_cell_grid(path: Path, axes: int = 2) -> str:
    values = {"seed": list(range(1, 1001)), "requests": list(range(1, 1001))} if axes == 2 else {
        "seed": list(range(1, 101)), "requests": list(range(1, 101)),
        "granularity": [32 * i for i in range(1, 101)]}
    return write_grid(path, 'command = "emulate"\n[axes]\n' + "".join(
        f"{name} = {v}\n" for name, v in values.items()))


def test_a_million_cell_grid_is_checked_per_axis_value_not_per_cell(tmp_path, monkeypatch):
    grid = sweep.load_grid(_million_cell_grid(tmp_path / "big.toml"))
    parser = sweep.command_parser(registry()["emulate"], "emulate")
    calls = collections.Counter()
    # the checks run in sweep.cells, which reads its own _verdict
    parse, verdict = parser.parse_args, sweep.cells._verdict

    def counted_parse(argv):
        calls["parse"] += 1
        assert calls["parse"] <= 2001, "every cell is parsed"
        return parse(argv)

    def counted_verdict(check, args):
        calls[check.key] += 1
        return verdict(check, args)
    monkeypatch.setattr(parser, "parse_args", counted_parse)
    monkeypatch.setattr(sweep.cells, "_verdict", counted_verdict)
    cells = sweep.plan(grid).cells
    assert len(cells) == 10 ** 6
    # a value check runs once per distinct value of what it reads
    assert (calls["requests"], calls["spec"], calls["granularity"]) == (1000, 1, 1)
    # the cells made when asked for are the ones a parse of each cell gives
    for i in (0, 1, 999, 1000, 123_456, 999_999):
        c = cells[i]
        assert c.argv == ("emulate", "--seed", str(i // 1000 + 1), "--requests",
                          str(i % 1000 + 1), "--json")
        assert c.hash == sweep.content_hash("emulate", parse(list(c.argv[1:])))


def test_cells_made_on_demand_are_the_cells_of_a_parse_of_each(tmp_path, fake_command):
    for name, text in (("in.csv", "a\n"), ("same.csv", "a\n"), ("other.csv", "b\n")):
        (tmp_path / name).write_text(text)
    grid = sweep.load_grid(write_grid(tmp_path / "g.toml", f"""
        command = "fake"
        zip = [["x", "label"]]
        [fixed]
        input = "{tmp_path / 'in.csv'}"
        [axes]
        x = [1, 2, 3]
        rows = [false, true]
        label = ["a", "b", "c"]
        """))
    parser = sweep.command_parser(__name__, "fake")
    cells = sweep.plan(grid).cells
    assert [c.axes for c in cells] == grid.cells()
    for c in cells:
        argv = sweep.cell_argv(parser, {**grid.fixed, **c.axes}) + ["--json"]
        assert c.argv == ("fake", *argv)
        assert c.hash == sweep.content_hash("fake", parser.parse_args(argv))
    # the hash follows a file's content, not its name
    same = sweep.plan(sweep.load_grid(write_grid(tmp_path / "g.toml", (
        tmp_path / "g.toml").read_text().replace("in.csv", "same.csv")))).cells
    other = sweep.plan(sweep.load_grid(write_grid(tmp_path / "g.toml", (
        tmp_path / "g.toml").read_text().replace("same.csv", "other.csv")))).cells
    assert [c.hash for c in same] == [c.hash for c in cells]
    assert not {c.hash for c in other} & {c.hash for c in cells}


def test_a_million_cell_dry_run_lists_its_first_cell_at_once(tmp_path):
    grid = _million_cell_grid(tmp_path / "big.toml")
    proc = subprocess.Popen(
        ["bash", "-c", f'"{sys.executable}" -m odma_hw sweep "{grid}" --dry-run | head -n 1'],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)   # checking cell by cell took about 100 s
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert out.split("\t")[0] == "0" and out.rstrip().endswith(
        "odma-hw emulate --seed 1 --requests 1 --json"), (out, err)


def test_a_grid_plot_cannot_draw_is_refused_before_its_cells_are_made(
        tmp_path, capsys, no_ray, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(sweep, "plan", lambda grid: pytest.fail("the cells were made first"))
    grid = _million_cell_grid(tmp_path / "big.toml", axes=3)
    assert main(["sweep", grid, "--plot", str(tmp_path / "p.png"), "--plot-fix", "seed=0"]) == 2
    err = capsys.readouterr().err
    assert "seed has no value '0'" in err and err.count("\n") == 1
    assert not (tmp_path / "p.png").exists()


@pytest.fixture
def long_trace(tmp_path) -> Path:
    """A trace whose longest request is 3000 + 200 tokens."""
    path = tmp_path / "t.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n100,50\n3000,200\n")
    return path


@pytest.mark.parametrize("axes,match", [
    ("max-model-len = [4000, 1000]", r"cell 1 \(max-model-len=1000\): max-model-len: 1 requests "
                                     r"of t.csv exceed the 1000-token limit"),
    ('max-model-len = [1000]\nclip = [true, false]',
     r"cell 1 \(max-model-len=1000 clip=False\): max-model-len: .*pass --clip"),
    ('timing = ["emu:lpddr5-6400", "probe:/nonexistent"]',
     r"cell 1 \(timing=probe:/nonexistent\): timing: cannot read probe JSON /nonexistent"),
    ('timing = ["emu:lpddr5-6400", "emu:lpddr9"]',
     r"cell 1 \(timing=emu:lpddr9\): timing: unknown emulator preset 'lpddr9'"),
    ('timing = ["sim:x"]', r"cell 0 \(timing=sim:x\): timing: unknown timing source 'sim:x'"),
])
def test_simulate_cells_that_simulate_would_refuse_fail_the_dry_run(
        tmp_path, capsys, no_ray, long_trace, axes, match):
    grid = write_grid(tmp_path / "g.toml", f'command = "simulate"\n[fixed]\ntrace = '
                      f'"{long_trace}"\npolicy = "odma"\n[axes]\n{axes}\n')
    assert main(["sweep", grid, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and __import__("re").search(match, err), err


def test_a_torch_device_that_is_not_here_fails_the_dry_run(tmp_path, capsys, no_ray,
                                                          long_trace):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    grid = write_grid(tmp_path / "g.toml", f'command = "simulate"\n[fixed]\ntrace = '
                      f'"{long_trace}"\n[axes]\ntiming = ["live:torch:cpu", "live:torch:cuda"]\n')
    assert main(["sweep", grid, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"odma-hw: error: {grid}: cell 1 (timing=live:torch:cuda): timing: ")
    assert err.count("\n") == 1


def test_simulate_cells_that_fit_pass_the_dry_run(tmp_path, capsys, no_ray, long_trace):
    grid = write_grid(tmp_path / "g.toml", f'command = "simulate"\n[fixed]\ntrace = '
                      f'"{long_trace}"\n[axes]\nmax-model-len = [1000, 4000]\nclip = [true]\n')
    assert main(["sweep", grid, "--dry-run"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


@pytest.fixture
def no_cell_runs(monkeypatch):
    """Output checks come before any cell runs (but after Ray is found)."""
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'odma-hw[sweep]'")

    def refuse(*args, **kwargs):
        raise AssertionError("the sweep started Ray before checking its output")
    monkeypatch.setattr(sweep, "connect", refuse)


@pytest.mark.parametrize("folder", ["results.jsonl", "results.csv.tmp", "results.csv",
                                    "sweep.json"])
def test_a_folder_where_an_output_file_goes_fails_in_one_line_before_any_cell(
        tmp_path, capsys, no_cell_runs, folder):
    grid = write_grid(tmp_path / "g.toml", 'command = "emulate"\n[axes]\nrequests = [10]\n')
    out = tmp_path / "out"
    (out / folder).mkdir(parents=True)
    assert main(["sweep", grid, "--out", str(out)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "it is a folder" in err and folder in err, err


@pytest.mark.parametrize("name", ["results.csv", "results.parquet", "sweep.json"])
def test_an_out_holding_files_no_sweep_wrote_is_refused_and_left_as_it_is(
        tmp_path, capsys, no_cell_runs, name):
    grid = write_grid(tmp_path / "g.toml", 'command = "emulate"\n[axes]\nrequests = [10]\n')
    out = tmp_path / "mine"
    out.mkdir()
    (out / name).write_text("precious data\n")
    assert main(["sweep", grid, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and name in err and "another --out" in err, err
    assert sorted(p.name for p in out.iterdir()) == [name]
    assert (out / name).read_text() == "precious data\n"


@pytest.mark.parametrize("where", ["file", "under a file", "empty"])
def test_an_out_no_folder_can_be_is_bad_usage_in_one_line_before_any_cell(
        tmp_path, capsys, no_cell_runs, where):
    grid = write_grid(tmp_path / "g.toml", 'command = "emulate"\n[axes]\nrequests = [10]\n')
    (tmp_path / "afile").write_text("")
    out = {"file": str(tmp_path / "afile"), "under a file": str(tmp_path / "afile" / "x" / "y"),
           "empty": ""}[where]
    try:
        code = main(["sweep", grid, "--out", out])
    except SystemExit as exc:           # argparse's refusal of the empty one
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err, err
    assert (tmp_path / "afile").read_text() == "" and not (tmp_path / "g-sweep").exists()


def test_an_out_that_cannot_be_made_fails_in_one_line_before_any_cell(tmp_path, capsys,
                                                                      no_cell_runs):
    if not os.path.isdir("/sys/kernel"):
        pytest.skip("needs Linux's /sys, where not even root makes folders")
    grid = write_grid(tmp_path / "g.toml", 'command = "emulate"\n[axes]\nrequests = [10]\n')
    assert main(["sweep", grid, "--out", "/sys/odma-hw-sweep"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("odma-hw: error: cannot create --out '/sys/odma-hw-sweep': ")
    assert err.count("\n") == 1


def test_a_read_only_out_fails_in_one_line_before_any_cell(tmp_path, capsys, no_cell_runs):
    if os.geteuid() == 0:
        pytest.skip("root writes in read-only folders")
    grid = write_grid(tmp_path / "g.toml", 'command = "emulate"\n[axes]\nrequests = [10]\n')
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o500)
    try:
        assert main(["sweep", grid, "--out", str(out)]) == 3
    finally:
        out.chmod(0o700)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Permission denied" in err, err


# --------------------------------------------------------------------- content hashes
def _hashes(tmp_path, body: str, name="g.toml") -> list[str]:
    return [c.hash for c in sweep.plan(sweep.load_grid(write_grid(tmp_path / name, body))).cells]


def test_hashes_are_stable_and_follow_the_parsed_arguments(tmp_path, fake_command):
    a = _hashes(tmp_path, 'command = "fake"\n[axes]\nx = [1, 2]\n')
    assert a == _hashes(tmp_path, 'command = "fake"\n[axes]\nx = [1, 2]\n')
    assert len(set(a)) == 2
    # the parser's value and its default decide, not the spelling
    assert _hashes(tmp_path, 'command = "fake"\n[axes]\nx = ["01", 2]\n') == a
    assert _hashes(tmp_path, 'command = "fake"\n[fixed]\nlabel = "a"\n[axes]\nx = [1, 2]\n') == a
    assert _hashes(tmp_path, 'command = "fake"\n[fixed]\nlabel = "b"\n[axes]\nx = [1, 2]\n') != a
    # two spellings of one cell would collapse into one row: refused
    with pytest.raises(BadArgument, match=r"cell 1 \(x=01\): the same arguments as cell 0"):
        _hashes(tmp_path, 'command = "fake"\n[axes]\nx = [1, "01"]\n')


def test_hashes_follow_the_content_of_the_files_a_cell_reads(tmp_path, fake_command,
                                                              monkeypatch):
    data = tmp_path / "input.csv"
    data.write_text("num_prefill_tokens,num_decode_tokens\n10,20\n")
    grid = 'command = "fake"\n[axes]\ninput = ["{}"]\n'
    absolute = _hashes(tmp_path, grid.format(data))
    monkeypatch.chdir(tmp_path)
    assert _hashes(tmp_path, grid.format("input.csv")) == absolute   # same bytes, same cell
    data.write_text("num_prefill_tokens,num_decode_tokens\n10,21\n")
    assert _hashes(tmp_path, grid.format("input.csv")) != absolute   # edited trace: rerun


def test_the_code_digest_covers_the_packages_a_command_runs(fake_command):
    names = {name for name, _ in sweep.code_files("simulate")}
    assert {"odma_hw/emu/model.py", "odma_hw/native.py", "allocator/serving/options.py",
            "allocator/serving/configs/tiny-llama.json"} <= names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    # how the sweep runs and shows cells is not what they compute
    assert not any(n.startswith("odma_cli/sweep/") for n in names)
    if any(n.startswith("odma_hw/_native") for n in os.listdir(REPO / "odma_hw")):
        assert any(n.startswith("odma_hw/_native") for n in names)   # the built shim
    # the hardware layer imports nothing above it: an emulate cell runs none of the allocator
    assert not any(n.startswith("allocator/") for n, _ in sweep.code_files("emulate"))
    assert "test_sweep.py" in {n for n, _ in sweep.code_files("fake")}


def test_an_edit_to_the_code_changes_every_hash(tmp_path, fake_command, monkeypatch):
    source = tmp_path / "code.py"
    source.write_text("A = 1\n")
    # code_digest reads its list of files in sweep.log
    monkeypatch.setattr(sweep.log, "code_files", lambda command: [("code.py", str(source))])
    grid = 'command = "fake"\n[axes]\nx = [1, 2, 3]\n'
    before = _hashes(tmp_path, grid)
    assert _hashes(tmp_path, grid) == before
    source.write_text("A = 22\n")   # another size too: the digest is remembered per mtime and size
    after = _hashes(tmp_path, grid)
    assert len(set(after)) == 3 and not set(after) & set(before)
    args = sweep.command_parser(__name__, "fake").parse_args(["--x", "1", "--json"])
    assert sweep.content_hash("fake", args) == after[0]


# --------------------------------------------------------------------- rows of the table
def test_outputs_flatten_to_scalar_columns_and_results_lists_to_rows():
    assert sweep.output_rows({"a": 1, "b": {"c": 2.5, "d": {"e": "x"}}, "s": [1, 2],
                              "n": None}) == [{"a": 1, "b.c": 2.5, "b.d.e": "x", "n": None}]
    rows = sweep.output_rows({"schema": "s/1", "results": [
        {"policy": "odma", "tps": 1.0, "ttft_s": {"p50": 0.1}, "series": [0]},
        {"policy": "paged", "tps": 2.0, "ttft_s": {"p50": 0.2}, "series": [0]}]})
    assert rows == [{"schema": "s/1", "policy": "odma", "tps": 1.0, "ttft_s.p50": 0.1},
                    {"schema": "s/1", "policy": "paged", "tps": 2.0, "ttft_s.p50": 0.2}]


def test_an_output_key_named_like_an_axis_is_kept_as_out_key():
    cell = sweep.Cell(3, {"policy": "odma,paged"}, ("simulate", "--json"), "h")
    result = {"status": "ok", "error": None, "rows": [{"policy": "odma", "wall_seconds": 2.0}],
              "wall_seconds": 1.0, "warm_up_seconds": 0.0, "worker": "w"}
    (r,) = sweep.cell_records(cell, result)
    assert (r["policy"], r["out.policy"]) == ("odma,paged", "odma")
    assert (r["wall_seconds"], r["out.wall_seconds"]) == (1.0, 2.0)


def test_plot_lines_follow_the_second_axis_and_the_rows_within_a_cell():
    # a simulate grid over rate (strings, as --rate takes a list) and page tokens: each cell
    # returns one row per policy, and each row repeats its cell's rate
    grid = sweep.Grid("g.toml", "simulate", {}, {"rate": ["2", "8"], "page-tokens": [16, 32]})
    rows = [{"cell": c, "status": "ok", "rate": rate, "page-tokens": pt, "out.rate": float(rate),
             "policy": policy, "output_tps": tps}
            for c, (rate, pt) in enumerate([("2", 16), ("2", 32), ("8", 16), ("8", 32)])
            for policy, tps in (("odma", 100 * c), ("paged", 100 * c + 1))]
    rows.append({"cell": 4, "status": "failed", "rate": "8", "page-tokens": 64})
    column, lines, numeric_x = sweep.plot_lines(grid, rows, "output_tps")
    assert column == "output_tps" and numeric_x
    assert lines == {"page-tokens=16, policy=odma": [(2.0, 0), (8.0, 200)],
                     "page-tokens=16, policy=paged": [(2.0, 1), (8.0, 201)],
                     "page-tokens=32, policy=odma": [(2.0, 100), (8.0, 300)],
                     "page-tokens=32, policy=paged": [(2.0, 101), (8.0, 301)]}
    with pytest.raises(BadArgument, match="--metric 'tps' is not a column"):
        sweep.plot_lines(grid, rows, "tps")


def test_the_printed_table_shows_axes_and_the_metric_and_says_what_it_left_out():
    grid = sweep.Grid("g.toml", "emulate", {}, {"seed": list(range(1, 51)),
                                                "pattern": ["seq"]})
    rows = [{"cell": c, "row": 0, "status": "failed" if c == 2 else "ok", "seed": c + 1,
             "pattern": "seq", **({} if c == 2 else {"efficiency": 1 / (c + 1)})}
            for c in range(50)]
    lines, left_out = sweep.results_table(grid, rows, "efficiency", limit=10)
    assert left_out == 40 and len(lines) == 11
    assert lines[0].split() == ["cell", "seed", "pattern", "efficiency"]
    # a column's numbers line up: the decimals that give its largest four digits
    assert [line.split() for line in lines[1:4]] == [["0", "1", "seq", "1.000"],
                                                     ["1", "2", "seq", "0.500"],
                                                     ["2", "3", "seq", "failed"]]
    # simulate: a column per policy, the rows of one cell side by side
    grid = sweep.Grid("g.toml", "simulate", {}, {"page-tokens": [16, 128]})
    rows = [{"cell": c, "row": i, "status": "ok", "page-tokens": pt, "policy": p,
             "output_tps": 100.0 * (c + 1) + i, "out.rate": 8.0}
            for c, pt in enumerate([16, 128]) for i, p in enumerate(["odma", "paged"])]
    lines, left_out = sweep.results_table(grid, rows, "output_tps")
    assert left_out == 0
    assert [line.split() for line in lines] == [
        ["cell", "page-tokens", "output_tps", "odma", "output_tps", "paged"],
        ["0", "16", "100.0", "101.0"], ["1", "128", "200.0", "201.0"]]


def test_units_of_axes_and_columns():
    assert [sweep.unit(n) for n in ("output_tps", "bandwidth_gbps", "ttft_s.p99",
                                    "wall_seconds", "requests_per_second", "efficiency",
                                    "out.policy", "kv-pool-gb")] == [
        "tok/s", "GB/s", "s", "s", "req/s", None, None, "GB"]
    # an option's unit is the command's to say (its OPTION_UNITS), not the sweep's
    assert sweep.unit("granularity") is None and sweep.unit("granularity", "emulate") == "B"
    assert sweep.unit("page-tokens", "simulate") == sweep.unit("page-tokens", "engine") == "tokens"
    assert sweep.unit("pool-gib", "replay") == "GiB" and sweep.unit("rate", "replay") == "req/s"


def test_the_default_metric_is_the_commands_own():
    assert [sweep.default_metric(c) for c in ("emulate", "replay", "simulate", "engine")] == [
        "efficiency", "utilization", "output_tps", "output_tps"]
    assert sweep.default_metric("probe") == "wall_seconds"     # a command that names none
    assert sweep.uses_numba("emulate") and sweep.uses_numba("simulate")
    assert not sweep.uses_numba("replay")


def _serving_grid():
    """A three-axis simulate grid (12 cells) and its rows: two per cell, odma and paged."""
    grid = sweep.Grid("map.toml", "simulate", {}, {"layout": ["hnd", "nhd"],
                                                   "page-tokens": [16, 32, 128],
                                                   "interleave": [256, 1024]})
    rows = []
    for c, axes in enumerate(grid.cells()):
        for i, policy in enumerate(("odma", "paged")):
            tps = 1000 * (axes["layout"] == "nhd") + axes["page-tokens"] + axes["interleave"] + i
            rows.append({"cell": c, "row": i, "status": "ok", **axes, "policy": policy,
                         "out.rate": 8.0, "output_tps": float(tps)})
    return grid, rows


def test_plot_lines_hold_the_other_axes_at_their_first_or_given_value():
    grid, rows = _serving_grid()
    view = sweep.plot_view(grid, x="page-tokens", series="layout")
    assert view.caption(grid) == "interleave=256 (first value)"
    column, lines, numeric_x = sweep.plot_lines(grid, rows, "output_tps", view)
    assert numeric_x and lines["layout=hnd, policy=odma"] == [(16, 272.0), (32, 288.0),
                                                              (128, 384.0)]
    assert sorted(lines) == ["layout=hnd, policy=odma", "layout=hnd, policy=paged",
                             "layout=nhd, policy=odma", "layout=nhd, policy=paged"]
    view = sweep.plot_view(grid, x="page-tokens", fix=["interleave=1024"])
    assert (view.series, view.caption(grid)) == ("layout", "interleave=1024 (--plot-fix)")
    _, lines, _ = sweep.plot_lines(grid, rows, "output_tps", view)
    assert lines["layout=nhd, policy=paged"] == [(16, 2041.0), (32, 2057.0), (128, 2153.0)]
    # by default: x the first axis, a line per value of the second, the rest held
    view = sweep.plot_view(grid)
    assert (view.x, view.series, view.caption(grid)) == ("layout", "page-tokens",
                                                         "interleave=256 (first value)")


def test_the_plot_labels_units_and_draws_wide_axes_on_a_log_scale(tmp_path, monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot")
    figures = []
    # report.py saves through odma_cli.plotting.save
    monkeypatch.setattr(sweep.report.plotting, "save", lambda fig, path: figures.append(fig))
    grid, rows = _serving_grid()
    view = sweep.plot_view(grid, x="page-tokens", fix=["interleave=1024"])
    sweep.plot(grid, rows, "output_tps", str(tmp_path / "p.png"), view)
    sweep.plot(grid, rows, "output_tps", str(tmp_path / "q.png"), sweep.plot_view(
        grid, x="interleave", series="page-tokens", fix=["layout=nhd"]))
    (ax,), (ax2,) = figures[0].axes, figures[1].axes
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_xscale()) == (
        "page-tokens (tokens)", "output_tps (tok/s)", "log")         # 16 to 128: 8x
    assert "interleave=1024 (--plot-fix)" in ax.get_title()
    assert (ax2.get_xlabel(), ax2.get_xscale()) == ("interleave (B)", "linear")   # 4x
    assert "layout=nhd (--plot-fix)" in ax2.get_title()
    for fig in figures:
        plt.close(fig)


# --------------------------------------------------------------------- sweeps on Ray
@pytest.fixture(scope="module")
def local_ray():
    """One local Ray with two workers for every test below; its workers can import this
    module (the fake command)."""
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'odma-hw[sweep]'")
    import logging

    path = os.pathsep.join(p for p in (str(TESTS), str(REPO), os.environ.get("PYTHONPATH"))
                           if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING, runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield ray
    ray.shutdown()


def test_a_small_emulate_sweep_on_two_workers(tmp_path, capsys, local_ray):
    pytest.importorskip("matplotlib")
    grid_text = """
        command = "emulate"
        [fixed]
        requests = 3000
        [axes]
        pattern = ["seq", "rand"]
        granularity = [{}, 64, 128]
        """
    out, png = tmp_path / "res", tmp_path / "eff.png"
    # 48 B is no multiple of the 32 B burst: refused before any cell runs
    grid = write_grid(tmp_path / "bad.toml", grid_text.format(48))
    assert main(["sweep", grid, "--out", str(out), "--plot", str(png)]) == 2
    err = capsys.readouterr().err
    assert "cell 0 (pattern=seq granularity=48)" in err and "multiple of the 32-byte burst" in err
    assert not out.exists()
    grid = write_grid(tmp_path / "emu.toml", grid_text.format(32))
    assert main(["sweep", grid, "--out", str(out), "--plot", str(png)]) == 0
    captured = capsys.readouterr()
    assert "6 ok, 0 failed" in captured.out
    table = [line.split() for line in captured.out.splitlines()[:7]]
    assert table[0] == ["cell", "pattern", "granularity", "efficiency"]
    assert [line[:3] for line in table[1:]] == [
        ["0", "seq", "32"], ["1", "seq", "64"], ["2", "seq", "128"], ["3", "rand", "32"],
        ["4", "rand", "64"], ["5", "rand", "128"]]
    assert all(0 < float(line[3]) <= 1 for line in table[1:])
    rows = read_csv(out / "results.csv")
    assert [(r["cell"], r["pattern"], r["granularity"], r["status"]) for r in rows] == [
        ("0", "seq", "32", "ok"), ("1", "seq", "64", "ok"), ("2", "seq", "128", "ok"),
        ("3", "rand", "32", "ok"), ("4", "rand", "64", "ok"), ("5", "rand", "128", "ok")]
    assert all(0 < float(r["efficiency"]) <= 1 for r in rows)
    assert all(r["requests"] == "3000" and r["out.pattern"] == r["pattern"] for r in rows)
    assert float(rows[1]["efficiency"]) > float(rows[4]["efficiency"])  # seq beats rand at 64 B
    assert {"commands.act", "config.seed", "hash", "command_line"} <= set(rows[0])
    assert len(read_log(out / "results.jsonl")) == 6
    meta = json.loads((out / "sweep.json").read_text())
    assert meta["cells"] == 6 and "never includes Numba compilation" in meta["numba_warm_up"]
    # each worker process warmed the emulator up once, before its first cell
    warm = [float(r["warm_up_seconds"]) for r in rows]
    assert any(w > 0 for w in warm) and sum(w > 0 for w in warm) <= 2
    assert png.stat().st_size > 0
    # a second run into the same folder must say --resume, not overwrite
    assert main(["sweep", grid, "--out", str(out)]) == 2
    assert "--resume" in capsys.readouterr().err


def test_resume_skips_ok_cells_and_reruns_failed_ones(tmp_path, capsys, fake_command,
                                                      local_ray):
    broken = tmp_path / "broken"
    broken.mkdir()
    grid = write_grid(tmp_path / "g.toml", f"""
        command = "fake"
        zip = [["x", "fail-while"]]
        [axes]
        x = [1, 2, 3, 4]
        fail-while = ["{tmp_path}/fine", "{broken}", "{tmp_path}/fine", "{broken}"]
        """)
    out = tmp_path / "out"
    assert main(["sweep", grid, "--out", str(out)]) == 3
    first = read_log(out / "results.jsonl")
    assert sorted((r["x"], r["status"]) for r in first) == [
        (1, "ok"), (2, "failed"), (3, "ok"), (4, "failed")]
    assert {r["error"] for r in first if r["status"] == "failed"} == {
        "BadArgument: fake failure for x=2", "BadArgument: fake failure for x=4"}

    broken.rmdir()                 # the cause is gone: --resume reruns exactly the failures
    assert main(["sweep", grid, "--out", str(out), "--resume"]) == 0
    second = read_log(out / "results.jsonl")
    assert second[:4] == first and sorted(r["x"] for r in second[4:]) == [2, 4]
    rows = read_csv(out / "results.csv")
    assert [(r["x"], r["status"], r["square"]) for r in rows] == [
        ("1", "ok", "1"), ("2", "ok", "4"), ("3", "ok", "9"), ("4", "ok", "16")]
    assert "nested.deep.label" in rows[0] and "series" not in rows[0]
    assert main(["sweep", grid, "--out", str(out), "--resume"]) == 0   # nothing left to do
    assert len(read_log(out / "results.jsonl")) == 6


def test_resume_with_every_cell_done_starts_no_ray_and_writes_the_table(
        tmp_path, capsys, fake_command, local_ray, monkeypatch):
    grid = write_grid(tmp_path / "g.toml", 'command = "fake"\n[axes]\nx = [1, 2, 3]\n')
    out = tmp_path / "out"
    assert main(["sweep", grid, "--out", str(out)]) == 0
    table = (out / "results.csv").read_text()
    (out / "results.csv").unlink()
    capsys.readouterr()

    def refuse(*args, **kwargs):
        raise AssertionError("the sweep reached Ray with nothing to run")
    monkeypatch.setattr(sweep, "import_ray", refuse)
    monkeypatch.setattr(sweep, "connect", refuse)
    assert main(["sweep", grid, "--out", str(out), "--resume"]) == 0
    captured = capsys.readouterr()
    assert "3 cells: 3 ok, 0 failed, 3 already done" in captured.out
    assert "Ray not started" in captured.out
    assert "3 of 3 cells already done (--resume)" in captured.err
    assert [line.split() for line in captured.out.splitlines()[:4]] == [
        ["cell", "x", "square"], ["0", "1", "1"], ["1", "2", "4"], ["2", "3", "9"]]
    assert (out / "results.csv").read_text() == table
    assert main(["sweep", grid, "--out", str(out), "--resume", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["cells"], summary["skipped"], summary["ran"], summary["ray_started"]) == (
        3, 3, 0, False)


def test_an_edit_to_the_code_reruns_every_cell_on_resume(tmp_path, capsys, fake_command,
                                                         local_ray, monkeypatch):
    source = tmp_path / "code.py"
    source.write_text("A = 1\n")
    monkeypatch.setattr(sweep.log, "code_files", lambda command: [("code.py", str(source))])
    grid = write_grid(tmp_path / "g.toml", 'command = "fake"\n[axes]\nx = [1, 2, 3]\n')
    out = tmp_path / "out"
    assert main(["sweep", grid, "--out", str(out)]) == 0
    assert main(["sweep", grid, "--out", str(out), "--resume"]) == 0
    assert "3 already done" in capsys.readouterr().out and len(read_log(out / "results.jsonl")) == 3
    source.write_text("A = 22\n")       # same version, other code: nothing is done any more
    assert main(["sweep", grid, "--out", str(out), "--resume"]) == 0
    assert "3 cells: 3 ok, 0 failed, 0 already done" in capsys.readouterr().out
    log = read_log(out / "results.jsonl")
    assert len(log) == 6 and not {r["hash"] for r in log[:3]} & {r["hash"] for r in log[3:]}
    assert [r["hash"] for r in read_csv(out / "results.csv")] == _hashes(tmp_path, (
        tmp_path / "g.toml").read_text())


def test_a_killed_worker_loses_no_finished_cell_and_resume_completes(
        tmp_path, capsys, fake_command, local_ray):
    deadly = tmp_path / "deadly"
    deadly.mkdir()
    grid = write_grid(tmp_path / "g.toml", f"""
        command = "fake"
        zip = [["x", "die-while"]]
        [fixed]
        rows = true
        [axes]
        x = [1, 2, 3, 4, 5]
        die-while = ["{tmp_path}/calm", "{tmp_path}/calm", "{deadly}", "{tmp_path}/calm",
                     "{tmp_path}/calm"]
        """)
    out = tmp_path / "out"
    assert main(["sweep", grid, "--out", str(out), "--retries", "0"]) == 3
    rows = read_csv(out / "results.csv")
    (died,) = [r for r in rows if r["status"] == "failed"]
    assert died["x"] == "3" and "Worker" in died["error"], died["error"]
    # every cell whose worker lived is there, two rows each (policy odma and paged)
    assert [(r["x"], r["row"], r["policy"]) for r in rows if r["status"] == "ok"] == [
        (str(x), str(i), p) for x in (1, 2, 4, 5) for i, p in enumerate(("odma", "paged"))]

    deadly.rmdir()
    assert main(["sweep", grid, "--out", str(out), "--resume"]) == 0
    rows = read_csv(out / "results.csv")
    assert [(r["x"], r["row"], r["status"], r["tps"]) for r in rows] == [
        (str(x), str(i), "ok", str(float(t * x))) for x in range(1, 6)
        for i, t in enumerate((10, 5))]


def test_ctrl_c_keeps_the_finished_cells_and_exits_130(tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'odma-hw[sweep]'")
    grid = write_grid(tmp_path / "slow.toml", """
        command = "emulate"
        [fixed]
        requests = 1500000
        [axes]
        seed = [1, 2, 3, 4, 5, 6, 7, 8]
        """)
    out = tmp_path / "out"
    log = out / "results.jsonl"
    # as a user's shell has it: no Ray authentication mode chosen
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    proc = subprocess.Popen([sys.executable, "-m", "odma_hw", "sweep", grid, "--out", str(out),
                             "--workers", "1"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and log.read_text().count("\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)   # what a terminal's Ctrl-C does
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "--resume runs the other" in err
    # the local cluster names its authentication mode: Ray 2.60 warns on every start otherwise
    assert "Token authentication" not in err, err
    finished = [r for r in read_log(log) if r["status"] == "ok"]
    assert 1 <= len(finished) < 8
    assert [r["hash"] for r in read_csv(out / "results.csv") if r["status"] == "ok"] == [
        r["hash"] for r in sorted(finished, key=lambda r: r["cell"])]


def test_a_torn_last_line_reruns_its_cell_on_resume(tmp_path, capsys, fake_command, local_ray):
    grid = write_grid(tmp_path / "g.toml", """
        command = "fake"
        [fixed]
        rows = true
        [axes]
        x = [1, 2, 3, 4]
        """)
    out = tmp_path / "out"
    assert main(["sweep", grid, "--out", str(out)]) == 0
    log = out / "results.jsonl"
    torn = read_log(log)[-1]
    os.truncate(log, log.stat().st_size - 100)   # a crash in the middle of a cell's last row
    capsys.readouterr()
    assert main(["sweep", grid, "--out", str(out), "--resume"]) == 0
    assert "4 cells: 4 ok, 0 failed, 3 already done" in capsys.readouterr().out
    rows = read_csv(out / "results.csv")
    assert [(r["x"], r["row"]) for r in rows] == [(str(x), str(i)) for x in range(1, 5)
                                                  for i in (0, 1)]
    # the rerun's rows start on a line of their own: every line but the torn one is whole
    lines = log.read_bytes().splitlines()
    assert [sweep.unframe(line) is None for line in lines] == [False] * 7 + [True] + [False] * 2
    assert [json.loads(line)["x"] for line in lines[-2:]] == [torn["x"]] * 2


def test_a_full_disk_mid_sweep_fails_in_one_line_and_keeps_the_finished_cells(
        tmp_path, capsys, fake_command, local_ray, monkeypatch):
    grid = write_grid(tmp_path / "g.toml", """
        command = "fake"
        [fixed]
        rows = true
        [axes]
        x = [1, 2, 3, 4]
        """)
    out = tmp_path / "out"
    # the log is written by sweep.log, through its own os
    real_os = sweep.log.os
    appends = []

    class DiskFillsUp:
        """sweep.log's os, but the log's second append stops half way: the disk is full."""

        def __getattr__(self, name):
            return getattr(real_os, name)

        def write(self, fd, data):
            appends.append(len(data))
            if len(appends) == 1:
                return real_os.write(fd, data)
            if len(appends) == 2:
                return real_os.write(fd, bytes(data[:len(data) // 2]))
            raise OSError(errno.ENOSPC, real_os.strerror(errno.ENOSPC))
    monkeypatch.setattr(sweep.log, "os", DiskFillsUp())
    assert main(["sweep", grid, "--out", str(out)]) == 3
    err = capsys.readouterr().err
    (error,) = [line for line in err.splitlines() if not line.startswith("sweep g.toml: ")]
    assert error.startswith("odma-hw: error: cannot append to") and \
        "No space left on device" in error and "--resume" in error, err
    (finished,) = sweep.latest_attempts(str(out / "results.jsonl")).values()
    assert len(finished[1]) == 2
    assert len(read_csv(out / "results.csv")) == 2     # the table holds the finished cell

    monkeypatch.setattr(sweep.log, "os", real_os)       # space again
    assert main(["sweep", grid, "--out", str(out), "--resume"]) == 0
    assert [r["x"] for r in read_csv(out / "results.csv")] == ["1", "1", "2", "2", "3", "3",
                                                              "4", "4"]


def test_a_plot_that_fails_after_the_work_exits_3_in_one_line(tmp_path, capsys, fake_command,
                                                              local_ray):
    pytest.importorskip("matplotlib")
    grid = write_grid(tmp_path / "g.toml", 'command = "fake"\n[axes]\nx = [1, 2]\n')
    out, png = tmp_path / "out", tmp_path / "p.png"
    # which columns a cell returns is known only once it ran
    assert main(["sweep", grid, "--out", str(out), "--plot", str(png), "--metric", "nope"]) == 3
    err = capsys.readouterr().err
    (error,) = [line for line in err.splitlines() if not line.startswith("sweep g.toml: ")]
    assert error.startswith("odma-hw: error: --plot") and "--metric 'nope' is not a column" in \
        error, err
    assert len(read_csv(out / "results.csv")) == 2 and not png.exists()


def test_ctrl_c_is_held_while_it_is_held_and_counted():
    with sweep.ctrl_c_held() as came:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
    assert came == [signal.SIGINT]
    with pytest.raises(KeyboardInterrupt):      # and is Ctrl-C again afterwards
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)


def run_script(tmp_path, text: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(text))
    return subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_a_ctrl_c_in_the_cleanup_still_shuts_ray_down_itself(tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'odma-hw[sweep]'")
    grid = write_grid(tmp_path / "g.toml", 'command = "emulate"\n[fixed]\nrequests = 1000\n'
                      '[axes]\nseed = [1]\n')
    # the Ctrl-C lands while the log closes, the first thing after the last progress line
    done = run_script(tmp_path, f"""
        import os, signal, time
        import ray
        from odma_cli import sweep
        from odma_cli.main import main
        close = sweep.ResultLog.close
        def interrupted_close(self):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            close(self)
        sweep.ResultLog.close = interrupted_close
        status = main(["sweep", {grid!r}, "--out", {str(tmp_path / "out")!r}])
        print(status, ray.is_initialized())
        """)
    assert done.stdout.split()[-2:] == ["130", "False"], done.stderr
    assert len(read_log(tmp_path / "out" / "results.jsonl")) == 1
    assert (tmp_path / "out" / "results.csv").exists()


def test_ctrl_c_at_exit_cannot_cut_short_a_shutdown_left_to_it(tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'odma-hw[sweep]'")
    # Ray started and never shut down (a Ctrl-C cut ray.init short, say): the exit does it,
    # under a Ctrl-C every 20 ms
    done = run_script(tmp_path, """
        import atexit, os, signal, threading, time
        from odma_cli import sweep
        ray = sweep.import_ray()
        assert sweep.connect(ray, None, 1)
        def ctrl_c_again_and_again():
            time.sleep(0.1)
            while True:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.02)
        atexit.register(lambda: threading.Thread(target=ctrl_c_again_and_again,
                                                 daemon=True).start())
        """)
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr


def test_more_ctrl_c_while_ray_shuts_down_print_no_traceback(tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'odma-hw[sweep]'")
    grid = write_grid(tmp_path / "slow.toml", """
        command = "emulate"
        [fixed]
        requests = 400000
        [axes]
        seed = [1, 2, 3, 4, 5, 6, 7, 8]
        """)
    out = tmp_path / "out"
    log = out / "results.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "odma_hw", "sweep", grid, "--out", str(out),
                             "--workers", "1"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr],
                              daemon=True)
    reader.start()
    err = []
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and log.read_text().count("\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        # the last progress line (nothing running) comes just before Ray shuts down: a second
        # Ctrl-C then lands in the shutdown, a third where Ray's exit hook would finish it
        while True:
            try:
                err.append(lines.get(timeout=30))
            except queue.Empty:
                break
            if " 0 running" in err[-1]:
                break
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.4)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = "".join(err) + "".join(lines.queue)
    assert "Traceback" not in err, err
    # 130, or killed by the last SIGINT once the interpreter had let go of its handler
    assert proc.returncode in (130, -signal.SIGINT), err
    assert [r["status"] for r in read_log(log)][:1] == ["ok"]


def test_a_cells_preset_reads_as_on_the_command_line(tmp_path):
    """A grid's preset gives each cell its flags, and the cell's own options still win, as
    `odma-hw simulate --preset ...` reads them (planning parses every cell)."""
    pytest.importorskip("numba")
    (tmp_path / "t.csv").write_text("num_prefill_tokens,num_decode_tokens\n20,4\n")
    grid = sweep.load_grid(write_grid(tmp_path / "g.toml", f"""
        command = "simulate"
        [fixed]
        trace = "{tmp_path / 't.csv'}"
        preset = "vllm-v1"
        [axes]
        max_batch = [64, 2048]
        """))
    from odma_cli.argtypes import parse_line

    plan = sweep.plan(grid)
    parsed = [vars(parse_line(sweep.command_parser(plan.module, "simulate"), list(c.argv[1:])))
              for c in plan.cells]
    assert [(a["layout"], a["max_num_batched_tokens"], a["max_batch"]) for a in parsed] == [
        ("nhd", 8192, 64), ("nhd", 8192, 2048)]
