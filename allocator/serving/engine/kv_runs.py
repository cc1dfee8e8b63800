"""The engine's KV in the allocator's pool, described for each step as run tables.

Every layout keeps its tokens in regions of the pool, each laid out head-major as
[layers, 2 (K, V), kv_heads, cap, head_dim] from an element offset `off`, `cap` the region's
capacity in tokens: a contiguous block (odma, static, s3, oracle) is one region of its
capacity, an extent block one region per extent, a paged block one region per page (cap =
page_tokens). A request's KV for a step is then a list of runs, in token order, each the first
tokens of one region: one run for a block, one per extent, one per page. One attention kernel
family (allocator/serving/engine/run_attention.py) reads every layout through these tables, so a
difference the engine measures between policies is the memory layout, not the code.

KVPool keeps, per request, the numpy arrays of its regions (offsets, caps, first positions),
renewed only when its block changes (a migration, a new extent, a new page), so that a step's
tables are a concatenation of cached arrays, not a Python loop over pages. The tables for the
whole batch are built once per step on the host and moved to the device in one copy each; every
layer's attention reads them, none builds its own index.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch


@dataclasses.dataclass
class StepTables:
    """The host side of one step: run tables for the requests that read KV (`readers`, in
    order), and a slot for every new token of the step (packed order)."""

    run_start: np.ndarray    # int32 [B + 1]: request b's runs are rows run_start[b]..[b + 1] - 1
    run_off: np.ndarray      # int64 [R]: each run's region offset (elements)
    run_cap: np.ndarray      # int32 [R]: each run's region capacity (tokens)
    run_len: np.ndarray      # int32 [R]: tokens of the run read this step
    run_pos: np.ndarray      # int32 [R]: position of the run's first token in its request
    ctx_len: np.ndarray      # int32 [B]: each reader's context, its new tokens included
    slot: np.ndarray         # int64 [N]: each new token's element offset (layer 0, K, head 0)
    slot_cap: np.ndarray     # int64 [N]: the capacity of the region that slot lies in


class KVPool:
    """The pool as one flat tensor of the KV dtype, and each request's regions in it."""

    def __init__(self, alloc, config, dtype, head_dim: int):
        self.alloc = alloc
        self.dtype = dtype
        self.layers = config.num_hidden_layers
        self.kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        self.element = torch.empty((), dtype=dtype).element_size()
        raw = alloc.pool_tensor()
        usable = raw.numel() // self.element * self.element
        self.flat = raw[:usable].view(dtype)
        self.device = self.flat.device
        # every region starts at a multiple of the allocator's alignment: the kernels may load
        # vectors (in elements)
        self.align = max(1, alloc.alignment // self.element)
        self.page_tokens = getattr(alloc, "page_tokens", None)
        if self.page_tokens is not None:
            if alloc.page_bytes % self.element:
                raise ValueError("page size is not a whole number of KV elements")
            self.page_elements = alloc.page_bytes // self.element
        self._regions: dict = {}     # request -> (key, (offsets, caps, first positions))

    # ------------------------------------------------------------------ regions
    def _elements(self, byte_offset: int) -> int:
        if byte_offset % self.element:
            raise ValueError(f"a KV region at byte {byte_offset} is not element-aligned")
        return byte_offset // self.element

    def regions(self, i, blk=None):
        """(offsets int64, caps int32, first positions int64) of request i's regions (of its live
        block, or of `blk`), in token order. Cached until the block changes: the allocator's
        block is looked up every time, so a released or migrated-away block is never read."""
        if blk is None:
            return self._regions_of(i, self.alloc.block(i), True)
        return self._regions_of(i, blk, False)

    def _regions_of(self, i, blk, live: bool):
        """regions() of request i in `blk`, its live block when `live` (then cached)."""
        key = (blk, blk.capacity_tokens, getattr(blk, "extents", None))
        got = self._regions.get(i)
        if got is not None and got[0][0] is blk and got[0][1:] == key[1:]:
            return got[1]
        if self.page_tokens is not None:
            pages = np.asarray(blk.pages, dtype=np.int64)
            offs = pages * self.page_elements
            caps = np.full(len(pages), self.page_tokens, dtype=np.int32)
        elif getattr(blk, "extents", None) is not None:
            offs = np.array([self._elements(e[0]) for e in blk.extents], dtype=np.int64)
            caps = np.array([e[2] for e in blk.extents], dtype=np.int32)
        else:
            offs = np.array([self._elements(blk.offset)], dtype=np.int64)
            caps = np.array([blk.capacity_tokens], dtype=np.int32)
        firsts = np.cumsum(caps, dtype=np.int64) - caps
        value = (offs, caps, firsts)
        if live:                     # (a migration's blocks are not cached: used once)
            self._regions[i] = (key, value)
        return value

    def views(self, i, blk=None):
        """[(first token, tokens, view (layers, 2, kv_heads, cap, head_dim))] of request i's
        regions: what a migration or a swap copies, region by region."""
        offs, caps, firsts = self.regions(i, blk)
        shape = (self.layers, 2, self.kv_heads)
        per_token = self.layers * 2 * self.kv_heads * self.head_dim
        return [(int(f), int(c), self.flat[int(o):int(o) + int(c) * per_token].view(
                    *shape, int(c), self.head_dim))
                for o, c, f in zip(offs, caps, firsts)]

    # ------------------------------------------------------------------ a step's tables
    def _stacked(self, requests):
        """Every region of `requests` in one set of arrays, request after request: (offsets,
        caps, first positions, the request's index in `requests` of each region, each
        request's region count)."""
        parts = [self._regions_of(i, blk, True)
                 for i, blk in zip(requests, self.alloc.blocks(requests))]
        counts = np.fromiter((len(o) for o, _, _ in parts), dtype=np.int64, count=len(parts))
        if not parts:
            return (np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int64),
                    np.zeros(0, np.int64), counts)
        return (np.concatenate([o for o, _, _ in parts]),
                np.concatenate([c for _, c, _ in parts]),
                np.concatenate([f for _, _, f in parts]),
                np.repeat(np.arange(len(parts)), counts), counts)

    def step_tables(self, readers, writers) -> StepTables:
        """Run tables for `readers` [(request, context tokens)] and slots for `writers`
        [(request, first new position, new tokens)] (the step's packed token order). A few
        array operations over the batch's regions stacked, not a loop of them per request: at
        a batch of 128 this is the host's largest cost of a step."""
        ctx = np.fromiter((c for _, c in readers), dtype=np.int64, count=len(readers))
        who = [i for i, _ in readers]
        stacked = self._stacked(who)
        offs, caps, firsts, owner, _ = stacked
        # a reader reads the regions that start before its context's end, each up to it
        keep = firsts < ctx[owner]
        per = np.bincount(owner[keep], minlength=len(readers))
        starts = np.zeros(len(readers) + 1, dtype=np.int32)
        np.cumsum(per, out=starts[1:])
        f = firsts[keep]
        lens = np.minimum(caps[keep], ctx[owner[keep]] - f)
        # a decode-only step writes where it reads: the same regions, stacked once
        same = len(writers) == len(who) and all(w[0] == i for w, i in zip(writers, who))
        slot, slot_cap = self._slots(writers, stacked if same else None)
        return StepTables(
            run_start=starts, run_off=offs[keep], run_cap=caps[keep],
            run_len=lens.astype(np.int32), run_pos=f.astype(np.int32),
            ctx_len=ctx.astype(np.int32), slot=slot, slot_cap=slot_cap)

    def _slots(self, writers, stacked=None):
        """(element offset, region capacity) of every new token of `writers`, in order;
        `stacked`: _stacked of the writers' requests where the caller has it."""
        offs, caps, firsts, owner, counts = stacked or self._stacked([i for i, _, _ in writers])
        n = np.fromiter((k for _, _, k in writers), dtype=np.int64, count=len(writers))
        first = np.fromiter((s for _, s, _ in writers), dtype=np.int64, count=len(writers))
        who = np.repeat(np.arange(len(writers)), n)                 # each new token's writer
        pos = first[who] + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        # each token's region: the last of its writer's regions starting at or before it,
        # found in one search over (writer, first position) pairs, which are sorted
        big = np.int64(1) << 40
        r = np.searchsorted(owner * big + firsts, who * big + pos, side="right") - 1
        end = firsts[r] + caps[r] if len(r) else np.zeros(0, np.int64)
        past = (r < 0) | (pos >= end) | (owner[r] != who) if len(r) else np.zeros(0, bool)
        if past.any():
            j = int(np.argmax(past))
            w = writers[int(who[j])][0]
            room = int(end[j]) if r[j] >= 0 and owner[r[j]] == who[j] else 0
            raise ValueError(f"request {w}: position {int(pos[j])} is past its block's "
                             f"{room} tokens")
        return (offs[r] + (pos - firsts[r]) * self.head_dim).astype(np.int64, copy=False), \
            caps[r].astype(np.int64)

    # ------------------------------------------------------------------ copies
    def save(self, i, tokens: int):
        """A host copy of request i's KV of positions [0, tokens), (layers, 2, kv_heads,
        tokens, head_dim) (a swap-out)."""
        parts = [view[:, :, :, :min(cap, tokens - first)]
                 for first, cap, view in self.views(i) if first < tokens]
        return torch.cat(parts, dim=3).to("cpu", copy=True)

    def load(self, i, saved) -> None:
        """Write a host copy save() made back into request i's (new) block (a swap-in)."""
        saved = saved.to(self.device)
        n = saved.shape[3]
        for first, cap, view in self.views(i):
            if first < n:
                view[:, :, :, :min(cap, n - first)] = saved[:, :, :, first:first + cap]

    def migrate(self, old, new) -> None:
        """The allocator's copy of a migration (or an extent merge): the first `written` tokens
        of every region, each to its place in the new block (not the request's yet)."""
        n = min(old.written // self.alloc.bytes_per_token, old.capacity_tokens)
        dst = self.views(new.request_id, new)
        for first, tokens, src in self.views(old.request_id, old):
            for to, room, view in dst:
                lo, hi = max(first, to), min(first + tokens, to + room, n)
                if lo < hi:
                    view[:, :, :, lo - to:hi - to] = src[:, :, :, lo - first:hi - first]
