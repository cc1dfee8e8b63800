"""argparse value types shared by the subcommands: each refuses what it cannot use with a short
reason, which the parser prints as one line with exit status 2 before any work starts."""

from __future__ import annotations

import argparse
import math


def parse_line(parser, argv: list, at: int = 0) -> argparse.Namespace:
    """parser.parse_args(argv), where a parsed `preset` carrying `flags` (other options, as
    --preset gives them) is read as if its flags stood at argv[at] (after a command's name):
    every flag of the line's own still wins. The command line and a sweep's cells read alike."""
    args = parser.parse_args(argv)
    flags = getattr(getattr(args, "preset", None), "flags", ())
    return parser.parse_args([*argv[:at], *flags, *argv[at:]]) if flags else args


def given(args, defaults: dict) -> list[str]:
    """The options of `defaults` (dest -> default) that the command line gave: their parser
    default is None, so that an option given can be told from one left at its default."""
    return [name for name in defaults if getattr(args, name) is not None]


def with_defaults(args, defaults: dict) -> dict:
    """Each option of `defaults` as the command line gave it, else its default."""
    return {name: default if getattr(args, name) is None else getattr(args, name)
            for name, default in defaults.items()}


def flag_names(dests) -> str:
    """['write_ratio', 'seed'] -> '--write-ratio, --seed', for a message."""
    return ", ".join("--" + d.replace("_", "-") for d in dests)


def _number(text: str, kind):
    try:
        return kind(text)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(
            f"{'an integer' if kind is int else 'a number'} is needed, not {text!r}") from None


def nonempty(text: str) -> str:
    """A path or a name: an empty one would silently mean the default, or nothing."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def count(text: str) -> int:
    """An integer >= 0."""
    v = _number(text, int)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {v}")
    return v


def positive_int(text: str) -> int:
    v = _number(text, int)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {v}")
    return v


def positive_float(text: str) -> float:
    """A finite number > 0."""
    v = _number(text, float)
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, not {text!r}")
    return v


def between(low: float, high: float):
    """The type of a number in [low, high] (a quantity with the range a card file gives it)."""
    def number(text: str) -> float:
        v = _number(text, float)
        if not low <= v <= high:                    # NaN compares false: refused too
            raise argparse.ArgumentTypeError(f"must be a number in [{low:g}, {high:g}], not "
                                             f"{text!r}")
        return v

    return number


def nonnegative_float(text: str) -> float:
    v = _number(text, float)
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {text!r}")
    return v


def unit_fraction(text: str) -> float:
    """A number in [0, 1)."""
    v = _number(text, float)
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), not {text!r}")
    return v


def comma_items(text: str) -> list[str] | None:
    """'a, b' -> ['a', 'b']; None where the text or any item is empty ('', 'a,', 'a,,b'): a
    stray comma is a typo more often than a wish for nothing there."""
    parts = [p.strip() for p in text.split(",")]
    return parts if all(parts) else None


def positive_floats(text: str) -> list[float]:
    """'0.5,1,2' -> [0.5, 1.0, 2.0]: a comma-separated list of finite numbers > 0."""
    parts = comma_items(text)
    if parts is None:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, not {text!r}")
    return [positive_float(p) for p in parts]


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2**63)."""
    v = count(text)
    if v >= 1 << 63:
        raise argparse.ArgumentTypeError(f"a seed must be below 2**63, not {v}")
    return v
