"""No module over MAX_FILE_LINES lines and no function over MAX_FUNCTION_LINES, measured here so
that neither creeps back: a module that grows past the limit is split by purpose, a function by
its steps. The few functions that stay longer are listed in EXEMPT, each with its reason, which
its own docstring must also give (a reader of the function learns it there, not here)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80

# (file, function's qualified name) -> (why it stays one function, the words of that reason
# its docstring gives beside "one function")
EXEMPT = {
    ("odma_hw/emu/timing_loop.py", "run_slice"): (
        "the Numba timing loop: the rank-level state lives in locals for the whole slice",
        "Numba timing loop"),
    ("odma_hw/emu/checker.py", "check"): (
        "the JEDEC checker: one replay over one running state, a rule per branch",
        "JEDEC checker"),
}


def sources() -> list[Path]:
    """Every Python file of the packages (and of native/), relative to ROOT."""
    found = [p for top in ("odma_cli", "odma_hw", "allocator") for p in (ROOT / top).rglob("*.py")]
    found += (ROOT / "native").glob("*.py")
    return sorted(p.relative_to(ROOT) for p in found if "__pycache__" not in p.parts)


def functions(path: Path):
    """(qualified name, first line, lines, docstring) of every def and async def in the file,
    nested ones and methods included; a function's lines run from its `def` to its last line."""
    tree = ast.parse((ROOT / path).read_text(), str(path))

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                yield (name, child.lineno, child.end_lineno - child.lineno + 1,
                       ast.get_docstring(child) or "")
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)
    yield from walk(tree, "")


def long_files() -> list[str]:
    out = []
    for path in sources():
        n = len((ROOT / path).read_text().splitlines())
        if n > MAX_FILE_LINES:
            out.append(f"{path}: {n} lines")
    return out


def long_functions() -> list[str]:
    out = []
    for path in sources():
        for name, line, n, _ in functions(path):
            if n > MAX_FUNCTION_LINES and (str(path), name) not in EXEMPT:
                out.append(f"{path}:{line} {name}: {n} lines")
    return out


def test_the_sources_are_found():
    found = {str(p) for p in sources()}
    assert {"odma_cli/main.py", "allocator/serving/sim/replica.py",
            *(f for f, _ in EXEMPT)} <= found


def test_no_file_is_over_the_limit():
    offenders = long_files()
    assert not offenders, (f"over {MAX_FILE_LINES} lines (split the module by purpose): "
                           + "; ".join(offenders))


def test_no_function_is_over_the_limit():
    offenders = long_functions()
    assert not offenders, (f"over {MAX_FUNCTION_LINES} lines (split the function by its steps, "
                           f"or exempt it in tests/test_sizes.py with its reason): "
                           + "; ".join(offenders))


@pytest.mark.parametrize("where", sorted(EXEMPT), ids=lambda w: f"{w[0]}:{w[1]}")
def test_an_exempt_function_is_still_long_and_says_why_in_its_docstring(where):
    path, name = where
    found = {n: (length, doc) for n, _, length, doc in functions(Path(path))}
    assert name in found, f"{path} has no function {name}: drop it from EXEMPT"
    length, doc = found[name]
    assert length > MAX_FUNCTION_LINES, (f"{path} {name} is {length} lines, within the limit: "
                                         f"drop it from EXEMPT")
    reason, words = EXEMPT[where]
    text = " ".join(doc.split()).lower()
    assert "one function" in text and words.lower() in text, (
        f"{path} {name}'s docstring must say why it is one function of over "
        f"{MAX_FUNCTION_LINES} lines: {reason}")


def test_the_measure_counts_nested_functions_methods_and_whole_files(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "odma_hw").mkdir()
    (tmp_path / "allocator").mkdir()
    body = "    x = 1\n" * MAX_FUNCTION_LINES
    (tmp_path / "odma_hw" / "m.py").write_text(
        "def outer():\n    def inner():\n" + "    " + body.replace("\n", "\n    ").rstrip()
        + "\n    return inner\n\n\nclass C:\n    async def method(self):\n    " +
        body.replace("\n", "\n    ").rstrip() + "\n")
    (tmp_path / "allocator" / "big.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    lengths = {name: n for name, _, n, _ in functions(Path("odma_hw/m.py"))}
    assert lengths == {"outer": MAX_FUNCTION_LINES + 3, "outer.inner": MAX_FUNCTION_LINES + 1,
                       "C.method": MAX_FUNCTION_LINES + 1}
    assert [o.split(" ")[1] for o in long_functions()] == ["outer:", "outer.inner:", "C.method:"]
    assert long_files() == [f"allocator/big.py: {MAX_FILE_LINES + 1} lines"]
