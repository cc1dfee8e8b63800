"""TLSF free-space manager over a byte range of a device pool (Masmano et al., ECRTS 2004).

The idea in one page
--------------------
Free ranges are kept in segregated free lists, one per size class. A size `n` (in alignment units)
maps to a class (fl, sl): the first level `fl` is the power of two below n, the second level `sl`
splits that power-of-two range into 32 equal sub-classes, so a class's sizes differ by < 1/32
(3.1 %). One bitmap says which first levels have any non-empty sub-class, one bitmap per first
level says which sub-classes are non-empty; "first non-empty class at or above (fl, sl)" is then two
bit tricks (`x & -x`, `int.bit_length`), independent of how many ranges are free.

    alloc:  look at the request's own class (one candidate, taken if it is big enough), else take
            any range from the first non-empty class strictly above it (every range there is
            larger than the request); split off the tail and file it as a new free range.
    free:   merge with the free neighbour on each side (found by dicts keyed by start and end
            offset), file the merged range.

Both are O(1) in the number of ranges. Only when neither finds a range (the pool is nearly full)
does alloc scan the request's own class, so that a request is refused only when no free range
can hold it.

Headers live outside the managed memory (dicts keyed by offset), as rmind/tlsf does, so the
range can be device memory the host never touches.
"""

from __future__ import annotations

from allocator.errors import require

SL_BITS = 5
SL_COUNT = 1 << SL_BITS
FL_COUNT = 64


def size_class(units: int) -> tuple[int, int]:
    """(fl, sl) of a size in alignment units. Sizes below 32 units map linearly into fl 0."""
    if units < SL_COUNT:
        return 0, units
    fl = units.bit_length() - SL_BITS
    return fl, (units >> (fl - 1)) - SL_COUNT


class TlsfFreeSpace:
    """Free space of the byte range [base, base + size) in multiples of `alignment` bytes.

    Invariants (check() verifies them):
    - every byte of the range lies in exactly one free range or one used range;
    - no two free ranges touch (frees coalesce immediately);
    - offsets and sizes are multiples of `alignment`;
    - bit (fl, sl) of the bitmaps is set iff free list (fl, sl) is non-empty;
    - free_bytes + used_bytes == size.
    Not thread-safe: the owner serialises calls.
    """

    def __init__(self, base: int, size: int, alignment: int):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if base % alignment or size % alignment or size < 0:
            raise ValueError("base and size must be non-negative multiples of the alignment")
        self.base = base
        self.size = size
        self.alignment = alignment
        self._shift = alignment.bit_length() - 1
        self._free_start: dict[int, int] = {}    # offset -> size of a free range
        self._free_end: dict[int, int] = {}      # end offset -> start of a free range
        self._used: dict[int, int] = {}          # offset -> size of a used range
        # free lists: class -> {offset: size}; a dict gives O(1) removal of any range (coalescing)
        self._lists = [[{} for _ in range(SL_COUNT)] for _ in range(FL_COUNT)]
        self._fl_bitmap = 0
        self._sl_bitmap = [0] * FL_COUNT
        self.free_bytes = size
        self.used_bytes = 0
        if size:
            self._insert(base, size)

    # -- free-list primitives ----------------------------------------------------------------
    def _insert(self, off: int, size: int) -> None:
        fl, sl = size_class(size >> self._shift)
        self._lists[fl][sl][off] = size
        self._sl_bitmap[fl] |= 1 << sl
        self._fl_bitmap |= 1 << fl
        self._free_start[off] = size
        self._free_end[off + size] = off

    def _remove(self, off: int, size: int) -> None:
        fl, sl = size_class(size >> self._shift)
        lst = self._lists[fl][sl]
        del lst[off]
        self._unlink(off, size, fl, sl, lst)

    def _unlink(self, off: int, size: int, fl: int, sl: int, lst: dict) -> None:
        """Bookkeeping after `off` was popped from free list (fl, sl) == lst."""
        if not lst:
            self._sl_bitmap[fl] &= ~(1 << sl)
            if not self._sl_bitmap[fl]:
                self._fl_bitmap &= ~(1 << fl)
        del self._free_start[off]
        del self._free_end[off + size]

    def _first_class_above(self, fl: int, sl: int):
        """The first non-empty class strictly above (fl, sl), or None."""
        m = self._sl_bitmap[fl] & (-1 << (sl + 1))
        if not m:
            m = self._fl_bitmap & (-1 << (fl + 1))
            if not m:
                return None
            fl = (m & -m).bit_length() - 1
            m = self._sl_bitmap[fl]
        return fl, (m & -m).bit_length() - 1

    # -- public API --------------------------------------------------------------------------
    def round_up(self, nbytes: int) -> int:
        mask = self.alignment - 1
        return (nbytes + mask) & ~mask

    def alloc(self, nbytes: int) -> int:
        """Offset of a used range of round_up(nbytes) bytes, or -1 when no free range can hold
        it (and then nothing changed)."""
        mask = self.alignment - 1
        nbytes = (nbytes + mask) & ~mask
        if nbytes <= 0 or nbytes > self.free_bytes:
            return -1
        fl, sl = size_class(nbytes >> self._shift)
        own = self._lists[fl][sl]
        off = -1
        if own:
            cand, size = own.popitem()        # most recently freed range of the own class
            own[cand] = size                   # (back for now; taken below if it fits)
            if size >= nbytes:
                off, cls = cand, (fl, sl)
        if off < 0:
            cls = self._first_class_above(fl, sl)
            if cls is not None:
                lst = self._lists[cls[0]][cls[1]]
                off, size = lst.popitem()
                lst[off] = size
            else:                              # nearly full: any range of the own class that fits
                for cand, size in own.items():
                    if size >= nbytes:
                        off, cls = cand, (fl, sl)
                        break
                if off < 0:
                    return -1
        rest = size - nbytes
        if rest and size_class(rest >> self._shift) == cls:
            # hot path: the tail stays in the same class, so only the key moves (no bitmap work)
            lst = self._lists[cls[0]][cls[1]]
            del lst[off]
            lst[off + nbytes] = rest
            del self._free_start[off]
            self._free_start[off + nbytes] = rest
            self._free_end[off + size] = off + nbytes
        else:
            self._remove(off, size)
            if rest:
                self._insert(off + nbytes, rest)
        self._used[off] = nbytes
        self.free_bytes -= nbytes
        self.used_bytes += nbytes
        return off

    def free(self, off: int) -> int:
        """Return the used range at `off` to the free space; returns its size. KeyError if `off`
        is not the start of a used range (nothing changes)."""
        size = self._used.pop(off)
        self.free_bytes += size
        self.used_bytes -= size
        start, end = off, off + size
        left = self._free_end.get(start)
        right = self._free_start.get(end)
        if left is None and right is not None:
            merged = right + size
            cls = size_class(right >> self._shift)
            if size_class(merged >> self._shift) == cls:
                # hot path: the free range after us grows downwards within its class
                lst = self._lists[cls[0]][cls[1]]
                del lst[end]
                lst[start] = merged
                del self._free_start[end]
                self._free_start[start] = merged
                self._free_end[end + right] = start
                return size
        if left is not None:
            self._remove(left, start - left)
            start = left
        if right is not None:
            self._remove(end, right)
            end += right
        self._insert(start, end - start)
        return size

    def size_of(self, off: int) -> int:
        return self._used[off]

    def largest_free(self) -> int:
        """Size of the largest free range: the top non-empty class holds it."""
        if not self._fl_bitmap:
            return 0
        fl = self._fl_bitmap.bit_length() - 1
        sl = self._sl_bitmap[fl].bit_length() - 1
        return max(self._lists[fl][sl].values())

    def external_fragmentation(self) -> float:
        """1 - largest free range / total free bytes (0 when nothing or one range is free)."""
        if not self.free_bytes:
            return 0.0
        return 1.0 - self.largest_free() / self.free_bytes

    def free_ranges(self) -> list[tuple[int, int]]:
        return sorted(self._free_start.items())

    def used_ranges(self) -> list[tuple[int, int]]:
        return sorted(self._used.items())

    def check(self) -> None:
        """Walk the whole range and verify every invariant in the class docstring
        (InvariantBroken when one does not hold)."""
        ranges = [(o, s, "free") for o, s in self._free_start.items()]
        ranges += [(o, s, "used") for o, s in self._used.items()]
        ranges.sort()
        pos = self.base
        prev_free = False
        for off, size, kind in ranges:
            require(off == pos, f"gap or overlap at {pos}: next range starts at {off}")
            require(size > 0 and off % self.alignment == 0 and size % self.alignment == 0,
                    f"{kind} range ({off}, {size}) is empty or misaligned")
            require(not (prev_free and kind == "free"), f"adjacent free ranges at {off}")
            prev_free = kind == "free"
            pos = off + size
        require(pos == self.base + self.size, f"ranges end at {pos}, not {self.base + self.size}")
        require(sum(self._free_start.values()) == self.free_bytes, "free byte count is off")
        require(sum(self._used.values()) == self.used_bytes, "used byte count is off")
        require(self.free_bytes + self.used_bytes == self.size, "free + used != size")
        require(len(self._free_end) == len(self._free_start), "free-range end index is off")
        listed = 0
        for fl in range(FL_COUNT):
            require(bool(self._fl_bitmap >> fl & 1) == bool(self._sl_bitmap[fl]),
                    f"first-level bit {fl} disagrees with its second-level bitmap")
            for sl in range(SL_COUNT):
                lst = self._lists[fl][sl]
                require(bool(self._sl_bitmap[fl] >> sl & 1) == bool(lst),
                        f"bit ({fl}, {sl}) disagrees with its free list")
                for off, size in lst.items():
                    require(size_class(size >> self._shift) == (fl, sl),
                            f"free range ({off}, {size}) is filed in the wrong class")
                    require(self._free_start.get(off) == size,
                            f"free range ({off}, {size}) is listed but not indexed")
                listed += len(lst)
        require(listed == len(self._free_start), "a free range is indexed but not listed")
