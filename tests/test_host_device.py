"""The host Device (odma_hw.devices.host) as the allocator and the probe use it.

Specification:
- `host` is always discovered when the shim is built, and opens to a Device describing this CPU;
- bytes written come back unchanged; copies are exact, also inside one buffer (memmove semantics);
- every bad argument is a BadArgument that leaves memory as it was; freeing twice, using a freed
  buffer and touching bytes outside a buffer are BadArguments;
- memory goes back to the OS on free(), on close() and when buffers or the device are collected;
- measure() validates its input, counts bytes by the documented convention, records its
  environment, frees its buffer on every exit (errors and Ctrl-C included) and turns a shim failure
  into DeviceError.
"""

import gc
import os

import numpy as np
import pytest

from odma_cli.errors import BadArgument, DeviceError
from odma_hw import devices, native
from odma_hw.devices import host as host_backend

MIB = 1 << 20


@pytest.fixture
def dev():
    d = devices.open("host")
    yield d
    d.close()


def test_host_is_discovered_and_describes_this_cpu(dev):
    assert host_backend.discover() == (["host"], None)
    info = dev.info
    assert (info.spec, info.kind) == ("host", "host")
    assert info.name and info.name == host_backend.cpu_model()
    assert info.peak_gbps is None  # DRAM peak is unknowable from inside a VM
    assert info.natural_granule == 64
    assert info.max_threads == len(os.sched_getaffinity(0))  # the CPUs this process may use
    assert 0 < info.free_bytes <= info.total_bytes
    assert dev.alignment == 64


def test_host_takes_no_argument():
    with pytest.raises(BadArgument):
        host_backend.open_device("0")


def test_written_bytes_read_back_unchanged(dev):
    buf = dev.alloc(10_000)
    payload = os.urandom(4321)
    dev.write(buf, 17, payload)
    assert dev.read(buf, 17, 4321) == payload
    assert dev.read(buf, 0, 17) == bytes(17)  # fresh memory is zero
    dev.write(buf, 0, bytearray(b"ab"))
    dev.write(buf, 9_990, memoryview(b"0123456789"))
    dev.write(buf, 100, np.arange(4, dtype=np.uint32))
    assert dev.read(buf, 0, 2) == b"ab"
    assert dev.read(buf, 9_990, 10) == b"0123456789"
    assert dev.read(buf, 100, 16) == np.arange(4, dtype=np.uint32).tobytes()
    assert dev.read(buf, 5, 0) == b""
    dev.free(buf)


def test_copy_is_exact_between_and_within_buffers(dev):
    a, b = dev.alloc(3 * MIB + 5), dev.alloc(3 * MIB + 5)
    data = os.urandom(3 * MIB + 5)
    dev.write(a, 0, data)
    seconds = dev.copy(b, 3, a, 1, 3 * MIB)
    assert isinstance(seconds, float) and seconds >= 0
    assert dev.read(b, 3, 3 * MIB) == data[1:3 * MIB + 1]
    assert dev.read(b, 0, 3) == bytes(3)
    # overlapping ranges of one buffer: like memmove
    dev.copy(a, 100, a, 0, 2 * MIB)
    assert dev.read(a, 100, 2 * MIB) == data[:2 * MIB]
    dev.copy(a, 0, a, 100, 2 * MIB)
    assert dev.read(a, 0, 2 * MIB) == data[:2 * MIB]
    dev.free(a)
    dev.free(b)


@pytest.mark.parametrize("nbytes", [0, -1, 1.5, True, "1", None])
def test_alloc_rejects_sizes_that_are_not_positive_integers(dev, nbytes):
    with pytest.raises(BadArgument):
        dev.alloc(nbytes)


def test_alloc_rejects_more_than_available_memory(dev):
    with pytest.raises(BadArgument, match="available"):
        dev.alloc(host_backend.mem_available() + (1 << 30))


def test_free_twice_is_a_bad_argument(dev):
    buf = dev.alloc(4096)
    dev.free(buf)
    with pytest.raises(BadArgument, match="already freed"):
        dev.free(buf)
    with pytest.raises(BadArgument):
        dev.read(buf, 0, 1)
    with pytest.raises(BadArgument):
        dev.write(buf, 0, b"x")


def test_buffers_of_another_device_are_refused(dev):
    other = devices.open("host")
    theirs = other.alloc(4096)
    try:
        with pytest.raises(BadArgument):
            dev.free(theirs)
        with pytest.raises(BadArgument):
            dev.read(theirs, 0, 1)
    finally:
        other.close()


@pytest.mark.parametrize("offset,nbytes", [(-1, 1), (0, 4097), (4096, 1), (4000, 97), (0, -1),
                                           (1.0, 1), (0, 2.0)])
def test_access_outside_the_buffer_is_refused_and_changes_nothing(dev, offset, nbytes):
    buf = dev.alloc(4096)
    dev.write(buf, 0, b"\x5a" * 4096)
    with pytest.raises(BadArgument):
        dev.read(buf, offset, nbytes)
    if isinstance(nbytes, int) and nbytes >= 0:
        with pytest.raises(BadArgument):
            dev.write(buf, offset, b"\x00" * nbytes)
    other = dev.alloc(8192)
    with pytest.raises(BadArgument):
        dev.copy(other, 0, buf, offset, nbytes)
    with pytest.raises(BadArgument):
        dev.copy(buf, offset, other, 0, nbytes)
    assert dev.read(buf, 0, 4096) == b"\x5a" * 4096
    assert dev.read(other, 0, 8192) == bytes(8192)


@pytest.mark.parametrize("data", [12, "text", None, np.arange(8)[::2]])
def test_write_needs_contiguous_bytes(dev, data):
    buf = dev.alloc(4096)
    with pytest.raises(BadArgument):
        dev.write(buf, 0, data)


def test_close_frees_everything_and_ends_use(dev):
    bufs = [dev.alloc(MIB) for _ in range(3)]
    dev.free(bufs[0])
    dev.close()
    assert dev._live.sizes == {}
    with pytest.raises(BadArgument):
        dev.read(bufs[1], 0, 1)
    with pytest.raises(BadArgument):
        dev.free(bufs[2])
    with pytest.raises(BadArgument):
        dev.alloc(MIB)
    with pytest.raises(BadArgument):
        dev.measure("read", buffer_bytes=MIB)
    dev.close()  # idempotent


def test_garbage_buffers_and_devices_give_their_memory_back():
    d = devices.open("host")
    live = d._live
    kept = d.alloc(MIB)
    d.alloc(MIB)  # dropped at once
    gc.collect()
    assert list(live.sizes) == [kept.handle]
    del d, kept
    gc.collect()
    assert live.sizes == {}


# ------------------------------------------------------------------------------------ measure

def test_measure_counts_bytes_by_convention_and_records_its_environment(dev):
    m = dev.measure("read", 64, 2, buffer_bytes=16 * MIB)
    assert (m.pattern, m.granule, m.threads, m.buffer_bytes, m.reps) == ("read", 64, 2, 16 * MIB, 5)
    assert m.bytes == 16 * MIB
    assert 0 < m.best_s <= m.median_s <= m.worst_s
    assert m.gbps >= m.median_gbps > 0
    for key in ("cpu_model", "huge_page_bytes", "huge_page_fraction", "page_size", "buffer_bytes",
                "threads", "reps", "compiler_flags", "loadavg_1m", "llc_reported_bytes"):
        assert key in m.extra, key
    assert m.extra["page_size"] in ("2M", "4K", "mixed")
    assert 0 <= m.extra["huge_page_bytes"] <= 16 * MIB
    assert "-O3" in m.extra["compiler_flags"]

    c = dev.measure("copy", buffer_bytes=16 * MIB + 200, reps=5)
    assert c.bytes == 2 * ((16 * MIB + 200) // 2 // 64 * 64)  # read + write of the half
    r = dev.measure("rand", 256, 1, buffer_bytes=16 * MIB, reps=5, work_bytes=3 * MIB + 1)
    assert r.bytes == (3 * MIB + 1) // 256 * 256
    assert r.method == "rand-mcg-8way"


def test_measure_reports_more_threads_than_cpus(dev):
    m = dev.measure("read", threads=dev.info.max_threads + 1, buffer_bytes=4 * MIB, reps=1)
    assert m.extra["threads_oversubscribed"] is True


def test_default_buffers_follow_the_working_set_rule(dev):
    avail_half = host_backend.mem_available() // 2
    llc = dev.info.details["llc_reported_bytes"] or 0
    read = dev.default_buffer_bytes("read")
    assert read == min(max(min(4 * llc, 4 << 30), 1 << 30), avail_half) // (2 * MIB) * (2 * MIB)
    assert dev.default_buffer_bytes("copy") in (2 * read, avail_half // (2 * MIB) * (2 * MIB))
    assert dev.default_buffer_bytes("rand") == min(1 << 30, avail_half) // (2 * MIB) * (2 * MIB)


BAD_MEASURE = [
    dict(pattern="stream"),
    dict(granule=48), dict(granule=4), dict(granule=0), dict(granule=64.0),
    dict(granule=8 * MIB),  # larger than the buffer
    dict(threads=0), dict(threads=257), dict(threads=1.0),
    dict(reps=0), dict(reps=2.5),
    dict(buffer_bytes=0), dict(buffer_bytes=-4096), dict(buffer_bytes=1.5),
    dict(buffer_bytes="big"),
    dict(seed=-1), dict(work_bytes=-1),
    dict(pattern="copy", buffer_bytes=100),  # too small for two halves (the shim says so)
]


@pytest.mark.parametrize("bad", BAD_MEASURE, ids=[repr(b) for b in BAD_MEASURE])
def test_measure_rejects_bad_input(dev, bad):
    args = dict(pattern="rand", granule=64, threads=1, buffer_bytes=4 * MIB, reps=1)
    args.update(bad)
    pattern = args.pop("pattern")
    with pytest.raises(BadArgument):
        dev.measure(pattern, **args)


def test_the_python_checks_use_the_shims_limits(dev):
    # native/odma.h is the one place for these numbers; base.MIN_GRANULE serves the backends
    # that have no shim (emu, torch) and must agree with it
    from odma_hw.devices import base

    assert base.MIN_GRANULE == native.lib.ODMA_MIN_GRANULE
    assert dev.measure_thread_limit == native.lib.ODMA_MAX_THREADS
    with pytest.raises(BadArgument, match=f"\\[1, {native.lib.ODMA_MAX_REPS}\\]"):
        dev.measure("read", buffer_bytes=4 * MIB, reps=native.lib.ODMA_MAX_REPS + 1)


def test_measure_rejects_a_buffer_larger_than_free_memory(dev):
    with pytest.raises(BadArgument, match="available"):
        dev.measure("read", buffer_bytes=host_backend.mem_available() + (1 << 30))


class ShimSpy:
    """Wraps native.call: records allocations and frees, and raises `fail` from the measurement."""

    def __init__(self, fail):
        self.fail, self.allocated, self.freed = fail, [], []
        self.real = native.call

    def __call__(self, name, *args):
        if name == "odma_host_measure":
            raise self.fail
        self.real(name, *args)
        if name == "odma_host_alloc":
            self.allocated.append(int(native.ffi.cast("uintptr_t", args[2][0])))
        if name == "odma_host_free":
            self.freed.append(int(native.ffi.cast("uintptr_t", args[0])))


@pytest.mark.parametrize("fail", [DeviceError("shim failed"), KeyboardInterrupt()])
def test_measure_frees_its_buffer_when_interrupted_or_failing(dev, monkeypatch, fail):
    spy = ShimSpy(fail)
    monkeypatch.setattr(host_backend.native, "call", spy)
    with pytest.raises(type(fail)):
        dev.measure("read", buffer_bytes=4 * MIB, reps=1)
    assert spy.allocated and spy.freed == spy.allocated


def test_shim_failures_surface_as_device_errors(dev, monkeypatch):
    real = native.call

    def out_of_memory(name, *args):
        if name == "odma_host_alloc":  # what the shim says when mmap fails
            raise native.error_for(native.lib.ODMA_ENOMEM)(
                "mmap of 4194304 bytes failed: Cannot allocate memory")
        return real(name, *args)

    monkeypatch.setattr(host_backend.native, "call", out_of_memory)
    with pytest.raises(DeviceError, match="mmap"):
        dev.measure("read", buffer_bytes=4 * MIB)
    with pytest.raises(DeviceError):
        dev.alloc(4 * MIB)
    assert dev._live.sizes == {}
