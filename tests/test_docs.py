"""Every repository path that README.md and docs/*.md name exists.

The rule:
- A path in code (inline backticks or a fenced block) is checked when it starts with one of the
  repository's top-level folders: irminsul/, benchmarks/, tests/, docs/, .ci/. It is read from the
  repository root. A `:line` or `::test` suffix is stripped.
- A path in code that starts with ../ is read from the markdown file's folder, and must stay inside
  the repository.
- A markdown link target that is not a URL or an anchor is read from the file's folder (any
  `#anchor` stripped).
- Templates are skipped: a path holding `<`, `*` or `{` (`docs/results/<name>.json`).
Files that commands write (`--out runs/...`, `am.jsonl`) go under runs/ or the current folder, never
under those top-level folders, so the rule never reads them.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = r"(?:irminsul|benchmarks|tests|docs|\.ci)/"
# a path starts a word (never inside /abs/path or a/b/c) and runs to whitespace or punctuation
PATH = re.compile(rf"(?<![\w./-])((?:{TOP}|\.\./)[^\s`'\"()\[\],;]*)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.S)


def named_paths(md: Path) -> list[tuple[str, Path]]:
    """(the path as written, where it should be) for every path the file names."""
    text = md.read_text()
    code = FENCE.findall(text) + re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    found = []
    for span in code:
        for written in PATH.findall(span):
            if any(c in written for c in "<*{"):
                continue
            path = re.sub(r":\d+(-\d+)?$", "", written.split("::")[0]).rstrip(".:")
            found.append((written, (md.parent if path.startswith("../") else ROOT) / path))
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        found.append((target, md.parent / target.split("#")[0]))
    return found


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(md):
    missing = [
        written for written, path in named_paths(md) if not path.resolve().is_relative_to(ROOT) or not path.exists()
    ]
    assert not missing, f"{md.relative_to(ROOT)} names paths that are not in the repository: {missing}"


def test_the_rule_reads_paths(tmp_path):
    # the check can fail: it finds what a page names, suffixes stripped, templates and URLs skipped
    md = tmp_path / "page.md"
    md.write_text(
        "Run `pytest tests/test_docs.py::test_named_paths_exist`, read `irminsul/cli.py:12` and\n"
        "`irminsul/gone.py`, not `docs/results/<name>.json`; [up](../elsewhere.md), [web](https://x.org).\n"
        "```\npython benchmarks/soak.py --out runs/soak.json\n```\n"
    )
    found = {written: path.exists() for written, path in named_paths(md)}
    assert found == {
        "tests/test_docs.py::test_named_paths_exist": True,
        "irminsul/cli.py:12": True,
        "irminsul/gone.py": False,
        "../elsewhere.md": False,
        "benchmarks/soak.py": True,
    }


# -- the README is a landing page, the docs a user's guide: no lab notebook -----------------------------

README_MAX_LINES = 150
# A commit hash: 40 hex digits anywhere, or 7-12 (holding a digit and a letter) near a word that names a
# revision. A date: YYYY-MM-DD. A machine's path: an absolute path under a home, a workspace or /tmp.
HASH = re.compile(
    r"\b[0-9a-f]{40}\b|(?i:\b(?:commits?|revisions?|rev|HEAD|sha)\b)[^.\n]{0,40}?"
    r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b"
)
DATE = re.compile(r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b")
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|home|root|tmp|Users|mnt|scratch)(?=/|\b)")


def notebook_lines(text: str) -> list[str]:
    """'line N: what' for every commit hash, date and machine path in a page."""
    return [
        f"line {n}: {what}"
        for n, line in enumerate(text.splitlines(), 1)
        for what, rule in (("commit hash", HASH), ("date", DATE), ("machine path", MACHINE_PATH))
        if rule.search(line)
    ]


def test_the_readme_is_a_landing_page():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"
    )


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_lab_notebook(md):
    found = notebook_lines(md.read_text())
    assert not found, (
        f"{md.relative_to(ROOT)} holds dates, commit hashes or one machine's paths (git keeps the "
        f"history; say what is true now and how to reproduce it): {found}"
    )


def test_the_notebook_rule_finds_them():
    page = (
        "measured at commit `a0f9fc9` on the EPYC\nrun on 2026-12-04 at 03:07\n"
        "python x.py --out /tmp/rs/run.json\nmodel /work/main/irminsul/bundled/mla\n"
        "git show 1f825b1e0c2a43f1d6c0a0b1c2d3e4f5a6b7c8d9\n"
    )
    assert notebook_lines(page) == [
        "line 1: commit hash",
        "line 2: date",
        "line 3: machine path",
        "line 4: machine path",
        "line 5: commit hash",
    ]
    fine = (
        "at most 100,000 characters (`a{1000000}`)\nthe commit that adds it, 3 decades\n"
        "read irminsul/model/native/gemv.c and runs/tmp/x\n12–14 minutes, 2.8 GB, x86-64-v3\n"
    )
    assert notebook_lines(fine) == []
