"""odma-hw: the hardware layer of ODMA (bandwidth probe, LPDDR5 emulator, devices)."""

from odma_hw.errors import (  # noqa: F401
    BadArgument,
    DeviceError,
    DeviceUnavailable,
    OdmaError,
)

__version__ = "0.1.0"
