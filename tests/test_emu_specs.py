"""Specs: the derived LPDDR5-6400 rules equal the reference table (lpddr5.md), presets resolve."""

import pytest

from odma_cli.errors import BadArgument
from odma_hw.emu import derive, device_spec, preset_names
from odma_hw.emu.specs import lpddr5


def test_lpddr5_6400_bg_bl16_matches_the_reference_table():
    ch = device_spec("lpddr5-6400").channel
    d = derive(ch)
    assert ch.timings.tCK_ns == pytest.approx(1.25)
    assert (d.nBL, d.nCL, d.nCWL, d.nRCD_RD, d.nRP, d.nRPab, d.nRAS, d.nRC) == (2, 17, 9, 15, 15, 17, 34, 49)
    assert (ch.timings.nWR, d.rd_to_pre, d.nCCD_S, d.nCCD_L, d.nRRD_S, d.nFAW) == (28, 8, 2, 4, 4, 16)
    assert (d.rd_to_wr, d.wr_to_rd_S, d.wr_to_rd_L) == (12, 16, 23)  # RL+2+2-WL; WL+2+5; WL+4+10
    assert (d.nPPD, d.nAAD, d.nRFCab, d.nRFCpb, d.nREFI, d.nREFIpb) == (2, 8, 168, 96, 3125, 391)
    assert d.act_parts == 2 and d.cas_sync == 1
    assert ch.burst_bytes == 32 and ch.peak_gbps == pytest.approx(12.8)


def test_bank_modes_follow_the_mode_table():
    # BG-mode BL32: two 2 CK halves 4 CK apart (tBURST 6 CK); another group's burst may fill the
    # gap 2 CK later (tCCD_S = BL/n_min); same group tCCD_L = BL/n_max = 8 CK
    bl32 = derive(lpddr5(6400, "bg", 32))
    assert (bl32.nBL, bl32.nBURST, bl32.nCCD_S, bl32.nCCD_L) == (4, 6, 2, 8)
    # turnarounds and write recovery count from the last data beat: RL+6+2-WL; WL+6+5; WL+6+nWR
    assert (bl32.rd_to_wr, bl32.wr_to_rd_S, bl32.wr_to_pre) == (16, 20, 9 + 6 + 28)
    assert derive(lpddr5(6400, "bg", 16)).nBURST == 2
    eight = lpddr5(6400, "8b", 32)
    d8 = derive(eight)
    assert (eight.org.banks, eight.org.page_bytes, d8.nRRD_S, d8.nFAW, d8.nBL) == (8, 4096, 8, 32, 4)
    assert (d8.nBURST, d8.nCCD_S) == (4, 4)  # 8B mode: BL32 is 4 contiguous CK
    sixteen = lpddr5(3200, "16b", 16)
    assert sixteen.org.bank_groups == 1 and sixteen.org.banks == 16
    with pytest.raises(BadArgument):
        lpddr5(6400, "16b", 16)  # 16B mode tops out at 3200 MT/s
    with pytest.raises(BadArgument):
        lpddr5(6400, "8b", 16)  # 8B mode is BL32 only


def test_lower_rates_keep_the_ns_values():
    d = derive(lpddr5(4267))
    tck = 8000 / 4267
    assert d.nRCD_RD * tck >= 18.75 > (d.nRCD_RD - 1) * tck
    assert d.nFAW * tck >= 20.0 > (d.nFAW - 1) * tck


def test_presets_and_devices():
    names = preset_names()
    for required in ("lpddr5-6400", "lpddr5-5500", "lpddr5-4267", "lpddr5-3200", "lpddr5-6400-8b",
                     "lpddr5x-8533", "lpddr4-4266", "hbm2-2000", "ddr5-3200", "mlu370-x4"):
        assert required in names
        assert device_spec(required).peak_gbps > 0
    mlu = device_spec("mlu370-x4")
    assert mlu.channels == 24 and mlu.peak_gbps == pytest.approx(307.2)
    assert mlu.total_bytes == 24 << 30
    assert device_spec("lpddr4-4266").peak_gbps == pytest.approx(8.532, rel=1e-3)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(BadArgument, match="lpddr5-6400.*mlu370-x4"):
        device_spec("lpddr6-9999")
    with pytest.raises(BadArgument):
        device_spec("hbm2-2000", bl=32)  # mode/BL apply to LPDDR5 only
