"""TOML text to a dict: tomllib (Python >= 3.11), else the tomli package with the same parser."""

from __future__ import annotations

from odma_cli.errors import BadArgument


def loads(text: str) -> dict:
    """The TOML document `text` as a dict. ValueError (tomllib's TOMLDecodeError) for bad TOML,
    nesting too deep for the parser's recursion included; BadArgument when no TOML parser is
    installed."""
    try:
        import tomllib
    except ImportError:                 # Python 3.10: the same parser, as a package
        try:
            import tomli as tomllib
        except ImportError:
            raise BadArgument("reading TOML needs Python >= 3.11 or `pip install tomli`; or "
                              "write the file as JSON") from None
    try:
        return tomllib.loads(text)
    except RecursionError:              # `a = [[[[...` thousands deep: still just bad TOML
        raise ValueError("arrays or tables nested too deep") from None
