"""What every `odma-hw` command shares (odma_cli/main.py main): how a failure of standard output ends.

Specification:
- output that cannot be written (a full disk, an I/O error) ends the command with exit status 3 and
  one line on stderr, never a traceback, whichever command wrote it;
- a reader that goes away early (a closed pipe) is not a failure: exit 0, nothing on stderr;
- a command whose optional library is missing (`make probe` installs none of them) exits 2 with
  one line naming the library and the extra that installs it, before any work.
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


# a command line (TRACE: a two-request trace), and the library it cannot run without
TRACE = "TRACE"
ENGINE = ["engine", "--model", "tiny-llama", "--trace", TRACE, "--prompt-cap", "8",
          "--output-cap", "2"]
NEEDS = [("torch", ENGINE, "odma-hw[torch]"),
         ("transformers", ENGINE, "odma-hw[engine]"),
         ("psutil", ENGINE + ["--policy", "hf", "--device", "torch:cpu"], "pip install psutil"),
         ("triton", ENGINE + ["--attention", "triton"], "triton"),
         ("torch", ["calibrate", "--out", "card.toml"], "odma-hw[torch]"),
         ("torch", ["probe", "--device", "torch:cpu"], "odma-hw[torch]"),
         ("matplotlib", ["simulate", "--trace", TRACE, "--plot", "p.png"], "odma-hw[plot]")]


@pytest.mark.parametrize("missing, args, says", NEEDS,
                         ids=[f"{lib}-{' '.join(args[:1] + args[-2:])}" for lib, args, _ in NEEDS])
def test_a_missing_library_is_one_line_and_exit_2_before_any_work(tmp_path_factory, missing,
                                                                   args, says):
    trace = tmp_path_factory.mktemp("trace") / "two.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n8,2\n8,2\n")
    cwd = tmp_path_factory.mktemp("cwd")
    args = [str(trace) if a == TRACE else a for a in args]
    # None in sys.modules makes every import of the library fail, as where it is not installed
    script = (f"import sys; sys.modules[{missing!r}] = None\n"
              "from odma_cli.main import main\nsys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=cwd, text=True,
                          capture_output=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("odma-hw: error:") and says in lines[0], lines
    assert not list(cwd.iterdir())                       # nothing written


def test_no_command_lists_the_commands_and_is_bad_usage_in_one_line():
    proc = run_with_stdout(subprocess.PIPE)
    assert proc.returncode == 2
    assert "simulate" in proc.stdout and "probe" in proc.stdout
    assert proc.stderr.splitlines() == ["odma-hw: error: no command given: name one of those "
                                        "above"], proc.stderr
