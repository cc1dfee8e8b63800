"""The arrays the DRAM timing engine (timing_loop.py) reads and carries: where each field sits in
them (the index tables T, O, S, V, B, L, Q, K, which Numba reads as constants), the option and
command codes, pack() and options() that build the timing and options arrays, and ChannelStates,
the state each channel carries from one slice to the next."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

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
    "cls",          # row state its first command met (CLS_*), 0 before that
    "next",         # next slot of its list, -1 at the tail
    "free",         # stack of free slot indices
))
# kinds of the next command a list needs; rows of the group table (kind * groups + group)
K = _indices("CommandKind", ("act", "pre", "rd", "wr", "none"))

CLS_HIT, CLS_MISS, CLS_CONFLICT = 1, 2, 3
INF = np.int64(1) << np.int64(60)


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
        s[:, V.faw0:V.faw3 + 1] = -INF
        s[:, V.wck_until] = -1
        s[:, V.ds_last] = -INF
        s[:, V.last_act] = -INF
        s[:, V.last_refpb] = -INF
        refresh = int(opt[O.refresh])
        s[:, V.ref_due] = (tp[T.nREFI] if refresh == REF_ALLBANK else
                           tp[T.nREFIpb] if refresh == REF_PERBANK else INF)
        s[:, V.nfree] = cap
        self.banks = np.zeros((channels, len(B), nb), np.int64)
        self.banks[:, B.open_row] = -1
        self.banks[:, B.group] = np.arange(nb) // int(tp[T.banks_per_group])
        self.lists = np.zeros((channels, len(L), 2 * nb), np.int64)
        self.lists[:, L.head] = -1
        self.lists[:, L.tail] = -1
        self.lists[:, L.kind] = K.none
        self.lists[:, L.age] = INF
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

