"""LPDDR5 bank/burst timing emulator (Numba): specs, address maps, traces, engine (its arrays in
state.py, its decisions in controller.py), checker.

    from odma_hw.emu import emulate
    s = emulate("lpddr5-6400", "rand", 64, 100_000)
    s.efficiency, s.bandwidth_gbps, s.row_hit_rate

Names load lazily so that building the `odma-hw` parser does not import Numba.
"""

import importlib

_EXPORTS = {
    "emulate": "odma_hw.emu.model", "EmuStats": "odma_hw.emu.model",
    "PRESETS": "odma_hw.emu.specs", "ChannelSpec": "odma_hw.emu.specs",
    "DeviceSpec": "odma_hw.emu.specs", "derive": "odma_hw.emu.specs",
    "device_spec": "odma_hw.emu.specs", "preset_names": "odma_hw.emu.specs",
    "PATTERNS": "odma_hw.emu.traces", "Trace": "odma_hw.emu.traces",
    "from_arrays": "odma_hw.emu.traces", "generate": "odma_hw.emu.traces",
    "read_trace_file": "odma_hw.emu.traces",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'odma_hw.emu' has no attribute {name!r}")
