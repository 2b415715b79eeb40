"""Checkpoint helpers shared by tests."""

import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file


def rows_reversed_copy(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint whose kv_a_proj_with_mqa matrix has its rows in reverse order: the same
    files, names and sizes, other weights (so other cached rows)."""
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    weights = load_file(path)
    key = next(k for k in weights if k.endswith("kv_a_proj_with_mqa.weight"))
    weights[key] = weights[key].flip(0)
    save_file(weights, path, metadata=meta)
    return dst
