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

Everything here is Numba over int64 arrays; the hot loop allocates nothing. The arrays' layout
is in state.py, the helpers that make each decision in controller.py; here the slice kernel
(run_slice) and the loop over slices (run).
"""

from __future__ import annotations

import time

import numba
import numpy as np
from numba import njit, prange
from numba.core import cgutils
from numba.extending import intrinsic

from odma_hw.emu.controller import (admit, choose_queue, issue_act, issue_column, issue_pre,
                                    pick_fcfs, pick_frfcfs, rank_earliest, recompute,
                                    refresh_allbank, refresh_bank, regroup)
from odma_hw.emu.state import (B, INF, K, LOG_COLS, O, PAGE_CLOSED, Q, QUEUE_BURSTS, REF_ALLBANK,
                               REF_PERBANK, SCHED_FCFS, T, V, ChannelStates)


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
    reload them) and go back to `v` when the slice ends.

    Why it is one function of over 80 lines (tests/test_sizes.py exempts it by name): it is the
    Numba timing loop, and those locals are what make it fast. Every piece split out of it would
    take a dozen of them in and hand them back as a tuple on each decision, or keep them in `v`,
    which costs the reloads above; the decisions themselves are already helpers
    (controller.py)."""
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
    R[K.none] = INF

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
        nxt, nfree, qr, qw = admit(n, nxt, nfree, qr, qw, now, qcap, per_burst, bank_of, row_of,
                                    bursts_of, write_of, nb, ng, banks, lists, slots, G)
        if qr + qw == 0:
            done = True
            break
        write_mode = choose_queue(write_mode, qr, qw, whi, wlo)
        rank_earliest(R, tp, refresh, cas_sync, now, nx_act_r, v[V.faw0 + faw_i], ca_row,
                       ca_col, last_refpb, nx_pre_r, wck_until, nx_rd_r, nx_wr_r)
        if fcfs:
            best_b, best_k, best_key, ty = pick_fcfs(tp, R, nb, ng, banks, lists, slots, G,
                                                      refresh, split_burst, ds_last, ds_gap,
                                                      ref_bank, ref_due)
        else:
            ty = write_mode
            best_b, best_k, best_key = pick_frfcfs(tp, R, ty, nb, banks, lists, refresh,
                                                    split_burst, ds_last, ds_gap, ref_bank,
                                                    ref_due)
        best_t = best_key >> 1

        # refresh, when due before the chosen command
        if refresh == REF_ALLBANK and best_t >= ref_due:
            now, ca_row = refresh_allbank(tp, max(ref_due, ca_row, now), nx_pre_r, ca_row,
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
                if refresh_bank(tp, tr, rb, nb, ng, banks, lists, slots, G, stats, log,
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
            issue_act(tp, t, b, g, li, nb, ng, banks, lists, slots, G, stats, log, logging)
            ca_row = t + tp[T.act_parts] * tp[T.ca_act]
            if not split:
                ca_col = ca_row
            nx_act_r = max(nx_act_r, t + tp[T.nRRD_S])
            v[V.faw0 + faw_i] = t
            faw_i = (faw_i + 1) & 3
            last_act = t
        elif best_k == K.pre:
            issue_pre(tp, t, b, li, nb, banks, lists, slots, stats, log, logging)
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
            freed = issue_column(tp, t, dend, cas, b, g, li, ty, nb, ng, banks, lists, slots,
                                  G, stats, hist, log, logging, closed_page)
            if freed >= 0:  # the access left the queue: its slot is free again
                slots[Q.free, nfree] = freed
                nfree += 1
            if per_burst or freed >= 0:  # a queue entry is free again
                if ty:
                    qw -= 1
                else:
                    qr -= 1
        recompute(b, g, nb, ng, banks, lists, slots, G)
        if best_k != K.pre:  # ACT, RD and WR moved a group-level rule of group g
            regroup(g, bpg, nb, lists, G)

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
