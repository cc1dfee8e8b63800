"""`odma-hw` command line: a thin layer over the Python APIs.

Each subcommand lives next to the code it drives, found through the registry of
odma_cli/commands.py, and exposes `register(subparsers)`, which adds its parser and sets
`func(args) -> int`. Exit codes: 0 ok, 2 bad usage (one-line reason), 3 failure at
run time (a device, or writing the output: a full disk, a closed terminal), 130 interrupted, 143
terminated (SIGTERM: a time limit, `kill`; the run ends as on Ctrl-C, what finished printed). A
reader that stops early (`odma-hw devices | head -1`) is not a failure: 0.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from odma_cli import __version__
from odma_cli.argtypes import parse_line
from odma_cli.commands import by_module
from odma_cli.errors import BadArgument, DeviceError, DeviceUnavailable, OdmaError

class Parser(argparse.ArgumentParser):
    """argparse that reports bad usage in one line with exit status 2 (not a usage dump)."""

    def error(self, message):
        self.exit(2, f"odma-hw: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="odma-hw",
        description="Measure whether device memory is random-access-constrained (RACM), emulate "
                    "LPDDR5 timing, and serve a request trace with each KV-cache allocation "
                    "policy (replayed, simulated or on a real engine): its memory use, "
                    "tokens/s and latencies.")
    parser.add_argument("--version", action="version", version=f"odma-hw {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for module, commands in by_module().items():
        try:
            importlib.import_module(module).register(sub)
        except ImportError as exc:
            # a missing dependency (numba, say) disables its own commands, not the whole tool
            for command in commands:
                _register_unavailable(sub, command, f"{command} is unavailable: {exc}")
    return parser


def _register_unavailable(sub, command: str, reason: str) -> None:
    p = sub.add_parser(command, help=f"(unavailable) {reason}", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)

    def explain(args):
        raise OdmaError(reason)
    p.set_defaults(func=explain)


class _OutputFailed(Exception):
    """Standard output refused a write (full disk, I/O error); carries the OSError."""


class _GuardedStdout:
    """sys.stdout while a command runs: a write or flush that fails becomes _OutputFailed, so
    main() can tell a failure of the output from any other OSError. A reader that went away
    (BrokenPipeError) stays what it is. Everything else is the real stream's."""

    def __init__(self, stream):
        self._stream = stream

    def _guard(self, method, *args):
        try:
            return method(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _OutputFailed(exc) from exc

    def write(self, text):
        return self._guard(self._stream.write, text)

    def writelines(self, lines):
        return self._guard(self._stream.writelines, lines)

    def flush(self):
        return self._guard(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _discard_stdout() -> None:
    """Point descriptor 1 at /dev/null, so that the interpreter's last flush of output that could
    not be written cannot fail a second time (and print a traceback after our one line)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real descriptor (an in-process caller)
        pass


def parse(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """(the parser, the parsed line); a command's --preset reads as its flags placed right
    after the command's name (argtypes.parse_line), so the line's own win."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    return parser, parse_line(parser, argv, at=1)


def _run(argv: list[str] | None) -> int:
    """Parse and run one command; odma errors and Ctrl-C become their exit codes."""
    parser, args = parse(argv)
    if not getattr(args, "func", None):     # the commands on stdout, the error in one line
        parser.print_help()
        print("odma-hw: error: no command given: name one of those above", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except (BadArgument, DeviceUnavailable) as exc:
        print(f"odma-hw: error: {exc}", file=sys.stderr)
        return 2
    except DeviceError as exc:
        print(f"odma-hw: device error: {exc}", file=sys.stderr)
        return 3
    except OdmaError as exc:
        print(f"odma-hw: error: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:       # a command may catch it and raise a new one: the flag says
        if _terminated:
            print("odma-hw: terminated", file=sys.stderr)
            return 143
        print("odma-hw: interrupted", file=sys.stderr)
        return 130


_terminated = False                 # a SIGTERM came (the handler below is the process's)


def end_on_sigterm_as_on_ctrl_c() -> None:
    """Install the handler below: the odma-hw process's (main() without argv), and the test and
    benchmark runs' (their conftest.py: a run cut by a time limit still reports what it did)."""
    signal.signal(signal.SIGTERM, _terminate)


def _terminate(signum, frame):
    """SIGTERM, raised where the run is as a KeyboardInterrupt: every command that keeps its
    finished work on Ctrl-C (simulate's runs, the engine's policies, a sweep's cells) keeps it
    when a time limit or `kill` ends it too, where the default would lose it all."""
    global _terminated
    _terminated = True
    raise KeyboardInterrupt


def _flush_stdout() -> None:
    # output can sit in a buffer until the end (stdout a file or a pipe): flush it while main()
    # can still report a failed write, not the interpreter at exit (a traceback)
    if sys.stdout is not None:  # None: descriptor 1 was closed, print() drops everything
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """The `odma-hw` process (argv None: sys.argv, and SIGTERM handled as above), or one
    command line run in the caller's process, its signals left as they are."""
    if argv is None:
        end_on_sigterm_as_on_ctrl_c()
    real_stdout = sys.stdout
    if real_stdout is not None:
        sys.stdout = _GuardedStdout(real_stdout)
    try:
        try:
            status = _run(argv)
        except SystemExit:  # argparse after --help, --version or a usage error
            _flush_stdout()
            raise
        _flush_stdout()
        return status
    except BrokenPipeError:  # the reader went away: it has what it wanted
        _discard_stdout()
        return 0
    except _OutputFailed as failed:
        _discard_stdout()
        exc = failed.args[0]
        print(f"odma-hw: error: cannot write to standard output: {exc.strerror or exc}",
              file=sys.stderr)
        return 3
    finally:
        sys.stdout = real_stdout


if __name__ == "__main__":
    sys.exit(main())
