"""Comments and docstrings of the serving path carry no measured figures: a time, a rate or a speed-up
measured on one machine, or a CPU's name, is true of that machine on that day and goes stale there.
Such figures live in docs/benchmarks.md beside the command that measured them; a comment says why and
names the benchmark that shows it. (Citations of a paper or a spec sheet in research/ are not checked.)"""

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVING = ("server", "engine", "model", "kvcache", "fleet", "integrations")
FIGURE = re.compile(
    r"\d[\d,.]*\s*(?:ms|us|µs|GB/s|GiB/s|MB/s|GFLOP/s|TFLOP/s|GMAC/s|tok/s|tokens/s)\b"
    r"|\d\.\d+(?:-\d\.\d+)?x\b|\b(?:Xeon|EPYC|Zen ?\d)\b"
)


def comment_lines(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring line of a Python, C or header file."""
    text = path.read_text()
    if path.suffix in (".c", ".h"):
        return [
            (text.count("\n", 0, m.start()) + 1 + i, line)
            for m in re.finditer(r"/\*.*?\*/|//[^\n]*", text, re.S)
            for i, line in enumerate(m.group().splitlines())
        ]
    out = [
        (t.start[0], t.string)
        for t in tokenize.generate_tokens(io.StringIO(text).readline)
        if t.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                out += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return out


def figures(path: Path) -> list[int]:
    return sorted({n for n, line in comment_lines(path) if FIGURE.search(line)})


def test_the_serving_path_keeps_measured_figures_out_of_its_comments():
    bad = [
        f"{p.relative_to(ROOT)}:{n}"
        for area in SERVING
        for p in sorted((ROOT / "irminsul" / area).rglob("*"))
        if p.suffix in (".py", ".c", ".h")
        for n in figures(p)
    ]
    assert not bad, (
        "these comments carry a measured figure or a CPU's name; put the figure in "
        "docs/benchmarks.md with its command and say why here:\n" + "\n".join(bad)
    )


def test_the_check_finds_figures(tmp_path):
    py = tmp_path / "m.py"
    py.write_text(
        '"""Fast: 1,357 us with the copy."""\nx = 3  # 2.5x faster on an AMX Xeon\n'
        'def f():\n    """reads ~36 GB/s"""\n    return "12 ms"  # a string, not a comment\n'
    )
    c = tmp_path / "k.c"
    c.write_text("/* one row\n * ~23 GB/s on a Zen 5 */\nint x = 1; // 4 rows\n")
    assert figures(py) == [1, 2, 4]
    assert figures(c) == [2]
    clean = tmp_path / "n.py"
    clean.write_text('"""Rows of 8 tokens, 2 heads; x [n, 4]."""\ny = 2  # 16 experts, 1e-3 tolerance\n')
    assert figures(clean) == []
