"""Event-driven, command-level timing engine of one DRAM channel (Numba), and N channels in parallel.

The controller holds a bounded read queue and write queue (FR-FCFS, or strict in-order), each entry
being an *access*: a run of bursts in one row of one bank. Every decision evaluates, per bank, the
one command that bank needs next (column command on a row hit, PRE on a conflict, ACT on a closed
bank) and the earliest CK at which every timing rule allows it. FR-FCFS is then
"min over banks of (max(now, t), not-a-hit, age)": among commands ready at the earliest ready time,
row hits first, then the oldest request. Time jumps straight to that edge; nothing ticks per clock.
Bank- and group-level earliest times are cached per (type, bank) list and refreshed only where a
command changed them, so each decision is a few branch-free (vectorised) passes over the banks.

Rules (all from specs.Derived): per-bank ACT/RD/WR/PRE earliest times; tCCD_S/L and WR->RD
S/L per bank group; tRRD_S/L and the four-activate window; two-part activate (ACT-1, ACT-2 in
consecutive CA slots, within tAAD); one command per CK on the command bus (split row/column buses
for HBM); data-bus slots of a burst sent in two halves (LPDDR5 BL32 in BG mode: halves 4 CK
apart, so the next burst either fills the gap exactly 2 CK later, from another group by tCCD_L,
or follows the whole 6 CK span; contiguous bursts need no rule beyond tCCD_S >= nBL); CAS
(WCK2CK sync) before RD/WR when the sync has lapsed; RD<->WR turnaround; tPPD; all-bank refresh
(PREab + REFab, blocks everything for tRFCab), per-bank refresh (round robin, tRFCpb, tPBR2PBR,
tPBR2ACT) or none; open page, or closed page with auto-precharge when no queued request hits the
row.

Approximations (documented, on purpose): a hit is ranked by the age of its bank's oldest request;
a PRE is not issued while a queued request of the served type still hits the open row (the
"prior hit" FR-FCFS variant); queue slots free when the last column command issues; request
latency counts from entering the queue to the end of its last data burst.

Everything here is Numba over int64 arrays; the hot loop allocates nothing.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numba import njit, prange

from odma_hw.emu.specs import Derived

# --- timing array (pack()) indices; names mirror specs.Derived --------------------------------
T_BL, T_CL, T_CWL, T_RCDRD, T_RCDWR, T_RP, T_RPAB, T_RAS, T_RC = 0, 1, 2, 3, 4, 5, 6, 7, 8
T_CCDS, T_CCDL, T_RRDS, T_RRDL, T_FAW, T_RTW, T_WTRS, T_WTRL = 9, 10, 11, 12, 13, 14, 15, 16
T_RTP, T_WTP, T_PPD, T_AAD, T_RFCAB, T_RFCPB, T_REFI, T_REFIPB = 17, 18, 19, 20, 21, 22, 23, 24
T_PBR2PBR, T_PBR2ACT, T_WCKPST, T_CA_ACT, T_ACT_PARTS, T_CA_RDWR = 25, 26, 27, 28, 29, 30
T_CA_PRE, T_CA_REF, T_CAS_SYNC, T_SPLIT, T_BANKS, T_BPG, T_BURST = 31, 32, 33, 34, 35, 36, 37
N_T = 38

_PACK_ORDER = (
    "nBL", "nCL", "nCWL", "nRCD_RD", "nRCD_WR", "nRP", "nRPab", "nRAS", "nRC",
    "nCCD_S", "nCCD_L", "nRRD_S", "nRRD_L", "nFAW", "rd_to_wr", "wr_to_rd_S", "wr_to_rd_L",
    "rd_to_pre", "wr_to_pre", "nPPD", "nAAD", "nRFCab", "nRFCpb", "nREFI", "nREFIpb",
    "nPBR2PBR", "nPBR2ACT", "nWCKPST", "ca_act", "act_parts", "ca_rdwr",
    "ca_pre", "ca_ref", "cas_sync", "split_row_col", "banks", "banks_per_group", "nBURST",
)

# --- options array indices ---------------------------------------------------------------------
O_REFRESH, O_PAGE, O_SCHED, O_QUEUE, O_WHI, O_WLO, O_WCK_ON = 0, 1, 2, 3, 4, 5, 6
N_O = 7
REF_NONE, REF_ALLBANK, REF_PERBANK = 0, 1, 2
PAGE_OPEN, PAGE_CLOSED = 0, 1
SCHED_FRFCFS, SCHED_FCFS = 0, 1

# --- command codes (command log) ---------------------------------------------------------------
C_ACT, C_ACT1, C_ACT2, C_RD, C_WR, C_PRE, C_PREAB, C_REFAB, C_REFPB, C_CAS = range(10)
COMMAND_NAMES = ("ACT", "ACT-1", "ACT-2", "RD", "WR", "PRE", "PREab", "REFab", "REFpb", "CAS")
LOG_COLS = 5  # time, command, bank, row, aux (RD/WR: 1 = auto-precharge; PRE: 1 = for refresh)

# --- per-channel statistics indices ------------------------------------------------------------
(S_END, S_ACT, S_PRE, S_RD, S_WR, S_CAS, S_PREAB, S_REFAB, S_REFPB, S_AUTOPRE, S_HIT, S_MISS,
 S_CONFLICT, S_READS, S_WRITES, S_CA_BUSY, S_LAT_SUM, S_LAT_N, S_LOGGED) = range(19)
N_S = 19
HIST_BINS = 1 << 14  # read-latency histogram, 1 CK per bin, last bin = overflow

_CLS_HIT, _CLS_MISS, _CLS_CONFLICT = 1, 2, 3
_INF = np.int64(1) << np.int64(60)


def pack(d: Derived) -> np.ndarray:
    """Derived timings -> the int64 array the engine reads."""
    assert 1 <= d.banks <= 256, "the FR-FCFS scan packs a bank index into 8 bits"
    return np.array([int(getattr(d, name)) for name in _PACK_ORDER], dtype=np.int64)


def options(refresh: int, page: int, sched: int, queue: int, write_high: int, write_low: int,
            wck_always_on: bool) -> np.ndarray:
    o = np.zeros(N_O, dtype=np.int64)
    o[O_REFRESH], o[O_PAGE], o[O_SCHED], o[O_QUEUE] = refresh, page, sched, queue
    o[O_WHI], o[O_WLO], o[O_WCK_ON] = write_high, write_low, int(wck_always_on)
    return o


assert len(_PACK_ORDER) == N_T and set(_PACK_ORDER) == {f.name for f in dataclasses.fields(Derived)}


@njit("void(int64[:, :], int64[:], int64, int64, int64, int64, int64)", cache=True)
def _log(log, stats, t, cmd, bank, row, aux):
    k = stats[S_LOGGED]
    if k < log.shape[0]:
        log[k, 0] = t
        log[k, 1] = cmd
        log[k, 2] = bank
        log[k, 3] = row
        log[k, 4] = aux
        stats[S_LOGGED] = k + 1


# kinds of the next command a (type, bank) queue needs; index rows of the group/rank tables
K_ACT, K_PRE, K_RD, K_WR, K_NONE = 0, 1, 2, 3, 4


@njit(cache=True, inline="always")
def _recompute(b, nb, cnt, head, hits, open_row, nx_act, nx_pre, nx_rd, nx_wr, e_seq,
               bk, bt, bseq, gi, g, ng, G, lt):
    """Cache, for both queues of bank b (in group g), the command it needs next, its bank-local
    earliest CK `bt`, where its group-level rule lives in G, and `lt`, the bank- and group-level
    earliest CK together (rank-level rules are added at decision time). Called whenever b
    changes; _regroup() refreshes `lt` when only G changed."""
    for ty in range(2):
        li = ty * nb + b
        if cnt[li] == 0:
            bk[li] = K_NONE
            bt[li] = 0
            bseq[li] = _INF
        else:
            bseq[li] = e_seq[head[li]]
            if open_row[b] >= 0:
                if hits[li] > 0:
                    bk[li] = K_RD + ty
                    bt[li] = nx_rd[b] if ty == 0 else nx_wr[b]
                else:
                    bk[li] = K_PRE
                    bt[li] = nx_pre[b]
            else:
                bk[li] = K_ACT
                bt[li] = nx_act[b]
        gi[li] = bk[li] * ng + g
        lt[li] = max(bt[li], G[gi[li]])


@njit(cache=True, inline="always")
def _regroup(g, bpg, nb, bt, gi, G, lt):
    """G of group g changed: refresh `lt` of both queues of its banks."""
    for b in range(g * bpg, (g + 1) * bpg):
        for li in (b, nb + b):
            lt[li] = max(bt[li], G[gi[li]])


@njit(cache=True)
def run_channel(tp, opt, bank_of, row_of, bursts_of, write_of, stats, hist, log):
    """Simulate one channel serving `bank_of.size` accesses in trace order (closed loop: the next
    access enters as soon as its queue has room). Fills `stats` (N_S), the read-latency `hist`
    and, up to its capacity, the command `log` (rows of LOG_COLS)."""
    n = bank_of.shape[0]
    nb = tp[T_BANKS]
    bpg = tp[T_BPG]
    ng = nb // bpg
    nBL, nCL, nCWL = tp[T_BL], tp[T_CL], tp[T_CWL]
    nBURST = tp[T_BURST]  # first to last data beat of a burst
    split_burst = nBURST != nBL  # two halves of nBL/2 CK, nBL/2 CK apart (specs.derive)
    half = nBL // 2
    qcap = opt[O_QUEUE]
    whi, wlo = opt[O_WHI], opt[O_WLO]
    refresh = opt[O_REFRESH]
    closed_page = opt[O_PAGE] == PAGE_CLOSED
    fcfs = opt[O_SCHED] == SCHED_FCFS
    cas_sync = tp[T_CAS_SYNC] != 0 and opt[O_WCK_ON] == 0
    split = tp[T_SPLIT] != 0
    act_parts, ca_act = tp[T_ACT_PARTS], tp[T_CA_ACT]
    ca_rdwr, ca_pre, ca_ref = tp[T_CA_RDWR], tp[T_CA_PRE], tp[T_CA_REF]
    logging = log.shape[0] > 0
    nbins = hist.shape[0]

    # earliest CK each command may issue: per bank, per bank group (rows of G by kind), per rank
    open_row = np.full(nb, -1, np.int64)
    nx_act = np.zeros(nb, np.int64)
    nx_pre = np.zeros(nb, np.int64)
    nx_rd = np.zeros(nb, np.int64)
    nx_wr = np.zeros(nb, np.int64)
    group_of = np.arange(nb) // bpg
    G = np.zeros(5 * ng, np.int64)  # [kind * ng + group]: ACT tRRD_L; RD tCCD_L, WR->RD_L; WR tCCD_L
    R = np.zeros(5, np.int64)        # rank-level earliest per kind, rebuilt every decision
    R[K_NONE] = _INF
    faw = np.full(4, -_INF, np.int64)  # times of the last four activates (ring, oldest first)
    faw_i = 0
    nx_act_r = np.int64(0)
    nx_rd_r = np.int64(0)
    nx_wr_r = np.int64(0)
    nx_pre_r = np.int64(0)
    ca_row = np.int64(0)  # next free CK of the (row) command bus
    ca_col = np.int64(0)  # next free CK of the column command bus (== ca_row unless split)
    wck_until = np.int64(-1)  # WCK2CK sync alive up to this CK
    ds_last = -_INF  # data start of the last burst (split bursts only)
    ds_gap = False   # whether that burst's gap is still free for another group's burst
    last_act = -_INF
    last_refpb = -_INF
    ref_due = tp[T_REFI] if refresh == REF_ALLBANK else (
        tp[T_REFIPB] if refresh == REF_PERBANK else _INF)
    ref_bank = 0

    # request queues: slots, per-(type, bank) FIFO lists in age order
    cap = 2 * qcap
    e_bank = np.zeros(cap, np.int64)
    e_row = np.zeros(cap, np.int64)
    e_left = np.zeros(cap, np.int64)
    e_seq = np.zeros(cap, np.int64)
    e_arr = np.zeros(cap, np.int64)
    e_cls = np.zeros(cap, np.int64)
    e_next = np.full(cap, -1, np.int64)
    free = np.arange(cap).astype(np.int64)
    nfree = cap
    head = np.full(2 * nb, -1, np.int64)
    tail = np.full(2 * nb, -1, np.int64)
    cnt = np.zeros(2 * nb, np.int64)
    hits = np.zeros(2 * nb, np.int64)  # entries of the list whose row is open
    bk = np.full(2 * nb, K_NONE, np.int64)  # cached next-command kind per list
    bt = np.zeros(2 * nb, np.int64)         # cached bank-local earliest CK per list
    bseq = np.full(2 * nb, _INF, np.int64)  # age (trace index) of each list's oldest entry
    gi = np.full(2 * nb, K_NONE * ng, np.int64)  # cached index into G per list
    lt = np.zeros(2 * nb, np.int64)  # max(bt, G[gi]): earliest CK by bank and group rules
    qn = np.zeros(2, np.int64)
    keys = np.zeros(nb, np.int64)  # scratch: FR-FCFS key of each list of the served queue

    now = np.int64(0)
    nxt = 0
    wmode = 0
    end = np.int64(0)
    while True:
        # ---- admit accesses in trace order while their queue has room
        while nxt < n:
            ty = np.int64(write_of[nxt])
            if qn[ty] >= qcap:
                break
            nfree -= 1
            s = free[nfree]
            b = np.int64(bank_of[nxt])
            r = np.int64(row_of[nxt])
            e_bank[s] = b
            e_row[s] = r
            e_left[s] = bursts_of[nxt]
            e_seq[s] = nxt
            e_arr[s] = now
            e_cls[s] = 0
            e_next[s] = -1
            li = ty * nb + b
            if tail[li] < 0:
                head[li] = s
            else:
                e_next[tail[li]] = s
            tail[li] = s
            cnt[li] += 1
            qn[ty] += 1
            if open_row[b] == r:
                hits[li] += 1
            _recompute(b, nb, cnt, head, hits, open_row, nx_act, nx_pre, nx_rd, nx_wr, e_seq,
                       bk, bt, bseq, gi, group_of[b], ng, G, lt)
            nxt += 1
        if qn[0] + qn[1] == 0:
            break

        # ---- which queue to serve (write draining between watermarks)
        if wmode == 1:
            if qn[1] == 0 or (qn[1] <= wlo and qn[0] > 0):
                wmode = 0
        elif qn[1] >= whi or qn[0] == 0:
            wmode = 1

        # rank-level earliest per kind, `now` included. CAS: every column command at or after
        # ca_col needs one CK more for its CAS exactly when the sync has lapsed by ca_col
        # (wck_until < ca_col): then t >= ca_col + 1; otherwise t = ca_col is inside the sync
        # window and any later t that is outside it is already >= ca_col + 1.
        R[K_ACT] = max(nx_act_r, faw[faw_i] + tp[T_FAW], ca_row, now)
        if refresh == REF_PERBANK:
            R[K_ACT] = max(R[K_ACT], last_refpb + tp[T_PBR2ACT])
        R[K_PRE] = max(nx_pre_r, ca_row, now)
        col_min = ca_col + 1 if (cas_sync and wck_until < ca_col) else ca_col
        R[K_RD] = max(nx_rd_r, col_min, now)
        R[K_WR] = max(nx_wr_r, col_min, now)

        # ---- pick the next command: min over banks of (max(now, t), not-hit, age)
        best_b = -1
        best_key = _INF
        best_k = K_NONE
        if fcfs:
            # strict in order: only the oldest request overall may issue commands
            best_seq = _INF
            oldest = 0
            for li in range(2 * nb):
                if bseq[li] < best_seq:
                    best_seq = bseq[li]
                    oldest = li
            ty = oldest // nb
            b = oldest - ty * nb
            h = head[oldest]
            if open_row[b] == e_row[h]:
                k = K_RD + ty
                t0 = nx_rd[b] if ty == 0 else nx_wr[b]
            elif open_row[b] >= 0:
                k = K_PRE
                t0 = nx_pre[b]
            else:
                k = K_ACT
                t0 = nx_act[b]
            t = max(t0, G[k * ng + group_of[b]], R[k])
            if split_burst and k >= K_RD:
                lat = nCL if ty == 0 else nCWL
                fill = ds_last + half - lat
                t = fill if (ds_gap and t <= fill) else max(t, ds_last + nBURST - lat)
            if refresh == REF_PERBANK and b == ref_bank and t >= ref_due:
                t = _INF
            if t < _INF:
                best_b = b
                best_k = k
                best_key = 2 * t
        else:
            ty = wmode
            base = ty * nb
            kcol = K_RD + ty
            # data-bus slots of a burst in two halves (split_burst): a column command may fill
            # the gap of the last burst (command time `fill`) or follow its whole span (`after`)
            lat = nCL if ty == 0 else nCWL
            fill = ds_last + half - lat if split_burst else np.int64(-1)
            after = ds_last + nBURST - lat if split_burst else -_INF
            gap_ok = split_burst and ds_gap
            # two branch-free passes over the banks (LLVM vectorises them): each list's key and
            # the smallest key, then the oldest request among the lists with it. The same choice
            # as a lexicographic min of (key, age); ages are unique trace indices.
            r_act, r_pre, r_col = R[K_ACT], R[K_PRE], R[kcol]
            kmin = _INF
            for j in range(nb):
                li = base + j
                k = bk[li]
                r = r_act if k == K_ACT else (r_pre if k == K_PRE else (
                    r_col if k == kcol else _INF))
                t = max(lt[li], r)
                tc = fill if (gap_ok and t <= fill) else max(t, after)
                t = tc if k == kcol else t
                key = 2 * t + (k < K_RD)
                keys[j] = key
                kmin = min(kmin, key)
            for attempt in range(2):
                if kmin >= _INF:
                    break
                # oldest among the lists with the smallest key: min of (age << 8 | j); a list of
                # that key is not empty, so its age is a trace index far below 2**55
                m = _INF
                for j in range(nb):
                    m = min(m, (bseq[base + j] << 8) | j if keys[j] == kmin else _INF)
                jbest = m & 255
                # a bank about to be refreshed issues nothing at or after ref_due
                if refresh == REF_PERBANK and jbest == ref_bank and (kmin >> 1) >= ref_due:
                    keys[jbest] = _INF
                    kmin = _INF
                    for j in range(nb):
                        kmin = min(kmin, keys[j])
                    continue
                best_key = kmin
                best_b = jbest
                best_k = bk[base + jbest]
                break
        best_t = best_key >> 1
        base = ty * nb

        # ---- refresh, when due before the chosen command
        if refresh == REF_ALLBANK and best_t >= ref_due:
            tpre = max(ref_due, ca_row, now)
            any_open = False
            for b in range(nb):
                if open_row[b] >= 0:
                    any_open = True
                    tpre = max(tpre, nx_pre[b])
            tref = tpre
            if any_open:
                tpre = max(tpre, nx_pre_r)
                if logging:
                    _log(log, stats, tpre, C_PREAB, -1, -1, 1)
                stats[S_PREAB] += 1
                stats[S_CA_BUSY] += ca_pre
                ca_row = tpre + ca_pre
                if not split:
                    ca_col = ca_row
                for b in range(nb):
                    if open_row[b] >= 0:
                        open_row[b] = -1
                        nx_act[b] = max(nx_act[b], tpre + tp[T_RPAB])
                for li in range(2 * nb):
                    hits[li] = 0
                tref = ca_row
            for b in range(nb):
                tref = max(tref, nx_act[b])
            tref = max(tref, ca_row)
            if logging:
                _log(log, stats, tref, C_REFAB, -1, -1, 0)
            stats[S_REFAB] += 1
            stats[S_CA_BUSY] += ca_ref
            ca_row = tref + ca_ref
            if not split:
                ca_col = ca_row
            for b in range(nb):
                nx_act[b] = max(nx_act[b], tref + tp[T_RFCAB])
                _recompute(b, nb, cnt, head, hits, open_row, nx_act, nx_pre, nx_rd, nx_wr,
                           e_seq, bk, bt, bseq, gi, group_of[b], ng, G, lt)
            ref_due += tp[T_REFI]
            now = tref
            continue
        if refresh == REF_PERBANK:
            rb = ref_bank
            if open_row[rb] >= 0:
                tr = max(ref_due, R[K_PRE], nx_pre[rb], now)
            else:
                tr = max(ref_due, ca_row, nx_act[rb], last_refpb + tp[T_PBR2PBR],
                         last_act + tp[T_PBR2ACT], now)
            if tr <= best_t:
                if open_row[rb] >= 0:
                    if logging:
                        _log(log, stats, tr, C_PRE, rb, open_row[rb], 1)
                    stats[S_PRE] += 1
                    stats[S_CA_BUSY] += ca_pre
                    open_row[rb] = -1
                    hits[rb] = 0
                    hits[nb + rb] = 0
                    nx_act[rb] = max(nx_act[rb], tr + tp[T_RP])
                    nx_pre_r = tr + tp[T_PPD]
                    ca_row = tr + ca_pre
                else:
                    if logging:
                        _log(log, stats, tr, C_REFPB, rb, -1, 0)
                    stats[S_REFPB] += 1
                    stats[S_CA_BUSY] += ca_ref
                    nx_act[rb] = max(nx_act[rb], tr + tp[T_RFCPB])
                    last_refpb = tr
                    ca_row = tr + ca_ref
                    ref_bank = (rb + 1) % nb
                    ref_due += tp[T_REFIPB]
                if not split:
                    ca_col = ca_row
                _recompute(rb, nb, cnt, head, hits, open_row, nx_act, nx_pre, nx_rd, nx_wr,
                           e_seq, bk, bt, bseq, gi, group_of[rb], ng, G, lt)
                now = tr
                continue

        # ---- issue the chosen command
        b = best_b
        t = best_t
        now = t
        li = base + b
        g = group_of[b]
        if best_k == K_ACT:
            h = head[li]
            r = e_row[h]
            if e_cls[h] == 0:
                e_cls[h] = _CLS_MISS
            if logging:
                if act_parts == 2:
                    _log(log, stats, t, C_ACT1, b, r, 0)
                    _log(log, stats, t + ca_act, C_ACT2, b, r, 0)
                else:
                    _log(log, stats, t, C_ACT, b, r, 0)
            stats[S_ACT] += 1
            stats[S_CA_BUSY] += act_parts * ca_act
            ca_row = t + act_parts * ca_act
            if not split:
                ca_col = ca_row
            open_row[b] = r
            nx_rd[b] = max(nx_rd[b], t + tp[T_RCDRD])
            nx_wr[b] = max(nx_wr[b], t + tp[T_RCDWR])
            nx_pre[b] = max(nx_pre[b], t + tp[T_RAS])
            nx_act[b] = max(nx_act[b], t + tp[T_RC])
            nx_act_r = max(nx_act_r, t + tp[T_RRDS])
            G[K_ACT * ng + g] = max(G[K_ACT * ng + g], t + tp[T_RRDL])
            faw[faw_i] = t
            faw_i = (faw_i + 1) & 3
            last_act = t
            for k in range(2):
                lk = k * nb + b
                c = 0
                e = head[lk]
                while e >= 0:
                    if e_row[e] == r:
                        c += 1
                    e = e_next[e]
                hits[lk] = c
        elif best_k == K_PRE:
            h = head[li]
            if e_cls[h] == 0:
                e_cls[h] = _CLS_CONFLICT
            if logging:
                _log(log, stats, t, C_PRE, b, open_row[b], 0)
            stats[S_PRE] += 1
            stats[S_CA_BUSY] += ca_pre
            ca_row = t + ca_pre
            if not split:
                ca_col = ca_row
            open_row[b] = -1
            hits[b] = 0
            hits[nb + b] = 0
            nx_act[b] = max(nx_act[b], t + tp[T_RP])
            nx_pre_r = t + tp[T_PPD]
        else:
            orow = open_row[b]
            prev = -1
            e = head[li]
            while e_row[e] != orow:
                prev = e
                e = e_next[e]
            if e_cls[e] == 0:
                e_cls[e] = _CLS_HIT
            if cas_sync and t > wck_until:
                if logging:
                    _log(log, stats, t - 1, C_CAS, b, orow, 0)
                stats[S_CAS] += 1
                stats[S_CA_BUSY] += 1
            stats[S_CA_BUSY] += ca_rdwr
            ca_col = t + ca_rdwr
            if not split:
                ca_row = ca_col
            if ty == 0:
                nx_rd_r = max(nx_rd_r, t + tp[T_CCDS])
                G[K_RD * ng + g] = max(G[K_RD * ng + g], t + tp[T_CCDL])
                nx_wr_r = max(nx_wr_r, t + tp[T_RTW])
                nx_pre[b] = max(nx_pre[b], t + tp[T_RTP])
                dend = t + nCL + nBURST
                stats[S_RD] += 1
            else:
                nx_wr_r = max(nx_wr_r, t + tp[T_CCDS])
                G[K_WR * ng + g] = max(G[K_WR * ng + g], t + tp[T_CCDL])
                nx_rd_r = max(nx_rd_r, t + tp[T_WTRS])
                G[K_RD * ng + g] = max(G[K_RD * ng + g], t + tp[T_WTRL])
                nx_pre[b] = max(nx_pre[b], t + tp[T_WTP])
                dend = t + nCWL + nBURST
                stats[S_WR] += 1
            if dend > end:
                end = dend
            if split_burst:
                ds = dend - nBURST
                ds_gap = not (ds_gap and ds == ds_last + half)  # filled the last one's gap?
                ds_last = ds
            if dend + tp[T_WCKPST] > wck_until:
                wck_until = dend + tp[T_WCKPST]
            e_left[e] -= 1
            if e_left[e] == 0:  # access complete: leave the queue
                nx = e_next[e]
                if prev < 0:
                    head[li] = nx
                else:
                    e_next[prev] = nx
                if tail[li] == e:
                    tail[li] = prev
                cnt[li] -= 1
                hits[li] -= 1
                qn[ty] -= 1
                free[nfree] = e
                nfree += 1
                cl = e_cls[e]
                if cl == _CLS_HIT:
                    stats[S_HIT] += 1
                elif cl == _CLS_MISS:
                    stats[S_MISS] += 1
                else:
                    stats[S_CONFLICT] += 1
                if ty == 0:
                    stats[S_READS] += 1
                    lat = dend - e_arr[e]
                    stats[S_LAT_SUM] += lat
                    stats[S_LAT_N] += 1
                    hist[min(lat, nbins - 1)] += 1
                else:
                    stats[S_WRITES] += 1
            auto = 0
            if closed_page and hits[b] + hits[nb + b] == 0:
                # auto-precharge (RDA/WRA): the bank closes as soon as tRAS/tRTP/tWR allow
                auto = 1
                open_row[b] = -1
                nx_act[b] = max(nx_act[b], nx_pre[b] + tp[T_RP])
                stats[S_AUTOPRE] += 1
            if logging:
                _log(log, stats, t, C_RD if ty == 0 else C_WR, b, orow, auto)
        _recompute(b, nb, cnt, head, hits, open_row, nx_act, nx_pre, nx_rd, nx_wr, e_seq,
                   bk, bt, bseq, gi, g, ng, G, lt)
        if best_k != K_PRE:  # ACT, RD and WR moved a group-level rule of group g
            _regroup(g, bpg, nb, bt, gi, G, lt)
    stats[S_END] = end


@njit(cache=True, parallel=True)
def run_channels(tp, opt, offsets, bank_of, row_of, bursts_of, write_of, stats, hist):
    """Channels are independent: simulate each on its own slice of the access arrays."""
    nch = offsets.shape[0] - 1
    for c in prange(nch):
        lo = offsets[c]
        hi = offsets[c + 1]
        log = np.zeros((0, LOG_COLS), np.int64)
        run_channel(tp, opt, bank_of[lo:hi], row_of[lo:hi], bursts_of[lo:hi], write_of[lo:hi],
                    stats[c], hist[c], log)
