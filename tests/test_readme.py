"""Every fenced code block of README.md and of docs/*.md runs as written, and every relative
link in them points at a file that exists.

A block's info string says what it is:
- ```python: run by a fresh interpreter in an empty folder;
- ```sh: run by bash from the repository's root, whichever page it is on (so
  ../shared/traces/... resolves), with .venv/bin first on PATH, stopping at the first command
  that fails;
- ```LANG file=NAME: a file the other blocks (of any page) use, written as NAME where they run;
- ```text: output, not run.
A block that needs a GPU or an MLU (it names cuda: or mlu:) is skipped. A block may be exempted
only with `<!-- not run: REASON -->` on the line before it, and the reason is reported. Any other
block fails: a newcomer copies what the README shows, so nothing in it goes untried by accident.
A block that repeats another page's block word for word (the README's examples of a command
that docs/ describes) runs once, where it first appears.

The shell blocks run in a copy of the repository made of links to its files, so that what they
write (plots, traces, sweep folders) lands in a temporary folder, not in the work tree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
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
    source: str = "README.md"   # the page, relative to the repository's root
    same_as: str | None = None  # the id of an earlier block with the same text, which runs

    @property
    def id(self) -> str:
        return f"{self.source}:{self.line}-{self.lang or 'untagged'}"


def parse_blocks(markdown: str, source: str = "README.md") -> list[Block]:
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
            raise ValueError(f"{source}:{start + 1}: code block never closed")
        marker = NOT_RUN.match(lines[start - 1].strip()) if start else None
        blocks.append(Block(start + 1, lang, attrs, "\n".join(lines[start + 1:end]) + "\n",
                            marker.group(1) if marker else None, source))
        i = end + 1
    return blocks


def parse_pages(pages: list[Path]) -> list[Block]:
    """Every page's blocks in order; a block that runs and repeats an earlier one word for word
    is marked `same_as` it, so that it runs once."""
    blocks, first = [], {}
    for page in pages:
        for b in parse_blocks(page.read_text(), page.relative_to(ROOT).as_posix()):
            if b.lang in RUN and b.not_run is None and "file" not in b.attrs:
                b.same_as = first.setdefault((b.lang, b.text), b.id)
                if b.same_as == b.id:
                    b.same_as = None
            blocks.append(b)
    return blocks


BLOCKS = parse_pages(PAGES)


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
    runs = [b for b in BLOCKS if b.lang in RUN and b.not_run is None and b.same_as is None]
    assert sum(b.source == "README.md" for b in runs) >= 3
    assert len(runs) >= 10


def test_files_the_blocks_write_have_one_text_each():
    texts = {}
    for b in BLOCKS:
        if "file" in b.attrs:
            assert texts.setdefault(b.attrs["file"], b.text) == b.text, (
                f"{b.id}: another page writes {b.attrs['file']} with other contents")


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_readme_block_runs_as_written(block, repo_copy, emulator_cache, tmp_path):
    if block.not_run is not None:
        assert block.not_run, f"{block.id}: a block not run must say why"
        pytest.skip(f"{block.id} not run: {block.not_run}")
    if block.same_as is not None:
        pytest.skip(f"{block.id} is {block.same_as} word for word, which runs")
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


def test_parse_pages_runs_a_repeated_block_once(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("```sh\nodma-hw devices\n```\n")
    (tmp_path / "docs" / "a.md").write_text("# A\n\n```sh\nodma-hw devices\n```\n")
    readme, doc = parse_pages([tmp_path / "README.md", tmp_path / "docs" / "a.md"])
    assert (readme.same_as, doc.same_as, doc.id) == (None, "README.md:1-sh", "docs/a.md:3-sh")


# --- the README's shape -------------------------------------------------------------------------

def test_readme_is_short_and_shows_the_layout_on_its_first_screen():
    assert len(README.read_bytes()) < 15_000, "README.md is the way in: results go to docs/"
    lines = README.read_text().splitlines()
    assert "## Layout" in lines[:60], "the layout is what a newcomer needs first"


def test_the_ci_runs_the_test_command_the_readme_gives():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip().startswith("make ")]
    assert ci, ".ci/run runs no make target"
    shown = {b.text.split("#")[0].strip() for b in BLOCKS
             if b.source == "README.md" and b.lang == "sh"}
    for command in ci:
        assert command in shown, f".ci/run runs `{command}`, which the README does not give"


# --- links --------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+).*?\1")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(markdown: str):
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    fenced = False
    for n, line in enumerate(markdown.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield n, CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)


def links(markdown: str) -> list[tuple[int, str]]:
    """(line number, target) of every link and image; a link's text may run over lines."""
    lines = markdown.splitlines()
    prose = dict(prose_lines(markdown))
    text = "\n".join(prose.get(n, "") for n in range(1, len(lines) + 1))
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in LINK.finditer(text)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|<[^>]*>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen, out = {}, set()
    for _, line in prose_lines(markdown):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            k = seen.get(base, 0)
            seen[base] = k + 1
            out.add(base if k == 0 else f"{base}-{k}")
    return out


def test_slugs_and_links_parse_as_github_reads_them():
    assert slug("Reading `odma-hw probe`") == "reading-odma-hw-probe"
    assert slug("Where paging wins: the map") == "where-paging-wins-the-map"
    assert slug("The ODMA paper's experiment") == "the-odma-papers-experiment"
    assert links("[a](docs/x.md#y) `[b](no.md)` ![c](p.png)\n```\n[d](e.md)\n```\n[the\n"
                 "map](m.md)\n") == [(1, "docs/x.md#y"), (1, "p.png"), (5, "m.md")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_at_a_file(page):
    text, where = page.read_text(), page.relative_to(ROOT).as_posix()
    bad = []
    for n, target in links(text):
        if SCHEME.match(target):
            continue                  # a web address: not checked here
        path, _, anchor = unquote(target).partition("#")
        dest = (page.parent / path).resolve() if path else page
        if ROOT not in (dest, *dest.parents):
            bad.append(f"{where}:{n}: {target} leaves the repository")
        elif not dest.exists():
            bad.append(f"{where}:{n}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{where}:{n}: {target}: no heading #{anchor} in {dest.name}")
    assert not bad, "\n".join(bad)


def test_every_page_of_docs_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve()
              for _, t in links(README.read_text()) if not SCHEME.match(t)}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"README.md links no page {missing}"


# --- the lists the docs keep: models, cards, emulator presets ------------------------------------

def _section(markdown: str, heading: str) -> str:
    start = markdown.index(f"\n{heading}\n")
    end = markdown.find("\n## ", start + 1)
    return markdown[start:end if end >= 0 else None]


def list_tables(doc: dict) -> str:
    """The README's tables of models and cards, as `odma-hw simulate --list --json` gives them."""
    rows = ["| model | kind | layers | params | KV B/token | max context |",
            "|---|---|---|---|---|---|"]
    for m in doc["models"]:
        kind = f"alias of `{m['alias_of']}`" if m["alias_of"] else m["kind"]
        params = (f"{m['params'] / 1e9:.2f}B" if m["params"] >= 1e8
                  else f"{m['params'] / 1e6:.2f}M")
        rows.append(f"| `{m['name']}` | {kind} | {m['layers']} | {params} | "
                    f"{m['kv_bytes_per_token']} | {m['max_context']} |")
    rows += ["", "| card | GB/s | GB | TFLOPS bf16 | timing |", "|---|---|---|---|---|"]
    for c in doc["cards"]:
        timing = c["timing"]
        if timing.startswith("probe:"):          # a path on this machine: its name is enough
            timing = "probe:" + Path(timing[len("probe:"):]).name
        rows.append(f"| `{c['name']}` | {c['bandwidth_gbps']:g} | {c['capacity_gb']:g} | "
                    f"{c['tflops_bf16']:g} | `{timing}` |")
    return "\n".join(rows)


def test_the_readme_lists_the_models_and_cards_simulate_lists():
    proc = subprocess.run([str(VENV_BIN / "odma-hw"), "simulate", "--list", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    section = _section(README.read_text(), "## Models and cards")
    expected = list_tables(json.loads(proc.stdout))
    for table in expected.split("\n\n"):
        assert table in section, (
            "README.md's tables under '## Models and cards' differ from `odma-hw simulate "
            f"--list --json`; they should read:\n\n{expected}\n")


def test_every_shipped_card_and_config_is_in_the_readme():
    section = _section(README.read_text(), "## Models and cards")
    serving = ROOT / "allocator" / "serving"
    shipped = [p.stem for p in sorted((serving / "cards").glob("*.toml"))]
    shipped += [p.stem for p in sorted((serving / "configs").glob("*.json"))]
    assert shipped
    missing = [name for name in shipped if f"| `{name}` |" not in section]
    assert not missing, f"README.md's '## Models and cards' lacks {missing}"


def test_the_emulator_page_lists_every_preset():
    from odma_hw.emu.specs import PRESETS
    rows = re.findall(r"^\| `([^`]+)` \|", (DOCS / "emulator.md").read_text(), re.M)
    assert sorted(rows) == sorted(PRESETS), (
        f"docs/emulator.md's presets {sorted(rows)} against odma_hw/emu/specs.py's "
        f"{sorted(PRESETS)}")
