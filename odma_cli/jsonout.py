"""JSON that every parser reads: a float that is not finite (a margin over no steps, a time
that overflowed) is written as null, never as the Infinity or NaN that json.dumps emits and
strict parsers (jq, JavaScript, Go) refuse."""

from __future__ import annotations

import json
import math

from odma_cli.errors import BadArgument


def finite(obj):
    """`obj` with every non-finite float (also inside dicts, lists and tuples) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj, **kwargs) -> str:
    return json.dumps(finite(obj), allow_nan=False, **kwargs)


def check_series(args) -> None:
    """--series adds time series to --json's object: without --json there is nowhere to put
    them, and a table that silently leaves them out is not what was asked for."""
    if args.series and not args.json:
        raise BadArgument("--series adds the time series to --json's output: give --json too")
