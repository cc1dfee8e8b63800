"""Where output goes and what input is read: why a folder cannot take new files, and which
files cannot be read as input, in the words an error line needs."""

from __future__ import annotations

import os
import stat

from odma_cli.errors import BadArgument


def folder_problem(folder: str, *, created: bool = False) -> str | None:
    """None where files can be made in `folder` (with `created`: where it exists or can be
    made, its missing parts created on the way); else why not, naming the part at fault: a
    regular file where a folder should be, or (without `created`) a folder that is not there."""
    existing = folder
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if existing and not os.path.isdir(existing):
        return f"{existing} is a file, not a folder"
    if existing != folder and not created:
        return f"folder {folder} does not exist"
    return None


def refuse_device(f, subject: str, kind: str) -> None:
    """BadArgument for an open input `f` that is a device other than a terminal: /dev/zero or
    /dev/urandom never end, and reading them as input only ends when memory does. Pipes and
    terminals end when their writer stops, so they stay welcome (`--trace /dev/stdin`,
    `--trace <(...)`). `subject` and `kind` word the error: "trace X is a device, not a CSV
    file"."""
    mode = os.fstat(f.fileno()).st_mode
    if (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)) and not f.isatty():
        raise BadArgument(f"{subject} is a device, not {kind}")
