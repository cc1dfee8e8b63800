"""What every `odma-hw` command shares (odma_cli/main.py main): how a failure of standard output ends.

Specification:
- output that cannot be written (a full disk, an I/O error) ends the command with exit status 3 and
  one line on stderr, never a traceback, whichever command wrote it;
- a reader that goes away early (a closed pipe) is not a failure: exit 0, nothing on stderr.
"""

import os
import subprocess
import sys

import pytest

DEV_FULL = "/dev/full"
needs_dev_full = pytest.mark.skipif(not os.path.exists(DEV_FULL), reason="needs /dev/full (Linux)")


def run_with_stdout(stdout, *args):
    return subprocess.run([sys.executable, "-m", "odma_hw", *args], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=120)


@needs_dev_full
@pytest.mark.parametrize("args", [["devices"], ["devices", "--json"], ["--help"], ["probe", "--help"],
                                  ["--version"]])
def test_output_to_a_full_disk_exits_3_with_one_line(args):
    with open(DEV_FULL, "w") as full:
        proc = run_with_stdout(full, *args)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == ["odma-hw: error: cannot write to standard output: No space left on device"], \
        proc.stderr


def test_a_reader_that_went_away_is_not_an_error():
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to the pipe now fails with EPIPE
    try:
        proc = run_with_stdout(write_end, "devices")
    finally:
        os.close(write_end)
    assert proc.returncode == 0
    assert proc.stderr == ""  # no "Exception ignored ... BrokenPipeError" at interpreter exit
