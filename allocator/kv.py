"""The one interface every KV allocator here implements, and the block it hands out.

A serving runtime (or `odma-hw replay` / `odma-hw simulate`) talks to any of them the same way:

    blk = alloc.reserve(request_id, prompt_tokens, predicted_tokens, uncertainty)  # admission
    blk = alloc.grow(request_id, total_tokens)      # a decode step outgrew the block?
                                                    # (copy=fn: the caller moves its KV)
    alloc.release(request_id, realized_tokens)      # completion (preempted=True: will rerun)

Failures raise OutOfMemory (admission waits, or the request is preempted), a BadArgument subclass
for a caller's mistake, MigrationFailed for a device that failed mid-copy; every failure leaves
the allocator as it was.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class KVBlock(Protocol):
    request_id: object
    prompt_tokens: int
    tokens: int             # prompt + generated, as told by reserve/grow
    capacity_tokens: int
    written: int            # high-water mark of bytes written: what a migration copies
    bucket: object          # the policy's label ("large", "paged", a bucket index, ...)

    @property
    def nbytes(self) -> int: ...

    @property
    def live(self) -> bool: ...

    def write(self, data, offset: int = 0) -> None: ...

    def read(self, nbytes: int, offset: int = 0) -> bytes: ...

    def mark_written(self, nbytes: int) -> None: ...


@runtime_checkable
class KVAllocator(Protocol):
    name: str
    pool_bytes: int
    bytes_per_token: int
    max_tokens: int

    def reserve(self, request_id, prompt_tokens: int, predicted_tokens: float = 0.0,
                uncertainty: float = 0.0) -> KVBlock: ...

    def grow(self, request_id, total_tokens: int, copy=None) -> KVBlock: ...

    def release(self, request_id, realized_tokens: int | None = None, *,
                preempted: bool = False) -> None: ...

    def block(self, request_id) -> KVBlock: ...

    def blocks(self, request_ids) -> list: ...

    def live_blocks(self) -> list: ...

    def stats(self) -> dict: ...

    def fragmentation(self) -> float: ...

    def check(self) -> None: ...

    def close(self) -> None: ...
