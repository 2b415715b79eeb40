"""The slow list (tests/slow_tests.txt) cannot rot: every entry names a test that exists."""

import ast
from pathlib import Path

import pytest

from tests.support.tiers import SLOW_LIST, STALE, covering, read_slow_list

ROOT = Path(__file__).resolve().parent.parent


def _defined(module: Path) -> dict[str, set[str]]:
    """A test module's top-level functions (no members) and classes (their methods)."""
    out = {}
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            out[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    return out


def _missing(entry: str) -> str | None:
    """Why `entry` names nothing, read from the source (parametrisations are not checked here)."""
    module, *names = entry.split("[", 1)[0].split("::")
    path = ROOT / module
    if not (module.startswith("tests/") and module.endswith(".py") and path.is_file()):
        return f"{module}: no such test module"
    if not names:
        return None
    defined = _defined(path)
    if names[0] not in defined:
        return f"{module}: no {names[0]}"
    if len(names) > 1 and (len(names) > 2 or names[1] not in defined[names[0]]):
        return f"{module}: no {'::'.join(names)}"
    return None


def test_every_entry_names_a_test_in_the_source():
    entries = read_slow_list()
    assert entries, f"{SLOW_LIST} is empty"
    missing = [why for why in map(_missing, entries) if why]
    assert not missing, f"{SLOW_LIST.name} names tests that are gone (remove or rename them): {missing}"
    duplicates = sorted({e for e in entries if entries.count(e) > 1})
    assert not duplicates, f"{SLOW_LIST.name} lists some entries twice: {duplicates}"


def test_every_entry_names_a_collected_test(request):
    """Against this session's collection, parametrisations included: an entry in a module collected
    here names at least one of its tests. Whole modules only: with -k or a node id on the command
    line a module is collected in part."""
    if request.config.option.keyword or any("::" in a for a in request.config.args):
        pytest.skip("part of a module collected")
    stale = request.config.stash.get(STALE, [])
    assert not stale, f"{SLOW_LIST.name} entries that name no collected test: {stale}"


def test_an_entry_covers_its_module_function_and_parametrisations():
    node = "tests/model/test_x.py::TestA::test_b[1-2]"
    assert covering(node) == {
        node,
        "tests/model/test_x.py",
        "tests/model/test_x.py::TestA",
        "tests/model/test_x.py::TestA::test_b",
    }
