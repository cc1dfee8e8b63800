"""emu:<preset> behaves like any Device: real bytes, modelled time, RACM-shaped bandwidth."""

import resource

import pytest

from odma_cli.errors import BadArgument
from odma_hw import devices
from odma_hw.devices import emu as emu_backend
from odma_hw.emu.specs import PRESETS, device_spec


@pytest.fixture
def dev():
    d = devices.open("emu:lpddr5-6400")
    yield d
    d.close()


def test_discover_lists_every_preset():
    specs, reason = emu_backend.discover()
    assert reason is None and "emu:lpddr5-6400" in specs and "emu:mlu370-x4" in specs


def test_info(dev):
    i = dev.info
    assert i.kind == "emu" and i.peak_gbps == pytest.approx(12.8)
    assert i.max_threads == 1 and i.total_bytes == 1 << 30


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_is_judged_at_64B_or_its_burst(preset):
    """The decision granule is the 64 B line consumers request (the host and MLU backends'
    granule too), or the channel's burst where larger: never a lone 32 B burst."""
    d = devices.open(f"emu:{preset}")
    try:
        assert d.info.natural_granule == max(64, device_spec(preset).channel.burst_bytes) == 64
    finally:
        d.close()


def test_bytes_are_real_and_copies_take_model_time(dev):
    a, b = dev.alloc(1 << 20), dev.alloc(1 << 20)
    payload = bytes(range(256)) * 4096
    dev.write(a, 0, payload)
    assert dev.read(a, 4096, 256) == payload[4096:4352]
    secs = dev.copy(b, 0, a, 0, 1 << 20)
    assert dev.read(b, 0, 1 << 20) == payload
    # 2 MiB of traffic at no more than the 12.8 GB/s peak
    assert secs >= 2 * (1 << 20) / 12.8e9
    dev.free(a)
    with pytest.raises(BadArgument):
        dev.free(a)
    with pytest.raises(BadArgument):
        dev.read(b, (1 << 20) - 10, 20)


def test_a_large_device_is_not_backed_up_front():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    d = devices.open("emu:mlu370-x4")
    buf = d.alloc(8 << 30)
    d.write(buf, (8 << 30) - 4, b"tail")
    assert d.read(buf, (8 << 30) - 4, 4) == b"tail"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 * 1024  # KiB
    d.close()


def test_alloc_errors(dev):
    with pytest.raises(BadArgument):
        dev.alloc(0)
    with pytest.raises(BadArgument):
        dev.alloc(2 << 30)


def test_measure_shows_random_access_penalty(dev):
    seq = dev.measure("read", 32)
    r32, r64 = dev.measure("rand", 32), dev.measure("rand", 64)
    assert 0.88 * 12.8 <= seq.gbps <= 12.8
    assert r32.gbps / seq.gbps < 0.5   # one BL16 per activate: tRRD/tFAW/command bus bound
    assert r32.gbps < r64.gbps < seq.gbps
    cp = dev.measure("copy", 64)
    assert 0 < cp.gbps <= 12.8
    with pytest.raises(BadArgument):
        dev.measure("rand", 48)
    with pytest.raises(BadArgument):
        dev.measure("scatter", 64)


def test_unknown_preset():
    with pytest.raises(BadArgument, match="unknown emulator preset"):
        devices.open("emu:nope")


@pytest.mark.parametrize("preset", ["ddr5-3200", "lpddr5-6400-8b"])
def test_a_granule_below_the_burst_moves_a_whole_burst(preset):
    """`odma-hw probe` sweeps from 32 B; on a 64 B-burst memory each 32 B read still moves a
    64 B burst, so it delivers exactly half the bytes of a 64 B read in the same time."""
    with devices.open(f"emu:{preset}") as d:
        r32, r64 = d.measure("rand", 32), d.measure("rand", 64)
        assert r32.gbps == pytest.approx(r64.gbps / 2)
        with pytest.raises(BadArgument, match="neither a multiple nor a divisor"):
            d.measure("rand", 48)
