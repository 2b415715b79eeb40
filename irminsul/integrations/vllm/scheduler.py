"""`IrminsulScheduler`: vLLM's v1 scheduler with a prompt's prefill split at loaded spans.

vLLM 0.32 asks the KV connector for loadable tokens only at admission and only right after the
local prefix hit (`Scheduler.schedule`, the waiting loop's `request.num_computed_tokens == 0`
branch). Two overrides make a prefill alternate computed and loaded spans without copying the
scheduler:

- `_reserve_prefill_lookahead` (called for every running and waiting request just before its blocks
  are allocated) also stops the request's chunk where its next loaded span begins;
- `schedule` first moves every running request that stands at the start of a loaded span over it
  (`num_computed_tokens += len(span)`; the step's `allocate_slots` then gives it the blocks the
  rows land in), and marks the step's loads synchronous so the worker writes them before the forward.

A load the worker cannot serve is a cache miss, so the scheduler recomputes the request from the
first block it left unwritten (vLLM's "recompute" load-failure policy, whatever the kv-transfer
config says), never fails it.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler

from irminsul.integrations.vllm.connector import IrminsulConnector


class IrminsulScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self._irminsul() is not None:
            self.recompute_kv_load_failures = True

    def _irminsul(self) -> IrminsulConnector | None:
        return self.connector if isinstance(self.connector, IrminsulConnector) else None

    def schedule(self, *args, **kwargs):
        connector = self._irminsul()
        moved = connector is not None and connector.advance(self.running)
        output = super().schedule(*args, **kwargs)
        if moved:
            output.has_sync_kv_loads = True
        return output

    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        connector = self._irminsul()
        return n if connector is None else connector.clip(request, num_computed_tokens, n)
