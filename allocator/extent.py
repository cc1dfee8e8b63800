"""ExtentAllocator: a request's KV in a short list of contiguous extents of a device pool.

    reserve(request, prompt, L, u)  first extent: the block ODMA would give (OdmaPolicy.place)
    grow(request, total)            fits: bookkeeping only; outgrown: append one more extent (no
                                    copy); once the request holds extent_max extents, merge
                                    them instead (migrate into one extent of the whole new
                                    capacity) when a range that large is free
    release(request, realized)      every extent back to TLSF; ODMA's buckets learn the length

ODMA reads each (layer, K/V, head) run of a request in one long burst, but a request that
outgrows its block is copied whole into a larger one; paging never copies, but reads runs of
one page, which a RACM device serves at a fraction of its streaming bandwidth. An extent is
read as one run per (layer, K/V, head) like a block, so a request in a few long extents reads
nearly as fast as one in a single block, and growing it costs no copy. How long is long enough
is the device's knee: the shortest run that reads at a chosen fraction of the sequential
bandwidth. The allocator knows tokens, not devices: the caller passes the knee in tokens
(AllocatorConfig.extent_knee_tokens; the serving simulation derives it from its timing source).

Growth: a new extent holds max(knee, growth) tokens (AllocatorConfig.extent_growth), at least
the tokens the request needs now, in whole grains (token_alignment; elastic's: the knee) and
never past max_tokens. If no
range that large is free, the smallest extent that holds the tokens needed now is tried before
giving up (it may be shorter than the knee), since the alternative is a preemption (a recompute
of the whole context). Growth extents and merge targets go to the large region first, as ODMA's
overflow blocks do.

Merge: appending an extent to a request that holds extent_max already first tries to migrate
it into one extent of the whole new capacity; with no such range free the request keeps its extents and the new one is appended, past the
bound (counted in merge_failures): a merge only buys read speed, never correctness.

Every failed call leaves the allocator as it was, apart from the failure counters
(reserve_failures, oom_events, merge_failures): an OutOfMemory from grow() leaves the request's
extents and bytes untouched (the caller preempts it), a failed merge copy leaves it live in its
extents (MigrationFailed).
"""

from __future__ import annotations

from odma_cli.errors import BadArgument

from allocator.arguments import count
from allocator.buckets import align_up
from allocator.config import check_config
from allocator.contiguous import RegionPool
from allocator.errors import OutOfMemory, require
from allocator.placement import OdmaPolicy
from allocator.pool import LIVE, MIGRATING, BlockPin, PinnedBlock


class ExtentBlock(PinnedBlock):
    """A request's KV in extents: extents[i] = (offset, nbytes, tokens, region) holds the
    request's tokens [start_i, start_i + tokens_i), start_i the sum of the earlier extents'
    tokens, in token order: token t is at byte t x bytes_per_token of the block.

    capacity_tokens = the sum of the extents' tokens; nbytes = capacity_tokens x bytes_per_token
    (each extent's range is block_bytes(tokens_i), rounded up to the alignment; the padding is not
    addressable). Growth replaces `extents` by a longer tuple (never changes it in place, so a
    running read's spans stay valid) and never changes the first extent; a merge gives the
    request a new one-extent block and this one goes stale, as a migrated Block does. `bucket`
    and `predicted` are those of the first extent's placement (what ODMA's buckets learn from).
    """

    __slots__ = ("extents", "bucket", "predicted")

    def __init__(self, owner, request_id, extents: tuple, bucket, prompt_tokens: int,
                 tokens: int, predicted):
        super().__init__(owner, request_id, prompt_tokens, sum(e[2] for e in extents))
        self.extents = extents
        self.bucket = bucket
        self.predicted = predicted
        self.tokens = tokens

    @property
    def nbytes(self) -> int:
        return self.capacity_tokens * self._owner.bytes_per_token

    @property
    def offset(self) -> int:
        """Pool offset of the first extent (where the block's first byte is)."""
        return self.extents[0][0]

    def extent_tokens(self) -> list[int]:
        """Tokens each extent holds, in token order."""
        return [e[2] for e in self.extents]

    def _spans(self, offset, nbytes):
        bpt = self._owner.bytes_per_token
        end = offset + nbytes
        out = []
        start = 0
        for off, _, tokens, _ in self.extents:
            stop = start + tokens * bpt
            lo, hi = max(offset, start), min(end, stop)
            if lo < hi:
                out.append((off + lo - start, hi - lo, lo - offset))
            if stop >= end:
                break
            start = stop
        return out

    def pin(self, nbytes: int, writing: bool = False) -> BlockPin:
        """PinnedBlock.pin for bytes [0, nbytes) of the first extent, the one contiguous range
        a raw transfer can address; BadArgument for a range past it."""
        n = count("nbytes", nbytes)
        first = self.extents[0][2] * self._owner.bytes_per_token
        if n > first:
            raise BadArgument(f"bytes [0, {n}) of request {self.request_id!r} span more than its "
                              f"first extent ({first} B): a raw transfer needs one contiguous "
                              f"range")
        return BlockPin(self, n, bool(writing))

    def _location(self):
        owner = self._owner
        return owner.device, owner._pool.buffer, self.extents[0][0]

    def tensor(self, dtype, shape):
        """Refused: a request's extents are not one range a tensor can view (view each with
        extent_tensor)."""
        raise BadArgument(f"request {self.request_id!r} is held in extents, not one contiguous "
                          f"range: view each with extent_tensor()")

    def extent_tensor(self, k: int, dtype, shape):
        """A torch tensor of `dtype` and `shape` viewing the start of extent k (no copy; torch
        devices only); as Block.tensor, writes through it are not tracked."""
        off, nbytes, _, _ = self.extents[k]
        return self._tensor_at(off, nbytes, dtype, shape)

    def __repr__(self):
        state = ("live", "migrating", "stale")[self._state]
        return (f"ExtentBlock(request={self.request_id!r}, extents="
                f"{[(e[0], e[2]) for e in self.extents]}, capacity_tokens="
                f"{self.capacity_tokens}, bucket={self.bucket!r}, {state})")


class ExtentAllocator(RegionPool):
    """KV allocator holding each request in at most extent_max contiguous extents (more only
    while merges find no room), the first sized by ODMA's placement.

    Invariants (check() verifies them): every extent of a live request is a used range of its
    region, sized block_bytes(its tokens), aligned, and no two extents share a range (so none
    overlap: TLSF's used ranges are disjoint); the used ranges are exactly the live extents and
    one range per running merge; capacity_tokens = the sum of the extents' tokens <= max_tokens;
    prompt <= tokens <= capacity; the regions tile the pool.
    """

    def __init__(self, device, pool_bytes: int, bytes_per_token: int, max_tokens: int,
                 config=None):
        self.config = config = check_config(config)
        super().__init__(device, pool_bytes, bytes_per_token, max_tokens,
                         OdmaPolicy(max_tokens, config), byte_alignment=config.byte_alignment,
                         copy_chunk_bytes=config.copy_chunk_bytes)
        self.name = "extent"
        self.token_alignment = config.token_alignment
        self.max_extents = config.extent_max
        self.growth = config.extent_growth
        self.first = config.extent_first
        self.knee_tokens = min(align_up(config.extent_knee_tokens or config.token_alignment,
                                        config.token_alignment), self.max_tokens)
        self.grain = self.token_alignment     # growth extents are whole grains
        self.appends = 0              # growth extents appended
        self.merge_failures = 0       # merges wanted that found no range: appended instead
        self.extents_sum = 0          # over completed requests: extents of the final block
        self.extents_max = 0

    # -- the protocol ------------------------------------------------------------------------------
    def reserve(self, request_id, prompt_tokens: int, predicted_tokens: float = 0.0,
                uncertainty: float = 0.0) -> ExtentBlock:
        """A new request's first extent: sized and placed as ODMA sizes and places its block, or
        (extent_first="knee") the prompt and one knee of room. Raises DuplicateRequest,
        BadArgument, OutOfMemory, AllocatorClosed (nothing changed)."""
        prompt, p = self._place(prompt_tokens, predicted_tokens, uncertainty)
        if self.first == "knee":
            p = p._replace(bucket="knee", large=False, key=None, capacity=min(
                align_up(prompt + self.knee_tokens, self.token_alignment), self.max_tokens))
        nbytes = self.block_bytes(p.capacity)
        with self._lock:
            off, region = self._take_new(request_id, nbytes, p)
            blk = ExtentBlock(self, request_id, ((off, nbytes, p.capacity, region),), p.bucket,
                              prompt, prompt, p.key)
            self._live[request_id] = blk
        return blk

    def grow(self, request_id, total_tokens: int, copy=None) -> ExtentBlock:
        """Tell the allocator the request now holds `total_tokens` (prompt + generated). Returns
        its block: the same one while it fits or after an extent was appended, a new one after a
        merge. A merge copies the old extents' first `written` bytes in token order, or calls
        copy(old, new) when given (a layout whose place of a token depends on the extents); it
        runs while the old block is still readable and the new one not yet the request's.
        Raises UnknownRequest, BadArgument (below the current length, above max_tokens),
        OutOfMemory (no extent fits: the request keeps its extents and bytes), MigrationFailed
        (the merge copy failed: likewise)."""
        total = count("total_tokens", total_tokens)
        with self._lock:
            blk = self._lookup(request_id)
            self._check_growth(blk, total)
            cap = blk.capacity_tokens
            if total <= cap:
                blk.tokens = total
                return blk
            size = self._extent_tokens(blk, total)
            new = None
            if len(blk.extents) >= self.max_extents:
                new = self._merge_target(blk, cap + size, total)
            if new is None:
                self._append(blk, size, total)
                blk.tokens = total
                return blk
            n = self._begin_migration(blk)
        return self._finish_migration(blk, new, n, copy)

    def _merge_target(self, blk: ExtentBlock, capacity: int, total: int) -> ExtentBlock | None:
        """Lock held: a one-extent block of `capacity` tokens for `blk`'s request to merge into,
        or None (counted in merge_failures) when no range that large is free."""
        nbytes = self.block_bytes(capacity)
        off, region = self._take(nbytes, True)
        if off < 0:
            self.merge_failures += 1
            return None
        return ExtentBlock(self, blk.request_id, ((off, nbytes, capacity, region),), blk.bucket,
                           blk.prompt_tokens, total, blk.predicted)

    def _extent_tokens(self, blk: ExtentBlock, total: int) -> int:
        """Lock held: tokens of the extent that takes `blk` to `total` tokens.

        At least the knee, so that the new run reads near streaming speed. Beyond it, by default
        ("generated") the tokens generated so far: the prompt's KV is known at admission and sits
        in the first extent, what overran is the predicted generation, so its share doubles, as
        ODMA's large blocks double theirs. A request that generates G tokens past its first
        extent then ends in about log2(G / knee) extents with at most half its generated part
        unused, where doubling the whole footprint ("footprint") would reserve up to the prompt
        again (Azure prompts average 1,155 tokens against a few hundred generated), and knee-sized
        extents ("knee") waste least but reach extent_max and merge soonest."""
        need = total - blk.capacity_tokens
        if self.growth == "generated":
            rule = total - blk.prompt_tokens
        elif self.growth == "footprint":
            rule = total
        else:
            rule = 0
        size = align_up(max(self.knee_tokens, rule, need), self.grain)
        return min(size, self.max_tokens - blk.capacity_tokens)

    def _append(self, blk: ExtentBlock, size: int, total: int) -> None:
        """Lock held: append an extent of `size` tokens to `blk`, else the smallest one that
        holds `total`; OutOfMemory (blk unchanged) when neither fits."""
        nbytes = self.block_bytes(size)
        off, region = self._take(nbytes, True)
        if off < 0:
            need = total - blk.capacity_tokens
            size = min(align_up(need, self.grain), self.max_tokens - blk.capacity_tokens)
            nbytes = self.block_bytes(size)
            off, region = self._take(nbytes, True)
            if off < 0:
                self.oom_events += 1
                raise OutOfMemory(f"request {blk.request_id!r} outgrew its "
                                  f"{blk.capacity_tokens}-token extents and no free range of "
                                  f"{nbytes} B is left")
        blk.extents = blk.extents + ((off, nbytes, size, region),)
        blk.capacity_tokens += size
        self.appends += 1

    def _free_storage(self, blk: ExtentBlock) -> None:
        for off, _, _, region in blk.extents:
            region.free(off)

    def _completed(self, blk: ExtentBlock, total: int) -> None:
        n = len(blk.extents)
        with self._lock:
            self.extents_sum += n
            self.extents_max = max(self.extents_max, n)
        super()._completed(blk, total)

    # -- reporting ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            blocks = list(self._live.values())
            live_extents = [len(b.extents) for b in blocks]
            out = {
                **self._pool_stats(blocks),
                "knee_tokens": self.knee_tokens,
                "max_extents": self.max_extents,
                "extent_growth": self.growth,
                "live_extents_mean": (sum(live_extents) / len(blocks) if blocks else None),
                "live_extents_max": max(live_extents, default=0),
                "extents_per_request_mean": (self.extents_sum / self.completed
                                             if self.completed else None),
                "extents_per_request_max": self.extents_max,
                "extent_appends": self.appends,
                "merge_failures": self.merge_failures,
                **self._migration_stats(),
                **self._counters(),
            }
        return self._bucket_stats(out)

    def check(self) -> None:
        """Verify the invariants in the class docstring (and TLSF's); InvariantBroken if not."""
        with self._lock:
            used = self._used_ranges()
            seen: set = set()
            extents = migrating = 0
            for rid, b in self._live.items():
                require(b.request_id == rid and b._state in (LIVE, MIGRATING),
                        f"the live table maps {rid!r} to {b!r}")
                migrating += b._state == MIGRATING
                require(len(b.extents) >= 1, f"request {rid!r} holds no extent")
                require(b.capacity_tokens == sum(e[2] for e in b.extents) <= self.max_tokens,
                        f"request {rid!r}: capacity {b.capacity_tokens} is not the sum of its "
                        f"extents {b.extent_tokens()} (at most {self.max_tokens})")
                require(b.prompt_tokens <= b.tokens <= b.capacity_tokens,
                        f"block of {rid!r}: prompt {b.prompt_tokens} <= tokens {b.tokens} <= "
                        f"capacity {b.capacity_tokens} does not hold")
                for off, nbytes, tokens, region in b.extents:
                    require(tokens > 0 and nbytes == self.block_bytes(tokens),
                            f"an extent of {rid!r} has {nbytes} B for {tokens} tokens")
                    require(used.get(off, (None, None)) == (nbytes, region),
                            f"an extent of {rid!r} at {off} is not a used range of its region")
                    require(off not in seen, f"the range at {off} is held twice")
                    require(off % self.alignment == 0, f"an extent of {rid!r} is misaligned")
                    seen.add(off)
                extents += len(b.extents)
            require(migrating <= self._migrating,
                    f"{migrating} requests migrating, {self._migrating} merges running")
            require(len(used) == extents + self._migrating,
                    f"{len(used)} used ranges for {extents} live extents and "
                    f"{self._migrating} merges")
            self._require_tiling()


ELASTIC_EXTENTS = 16


class ElasticAllocator(ExtentAllocator):
    """The extent allocator for admission by predicted demand instead of reservation: memory is
    committed as tokens come, and a scheduler admits a request only while the predicted
    remaining need of everything running (AllocatorConfig.demand_bound) and the request's own
    predicted footprint fit the free pool; when a growth finds no room, the request with the
    least progress is preempted, not necessarily the one growing. `admission` tells the
    scheduler so.

    Every extent is a whole number of knees (growth appends one knee), at most
    ELASTIC_EXTENTS of them before a merge. The first placement holds the prompt and one knee of
    room, rounded up to whole knees, in either region; where no free range is that long (a pool
    of many extents fragments), it is taken in pieces of whole knees, halving down to one: a
    short piece is read as its own run, still at the knee's efficiency, where paging would read
    pages and ODMA would wait for one long range. Since every range it takes and frees is whole
    knees, the free space is whole knees too (capped requests aside): no hole is too short to
    use, as paging's pages never are."""

    admission = "demand"

    def __init__(self, device, pool_bytes: int, bytes_per_token: int, max_tokens: int,
                 config=None):
        import dataclasses

        # committed a knee at a time, as paging commits a page at a time; 16 extents of at
        # least a knee before a merge, so that growth seldom copies
        config = check_config(config)
        config = dataclasses.replace(config, extent_first="knee", extent_growth="knee",
                                     extent_max=max(config.extent_max, ELASTIC_EXTENTS))
        super().__init__(device, pool_bytes, bytes_per_token, max_tokens, config)
        self.name = "elastic"
        self.grain = self.knee_tokens
        self.split_reserves = 0       # first placements taken in more than one piece

    def reserve(self, request_id, prompt_tokens: int, predicted_tokens: float = 0.0,
                uncertainty: float = 0.0) -> ExtentBlock:
        """A new request's first extents: its prompt and one knee of room in whole knees, whole or
        in pieces of whole knees. Raises DuplicateRequest, BadArgument, OutOfMemory, AllocatorClosed
        (nothing changed)."""
        prompt, p = self._place(prompt_tokens, predicted_tokens, uncertainty)
        total = min(align_up(prompt + self.knee_tokens, self.grain), self.max_tokens)
        with self._lock:
            self._check_new(request_id)
            pieces = self._take_pieces(total)
            if not pieces:
                self.reserve_failures += 1
                raise OutOfMemory(f"no {total}-token room for request {request_id!r}, whole "
                                  f"or in pieces of {self.knee_tokens} tokens or more")
            self.split_reserves += len(pieces) > 1
            blk = ExtentBlock(self, request_id, tuple(pieces), "knee", prompt, prompt, None)
            self._live[request_id] = blk
        return blk

    def _take_pieces(self, total: int) -> list:
        """Lock held: extents holding `total` tokens, the longest free ranges first, each whole
        knees (the last: what is left): [] (nothing taken) when they do not fit."""
        pieces, left, size = [], total, total
        while left > 0:
            size = min(size, left)
            nbytes = self.block_bytes(size)
            for region in self._regions:
                off = region.alloc(nbytes)
                if off >= 0:
                    pieces.append((off, nbytes, size, region))
                    left -= size
                    break
            else:
                if size <= min(self.knee_tokens, left):
                    for off, _, _, region in pieces:
                        region.free(off)
                    return []
                size = max(min(self.knee_tokens, left), align_up(size // 2, self.grain))
        return pieces

    def stats(self) -> dict:
        return dict(super().stats(), split_reserves=self.split_reserves)
