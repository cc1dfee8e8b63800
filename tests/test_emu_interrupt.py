"""Ctrl-C during a long `odma-hw emulate` stops it at once (exit status 130), not when the
timing engine's run ends: the engine runs in short slices and returns to Python between them."""

import os
import selectors
import signal
import subprocess
import sys
import time

import pytest

ODMA_HW = os.path.join(os.path.dirname(sys.executable), "odma-hw")


def _line_containing(proc, text, seconds):
    """The first stderr line of `proc` containing `text`, read within `seconds` (else None)."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    deadline = time.monotonic() + seconds
    buffered = b""
    while time.monotonic() < deadline:
        if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
            continue
        chunk = os.read(proc.stderr.fileno(), 4096)
        if not chunk:
            return None  # the process ended
        buffered += chunk
        for line in buffered.decode(errors="replace").splitlines():
            if text in line:
                return line
    return None


@pytest.mark.skipif(not os.path.exists(ODMA_HW), reason="odma-hw console script not installed")
@pytest.mark.parametrize("spec", ["lpddr5-6400", "mlu370-x4"])
def test_ctrl_c_during_the_timing_run_exits_130_at_once(spec):
    # 20 M random requests keep the timing engine busy for several seconds on any machine
    proc = subprocess.Popen([ODMA_HW, "emulate", "--spec", spec, "--requests", "20000000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # the first progress line comes after the engine's first slice: it is running
        assert _line_containing(proc, "timing:", 60) is not None
        proc.send_signal(signal.SIGINT)
        returncode = proc.wait(timeout=5)  # not the 10+ s of the remaining run
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert returncode == 130
    assert b"odma-hw: interrupted" in proc.stderr.read()
