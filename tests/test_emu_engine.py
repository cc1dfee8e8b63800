"""The timing engine runs in resumable slices: however a run is cut, it gives the same result to
the bit; its index tables come from one list of names each; the address decomposition, done in
chunks, is the same as in one piece; the write-drain watermarks and the queue unit mean what the
documentation says."""

import dataclasses

import numpy as np
import pytest

from odma_cli.errors import BadArgument
from odma_hw.emu import emulate, mapping, state, timing_loop
from odma_hw.emu.mapping import address_map, decompose
from odma_hw.emu.model import controller_options
from odma_hw.emu.specs import Derived, derive, device_spec
from odma_hw.emu.traces import generate


def _prepared(spec, pattern, requests, *, bl=None, write_ratio=0.3, refresh="allbank",
              page="open", scheduler="frfcfs", queue=32, queue_unit="burst", seed=3):
    dev = device_spec(spec, bl=bl)
    tr = generate(pattern, requests, 64, footprint=dev.total_bytes, burst=dev.channel.burst_bytes,
                  write_ratio=write_ratio, seed=seed)
    arrays = decompose(address_map(dev), tr.addr, tr.size, tr.write)
    opt = controller_options(dev, refresh, page, scheduler, queue, False, queue_unit=queue_unit)
    return state.pack(derive(dev.channel)), opt, arrays, dev.channels


def _run(prepared, budget, record=0):
    tp, opt, (offsets, bank, row, bursts, wr), nch = prepared
    stats = np.zeros((nch, state.N_S), np.int64)
    hist = np.zeros((nch, state.HIST_BINS), np.int64)
    log = np.zeros((record, state.LOG_COLS), np.int64) if record else None
    states = timing_loop.run(tp, opt, offsets, bank, row, bursts, wr, stats, hist, log,
                             budget=budget)
    assert states.done
    return stats, hist, log


CASES = [
    dict(spec="lpddr5-6400", pattern="rand"),
    dict(spec="lpddr5-6400", pattern="mixed", refresh="perbank", page="closed"),
    dict(spec="lpddr5-6400", pattern="rand", bl=32, scheduler="fcfs", queue_unit="access"),
    dict(spec="lpddr4-4266", pattern="paged", refresh="none", queue=4),
    dict(spec="hbm2-2000", pattern="kvscan", write_ratio=0.5),
    dict(spec="mlu370-x4", pattern="rand"),  # 24 channels in parallel
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_a_run_cut_into_tiny_slices_equals_one_slice(case):
    prepared = _prepared(requests=6000, **case)
    whole = _run(prepared, budget=1 << 40)
    for budget in (1, 7, 1000):
        sliced = _run(prepared, budget=budget)
        for a, b in zip(whole, sliced):
            if a is not None:
                np.testing.assert_array_equal(a, b)
    assert whole[0][:, state.S.end].min() > 0


def test_recorded_command_logs_do_not_depend_on_slicing():
    prepared = _prepared("lpddr5-6400", "rand", 3000, refresh="perbank")
    whole = _run(prepared, budget=1 << 40, record=50_000)
    sliced = _run(prepared, budget=5, record=50_000)
    assert whole[0][0, state.S.logged] > 10_000
    for a, b in zip(whole, sliced):
        np.testing.assert_array_equal(a, b)


def test_the_default_slices_are_sized_on_the_fly_and_give_the_same_result():
    prepared = _prepared("lpddr5-6400", "rand", 20_000)
    for a, b in zip(_run(prepared, budget=None), _run(prepared, budget=1 << 40)):
        if a is not None:
            np.testing.assert_array_equal(a, b)


def test_progress_is_reported_between_slices():
    seen = []
    s = emulate("lpddr5-6400", "rand", 64, 5000, progress=lambda *a: seen.append(a))
    assert seen[0] == ("trace", 0, 5000)
    timing = [a for a in seen if a[0] == "timing"]
    assert len(timing) >= 1 and timing[-1] == ("timing", s.accesses, s.accesses)
    assert [a[1] for a in timing] == sorted(a[1] for a in timing)


def test_index_tables_come_from_one_list_of_names_each():
    # the timing array follows specs.Derived field by field
    assert T_NAMES == tuple(f.name for f in dataclasses.fields(Derived))
    d = derive(device_spec("lpddr5-6400").channel)
    tp = state.pack(d)
    for name in T_NAMES:
        assert tp[getattr(state.T, name)] == getattr(d, name)
    # every table numbers its names 0, 1, 2, ... in order, and its size is its length
    for table, size in ((state.T, state.N_T), (state.S, state.N_S), (state.O, state.N_O)):
        assert list(table) == list(range(size))
        assert len(set(table._fields)) == size


T_NAMES = state.T._fields


def test_decomposition_in_chunks_equals_one_piece(monkeypatch):
    dev = device_spec("mlu370-x4")
    tr = generate("kvscan", 20_000, 96, footprint=dev.total_bytes, burst=32, write_ratio=0.4)
    amap = address_map(dev, "rbc")
    whole = decompose(amap, tr.addr, tr.size, tr.write)
    monkeypatch.setattr(mapping, "_CHUNK", 999)
    chunked = decompose(amap, tr.addr, tr.size, tr.write)
    for a, b in zip(whole, chunked):
        np.testing.assert_array_equal(a, b)


def test_access_bound_covers_every_generated_pattern():
    for spec, amap_name in (("lpddr5-6400", "bg"), ("mlu370-x4", "rbc"), ("ddr5-3200", "xor")):
        dev = device_spec(spec)
        amap = address_map(dev, amap_name)
        for pattern in ("seq", "rand", "strided", "paged", "kvscan"):
            for g in (64, 96, 4096, 8192):
                if g % dev.channel.burst_bytes:
                    continue
                blocks = dict(block_bytes=64 * g) if pattern == "paged" else {}
                tr = generate(pattern, 3000, g, footprint=dev.total_bytes,
                              burst=dev.channel.burst_bytes, **blocks)
                accesses = decompose(amap, tr.addr, tr.size, tr.write)[1].size
                assert accesses <= 3000 * mapping.max_accesses(amap, g, aligned=True)


# --- write draining and the queue unit ---------------------------------------------------------

def _switches(**kw):
    """Read/write turnarounds in the command stream of a mixed run."""
    s = emulate("lpddr5-6400", "rand", 64, 4000, write_ratio=0.4, refresh="none",
                record=100_000, **kw)
    col = s.log[np.isin(s.log[:, 1], (state.C_RD, state.C_WR)), 1]
    return int((col[1:] != col[:-1]).sum()), s.efficiency


def test_watermarks_set_the_length_of_write_batches():
    default, eff_default = _switches()
    narrow, eff_narrow = _switches(write_high=0.5, write_low=0.4)
    drain_empty, _ = _switches(write_low=0.0)
    assert narrow > 2 * default          # short batches: many more turnarounds, lower efficiency
    assert eff_narrow < eff_default
    assert drain_empty < default         # draining the write queue empty: longer batches


def test_watermarks_are_strict_fractions_of_the_write_queue():
    dev = device_spec("lpddr5-6400")
    # drain from more than 0.8 x 10 = 8 queued writes down to fewer than 0.2 x 10 = 2
    o = controller_options(dev, "allbank", "open", "frfcfs", 10, False, write_high=0.8,
                           write_low=0.2)
    assert (o[state.O.write_high], o[state.O.write_low]) == (9, 1)
    o = controller_options(dev, "allbank", "open", "frfcfs", 32, False)  # default: 26 and 6 of 32
    assert (o[state.O.write_high], o[state.O.write_low]) == (26, 6)


@pytest.mark.parametrize("kw,match", [
    (dict(write_high=1.5), r"high watermark must be a fraction .* \[0, 1\]"),
    (dict(write_low=-0.1), r"low watermark must be a fraction"),
    (dict(write_high=0.3, write_low=0.3), "must be below the high watermark"),
    (dict(queue_unit="bytes"), "unknown queue unit"),
    (dict(threads=0), "threads must be a positive integer"),
    (dict(seed=-1), "seed must be a non-negative integer"),
])
def test_bad_policy_arguments(kw, match):
    with pytest.raises(BadArgument, match=match):
        emulate("lpddr5-6400", "rand", 64, 100, **kw)


def test_an_entry_per_burst_holds_half_as_many_64B_accesses():
    # 64 B = 2 bursts: 32 one-burst entries hold what 16 one-access entries hold
    burst = emulate("lpddr5-6400", "rand", 64, 20_000, queue=32, queue_unit="burst")
    access16 = emulate("lpddr5-6400", "rand", 64, 20_000, queue=16, queue_unit="access")
    access32 = emulate("lpddr5-6400", "rand", 64, 20_000, queue=32, queue_unit="access")
    assert abs(burst.efficiency - access16.efficiency) < 0.005
    assert access32.efficiency > burst.efficiency + 0.02
    # a one-burst request is one entry either way
    one = [emulate("lpddr5-6400", "rand", 32, 20_000, write_ratio=0.3, queue_unit=u).as_dict()
           for u in ("burst", "access")]
    for d in one:
        d.pop("wall_seconds"), d.pop("requests_per_second"), d.pop("config")
    assert one[0] == one[1]
