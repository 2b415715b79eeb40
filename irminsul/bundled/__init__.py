"""Checkpoints that ship inside the package (see each folder's MODEL_CARD.md)."""

from pathlib import Path

from irminsul.errors import CheckpointError

ROOT = Path(__file__).parent
NAMES = ("mla", "gqa")


def bundled_model(name: str = "mla") -> Path:
    """Directory of a bundled reference checkpoint: "mla" (DeepSeek-V2 architecture) or "gqa" (its Llama twin)."""
    if name not in NAMES:
        raise CheckpointError(f"no bundled model named {name!r}; choose one of {', '.join(NAMES)}")
    path = ROOT / name
    if not (path / "config.json").exists():
        raise CheckpointError(f"the bundled {name!r} model is not in this installation ({path} has no config.json)")
    return path
