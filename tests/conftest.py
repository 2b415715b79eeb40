
import os

import pytest
import torch

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
