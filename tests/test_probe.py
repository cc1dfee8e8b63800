"""The probe's decision rule, its planning (every argument checked before anything is measured)
and the `probe` / `devices` command-line contract."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from odma_cli import main as cli
from odma_cli.commands import model_head_dim
from odma_cli.errors import BadArgument
from odma_hw.devices import host as host_backend
from odma_hw.devices.base import Device, DeviceInfo, Measurement
from odma_hw.probe.cli import format_table
from odma_hw.probe.measure import classify, plan_probe, probe_device
from odma_hw.probe.runs import KVRun, knee, parse_granularities, ratio_at

MIB = 1 << 20


def run_cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "odma_hw", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def m(pattern="read", best=1.0, median=1.0, granule=64):
    return Measurement(pattern, granule, 1, 1 << 20, 1e9, best, median, median, 5, "test")


# --- the decision rule ------------------------------------------------------------------------
def test_saturated_low_ratio_is_racm():
    verdict, reason = classify(0.3, 0.5, {1: 10.0, 2: 10.5}, {1: 3.0, 2: 3.1}, None, [m()])
    assert verdict == "racm" and "0.30" in reason


def test_saturated_high_ratio_is_not_racm():
    assert classify(0.8, 0.5, {1: 10.0}, {1: 8.0}, 12.0, [m()])[0] == "not-racm"


def test_bandwidth_still_scaling_with_threads_is_inconclusive():
    # devices.md rule 8: doubling from 1 to 2 threads means the ratio is a per-core limit
    verdict, reason = classify(0.14, 0.5, {1: 19.0, 2: 38.0}, {1: 2.6, 2: 5.3}, None, [m()])
    assert verdict == "inconclusive" and reason.startswith("unsaturated")


def test_random_still_scaling_is_inconclusive_even_if_sequential_saturated():
    verdict, _ = classify(0.2, 0.5, {1: 30.0, 2: 31.0}, {1: 2.6, 2: 5.3}, None, [m()])
    assert verdict == "inconclusive"


def test_far_below_known_peak_is_inconclusive():
    verdict, reason = classify(0.3, 0.5, {1: 10.0}, {1: 3.0}, 300.0, [m()])
    assert verdict == "inconclusive" and "peak" in reason


def test_disagreeing_repetitions_are_inconclusive():
    verdict, reason = classify(0.3, 0.5, {1: 10.0}, {1: 3.0}, None, [m(best=1.0, median=1.6)])
    assert verdict == "inconclusive" and "disagree" in reason


def test_a_working_set_that_may_fit_a_cache_is_inconclusive():
    verdict, reason = classify(0.3, 0.5, {1: 10.0}, {1: 3.0}, None, [m()],
                               cache_note="the buffer is small")
    assert verdict == "inconclusive" and reason.startswith("cache: the buffer is small")


# --- planning: every argument checked before the first measurement -----------------------------
class FakeDevice(Device):
    """A device that records the measurements asked of it and answers fixed bandwidths
    (random 64 B at 30 % of sequential)."""

    def __init__(self, kind="torch", max_threads=1, details=None, memory=64 << 30):
        self.info = DeviceInfo(spec=f"fake:{kind}", kind=kind, name="fake", total_bytes=memory,
                               free_bytes=memory, peak_gbps=None, natural_granule=64,
                               max_threads=max_threads, details=dict(details or {}))
        self.measured = []

    def alloc(self, nbytes):
        raise NotImplementedError

    free = write = read = copy = alloc

    def measure(self, pattern, granule=64, threads=1, *, buffer_bytes=None, reps=5, seed=1):
        self.measured.append((pattern, granule, threads))
        size = self.check_measure(pattern, granule, threads, buffer_bytes=buffer_bytes, reps=reps)
        seconds = 1.0 if pattern != "rand" else 1 / 0.3
        return Measurement(pattern, granule, threads, size, 1e10, seconds, seconds, seconds, reps,
                           "fake")


def test_more_threads_than_cpus_is_refused_before_measuring_and_says_so():
    host_like = FakeDevice("host", max_threads=2)
    with pytest.raises(BadArgument) as err:
        probe_device(host_like, (64,), threads=1000, buffer_bytes=256 * MIB)
    assert "threads 1000" in str(err.value) and "2 CPU" in str(err.value)
    assert "500" not in str(err.value)  # once reported half the number asked for
    assert host_like.measured == []


def test_devices_on_their_own_parallelism_are_measured_with_one_thread():
    plan = plan_probe(FakeDevice(max_threads=1), (64,), threads=8)
    assert plan.threads == 1 and {t for _, _, t in plan.steps} == {1}


@pytest.mark.parametrize("bad", [dict(decision_granule=0), dict(decision_granule=48),
                                 dict(granularities=(64, 0)), dict(reps=0), dict(alpha=float("nan")),
                                 dict(buffer_bytes=0), dict(buffer_bytes=128 << 30)])
def test_bad_plans_are_refused_before_measuring(bad):
    dev = FakeDevice()
    args = dict(granularities=(64,), buffer_bytes=None)
    args.update(bad)
    with pytest.raises(BadArgument):
        probe_device(dev, **args)
    assert dev.measured == []


def test_a_buffer_below_four_times_a_known_cache_is_refused_naming_the_cache():
    dev = FakeDevice("host", max_threads=2, details={"llc_reported_bytes": 32 * MIB})
    with pytest.raises(BadArgument) as err:
        plan_probe(dev, (64,), buffer_bytes=100 * MIB)
    text = str(err.value)
    assert "32 MiB last-level cache" in text and "at least 128 MiB" in text
    assert plan_probe(dev, (64,), buffer_bytes=128 * MIB).cache_note is None


def test_a_small_buffer_on_a_device_of_unknown_cache_makes_the_verdict_inconclusive():
    dev = FakeDevice()  # no cache size; default working set 1 GiB
    small = probe_device(dev, (64,), buffer_bytes=64 * MIB)
    assert small.verdict == "inconclusive" and small.reason.startswith("cache:")
    assert "no cache size" in small.reason and "64 MiB" in small.reason
    table = format_table([small])
    assert "inconclusive" in table and "cache:" in table
    assert probe_device(FakeDevice(), (64,), buffer_bytes=1 << 30).verdict == "racm"


def test_default_streaming_buffers_capped_below_the_cache_rule_are_flagged():
    # 1 GiB of memory, a reported 480 MiB cache: the defaults cannot reach 4 x the cache
    dev = FakeDevice("host", max_threads=1, details={"llc_reported_bytes": 480 * MIB},
                     memory=1 << 30)
    dev.default_buffer_bytes = lambda pattern: 512 * MIB
    result = probe_device(dev, (64,))
    assert result.verdict == "inconclusive" and "480 MiB last-level cache" in result.reason


@pytest.mark.parametrize("text,expected", [("64", [64]), ("32,64,4K", [32, 64, 4096]),
                                           ("128,32,128", [32, 128])])
def test_granularity_parsing(text, expected):
    assert parse_granularities(text) == expected


@pytest.mark.parametrize("text", ["48", "4", "abc", "64,", "-64", "0"])
def test_granularity_rejects_malformed(text):
    with pytest.raises(BadArgument):
        parse_granularities(text)


# --- the command line -------------------------------------------------------------------------
SMALL = ["--buffer-mib", "64", "--reps", "2", "--quiet"]
# the H100's probe that the h100-sxm card ships (measured 2026-11-26)
H100_PROBE = str(Path(__file__).resolve().parents[1] / "allocator" / "serving" / "cards"
                 / "h100-sxm.probe.json")
EMU = ["--device", "emu:lpddr5-6400"]
LLC = host_backend.llc_reported_bytes()
# a host buffer the cache rule accepts on this machine, in MiB
HOST_MIB = max(256, -(-4 * (LLC or 0) // MIB))


@pytest.mark.parametrize("args,needle", [
    (["--device", "gpu:0"], "unknown device"),
    (["--device", "cuda:x"], "cuda:N"),
    (["--device", "torch:cpu", "--granularity", "48"], "power of two"),
    (["--device", "torch:cpu", "--granularity", "6x"], "malformed granularity"),
    (["--device", "torch:cpu", "--alpha", "1.5"], "alpha"),
    (["--device", "torch:cpu", "--alpha", "0"], "alpha"),
    (["--device", "torch:cpu", "--threads", "0"], "threads"),
    (["--device", "torch:cpu", "--buffer-mib", "100000000"], "free"),
    (["--device", "torch:cpu", "--buffer-mib", "1", "--granularity", "2K,4M"], "exceeds"),
    (["--device", "emu:no-such-preset"], "no-such-preset"),
    # each of the following once ended in a traceback, or ran (part of) the probe first: without
    # --quiet every measurement prints a progress line, so "one line" also means "nothing measured"
    (["--device", "torch:cpu", "--buffer-mib", "nan"], "finite number"),
    (["--device", "torch:cpu", "--buffer-mib", "inf"], "finite number"),
    ([*EMU, "--granularity", ""], "malformed granularity"),
    ([*EMU, "--decision-granularity", "0"], "power of two"),
    ([*EMU, "--decision-granularity", "48"], "power of two"),
    ([*EMU, "--plot", "x.xyz"], "unknown image format 'xyz'"),
    ([*EMU, "--plot", "/nonexistent/dir/x.png"], "does not exist"),
    (["--device", "host", "--threads", "1000"], "threads 1000 is more than"),
    ([*EMU, "--threads", "4"], "none of emu:lpddr5-6400 runs on host threads"),
    ([*EMU, "--device", "host", "--reps", "20000"], "reps must be an integer in [1, 10000]"),
    (["--device", "host", *EMU, "--device", "host"], "name each device once"),
    # the verdict for a decision: the run asked about is checked before anything is measured
    ([*EMU, "--model", "qwen2.5-0.5b", "--page-tokens", "0"], "--page-tokens: must be a positive"),
    ([*EMU, "--run-bytes", "2G"], "larger than the 1073741824-byte buffer the probe reads on emu"),
    ([*EMU, "--run-bytes", "2M", "--buffer-mib", "1"], "larger than the 1048576-byte buffer"),
    ([*EMU, "--run-bytes", "4"], "below the smallest granule the probe measures (8 B)"),
    ([*EMU, "--run-bytes", "2KB,4K"], "malformed --run-bytes"),
    ([*EMU, "--model", "qwen2.5-0.5b", "--page-tokens", "1000000000"], "larger than the"),
    ([*EMU, "--page-tokens", "16"], "give --model too"),
    ([*EMU, "--dtype", "fp8"], "give --model too"),
    ([*EMU, "--model", "qwen2.5-0.5b", "--run-bytes", "2K"], "give one of them"),
    ([*EMU, "--model", "qwen2.5-0.5b", "--dtype", "int4"], "invalid choice: 'int4'"),
    ([*EMU, "--model", "no-such-model"], "unknown --model 'no-such-model'"),
    ([*EMU, "--full-speed", "1.5"], "full speed must lie in (0, 1]"),
    (["--from", "/nonexistent/probe.json"], "cannot read --from file"),
    (["--from", "pyproject.toml"], "is not valid JSON"),
    (["--from", H100_PROBE, "--run-bytes", "2G"], "larger than the 1073741824-byte buffer"),
    (["--from", H100_PROBE, "--run-bytes", "16"], "below the smallest granule"),
    (["--from", H100_PROBE, "--device", "cuda:1"], "'cuda:1' is not in"),
    (["--from", H100_PROBE, "--reps", "2"], "--reps shapes a measurement"),
    (["--from", H100_PROBE, "--alpha", "0.4"], "--alpha shapes a measurement"),
])
def test_bad_input_exits_2_with_one_line(args, needle):
    r = run_cli("probe", *args)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_every_device_is_validated_before_any_is_measured():
    # the emulator (1 GiB) cannot hold the buffer; host could, and was once measured first
    mib = max(2000, HOST_MIB)
    if mib * MIB > host_backend.mem_available() // 2:
        pytest.skip(f"needs {mib} MiB of free memory for the host side")
    r = run_cli("probe", "--device", "host", *EMU, "--buffer-mib", str(mib))
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "free on emu:lpddr5-6400" in lines[0], r.stderr


@pytest.mark.skipif(not LLC, reason="this machine reports no last-level cache size")
def test_a_host_buffer_that_fits_the_cache_is_refused_naming_what_was_found():
    r = run_cli("probe", "--device", "host", "--buffer-mib", "1")
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"{LLC / MIB:g} MiB last-level cache" in lines[0]
    assert f"at least {4 * LLC / MIB:g} MiB" in lines[0] and "/sys/devices/system/cpu" in lines[0]


def test_a_plot_that_cannot_be_written_at_the_end_keeps_the_results(tmp_path, monkeypatch, capsys):
    import matplotlib.figure

    def disk_full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", disk_full)
    status = cli.main(["probe", *EMU, "--granularity", "64", "--reps", "1", "--quiet",
                       "--plot", str(tmp_path / "probe.png")])
    out, err = capsys.readouterr()
    assert "emu:lpddr5-6400" in out and "verdict" in out  # the table came first
    assert status == 3  # an output failure after the work, as in replay and simulate
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "cannot write plot" in lines[0] and "No space left" in lines[0]


def test_unknown_device_lists_the_known_ones():
    r = run_cli("probe", "--device", "tpu:0")
    assert r.returncode == 2
    for known in ("host", "cuda:N", "mlu:N", "torch:", "emu:"):
        assert known in r.stderr


def test_probe_json_schema_on_torch_cpu(tmp_path):
    png = tmp_path / "probe.png"
    r = run_cli("probe", "--device", "torch:cpu", "--granularity", "64,256", "--json",
                "--plot", str(png), *SMALL)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "odma-hw.probe/1"
    (dev,) = doc["devices"]
    for key in ("device", "kind", "name", "peak_gbps", "seq_gbps", "rand_gbps", "granularity",
                "ratio", "alpha", "verdict", "reason"):
        assert key in dev
    assert dev["device"] == "torch:cpu" and dev["kind"] == "torch"
    assert set(dev["rand_gbps"]) == {"64", "256"}
    assert dev["seq_gbps"] > 0 and all(v > 0 for v in dev["rand_gbps"].values())
    assert dev["ratio"] == pytest.approx(dev["rand_gbps"]["64"] / dev["seq_gbps"])
    assert dev["verdict"] in ("racm", "not-racm", "inconclusive") and dev["reason"]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_probe_table_prints_a_verdict_per_device():
    r = run_cli("probe", "--device", "torch:cpu", "--granularity", "64", *SMALL)
    assert r.returncode == 0, r.stderr
    assert "torch:cpu" in r.stdout and any(v in r.stdout for v in ("racm", "inconclusive"))


def test_a_torch_devices_probe_says_it_measures_torchs_gather_and_names_the_native_device():
    # torch's index_select is not the memory's rate (an H100's HBM3 read as RACM at
    # every run size); the output says so, in the JSON and in a line under the table
    r = run_cli("probe", "--device", "torch:cpu", "--granularity", "64", "--json", *SMALL)
    assert r.returncode == 0, r.stderr
    (dev,) = json.loads(r.stdout)["devices"]
    assert dev["measures"].startswith("torch gather (index_select)")
    assert "not the memory's rate" in dev["measures"]
    assert dev["native_device"] == "host" and "probe --device host" in dev["measures"]
    r = run_cli("probe", "--device", "torch:cpu", "--granularity", "64", *SMALL)
    assert r.returncode == 0, r.stderr
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("torch:cpu: measures ")]
    assert "torch gather (index_select)" in line and "probe --device host" in line


@pytest.mark.parametrize("spec,native", [("torch:cpu", "host"), ("cpu", "host"),
                                         ("torch:cuda", "cuda:0"), ("torch:cuda:3", "cuda:3"),
                                         ("torch:mlu:1", "mlu:1"), ("torch:xpu:0", None),
                                         ("torch:meta", None), ("torch:cuda:x", None)])
def test_the_native_device_behind_a_torch_device(spec, native):
    from odma_hw.devices.torch_device import native_spec

    assert native_spec(spec) == native


def test_devices_lists_every_backend_with_reason_when_absent():
    r = run_cli("devices", "--json")
    assert r.returncode == 0, r.stderr
    backends = {b["backend"]: b for b in json.loads(r.stdout)["backends"]}
    assert set(backends) == {"host", "cuda", "mlu", "torch", "emu"}
    for b in backends.values():
        assert b["specs"] or b["reason"], b
    assert "torch:cpu" in backends["torch"]["specs"]


@pytest.mark.parametrize("device,mib", [("torch:cpu", 256), ("host", HOST_MIB)])
def test_ctrl_c_stops_cleanly(device, mib):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "odma_hw", "probe", "--device", device,
                          "--buffer-mib", str(mib), "--reps", "50"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    # wait until measuring has begun (the progress display prints the first step)
    deadline = time.time() + 60
    line = ""
    while time.time() < deadline and "read" not in line:
        line = p.stderr.readline()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130
    assert "interrupted" in err and "Traceback" not in err


# --- a verdict for a decision: the knee, and what paging a model's KV costs ---------------------
H100_RATIOS = {32: 0.34, 64: 0.68, 128: 0.98, 256: 1.03, 512: 1.03, 1024: 1.03, 4096: 1.04}


def test_the_knee_is_the_smallest_run_from_which_on_runs_read_at_full_speed():
    assert knee(H100_RATIOS) == 128                      # not 64 B: 0.68 is above alpha only
    assert knee(H100_RATIOS, 0.5) == 64
    # a granule that passes below one that fails is not the knee: from it on, they all must
    assert knee({64: 0.95, 128: 0.7, 256: 0.92, 4096: 0.99}) == 256
    assert knee({64: 0.5, 4096: 0.73}) is None


def test_the_ratio_of_a_run_is_measured_interpolated_or_the_largest_measured():
    assert ratio_at(H100_RATIOS, 128, "x") == (0.98, "measured", [128])
    ratio, how, around = ratio_at(H100_RATIOS, 2048, "x")   # log2 halfway from 1 KiB to 4 KiB
    assert how == "interpolated" and around == [1024, 4096] and ratio == pytest.approx(1.035)
    assert ratio_at(H100_RATIOS, 3072, "x")[0] == pytest.approx(1.03 + 0.01 * (11.585 - 10) / 2,
                                                                abs=1e-3)
    assert ratio_at(H100_RATIOS, 1 << 20, "x") == (1.04, "largest-measured", [4096])
    with pytest.raises(BadArgument, match="below the smallest granule x measured"):
        ratio_at(H100_RATIOS, 16, "x")


def test_a_models_kv_run_is_a_page_of_one_head_as_simulate_reads_the_model(tmp_path):
    # Qwen2.5-0.5B: head_dim = 896 / 14 = 64; a 16-token bf16 page of one head is 2 KiB
    assert model_head_dim("qwen2.5-0.5b") == ("qwen2.5-0.5b", 64)
    run = KVRun.of_model("qwen2.5-0.5b", 64, 16, "bf16")
    assert run.nbytes == 2048 and run.label().endswith("are 2 KiB runs")
    assert KVRun.of_model("m", 64, 16, "fp32").nbytes == 4096
    assert KVRun.of_model("m", 64, 16, "fp8").nbytes == 1024
    # a config's own head_dim wins over hidden / heads (tiny-llama gives 8 where 64 / 8 = 8;
    # here 16): the one rule simulate and the engine size the model by
    config = json.loads((Path(__file__).resolve().parents[1] / "allocator" / "serving"
                         / "configs" / "tiny-llama.json").read_text())
    config["head_dim"] = 16
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_head_dim(str(tmp_path))[1] == 16


def test_a_run_that_is_no_power_of_two_is_interpolated_between_the_granules_measured_around_it():
    dev = FakeDevice()
    plan = plan_probe(dev, (64,), run=KVRun(3072))
    assert plan.granularities == [64, 2048, 4096]
    assert plan_probe(FakeDevice(), (64,), run=KVRun(2048)).granularities == [64, 2048]
    result = probe_device(FakeDevice(), (64,), buffer_bytes=1 << 30, run=KVRun(3072))
    assert result.kv_run["ratio_source"] == "interpolated"
    assert result.kv_run["ratio_granules"] == [2048, 4096]
    assert result.kv_run["ratio"] == pytest.approx(0.3)
    assert result.kv_run["verdict"] == "contiguous-recommended"
    assert "RACM at this run size" in result.kv_run["summary"]


def test_a_run_larger_than_the_buffer_is_refused_before_measuring():
    dev = FakeDevice()
    with pytest.raises(BadArgument, match="larger than the 67108864-byte buffer"):
        probe_device(dev, (64,), buffer_bytes=64 * MIB, run=KVRun(128 * MIB))
    assert dev.measured == []


def test_the_h100s_probe_says_paging_costs_nothing_there(capsys):
    """The issue's target: the H100 measured on 2026-11-26 (the copy h100-sxm ships) reads
    Qwen2.5-0.5B's 16-token pages at full speed, whatever its 32 B verdict says."""
    assert cli.main(["probe", "--device", "cuda:0", "--from", H100_PROBE,
                     "--model", "qwen2.5-0.5b", "--page-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert ("16-token pages of qwen2.5-0.5b (head_dim 64, bf16) are 2 KiB runs: 1.04 of "
            "streaming here: paging costs nothing on this device") in out
    assert "interpolated between the measured 1 KiB and 4 KiB" in out
    # which granule each verdict uses
    assert "the racm verdict is taken at the 32 B decision granule" in out
    assert "tens to hundreds of bytes" in out and "the verdict at the 2 KiB run size" in out
    assert "knee 128 B" in out


def test_a_rejudged_probe_keeps_every_saved_field_and_adds_the_knee_and_the_run(capsys):
    saved = json.loads(Path(H100_PROBE).read_text())["devices"][0]
    assert cli.main(["probe", "--from", H100_PROBE, "--model", "qwen2.5-0.5b", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "odma-hw.probe/1"
    (dev,) = doc["devices"]
    assert {k: dev[k] for k in saved} == saved                 # the old fields, as they were
    assert dev["knee_bytes"] == 128 and dev["full_speed"] == 0.9
    assert dev["from_file"] == H100_PROBE and "32 B decision granule" in dev["granule_note"]
    run = dev["kv_run"]
    assert (run["run_bytes"], run["page_tokens"], run["head_dim"], run["dtype"]) == \
        (2048, 16, 64, "bf16")                                 # --page-tokens defaults to 16
    assert run["verdict"] == "paging-free" and run["ratio"] == pytest.approx(1.0355, abs=1e-3)
    # fp32 pages are 4 KiB: measured there
    assert cli.main(["probe", "--from", H100_PROBE, "--model", "qwen2.5-0.5b", "--dtype", "fp32",
                     "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["devices"][0]["kv_run"]
    assert (run["run_bytes"], run["ratio_source"]) == (4096, "measured")
    # 64 B runs (--run-bytes) read at 0.68: above alpha, yet paging would cost half again
    assert cli.main(["probe", "--from", H100_PROBE, "--run-bytes", "64"]) == 0
    out = capsys.readouterr().out
    assert "64 B runs: 0.68 of streaming here: paging reads at 0.68; contiguous blocks " \
           "recommended (paged KV reads take 1.47x" in out


@pytest.mark.parametrize("preset", ["mlu370-x4", "lpddr5-6400-8b"])
def test_an_emulated_device_measures_the_models_run_and_says_what_paging_costs(preset, capsys):
    assert cli.main(["probe", "--device", f"emu:{preset}", "--granularity", "64", "--reps", "1",
                     "--quiet", "--model", "qwen2.5-0.5b", "--page-tokens", "16", "--json"]) == 0
    (dev,) = json.loads(capsys.readouterr().out)["devices"]
    assert set(dev["rand_gbps"]) == {"64", "2048"}             # the 2 KiB run was measured
    run = dev["kv_run"]
    assert run["ratio_source"] == "measured"
    assert run["ratio"] == pytest.approx(dev["rand_gbps"]["2048"] / dev["seq_gbps"])
    assert run["summary"].startswith("16-token pages of qwen2.5-0.5b (head_dim 64, bf16) are "
                                      f"2 KiB runs: {run['ratio']:.2f} of streaming here: ")
    if preset == "mlu370-x4":       # 24 channels of LPDDR5 in BG mode: 2 KiB runs at ~0.72
        assert run["verdict"] == "contiguous-recommended" and "paging reads at" in run["summary"]
        assert dev["knee_bytes"] is None
    assert run["verdict"] == ("paging-free" if run["ratio"] >= 0.9 else "contiguous-recommended")


@pytest.mark.parametrize("change, says", [
    (dict(verdict="maybe"), "'verdict' must be one of racm, not-racm, inconclusive"),
    (dict(alpha=5), "'alpha' is a fraction of streaming in (0, 1], got 5"),
    (dict(granularity=8192), "'granularity' 8192 has no figure in 'rand_gbps'"),
    (dict(copy_gbps="x"), "'copy_gbps' must be a finite number > 0, got 'x'"),
    (dict(copy_gbps=-1), "'copy_gbps' must be a finite number > 0, got -1"),
    (dict(peak_gbps={}), "'peak_gbps' must be a finite number > 0, got {}"),
])
def test_a_saved_entry_that_contradicts_itself_is_refused_naming_the_key(tmp_path, capsys,
                                                                         change, says):
    doc = json.loads(Path(H100_PROBE).read_text())
    doc["devices"][0].update(change)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    try:
        code = cli.main(["probe", "--from", str(path)])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and says in err, err


def test_an_emulated_run_as_large_as_the_buffer_is_measured_not_refused_midway(capsys):
    # 1,024 random positions of a 1 GiB run would be a terabyte to emulate: the run's traffic is
    # capped, so the largest run the buffer holds is measured like any other, streaming there
    assert cli.main(["probe", *EMU, "--granularity", "64", "--reps", "1", "--quiet",
                     "--run-bytes", "1G", "--json"]) == 0
    (dev,) = json.loads(capsys.readouterr().out)["devices"]
    assert dev["kv_run"]["ratio_source"] == "measured"
    assert dev["kv_run"]["ratio"] == pytest.approx(1.0, abs=0.05)
    (run,) = [m for m in dev["measurements"] if m["granule"] == 1 << 30]
    assert run["pattern"] == "rand" and run["extra"]["requests"] == 1
