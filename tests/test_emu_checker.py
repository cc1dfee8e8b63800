"""The recorded command stream of any small run obeys every timing rule, as judged by an
independent plain-Python checker; and the checker does catch broken streams."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from odma_hw.emu import derive, device_spec, emulate
from odma_hw.emu.checker import check
from odma_hw.emu.state import C_ACT1, C_CAS, C_RD, C_REFAB

PRESETS = ["lpddr5-6400", "lpddr5-5500", "lpddr5-3200", "lpddr5-6400-8b", "lpddr5x-8533",
           "lpddr4-4266", "hbm2-2000", "ddr5-3200"]
NO_PERBANK = {"hbm2-2000", "ddr5-3200"}
# BG mode with BL32: each burst is two halves with a gap another bank group's burst may fill
BG_BL32 = ["lpddr5-6400", "lpddr5-5500", "lpddr5-4267", "lpddr5x-8533"]
PATTERNS = ["seq", "rand", "strided", "mixed", "paged", "kvscan"]


def run(spec, requests=1500, **kw):
    s = emulate(spec, requests=requests, record=200_000, **kw)
    d = derive(device_spec(spec, mode=kw.get("mode"), bl=kw.get("bl")).channel)
    return s, d


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.sampled_from(PRESETS), pattern=st.sampled_from(PATTERNS),
       gmul=st.sampled_from([1, 2, 4, 8]), write_ratio=st.sampled_from([0.0, 0.2, 0.5, 1.0]),
       amap=st.sampled_from(["bg", "rbc", "xor"]), refresh=st.sampled_from(["allbank", "perbank", "none"]),
       page=st.sampled_from(["open", "closed"]), sched=st.sampled_from(["frfcfs", "fcfs"]),
       queue=st.sampled_from([1, 4, 32]), unit=st.sampled_from(["burst", "access"]),
       wck=st.booleans(), seed=st.integers(0, 1000), small_footprint=st.booleans())
def test_every_recorded_command_obeys_every_timing_rule(spec, pattern, gmul, write_ratio, amap, refresh,
                                                        page, sched, queue, unit, wck, seed,
                                                        small_footprint):
    if refresh == "perbank" and spec in NO_PERBANK:
        refresh = "none"
    wck = wck and bool(derive(device_spec(spec).channel).cas_sync)   # LPDDR5's alone
    g = device_spec(spec).channel.burst_bytes * gmul
    s, d = run(spec, pattern=pattern, granularity=g, write_ratio=write_ratio, address_map_name=amap,
               refresh=refresh, page_policy=page, scheduler=sched, queue=queue, queue_unit=unit,
               wck_always_on=wck, seed=seed, footprint=(1 << 20) if small_footprint else None)
    assert len(s.log) < 200_000  # the whole run was recorded
    errors = check(s.log, d, refresh=refresh, wck_always_on=wck,
                   expected_bursts=s.requests * gmul)
    assert errors == []


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.sampled_from(BG_BL32), pattern=st.sampled_from(PATTERNS),
       gmul=st.sampled_from([1, 2, 4]), write_ratio=st.sampled_from([0.0, 0.2, 0.5, 1.0]),
       amap=st.sampled_from(["bg", "rbc", "xor"]), refresh=st.sampled_from(["allbank", "perbank", "none"]),
       page=st.sampled_from(["open", "closed"]), sched=st.sampled_from(["frfcfs", "fcfs"]),
       queue=st.sampled_from([1, 4, 32]), wck=st.booleans(), seed=st.integers(0, 1000),
       small_footprint=st.booleans())
def test_bg_mode_bl32_streams_obey_every_timing_rule(spec, pattern, gmul, write_ratio, amap, refresh,
                                                     page, sched, queue, wck, seed, small_footprint):
    s, d = run(spec, bl=32, pattern=pattern, granularity=64 * gmul, write_ratio=write_ratio,
               address_map_name=amap, refresh=refresh, page_policy=page, scheduler=sched,
               queue=queue, wck_always_on=wck, seed=seed,
               footprint=(1 << 20) if small_footprint else None)
    assert d.nBURST > d.nBL  # really the split-burst case
    assert len(s.log) < 200_000
    errors = check(s.log, d, refresh=refresh, wck_always_on=wck,
                   expected_bursts=s.requests * gmul)
    assert errors == []


@pytest.fixture(scope="module")
def good():
    s, d = run("lpddr5-6400", pattern="rand", granularity=64, write_ratio=0.3)
    assert check(s.log, d) == []
    return s.log.copy(), d


def mutated(log, index_of, change):
    bad = log.copy()
    i = index_of(bad)
    change(bad, i)
    return bad


def first(log, cmd, start=10):
    return int(np.flatnonzero(log[:, 1] == cmd)[start])


@pytest.mark.parametrize("name,index_of,change", [
    ("read one CK early", lambda l: first(l, C_RD), lambda l, i: l.__setitem__((i, 0), l[i, 0] - 1)),
    ("activate two CK early", lambda l: first(l, C_ACT1), lambda l, i: l[i:i + 2, 0].__isub__(2)),
    ("read to the wrong row", lambda l: first(l, C_RD), lambda l, i: l.__setitem__((i, 3), l[i, 3] + 1)),
    ("missing CAS", lambda l: first(l, C_CAS, 1), lambda l, i: l.__setitem__((i, 1), -1)),
    ("refresh moved into a busy bank", lambda l: first(l, C_REFAB, 1),
     lambda l, i: l.__setitem__((i, 0), l[i, 0] - 40)),
])
def test_the_checker_catches_broken_streams(good, name, index_of, change):
    log, d = good
    bad = mutated(log, index_of, change)
    bad = bad[bad[:, 1] >= 0]
    assert check(bad, d) != [], name


@pytest.fixture(scope="module")
def good_bl32():
    s, d = run("lpddr5-6400", bl=32, pattern="rand", granularity=64)
    assert check(s.log, d) == []
    return s.log.copy(), d


def test_bl32_bursts_fill_each_others_gaps(good_bl32):
    log, d = good_bl32
    reads = log[log[:, 1] == C_RD]
    spacing = np.diff(reads[:, 0])
    # data starts are 2 CK apart (the second burst fills the first one's gap) or a whole 6 CK
    # burst apart; nothing in between
    assert (spacing == 2).any() and (spacing >= 6).any()
    assert not ((spacing > 2) & (spacing < 6)).any()
    paired = np.flatnonzero(spacing == 2)
    assert (reads[paired, 2] // 4 != reads[paired + 1, 2] // 4).all()  # from another bank group


def test_the_checker_rejects_a_burst_in_the_other_half_slot(good_bl32):
    """4 CK after a BL32 is legal for a contiguous 4 CK burst but lands on the second half of a
    burst sent in two halves: the checker must say the data overlap."""
    log, d = good_bl32
    rd = np.flatnonzero(log[:, 1] == C_RD)
    flagged = 0
    for i, j in zip(rd[:-1], rd[1:]):
        if log[j, 0] - log[i, 0] < 6 or log[i, 2] // 4 == log[j, 2] // 4:
            continue
        bad = log.copy()
        bad[j, 0] = log[i, 0] + 4
        errors = check(bad, d)
        assert errors != []
        if all("overlaps" in e for e in errors):
            flagged += 1  # caught by the data-bus rule alone (no other rule involved)
    assert flagged > 0


def test_a_dropped_burst_is_noticed(good):
    log, d = good
    i = first(log, C_RD)
    assert check(np.delete(log, i, axis=0), d, expected_bursts=int((log[:, 1] == C_RD).sum())) != []
