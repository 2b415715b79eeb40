"""The slow tier: tests/slow_tests.txt names the tests that `pytest -m "not slow"` leaves out.

Each entry is a test module (`tests/model/test_parity.py`), a class or function in one
(`tests/server/test_load.py::test_sustained_streams`, every parametrisation of it) or one node id
(`...::test_x[case]`), relative to the clone's root as pytest prints node ids; `#` starts a comment.
tests/conftest.py marks what an entry names with `slow`; tests/test_tiers.py checks that every
entry still names something.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SLOW_LIST = Path(__file__).resolve().parents[1] / "slow_tests.txt"
# entries in a module this session collected that name none of its tests (set by tests/conftest.py)
STALE = pytest.StashKey[list]()


def read_slow_list(path: Path = SLOW_LIST) -> list[str]:
    """The entries of the slow list, in order, comments and blank lines left out."""
    entries = []
    for line in path.read_text().splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            entries.append(entry)
    return entries


def covering(nodeid: str) -> set[str]:
    """Every entry that would name the test `nodeid`: the node itself, its module, and each class
    or function above it (a function's entry covers all its parametrisations)."""
    parts = nodeid.split("[", 1)[0].split("::")
    return {nodeid} | {"::".join(parts[:i]) for i in range(1, len(parts) + 1)}


HEADER = """\
# The slow tier: the tests that `pytest -m "not slow"` (the fast tier) leaves out; tests/conftest.py
# marks them `slow`, tests/test_tiers.py checks that each entry still names a test. An entry is a
# module, a function (all its cases) or one node id, as pytest prints them; tests/support/tiers.py.
#
# Made from measurement, on a 2-core box: each test directory run with
#   python -m pytest -p no:cacheprovider --durations=0 tests/DIR > durations-DIR.txt
# then
#   python -m tests.support.tiers --threshold {threshold:g}{modules} durations-*.txt > tests/slow_tests.txt
# lists every function whose cases took {threshold:g} s or more together (setup and teardown
# included), and a whole module where every measured function in it does{module_note}.
# Remake it the same way when the fast tier takes more than 3 minutes on a 2-core box.
"""


def durations(paths: list[Path]) -> dict[str, float]:
    """Seconds per test function (its cases, setup, call and teardown summed) from the reports of
    `pytest --durations=0`; the most any report gives (a run of the fast tier alone shows the costs
    that move to the first fast test when the slow one before it is left out)."""
    import re

    out: dict[str, float] = {}
    for path in paths:
        report: dict[str, float] = {}
        for line in Path(path).read_text(errors="replace").splitlines():
            m = re.match(r"^([\d.]+)s (?:setup|call|teardown)\s+(tests/\S.*)$", line.strip())
            if m:
                func = m.group(2).split("[", 1)[0]
                report[func] = report.get(func, 0.0) + float(m.group(1))
        for func, seconds in report.items():
            out[func] = max(out.get(func, 0.0), seconds)
    return out


def slow_entries(per_function: dict[str, float], threshold: float, modules: set[str] = frozenset()) -> list[str]:
    """The functions at or above `threshold` seconds; a module instead where all its functions are
    (or where it is in `modules`)."""
    by_module: dict[str, dict[str, float]] = {}
    for func, seconds in per_function.items():
        by_module.setdefault(func.split("::", 1)[0], {})[func] = seconds
    entries = []
    for module in sorted(by_module.keys() | set(modules)):
        funcs = by_module.get(module, {})
        slow = sorted(f for f, s in funcs.items() if s >= threshold)
        if module in modules or (slow and len(slow) == len(funcs)):
            entries.append(module)
        else:
            entries += slow
    return entries


def main(argv: list[str] | None = None) -> int:
    """Print a slow list made from `pytest --durations=0` reports."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m tests.support.tiers", description=main.__doc__)
    p.add_argument("reports", nargs="+", type=Path)
    p.add_argument("--threshold", type=float, required=True, help="seconds per function, cases summed")
    p.add_argument(
        "--module", action="append", default=[], help="list this whole module (a slow module-scoped fixture)"
    )
    args = p.parse_args(argv)
    modules = "".join(f" \\\n#     --module {m}" for m in args.module)
    note = "\n# or where its module-scoped fixture is the slow part (--module)" if args.module else ""
    print(HEADER.format(threshold=args.threshold, modules=modules, module_note=note), end="")
    for entry in slow_entries(durations(args.reports), args.threshold, set(args.module)):
        print(entry)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
