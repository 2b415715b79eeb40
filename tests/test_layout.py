"""The serving path (server, engine, model, kvcache, fleet, integrations) imports no research code: `irminsul.research` (trace
building, the fidelity study, training the reference models) is a tool over the engine, never a
part of it. Every import is checked, those inside functions included."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVING = ("server", "engine", "model", "kvcache", "fleet", "integrations")
RESEARCH = ("irminsul.research", "irminsul.workloads", "irminsul.eval", "irminsul.train")


def research_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of research code in a module's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from irminsul import research` names the package in the alias
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if any(n == r or n.startswith(r + ".") for r in RESEARCH)][:1]
    return sorted(found)


def test_the_serving_path_imports_no_research_code():
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for area in SERVING
        for path in sorted((ROOT / "irminsul" / area).rglob("*.py"))
        for line, name in research_imports(path.read_text())
    ]
    assert not bad, "the serving path imports research code:\n" + "\n".join(bad)


def test_the_check_finds_every_form_of_import():
    source = (
        "import json\nfrom irminsul.model import chat_format\n"
        "def f():\n    from irminsul.research.workloads.trace import read_trace\n"
        "import irminsul.train.data\nfrom irminsul import research\nfrom irminsul.evaluation import x\n"
    )
    assert research_imports(source) == [
        (4, "irminsul.research.workloads.trace"),
        (5, "irminsul.train.data"),
        (6, "irminsul.research"),
    ]


# A comment, docstring or doc that needs the tracker to be understood: "issue 30", "stop 12", "(#41)".
TRACKER = re.compile(r"\b[Ii]ssues? #?\d+|\b[Ss]tops? \d+\b|\(#\d+\)|found by probing")


def tracker_references(text: str) -> list[int]:
    return [n for n, line in enumerate(text.splitlines(), 1) if TRACKER.search(line)]


def test_comments_and_docs_stand_without_the_tracker():
    files = [
        p
        for area in ("irminsul", "tests", "benchmarks", "docs")
        for p in sorted((ROOT / area).rglob("*"))
        if p.suffix in (".py", ".md", ".sh") and "data" not in p.relative_to(ROOT).parts
    ]
    files += [ROOT / "README.md", ROOT / ".ci" / "run", ROOT / "pyproject.toml"]
    bad = [
        f"{p.relative_to(ROOT)}:{n}" for p in files if p != Path(__file__) for n in tracker_references(p.read_text())
    ]
    assert not bad, "these lines name the tracker's history; say what the code does instead:\n" + "\n".join(bad)


def test_the_tracker_check_finds_references():
    assert tracker_references("a\n# see issue 30\nb (#12)\nIssue #4\nstop 23 landed\nissues 3") == [2, 3, 4, 5, 6]
    assert tracker_references("stop tokens\n3 stops\nissued 30 requests\nthe stop 'x'") == []


def _module_imports(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (inside functions too), for every module in it."""
    folder = ROOT / Path(*package.split("."))
    modules = {}
    for path in folder.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {n for n in names if n in modules and n != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    circles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return circles


def test_the_model_layer_has_no_import_circles():
    """Each module of irminsul.model imports only what sits below it (a package's __init__ counts as
    a module); an import inside a function counts as much as one at the top."""
    assert _circles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]  # (the check finds one)
    assert _circles(_module_imports("irminsul.model")) == []


def test_the_model_layer_reads_the_environment_only_in_its_settings():
    """Every switch of irminsul.model is named in model/settings.py (its table says what each does)."""
    reads = re.compile(r"os\.environ|os\.getenv|getenv\(")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "irminsul" / "model").rglob("*.py"))
        if path.name != "settings.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if reads.search(line)
    ]
    assert found == []
    table = (ROOT / "irminsul" / "model" / "settings.py").read_text()
    for name in re.findall(r'_Variable\("(\w+)"', table):
        assert f"| {name} |" in table, f"{name} is read but not in the settings' table"


def _imports(source: str) -> set[str]:
    """Every module a source imports (inside functions too), as written: `from a.b import c` gives a.b."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


ABOVE_THE_CACHE = ("irminsul.engine", "irminsul.server", "irminsul.fleet", "irminsul.integrations")


def _upward(source: str) -> set[str]:
    submodule = tuple(f"{p}." for p in ABOVE_THE_CACHE)
    return {m for m in _imports(source) if m in ABOVE_THE_CACHE or m.startswith(submodule)}


def test_the_cache_layer_imports_nothing_above_it():
    """No module of irminsul.kvcache imports the engine, the server, the fleet or the integrations:
    data flows server -> engine -> cache -> model, and the KV manager hands the scheduler values
    (an admission, fresh slots) instead of writing into its sequences."""
    assert _upward(
        "def f():\n    from irminsul.engine.sequence import Sequence\nimport irminsul.server\n"
        "import irminsul.kvcache.pool\n"
    ) == {"irminsul.engine.sequence", "irminsul.server"}
    found = {
        str(path.relative_to(ROOT)): sorted(up)
        for path in sorted((ROOT / "irminsul" / "kvcache").rglob("*.py"))
        if (up := _upward(path.read_text()))
    }
    assert found == {}
