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
    missing = [written for written, path in named_paths(md)
               if not path.resolve().is_relative_to(ROOT) or not path.exists()]
    assert not missing, f"{md.relative_to(ROOT)} names paths that are not in the repository: {missing}"


def test_the_rule_reads_paths(tmp_path):
    # the check can fail: it finds what a page names, suffixes stripped, templates and URLs skipped
    md = tmp_path / "page.md"
    md.write_text("Run `pytest tests/test_docs.py::test_named_paths_exist`, read `irminsul/cli.py:12` and\n"
                  "`irminsul/gone.py`, not `docs/results/<name>.json`; [up](../elsewhere.md), [web](https://x.org).\n"
                  "```\npython benchmarks/soak.py --out runs/soak.json\n```\n")
    found = {written: path.exists() for written, path in named_paths(md)}
    assert found == {"tests/test_docs.py::test_named_paths_exist": True, "irminsul/cli.py:12": True,
                     "irminsul/gone.py": False, "../elsewhere.md": False, "benchmarks/soak.py": True}
