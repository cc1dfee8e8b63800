"""The compiled shim (`odma_hw._native`) and the one way to call it.

`call("odma_host_alloc", ...)` runs a shim function with a fresh message buffer and turns a non-zero
status into the matching odma error, so no caller handles raw statuses.
"""

from __future__ import annotations

from odma_hw.errors import BadArgument, DeviceError, DeviceUnavailable

try:
    from odma_hw._native import ffi, lib
    IMPORT_ERROR: str | None = None
except ImportError as exc:  # not built: every backend that needs it reports this reason
    ffi = lib = None
    IMPORT_ERROR = f"native shim not built ({exc}); reinstall with `pip install -e .`"

# status -> exception class (see native/odma.h)
_ERRORS = {1: BadArgument, 2: DeviceError, 3: DeviceUnavailable, 4: DeviceUnavailable, 5: DeviceError}
STATUS_NAMES = {0: "ok", 1: "invalid argument", 2: "out of memory", 3: "library unavailable",
                4: "no such device", 5: "device error"}


def available() -> bool:
    return lib is not None


def require():
    """Return (ffi, lib) or raise DeviceUnavailable with the reason the shim is missing."""
    if lib is None:
        raise DeviceUnavailable(IMPORT_ERROR)
    return ffi, lib


def call(name: str, *args) -> None:
    """Call shim function `name(*args, msg)`; raise the odma error for a non-zero status."""
    ffi_, lib_ = require()
    msg = ffi_.new("char[]", lib_.ODMA_MSG_LEN)
    status = getattr(lib_, name)(*args, msg)
    if status != 0:
        text = ffi_.string(msg).decode(errors="replace").strip() or STATUS_NAMES.get(status, "?")
        raise _ERRORS.get(status, DeviceError)(f"{text}")


def status_of(name: str, *args) -> tuple[int, str]:
    """Like call() but returns (status, message) instead of raising (for discovery)."""
    ffi_, lib_ = require()
    msg = ffi_.new("char[]", lib_.ODMA_MSG_LEN)
    status = getattr(lib_, name)(*args, msg)
    return status, ffi_.string(msg).decode(errors="replace").strip()
