"""cffi API-mode builder for the native shim (`odma_hw._native`).

setup.py names `ffibuilder` in cffi_modules, so `pip install` compiles the shim; no manual step.
The cdef is the block of native/odma.h between ODMA_CDEF_BEGIN and ODMA_CDEF_END, so the header
stays the one description of the ABI.
"""

import pathlib

from cffi import FFI

NATIVE = pathlib.Path(__file__).resolve().parent
HEADER = NATIVE / "odma.h"
# one small file per backend; the order only matters for readability of build logs
SOURCES = ["common.c", "host.c", "copier.c", "cuda.c", "cnrt.c"]
# every header the sources include (odma.h, common.h, copy_kernel.h and the generated
# kernels_ptx.h): a change to any of them rebuilds the shim
HEADERS = sorted(p.name for p in NATIVE.glob("*.h"))


def _rel(name: str) -> str:
    return str((NATIVE / name).relative_to(NATIVE.parent))


def _cdef() -> str:
    text = HEADER.read_text()
    start = text.index("/* ODMA_CDEF_BEGIN */") + len("/* ODMA_CDEF_BEGIN */")
    end = text.index("/* ODMA_CDEF_END */")
    return text[start:end]


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "odma_hw._native",
    '#include "odma.h"\n',
    sources=[_rel(s) for s in SOURCES],
    depends=[_rel(h) for h in HEADERS],
    include_dirs=[str(NATIVE.relative_to(NATIVE.parent))],
    # Built at install time on the machine that runs it, so -march=native is safe and lets the
    # kernels use the widest vector loads the CPU has.
    extra_compile_args=["-O3", "-march=native", "-std=gnu11", "-pthread", "-Wall", "-Wextra",
                        "-Wno-unused-parameter"],
    extra_link_args=["-pthread"],
    libraries=["dl"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
