"""Trace generators and user traces (arrays, text files) with one-line errors."""

import json

import numpy as np
import pytest

from odma_cli.errors import BadArgument
from odma_hw.emu import from_arrays, generate, read_trace_file, emulate

MB = 1 << 20


def test_generators_stay_aligned_and_inside_the_footprint():
    for pattern in ("seq", "rand", "strided", "mixed", "paged", "kvscan"):
        t = generate(pattern, 5000, 64, footprint=64 * MB, burst=32, seed=3)
        assert len(t) == 5000 and (t.addr % 64 == 0).all()
        assert t.addr.min() >= 0 and (t.addr + t.size).max() <= 64 * MB


def test_pattern_shapes():
    seq = generate("seq", 100, 64, footprint=MB, burst=32)
    assert (np.diff(seq.addr) == 64).all()
    paged = generate("paged", 1024, 64, footprint=64 * MB, burst=32, block_bytes=4096)
    blocks = paged.addr.reshape(-1, 64)  # each 4 KiB block read in order
    assert (np.diff(blocks, axis=1) == 64).all() and (blocks[:, 0] % 4096 == 0).all()
    mixed = generate("mixed", 10000, 64, footprint=MB, burst=32)
    assert 0.4 < mixed.write.mean() < 0.6
    assert generate("rand", 1000, 64, footprint=MB, burst=32, write_ratio=1.0).write.all()


def test_a_write_ratio_given_is_kept_and_reported_0_included(capsys):
    """mixed defaults to half writes, but an explicit 0 is a read-only mixed run, and the
    config reports the share the run had."""
    from odma_cli.main import main

    assert not generate("mixed", 1000, 64, footprint=MB, burst=32, write_ratio=0.0).write.any()
    for given, share in ((["--write-ratio", "0"], 0.0), ([], 0.5)):
        assert main(["emulate", "--pattern", "mixed", "--requests", "2000", "--json"] + given) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["config"]["write_ratio"] == share
        assert (out["writes"] == 0) == (share == 0.0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(granule=48), "multiple of the 32-byte burst"),
    (dict(write_ratio=1.5), r"write ratio must be in \[0, 1\]"),
    (dict(pattern="zigzag"), "unknown pattern"),
])
def test_bad_generator_arguments(kwargs, match):
    args = dict(pattern="rand", n=10, granule=64, footprint=MB, burst=32)
    args.update(kwargs)
    with pytest.raises(BadArgument, match=match):
        generate(args.pop("pattern"), args.pop("n"), args.pop("granule"), **args)


def test_text_trace(tmp_path):
    p = tmp_path / "t.trace"
    p.write_text("# address op [size]\n0x0 R\n\n4096 W 128\n0x2000 r  # comment\n")
    t = read_trace_file(str(p), granule=64, burst=32, device_bytes=MB)
    assert list(t.addr) == [0, 4096, 0x2000] and list(t.write) == [0, 1, 0] and list(t.size) == [64, 128, 64]
    s = emulate("lpddr5-6400", trace=str(p), granularity=64)
    assert s.requests == 3 and s.bytes == 256


@pytest.mark.parametrize("text,match", [
    ("0x0 R\nnot a line at all\n", "line 2: expected"),
    ("0x0 X\n", "line 1: operation must be R or W"),
    ("zz R\n", "line 1: bad address"),
    ("0x0 R\n0x40000000 W\n", "line 2: address 0x40000000 \\+ 64 is beyond"),
    ("0x10 R\n", "line 1: .*not aligned"),
    ("", "has no requests"),
])
def test_bad_text_traces_name_the_line(tmp_path, text, match):
    p = tmp_path / "bad.trace"
    p.write_text(text)
    with pytest.raises(BadArgument, match=match):
        emulate("lpddr5-6400", trace=str(p), granularity=64)


def test_array_traces():
    t = from_arrays([0, 64, 1 << 20], [0, 1, 0], granule=64, burst=32, device_bytes=1 << 30)
    assert emulate("lpddr5-6400", trace=t).requests == 3
    with pytest.raises(BadArgument, match="request 1: address .* beyond"):
        from_arrays([0, 1 << 40], granule=64, burst=32, device_bytes=1 << 30)


def test_unaligned_requests_cost_every_burst_they_touch():
    # 64 bytes starting one byte before a 32-B burst boundary touch three bursts; the engine
    # used to spin forever on the zero-burst piece such a request left behind
    from odma_hw.emu.traces import Trace

    # user traces must be aligned (from_arrays checks); internal ones such as copies need not be
    tr = Trace(np.array([(1 << 20) - 1, 4096]), np.array([64, 64]), np.array([0, 1], np.uint8))
    s = emulate("lpddr5-6400", trace=tr, granularity=32, refresh="none")
    assert s.commands["rd"] == 3 and s.commands["wr"] == 2


def test_emulated_copy_between_unaligned_buffers_moves_bytes_and_takes_time():
    from odma_hw import devices

    with devices.open("emu:lpddr5-6400") as dev:
        a, b = dev.alloc(1 << 16), dev.alloc(1 << 16)
        data = bytes(range(256)) * 16
        dev.write(a, 3, data)
        seconds = dev.copy(b, 5, a, 3, len(data))
        assert dev.read(b, 5, len(data)) == data
        # a 4 KiB copy is 8 KiB of traffic: at least its time on a 12.8 GB/s bus
        assert seconds >= 2 * len(data) / 12.8e9
