"""`IrminsulConnector`: a vLLM v1 KV connector that loads a prompt's reused chunks at any position.

vLLM asks a connector once per request, at admission, how many tokens *after* its local prefix hit it
can load (`get_num_new_matched_tokens`); a document moved behind a new header is never there. So this
connector does two jobs and `IrminsulScheduler` (scheduler.py) the third:

- scheduler side: at admission, plan the prompt with Irminsul's planner (`spans.SpanIndex`: CDC
  chunks, verified registry, S1 windows, sink carve-out) and keep the plan; each step, say in the
  metadata which rows to load into which slots (with their RoPE shift δ) and which computed chunks to
  copy out of the cache into the row store; forget a plan when its request finishes;
- worker side: hold the rows (`[layers, len, kv_lora_rank + rope_dim]`, `k_pe` as vLLM stores it:
  rotated at the chunk's source positions), write loads into vLLM's MLA cache before the forward
  (`c_KV` copied, `k_pe` rotated by δ), copy saves out after it;
- the scheduler subclass stops a prefill step at the start of a loaded span, and at the next step
  moves the request's `num_computed_tokens` over the span (see docs/vllm.md).

Use: `--kv-transfer-config '{"kv_connector": "IrminsulConnector", "kv_connector_module_path":
"irminsul.integrations.vllm.connector", "kv_role": "kv_both"}' --scheduler-cls
irminsul.integrations.vllm.scheduler.IrminsulScheduler`.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from irminsul.integrations.vllm.spans import Load, RequestSpans, SpanIndex, rotate_interleaved

log = logging.getLogger("irminsul.vllm")

# every live connector, by role (an in-process engine's tests and benchmarks read their counters)
INSTANCES: dict[str, list["IrminsulConnector"]] = {"scheduler": [], "worker": []}


@dataclass
class SlotLoad:
    fingerprint: int
    src_offset: int
    length: int
    delta: int
    slots: np.ndarray  # [length] int64 flat slot ids (block_id * block_size + offset)


@dataclass
class SlotSave:
    fingerprint: int
    slots: np.ndarray


@dataclass
class IrminsulMetadata(KVConnectorMetadata):
    loads: list[SlotLoad] = field(default_factory=list)
    saves: list[SlotSave] = field(default_factory=list)
    drops: list[int] = field(default_factory=list)


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    planned_load_tokens: int = 0
    loaded_tokens: int = 0
    computed_prompt_tokens: int = 0


def _model_config(vllm_config) -> dict:
    path = Path(vllm_config.model_config.model) / "config.json"
    return json.loads(path.read_text()) if path.exists() else vllm_config.model_config.hf_config.to_dict()


def _inv_freq(raw: dict) -> torch.Tensor:
    """The checkpoint's RoPE frequencies for k_pe, YaRN included (Irminsul's reader of the config)."""
    from irminsul.model.config import ModelConfig
    from irminsul.model.rope import inv_freq

    return inv_freq(ModelConfig.from_dict(raw).rope)


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
        self.block_size = vllm_config.cache_config.block_size
        self.row_width = raw["kv_lora_rank"] + raw["qk_rope_head_dim"]
        self.kv_lora_rank = raw["kv_lora_rank"]
        n_layers = raw.get("num_hidden_layers", 1)
        if role == KVConnectorRole.SCHEDULER:
            budget = int(float(extra.get("registry_gib", 1.0)) * 2**30)
            self.index = SpanIndex(str(vllm_config.model_config.model), n_layers * self.row_width * 2, budget,
                                   tenant=str(extra.get("tenant", "")), sink=int(extra.get("sink", 32)))
            self.requests: dict[str, Any] = {}  # request id -> the vLLM Request
            self.spans: dict[str, RequestSpans] = {}
            self.pending: dict[str, list[Load]] = {}  # loads moved over, waiting for their blocks
            self.stats: dict[str, RequestStats] = {}
            # the CPU reference MLA backend cannot prefill after cached rows (no chunked context), so a
            # compute span after a load goes through its decode kernel, `after_load_chunk` tokens a step
            # (cpu_mla.py; 0 when the backend has chunked prefill and the span is one chunk)
            self.after_load_chunk = _after_load_chunk(vllm_config, extra)
            INSTANCES["scheduler"].append(self)
        else:
            chunk = _after_load_chunk(vllm_config, extra)
            if chunk > 1:
                from irminsul.integrations.vllm import cpu_mla

                cpu_mla.enable(chunk)  # (before the worker builds its attention metadata builders)
            self.inv_freq = _inv_freq(raw)
            self.rows: dict[int, torch.Tensor] = {}  # fingerprint -> [layers, len, row_width]
            self.layers: list[torch.Tensor] = []  # each layer's cache viewed as [slots, row_width]
            self.loaded_rows = self.saved_rows = 0
            INSTANCES["worker"].append(self)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        def layer_index(name: str) -> int:
            m = re.search(r"layers\.(\d+)\.", name)
            return int(m.group(1)) if m else 0

        self.layers = [kv_caches[n].view(-1, self.row_width) for n in sorted(kv_caches, key=layer_index)]

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        for load in meta.loads:
            rows = self.rows[load.fingerprint][:, load.src_offset:load.src_offset + load.length]
            slots = torch.from_numpy(load.slots)
            k_pe = rotate_interleaved(rows[..., self.kv_lora_rank:], load.delta, self.inv_freq)
            for layer, (c_kv, pe) in zip(self.layers, zip(rows[..., :self.kv_lora_rank], k_pe)):
                layer[slots, :self.kv_lora_rank] = c_kv.to(layer.dtype)
                layer[slots, self.kv_lora_rank:] = pe.to(layer.dtype)
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
            slots = torch.from_numpy(save.slots)
            self.rows[save.fingerprint] = torch.stack([layer[slots] for layer in self.layers])
            self.saved_rows += len(save.slots)
        for fp in meta.drops:
            self.rows.pop(fp, None)

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        if rid in self.spans:  # asked again (the request was not admitted, or was preempted)
            self.index.release(self.spans.pop(rid))
        self.pending.pop(rid, None)
        spans = self.index.plan(request.prompt_token_ids)
        spans.loads = [load for load in spans.loads if load.start >= num_computed_tokens]
        self.requests[rid], self.spans[rid] = request, spans
        self.stats[rid] = RequestStats(prompt_tokens=spans.n,
                                       planned_load_tokens=sum(len(x) for x in spans.loads))
        return 0, False  # nothing right after the prefix: a carve-out or a new header comes first

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        return

    def clip(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """The scheduler's chunk for a request, stopped where a load begins."""
        spans = self.spans.get(request.request_id)
        if spans is None or not spans.loads or num_computed_tokens >= spans.n:
            return num_new_tokens
        stop = spans.next_load_start(num_computed_tokens - 1)
        if stop is not None and stop > num_computed_tokens:
            num_new_tokens = min(num_new_tokens, stop - num_computed_tokens)
        if self.after_load_chunk and num_computed_tokens > spans.loads[0].start:
            num_new_tokens = min(num_new_tokens, self.after_load_chunk)
        return num_new_tokens

    def advance(self, running) -> bool:
        """Move every running request that stands at the start of a load over it; True if any."""
        moved = False
        for request in running:
            spans = self.spans.get(request.request_id)
            if spans is None or request.num_computed_tokens >= spans.n:
                continue
            run = spans.load_at(request.num_computed_tokens)
            if not run:
                continue
            request.num_computed_tokens = run[-1].end
            self.pending.setdefault(request.request_id, []).extend(run)
            self.stats[request.request_id].loaded_tokens += sum(len(x) for x in run)
            moved = True
        return moved

    def _slots(self, request_id: str, start: int, end: int) -> np.ndarray:
        blocks = np.asarray(self._kv_cache_manager.get_block_ids(request_id)[0], dtype=np.int64)
        pos = np.arange(start, end)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def build_connector_meta(self, scheduler_output) -> IrminsulMetadata:
        meta = IrminsulMetadata(drops=self.index.evicted())
        scheduled = scheduler_output.num_scheduled_tokens
        for rid, loads in list(self.pending.items()):
            if rid not in scheduled:
                continue  # its blocks come with the step that schedules it
            for load in loads:
                meta.loads.append(SlotLoad(load.fingerprint, load.src_offset, len(load), load.delta,
                                           self._slots(rid, load.start, load.end)))
            del self.pending[rid]
        for rid, n in scheduled.items():
            spans, request = self.spans.get(rid), self.requests.get(rid)
            if spans is None or request is None:
                continue
            start = request.num_computed_tokens
            if start < spans.n:
                self.stats[rid].computed_prompt_tokens += min(n, spans.n - start)
            upto = min(start + n, spans.n)
            for chunk in self.index.to_save(spans, upto):
                meta.saves.append(SlotSave(chunk.fingerprint, self._slots(rid, chunk.start, chunk.end)))
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        rid = request.request_id
        spans = self.spans.pop(rid, None)
        if spans is not None:
            self.index.release(spans)
            st = self.stats[rid]
            log.info("irminsul: request %s: %d prompt tokens, %d loaded from the registry, %d computed",
                     rid, st.prompt_tokens, st.loaded_tokens, st.computed_prompt_tokens)
        self.requests.pop(rid, None)
        self.pending.pop(rid, None)
        return False, None
