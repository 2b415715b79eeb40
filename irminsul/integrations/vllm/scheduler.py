"""`IrminsulScheduler`: vLLM's v1 scheduler with a prompt's prefill split at loaded spans, for a vLLM
without the upstream change.

vLLM 0.32 asks the KV connector for loadable tokens only at admission and only right after the
local prefix hit (`Scheduler.schedule`, the waiting loop's `request.num_computed_tokens == 0`
branch). The upstream change (`upstream/scheduler.patch`, docs/vllm-upstream.md) adds two optional
connector hooks that the scheduler asks on the running path:
`get_num_new_matched_tokens_running` (a prefill under way, where it stands) and
`get_max_num_new_tokens` (a chunk ends where a load begins). On a vLLM with that change this class
adds nothing (`HOOKS`) and the connector alone is enough. Without it, two overrides ask the same
hooks, without copying the scheduler:

- `schedule` first moves every running request that stands at the start of a loaded span over it
  (`num_computed_tokens += len(span)`; the step's `allocate_slots` then gives it the blocks the
  rows land in), and marks the step synchronous whenever its metadata carries loads, so the worker
  writes them before the forward;
- `_reserve_prefill_lookahead` (called for every running and waiting request just before its blocks
  are allocated) also stops the request's chunk where its next loaded span begins.

A load the worker cannot serve is a cache miss, so the scheduler recomputes the request from the
first block it left unwritten (vLLM's "recompute" load-failure policy, whatever the kv-transfer
config says), never fails it.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler

from irminsul.integrations.vllm.connector import IrminsulConnector

# the installed vLLM's scheduler asks the connector on the running path itself (the upstream change)
HOOKS = hasattr(Scheduler, "_get_num_running_external_tokens")


class IrminsulScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self._irminsul() is not None:
            self.recompute_kv_load_failures = True

    def _irminsul(self) -> IrminsulConnector | None:
        return self.connector if isinstance(self.connector, IrminsulConnector) else None

    def schedule(self, *args, **kwargs):
        connector = self._irminsul()
        if connector is None or HOOKS:
            return super().schedule(*args, **kwargs)
        for request in self.running:
            if request.num_output_placeholders > 0 or request.num_computed_tokens >= request.num_prompt_tokens - 1:
                continue
            n = connector.get_num_new_matched_tokens_running(request, request.num_computed_tokens)
            n = min(n, request.num_prompt_tokens - 1 - request.num_computed_tokens)
            if n > 0:  # (blocks: this step's allocate_slots gives them, or a later step's)
                connector.update_state_after_alloc(request, None, n)
                request.num_computed_tokens += n
        output = super().schedule(*args, **kwargs)
        if connector.has_loads(output.kv_connector_metadata):
            output.has_sync_kv_loads = True
        return output

    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        connector = self._irminsul()
        if connector is None or HOOKS or n <= 1:
            return n
        limit = connector.get_max_num_new_tokens(request, num_computed_tokens)
        return n if limit is None or limit <= 0 else min(n, limit)
