"""The house's arrows point down: the shell (odma_cli: command line, registry, errors, JSON,
plots, TOML, sweep) imports neither package above it, the hardware layer (odma_hw) never imports
the allocator (which is built on it), and no module imports another module's private names. The
command line and the sweep reach every command only through the registry
(odma_cli/commands.py), and neither the shell nor the hardware layer names an allocator command
or compares a policy name."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("odma_cli", "odma_hw", "allocator")


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
    assert {"odma_cli/main.py", "odma_hw/probe/cli.py", "allocator/serving/sim/replica.py"} <= found


# what each package may not import: every package above it
ABOVE = {"odma_cli": ("odma_hw", "allocator"), "odma_hw": ("allocator",), "allocator": ()}


@pytest.mark.parametrize("path", [p for p in modules() if ABOVE[p.parts[0]]], ids=str)
def test_no_package_imports_one_above_it(path):
    above = [m for m, _ in imports(path) if m.split(".")[0] in ABOVE[path.parts[0]]]
    assert not above, f"{path} imports {above}"


def allocator_commands() -> set:
    """The commands the allocator's modules implement (pyproject.toml's entry points)."""
    try:
        import tomllib
    except ImportError:                 # Python 3.10
        import tomli as tomllib
    with open(ROOT / "pyproject.toml", "rb") as f:
        group = tomllib.load(f)["project"]["entry-points"]["odma_cli.commands"]
    return {name for name, module in group.items() if module.startswith("allocator.")}


def command_names_spelt(path: Path, commands: set) -> list:
    """(line, name) of every string constant in the module that is exactly a command's name
    (a dict key, a comparison, a default): how a lower layer would come to depend on one."""
    tree = ast.parse((ROOT / path).read_text(), str(path))
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
                  and n.body and isinstance(n.body[0], ast.Expr)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in commands
            and id(n) not in docstrings]


@pytest.mark.parametrize("path", [p for p in modules() if p.parts[0] != "allocator"], ids=str)
def test_neither_the_shell_nor_the_hardware_layer_names_an_allocator_command(path):
    """The sweep asks a command for its default metric and its options' units, and probe asks
    the entry point that reads models: none of them spells an allocator command's name."""
    found = command_names_spelt(path, allocator_commands())
    assert not found, f"{path} names allocator commands: {found}"


def test_the_check_finds_a_command_name(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "m.py").write_text('"""simulate"""\nMETRICS = {"simulate": "output_tps"}\n'
                                   'if command == "replay":\n    pass\n')
    assert command_names_spelt(Path("m.py"), {"simulate", "replay"}) == [(2, "simulate"),
                                                                          (3, "replay")]


@pytest.mark.parametrize("path", list(modules()), ids=str)
def test_no_module_imports_another_modules_private_names(path):
    private = [f"{m}.{n}" for m, names in imports(path) if m.split(".")[0] in PACKAGES
               for n in names if n.startswith("_") and not n.endswith("__")]   # __version__ is public
    assert not private, f"{path} imports {private}"


def test_every_command_is_registered_and_has_a_parser():
    from odma_cli.commands import registry
    from odma_cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(registry()) == set(sub.choices)
    for name in ("probe", "emulate", "replay", "simulate", "engine", "workload", "sweep"):
        assert name in registry()


def test_a_command_whose_module_cannot_load_is_reported_not_fatal(monkeypatch, capsys):
    from odma_cli.commands import registry
    from odma_cli.main import main

    monkeypatch.setitem(registry(), "broken", "odma_hw.no_such_module")
    assert main(["broken"]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "broken is unavailable" in err
    assert main(["devices", "--json"]) == 0                     # the rest keeps working


# -- policies are named in their registry only ------------------------------------------------
POLICY_NAMES = {"oracle", "paged", "extent", "elastic", "static", "s3", "odma"}
# the registries that own these names: the policies' (allocator/policies.py) and the
# predictors' (allocator/predictors.py: "oracle" is a predictor too)
REGISTRIES = {"allocator/policies.py", "allocator/predictors.py"}


def _names(node) -> set:
    """The policy names a comparison operand spells out: a string, or a tuple, list or set of
    them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & POLICY_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_names(e) for e in node.elts)) if node.elts else set()
    return set()


def _is_layout(node) -> bool:
    """An operand naming a KV layout ("extent", "paged" are layouts too, not policies)."""
    name = node.id if isinstance(node, ast.Name) else \
        node.attr if isinstance(node, ast.Attribute) else ""
    return "layout" in name


def policy_comparisons(path: Path) -> list:
    """(line, source) of every ==, !=, in or not in comparing something with a policy name."""
    text = (ROOT / path).read_text()
    found = []
    for node in ast.walk(ast.parse(text, str(path))):
        if not isinstance(node, ast.Compare):
            continue
        if not all(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            continue
        operands = [node.left, *node.comparators]
        if any(_names(o) for o in operands) and not any(_is_layout(o) for o in operands):
            found.append((node.lineno, ast.get_source_segment(text, node)))
    return found


@pytest.mark.parametrize("path", [p for p in modules() if p.parts[0] == "allocator"
                                  and str(p) not in REGISTRIES], ids=str)
def test_no_module_compares_policy_names_outside_the_registry(path):
    """A policy is what its descriptor says (allocator.policies.PolicySpec: its allocator,
    predictor, KV layout, knee, admission), not a name to compare: a new policy then needs a
    registry entry, not a hunt through every module that spells the old ones."""
    found = policy_comparisons(path)
    assert not found, f"{path} compares policy names: {found}"


def test_the_check_finds_a_policy_comparison(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "m.py").write_text('if policy in ("extent", "elastic") or p == "odma":\n    pass\n'
                                   'if self.layout == "extent" or kind == "decode":\n    pass\n')
    assert [line for line, _ in policy_comparisons(Path("m.py"))] == [1, 1]


def test_every_folder_of_code_or_data_ships_in_the_distribution():
    """A folder left out of pyproject.toml's packages is missing from an installed wheel while
    the editable install of the tests still imports it (allocator.serving.core once was)."""
    try:
        import tomllib
    except ImportError:                 # Python 3.10
        import tomli as tomllib
    with open(ROOT / "pyproject.toml", "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    folders = {p.parent.relative_to(ROOT) for top in PACKAGES
               for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".toml", ".json")
               and "__pycache__" not in p.parts}
    missing = sorted(str(f).replace("/", ".") for f in folders
                     if str(f).replace("/", ".") not in listed)
    assert not missing, f"pyproject.toml's packages lack {missing}"
