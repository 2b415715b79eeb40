"""Load an HF-format checkpoint directory: config.json + *.safetensors (+ index) + tokenizer.json."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from irminsul.errors import CheckpointError, RequestError
from irminsul.model.config import read_json_config
from irminsul.model.registry import model_class
from irminsul.model.settings import Settings

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype={dtype!r} is not supported; use one of {sorted(set(DTYPES))}")
    return DTYPES[dtype]


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is corrupt ({e!r}); re-download or re-save the checkpoint") from None
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise CheckpointError(f"{path}: shard(s) listed in the index are missing: {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} holds no *.safetensors weights")
    return files


def read_tensors(files: list[Path], num_layers: int) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key.endswith("weight_scale_inv"):
                        raise CheckpointError(
                            f"{file.name}: {key} is an FP8 block-scale; dequantise the checkpoint to bf16 first"
                        )
                    m = _LAYER.match(key)
                    if m and int(m.group(1)) >= num_layers:
                        continue  # multi-token-prediction layers (V3) are not used for serving
                    tensors[key] = f.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{file} is not a readable safetensors file ({e}); it may be truncated") from None
    return _unfuse_experts(tensors)


def owned(read: torch.Tensor, converted: torch.Tensor) -> torch.Tensor:
    """`converted` (a tensor `read_tensors` read, after `.to(device, dtype)`), in memory of its own:
    where `.to` changed nothing it returned the read tensor, a view into the file's mapping (safe_open
    maps the file), and there a weight can be read much slower than a copy of it (a bf16 tensor's data
    may sit off a cache line in the file). The copy is aligned, and the mapping is released."""
    return converted.clone() if converted.data_ptr() == read.data_ptr() else converted


def _unfuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accept HF's in-memory fused expert layout ([E, 2*I, H] gate_up, [E, H, I] down) too."""
    for key in [k for k in tensors if _FUSED.match(k)]:
        prefix, kind = _FUSED.match(key).groups()
        fused = tensors.pop(key)
        for e in range(fused.shape[0]):
            if kind == "gate_up_proj":
                gate, up = fused[e].chunk(2, dim=0)
                tensors[f"{prefix}.{e}.gate_proj.weight"] = gate
                tensors[f"{prefix}.{e}.up_proj.weight"] = up
            else:
                tensors[f"{prefix}.{e}.down_proj.weight"] = fused[e]
    return tensors


def check_device(device) -> None:
    """A device this torch can run on, else a RequestError that says why."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise RequestError(f"device={device!r} is not a device torch knows; use cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RequestError(f"device={device!r}, but this torch ({torch.__version__}) sees no CUDA GPU")
    if dev.type not in ("cpu", "cuda"):
        raise RequestError(f"device={device!r}: Irminsul runs on cpu or cuda")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise RequestError(f"device={device!r}, but there are {torch.cuda.device_count()} CUDA devices")


def read_config(path: Path) -> dict:
    """The checkpoint's config.json as a dict, else a ConfigError that says what is wrong with it."""
    return read_json_config(path / "config.json")


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    pack: bool = True,
    settings: Settings | None = None,
):
    """The checkpoint as the class its model_type is registered to (registry.py), a `base.Model`;
    `pack`: lay its weights out for inference where the family does (`DeepseekModel.pack`);
    `settings`: the switches it runs by (model/settings.py; default the environment's, read now)."""
    path = Path(path)
    if not path.is_dir():
        text = str(path)
        if not path.is_absolute() and len(path.parts) == 2 and not text.startswith("."):  # "org/name": a Hub id
            raise CheckpointError(
                f"checkpoint directory {text} does not exist; --model / LLM(model) reads a local "
                f"checkpoint directory, not a model hub id: download it first (e.g. `huggingface-cli "
                f"download {text} --local-dir DIR`) and give DIR"
            )
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    check_device(device)
    family = model_class(read_config(path).get("model_type"))
    return family.load(path, dtype=dtype, device=device, pack=pack, settings=settings)
