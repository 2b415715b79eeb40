"""The connector's store tiers: Irminsul's disk and Redis tiers under the connector's registry.

`kv_connector_extra_config` option `"stores"` (a list, or one spec): `disk:PATH` and
`redis://host:port/db`, the specs of `irminsul serve --store`, opened by the same `open_registry`
with the same options (`disk_gib`, `redis_ttl_s`, `redis_timeout_s`: `--disk-budget`,
`--redis-ttl`, `--redis-timeout`) and the same store secret (`IRMINSUL_STORE_SECRET` in the
environment, as for `irminsul serve`; never in the extra config, which vLLM logs). The memory tier
is the connector's registry (`registry_gib`).

What the tiers keep, and the checks, are the server's: one codec blob per chunk (its rows, token ids,
base position, the writer's namespace) under a keyed MAC; every read is verified and compared (token
ids and namespace), so a chunk saved under one tenant or cache_salt is never loaded for another, and
a damaged or forged entry is dropped and recomputed. Entries are keyed by the checkpoint's identity
(`rows_model_id`: its config and weights' bytes, the cache dtype and vLLM's row layout) and the
secret's id, so another model, another layout or another secret never reads them. A tier that fails
is a miss or a skipped write, never an error (the tiered registry's rules).

Where the connector differs from Irminsul's engine: the engine registers a chunk once its rows are
in its pool, the connector registers it the step it is scheduled, before the worker has computed
its rows. So `ConnectorTiers.put` fills the memory tier alone, and `spill` writes an entry down to
the lower tiers once the worker has sent its rows back (spans.SpanIndex.spill). Nothing here
imports vLLM.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import xxhash

from irminsul.kvcache.registry import Entry
from irminsul.kvcache.store import RowLayout, StoreConfig, open_registry
from irminsul.kvcache.store.tiered import TieredRegistry

log = logging.getLogger("vllm.irminsul")

ROWS = "vllm-mla-rows-v1"  # vLLM's MLA cache rows: [c_KV | k_pe], k_pe rotated at the source positions
SECRET_ENV = "IRMINSUL_STORE_SECRET"


class ConnectorTiers(TieredRegistry):
    """Irminsul's tiered registry whose memory tier names the worker's keys: a chunk registered
    (`put`) enters the memory tier only; its rows go down to the lower tiers with `spill`, once the
    worker has copied them out. Lookups, promotion (`bind`), verification and failure handling are
    the tiered registry's own."""

    def put(self, entry: Entry) -> bool:
        return self.memory.put(entry)

    def spill(self, entry: Entry) -> None:
        """Write an entry holding its rows to every lower tier, on the tiered registry's writer thread
        (a full queue drops it, counted)."""
        self.write_lower(entry)


def store_specs(extra: dict) -> tuple[str, ...]:
    """The lower tiers the extra config names (empty: the registry is memory only)."""
    stores = extra.get("stores") or ()
    specs = (stores,) if isinstance(stores, str) else tuple(stores)
    return tuple(str(s) for s in specs if s != "memory")


def store_config(extra: dict, memory_bytes: int) -> StoreConfig:
    """The server's StoreConfig from the extra config (validated as `--store` is)."""
    disk_gib = float(extra.get("disk_gib", StoreConfig().disk_bytes / 2**30))
    ttl = extra.get("redis_ttl_s")
    config = StoreConfig(
        ("memory", *store_specs(extra)),
        memory_bytes=memory_bytes,
        disk_bytes=int(disk_gib * 2**30),
        redis_ttl_s=None if ttl is None else int(ttl),
        redis_timeout_s=float(extra.get("redis_timeout_s", StoreConfig().redis_timeout_s)),
    )
    if config.disk_path and config.disk_bytes < 1:
        raise ValueError(f"disk_gib {disk_gib} holds nothing; give it a size, or drop the disk tier")
    return config


def rows_model_id(model: str, dtype: torch.dtype, revision: str | None = None) -> str:
    """The identity the tiers key entries by: the checkpoint's (its config and weight files' bytes,
    irminsul.model.identity) in `dtype` (the KV cache's), and vLLM's row layout. Two replicas of one
    checkpoint agree wherever their copies lie; any other checkpoint, dtype or layout differs."""
    from irminsul.model.identity import checkpoint_id

    path = Path(model)
    if not (path / "config.json").exists():  # a hub name: the snapshot vLLM downloaded
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(model, revision=revision, local_files_only=True))
    dtype_name = str(dtype).removeprefix("torch.")
    return xxhash.xxh64(f"{checkpoint_id(path, dtype_name)};{ROWS}".encode()).hexdigest()


def open_tiers(
    extra: dict, model_id: str, n_layers: int, row_width: int, dtype: torch.dtype, memory_bytes: int
) -> ConnectorTiers | None:
    """The registry over the tiers `extra` names (None when it names none)."""
    config = store_config(extra, memory_bytes)
    layout = RowLayout(model_id, n_layers, row_width, dtype, "cpu", os.environ.get(SECRET_ENV, "").encode())
    opened = open_registry(config, layout, memory_bytes=memory_bytes)
    if not isinstance(opened, TieredRegistry):
        return None
    tiers = ConnectorTiers(opened.memory, opened.lower)
    where = [f"disk:{config.disk_path}" if t.key_prefix is None else t.location for t in tiers.lower]
    log.info(
        "irminsul: store tiers under the registry: %s (entries keyed by %s:%s)",
        ", ".join(where),
        model_id,
        layout.key_id,
    )
    if not layout.secret:
        log.warning(
            "irminsul: %s is not set: the store tiers' MACs check integrity, not who wrote an entry; "
            "set it (the same on every replica) where others can write the disk or Redis",
            SECRET_ENV,
        )
    for tier in tiers.lower:
        if not tier.available:  # (it reconnects by itself; say so once)
            log.warning("irminsul: the store tier %s does not answer; serving without it until it does", tier.location)
    return tiers
