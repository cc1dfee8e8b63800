"""The house's arrows point down: the hardware layer (odma_hw) never imports the allocator
(which is built on it), and no module imports another module's private names. The command line
and the sweep reach the allocator's commands only through the registry (odma_hw/commands.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("odma_hw", "allocator")


def modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT)


def imports(path: Path):
    """(imported module, names taken from it) of every import in the file, functions included."""
    tree = ast.parse((ROOT / path).read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, tuple(a.name for a in node.names)


def test_the_modules_are_found():
    found = {str(p) for p in modules()}
    assert "odma_hw/cli.py" in found and "allocator/serving/engine.py" in found


@pytest.mark.parametrize("path", [p for p in modules() if p.parts[0] == "odma_hw"], ids=str)
def test_the_hardware_layer_never_imports_the_allocator(path):
    above = [m for m, _ in imports(path) if m == "allocator" or m.startswith("allocator.")]
    assert not above, f"{path} imports {above}"


@pytest.mark.parametrize("path", list(modules()), ids=str)
def test_no_module_imports_another_modules_private_names(path):
    private = [f"{m}.{n}" for m, names in imports(path) if m.split(".")[0] in PACKAGES
               for n in names if n.startswith("_") and not n.endswith("__")]   # __version__ is public
    assert not private, f"{path} imports {private}"


def test_every_command_is_registered_and_has_a_parser():
    from odma_hw.cli import build_parser
    from odma_hw.commands import registry

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(registry()) == set(sub.choices)
    for name in ("probe", "emulate", "replay", "simulate", "engine", "workload", "sweep"):
        assert name in registry()


def test_a_command_whose_module_cannot_load_is_reported_not_fatal(monkeypatch, capsys):
    from odma_hw.cli import main
    from odma_hw.commands import registry

    monkeypatch.setitem(registry(), "broken", "odma_hw.no_such_module")
    assert main(["broken"]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "broken is unavailable" in err
    assert main(["devices", "--json"]) == 0                     # the rest keeps working
