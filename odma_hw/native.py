"""The compiled shim (`odma_hw._native`) and the one way to call it.

`call("odma_host_alloc", ...)` runs a shim function with a fresh message buffer and turns a non-zero
status into the matching odma error, so no caller handles raw statuses. Status codes, pattern codes
and limits are read from the shim (the integer #defines of native/odma.h, which cffi exposes on
`lib`), never copied here.
"""

from __future__ import annotations

from odma_cli.errors import BadArgument, DeviceError, DeviceUnavailable, OdmaError

try:
    from odma_hw._native import ffi, lib
    IMPORT_ERROR: str | None = None
except ImportError as exc:  # not built: every backend that needs it reports this reason
    ffi = lib = None
    IMPORT_ERROR = f"native shim not built ({exc}); reinstall with `pip install -e .`"

if lib is not None:
    # status -> (exception class, what it means when the shim gave no message)
    _STATUS = {
        lib.ODMA_EINVAL: (BadArgument, "invalid argument"),
        lib.ODMA_ENOMEM: (DeviceError, "out of memory"),
        lib.ODMA_ENOLIB: (DeviceUnavailable, "library unavailable"),
        lib.ODMA_ENODEV: (DeviceUnavailable, "no such device"),
        lib.ODMA_EDEVICE: (DeviceError, "device error"),
    }
    _ERRORS = {status: error for status, (error, _) in _STATUS.items()}
    # Measurement.pattern -> ODMA_PAT_*
    PATTERN_CODES = {"read": lib.ODMA_PAT_READ, "copy": lib.ODMA_PAT_COPY, "rand": lib.ODMA_PAT_RAND}
else:
    _STATUS, _ERRORS, PATTERN_CODES = {}, {}, {}


def available() -> bool:
    return lib is not None


def require():
    """Return (ffi, lib) or raise DeviceUnavailable with the reason the shim is missing."""
    if lib is None:
        raise DeviceUnavailable(IMPORT_ERROR)
    return ffi, lib


def status_name(status: int) -> str:
    """What a shim status means, in words ("unknown status N" for one the shim never returns)."""
    if lib is not None and status == lib.ODMA_OK:
        return "ok"
    return _STATUS[status][1] if status in _STATUS else f"unknown status {status}"


def error_for(status: int) -> type[OdmaError]:
    """The odma exception class for a non-zero shim status (DeviceError for an unknown one)."""
    return _ERRORS.get(status, DeviceError)


def call(name: str, *args) -> None:
    """Call shim function `name(*args, msg)`; raise the odma error for a non-zero status."""
    ffi_, lib_ = require()
    msg = ffi_.new("char[]", lib_.ODMA_MSG_LEN)
    status = getattr(lib_, name)(*args, msg)
    if status != lib_.ODMA_OK:
        text = ffi_.string(msg).decode(errors="replace").strip() or status_name(status)
        raise error_for(status)(text)


def status_of(name: str, *args) -> tuple[int, str]:
    """Like call() but returns (status, message) instead of raising (for discovery)."""
    ffi_, lib_ = require()
    msg = ffi_.new("char[]", lib_.ODMA_MSG_LEN)
    status = getattr(lib_, name)(*args, msg)
    return status, ffi_.string(msg).decode(errors="replace").strip()
