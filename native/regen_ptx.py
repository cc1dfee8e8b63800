"""Regenerate the PTX embedded in native/cuda.c from native/kernels.cu.

    python native/regen_ptx.py            rewrite ODMA_PTX in cuda.c
    python native/regen_ptx.py --check    exit 1 if cuda.c does not hold what kernels.cu gives

nvcc (CUDA 13) emits `.version 9.x` / `.target sm_75`; drivers older than the toolkit reject a newer
PTX ISA (CUDA_ERROR_UNSUPPORTED_PTX_VERSION), so the header is lowered to `.version 6.4` /
`.target sm_52` (CUDA 10.1's ISA) after checking with ptxas that the lowered text still assembles
for sm_75 and sm_90. The kernels use nothing newer than that ISA.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import tempfile

NATIVE = pathlib.Path(__file__).resolve().parent
SOURCE = NATIVE / "kernels.cu"
TARGET = NATIVE / "cuda.c"
BEGIN, END = "/* ODMA_PTX_BEGIN */\n", "/* ODMA_PTX_END */\n"
CHECK_ARCHS = ("sm_75", "sm_90")


def lower(ptx: str) -> str:
    ptx = re.sub(r"^\.version .*$", ".version 6.4", ptx, count=1, flags=re.M)
    return re.sub(r"^\.target .*$", ".target sm_52", ptx, count=1, flags=re.M)


def generate() -> str:
    """The lowered PTX text for kernels.cu (needs nvcc and ptxas on PATH)."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = pathlib.Path(tmp) / "kernels.ptx"
        subprocess.run(["nvcc", "-ptx", "-arch=compute_75", "-O3", "-o", str(raw), str(SOURCE)],
                       check=True)
        low = pathlib.Path(tmp) / "lowered.ptx"
        low.write_text(lower(raw.read_text()))
        for arch in CHECK_ARCHS:
            subprocess.run(["ptxas", f"-arch={arch}", str(low), "-o", str(pathlib.Path(tmp) / "o")],
                           check=True)
        return low.read_text()


def as_c_literal(ptx: str) -> str:
    lines = ptx.rstrip("\n").split("\n")
    body = "\n".join('    "' + ln.replace("\\", "\\\\").replace('"', '\\"') + '\\n"' for ln in lines)
    return "static const char ODMA_PTX[] =\n" + body + ";\n"


def embedded(c_text: str) -> str:
    """The PTX block currently in cuda.c (between the markers), as C text."""
    return c_text[c_text.index(BEGIN) + len(BEGIN):c_text.index(END)]


def main(argv: list[str]) -> int:
    literal = as_c_literal(generate())
    text = TARGET.read_text()
    if "--check" in argv:
        same = embedded(text) == literal
        print("embedded PTX matches kernels.cu" if same else "embedded PTX differs from kernels.cu")
        return 0 if same else 1
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    TARGET.write_text(text[:start] + literal + text[end:])
    print(f"rewrote ODMA_PTX in {TARGET} ({literal.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
