"""Errors the allocator raises on purpose; all are odma_cli.errors.OdmaError subclasses.

Every failed operation leaves the allocator exactly as it was, so a caller can catch the error and
carry on (preempt the request, retry later, fix the argument).
"""

from odma_cli.errors import BadArgument, DeviceError, OdmaError


class OutOfMemory(OdmaError):
    """No free range is large enough for the block asked for. On grow() the request stays valid
    in its old block, so the caller can preempt it."""


class UnknownRequest(BadArgument):
    """The request id is not live in this allocator (never reserved, or already released)."""


class DuplicateRequest(BadArgument):
    """reserve() was called for a request id that is already live."""


class RequestBusy(BadArgument):
    """The request is being migrated by another thread: grow()/release() of it, and writes to its
    old block, are refused until the migration is over."""


class StaleBlock(BadArgument):
    """A Block was used after its request migrated away from it or was released."""


class PoolTooLarge(BadArgument):
    """The pool asked for is larger than the device can hold."""


class AllocatorClosed(BadArgument):
    """The allocator was closed: its pool is gone, so nothing can be reserved or moved."""


class MigrationFailed(DeviceError):
    """The device copy of a migration failed; the request stays in its old block, bytes intact."""


class InvariantBroken(OdmaError):
    """check() found the allocator's bookkeeping inconsistent (a bug, never a caller's mistake)."""


def require(condition: bool, message: str) -> None:
    """Raise InvariantBroken(message) unless `condition` (check() methods: explicit, never
    `assert`, so they hold under `python -O` too)."""
    if not condition:
        raise InvariantBroken(message)


__all__ = ["OutOfMemory", "UnknownRequest", "DuplicateRequest", "RequestBusy", "StaleBlock",
           "PoolTooLarge", "AllocatorClosed", "MigrationFailed", "InvariantBroken",
           "BadArgument", "OdmaError", "require"]
