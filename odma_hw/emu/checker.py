"""Independent plain-Python checker of a recorded command stream.

The engine keeps "earliest next issue" times; this checker knows nothing of that. It replays the
log (time, command, bank, row, aux) with its own bank state machine and checks every command
against the history of earlier ones, rule by rule, with the timings of specs.Derived:

command bus (one command per CK per bus; ACT-2 within tAAD of ACT-1), bank state (ACT only to a
closed bank, RD/WR only to the open row, PRE only to an open bank), same-bank tRC, tRCD, tRAS,
tRP, tRTP, write recovery, auto-precharge, different-bank tRRD_S/L and the four-activate window,
column-to-column tCCD_S/L, read-to-write and write-to-read S/L turnarounds, data-bus overlap
(a burst in two halves, LPDDR5 BL32 in BG mode, occupies only its two half slots, so another
group's burst may sit in its gap and nothing else may),
tPPD, CAS (WCK2CK sync) before RD/WR once the sync lapsed, all-bank refresh (all banks closed,
tRPab, tRFCab), per-bank refresh (tRFCpb, tPBR2PBR, tPBR2ACT) and the refresh rate.

check(log, derived, ...) returns a list of violations (empty when the stream is legal).
"""

from __future__ import annotations

from odma_hw.emu.state import (C_ACT, C_ACT1, C_ACT2, C_CAS, C_PRE, C_PREAB, C_RD, C_REFAB,
                               C_REFPB, C_WR, COMMAND_NAMES)
from odma_hw.emu.specs import Derived

_NEG = -(1 << 60)


class _Bank:
    def __init__(self):
        self.row = None          # open row or None
        self.act = _NEG          # last ACT(-1) time
        self.pre_ready = _NEG    # earliest PRE allowed by tRAS/tRTP/tWR since the last ACT
        self.closed_at = _NEG    # time the bank last closed (PRE, PREab, auto-precharge)
        self.closed_rp = 0       # tRP that applies after closed_at
        self.ref_until = _NEG    # refresh busy until
        self.act2_due = None     # (ACT-1 time, row) waiting for its ACT-2


def check(log, d: Derived, *, refresh: str = "allbank", wck_always_on: bool = False,
          expected_bursts: int | None = None, max_errors: int = 20) -> list[str]:
    """Verify a command log (rows: time, command, bank, row, aux) against the timings `d`.

    Why it is one function of over 80 lines (tests/test_sizes.py exempts it by name): it is the
    JEDEC checker, one replay loop whose rules read and update the same running state (banks,
    buses, windows, refresh), and it must stay readable beside the standard, a rule per branch
    in one place, and independent of the engine's helpers: split into functions, each rule
    would take that whole state in and out."""
    errors: list[str] = []
    rows = sorted((tuple(int(x) for x in r) for r in log), key=lambda r: (r[0], r[1] == C_RD or r[1] == C_WR))

    def bad(t, cmd, bank, what):
        if len(errors) < max_errors:
            errors.append(f"t={t} {COMMAND_NAMES[cmd]} bank {bank}: {what}")

    nb, bpg = d.banks, d.banks_per_group
    banks = [_Bank() for _ in range(nb)]
    acts: list[tuple[int, int]] = []        # (time, bank) of every activate
    last_rd = [_NEG] * (nb // bpg)          # per bank group
    last_wr = [_NEG] * (nb // bpg)
    any_rd = any_wr = _NEG
    last_pre = _NEG
    last_refpb = _NEG
    data: list[tuple[int, int]] = []        # data-bus intervals (two per burst when split)
    split = d.nBURST != d.nBL
    half = d.nBL // 2
    wck_until = -1
    cas_times = set()
    bus_end = {0: _NEG, 1: _NEG}            # command bus(es): next free CK
    refab = refpb = 0
    bursts = 0

    def occupy(t, cmd, bank, length, bus):
        if t < bus_end[bus]:
            bad(t, cmd, bank, f"command bus busy until {bus_end[bus]}")
        bus_end[bus] = max(bus_end[bus], t + length)

    for t, cmd, b, row, aux in rows:
        row_bus = 0
        col_bus = 1 if d.split_row_col else 0
        g = b // bpg if b >= 0 else -1
        if cmd in (C_ACT, C_ACT1):
            occupy(t, cmd, b, d.ca_act, row_bus)
            k = banks[b]
            if k.row is not None:
                bad(t, cmd, b, f"activate while row {k.row} is open")
            if t < k.act + d.nRC:
                bad(t, cmd, b, f"tRC: previous ACT at {k.act}")
            if t < k.closed_at + k.closed_rp:
                bad(t, cmd, b, f"tRP: closed at {k.closed_at}")
            if t < k.ref_until:
                bad(t, cmd, b, f"refresh busy until {k.ref_until}")
            if refresh == "perbank" and t < last_refpb + d.nPBR2ACT:
                bad(t, cmd, b, f"tPBR2ACT: REFpb at {last_refpb}")
            for ta, ba in reversed(acts[-8:]):
                need = d.nRRD_L if ba // bpg == g else d.nRRD_S
                if ba != b and t < ta + need:
                    bad(t, cmd, b, f"tRRD: ACT bank {ba} at {ta}")
            if len(acts) >= 4 and t < acts[-4][0] + d.nFAW:
                bad(t, cmd, b, f"tFAW: four activates since {acts[-4][0]}")
            acts.append((t, b))
            k.row, k.act = row, t
            k.pre_ready = t + d.nRAS
            if cmd == C_ACT1:
                k.act2_due = (t, row)
        elif cmd == C_ACT2:
            occupy(t, cmd, b, d.ca_act, row_bus)
            k = banks[b]
            if k.act2_due is None:
                bad(t, cmd, b, "ACT-2 without ACT-1")
            else:
                t1, r1 = k.act2_due
                if not (t1 < t <= t1 + d.nAAD) or r1 != row:
                    bad(t, cmd, b, f"ACT-2 not within tAAD={d.nAAD} of ACT-1 at {t1}")
                k.act2_due = None
        elif cmd in (C_RD, C_WR):
            occupy(t, cmd, b, d.ca_rdwr, col_bus)
            k = banks[b]
            bursts += 1
            if k.act2_due is not None:
                bad(t, cmd, b, "column command before ACT-2")
            if k.row is None or k.row != row:
                bad(t, cmd, b, f"row {row} is not open (open: {k.row})")
            is_rd = cmd == C_RD
            if t < k.act + (d.nRCD_RD if is_rd else d.nRCD_WR):
                bad(t, cmd, b, f"tRCD: ACT at {k.act}")
            for gg in range(nb // bpg):
                same = gg == g
                if is_rd:
                    if t < last_rd[gg] + (d.nCCD_L if same else d.nCCD_S):
                        bad(t, cmd, b, f"tCCD: RD in group {gg} at {last_rd[gg]}")
                    if t < last_wr[gg] + (d.wr_to_rd_L if same else d.wr_to_rd_S):
                        bad(t, cmd, b, f"write-to-read: WR in group {gg} at {last_wr[gg]}")
                else:
                    if t < last_wr[gg] + (d.nCCD_L if same else d.nCCD_S):
                        bad(t, cmd, b, f"tCCD: WR in group {gg} at {last_wr[gg]}")
            if not is_rd and t < any_rd + d.rd_to_wr:
                bad(t, cmd, b, f"read-to-write: RD at {any_rd}")
            start = t + (d.nCL if is_rd else d.nCWL)
            if split:  # first half, a gap of one half, second half
                mine = [(start, start + half), (start + d.nBURST - half, start + d.nBURST)]
            else:
                mine = [(start, start + d.nBL)]
            for m0, m1 in mine:
                for s0, s1 in data[-8:]:
                    if m0 < s1 and s0 < m1:
                        bad(t, cmd, b, f"data [{m0}, {m1}) overlaps data [{s0}, {s1})")
            if d.cas_sync and not wck_always_on and t > wck_until and (t - 1) not in cas_times:
                bad(t, cmd, b, f"no CAS: WCK sync lapsed at {wck_until}")
            data.extend(mine)
            wck_until = max(wck_until, start + d.nBURST + d.nWCKPST)
            if is_rd:
                last_rd[g] = t
                any_rd = max(any_rd, t)
                k.pre_ready = max(k.pre_ready, t + d.rd_to_pre)
            else:
                last_wr[g] = t
                any_wr = max(any_wr, t)
                k.pre_ready = max(k.pre_ready, t + d.wr_to_pre)
            if aux == 1:  # auto-precharge
                k.row = None
                k.closed_at, k.closed_rp = k.pre_ready, d.nRP
        elif cmd == C_CAS:
            occupy(t, cmd, b, 1, col_bus)
            cas_times.add(t)
        elif cmd == C_PRE:
            occupy(t, cmd, b, d.ca_pre, row_bus)
            k = banks[b]
            if k.row is None:
                bad(t, cmd, b, "precharge of a closed bank")
            if t < k.pre_ready:
                bad(t, cmd, b, f"tRAS/tRTP/tWR: earliest {k.pre_ready}")
            if t < last_pre + d.nPPD:
                bad(t, cmd, b, f"tPPD: PRE at {last_pre}")
            last_pre = t
            k.row = None
            k.closed_at, k.closed_rp = t, d.nRP
        elif cmd == C_PREAB:
            occupy(t, cmd, b, d.ca_pre, row_bus)
            if t < last_pre + d.nPPD:
                bad(t, cmd, b, f"tPPD: PRE at {last_pre}")
            last_pre = t
            for i, k in enumerate(banks):
                if k.row is not None:
                    if t < k.pre_ready:
                        bad(t, cmd, i, f"PREab: tRAS/tRTP/tWR earliest {k.pre_ready}")
                    k.row = None
                    k.closed_at, k.closed_rp = t, d.nRPab
        elif cmd == C_REFAB:
            occupy(t, cmd, b, d.ca_ref, row_bus)
            refab += 1
            for i, k in enumerate(banks):
                if k.row is not None:
                    bad(t, cmd, i, "REFab with the bank open")
                if t < k.closed_at + k.closed_rp or t < k.act + d.nRC or t < k.ref_until:
                    bad(t, cmd, i, "REFab before tRP/tRC/previous refresh")
                k.ref_until = t + d.nRFCab
        elif cmd == C_REFPB:
            occupy(t, cmd, b, d.ca_ref, row_bus)
            refpb += 1
            k = banks[b]
            if k.row is not None:
                bad(t, cmd, b, "REFpb with the bank open")
            if t < k.closed_at + k.closed_rp or t < k.act + d.nRC or t < k.ref_until:
                bad(t, cmd, b, "REFpb before tRP/tRC/previous refresh")
            if t < last_refpb + d.nPBR2PBR:
                bad(t, cmd, b, f"tPBR2PBR: REFpb at {last_refpb}")
            if acts and t < max(ta for ta, _ in acts[-4:]) + d.nPBR2ACT:
                bad(t, cmd, b, "tPBR2ACT: too close to an activate")
            last_refpb = t
            k.ref_until = t + d.nRFCpb
        else:
            bad(t, cmd, b, "unknown command")

    if rows:
        span = rows[-1][0]
        # refresh may lag its due time by at most one interval (plus the drain of one command)
        if refresh == "allbank" and refab < span // d.nREFI - 1:
            errors.append(f"refresh rate: {refab} REFab in {span} CK, tREFI {d.nREFI}")
        if refresh == "perbank" and refpb < span // d.nREFIpb - 1:
            errors.append(f"refresh rate: {refpb} REFpb in {span} CK, tREFIpb {d.nREFIpb}")
        if refresh == "none" and refab + refpb:
            errors.append("refresh commands with refresh off")
    if expected_bursts is not None and bursts != expected_bursts:
        errors.append(f"{bursts} column commands for {expected_bursts} bursts requested")
    return errors
