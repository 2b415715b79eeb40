"""The connector's counters, reported the way vLLM reports a KV connector's: in the server's log and at
its /metrics.

The worker counts the rows (one per prompt token, all layers) it wrote into vLLM's cache from the
registry, copied out of the cache into the registry, those of loads it could not serve (recomputed
instead) and those it freed when the registry evicted their chunk. After each step it hands vLLM what
changed since the last (`IrminsulStats`, from the connector's `get_kv_connector_stats`); vLLM's stat
loggers, in the API server's process, sum them, print them once a log interval ("KV Transfer metrics:
loaded_rows=..., saved_rows=..., missed_rows=..., evicted_rows=...") and add them to Prometheus
counters (`IrminsulPromMetrics`: `vllm:irminsul_loaded_rows_total`, ...).
vLLM reports them only where it keeps stats (its server; not an offline `LLM`, which disables them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

COUNTERS = {
    "loaded_rows": "Prompt rows Irminsul's connector wrote into the KV cache from its registry (not computed).",
    "saved_rows": "Computed prompt rows Irminsul's connector copied into its registry.",
    "missed_rows": "Rows of planned loads the worker did not hold (a cache miss: recomputed).",
    "evicted_rows": "Rows Irminsul's connector freed because its registry evicted their chunk.",
}


@dataclass
class IrminsulStats(KVConnectorStats):
    """The counters' increase over an interval (`data`: name -> rows); vLLM sums the workers' and the
    steps' with `aggregate`."""

    def __post_init__(self):
        self.data = {name: int(self.data.get(name, 0)) for name in COUNTERS}

    def reset(self):
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> IrminsulStats:
        for name in COUNTERS:
            self.data[name] += int(other.data.get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class IrminsulPromMetrics(KVConnectorPromMetrics):
    """`vllm:irminsul_<counter>_total` per engine (vLLM's `model_name` and `engine` labels). The `vllm:`
    prefix is what vLLM unregisters before it registers its metrics again in one process."""

    def __init__(
        self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:irminsul_{name}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, doc in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for name, per_engine in self.counters.items():
            if transfer_stats_data.get(name):
                per_engine[engine_idx].inc(transfer_stats_data[name])


def count_as_cached(request, tokens: int) -> None:
    """Add `tokens` loaded rows (negative: take them back, recomputed after a miss) to vLLM's own count
    of a vLLM Request's reused prompt tokens: its `PrefillStats`, behind the OpenAI answer's
    `usage.prompt_tokens_details.cached_tokens`, `RequestOutput.num_cached_tokens` and the
    `vllm:prompt_tokens_cached` and `vllm:prompt_tokens_by_source{source="external_kv_transfer"}`
    counters. vLLM sets it at admission from what the connector's `get_num_new_matched_tokens` answered
    (0 for Irminsul: its loads come later, where the prompt reaches them) and reads it once the request's
    first token is out; as vLLM does, only a first prefill counts (none after a preemption)."""
    prefill = getattr(request, "prefill_stats", None)
    if prefill is None or getattr(request, "num_preemptions", 0) > 0:
        return
    prefill.num_external_cached_tokens += tokens
    prefill.num_cached_tokens += tokens
    prefill.num_computed_tokens -= tokens
