"""Run sizes, and what paging costs at them: the granule and fraction arguments of a probe
(check_granule, parse_granularities, check_alpha, check_full_speed), the KV run a paged layout
reads (KVRun), the knee of a device's random/sequential ratios and judge_run(), the verdict on a
run size that a probe result reports as `kv_run`."""

from __future__ import annotations

import dataclasses
import math

from odma_cli.errors import BadArgument
from odma_hw.devices.base import MIN_GRANULE, is_int

# A run reading at this fraction of streaming or more reads at full speed: the knee is where runs
# reach it for good, and KV runs that reach it make paging free. It is not alpha: alpha marks a
# device as RACM at its decision granule, while a page read at 0.68 of streaming (an H100's 64 B
# runs) still makes paged KV reads take half as long again as a contiguous block's.
FULL_SPEED = 0.9
# bytes per KV element; bf16 is what GPU serving stacks keep their KV cache in by default
KV_DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
DEFAULT_KV_DTYPE = "bf16"
DEFAULT_PAGE_TOKENS = 16            # as `simulate` and `engine` page by default (vLLM's block)


def check_granule(g) -> int:
    """A granule: an integer power of two >= 8 bytes (the upper bound is the buffer)."""
    if not is_int(g) or g < MIN_GRANULE or g & (g - 1):
        raise BadArgument(f"granularity {g!r} is not a power of two >= {MIN_GRANULE}")
    return g


def bytes_of(text: str) -> int | None:
    """'64' -> 64, '4K' -> 4096, '1M' -> 1048576, '1G' (a trailing B is allowed); None if
    malformed."""
    part = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(part[-1:], 1)
    if mult > 1:
        part = part[:-1]
    return int(part) * mult if part.isdigit() else None


def parse_granule(text: str) -> int:
    """One granule, as --decision-granularity takes it: '64' or '4K'."""
    g = bytes_of(text)
    if g is None:
        raise BadArgument(f"malformed granularity {text!r}: expected e.g. 32, 64 or 4K")
    return check_granule(g)


def parse_granularities(text: str) -> list[int]:
    """'32,64,4K' -> [32, 64, 4096]; each a power of two >= 8 (the upper bound is the buffer)."""
    values = [bytes_of(part) for part in text.split(",")]
    if None in values:
        raise BadArgument(f"malformed granularity {text!r}: expected e.g. 32,64,4K")
    return sorted({check_granule(g) for g in values})


def check_alpha(alpha: float) -> float:
    if not (isinstance(alpha, (int, float)) and 0.0 < alpha < 1.0):  # also refuses nan
        raise BadArgument(f"alpha must lie in (0, 1), got {alpha}")
    return alpha


def check_full_speed(fraction: float) -> float:
    if not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0):  # also refuses nan
        raise BadArgument(f"full speed must lie in (0, 1] (a fraction of streaming), got "
                          f"{fraction}")
    return fraction


def size_text(nbytes: int) -> str:
    """2048 -> '2 KiB', 96 -> '96 B', 3072 -> '3 KiB'."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


@dataclasses.dataclass(frozen=True)
class KVRun:
    """A contiguous run that a paged KV layout reads, whose cost the probe reports: one page of
    one (layer, K or V, KV head) in the head-major layout [layers, 2, kv_heads, tokens, head_dim]
    is page_tokens x head_dim x dtype bytes (a model's pages: of_model), or `nbytes` as given."""

    nbytes: int
    page_tokens: int | None = None
    model: str | None = None
    head_dim: int | None = None
    dtype: str | None = None

    @classmethod
    def of_model(cls, model: str, head_dim: int, page_tokens: int, dtype: str) -> "KVRun":
        if not is_int(page_tokens) or page_tokens < 1:
            raise BadArgument(f"--page-tokens must be a positive integer, got {page_tokens!r}")
        if dtype not in KV_DTYPES:
            raise BadArgument(f"unknown --dtype {dtype!r}: expected one of {', '.join(KV_DTYPES)}")
        return cls(page_tokens * head_dim * KV_DTYPES[dtype], page_tokens, model, head_dim, dtype)

    def label(self) -> str:
        """'16-token pages of M (head_dim 64, bf16) are 2 KiB runs', or '2 KiB runs'."""
        if self.model is None:
            return f"{size_text(self.nbytes)} runs"
        return (f"{self.page_tokens}-token pages of {self.model} (head_dim {self.head_dim}, "
                f"{self.dtype}) are {size_text(self.nbytes)} runs")

    def check_fits(self, buffer_bytes: int, where: str) -> None:
        """BadArgument when no random read of this run fits: below the smallest granule measured,
        or larger than the `buffer_bytes` buffer the probe reads on `where`."""
        what = "--run-bytes" if self.model is None else self.label().replace(" are ", ", ")
        if self.nbytes < MIN_GRANULE:
            raise BadArgument(f"{what}: {self.nbytes} B is below the smallest granule the probe "
                              f"measures ({MIN_GRANULE} B)")
        if self.nbytes > buffer_bytes:
            raise BadArgument(f"{what}: {self.nbytes} B is larger than the {buffer_bytes}-byte "
                              f"buffer the probe reads on {where}")

    def granules(self, buffer_bytes: int) -> list[int]:
        """The granules to measure for it: the run itself where it is a power of two, else the
        powers of two around it (the ratio is interpolated between them); none above the
        buffer (check_fits first)."""
        below = 1 << (self.nbytes.bit_length() - 1)
        if below == self.nbytes:
            return [below]
        return [g for g in (below, 2 * below) if MIN_GRANULE <= g <= buffer_bytes]


def knee(ratios: dict[int, float], full_speed: float = FULL_SPEED) -> int | None:
    """The smallest measured granule from which on every measured granule reads at >=
    `full_speed` of streaming (ratios: granule -> random/sequential); None when the largest does
    not."""
    found = None
    for g in sorted(ratios, reverse=True):
        if ratios[g] < full_speed:
            break
        found = g
    return found


def ratio_at(ratios: dict[int, float], nbytes: int, where: str) -> tuple[float, str, list[int]]:
    """(random/sequential for runs of `nbytes`, how it was found, the granules it comes from):
    "measured" at that granule; "interpolated" linearly in log2(size) between the two measured
    granules around it; "largest-measured" above the largest granule measured (a longer run
    reads no worse: a lower bound). BadArgument below the smallest granule `where` measured."""
    if nbytes in ratios:
        return ratios[nbytes], "measured", [nbytes]
    sizes = sorted(ratios)
    if nbytes < sizes[0]:
        raise BadArgument(f"a {nbytes} B run is below the smallest granule {where} measured "
                          f"({sizes[0]} B): probe the device for it rather than judging a saved "
                          f"result")
    if nbytes > sizes[-1]:
        return ratios[sizes[-1]], "largest-measured", [sizes[-1]]
    lo = max(g for g in sizes if g < nbytes)
    hi = min(g for g in sizes if g > nbytes)
    w = (math.log2(nbytes) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return ratios[lo] * (1 - w) + ratios[hi] * w, "interpolated", [lo, hi]


def judge_run(run: KVRun, ratios: dict[int, float], alpha: float, full_speed: float,
              where: str) -> dict:
    """What paging costs for runs like `run` on a device whose random/sequential ratios by
    granule are `ratios`: the JSON object `kv_run` of a probe result, its `summary` the sentence
    the table prints."""
    ratio, how, around = ratio_at(ratios, run.nbytes, where)
    basis = {"measured": f"measured at {size_text(run.nbytes)}",
             "interpolated": (f"interpolated between the measured {size_text(around[0])} and "
                              f"{size_text(around[-1])}"),
             "largest-measured": (f"the largest measured granule's ({size_text(around[0])}): "
                                  f"a longer run reads no worse")}[how]
    free = ratio >= full_speed
    if free and round(ratio, 2) >= 1.0:          # as the sentence prints it
        tail = "paging costs nothing on this device"
    elif free:
        tail = (f"paging costs little on this device (paged KV reads take {1 / ratio:.2f}x a "
                f"contiguous block's time; >= {full_speed:g} of streaming is full speed)")
    else:
        tail = (f"paging reads at {ratio:.2f}; contiguous blocks recommended (paged KV reads "
                f"take {1 / ratio:.2f}x a contiguous block's time")
        tail += f"; below alpha {alpha:.2f}: RACM at this run size)" if ratio < alpha else ")"
    return {"run_bytes": run.nbytes, "page_tokens": run.page_tokens, "model": run.model,
            "head_dim": run.head_dim, "dtype": run.dtype,
            "dtype_bytes": KV_DTYPES.get(run.dtype) if run.dtype else None,
            "ratio": ratio, "ratio_source": how, "ratio_granules": around,
            "full_speed": full_speed,
            "verdict": "paging-free" if free else "contiguous-recommended",
            "summary": f"{run.label()}: {ratio:.2f} of streaming here: {tail}",
            "basis": f"the verdict at the {size_text(run.nbytes)} run size; its ratio {basis}"}
