"""One exception tree for the whole project.

The CLI maps BadArgument and DeviceUnavailable to exit status 2 (bad usage: the user named something
that is not there or not valid), DeviceError (a device failed at run time), RunFailed (some runs failed, the
others' results were printed) and OutputError (results could not be written) to exit status 3.
Every exception carries a one-line message fit to print as is.
"""


def one_line(text, limit: int = 300) -> str:
    """A message (an exception's, a library's) folded onto one line of at most `limit`
    characters, as every message odma-hw prints is: one line per error."""
    return " ".join(str(text).split())[:limit]


class OdmaError(Exception):
    """Base of every error odma-hw raises on purpose."""


class BadArgument(OdmaError, ValueError):
    """An argument is malformed or out of range; nothing was changed."""


class DeviceUnavailable(OdmaError):
    """A device spec names a backend or device that this machine does not have (the reason says why)."""


class DeviceError(OdmaError):
    """A device or its runtime failed while working."""


class RunFailed(OdmaError):
    """Some runs of a command failed at run time; the others finished and their results were
    printed."""


class OutputError(OdmaError):
    """Results could not be written (a full disk, a read-only folder, a failed plot); what was
    finished is kept or already printed."""


def error_line(exc: BaseException) -> str:
    """One line for a failure: the message of odma-hw's own errors, of a fault or a stall
    (RuntimeError) and of memory running out; any other error named by its type (a library's
    TypeError or compiler error says little without it)."""
    if isinstance(exc, (OdmaError, RuntimeError, MemoryError)):
        return one_line(exc)
    return f"{type(exc).__name__}: {one_line(exc)}"
