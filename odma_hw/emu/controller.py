"""The controller's decisions, one Numba helper each, which the slice kernel (timing_loop.run_slice)
inlines: admitting accesses into the queues (admit), choosing the queue to serve
(choose_queue), the earliest CK of each command (rank_earliest, and recompute and regroup, which
cache the bank- and group-level rules), picking the command (pick_fcfs, pick_frfcfs) and issuing
it (issue_act, issue_pre, issue_column, refresh_allbank, refresh_bank), logging each command.
The module docstring of timing_loop.py gives the rules they implement."""

from __future__ import annotations

import numpy as np
from numba import njit

from odma_hw.emu.state import (B, C_ACT, C_ACT1, C_ACT2, C_CAS, C_PRE, C_PREAB, C_RD, C_REFAB,
                               C_REFPB, C_WR, CLS_CONFLICT, CLS_HIT, CLS_MISS, INF, K, L, Q, S, T,
                               REF_PERBANK)


@njit("void(int64[:, :], int64[:], int64, int64, int64, int64, int64)", cache=True)
def _log(log, stats, t, cmd, bank, row, aux):
    k = stats[S.logged]
    if k < log.shape[0]:
        log[k, 0] = t
        log[k, 1] = cmd
        log[k, 2] = bank
        log[k, 3] = row
        log[k, 4] = aux
        stats[S.logged] = k + 1


@njit(cache=True, inline="always")
def recompute(b, g, nb, ng, banks, lists, slots, G):
    """Cache, for both queues of bank b (in group g), the command it needs next, its bank-local
    earliest CK, where its group-level rule lives in G, and the bank- and group-level earliest CK
    together (rank-level rules are added at decision time). Called whenever b changes;
    regroup() refreshes the last when only G changed."""
    for ty in range(2):
        li = ty * nb + b
        if lists[L.count, li] == 0:
            k = K.none
            lists[L.bank_t, li] = 0
            lists[L.age, li] = INF
        else:
            lists[L.age, li] = slots[Q.seq, lists[L.head, li]]
            if banks[B.open_row, b] >= 0:
                if lists[L.hits, li] > 0:
                    k = K.rd + ty
                    lists[L.bank_t, li] = banks[B.nx_rd, b] if ty == 0 else banks[B.nx_wr, b]
                else:
                    k = K.pre
                    lists[L.bank_t, li] = banks[B.nx_pre, b]
            else:
                k = K.act
                lists[L.bank_t, li] = banks[B.nx_act, b]
        lists[L.kind, li] = k
        gi = k * ng + g
        lists[L.group_idx, li] = gi
        lists[L.t, li] = max(lists[L.bank_t, li], G[gi])


@njit(cache=True, inline="always")
def regroup(g, bpg, nb, lists, G):
    """G of group g changed: refresh the bank- and group-level earliest CK of both queues of its
    banks."""
    for b in range(g * bpg, (g + 1) * bpg):
        for li in (b, nb + b):
            lists[L.t, li] = max(lists[L.bank_t, li], G[lists[L.group_idx, li]])


@njit(cache=True, inline="always")
def admit(n, nxt, nfree, qr, qw, now, qcap, per_burst, bank_of, row_of, bursts_of, write_of, nb,
           ng, banks, lists, slots, G):
    """Admit accesses in trace order from `nxt` while their queue has room (closed loop): an
    entry per access, or per burst (`per_burst`; an access longer than the queue still enters
    an empty one). Returns the new (nxt, nfree, queued reads, queued writes)."""
    while nxt < n:
        ty = np.int64(write_of[nxt])
        q = qw if ty else qr
        entries = np.int64(bursts_of[nxt]) if per_burst else np.int64(1)
        if q > 0 and q + entries > qcap:
            break
        nfree -= 1
        s = slots[Q.free, nfree]
        b = np.int64(bank_of[nxt])
        r = np.int64(row_of[nxt])
        slots[Q.row, s] = r
        slots[Q.left, s] = bursts_of[nxt]
        slots[Q.seq, s] = nxt
        slots[Q.arrival, s] = now
        slots[Q.cls, s] = 0
        slots[Q.next, s] = -1
        li = ty * nb + b
        if lists[L.tail, li] < 0:
            lists[L.head, li] = s
        else:
            slots[Q.next, lists[L.tail, li]] = s
        lists[L.tail, li] = s
        lists[L.count, li] += 1
        if ty:
            qw += entries
        else:
            qr += entries
        if banks[B.open_row, b] == r:
            lists[L.hits, li] += 1
        recompute(b, banks[B.group, b], nb, ng, banks, lists, slots, G)
        nxt += 1
    return nxt, nfree, qr, qw


@njit(cache=True, inline="always")
def choose_queue(write_mode, qr, qw, whi, wlo):
    """Write draining: serve writes from the high watermark (or when no read waits) down to the
    low watermark (while a read waits). Returns 1 to serve writes, 0 reads."""
    if write_mode == 1:
        if qw == 0 or (qw <= wlo and qr > 0):
            return 0
        return 1
    if qw >= whi or qr == 0:
        return 1
    return 0


@njit(cache=True, inline="always")
def rank_earliest(R, tp, refresh, cas_sync, now, nx_act_r, oldest_act, ca_row, ca_col,
                   last_refpb, nx_pre_r, wck_until, nx_rd_r, nx_wr_r):
    """Fill R with the rank-level earliest CK per kind, `now` included. CAS: every column command
    at or after ca_col needs one CK more for its CAS exactly when the sync has lapsed by ca_col
    (wck_until < ca_col): then t >= ca_col + 1; otherwise t = ca_col is inside the sync window
    and any later t that is outside it is already >= ca_col + 1."""
    R[K.act] = max(nx_act_r, oldest_act + tp[T.nFAW], ca_row, now)
    if refresh == REF_PERBANK:
        R[K.act] = max(R[K.act], last_refpb + tp[T.nPBR2ACT])
    R[K.pre] = max(nx_pre_r, ca_row, now)
    col_min = ca_col + 1 if (cas_sync and wck_until < ca_col) else ca_col
    R[K.rd] = max(nx_rd_r, col_min, now)
    R[K.wr] = max(nx_wr_r, col_min, now)


@njit(cache=True, inline="always")
def pick_fcfs(tp, R, nb, ng, banks, lists, slots, G, refresh, split_burst, ds_last, ds_gap,
               ref_bank, ref_due):
    """Strict in order: only the oldest request overall may issue a command. Returns
    (bank, kind, key = 2 * CK, queue type); key INF when it may not issue now."""
    best_seq = INF
    oldest = 0
    for li in range(2 * nb):
        if lists[L.age, li] < best_seq:
            best_seq = lists[L.age, li]
            oldest = li
    ty = oldest // nb
    b = oldest - ty * nb
    h = lists[L.head, oldest]
    if banks[B.open_row, b] == slots[Q.row, h]:
        k = K.rd + ty
        t0 = banks[B.nx_rd, b] if ty == 0 else banks[B.nx_wr, b]
    elif banks[B.open_row, b] >= 0:
        k = K.pre
        t0 = banks[B.nx_pre, b]
    else:
        k = K.act
        t0 = banks[B.nx_act, b]
    t = max(t0, G[k * ng + banks[B.group, b]], R[k])
    if split_burst and k >= K.rd:
        # the data bus after a burst sent in two halves: fill its gap or follow its whole span
        lat = tp[T.nCL] if ty == 0 else tp[T.nCWL]
        fill = ds_last + tp[T.nBL] // 2 - lat
        t = fill if (ds_gap and t <= fill) else max(t, ds_last + tp[T.nBURST] - lat)
    if refresh == REF_PERBANK and b == ref_bank and t >= ref_due:
        t = INF
    if t < INF:
        return b, k, 2 * t, ty
    return -1, K.none, INF, ty


@njit(cache=True, inline="always")
def pick_frfcfs(tp, R, ty, nb, banks, lists, refresh, split_burst, ds_last, ds_gap, ref_bank,
                 ref_due):
    """FR-FCFS over the served queue: min over banks of (max(now, t), not-hit, age). Returns
    (bank, kind, key = 2 * CK + not-hit); key INF when nothing may issue."""
    base = ty * nb
    kcol = K.rd + ty
    # data-bus slots of a burst in two halves (split_burst): a column command may fill the gap
    # of the last burst (command time `fill`) or follow its whole span (`after`)
    lat = tp[T.nCL] if ty == 0 else tp[T.nCWL]
    fill = ds_last + tp[T.nBL] // 2 - lat if split_burst else np.int64(-1)
    after = ds_last + tp[T.nBURST] - lat if split_burst else -INF
    gap_ok = split_burst and ds_gap
    # two branch-free passes over the banks (LLVM vectorises them): each list's key and the
    # smallest key, then the oldest request among the lists with it. The same choice as a
    # lexicographic min of (key, age); ages are unique trace indices.
    r_act, r_pre, r_col = R[K.act], R[K.pre], R[kcol]
    kmin = INF
    for j in range(nb):
        li = base + j
        k = lists[L.kind, li]
        r = r_act if k == K.act else (r_pre if k == K.pre else (r_col if k == kcol else INF))
        t = max(lists[L.t, li], r)
        tc = fill if (gap_ok and t <= fill) else max(t, after)
        t = tc if k == kcol else t
        key = 2 * t + (k < K.rd)
        banks[B.key, j] = key
        kmin = min(kmin, key)
    for attempt in range(2):
        if kmin >= INF:
            break
        # oldest among the lists with the smallest key: min of (age << 8 | j); a list of that
        # key is not empty, so its age is a trace index far below 2**55
        m = INF
        for j in range(nb):
            m = min(m, (lists[L.age, base + j] << 8) | j if banks[B.key, j] == kmin else INF)
        jbest = m & 255
        # a bank about to be refreshed issues nothing at or after ref_due
        if refresh == REF_PERBANK and jbest == ref_bank and (kmin >> 1) >= ref_due:
            banks[B.key, jbest] = INF
            kmin = INF
            for j in range(nb):
                kmin = min(kmin, banks[B.key, j])
            continue
        return jbest, lists[L.kind, base + jbest], kmin
    return -1, K.none, INF


@njit(cache=True, inline="always")
def refresh_allbank(tp, tpre, nx_pre_r, ca_row, split, nb, ng, banks, lists, slots, G, stats,
                     log, logging):
    """PREab (if any bank is open) and REFab, no earlier than `tpre` and as early as the open
    banks and the command bus allow. Returns (REFab CK, next free CK of the row command bus)."""
    ca_pre, ca_ref = tp[T.ca_pre], tp[T.ca_ref]
    any_open = False
    for b in range(nb):
        if banks[B.open_row, b] >= 0:
            any_open = True
            tpre = max(tpre, banks[B.nx_pre, b])
    tref = tpre
    if any_open:
        tpre = max(tpre, nx_pre_r)
        if logging:
            _log(log, stats, tpre, C_PREAB, -1, -1, 1)
        stats[S.preab] += 1
        stats[S.ca_busy] += ca_pre
        ca_row = tpre + ca_pre
        for b in range(nb):
            if banks[B.open_row, b] >= 0:
                banks[B.open_row, b] = -1
                banks[B.nx_act, b] = max(banks[B.nx_act, b], tpre + tp[T.nRPab])
        for li in range(2 * nb):
            lists[L.hits, li] = 0
        tref = ca_row
    for b in range(nb):
        tref = max(tref, banks[B.nx_act, b])
    tref = max(tref, ca_row)
    if logging:
        _log(log, stats, tref, C_REFAB, -1, -1, 0)
    stats[S.refab] += 1
    stats[S.ca_busy] += ca_ref
    for b in range(nb):
        banks[B.nx_act, b] = max(banks[B.nx_act, b], tref + tp[T.nRFCab])
        recompute(b, banks[B.group, b], nb, ng, banks, lists, slots, G)
    return tref, tref + ca_ref


@njit(cache=True, inline="always")
def refresh_bank(tp, tr, rb, nb, ng, banks, lists, slots, G, stats, log, logging):
    """Per-bank refresh of bank rb at `tr`: its PRE when it is open (returns True), else its
    REFpb (returns False)."""
    if banks[B.open_row, rb] >= 0:
        if logging:
            _log(log, stats, tr, C_PRE, rb, banks[B.open_row, rb], 1)
        stats[S.pre] += 1
        stats[S.ca_busy] += tp[T.ca_pre]
        banks[B.open_row, rb] = -1
        lists[L.hits, rb] = 0
        lists[L.hits, nb + rb] = 0
        banks[B.nx_act, rb] = max(banks[B.nx_act, rb], tr + tp[T.nRP])
        precharged = True
    else:
        if logging:
            _log(log, stats, tr, C_REFPB, rb, -1, 0)
        stats[S.refpb] += 1
        stats[S.ca_busy] += tp[T.ca_ref]
        banks[B.nx_act, rb] = max(banks[B.nx_act, rb], tr + tp[T.nRFCpb])
        precharged = False
    recompute(rb, banks[B.group, rb], nb, ng, banks, lists, slots, G)
    return precharged


@njit(cache=True, inline="always")
def issue_act(tp, t, b, g, li, nb, ng, banks, lists, slots, G, stats, log, logging):
    """ACT (ACT-1 + ACT-2 where two-part) of the row of the oldest access of list li."""
    h = lists[L.head, li]
    r = slots[Q.row, h]
    if slots[Q.cls, h] == 0:
        slots[Q.cls, h] = CLS_MISS
    act_parts, ca_act = tp[T.act_parts], tp[T.ca_act]
    if logging:
        if act_parts == 2:
            _log(log, stats, t, C_ACT1, b, r, 0)
            _log(log, stats, t + ca_act, C_ACT2, b, r, 0)
        else:
            _log(log, stats, t, C_ACT, b, r, 0)
    stats[S.act] += 1
    stats[S.ca_busy] += act_parts * ca_act
    banks[B.open_row, b] = r
    banks[B.nx_rd, b] = max(banks[B.nx_rd, b], t + tp[T.nRCD_RD])
    banks[B.nx_wr, b] = max(banks[B.nx_wr, b], t + tp[T.nRCD_WR])
    banks[B.nx_pre, b] = max(banks[B.nx_pre, b], t + tp[T.nRAS])
    banks[B.nx_act, b] = max(banks[B.nx_act, b], t + tp[T.nRC])
    G[K.act * ng + g] = max(G[K.act * ng + g], t + tp[T.nRRD_L])
    # the new row: count the hits of both queues of the bank
    for k in range(2):
        lk = k * nb + b
        c = 0
        e = lists[L.head, lk]
        while e >= 0:
            if slots[Q.row, e] == r:
                c += 1
            e = slots[Q.next, e]
        lists[L.hits, lk] = c


@njit(cache=True, inline="always")
def issue_pre(tp, t, b, li, nb, banks, lists, slots, stats, log, logging):
    """PRE of bank b, whose open row no access of list li (the oldest first) wants."""
    h = lists[L.head, li]
    if slots[Q.cls, h] == 0:
        slots[Q.cls, h] = CLS_CONFLICT
    if logging:
        _log(log, stats, t, C_PRE, b, banks[B.open_row, b], 0)
    stats[S.pre] += 1
    stats[S.ca_busy] += tp[T.ca_pre]
    banks[B.open_row, b] = -1
    lists[L.hits, b] = 0
    lists[L.hits, nb + b] = 0
    banks[B.nx_act, b] = max(banks[B.nx_act, b], t + tp[T.nRP])


@njit(cache=True, inline="always")
def _retire(e, prev, li, ty, dend, lists, slots, stats, hist):
    """The access in slot e (after slot `prev` in list li) sent its last burst, its data ending
    at `dend`: out of its list, into the statistics."""
    nx = slots[Q.next, e]
    if prev < 0:
        lists[L.head, li] = nx
    else:
        slots[Q.next, prev] = nx
    if lists[L.tail, li] == e:
        lists[L.tail, li] = prev
    lists[L.count, li] -= 1
    lists[L.hits, li] -= 1
    cl = slots[Q.cls, e]
    if cl == CLS_HIT:
        stats[S.hit] += 1
    elif cl == CLS_MISS:
        stats[S.miss] += 1
    else:
        stats[S.conflict] += 1
    if ty == 0:
        stats[S.reads] += 1
        lat = dend - slots[Q.arrival, e]
        stats[S.lat_sum] += lat
        stats[S.lat_n] += 1
        hist[min(lat, hist.shape[0] - 1)] += 1
    else:
        stats[S.writes] += 1


@njit(cache=True, inline="always")
def issue_column(tp, t, dend, cas, b, g, li, ty, nb, ng, banks, lists, slots, G, stats, hist,
                  log, logging, closed_page):
    """RD or WR (ty) of one burst of the oldest access of list li that hits the open row of bank
    b, its data ending at `dend`; `cas`: a CAS (WCK2CK sync) goes first. Returns the access's
    queue slot when that was its last burst (the access left the queue), else -1."""
    orow = banks[B.open_row, b]
    prev = -1
    e = lists[L.head, li]
    while slots[Q.row, e] != orow:
        prev = e
        e = slots[Q.next, e]
    if slots[Q.cls, e] == 0:
        slots[Q.cls, e] = CLS_HIT
    if cas:
        if logging:
            _log(log, stats, t - 1, C_CAS, b, orow, 0)
        stats[S.cas] += 1
        stats[S.ca_busy] += 1
    stats[S.ca_busy] += tp[T.ca_rdwr]
    if ty == 0:
        G[K.rd * ng + g] = max(G[K.rd * ng + g], t + tp[T.nCCD_L])
        banks[B.nx_pre, b] = max(banks[B.nx_pre, b], t + tp[T.rd_to_pre])
        stats[S.rd] += 1
    else:
        G[K.wr * ng + g] = max(G[K.wr * ng + g], t + tp[T.nCCD_L])
        G[K.rd * ng + g] = max(G[K.rd * ng + g], t + tp[T.wr_to_rd_L])
        banks[B.nx_pre, b] = max(banks[B.nx_pre, b], t + tp[T.wr_to_pre])
        stats[S.wr] += 1
    if dend > stats[S.end]:
        stats[S.end] = dend
    slots[Q.left, e] -= 1
    freed = -1
    if slots[Q.left, e] == 0:
        _retire(e, prev, li, ty, dend, lists, slots, stats, hist)
        freed = e
    auto = 0
    if closed_page and lists[L.hits, b] + lists[L.hits, nb + b] == 0:
        # auto-precharge (RDA/WRA): the bank closes as soon as tRAS/tRTP/tWR allow
        auto = 1
        banks[B.open_row, b] = -1
        banks[B.nx_act, b] = max(banks[B.nx_act, b], banks[B.nx_pre, b] + tp[T.nRP])
        stats[S.auto_pre] += 1
    if logging:
        _log(log, stats, t, C_RD if ty == 0 else C_WR, b, orow, auto)
    return freed

