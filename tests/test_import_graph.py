"""The package's imports run one way: no module imports, directly or through others, a module that
imports it back, and no subpackage (server, fleet, engine, kvcache, model, ...) imports one that
imports it back. Every import counts, those inside functions included: a circle closed inside a
function is still two rooms that each need the other."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "irminsul"

# Circles allowed while they are taken apart, each with its reason: an entry is the set of modules
# (or, in KNOWN_PACKAGE_CIRCLES, subpackages) of one strongly connected component. None is left.
KNOWN_MODULE_CIRCLES: dict[frozenset[str], str] = {}
KNOWN_PACKAGE_CIRCLES: dict[frozenset[str], str] = {}


def modules(package: str = PACKAGE) -> dict[str, Path]:
    """Every module of `package`, by dotted name (a package's __init__ under the package's name)."""
    found = {}
    for path in (ROOT / Path(*package.split("."))).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(source: str, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that a module's source imports, anywhere in it. `from a import b`
    imports a.b when that is a module, else a; relative imports are resolved against `name`."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in known:  # `import a.b.c` of a name that is no module: its package
                n = n.rpartition(".")[0]
            if n:
                out.add(n)
    return out - {name}


def module_graph(package: str = PACKAGE) -> dict[str, set[str]]:
    found = modules(package)
    known = set(found)
    return {name: imported(path.read_text(), name, path.name == "__init__.py", known) for name, path in found.items()}


def package_graph(graph: dict[str, set[str]], package: str = PACKAGE) -> dict[str, set[str]]:
    """The module graph folded into the package's subpackages and top-level modules
    (irminsul.server.app -> irminsul.server); the package's own __init__ is left out."""
    depth = package.count(".") + 2

    def room(name: str) -> str:
        return ".".join(name.split(".")[:depth])

    folded: dict[str, set[str]] = {}
    for name, targets in graph.items():
        if name == package:
            continue
        folded.setdefault(room(name), set()).update(room(t) for t in targets if t != package)
    return {k: v - {k} for k, v in folded.items()}


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _describe(found: list[frozenset[str]]) -> list[str]:
    return [" <-> ".join(sorted(c)) for c in found]


def test_the_check_finds_circles_in_functions_and_relative_imports():
    known = {"p", "p.a", "p.b", "p.c", "p.sub", "p.sub.d"}
    assert imported("def f():\n    from p.b import thing\n", "p.a", False, known) == {"p.b"}
    assert imported("from . import b, thing\nfrom .sub.d import x\n", "p.a", False, known) == {"p.b", "p", "p.sub.d"}
    assert imported("from .. import c\n", "p.sub.d", False, known) == {"p.c"}
    assert imported("import p.sub.d.nothing\n", "p.a", False, known) == {"p.sub.d"}
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert circles({"a": {"b"}, "b": set()}) == []
    graph = {"p.x.one": {"p.y.two"}, "p.y.two": {"p.x.three"}, "p.x.three": set()}
    assert circles(package_graph(graph, "p")) == [frozenset({"p.x", "p.y"})]


def test_no_module_imports_one_that_imports_it_back():
    found = circles(module_graph())
    new = [c for c in found if c not in KNOWN_MODULE_CIRCLES]
    assert not new, "import circles between modules:\n" + "\n".join(_describe(new))
    gone = [c for c in KNOWN_MODULE_CIRCLES if c not in found]
    assert not gone, "listed circles that are gone (drop them from the list):\n" + "\n".join(_describe(gone))


def test_no_subpackage_imports_one_that_imports_it_back():
    found = circles(package_graph(module_graph()))
    new = [c for c in found if c not in KNOWN_PACKAGE_CIRCLES]
    assert not new, "import circles between subpackages:\n" + "\n".join(_describe(new))
    gone = [c for c in KNOWN_PACKAGE_CIRCLES if c not in found]
    assert not gone, "listed circles that are gone (drop them from the list):\n" + "\n".join(_describe(gone))


def test_the_server_never_imports_the_fleet():
    """The fleet is an ingress over replicas of the server: it imports the server's modules, never
    the other way round."""
    graph = module_graph()
    bad = [
        f"{m} imports {t}"
        for m, targets in sorted(graph.items())
        if m.startswith(f"{PACKAGE}.server")
        for t in sorted(targets)
        if t.startswith(f"{PACKAGE}.fleet")
    ]
    assert not bad, "\n".join(bad)
