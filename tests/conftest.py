import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A random tiny DeepSeek-V2 checkpoint (MoE, no YaRN), shared by the session."""
    from irminsul.model.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "v2")
