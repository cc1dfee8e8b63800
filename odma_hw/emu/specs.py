"""DRAM standards as plain data: organisation and timings, secondary timings derived in one place.

In the style of gem5's `dram_interfaces/*.py` and Ramulator 2.1's `dram/*.py`: a preset is a frozen
dataclass of numbers; `derive()` turns a ChannelSpec into the integer CK counts of every rule the
engine and the checker enforce. Nothing outside this module knows a JEDEC number.

Sources (facts only, no code):
- LPDDR5: ../shared/reference/lpddr5.md, which gathers Ramulator 2.1 `lpddr5.py`, gem5 `lpddr5.py` and
  DRAMSys `MemSpecLPDDR5.h`. The public models call several of these values estimates of the NDA'd
  JEDEC tables; so do we. Lower data rates keep the 6400 ns values and recompute CK counts.
- LPDDR4-4266: DRAMSys `JEDEC_1Gbx16_LPDDR4-4266.json` via lpddr5.md.
- HBM2: gem5 `dram_interfaces/hbm.py`, class HBM_2000_4H_1x64 (one 64-bit pseudo channel, 2 Gb/s,
  BL4, 16 banks in 4 groups, 1 KiB page, two-cycle activate). HBM has separate row and column
  command buses (JESD235), so activates do not compete with reads for command slots.
- DDR5-3200AN: Ramulator 2.1 `src/dram/impl/DDR5.cpp` (preset DDR5_3200AN, org DDR5_8Gb_x8; one
  32-bit sub-channel of x8 devices, BL16 = 64 B, two-cycle ACT/RD/WR commands).
"""

from __future__ import annotations

import dataclasses
import math

from odma_cli.errors import BadArgument


@dataclasses.dataclass(frozen=True)
class Organisation:
    """One channel: banks, rows, page and data bus. Bank groups = 1 when the mode has none."""

    bank_groups: int
    banks_per_group: int
    rows: int
    page_bytes: int
    bus_bits: int
    burst_length: int  # beats per RD/WR

    @property
    def banks(self) -> int:
        return self.bank_groups * self.banks_per_group

    @property
    def burst_bytes(self) -> int:
        return self.bus_bits * self.burst_length // 8

    @property
    def channel_bytes(self) -> int:
        return self.banks * self.rows * self.page_bytes


@dataclasses.dataclass(frozen=True)
class Timings:
    """Primary timings of one speed bin, in CK (integers), plus tCK in ns.

    nBL: CK the data bus is busy per burst. nBURST: CK from the first to the last data beat of
    one burst (0 = nBL, a contiguous burst); nBURST > nBL means the burst is sent as two halves of
    nBL/2 CK with a gap of nBURST - nBL = nBL/2 CK that another bank group's burst may fill
    (LPDDR5 BL32 in BG mode). nCCD_L: column-to-column in the same bank group (equal to nCCD_S
    without bank groups). nRCD counts from the first activate part.
    nRFCpb = 0 means the standard has no per-bank refresh in this model.
    """

    tCK_ns: float
    nBL: int
    nCL: int
    nCWL: int
    nRCD: int
    nRCDWR: int
    nRPpb: int
    nRPab: int
    nRAS: int
    nRC: int
    nWR: int
    nRTP: int
    nCCD_S: int
    nCCD_L: int
    nRRD_S: int
    nRRD_L: int
    nFAW: int
    nWTR_S: int
    nWTR_L: int
    nPPD: int
    nRFCab: int
    nRFCpb: int
    nREFI: int
    nREFIpb: int
    nPBR2PBR: int = 0
    nPBR2ACT: int = 0
    nAAD: int = 0          # max ACT-1 -> ACT-2 distance (two-part activate only)
    nWCKPST: int = 0       # WCK sync survives this long after a burst (CAS sync only)
    nRTW_gap: int = 2      # bus turnaround added to the read-to-write rule
    nWTR_L_burst: int = 0  # burst term of same-group write-to-read (BL/n_max on LPDDR5); 0 = nBL
    rd_to_wr: int = 0      # explicit read-to-write override (0 = derive)
    nBURST: int = 0        # first-to-last data beat of one burst (0 = nBL: contiguous)


@dataclasses.dataclass(frozen=True)
class CommandBus:
    """How commands occupy the command/address bus, in CK."""

    act_parts: int = 1     # 2: ACT-1 + ACT-2 (LPDDR4/5)
    ca_act: int = 1        # CK per activate part
    ca_rdwr: int = 1
    ca_pre: int = 1
    ca_ref: int = 1
    cas_sync: bool = False  # LPDDR5: a CAS (WCK2CK sync) precedes RD/WR unless sync is alive
    split_row_col: bool = False  # HBM: separate row and column command buses


@dataclasses.dataclass(frozen=True)
class ChannelSpec:
    name: str
    standard: str
    data_rate_mts: int
    org: Organisation
    timings: Timings
    bus: CommandBus
    mode: str = ""  # LPDDR5 bank mode: bg | 16b | 8b
    source: str = ""

    @property
    def peak_gbps(self) -> float:
        """Data-bus ceiling: one burst every nBL CK."""
        return self.org.burst_bytes / (self.timings.nBL * self.timings.tCK_ns)

    @property
    def burst_bytes(self) -> int:
        return self.org.burst_bytes


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """A device: N identical channels behind one controller that interleaves addresses across
    channels every `interleave_bytes`."""

    name: str
    channel: ChannelSpec
    channels: int = 1
    interleave_bytes: int = 256

    @property
    def peak_gbps(self) -> float:
        return self.channel.peak_gbps * self.channels

    @property
    def total_bytes(self) -> int:
        return self.channel.org.channel_bytes * self.channels


@dataclasses.dataclass(frozen=True)
class Derived:
    """Every rule the engine and the checker enforce, in CK. The one place secondary timings are
    computed (see derive())."""

    nBL: int           # data-bus CK carrying data per burst
    nBURST: int        # first-to-last data beat: nBL, or nBL + nBL/2 for a burst in two halves
    nCL: int
    nCWL: int
    nRCD_RD: int
    nRCD_WR: int
    nRP: int
    nRPab: int
    nRAS: int
    nRC: int
    nCCD_S: int
    nCCD_L: int
    nRRD_S: int
    nRRD_L: int
    nFAW: int
    rd_to_wr: int      # RD -> WR, any bank
    wr_to_rd_S: int    # WR -> RD, other bank group
    wr_to_rd_L: int    # WR -> RD, same bank group
    rd_to_pre: int     # RD -> PRE, same bank
    wr_to_pre: int     # WR -> PRE, same bank
    nPPD: int
    nAAD: int
    nRFCab: int
    nRFCpb: int
    nREFI: int
    nREFIpb: int
    nPBR2PBR: int
    nPBR2ACT: int
    nWCKPST: int
    ca_act: int
    act_parts: int
    ca_rdwr: int
    ca_pre: int
    ca_ref: int
    cas_sync: int
    split_row_col: int
    banks: int
    banks_per_group: int


def derive(ch: ChannelSpec) -> Derived:
    t, b, o = ch.timings, ch.bus, ch.org
    burst = t.nBURST or t.nBL
    if burst != t.nBL and (t.nBL % 2 or burst != t.nBL + t.nBL // 2):
        raise BadArgument(f"{ch.name}: a split burst is two halves of nBL/2 CK with a gap of "
                          f"nBL/2 CK (nBURST = 3 nBL/2), not nBL={t.nBL}, nBURST={burst}")
    # the closest two bursts' data may start: another group's burst may fill a split burst's gap
    min_spacing = t.nBL // 2 if burst != t.nBL else t.nBL
    # turnarounds and write recovery count from the last data beat, i.e. the whole burst span
    rd_to_wr = t.rd_to_wr or (t.nCL + burst + t.nRTW_gap - t.nCWL)
    return Derived(
        nBL=t.nBL, nBURST=burst, nCL=t.nCL, nCWL=t.nCWL, nRCD_RD=t.nRCD, nRCD_WR=t.nRCDWR,
        nRP=t.nRPpb, nRPab=t.nRPab, nRAS=t.nRAS, nRC=max(t.nRC, t.nRAS + t.nRPpb),
        nCCD_S=max(t.nCCD_S, min_spacing), nCCD_L=max(t.nCCD_L, t.nCCD_S, burst),
        nRRD_S=t.nRRD_S, nRRD_L=max(t.nRRD_L, t.nRRD_S), nFAW=t.nFAW,
        rd_to_wr=max(rd_to_wr, 1),
        wr_to_rd_S=t.nCWL + burst + t.nWTR_S,
        wr_to_rd_L=t.nCWL + (t.nWTR_L_burst or burst) + t.nWTR_L,
        rd_to_pre=t.nRTP,
        wr_to_pre=t.nCWL + burst + t.nWR,
        nPPD=t.nPPD, nAAD=max(t.nAAD, b.ca_act),
        nRFCab=t.nRFCab, nRFCpb=t.nRFCpb, nREFI=t.nREFI, nREFIpb=t.nREFIpb,
        nPBR2PBR=t.nPBR2PBR, nPBR2ACT=t.nPBR2ACT, nWCKPST=t.nWCKPST,
        ca_act=b.ca_act, act_parts=b.act_parts, ca_rdwr=b.ca_rdwr, ca_pre=b.ca_pre,
        ca_ref=b.ca_ref, cas_sync=int(b.cas_sync), split_row_col=int(b.split_row_col),
        banks=o.banks, banks_per_group=o.banks_per_group,
    )


# ---------------------------------------------------------------------------------------------
# LPDDR5: reference ns values (lpddr5.md, LPDDR5-6400 x16 8 Gb); other data rates recompute CK.

def _ck(ns: float, tck: float, minimum: int = 0) -> int:
    return max(minimum, math.ceil(round(ns / tck, 6)))


LPDDR5_NS = dict(RL=21.25, WL=11.25, RCD=18.75, RPpb=18.75, RPab=21.25, RAS=42.5, RC=61.25,
                 WR=35.0, RTP=10.0, WTR_S=6.25, WTR_L=12.5, RFCab=210.0, RFCpb=120.0,
                 REFI=3906.25, PBR2PBR=90.0, PBR2ACT=7.5)


def lpddr5(data_rate: int, mode: str = "bg", bl: int = 16) -> ChannelSpec:
    """One LPDDR5 x16 channel (8 Gb die) at `data_rate` MT/s in bank mode bg|16b|8b.

    WCK:CK = 4:1 (8 data beats per CK) at every rate, so BL16 is 2 CK and BL32 is 4 CK of data bus.
    BG mode: 4 groups x 4 banks, tCCD_S = BL/n_min = 2 CK, tCCD_L = BL/n_max (4 CK BL16, 8 CK
    BL32). A BL32 in BG mode is sent as two 16-beat halves with a 2 CK gap (tBURST 6 CK, gem5
    LPDDR5_6400_1x16_BG_BL32): the second half starts 4 CK after the first, and another bank
    group's burst issued 2 CK later fills the gap. 16B/8B-mode BL32 is 4 contiguous CK.
    16B mode: 16 banks, no groups, <= 3200 MT/s. 8B mode: 8 banks, BL32 only, 4 KiB page,
    tRRD 10 ns, tFAW 40 ns.
    """
    mode = mode.lower()
    if mode not in ("bg", "16b", "8b"):
        raise BadArgument(f"unknown LPDDR5 bank mode {mode!r}: expected bg, 16b or 8b")
    if bl not in (16, 32):
        raise BadArgument(f"LPDDR5 burst length must be 16 or 32, not {bl}")
    if mode == "8b" and bl != 32:
        raise BadArgument("LPDDR5 8B mode supports BL32 only")
    if mode == "16b" and data_rate > 3200:
        raise BadArgument(f"LPDDR5 16B mode runs at most 3200 MT/s, not {data_rate}")
    if mode == "bg" and data_rate <= 3200:
        raise BadArgument(f"LPDDR5 BG mode is for data rates above 3200 MT/s, not {data_rate}")
    tck = 8000.0 / data_rate  # ns; 4:1 WCK:CK, 8 beats per CK
    ns = LPDDR5_NS
    n_bl = bl // 8
    n_burst = 0  # contiguous
    if mode == "bg":
        org = Organisation(4, 4, 1 << 15, 2048, 16, bl)
        ccd_s, ccd_l, wtr_l_burst = 2, 2 * n_bl, 2 * n_bl
        if bl == 32:
            n_burst = n_bl + n_bl // 2  # two 2 CK halves, 2 CK apart: 6 CK
        rrd, faw = _ck(5.0, tck, 2), _ck(20.0, tck)
    elif mode == "16b":
        org = Organisation(1, 16, 1 << 15, 2048, 16, bl)
        ccd_s = ccd_l = n_bl
        wtr_l_burst = 0
        rrd, faw = _ck(5.0, tck, 2), _ck(20.0, tck)
    else:
        org = Organisation(1, 8, 1 << 15, 4096, 16, bl)
        ccd_s = ccd_l = n_bl
        wtr_l_burst = 0
        rrd, faw = _ck(10.0, tck, 2), _ck(40.0, tck)
    rcd, rp = _ck(ns["RCD"], tck), _ck(ns["RPpb"], tck)
    ras = _ck(ns["RAS"], tck)
    t = Timings(
        tCK_ns=tck, nBL=n_bl, nCL=_ck(ns["RL"], tck), nCWL=_ck(ns["WL"], tck),
        nRCD=rcd, nRCDWR=rcd, nRPpb=rp, nRPab=_ck(ns["RPab"], tck), nRAS=ras,
        nRC=max(_ck(ns["RC"], tck), ras + rp), nWR=_ck(ns["WR"], tck), nRTP=_ck(ns["RTP"], tck),
        nCCD_S=ccd_s, nCCD_L=ccd_l, nRRD_S=rrd, nRRD_L=rrd, nFAW=faw,
        nWTR_S=_ck(ns["WTR_S"], tck), nWTR_L=_ck(ns["WTR_L"], tck), nPPD=2,
        nRFCab=_ck(ns["RFCab"], tck), nRFCpb=_ck(ns["RFCpb"], tck),
        nREFI=round(ns["REFI"] / tck), nREFIpb=round(ns["REFI"] / 8 / tck),
        nPBR2PBR=_ck(ns["PBR2PBR"], tck), nPBR2ACT=_ck(ns["PBR2ACT"], tck),
        nAAD=8, nWCKPST=2, nWTR_L_burst=wtr_l_burst, nBURST=n_burst,
    )
    bus = CommandBus(act_parts=2, ca_act=1, ca_rdwr=1, ca_pre=1, ca_ref=1, cas_sync=True)
    name = f"LPDDR5-{data_rate} x16 {mode.upper()} BL{bl}"
    return ChannelSpec(name, "LPDDR5", data_rate, org, t, bus, mode,
                       "lpddr5.md (Ramulator 2.1 / gem5 / DRAMSys LPDDR5 models)")


def lpddr5x(data_rate: int = 8533, mode: str = "bg", bl: int = 16) -> ChannelSpec:
    """LPDDR5X keeps LPDDR5's core timings in ns (same array), at a higher interface rate."""
    ch = lpddr5(data_rate, mode, bl)
    return dataclasses.replace(ch, name=ch.name.replace("LPDDR5", "LPDDR5X"), standard="LPDDR5X")


def lpddr4_4266() -> ChannelSpec:
    """LPDDR4-4266 x16, 8 banks; every command takes 2 CK on the 6-bit CA bus (ACT-1 + ACT-2,
    RD-1/WR-1 + CAS-2), so an activate costs 4 CK and a column command 4 CK of command bus."""
    org = Organisation(1, 8, 1 << 16, 2048, 16, 16)
    t = Timings(
        tCK_ns=0.469, nBL=8, nCL=36, nCWL=18, nRCD=39 + 2, nRCDWR=39 + 2, nRPpb=39, nRPab=45,
        nRAS=90 + 2, nRC=129 + 2, nWR=39, nRTP=17, nCCD_S=8, nCCD_L=8, nRRD_S=22, nRRD_L=22,
        nFAW=86, nWTR_S=22, nWTR_L=22, nPPD=4, nRFCab=812, nRFCpb=406, nREFI=8341,
        nREFIpb=8341 // 8, nPBR2PBR=192, nPBR2ACT=16, nAAD=2,
    )
    # tRCD/tRAS count from ACT-2 in LPDDR4; we count from ACT-1, hence the + 2 (ACT-2 offset).
    bus = CommandBus(act_parts=2, ca_act=2, ca_rdwr=4, ca_pre=2, ca_ref=2)
    return ChannelSpec("LPDDR4-4266 x16", "LPDDR4", 4266, org, t, bus, "",
                       "DRAMSys JEDEC_1Gbx16_LPDDR4-4266.json via lpddr5.md")


def hbm2_2000() -> ChannelSpec:
    """HBM2 pseudo channel, gem5 HBM_2000_4H_1x64: tCK 1 ns, 64-bit, BL4 (32 B in 2 CK)."""
    org = Organisation(4, 4, 1 << 14, 1024, 64, 4)
    t = Timings(
        tCK_ns=1.0, nBL=2, nCL=18, nCWL=7, nRCD=12, nRCDWR=6, nRPpb=14, nRPab=14, nRAS=28,
        nRC=42, nWR=14, nRTP=5, nCCD_S=2, nCCD_L=3, nRRD_S=4, nRRD_L=6, nFAW=16,
        nWTR_S=4, nWTR_L=9, nPPD=1, nRFCab=220, nRFCpb=0, nREFI=3900, nREFIpb=0,
    )
    bus = CommandBus(act_parts=1, ca_act=2, ca_rdwr=1, ca_pre=1, ca_ref=1, split_row_col=True)
    return ChannelSpec("HBM2-2000 pseudo channel x64", "HBM2", 2000, org, t, bus, "",
                       "gem5 dram_interfaces/hbm.py HBM_2000_4H_1x64")


def ddr5_3200() -> ChannelSpec:
    """DDR5-3200AN sub-channel (32-bit, x8 devices), Ramulator 2.1 DDR5_3200AN / DDR5_8Gb_x8:
    8 groups x 2 banks, BL16 = 64 B in 8 CK, 2-cycle ACT/RD/WR commands."""
    org = Organisation(8, 2, 1 << 16, 4096, 32, 16)
    tck = 0.625
    t = Timings(
        tCK_ns=tck, nBL=8, nCL=24, nCWL=22, nRCD=24, nRCDWR=24, nRPpb=24, nRPab=24, nRAS=52,
        nRC=75, nWR=48, nRTP=12, nCCD_S=8, nCCD_L=8, nRRD_S=8, nRRD_L=8, nFAW=32,
        nWTR_S=4, nWTR_L=16, nPPD=2, nRFCab=_ck(195.0, tck), nRFCpb=0,
        nREFI=round(3900 / tck), nREFIpb=0, nRTW_gap=4,
    )
    bus = CommandBus(act_parts=1, ca_act=2, ca_rdwr=2, ca_pre=1, ca_ref=1)
    return ChannelSpec("DDR5-3200AN x32 sub-channel", "DDR5", 3200, org, t, bus, "",
                       "Ramulator 2.1 src/dram/impl/DDR5.cpp DDR5_3200AN")


# ---------------------------------------------------------------------------------------------
# Presets users name (`--spec`, `emu:<preset>`).

def _lp5(rate, mode="bg", bl=16):
    return lambda m=None, b=None: lpddr5(rate, m or mode, b or bl)


_FIXED = {
    "lpddr4-4266": lpddr4_4266,
    "hbm2-2000": hbm2_2000,
    "ddr5-3200": ddr5_3200,
}

# name -> (builder(mode, bl) -> ChannelSpec, channels, interleave bytes, description)
PRESETS = {
    "lpddr5-6400": (_lp5(6400), 1, 256, "LPDDR5-6400 x16, BG mode, BL16 (BL32 selectable)"),
    "lpddr5-5500": (_lp5(5500), 1, 256, "LPDDR5-5500 x16, BG mode, BL16"),
    "lpddr5-4267": (_lp5(4267), 1, 256, "LPDDR5-4267 x16, BG mode, BL16"),
    "lpddr5-3200": (_lp5(3200, "16b"), 1, 256, "LPDDR5-3200 x16, 16B mode, BL16"),
    "lpddr5-6400-8b": (_lp5(6400, "8b", 32), 1, 256, "LPDDR5-6400 x16, 8B mode, BL32"),
    "lpddr5x-8533": (lambda m=None, b=None: lpddr5x(8533, m or "bg", b or 16), 1, 256,
                     "LPDDR5X-8533 x16, BG mode, BL16"),
    "lpddr4-4266": (None, 1, 256, "LPDDR4-4266 x16, 8 banks, BL16"),
    "hbm2-2000": (None, 1, 256, "HBM2 2 Gb/s, one 64-bit pseudo channel (gem5)"),
    "ddr5-3200": (None, 1, 256, "DDR5-3200AN, one 32-bit sub-channel (Ramulator 2.1)"),
    # MLU370-X4: 24 GB LPDDR5, 307.2 GB/s = 24 x16 channels at 6400. The interleave granule of
    # its controller is not public; 256 B is our assumption (a few bursts per channel).
    "mlu370-x4": (_lp5(6400), 24, 256, "Cambricon MLU370-X4: 24 x LPDDR5-6400 x16, 307.2 GB/s"),
}


def preset_names() -> list[str]:
    return list(PRESETS)


def device_spec(name: str, *, mode: str | None = None, bl: int | None = None,
                channels: int | None = None, interleave: int | None = None) -> DeviceSpec:
    """Resolve a preset (with optional LPDDR5 mode/BL, channel count and interleave overrides)."""
    key = (name or "").strip().lower()
    if key not in PRESETS:
        raise BadArgument(f"unknown emulator preset {name!r}: expected one of "
                          + ", ".join(PRESETS))
    builder, n_ch, gran, _ = PRESETS[key]
    if builder is None:
        if mode is not None or bl is not None:
            raise BadArgument(f"--mode/--bl apply to LPDDR5 presets only, not {key}")
        ch = _FIXED[key]()
    else:
        ch = builder(mode, bl)
    if channels is not None:
        if not isinstance(channels, int) or channels < 1 or channels > 1024:
            raise BadArgument(f"channels must be an integer in [1, 1024], not {channels!r}")
        n_ch = channels
    if interleave is not None:
        if (not isinstance(interleave, int) or interleave < ch.burst_bytes
                or interleave & (interleave - 1) or interleave > ch.org.channel_bytes):
            raise BadArgument(f"channel interleave must be a power of two between the "
                              f"{ch.burst_bytes}-byte burst and the {ch.org.channel_bytes}-byte "
                              f"channel, not {interleave}")
        gran = interleave
    gran = max(gran, ch.burst_bytes)
    return DeviceSpec(key, ch, n_ch, gran)
