"""The documentation runs: every ```python block of README.md and docs/*.md is executed, so none drifts from the code.

The blocks of one page run in order, in one namespace, in an empty directory of their own (a page's first blocks make
what its later ones read, as a reader following it would). A block that cannot run on its own is preceded by

    <!-- doc-test: skip (why; covered by tests/test_file.py::test_name) -->

naming the test that does what it shows; that test must exist. Bash blocks are not run, but every ``dcp-zarr``
command line in them must parse with the CLI's own parser, and every ``dcp-zarr X`` named in the text must be a
subcommand. Relative links between the pages must point at files (and headings) that exist.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*PAGES, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "benchmarks").rglob("*.md"))]

FENCE = re.compile(r"^```(\S*)\s*$")
SKIP = re.compile(r"^<!-- doc-test: skip \((?P<why>[^;]+); covered by (?P<file>tests/[\w/]+\.py)::(?P<test>\w+)\) -->$")
MARKER = re.compile(r"<!--\s*doc-test")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: re.Match | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    found, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{page.relative_to(ROOT)}:{start + 1}: a code block is never closed"
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        found.append(Block(page, start + 1, fence.group(1), "\n".join(body) + "\n", SKIP.match(before.strip())))
        i += 1
    return found


def python_blocks(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.lang == "python"]


PAGES_WITH_PYTHON = [p for p in PAGES if python_blocks(p)]


# -- what some pages need around their blocks ---------------------------------------------------------------------


@pytest.fixture
def loopback_s3(monkeypatch):
    """docs/object-stores.md talks to "my-bucket" with credentials found as s3fs and obstore find them: here a
    loopback S3 server, named by the environment variables those clients read."""
    from tests.support.s3 import CREDENTIALS, S3Server

    server = S3Server()
    server.make_bucket("my-bucket")
    for name, value in {"S3_ENDPOINT_URL": server.endpoint, "AWS_ENDPOINT_URL": server.endpoint,
                        "AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": CREDENTIALS["key"],
                        "AWS_SECRET_ACCESS_KEY": CREDENTIALS["secret"], "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    yield server
    server.stop()


PAGE_FIXTURES = {"object-stores.md": "loopback_s3"}


# The pages of dcp_zarr.integrations: each imports its framework (seconds), so they run with the framework tests.
FRAMEWORK_PAGES = {"torchtitan.md", "lightning.md", "accelerate.md"}


def _page_param(page):
    """object-stores.md runs against the loopback S3 server, the framework pages import their frameworks: marked so
    that -m selections know it."""
    marks = [pytest.mark.s3, pytest.mark.slow] if PAGE_FIXTURES.get(page.name) == "loopback_s3" else []
    if page.name in FRAMEWORK_PAGES:
        marks = [pytest.mark.frameworks, pytest.mark.slow]
    return pytest.param(page, marks=marks, id=str(page.relative_to(ROOT)))


@pytest.mark.parametrize("page", [_page_param(p) for p in PAGES_WITH_PYTHON])
def test_every_python_block_of_the_page_runs(page, tmp_path, monkeypatch, request):
    if page.name in PAGE_FIXTURES:
        request.getfixturevalue(PAGE_FIXTURES[page.name])
    monkeypatch.chdir(tmp_path)
    # A page's blocks may set environment variables (accelerate's Accelerator does): undone after the page.
    environment = dict(os.environ)
    request.addfinalizer(lambda: (os.environ.clear(), os.environ.update(environment)))
    namespace: dict = {"__name__": "__doc_test__"}
    ran = 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|unavailable|not initialized).*")
        for block in python_blocks(page):
            if block.skip:
                continue
            try:
                exec(compile(block.code, block.where, "exec"), namespace)
            except KeyboardInterrupt:
                raise
            except BaseException:  # DCP's CheckpointException is a BaseException; SystemExit is a failure too
                pytest.fail(f"the python block at {block.where} raised:\n{traceback.format_exc()}", pytrace=False)
            ran += 1
    assert ran, f"{page.relative_to(ROOT)}: every python block is skipped"


# The modules of dcp_zarr that zarr-python imports itself, through the entry points of dcp_zarr's data types
ZARR_ENTRY_POINT_MODULES = {"dcp_zarr", "dcp_zarr.errors", "dcp_zarr.version", "dcp_zarr.format",
                            "dcp_zarr.format.zarr_dtypes", "dcp_zarr.format.dtype_table"}


def test_the_cli_page_reads_a_training_checkpoint_with_zarr_python_alone(tmp_path, monkeypatch):
    """docs/offline-and-cli.md's read_with_zarr.py, run where torch cannot be imported, against the checkpoint the
    page's first block saves: tensors, a trainer's values and a dataloader's bytes, with zarr-python alone."""
    setup, *rest = python_blocks(ROOT / "docs" / "offline-and-cli.md")
    alone = next(block for block in rest if block.code.startswith("# read_with_zarr.py"))
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|unavailable|not initialized).*")
        exec(compile(setup.code, setup.where, "exec"), {"__name__": "__doc_test__"})

    script = ("import sys\nsys.modules['torch'] = None  # `import torch` raises\n" + alone.code
              + "print(sorted(m for m in sys.modules if m.startswith('dcp_zarr')))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)

    assert done.returncode == 0, f"{alone.where}:\n{done.stderr}"
    assert set(ast.literal_eval(done.stdout.splitlines()[-1])) <= ZARR_ENTRY_POINT_MODULES


def test_each_skipped_block_names_a_test_that_exists():
    skipped = [b for p in PAGES for b in python_blocks(p) if b.skip]
    for block in skipped:
        test_file = ROOT / block.skip["file"]
        assert test_file.is_file(), f"{block.where}: {block.skip['file']} does not exist"
        assert re.search(rf"^\s*def {block.skip['test']}\(", test_file.read_text(), re.M), (
            f"{block.where}: {block.skip['file']} has no test {block.skip['test']}")
    assert len(skipped) <= 3, f"keep skips few: {[b.where for b in skipped]}"


def test_every_marker_and_fence_is_one_the_test_understands():
    """A misspelt marker would silently run (or a ```py fence silently not run) what the page meant otherwise."""
    for page in PAGES:
        text = page.read_text().splitlines()
        for number, line in enumerate(text, 1):
            if MARKER.search(line):
                assert SKIP.match(line.strip()), f"{page.relative_to(ROOT)}:{number}: malformed doc-test marker"
        for block in blocks(page):
            assert block.lang not in {"py", "python3", "pycon", "ipython", "Python"}, (
                f"{block.where}: write ```python so the block is run")
            if block.skip:
                assert block.lang == "python", f"{block.where}: a skip marker before a block that is never run"


# -- the dcp-zarr commands the pages show ------------------------------------------------------------------------


def _cli_parser():
    from dcp_zarr.tools import cli

    return cli._parser()


def _subcommands() -> set[str]:
    import argparse

    parser = _cli_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(action.choices)


def _command_lines(block: Block):
    """Each shell line of a bash block, with ``\\`` continuations joined and comments dropped."""
    joined = block.code.replace("\\\n", " ")
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] == "$":
            words = words[1:]
        if words:
            yield words


def _cli_argv(words: list[str]) -> list[str] | None:
    if words[0] == "dcp-zarr":
        return words[1:]
    if words[:3] in (["python", "-m", "dcp_zarr"], ["python3", "-m", "dcp_zarr"]):
        return words[3:]
    return None


def test_every_dcp_zarr_command_line_in_a_bash_block_parses():
    parser, checked = _cli_parser(), 0
    for page in LINKED:
        if not page.is_file():
            continue
        for block in blocks(page):
            if block.lang not in {"bash", "sh", "console"}:
                continue
            for words in _command_lines(block):
                argv = _cli_argv(words)
                if argv is None:
                    continue
                try:
                    parser.parse_args(argv)
                except SystemExit as exit_:
                    pytest.fail(f"{block.where}: {shlex.join(words)!r} does not parse (exit status {exit_.code})")
                checked += 1
    assert checked >= 10  # the CLI page alone shows more; fewer means this test stopped finding them


def test_every_dcp_zarr_subcommand_named_in_the_text_exists():
    """Inline code such as `dcp-zarr prune ROOT --keep-last N` names a subcommand that exists."""
    known, named = _subcommands(), 0
    for page in LINKED:
        if not page.is_file():
            continue
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for span in re.findall(r"`([^`]+)`", line):
                match = re.match(r"(?:dcp-zarr|python -m dcp_zarr) ([a-z][a-z-]*)", span)
                if not match:
                    continue
                named += 1
                assert match.group(1) in known, (
                    f"{page.relative_to(ROOT)}:{number}: 'dcp-zarr {match.group(1)}' is not a subcommand "
                    f"({', '.join(sorted(known))})")
    assert named >= 5


# -- links --------------------------------------------------------------------------------------------------------


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    found, in_code = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_relative_links_point_at_files_and_headings_that_exist():
    checked = 0
    for page in LINKED:
        if not page.is_file():
            continue
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            assert resolved.exists(), f"{page.relative_to(ROOT)}: link {target!r}: no such file"
            if anchor and resolved.suffix == ".md":
                assert anchor in _anchors(resolved), f"{page.relative_to(ROOT)}: link {target!r}: no such heading"
            checked += 1
    assert checked >= 20


# -- the front door -----------------------------------------------------------------------------------------------


def test_the_readme_is_a_front_door_with_its_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    # .ci/run runs the first bash block's two lines as written (install and example, then the tests)
    first_block = text.split("```bash\n", 1)[1].split("\n```", 1)[0].splitlines()
    assert len(first_block) == 2, first_block
    install, tests = first_block
    assert install.startswith("python3 -m venv .venv && . .venv/bin/activate && ") and install.endswith(
        ' && pip install -e ".[test]" && bash examples/demo.sh'), install
    assert tests == "python -m pytest -q"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install in ci and tests in ci, ".ci/run must run README's two commands exactly as README shows them"
    assert os.path.isfile(ROOT / "examples" / "demo.sh")
