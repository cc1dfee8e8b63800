"""odma-hw: the hardware layer of ODMA (bandwidth probe, LPDDR5 emulator, devices)."""

from odma_cli import __version__  # noqa: F401
from odma_cli.errors import (  # noqa: F401
    BadArgument,
    DeviceError,
    DeviceUnavailable,
    OdmaError,
)
