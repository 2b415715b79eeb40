"""`IrminsulConnector`: a vLLM v1 KV connector that loads a prompt's reused chunks at any position.

vLLM asks a connector once per request, at admission, how many tokens *after* its local prefix hit it
can load (`get_num_new_matched_tokens`); a document moved behind a new header is never there. So this
connector does two jobs and the scheduler the third:

- scheduler side: at admission, plan the prompt with Irminsul's planner (`spans.SpanIndex`: CDC
  chunks, verified registry, S1 windows, sink carve-out) and keep the plan; each step, say in the
  metadata which rows to load into which slots (with their RoPE shift δ) and which computed chunks to
  copy out of the cache into the row store; forget a plan when its request finishes;
- worker side: hold the rows (`[layers, len, kv_lora_rank + rope_dim]`, `k_pe` as vLLM stores it:
  rotated at the chunk's source positions) under the key each registration gets, write loads into
  vLLM's MLA cache before the forward (`c_KV` copied, `k_pe` rotated by δ), copy saves out after it,
  then free the rows of the keys dropped. A load whose rows the worker lacks is a miss, never an
  error: its blocks are reported to vLLM, which recomputes the request from the first of them, and
  the scheduler side stops planning that entry;
- the scheduler asks two hooks on the running path: `get_max_num_new_tokens` (a prefill chunk stops
  where a loaded span begins) and `get_num_new_matched_tokens_running` (at that boundary, the request's
  `num_computed_tokens` moves over the span, its blocks allocated with the next chunk). A vLLM with the
  upstream change (`upstream/scheduler.patch`, docs/vllm-upstream.md) asks them itself; on a stock
  vLLM, `IrminsulScheduler` (scheduler.py) does.

Tenants: a request's `cache_salt` subdivides the connector's tenant (`kv_connector_extra_config`
"tenant", default ""), as Irminsul's own server subdivides an API key's; a request without one is the
tenant itself. Each searches its own namespace, then the operator's shared one (`SHARED`), which a
request fills when its `cache_salt` is the operator's secret `publish_salt` (extra config; unset, no
request can publish).

Store tiers (tiers.py): with `"stores": ["disk:PATH", "redis://host:port/db"]` in the extra config, the
registry is the memory tier of Irminsul's tiered store, as in Irminsul's own server. The worker sends
the rows it saved back to the scheduler side, which writes them down to the disk and Redis tiers in
the background; a plan's chunk that memory lacks is looked up there (verified: MAC, token ids,
namespace), brought into memory under a new key, and its rows ride to the worker in the next step's
metadata. A vLLM restarted on the same disk, or replicas sharing one Redis, load each other's chunks.

A fleet: with `"journal_socket": PATH` in the extra config, the scheduler side answers for its registry's
journal (the chunks it holds, as changes) on that Unix socket (journal.py), for a fleet replica's router
(irminsul/fleet/vllm_replica.py).

Counters: the worker's rows loaded, saved and missed go to vLLM's stat loggers (its log, /metrics), and
each request's loaded rows into vLLM's own count of its cached tokens (metrics.py).

Use: `irminsul vllm-serve MODEL ...` (serve.py), or in vLLM's own configuration `--kv-transfer-config
'{"kv_connector": "IrminsulConnector", "kv_connector_module_path": "irminsul.integrations.vllm.connector",
"kv_role": "kv_both", "kv_load_failure_policy": "recompute"}' --scheduler-cls
irminsul.integrations.vllm.scheduler.IrminsulScheduler` (the scheduler can be left out on a vLLM with
the upstream change).
"""

from __future__ import annotations

import atexit
import hmac
import json
import logging
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from irminsul.integrations.vllm.metrics import COUNTERS, IrminsulPromMetrics, IrminsulStats, count_as_cached
from irminsul.integrations.vllm.spans import Load, RequestSpans, SpanIndex, rotate_interleaved
from irminsul.integrations.vllm.tiers import open_tiers, rows_model_id, store_specs
from irminsul.kvcache.namespaces import SHARED

# NOTE: a child of vLLM's "vllm" logger, which is the one vLLM gives a handler and a format, so these
# lines reach the server's log beside vLLM's own
log = logging.getLogger("vllm.irminsul")

# every live connector, by role (an in-process engine's tests and benchmarks read their counters)
INSTANCES: dict[str, list[IrminsulConnector]] = {"scheduler": [], "worker": []}
KEEP_FINISHED = 1024  # finished requests whose stats stay readable


@dataclass
class SlotLoad:
    request_id: str
    key: int  # the stored rows (spans.Load.key)
    src_offset: int
    length: int
    delta: int
    slots: np.ndarray  # [length] int64 flat slot ids (block_id * block_size + offset)


@dataclass
class SlotSave:
    request_id: str
    key: int
    slots: np.ndarray


@dataclass
class IrminsulMetadata(KVConnectorMetadata):
    """One step's work for the worker: rows from the store tiers and loads before the forward, then
    saves, then drops."""

    puts: dict[int, torch.Tensor] = field(default_factory=dict)  # key -> rows a lower tier gave
    loads: list[SlotLoad] = field(default_factory=list)
    saves: list[SlotSave] = field(default_factory=list)
    # NOTE: applied after the saves: a key saved and evicted in the same step is then not held; a key
    # is never saved again, so a drop that arrives late frees nothing a later save wrote
    drops: list[int] = field(default_factory=list)


@dataclass
class IrminsulWorkerMetadata(KVConnectorWorkerMetadata):
    """What a worker could not do in a step, back to the scheduler side."""

    missed: dict[str, list[int]] = field(default_factory=dict)  # request id -> keys it lacked for its loads
    unsaved: list[int] = field(default_factory=list)  # keys not saved: their request read a missed load
    saved: dict[int, torch.Tensor] = field(default_factory=dict)  # key -> rows saved, for the store tiers

    def aggregate(self, other: IrminsulWorkerMetadata) -> IrminsulWorkerMetadata:
        missed = {rid: self.missed.get(rid, []) + other.missed.get(rid, []) for rid in {**self.missed, **other.missed}}
        return IrminsulWorkerMetadata(missed, self.unsaved + other.unsaved, {**self.saved, **other.saved})


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    planned_load_tokens: int = 0
    loaded_tokens: int = 0
    computed_prompt_tokens: int = 0
    reported_tokens: int = 0  # loaded tokens added to vLLM's own count of the request's cached tokens
    preemptions: int = 0  # times vLLM preempted the request before this plan (the counts are this plan's)
    fetched_tokens: int = 0  # rows its plan brought in from the store tiers (disk, Redis)


def _cut(run: list[Load], end: int) -> list[Load]:
    """The loads of a run up to position `end` (the last one shortened if it crosses it)."""
    out = []
    for load in run:
        if load.start >= end:
            break
        out.append(load if load.end <= end else Load(load.start, end, load.key, load.src_offset, load.delta))
    return out


def _scheduler_asks_hooks(vllm_config) -> bool:
    """Whether the engine's scheduler asks the running-path hooks: vLLM's own with the upstream change,
    or IrminsulScheduler (or a subclass of it)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if hasattr(Scheduler, "_get_num_running_external_tokens"):
        return True
    cls = getattr(getattr(vllm_config, "scheduler_config", None), "scheduler_cls", None)
    if cls is None:
        return False
    if isinstance(cls, str):
        return cls.rsplit(".", 1)[-1] == "IrminsulScheduler"
    return any(c.__name__ == "IrminsulScheduler" for c in getattr(cls, "__mro__", ()))


def _model_config(vllm_config) -> dict:
    path = Path(vllm_config.model_config.model) / "config.json"
    return json.loads(path.read_text()) if path.exists() else vllm_config.model_config.hf_config.to_dict()


def _inv_freq(raw: dict) -> torch.Tensor:
    """The checkpoint's RoPE frequencies for k_pe, YaRN included (Irminsul's reader of the config)."""
    from irminsul.model.config import ModelConfig
    from irminsul.model.rope import inv_freq

    return inv_freq(ModelConfig.from_dict(raw).rope)


def _cache_dtype(vllm_config) -> torch.dtype:
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    return kv_cache_dtype_str_to_dtype(vllm_config.cache_config.cache_dtype, vllm_config.model_config)


def _after_load_chunk(vllm_config, extra: dict) -> int:
    """Tokens a compute span after loaded rows may take per step: 0 (no limit) where the backend prefills
    after cached rows (chunked prefill on), else `after_load_chunk` (default 256; 1 is one token a step
    through vLLM's own decode path, without cpu_mla's builder)."""
    if vllm_config.scheduler_config.enable_chunked_prefill:
        return 0
    return max(1, int(extra.get("after_load_chunk", 256)))


class IrminsulConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        raw = _model_config(vllm_config)
        if "kv_lora_rank" not in raw:
            raise ValueError(
                f"IrminsulConnector serves MLA models (DeepSeek V2/V3 and their family): "
                f"{vllm_config.model_config.model} has no kv_lora_rank in its config"
            )
        self.block_size = vllm_config.cache_config.block_size
        self.row_width = raw["kv_lora_rank"] + raw["qk_rope_head_dim"]
        self.kv_lora_rank = raw["kv_lora_rank"]
        n_layers = raw.get("num_hidden_layers", 1)
        if role == KVConnectorRole.SCHEDULER:
            budget = int(float(extra.get("registry_gib", 1.0)) * 2**30)
            self.tenant = str(extra.get("tenant", ""))
            self.publish_salt = extra.get("publish_salt")  # a request with this cache_salt writes to SHARED
            model_id, tiers = str(vllm_config.model_config.model), None
            if store_specs(extra):  # (namespaces a restart or another replica shares: the checkpoint's identity)
                model_config = vllm_config.model_config
                dtype = _cache_dtype(vllm_config)
                model_id = rows_model_id(model_config.model, dtype, getattr(model_config, "revision", None))
                tiers = open_tiers(extra, model_id, n_layers, self.row_width, dtype, budget)
            self.index = SpanIndex(
                model_id,
                n_layers * self.row_width * 2,
                budget,
                tenant=self.tenant,
                sink=int(extra.get("sink", 32)),
                registry=tiers,
            )
            self._closed = False
            # a fleet replica's router follows the registry through its journal (journal.py)
            self.journal_server = None
            if extra.get("journal_socket"):
                from irminsul.integrations.vllm.journal import JournalServer

                self.journal_server = JournalServer(self.index.journal, str(extra["journal_socket"]), self.index.naming)
            if tiers is not None:  # (the engine's shutdown closes it first; this writes down what an exit leaves)
                atexit.register(self.shutdown)
            self.requests: dict[str, Any] = {}  # request id -> the vLLM Request
            self.spans: dict[str, RequestSpans] = {}
            self.pending: dict[str, list[Load]] = {}  # loads moved over, waiting for their blocks
            self.loaded: dict[str, list[tuple[int, int]]] = {}  # the rows [start, end) moved over
            self.offered: dict[str, list[Load]] = {}  # loads answered this step, waiting for their blocks
            self.stats: dict[str, RequestStats] = {}  # live requests and the last KEEP_FINISHED
            self.finished: deque[str] = deque()
            # the CPU reference MLA backend cannot prefill after cached rows (no chunked context), so a
            # compute span after a load goes through its decode kernel, `after_load_chunk` tokens a step
            # (cpu_mla.py; 0 when the backend has chunked prefill and the span is one chunk)
            self.after_load_chunk = _after_load_chunk(vllm_config, extra)
            if not _scheduler_asks_hooks(vllm_config):
                log.warning(
                    "irminsul: this vLLM's scheduler asks a KV connector only at admission: rows are "
                    "saved but never loaded mid-prompt; use --scheduler-cls %s or a vLLM with the "
                    "upstream change (docs/vllm-upstream.md)",
                    "irminsul.integrations.vllm.scheduler.IrminsulScheduler",
                )
            INSTANCES["scheduler"].append(self)
        else:
            chunk = _after_load_chunk(vllm_config, extra)
            if chunk > 1:
                from irminsul.integrations.vllm import cpu_mla

                cpu_mla.enable(chunk)  # (before the worker builds its attention metadata builders)
            self.inv_freq = _inv_freq(raw)
            self.rows: dict[int, torch.Tensor] = {}  # key -> [layers, len, row_width]
            self.layers: list[torch.Tensor] = []  # each layer's cache viewed as [slots, row_width]
            self.loaded_rows = self.saved_rows = self.missed_rows = self.evicted_rows = 0  # (metrics.COUNTERS)
            self.fetched_rows = 0  # rows taken in from the store tiers
            self.spills = bool(store_specs(extra))  # saved rows go back to the scheduler side, for the tiers
            self.saved: dict[int, torch.Tensor] = {}
            self.reported = dict.fromkeys(COUNTERS, 0)  # the counters as the last get_kv_connector_stats saw them
            self.missed: dict[str, list[int]] = {}  # this step's loads without rows, by request
            self.unsaved: list[int] = []
            self.invalid_blocks: set[int] = set()  # the blocks those loads were to fill
            INSTANCES["worker"].append(self)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        def layer_index(name: str) -> int:
            m = re.search(r"layers\.(\d+)\.", name)
            return int(m.group(1)) if m else 0

        self.layers = [kv_caches[n].view(-1, self.row_width) for n in sorted(kv_caches, key=layer_index)]

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        for key, rows in meta.puts.items():  # (before the loads that read them)
            self.rows[key] = rows.to(self.layers[0].device) if self.layers else rows
            self.fetched_rows += rows.shape[1]
        for load in meta.loads:
            stored = self.rows.get(load.key)
            if stored is None:  # a miss: vLLM recomputes the request from the first of these blocks
                self.missed.setdefault(load.request_id, []).append(load.key)
                self.invalid_blocks.update((load.slots // self.block_size).tolist())
                self.missed_rows += load.length
                continue
            rows = stored[:, load.src_offset : load.src_offset + load.length]
            slots = torch.from_numpy(load.slots)
            k_pe = rotate_interleaved(rows[..., self.kv_lora_rank :], load.delta, self.inv_freq)
            for layer, (c_kv, pe) in zip(self.layers, zip(rows[..., : self.kv_lora_rank], k_pe)):
                layer[slots, : self.kv_lora_rank] = c_kv.to(layer.dtype)
                layer[slots, self.kv_lora_rank :] = pe.to(layer.dtype)
            self.loaded_rows += load.length

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are written whole in start_load_kv, before the forward

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return  # saves are copied whole in wait_for_save, after the forward

    def wait_for_save(self):
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        for save in meta.saves:
            if save.request_id in self.missed:  # computed over rows that were never written
                self.unsaved.append(save.key)
                continue
            slots = torch.from_numpy(save.slots)
            self.rows[save.key] = torch.stack([layer[slots] for layer in self.layers])
            self.saved_rows += len(save.slots)
            if self.spills:
                self.saved[save.key] = self.rows[save.key].cpu()  # (no copy on a CPU)
        for key in meta.drops:
            rows = self.rows.pop(key, None)
            if rows is not None:
                self.evicted_rows += rows.shape[1]

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self.invalid_blocks = self.invalid_blocks, set()
        return out

    def get_kv_connector_stats(self) -> IrminsulStats | None:
        """The worker's counters' increase since the last call (vLLM asks after every step); None when
        nothing changed, and on the scheduler side."""
        if self.role != KVConnectorRole.WORKER:
            return None
        now = {name: getattr(self, name) for name in COUNTERS}
        step = IrminsulStats({name: now[name] - self.reported[name] for name in COUNTERS})
        self.reported = now
        return None if step.is_empty() else step

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> IrminsulStats:
        return IrminsulStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> IrminsulPromMetrics:
        return IrminsulPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def build_connector_worker_meta(self) -> IrminsulWorkerMetadata | None:
        if not self.missed and not self.unsaved and not self.saved:
            return None
        out = IrminsulWorkerMetadata(self.missed, self.unsaved, self.saved)
        self.missed, self.unsaved, self.saved = {}, [], {}
        return out

    def shutdown(self) -> None:
        """The scheduler side writes down what it queued for the store tiers and stops their threads."""
        if self.role == KVConnectorRole.SCHEDULER and not self._closed:
            self._closed = True
            self.index.close()
            if self.journal_server is not None:
                self.journal_server.close()

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        if rid in self.spans:  # asked again (the request was not admitted, or was preempted)
            self.index.release(self.spans.pop(rid))
        self.pending.pop(rid, None)
        self.loaded.pop(rid, None)
        self.offered.pop(rid, None)
        fetched = self.index.fetched_tokens
        spans = self.index.plan(request.prompt_token_ids, self.tenant_of(request))
        spans.loads = [load for load in spans.loads if load.start >= num_computed_tokens]
        self.requests[rid], self.spans[rid] = request, spans
        self.stats[rid] = RequestStats(
            prompt_tokens=spans.n,
            planned_load_tokens=sum(len(x) for x in spans.loads),
            preemptions=int(getattr(request, "num_preemptions", 0) or 0),
            fetched_tokens=self.index.fetched_tokens - fetched,
        )
        return 0, False  # nothing right after the prefix: a carve-out or a new header comes first

    def tenant_of(self, request) -> str | None:
        """The request's namespace: its cache_salt subdivides the connector's tenant (None: no salt, the
        tenant itself); the operator's publish_salt names the shared namespace."""
        salt = request.cache_salt
        if not salt:  # (vLLM's prefix cache ignores an empty salt too)
            return None
        if self.publish_salt is not None and hmac.compare_digest(salt.encode(), str(self.publish_salt).encode()):
            return SHARED
        return f"{self.tenant}|salt:{salt}"

    # The two hooks a scheduler asks on the running path (the upstream change, docs/vllm-upstream.md;
    # IrminsulScheduler asks them on a vLLM without it): a prefill under way is asked again where it
    # stands, and its chunks end where a load begins.
    def get_num_new_matched_tokens_running(self, request, num_computed_tokens: int) -> int:
        """Tokens to load where a running request's prefill stands: the run of loads that starts at
        num_computed_tokens (adjacent loads together), or 0. The scheduler allocates their blocks and
        confirms with update_state_after_alloc, or asks again in a later step."""
        spans = self.spans.get(request.request_id)
        if spans is None or num_computed_tokens >= spans.n:
            return 0
        run = spans.load_at(num_computed_tokens)
        if not run:
            return 0
        self.offered[request.request_id] = run
        return run[-1].end - num_computed_tokens

    def get_max_num_new_tokens(self, request, num_computed_tokens: int) -> int | None:
        """The most tokens a chunk starting at num_computed_tokens may compute: up to the next load, and
        after rows already in the cache at most `after_load_chunk` (the CPU backend's decode path)."""
        spans = self.spans.get(request.request_id)
        if spans is None:
            return None
        limit = None
        stop = spans.next_load_start(num_computed_tokens - 1) if num_computed_tokens < spans.n else None
        if stop is not None and stop > num_computed_tokens:
            limit = stop - num_computed_tokens
        # NOTE: past the prompt too: a request resumed after a preemption computes its output tokens
        # again after the prompt's rows, and a longer span would take the backend's prefill path, which
        # cannot see them
        if self.after_load_chunk and num_computed_tokens > 0:  # rows before it: loaded, or kept by a recompute
            limit = min(limit or self.after_load_chunk, self.after_load_chunk)
        return limit

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        """After the scheduler allocated a running request's blocks for `num_external_tokens` offered by
        get_num_new_matched_tokens_running (request.num_computed_tokens still where they start): those
        loads are planned, written by the worker before this step's forward (build_connector_meta).
        At admission (get_num_new_matched_tokens answered 0) there is nothing to do."""
        rid = request.request_id
        run = self.offered.pop(rid, None)
        if num_external_tokens <= 0 or run is None or rid not in self.spans:
            return
        run = _cut(run, run[0].start + num_external_tokens)
        self.pending.setdefault(rid, []).extend(run)
        self.loaded.setdefault(rid, []).extend((x.start, x.end) for x in run)
        self.stats[rid].loaded_tokens += sum(len(x) for x in run)
        self._report_cached(request)

    def has_loads(self, meta) -> bool:
        return isinstance(meta, IrminsulMetadata) and bool(meta.loads)

    def in_flight(self) -> dict[str, int]:
        """The scheduler side's per-request bookkeeping, by kind (all 0 once every request has finished,
        been aborted or been preempted and finished), and the registry's pinned entries."""
        return {
            "requests": len(self.requests),
            "plans": len(self.spans),
            "pending_loads": len(self.pending),
            "loaded": len(self.loaded),
            "offered": len(self.offered),
            "pinned_entries": self.index.registry.stats.pinned,
        }

    def _report_cached(self, request) -> None:
        """vLLM's own count of the request's reused tokens includes the rows loaded so far
        (metrics.count_as_cached)."""
        st = self.stats[request.request_id]
        count_as_cached(request, st.loaded_tokens - st.reported_tokens)
        st.reported_tokens = st.loaded_tokens

    def _slots(self, request_id: str, start: int, end: int) -> np.ndarray:
        blocks = np.asarray(self._kv_cache_manager.get_block_ids(request_id)[0], dtype=np.int64)
        pos = np.arange(start, end)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def build_connector_meta(self, scheduler_output) -> IrminsulMetadata:
        meta = IrminsulMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for rid in scheduler_output.preempted_req_ids or ():  # its blocks are freed; readmission plans again
            self.pending.pop(rid, None)
            self.offered.pop(rid, None)
        for rid, loads in list(self.pending.items()):
            if rid not in scheduled:
                continue  # its blocks come with the step that schedules it
            for load in loads:
                meta.loads.append(
                    SlotLoad(
                        rid, load.key, load.src_offset, len(load), load.delta, self._slots(rid, load.start, load.end)
                    )
                )
            del self.pending[rid]
        for rid, n in scheduled.items():
            spans, request = self.spans.get(rid), self.requests.get(rid)
            if spans is None or request is None:
                continue
            start = request.num_computed_tokens
            if start < spans.n:
                self.stats[rid].computed_prompt_tokens += min(n, spans.n - start)
            upto = min(start + n, spans.n)
            for save in self.index.to_save(spans, upto):
                meta.saves.append(SlotSave(rid, save.key, self._slots(rid, save.start, save.end)))
        meta.puts = self.index.fetched()  # (this step's plans' included)
        meta.drops = self.index.evicted()  # (this step's evictions included)
        return meta

    def update_connector_output(self, connector_output) -> None:
        """The worker's misses: vLLM has moved each such request back to the first block a load left
        unwritten (IrminsulScheduler's recompute policy); here the entries stop being planned, for
        these requests and every later one."""
        report = connector_output.kv_connector_worker_meta
        if not isinstance(report, IrminsulWorkerMetadata):
            return
        lost = {key for keys in report.missed.values() for key in keys} | set(report.unsaved)
        for key, rows in report.saved.items():  # down to the store tiers, in the background
            if key not in lost:
                self.index.spill(key, rows)
        for rid, spans in self.spans.items():
            spans.loads = [x for x in spans.loads if x.key not in lost]
            if rid in report.missed and rid in self.requests:
                log.warning(
                    "irminsul: request %s: %d stored chunks were not on the worker; recomputing them",
                    rid,
                    len(report.missed[rid]),
                )
                pos = self.requests[rid].num_computed_tokens  # (rows after it are computed again)
                self.loaded[rid] = [(a, min(b, pos)) for a, b in self.loaded.get(rid, []) if a < pos]
                self.stats[rid].loaded_tokens = sum(b - a for a, b in self.loaded[rid])
                self._report_cached(self.requests[rid])
        self.index.lose(lost)

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        rid = request.request_id
        spans = self.spans.pop(rid, None)
        if spans is not None:
            self.index.release(spans)
            st = self.stats[rid]
            log.info(
                "irminsul: request %s: %d prompt tokens, %d loaded from the registry, %d computed",
                rid,
                st.prompt_tokens,
                st.loaded_tokens,
                st.computed_prompt_tokens,
            )
            self.finished.append(rid)
            while len(self.finished) > KEEP_FINISHED:
                self.stats.pop(self.finished.popleft(), None)
        self.requests.pop(rid, None)
        self.pending.pop(rid, None)
        self.loaded.pop(rid, None)
        self.offered.pop(rid, None)
        return False, None
