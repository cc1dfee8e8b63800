"""`odma-hw` command line: a thin layer over the Python APIs.

Each subcommand lives next to the code it drives and exposes `register(subparsers)`, which adds its
parser and sets `func(args) -> int`. Exit codes: 0 ok, 2 bad usage (one-line reason), 3 device
failure at run time, 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from odma_hw.errors import BadArgument, DeviceError, DeviceUnavailable, OdmaError

# modules that register subcommands, in the order --help lists them
COMMAND_MODULES = {
    "odma_hw.probe": ("devices", "probe"),
    "odma_hw.emu.cli": ("emulate",),
    "allocator.replay": ("replay",),
    "allocator.serving.cli": ("simulate",),
    "allocator.serving.workloads": ("workload",),
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad usage in one line with exit status 2 (not a usage dump)."""

    def error(self, message):
        self.exit(2, f"odma-hw: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="odma-hw",
        description="Measure whether device memory is random-access-constrained (RACM), emulate "
                    "LPDDR5 timing, and replay KV-cache allocation policies.")
    parser.add_argument("--version", action="version", version="odma-hw 0.1.0")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for module, commands in COMMAND_MODULES.items():
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
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
    except KeyboardInterrupt:
        print("odma-hw: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
