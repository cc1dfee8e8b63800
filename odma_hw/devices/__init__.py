"""Device specs -> Device objects.

Specs users type: `host`, `cuda:N`, `mlu:N`, `torch:<torch device>` and `emu:<preset>`.
Each backend lives in its own module with two functions:
    discover() -> (specs, reason)   the specs this machine has, and why none when empty
    open_device(arg) -> Device       arg is what follows the colon ('' for host)
Backends are imported lazily so that a missing library only affects its own backend.
"""

from __future__ import annotations

import dataclasses
import importlib

from odma_cli.errors import BadArgument, DeviceUnavailable
from odma_hw.devices.base import Buffer, Device, DeviceInfo, Measurement  # noqa: F401

# spec prefix -> module implementing it
BACKENDS = {
    "host": "odma_hw.devices.host",
    "cuda": "odma_hw.devices.cuda",
    "mlu": "odma_hw.devices.mlu",
    "torch": "odma_hw.devices.torch_device",
    "emu": "odma_hw.devices.emu",
}


@dataclasses.dataclass
class BackendStatus:
    backend: str
    specs: list[str]
    reason: str | None  # why no device was found (None when specs is non-empty)


def _backend(name: str):
    try:
        return importlib.import_module(BACKENDS[name])
    except ImportError as exc:  # a dependency of that backend is missing
        raise DeviceUnavailable(f"{name} backend unavailable: {exc}") from None


def discover() -> list[BackendStatus]:
    """Every backend with the devices it finds here, or the reason it finds none. Never raises."""
    out = []
    for name in BACKENDS:
        try:
            specs, reason = _backend(name).discover()
        except DeviceUnavailable as exc:
            specs, reason = [], str(exc)
        except Exception as exc:  # a backend bug must not hide the other backends
            specs, reason = [], f"{type(exc).__name__}: {exc}"
        out.append(BackendStatus(name, list(specs), None if specs else reason))
    return out


def parse_spec(spec: str) -> tuple[str, str]:
    """'cuda:0' -> ('cuda', '0'); raises BadArgument listing the known backends."""
    if not isinstance(spec, str) or not spec.strip():
        raise BadArgument("empty device spec")
    backend, _, arg = spec.strip().partition(":")
    if backend not in BACKENDS:
        raise BadArgument(
            f"unknown device {spec!r}: expected one of host, cuda:N, mlu:N, torch:<device>, emu:<preset>")
    if backend == "host" and arg:
        raise BadArgument(f"unknown device {spec!r}: the host device takes no argument")
    if backend in ("cuda", "mlu") and not arg.isdigit():
        raise BadArgument(f"unknown device {spec!r}: expected {backend}:N with N a device index")
    if backend in ("torch", "emu") and not arg:
        raise BadArgument(f"unknown device {spec!r}: {backend}: needs an argument, e.g. "
                          + ("torch:cpu" if backend == "torch" else "emu:lpddr5-6400"))
    return backend, arg


def open(spec: str) -> Device:  # noqa: A001 - the documented name (odma_hw.devices.open)
    """Open a device by spec. BadArgument for a malformed spec, DeviceUnavailable when the
    backend or device is not present here (with the reason)."""
    backend, arg = parse_spec(spec)
    return _backend(backend).open_device(arg)
