"""The one check of the keys a user's document holds at its top level (a card, an engine
profile, a sweep's grid), so that each refuses a typo in the same one line."""

from __future__ import annotations

from odma_cli.errors import BadArgument


def check_keys(where: str, data, keys: dict, what: str) -> None:
    """BadArgument in one line unless `data` is a table of keys, each one of `keys` (name ->
    (required, kind)), holding every required one; `what` names the document ("a card")."""
    if not isinstance(data, dict):
        raise BadArgument(f"{where}: the top level must be a table of keys")
    unknown = [k for k in data if k not in keys]
    if unknown:
        raise BadArgument(f"{where}: unknown key {unknown[0]!r}; {what} has "
                          f"{', '.join(keys)}")
    missing = [k for k, (required, _) in keys.items() if required and k not in data]
    if missing:
        raise BadArgument(f"{where}: missing key {missing[0]!r}")
