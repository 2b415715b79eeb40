import os
from pathlib import Path

import pytest
import torch

from tests.support.tiers import STALE, covering, read_slow_list

WHOLE = pytest.StashKey[set]()  # the modules the slow list names whole

try:  # (the vLLM step's venv has pytest and not hypothesis: its tests use none)
    from hypothesis import settings
except ImportError:
    settings = None
if settings is not None:
    # No example database in the clone (hypothesis's default, .hypothesis/): a failing example found
    # once would be replayed by every later run there. A failure prints the blob that reproduces it
    # instead (@reproduce_failure), and a test pins what it must always try with @example.
    settings.register_profile("irminsul", database=None, print_blob=True)
    settings.load_profile("irminsul")
    # Hypothesis's other files (its cache of the source's constants, of unicode tables) go to the
    # user's cache too, not to .hypothesis/ in the working directory; HYPOTHESIS_STORAGE_DIRECTORY
    # still chooses.
    if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        from hypothesis.configuration import set_hypothesis_home_dir

        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        set_hypothesis_home_dir(cache / "irminsul" / "hypothesis")

# No GPU: Triton kernels run under Triton's interpreter (read when triton is imported, so set first)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The eager decode path unless a test asks for the compiled step (tests/engine/test_compiled.py
# checks the two agree); compiling it for every model a test builds would take minutes.
os.environ.setdefault("IRMINSUL_COMPILE_DECODE", "0")
# torch's kernels for one-row products unless a test asks for the native one (tests/model/test_gemv.py):
# every model a test packs would otherwise time it against F.linear for each of its shapes
os.environ.setdefault("IRMINSUL_GEMV", "0")

# One thread: on a shared 2-core box, two-thread ops stall on the busy core (~8 ms per op).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A random tiny DeepSeek-V2 checkpoint (MoE, no YaRN), shared by the session."""
    from irminsul.model.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "v2")


# The fast tier, `pytest -m "not slow"`: tests/slow_tests.txt names the slow tests (how it is made
# and remade: its header; the format: tests/support/tiers.py).
@pytest.hookimpl(tryfirst=True)  # (before -m deselects by marker)
def pytest_collection_modifyitems(config, items):
    entries = read_slow_list()
    wanted, matched = set(entries), set()
    for item in items:
        hits = covering(item.nodeid) & wanted
        if hits:
            item.add_marker(pytest.mark.slow)
            matched |= hits
    modules = {item.nodeid.split("::", 1)[0] for item in items}
    config.stash[STALE] = [e for e in entries if e not in matched and e.split("::", 1)[0] in modules]


def pytest_ignore_collect(collection_path, config):
    """Under -m "not slow", a module the slow list names whole is not even imported."""
    if config.option.markexpr.replace(" ", "") != "notslow" or collection_path.suffix != ".py":
        return None
    if WHOLE not in config.stash:
        config.stash[WHOLE] = {e for e in read_slow_list() if "::" not in e}
    try:
        module = collection_path.relative_to(config.rootpath).as_posix()
    except ValueError:
        return None
    return True if module in config.stash[WHOLE] else None
