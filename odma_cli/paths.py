"""Where output goes: why a folder cannot take new files, in the words an error line needs."""

from __future__ import annotations

import os


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
