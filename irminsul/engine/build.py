"""The one way to build an engine: `build_engine(config, model, tokenizer)` sizes its latent pool
(or shares another engine's) and wires the KV manager, the model runner and the scheduler."""

from __future__ import annotations

import math
import os

import torch

from irminsul.engine.config import EngineConfig
from irminsul.engine.engine import Engine
from irminsul.errors import RequestError
from irminsul.kvcache.pool import LatentPool
from irminsul.kvcache.registry import ChunkStore
from irminsul.model.tokenizer import Tokenizer

DEFAULT_KV_CACHE_GIB = 1.0  # on the CPU (committed lazily, as rows are written)
GPU_MEMORY_SHARE = 0.85  # on a GPU: this share of the memory free once the weights are loaded


def default_kv_cache_gib(device) -> float:
    """The pool's default size: 1 GiB on the CPU; on a CUDA device, most of its free memory (as
    vLLM's gpu_memory_utilization; the rest is left to activations)."""
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT_KV_CACHE_GIB
    free, _ = torch.cuda.mem_get_info(device)
    return GPU_MEMORY_SHARE * free / 2**30


def memory_bytes(device) -> float:
    """The memory a pool on this device could at most take: the GPU's, or the machine's RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # (no sysconf: not checked)
        return math.inf


def build_pool(config: EngineConfig, model) -> LatentPool:
    """A latent pool of `config.kv_cache_gib` GiB (the device's default if None) for the model."""
    gib = default_kv_cache_gib(model.device) if config.kv_cache_gib is None else config.kv_cache_gib
    if gib * 2**30 > (total := memory_bytes(model.device)):
        raise RequestError(
            f"kv_cache_gib={config.kv_cache_gib!r} is more than the {total / 2**30:.0f} GiB of memory "
            f"{'this GPU' if torch.device(model.device).type == 'cuda' else 'this machine'} has"
        )
    return LatentPool.sized(model.config, int(gib * 2**30), model.dtype, model.device)


def build_engine(
    config: EngineConfig,
    model,
    tokenizer: Tokenizer,
    pool: LatentPool | None = None,
    registry: ChunkStore | None = None,
) -> Engine:
    """An engine over a loaded model. `pool`: share another engine's (engines over the same
    weights, each with its own cache, as the evaluations compare strategies; `kv_cache_gib` is then
    unused). `registry`: the content registry its cache runs over (the store's tiers); an
    in-memory one by default."""
    return Engine(model, tokenizer, config, build_pool(config, model) if pool is None else pool, registry)
