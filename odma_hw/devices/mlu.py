"""Cambricon MLUs through CNRT (native/cnrt.c): specs `mlu:N`.

Found when libcnrt.so loads from $NEUWARE_HOME/lib64 or the loader's search path and reports a
device. Measurements are DMA-based (no kernel compiler here); kernel-driven random access on an
MLU comes from the torch backend (`torch:mlu:0` with torch_mlu).
"""

from __future__ import annotations

from odma_hw.devices import accel


def discover() -> tuple[list[str], str | None]:
    """(['mlu:0', ...], None), or ([], why there is none)."""
    return accel.discover("mlu")


def open_device(arg: str) -> accel.NativeAccelDevice:
    return accel.open_device("mlu", arg)
