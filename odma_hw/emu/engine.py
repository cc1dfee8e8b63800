"""Event-driven, command-level timing engine of DRAM channels (Numba), resumable in slices.

The controller holds a bounded read queue and write queue (FR-FCFS, or strict in-order) of
*accesses*: runs of bursts in one row of one bank. Every decision evaluates, per bank, the
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

Queues: a read and a write queue of `queue` entries each, an entry holding one burst (default,
as gem5 and Ramulator count) or one access (QUEUE_ACCESSES). Write draining: the controller
serves one queue at a time; it turns to writes when the write queue reaches the high watermark
(or no read waits) and back to reads when it falls to the low watermark (or no write waits).

Approximations (documented, on purpose): a hit is ranked by the age of its bank's oldest request;
a PRE is not issued while a queued request of the served type still hits the open row (the
"prior hit" FR-FCFS variant); an entry frees when its burst's column command issues (the
access's last one, for an entry per access), an access enters only when all its entries are free
(or its queue is empty); request latency counts from entering the queue to the end of its last
data burst.

Resumable: the whole state of a channel (queues, bank and bus timing, refresh) lives in arrays
the caller owns (ChannelStates, beside the statistics), so a kernel call runs at most `budget`
decisions and returns; run() loops over such slices from Python, which is where Ctrl-C
(KeyboardInterrupt) is raised. A run cut into slices is bit-identical to one long slice: a slice
stops only at the top of the decision loop, where nothing lives outside the state arrays.

Everything here is Numba over int64 arrays; the hot loop allocates nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numba
import numpy as np
from numba import njit, prange
from numba.core import cgutils
from numba.extending import intrinsic

from odma_hw.emu.specs import Derived


def _indices(kind: str, names: tuple[str, ...]):
    """name -> position, as a namedtuple of ints (`T.nCL` is where nCL sits in the timing array).
    Numba reads such a global as a constant, so `tp[T.nCL]` costs what `tp[2]` does."""
    return collections.namedtuple(kind, names)(*range(len(names)))


# --- timing array (pack()): every rule of specs.Derived, in its field order --------------------
T = _indices("TimingIndex", tuple(f.name for f in dataclasses.fields(Derived)))
N_T = len(T)

# --- options array (options()) -----------------------------------------------------------------
O = _indices("OptionIndex", ("refresh", "page", "sched", "queue", "queue_unit", "write_high",
                             "write_low", "wck_always_on"))
N_O = len(O)
REF_NONE, REF_ALLBANK, REF_PERBANK = 0, 1, 2
PAGE_OPEN, PAGE_CLOSED = 0, 1
SCHED_FRFCFS, SCHED_FCFS = 0, 1
QUEUE_ACCESSES, QUEUE_BURSTS = 0, 1  # what one queue entry holds

# --- command codes (command log) ---------------------------------------------------------------
C_ACT, C_ACT1, C_ACT2, C_RD, C_WR, C_PRE, C_PREAB, C_REFAB, C_REFPB, C_CAS = range(10)
COMMAND_NAMES = ("ACT", "ACT-1", "ACT-2", "RD", "WR", "PRE", "PREab", "REFab", "REFpb", "CAS")
LOG_COLS = 5  # time, command, bank, row, aux (RD/WR: 1 = auto-precharge; PRE: 1 = for refresh)

# --- per-channel statistics --------------------------------------------------------------------
S = _indices("StatIndex", (
    "end",        # CK of the last data beat
    "act", "pre", "rd", "wr", "cas", "auto_pre", "preab", "refab", "refpb",  # commands
    "hit", "miss", "conflict",  # accesses by the row state their first command met
    "reads", "writes",          # accesses completed
    "ca_busy",                  # CK of command bus occupied
    "lat_sum", "lat_n",         # read latency (CK), summed over completed reads
    "logged",                   # rows written to the command log
))
N_S = len(S)
HIST_BINS = 1 << 14  # read-latency histogram, 1 CK per bin, last bin = overflow

# --- the state a channel carries from one slice to the next (ChannelStates) ----------------------
# scalars
V = _indices("ScalarIndex", (
    "now", "next_access", "nfree", "queued_rd", "queued_wr", "write_mode", "done",
    "nx_act_r", "nx_rd_r", "nx_wr_r", "nx_pre_r",  # rank-level earliest ACT, RD, WR, PRE
    "faw0", "faw1", "faw2", "faw3", "faw_i",       # last four activates (ring, oldest at faw_i)
    "ca_row", "ca_col",  # next free CK of the (row) command bus and of the column bus
    "wck_until",         # WCK2CK sync alive up to this CK
    "ds_last", "ds_gap",  # data start of the last split burst; whether its gap is still free
    "last_act", "last_refpb", "ref_due", "ref_bank",
))
# rows of per-bank arrays
B = _indices("BankRow", ("open_row", "nx_act", "nx_pre", "nx_rd", "nx_wr", "group",
                         "key"))  # key: scratch, the FR-FCFS key of each list of the served queue
# rows of per-list arrays: one FIFO list of queued accesses per (type, bank), reads first
L = _indices("ListRow", (
    "head", "tail", "count",
    "hits",       # entries of the list whose row is open
    "kind",       # cached next-command kind (K)
    "bank_t",     # cached bank-local earliest CK
    "age",        # trace index of the oldest entry
    "group_idx",  # cached index into the group table
    "t",          # max(bank_t, group rule): earliest CK by bank and group rules
))
# rows of per-slot arrays: one slot per queued access
Q = _indices("SlotRow", (
    "row", "left",  # row of the access, bursts still to send
    "seq",          # trace index (age)
    "arrival",      # CK it entered the queue
    "cls",          # row state its first command met (_CLS_*), 0 before that
    "next",         # next slot of its list, -1 at the tail
    "free",         # stack of free slot indices
))
# kinds of the next command a list needs; rows of the group table (kind * groups + group)
K = _indices("CommandKind", ("act", "pre", "rd", "wr", "none"))

_CLS_HIT, _CLS_MISS, _CLS_CONFLICT = 1, 2, 3
_INF = np.int64(1) << np.int64(60)


def pack(d: Derived) -> np.ndarray:
    """Derived timings -> the int64 array the engine reads (indices T)."""
    assert 1 <= d.banks <= 256, "the FR-FCFS scan packs a bank index into 8 bits"
    return np.array([int(x) for x in dataclasses.astuple(d)], dtype=np.int64)


def options(refresh: int, page: int, sched: int, queue: int, write_high: int, write_low: int,
            wck_always_on: bool, queue_unit: int = QUEUE_ACCESSES) -> np.ndarray:
    o = np.zeros(N_O, dtype=np.int64)
    o[O.refresh], o[O.page], o[O.sched], o[O.queue] = refresh, page, sched, queue
    o[O.queue_unit] = queue_unit
    o[O.write_high], o[O.write_low], o[O.wck_always_on] = write_high, write_low, int(wck_always_on)
    return o


class ChannelStates:
    """Everything the engines of `channels` channels carry between slices, stacked by channel:
    scalars (V), per-bank rows (B), per-list rows (L), per-slot rows (Q) and the group table.
    Created once per run; run() passes it to every kernel call, which indexes it by name
    (`lists[L.hits, li]`)."""

    def __init__(self, tp: np.ndarray, opt: np.ndarray, channels: int):
        nb = int(tp[T.banks])
        ng = nb // int(tp[T.banks_per_group])
        cap = 2 * int(opt[O.queue])
        self.scalars = np.zeros((channels, len(V)), np.int64)
        s = self.scalars
        s[:, V.faw0:V.faw3 + 1] = -_INF
        s[:, V.wck_until] = -1
        s[:, V.ds_last] = -_INF
        s[:, V.last_act] = -_INF
        s[:, V.last_refpb] = -_INF
        refresh = int(opt[O.refresh])
        s[:, V.ref_due] = (tp[T.nREFI] if refresh == REF_ALLBANK else
                           tp[T.nREFIpb] if refresh == REF_PERBANK else _INF)
        s[:, V.nfree] = cap
        self.banks = np.zeros((channels, len(B), nb), np.int64)
        self.banks[:, B.open_row] = -1
        self.banks[:, B.group] = np.arange(nb) // int(tp[T.banks_per_group])
        self.lists = np.zeros((channels, len(L), 2 * nb), np.int64)
        self.lists[:, L.head] = -1
        self.lists[:, L.tail] = -1
        self.lists[:, L.kind] = K.none
        self.lists[:, L.age] = _INF
        self.lists[:, L.group_idx] = K.none * ng
        self.slots = np.zeros((channels, len(Q), cap), np.int64)
        self.slots[:, Q.next] = -1
        self.slots[:, Q.free] = np.arange(cap)
        # earliest CK per (kind, bank group): ACT tRRD_L; RD tCCD_L, WR->RD_L; WR tCCD_L
        self.groups = np.zeros((channels, len(K) * ng), np.int64)

    def arrays(self, c: int) -> tuple:
        return (self.scalars[c], self.banks[c], self.lists[c], self.slots[c], self.groups[c])

    @property
    def done(self) -> bool:
        return bool(self.scalars[:, V.done].all())

    @property
    def admitted(self) -> int:
        """Accesses that have entered a queue so far, over all channels."""
        return int(self.scalars[:, V.next_access].sum())


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
def _recompute(b, g, nb, ng, banks, lists, slots, G):
    """Cache, for both queues of bank b (in group g), the command it needs next, its bank-local
    earliest CK, where its group-level rule lives in G, and the bank- and group-level earliest CK
    together (rank-level rules are added at decision time). Called whenever b changes;
    _regroup() refreshes the last when only G changed."""
    for ty in range(2):
        li = ty * nb + b
        if lists[L.count, li] == 0:
            k = K.none
            lists[L.bank_t, li] = 0
            lists[L.age, li] = _INF
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
def _regroup(g, bpg, nb, lists, G):
    """G of group g changed: refresh the bank- and group-level earliest CK of both queues of its
    banks."""
    for b in range(g * bpg, (g + 1) * bpg):
        for li in (b, nb + b):
            lists[L.t, li] = max(lists[L.bank_t, li], G[lists[L.group_idx, li]])


@njit(cache=True, inline="always")
def _admit(n, nxt, nfree, qr, qw, now, qcap, per_burst, bank_of, row_of, bursts_of, write_of, nb,
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
        _recompute(b, banks[B.group, b], nb, ng, banks, lists, slots, G)
        nxt += 1
    return nxt, nfree, qr, qw


@njit(cache=True, inline="always")
def _choose_queue(write_mode, qr, qw, whi, wlo):
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
def _rank_earliest(R, tp, refresh, cas_sync, now, nx_act_r, oldest_act, ca_row, ca_col,
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
def _pick_fcfs(tp, R, nb, ng, banks, lists, slots, G, refresh, split_burst, ds_last, ds_gap,
               ref_bank, ref_due):
    """Strict in order: only the oldest request overall may issue a command. Returns
    (bank, kind, key = 2 * CK, queue type); key _INF when it may not issue now."""
    best_seq = _INF
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
        t = _INF
    if t < _INF:
        return b, k, 2 * t, ty
    return -1, K.none, _INF, ty


@njit(cache=True, inline="always")
def _pick_frfcfs(tp, R, ty, nb, banks, lists, refresh, split_burst, ds_last, ds_gap, ref_bank,
                 ref_due):
    """FR-FCFS over the served queue: min over banks of (max(now, t), not-hit, age). Returns
    (bank, kind, key = 2 * CK + not-hit); key _INF when nothing may issue."""
    base = ty * nb
    kcol = K.rd + ty
    # data-bus slots of a burst in two halves (split_burst): a column command may fill the gap
    # of the last burst (command time `fill`) or follow its whole span (`after`)
    lat = tp[T.nCL] if ty == 0 else tp[T.nCWL]
    fill = ds_last + tp[T.nBL] // 2 - lat if split_burst else np.int64(-1)
    after = ds_last + tp[T.nBURST] - lat if split_burst else -_INF
    gap_ok = split_burst and ds_gap
    # two branch-free passes over the banks (LLVM vectorises them): each list's key and the
    # smallest key, then the oldest request among the lists with it. The same choice as a
    # lexicographic min of (key, age); ages are unique trace indices.
    r_act, r_pre, r_col = R[K.act], R[K.pre], R[kcol]
    kmin = _INF
    for j in range(nb):
        li = base + j
        k = lists[L.kind, li]
        r = r_act if k == K.act else (r_pre if k == K.pre else (r_col if k == kcol else _INF))
        t = max(lists[L.t, li], r)
        tc = fill if (gap_ok and t <= fill) else max(t, after)
        t = tc if k == kcol else t
        key = 2 * t + (k < K.rd)
        banks[B.key, j] = key
        kmin = min(kmin, key)
    for attempt in range(2):
        if kmin >= _INF:
            break
        # oldest among the lists with the smallest key: min of (age << 8 | j); a list of that
        # key is not empty, so its age is a trace index far below 2**55
        m = _INF
        for j in range(nb):
            m = min(m, (lists[L.age, base + j] << 8) | j if banks[B.key, j] == kmin else _INF)
        jbest = m & 255
        # a bank about to be refreshed issues nothing at or after ref_due
        if refresh == REF_PERBANK and jbest == ref_bank and (kmin >> 1) >= ref_due:
            banks[B.key, jbest] = _INF
            kmin = _INF
            for j in range(nb):
                kmin = min(kmin, banks[B.key, j])
            continue
        return jbest, lists[L.kind, base + jbest], kmin
    return -1, K.none, _INF


@njit(cache=True, inline="always")
def _refresh_allbank(tp, tpre, nx_pre_r, ca_row, split, nb, ng, banks, lists, slots, G, stats,
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
        _recompute(b, banks[B.group, b], nb, ng, banks, lists, slots, G)
    return tref, tref + ca_ref


@njit(cache=True, inline="always")
def _refresh_bank(tp, tr, rb, nb, ng, banks, lists, slots, G, stats, log, logging):
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
    _recompute(rb, banks[B.group, rb], nb, ng, banks, lists, slots, G)
    return precharged


@njit(cache=True, inline="always")
def _issue_act(tp, t, b, g, li, nb, ng, banks, lists, slots, G, stats, log, logging):
    """ACT (ACT-1 + ACT-2 where two-part) of the row of the oldest access of list li."""
    h = lists[L.head, li]
    r = slots[Q.row, h]
    if slots[Q.cls, h] == 0:
        slots[Q.cls, h] = _CLS_MISS
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
def _issue_pre(tp, t, b, li, nb, banks, lists, slots, stats, log, logging):
    """PRE of bank b, whose open row no access of list li (the oldest first) wants."""
    h = lists[L.head, li]
    if slots[Q.cls, h] == 0:
        slots[Q.cls, h] = _CLS_CONFLICT
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
    if cl == _CLS_HIT:
        stats[S.hit] += 1
    elif cl == _CLS_MISS:
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
def _issue_column(tp, t, dend, cas, b, g, li, ty, nb, ng, banks, lists, slots, G, stats, hist,
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
        slots[Q.cls, e] = _CLS_HIT
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


@intrinsic
def _unmanaged(typingctx, arr):
    """The same array without its reference count (no meminfo). The slice kernel hands its
    arrays to a dozen inlined helpers; Numba reference-counts each such argument and cannot
    prune the counts across the helpers' loops and early exits, which tripled the time of a
    decision. The caller of the kernel owns every array for the whole call, so unmanaged views
    are safe inside it."""
    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, value=args[0])
        ary.meminfo = cgutils.get_null_value(ary.meminfo.type)
        ary.parent = cgutils.get_null_value(ary.parent.type)
        return ary._getvalue()
    return arr(arr), codegen


@njit(cache=True)
def run_slice(tp, opt, bank_of, row_of, bursts_of, write_of, stats, hist, log, v, banks, lists,
              slots, G, budget):
    """Continue one channel serving `bank_of.size` accesses in trace order (closed loop: the next
    access enters as soon as its queue has room) for at most `budget` decisions. Its state is
    (v, banks, lists, slots, G) of ChannelStates. Fills `stats` (S), the read-latency `hist`
    and, up to its capacity, the command `log` (rows of LOG_COLS). Returns whether the channel
    has served every access.

    The helpers update bank, queue and group arrays; the rank-level scalars live in locals here
    for the whole slice (as array elements, every store to another array would force LLVM to
    reload them) and go back to `v` when the slice ends."""
    if v[V.done]:
        return True
    tp, opt, bank_of, row_of = _unmanaged(tp), _unmanaged(opt), _unmanaged(bank_of), \
        _unmanaged(row_of)
    bursts_of, write_of, stats, hist = _unmanaged(bursts_of), _unmanaged(write_of), \
        _unmanaged(stats), _unmanaged(hist)
    log, v, banks, lists = _unmanaged(log), _unmanaged(v), _unmanaged(banks), _unmanaged(lists)
    slots, G = _unmanaged(slots), _unmanaged(G)

    n = bank_of.shape[0]
    nb = tp[T.banks]
    bpg = tp[T.banks_per_group]
    ng = nb // bpg
    nBURST = tp[T.nBURST]  # first to last data beat of a burst
    split_burst = nBURST != tp[T.nBL]  # two halves of nBL/2 CK, nBL/2 CK apart (specs.derive)
    half = tp[T.nBL] // 2
    qcap = opt[O.queue]
    per_burst = opt[O.queue_unit] == QUEUE_BURSTS
    whi, wlo = opt[O.write_high], opt[O.write_low]
    refresh = opt[O.refresh]
    closed_page = opt[O.page] == PAGE_CLOSED
    fcfs = opt[O.sched] == SCHED_FCFS
    cas_sync = tp[T.cas_sync] != 0 and opt[O.wck_always_on] == 0
    split = tp[T.split_row_col] != 0
    logging = log.shape[0] > 0
    R = np.empty(len(K), np.int64)  # rank-level earliest CK per kind, rebuilt every decision
    R[K.none] = _INF

    now, nxt, nfree = v[V.now], v[V.next_access], v[V.nfree]
    qr, qw, write_mode = v[V.queued_rd], v[V.queued_wr], v[V.write_mode]
    nx_act_r, nx_rd_r, nx_wr_r, nx_pre_r = v[V.nx_act_r], v[V.nx_rd_r], v[V.nx_wr_r], v[V.nx_pre_r]
    faw_i = v[V.faw_i]
    ca_row, ca_col, wck_until = v[V.ca_row], v[V.ca_col], v[V.wck_until]
    ds_last, ds_gap = v[V.ds_last], v[V.ds_gap] != 0
    last_act, last_refpb = v[V.last_act], v[V.last_refpb]
    ref_due, ref_bank = v[V.ref_due], v[V.ref_bank]
    done = False

    for _ in range(budget):
        nxt, nfree, qr, qw = _admit(n, nxt, nfree, qr, qw, now, qcap, per_burst, bank_of, row_of,
                                    bursts_of, write_of, nb, ng, banks, lists, slots, G)
        if qr + qw == 0:
            done = True
            break
        write_mode = _choose_queue(write_mode, qr, qw, whi, wlo)
        _rank_earliest(R, tp, refresh, cas_sync, now, nx_act_r, v[V.faw0 + faw_i], ca_row,
                       ca_col, last_refpb, nx_pre_r, wck_until, nx_rd_r, nx_wr_r)
        if fcfs:
            best_b, best_k, best_key, ty = _pick_fcfs(tp, R, nb, ng, banks, lists, slots, G,
                                                      refresh, split_burst, ds_last, ds_gap,
                                                      ref_bank, ref_due)
        else:
            ty = write_mode
            best_b, best_k, best_key = _pick_frfcfs(tp, R, ty, nb, banks, lists, refresh,
                                                    split_burst, ds_last, ds_gap, ref_bank,
                                                    ref_due)
        best_t = best_key >> 1

        # refresh, when due before the chosen command
        if refresh == REF_ALLBANK and best_t >= ref_due:
            now, ca_row = _refresh_allbank(tp, max(ref_due, ca_row, now), nx_pre_r, ca_row,
                                           split, nb, ng, banks, lists, slots, G, stats, log,
                                           logging)
            if not split:
                ca_col = ca_row
            ref_due += tp[T.nREFI]
            continue
        if refresh == REF_PERBANK:
            rb = ref_bank
            if banks[B.open_row, rb] >= 0:
                tr = max(ref_due, R[K.pre], banks[B.nx_pre, rb], now)
            else:
                tr = max(ref_due, ca_row, banks[B.nx_act, rb], last_refpb + tp[T.nPBR2PBR],
                         last_act + tp[T.nPBR2ACT], now)
            if tr <= best_t:
                if _refresh_bank(tp, tr, rb, nb, ng, banks, lists, slots, G, stats, log,
                                 logging):
                    nx_pre_r = tr + tp[T.nPPD]
                    ca_row = tr + tp[T.ca_pre]
                else:
                    last_refpb = tr
                    ca_row = tr + tp[T.ca_ref]
                    ref_bank = (rb + 1) % nb
                    ref_due += tp[T.nREFIpb]
                if not split:
                    ca_col = ca_row
                now = tr
                continue

        # issue the chosen command
        b = best_b
        t = best_t
        now = t
        li = ty * nb + b
        g = banks[B.group, b]
        if best_k == K.act:
            _issue_act(tp, t, b, g, li, nb, ng, banks, lists, slots, G, stats, log, logging)
            ca_row = t + tp[T.act_parts] * tp[T.ca_act]
            if not split:
                ca_col = ca_row
            nx_act_r = max(nx_act_r, t + tp[T.nRRD_S])
            v[V.faw0 + faw_i] = t
            faw_i = (faw_i + 1) & 3
            last_act = t
        elif best_k == K.pre:
            _issue_pre(tp, t, b, li, nb, banks, lists, slots, stats, log, logging)
            ca_row = t + tp[T.ca_pre]
            if not split:
                ca_col = ca_row
            nx_pre_r = t + tp[T.nPPD]
        else:
            cas = cas_sync and t > wck_until
            ca_col = t + tp[T.ca_rdwr]
            if not split:
                ca_row = ca_col
            if ty == 0:
                nx_rd_r = max(nx_rd_r, t + tp[T.nCCD_S])
                nx_wr_r = max(nx_wr_r, t + tp[T.rd_to_wr])
                dend = t + tp[T.nCL] + nBURST
            else:
                nx_wr_r = max(nx_wr_r, t + tp[T.nCCD_S])
                nx_rd_r = max(nx_rd_r, t + tp[T.wr_to_rd_S])
                dend = t + tp[T.nCWL] + nBURST
            if split_burst:
                ds = dend - nBURST
                ds_gap = not (ds_gap and ds == ds_last + half)  # filled the last one's gap?
                ds_last = ds
            if dend + tp[T.nWCKPST] > wck_until:
                wck_until = dend + tp[T.nWCKPST]
            freed = _issue_column(tp, t, dend, cas, b, g, li, ty, nb, ng, banks, lists, slots,
                                  G, stats, hist, log, logging, closed_page)
            if freed >= 0:  # the access left the queue: its slot is free again
                slots[Q.free, nfree] = freed
                nfree += 1
            if per_burst or freed >= 0:  # a queue entry is free again
                if ty:
                    qw -= 1
                else:
                    qr -= 1
        _recompute(b, g, nb, ng, banks, lists, slots, G)
        if best_k != K.pre:  # ACT, RD and WR moved a group-level rule of group g
            _regroup(g, bpg, nb, lists, G)

    v[V.now], v[V.next_access], v[V.nfree] = now, nxt, nfree
    v[V.queued_rd], v[V.queued_wr], v[V.write_mode] = qr, qw, write_mode
    v[V.nx_act_r], v[V.nx_rd_r], v[V.nx_wr_r], v[V.nx_pre_r] = nx_act_r, nx_rd_r, nx_wr_r, nx_pre_r
    v[V.faw_i] = faw_i
    v[V.ca_row], v[V.ca_col], v[V.wck_until] = ca_row, ca_col, wck_until
    v[V.ds_last], v[V.ds_gap] = ds_last, ds_gap
    v[V.last_act], v[V.last_refpb] = last_act, last_refpb
    v[V.ref_due], v[V.ref_bank] = ref_due, ref_bank
    v[V.done] = done
    return done


@njit(cache=True, parallel=True)
def run_slices(tp, opt, offsets, bank_of, row_of, bursts_of, write_of, stats, hist, scalars,
               banks, lists, slots, groups, budget):
    """One slice of every unfinished channel, in parallel (channels are independent; channel c
    serves accesses offsets[c]:offsets[c + 1])."""
    nch = offsets.shape[0] - 1
    for c in prange(nch):
        lo = offsets[c]
        hi = offsets[c + 1]
        log = np.zeros((0, LOG_COLS), np.int64)
        run_slice(tp, opt, bank_of[lo:hi], row_of[lo:hi], bursts_of[lo:hi], write_of[lo:hi],
                  stats[c], hist[c], log, scalars[c], banks[c], lists[c], slots[c], groups[c],
                  budget)


# Wall time one slice aims at: short enough that Ctrl-C is honoured within a fraction of a
# second, long enough that the Python loop around slices costs nothing measurable.
SLICE_SECONDS = 0.1
_FIRST_BUDGET = 1 << 12  # decisions per channel in the first slice (grows to SLICE_SECONDS)
_MAX_BUDGET = 1 << 26


def run(tp, opt, offsets, bank_of, row_of, bursts_of, write_of, stats, hist, log=None, *,
        budget: int | None = None, progress=None) -> ChannelStates:
    """Simulate every channel (channel c serves accesses offsets[c]:offsets[c + 1]) to the end,
    in slices of at most `budget` decisions per channel (default: sized on the fly so that one
    slice takes about SLICE_SECONDS), returning to Python between slices. `log` (channel 0's
    command log) runs the channels one after another; otherwise they run in parallel.
    `progress(admitted, total)` is called after every slice."""
    nch = offsets.shape[0] - 1
    total = int(offsets[-1])
    states = ChannelStates(tp, opt, nch)
    adaptive = budget is None
    budget = _FIRST_BUDGET if adaptive else int(budget)
    if budget < 1:
        raise ValueError(f"slice budget must be positive, not {budget}")
    empty = np.zeros((0, LOG_COLS), np.int64)

    def next_budget(budget, seconds):
        if not adaptive:
            return budget
        scale = min(4.0, max(0.25, SLICE_SECONDS / max(seconds, 1e-6)))
        return int(min(_MAX_BUDGET, max(256, budget * scale)))

    if log is not None or nch == 1:
        for c in range(nch):
            lo, hi = int(offsets[c]), int(offsets[c + 1])
            args = (tp, opt, bank_of[lo:hi], row_of[lo:hi], bursts_of[lo:hi], write_of[lo:hi],
                    stats[c], hist[c], log if (c == 0 and log is not None) else empty,
                    *states.arrays(c))
            while True:
                t0 = time.perf_counter()
                finished = run_slice(*args, budget)
                budget = next_budget(budget, time.perf_counter() - t0)
                if progress is not None:
                    progress(states.admitted, total)
                if finished:
                    break
    else:
        # channels differ in work per slice: threads take them one at a time (chunk size 1)
        # rather than in equal blocks, so no thread idles long before each slice's end
        previous_chunksize = numba.set_parallel_chunksize(1)
        try:
            while not states.done:
                t0 = time.perf_counter()
                run_slices(tp, opt, offsets, bank_of, row_of, bursts_of, write_of, stats, hist,
                           states.scalars, states.banks, states.lists, states.slots,
                           states.groups, budget)
                budget = next_budget(budget, time.perf_counter() - t0)
                if progress is not None:
                    progress(states.admitted, total)
        finally:
            numba.set_parallel_chunksize(previous_chunksize)
    return states
