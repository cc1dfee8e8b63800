"""NVIDIA GPUs through the CUDA driver API (native/cuda.c): specs `cuda:N`.

Found when libcuda.so.1 (the NVIDIA driver) loads and cuInit succeeds; the toolkit's stub libcuda
and a missing driver are reported as the reason, never crashed on.
"""

from __future__ import annotations

from odma_hw.devices import accel


def discover() -> tuple[list[str], str | None]:
    """(['cuda:0', ...], None), or ([], why there is none)."""
    return accel.discover("cuda")


def open_device(arg: str) -> accel.NativeAccelDevice:
    return accel.open_device("cuda", arg)
