"""Plots of every subcommand: checked before any work, written after it.

check_plot_path() refuses up front what savefig would refuse at the end (no matplotlib, a
folder that does not exist or is not writable, a format matplotlib cannot write), so a long run
never ends in a traceback and never loses its results to a bad --plot.
"""

from __future__ import annotations

import os

from odma_cli.errors import BadArgument, OutputError
from odma_cli.paths import folder_problem


def pyplot():
    """matplotlib.pyplot on the Agg backend; BadArgument naming the extra when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BadArgument(f"--plot needs matplotlib ({exc}); pip install 'odma-hw[plot]'") from None
    return plt


def check_plot_path(path: str) -> None:
    """BadArgument unless a figure can be saved at `path`."""
    plt = pyplot()
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise BadArgument(f"--plot {path!r} is a directory; give a file name such as plot.png")
    problem = folder_problem(folder)
    if problem:
        raise BadArgument(f"--plot {path!r}: {problem}")
    if not os.access(folder, os.W_OK):
        raise BadArgument(f"--plot {path!r}: folder {folder} is not writable")
    existed = os.path.exists(path)
    try:                    # what access() cannot tell: a file system that takes no new files
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise BadArgument(f"--plot {path!r}: cannot write there: {exc.strerror or exc}") from None
    if not existed:
        try:
            os.unlink(path)
        except OSError:
            pass
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    fig = plt.figure()
    try:
        formats = fig.canvas.get_supported_filetypes()
    finally:
        plt.close(fig)
    if ext not in formats:
        raise BadArgument(f"--plot {path!r}: unknown image format {ext or '(none)'!r}; use one "
                          f"of {', '.join(sorted(formats))}")


def save(fig, path: str) -> None:
    """Save and close `fig`; an I/O failure is one OutputError line (the results were already
    printed)."""
    plt = pyplot()
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as exc:
        raise OutputError(f"cannot write plot {path!r}: {exc.strerror or exc} (the results "
                          f"above are complete)") from None
    finally:
        plt.close(fig)
