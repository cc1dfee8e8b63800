"""torch:<device> moves real bytes through tensors and rejects bad input without side effects."""

import pytest

torch = pytest.importorskip("torch")

from odma_cli.errors import BadArgument, DeviceUnavailable  # noqa: E402
from odma_hw import devices  # noqa: E402


@pytest.fixture
def dev():
    with devices.open("torch:cpu") as d:
        yield d


def test_write_read_roundtrip_at_odd_offsets(dev):
    buf = dev.alloc(4099)
    payload = bytes(range(256)) * 3 + b"\x07"
    dev.write(buf, 13, payload)
    assert dev.read(buf, 13, len(payload)) == payload


def test_copy_moves_bytes_including_overlap(dev):
    buf = dev.alloc(1000)
    data = bytes((i * 7) % 251 for i in range(1000))
    dev.write(buf, 0, data)
    dev.copy(buf, 100, buf, 0, 500)          # overlapping, forward
    assert dev.read(buf, 100, 500) == data[:500]
    other = dev.alloc(600)
    seconds = dev.copy(other, 1, buf, 100, 499)
    assert seconds >= 0 and dev.read(other, 1, 499) == data[:499]


def test_tensor_view_aliases_device_memory(dev):
    buf = dev.alloc(64)
    view = dev.tensor(buf, 8, 16)
    view.fill_(0xAB)
    assert dev.read(buf, 8, 16) == b"\xab" * 16


@pytest.mark.parametrize("offset,nbytes", [(-1, 4), (0, 65), (60, 5)])
def test_out_of_range_is_rejected(dev, offset, nbytes):
    buf = dev.alloc(64)
    dev.write(buf, 0, b"x" * 64)
    with pytest.raises(BadArgument):
        dev.read(buf, offset, nbytes)
    with pytest.raises(BadArgument):
        dev.write(buf, offset, b"y" * max(nbytes, 0))
    assert dev.read(buf, 0, 64) == b"x" * 64


def test_double_free_and_foreign_buffers_are_rejected(dev):
    buf = dev.alloc(64)
    dev.free(buf)
    with pytest.raises(BadArgument):
        dev.free(buf)
    with devices.open("torch:cpu") as other:
        theirs = other.alloc(64)
        with pytest.raises(BadArgument):
            dev.read(theirs, 0, 1)


@pytest.mark.parametrize("nbytes", [0, -5, 1 << 60])
def test_bad_sizes_are_rejected(dev, nbytes):
    with pytest.raises(BadArgument):
        dev.alloc(nbytes)


def test_measure_reports_positive_bandwidth_with_useful_byte_counts(dev):
    size = 32 << 20
    read = dev.measure("read", 64, buffer_bytes=size, reps=2)
    copy = dev.measure("copy", 64, buffer_bytes=size, reps=2)
    rand = dev.measure("rand", 256, buffer_bytes=size, reps=2)
    assert read.bytes == size and copy.bytes == size  # copy counts both halves: read + write
    assert rand.bytes % 256 == 0
    assert min(read.gbps, copy.gbps, rand.gbps) > 0


@pytest.mark.parametrize("pattern,granule", [("scan", 64), ("rand", 48), ("rand", 4)])
def test_measure_rejects_bad_arguments(dev, pattern, granule):
    with pytest.raises(BadArgument):
        dev.measure(pattern, granule, buffer_bytes=1 << 20, reps=1)


def test_absent_accelerator_is_reported_not_crashed():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(DeviceUnavailable, match="no cuda"):
        devices.open("torch:cuda:0")
    with pytest.raises(BadArgument):
        devices.open("torch:warp-drive")
