"""Ray Serve's own routers, fitted to the fleet's request shape: prefix affinity and power of two.

`PrefixAffinityRequestRouter` is Ray Serve LLM's `PrefixCacheAffinityRouter`, unchanged but for where
it finds the prompt (Ray 2.60, `ray/llm/_internal/serve/routing_policies/prefix_aware/
prefix_aware_router.py`; imported from there because `ray.serve.llm` needs pyarrow, which the router
does not). Ray's reads a positional argument with a `.messages` or `.prompt`; the fleet's ingress sends
the request's bytes (`asgi.Forwarded`), so `_extract_text_from_request` parses the body and gives its
`messages` (or `prompt`) to Ray's own normalisation (each message's text, concatenated). The rest is
Ray's: a prefix tree of the text routed to each replica (a detached `PrefixTreeActor`); when the
replicas' queue lengths differ by at most `imbalanced_threshold` (default infinite), the replicas
whose tree matches the longest prefix if that is >= `match_rate_threshold` (0.1) of the text, else
the replicas with the smallest trees; otherwise, and among those, power of two choices.

`PowerOfTwoRequestRouter` is Serve's default `PowerOfTwoChoicesRequestRouter`.

Both send the ingress's targeted calls (`target=` a replica id: metrics, health, snapshots) to the
replica they name, and keep the process's `FleetView` current, so the fleet's /health and /metrics
list every replica as they do under the content router.
"""

from __future__ import annotations

import json

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from irminsul.fleet.asgi import Forwarded
from irminsul.fleet.ray_router import FleetView, fleet_view


class _FleetCalls(RequestRouter):
    """Targeted calls to the named replica; the fleet's view follows the replicas. (A mixin before a
    Serve router: `super()` is that router, and RequestRouter stays last in the MRO.)"""

    def _fleet(self) -> FleetView:
        return fleet_view(self._deployment_id.name, self._deployment_id.app_name)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._fleet().update(replicas)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._fleet().drop(replica_id.unique_id)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        target = pending_request.kwargs.get("target") if pending_request is not None else None
        if target is not None:
            named = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            return [named] if named else []  # (a replica gone by now: the caller times out)
        # (mypy checks super() against RequestRouter's abstract method; the MRO puts a Serve router between)
        return await super().choose_replicas(candidate_replicas, pending_request)  # type: ignore[safe-super]


# Ray annotates PrefixCacheAffinityRouter.choose_replicas as returning list[RunningReplica]; it returns the
# ranks, list[list[RunningReplica]], as RequestRouter's does (and _FleetCalls's)
class PrefixAffinityRequestRouter(_FleetCalls, PrefixCacheAffinityRouter):  # type: ignore[misc]  # (Ray's annotation)
    # None: no text to match (Ray's callers test for it, though its annotation says str)
    def _extract_text_from_request(  # type: ignore[override]  # (Ray's annotation)
        self, pending_request: PendingRequest
    ) -> str | None:
        forwarded = next((a for a in pending_request.args if isinstance(a, Forwarded)), None)
        try:
            body = json.loads(forwarded.body) if forwarded is not None and forwarded.body else None
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(body, dict):
            return None
        prompt = body.get("messages", body.get("prompt"))
        text = self._normalize_prompt_to_string(prompt) if prompt is not None else ""
        return text or None  # (Ray divides by the text's length)


class PowerOfTwoRequestRouter(_FleetCalls, PowerOfTwoChoicesRequestRouter):
    pass
