"""Every fenced code block of README.md runs as written.

A block's info string says what it is:
- ```python: run by a fresh interpreter in an empty folder;
- ```sh: run by bash from the repository's root (so ../shared/traces/... resolves), with
  .venv/bin first on PATH, stopping at the first command that fails;
- ```LANG file=NAME: a file the other blocks use, written as NAME where they run;
- ```text: output, not run.
A block that needs a GPU or an MLU (it names cuda: or mlu:) is skipped. A block may be exempted
only with `<!-- not run: REASON -->` on the line before it, and the reason is reported. Any other
block fails: a newcomer copies what the README shows, so nothing in it goes untried by accident.

The shell blocks run in a copy of the repository made of links to its files, so that what they
write (plots, traces, sweep folders) lands in a temporary folder, not in the work tree.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
VENV_BIN = ROOT / ".venv" / "bin"
SHARED = ROOT.parent / "shared"

FENCE = re.compile(r"^```(\S*)\s*(.*)$")
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.*?)\s*-->$")
NEEDS_ACCELERATOR = re.compile(r"\b(cuda|mlu):")
RUN = ("python", "sh")
OUTPUT = ("text",)
# a README command hung on a lock or a prompt must fail the test, not stall the suite
BLOCK_TIMEOUT_S = 600


@dataclasses.dataclass
class Block:
    line: int               # of the opening fence, 1-based
    lang: str
    attrs: dict
    text: str
    not_run: str | None     # the reason given, or None

    @property
    def id(self) -> str:
        return f"README.md:{self.line}-{self.lang or 'untagged'}"


def parse_blocks(markdown: str) -> list[Block]:
    blocks, lines = [], markdown.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        attrs = dict(a.split("=", 1) for a in m.group(2).split() if "=" in a)
        end = start + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"README.md:{start + 1}: code block never closed")
        marker = NOT_RUN.match(lines[start - 1].strip()) if start else None
        blocks.append(Block(start + 1, lang, attrs, "\n".join(lines[start + 1:end]) + "\n",
                            marker.group(1) if marker else None))
        i = end + 1
    return blocks


BLOCKS = parse_blocks(README.read_text())


def _mirror(src: Path, dst: Path, depth: int) -> None:
    """dst holds a link to every entry of src; folders `depth` levels down are real folders (so
    that files written into them stay out of src), deeper ones and hidden ones links."""
    dst.mkdir(parents=True, exist_ok=True)
    for entry in src.iterdir():
        if entry.is_dir() and not entry.is_symlink() and depth > 0 \
                and not entry.name.startswith("."):
            _mirror(entry, dst / entry.name, depth - 1)
        else:
            (dst / entry.name).symlink_to(entry)


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory) -> Path:
    """The repository as links, beside a link to ../shared, in a temporary folder."""
    if not (VENV_BIN / "odma-hw").exists():
        pytest.fail(f"{VENV_BIN / 'odma-hw'} is missing: run `make setup`")
    # `make probe` in the copy would reinstall from the copy, pointing the venv's editable
    # install at a folder about to be deleted: only an up-to-date venv may meet it
    stale = subprocess.run(["make", "-q", ".venv/.installed"], cwd=ROOT,
                           capture_output=True).returncode
    if stale:
        pytest.fail("the venv is older than pyproject.toml, setup.py or native/: run "
                    "`make setup` first")
    base = tmp_path_factory.mktemp("readme")
    _mirror(ROOT, base / ROOT.name, depth=2)
    if SHARED.is_dir():
        (base / "shared").symlink_to(SHARED)
    return base / ROOT.name


@pytest.fixture(scope="module")
def emulator_cache(tmp_path_factory) -> Path:
    """One emulator efficiency cache for every block (computed by the first that needs it)."""
    return tmp_path_factory.mktemp("odma-cache")


def _environment(cache: Path, tmp: Path | None = None) -> dict:
    env = dict(os.environ, ODMA_CACHE_DIR=str(cache),
               PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("VIRTUAL_ENV", None)
    if tmp is not None:
        env["TMPDIR"] = str(tmp)
    return env


def _write_files(cwd: Path) -> None:
    for b in BLOCKS:
        if "file" in b.attrs:
            (cwd / b.attrs["file"]).write_text(b.text)


def _check(block: Block, proc: subprocess.CompletedProcess) -> None:
    if proc.returncode != 0:
        pytest.fail(f"{block.id} exited {proc.returncode}:\n{block.text}\n--- stdout\n"
                    f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}", pytrace=False)


def test_readme_has_code_blocks_to_run():
    assert sum(b.lang in RUN and b.not_run is None for b in BLOCKS) >= 5


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_readme_block_runs_as_written(block, repo_copy, emulator_cache, tmp_path):
    if block.not_run is not None:
        assert block.not_run, f"{block.id}: a block not run must say why"
        pytest.skip(f"{block.id} not run: {block.not_run}")
    if "file" in block.attrs:
        assert "/" not in block.attrs["file"], f"{block.id}: name a file, not a path"
        return       # written where the other blocks run
    if block.lang in OUTPUT:
        return
    assert block.lang in RUN, (
        f"{block.id}: say what this block is: ```python or ```sh (run), ```text (output), "
        f"```LANG file=NAME (a file the others use), or mark it <!-- not run: REASON -->")
    need = NEEDS_ACCELERATOR.search(block.text)
    if need:
        pytest.skip(f"{block.id} needs a {need.group(1).upper()} device")
    if "../shared/" in block.text and not SHARED.is_dir():
        pytest.skip(f"{block.id} reads ../shared/, which this checkout has not: {SHARED}")
    if block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(block.text)
        cwd = tmp_path / "cwd"
        cwd.mkdir()
        _write_files(cwd)
        proc = subprocess.run([sys.executable, str(script)], cwd=cwd, capture_output=True,
                              text=True, env=_environment(emulator_cache, tmp_path),
                              timeout=BLOCK_TIMEOUT_S)
    else:
        _write_files(repo_copy)
        proc = subprocess.run(["bash", "--noprofile", "--norc", "-e", "-o", "pipefail", "-c",
                               block.text], cwd=repo_copy, capture_output=True, text=True,
                              env=_environment(emulator_cache), timeout=BLOCK_TIMEOUT_S)
    _check(block, proc)


def test_a_block_that_fails_fails_its_test(repo_copy, emulator_cache, tmp_path):
    """The runner itself: a README command that fails midway must not pass for the last one."""
    block = Block(1, "sh", {}, "odma-hw simulate --no-such-flag\necho still here\n", None)
    with pytest.raises(pytest.fail.Exception):
        test_readme_block_runs_as_written(block, repo_copy, emulator_cache, tmp_path)


def test_an_untagged_block_is_refused():
    (block,) = parse_blocks("text\n\n```\nodma-hw probe\n```\n")
    with pytest.raises(AssertionError, match="say what this block is"):
        test_readme_block_runs_as_written(block, None, None, None)


def test_a_not_run_marker_exempts_only_the_block_after_it():
    blocks = parse_blocks("<!-- not run: minutes of work -->\n```sh\nmake bench\n```\n\n"
                          "```sh\nodma-hw devices\n```\n")
    assert [b.not_run for b in blocks] == ["minutes of work", None]
