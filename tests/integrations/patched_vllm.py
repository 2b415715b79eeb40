"""The installed vLLM with the upstream change applied (`irminsul/integrations/vllm/upstream/scheduler.patch`),
without touching the installed package: the files the patch names are copied to a folder, patched there,
and imported in their place.

`python -m tests.integrations.patched_vllm DIR MODULE [ARGS...]` (from the clone's root) runs
`python -m MODULE ARGS...` with DIR's patched modules in place of the installed ones, Irminsul's
scheduler subclass replaced by vLLM's own `Scheduler` (constructing the subclass raises), and prints
one line `PATCHED {...}` naming the modules loaded from DIR.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

PATCH = Path(__file__).resolve().parents[2] / "irminsul/integrations/vllm/upstream/scheduler.patch"


def patched_files() -> list[str]:
    """The paths the patch changes, relative to site-packages (`vllm/...`)."""
    return re.findall(r"^\+\+\+ b/(\S+)", PATCH.read_text(), re.M)


def apply(dest: Path) -> Path:
    """Copy the installed files the patch names under dest and apply the patch there (`patch`, else
    `git apply`); raises if it does not apply cleanly."""
    import vllm

    site = Path(vllm.__file__).resolve().parents[1]
    for rel in patched_files():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(site / rel, dest / rel)
    if shutil.which("patch"):
        cmd = ["patch", "-p1", "--forward", "--batch", "-i", str(PATCH)]
    else:
        cmd = ["git", "apply", "-p1", str(PATCH)]
    done = subprocess.run(cmd, cwd=dest, capture_output=True, text=True)
    if done.returncode != 0 or re.search(r"\bfuzz\b|offset|FAILED", done.stdout):
        raise RuntimeError(f"the patch does not apply cleanly:\n{done.stdout}{done.stderr}")
    return dest


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the patched modules in a folder before the installed ones."""

    def __init__(self, root: Path):
        self.modules = {rel[:-3].replace("/", "."): root / rel for rel in patched_files()}
        self.loaded: list[str] = []

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.modules:
            return None
        self.loaded.append(fullname)
        return importlib.util.spec_from_file_location(fullname, self.modules[fullname])


def install(root: Path) -> _Finder:
    """Import the patched modules from root from now on (before anything imports them)."""
    finder = _Finder(root)
    assert not set(finder.modules) & set(sys.modules), "install() must run before vLLM is imported"
    sys.meta_path.insert(0, finder)
    return finder


def main() -> int:
    root, module, args = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    finder = install(root)
    import irminsul.integrations.vllm as integration
    from irminsul.integrations.vllm import scheduler

    assert scheduler.HOOKS, "the patched scheduler was not loaded"

    def refuse(self, *a, **k):
        raise AssertionError("IrminsulScheduler constructed: this run is the connector alone")

    scheduler.IrminsulScheduler.__init__ = refuse
    integration.SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"  # (vLLM's own)
    print("PATCHED " + json.dumps({"modules": finder.loaded}), flush=True)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
