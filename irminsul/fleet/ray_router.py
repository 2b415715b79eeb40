"""The content router as a Ray Serve `RequestRouter` on the replica deployment.

Ray Serve runs one request router per deployment handle, in the process that holds the handle:
here the fleet's ingress, which renders each prompt as a replica would (`prompt.RouteKey`) and
passes it beside the request (`handle.http.remote(request, route=key)`). `choose_replicas` reads
the key from `pending_request.kwargs`, as Ray Serve LLM's routers read the request from
`pending_request.args`, scores every candidate with `ContentRouter.choose`, and returns the
replicas ranked by cost (Serve takes the first that has room), and records the first choice as
sent there at once (the requests of a burst are chosen before any is accepted); `on_request_routed`
records it again where Serve sent it instead, if the first had no room. The choice's explanation
is written into the key before Serve sends it, and the replica returns it as the `x-irminsul-route`
header.

Each replica's chunks come with its routing stats (`feed.py`), which Serve pushes to every router
with each change of any replica's; `update_replicas` applies them. A replica whose periods a view
cannot continue is marked stale; the ingress fetches its snapshot out of band
(`FleetView.stale`, `FleetView.restore`). A replica that dies (`on_replica_actor_died`) or leaves
(`update_replicas`) is forgotten at once: nothing is routed to it after the broadcast that drops it.

Targeted calls (a replica's snapshot, metrics, health) name their replica in `target=`.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from irminsul.fleet.feed import RoutingStats, Snapshot, follow, restore
from irminsul.fleet.prompt import RouteKey
from irminsul.fleet.router import ContentRouter, Decision, ReplicaView
from irminsul.kvcache.chunker import ChunkerConfig


class FleetView:
    """What the routers of one process know of the replicas; the ingress in that process reads it
    (which replicas exist, which need a snapshot). Thread-safe: Serve routes on its own loop."""

    def __init__(self, assignment_ttl_s: float = 30.0):
        self.assignment_ttl_s = assignment_ttl_s
        self.router: ContentRouter | None = None  # built from the first replica's metadata
        self.default_tenant = ""
        self.meta: dict = {}  # the first replica's record_replica_metadata
        self.views: dict[str, ReplicaView] = {}
        self.stale: set[str] = set()  # replicas whose view needs a snapshot
        self._reports: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def replicas(self) -> list[str]:
        with self._lock:
            return sorted(self.views)

    def update(self, replicas: list[RunningReplica]) -> None:
        """Follow every replica's latest routing stats; forget the ones that left."""
        with self._lock:
            present = {r.replica_id.unique_id: r for r in replicas}
            for rid in list(self.views):
                if rid not in present:
                    self._drop(rid)
            for rid, replica in present.items():
                if self.router is None and replica.replica_metadata:
                    self._build(replica.replica_metadata)
                view = self.views.setdefault(rid, ReplicaView(rid))
                stats = RoutingStats.of(replica.routing_stats)
                if stats is None:
                    continue
                if self._reports.get(rid) != stats.report:
                    self._reports[rid] = stats.report
                    view.load = stats.load
                if follow(view, stats):
                    self.stale.discard(rid)
                else:
                    self.stale.add(rid)

    def restore(self, replica_id: str, snapshot: Snapshot) -> None:
        with self._lock:
            view = self.views.get(replica_id)
            if view is not None:
                restore(view, snapshot)
                self.stale.discard(replica_id)

    def drop(self, replica_id: str) -> None:
        with self._lock:
            self._drop(replica_id)

    def _drop(self, replica_id: str) -> None:
        self.views.pop(replica_id, None)
        self._reports.pop(replica_id, None)
        self.stale.discard(replica_id)
        if self.router is not None:
            self.router.forget(replica_id)

    def _build(self, meta: dict) -> None:
        marker = meta.get("marker")
        self.router = ContentRouter(
            meta["model_id"],
            ChunkerConfig(marker=tuple(marker) if marker else None),
            assignment_ttl_s=self.assignment_ttl_s,
            sink=meta["sink"],
        )
        self.default_tenant = meta.get("default_tenant", "")
        self.meta = dict(meta)

    def fingerprints(self, route: RouteKey) -> list[int]:
        """The prompt's chunk fingerprints in its tenant's namespace and the shared one (the keys
        the shared store would hold them under); none before the first replica's metadata."""
        router = self.router
        if router is None:
            return []
        prompt = router.chunks(route.token_ids, route.segment_starts, self._tenant(route))
        return [*prompt.fingerprints.tolist(), *prompt.shared.tolist()]

    def choose(self, replica_ids: list[str], route: RouteKey) -> Decision | None:
        with self._lock:
            if self.router is None:
                return None
            views = {rid: self.views.setdefault(rid, ReplicaView(rid)) for rid in replica_ids}
            return self.router.choose(
                route.token_ids, views, route.segment_starts, self._tenant(route), store=route.stored or None
            )

    def record(self, decision: Decision, route: RouteKey) -> None:
        with self._lock:
            if self.router is not None and decision.replica in self.views:
                self.router.record(decision, route.token_ids, route.segment_starts, self._tenant(route))

    def load(self, replica_id: str) -> int:
        view = self.views.get(replica_id)
        return 0 if view is None else view.load.running + view.load.waiting

    def _tenant(self, route: RouteKey) -> str:
        return self.default_tenant if route.tenant is None else route.tenant


_views: dict[str, FleetView] = {}
_views_lock = threading.Lock()


def fleet_view(deployment: str, app: str = "") -> FleetView:
    """The process's view of one replica deployment (the routers' and the ingress's)."""
    # NOTE: Serve ships the router class to the handle's process by value (cloudpickle), with a copy
    # of this module's globals; the one registry is the imported module's
    home = importlib.import_module(__name__)
    with home._views_lock:
        return home._views.setdefault(f"{app}/{deployment}", home.FleetView())


class ContentRequestRouter(RequestRouter):
    def initialize_state(self, assignment_ttl_s: float = 30.0, **unknown: Any) -> None:
        """`request_router_kwargs`: assignment_ttl_s, the ContentRouter's."""
        if unknown:  # (Serve's base takes any keyword; this router takes only its own)
            raise TypeError(f"ContentRequestRouter takes no request_router_kwargs {', '.join(map(repr, unknown))}")
        self.fleet = fleet_view(self._deployment_id.name, self._deployment_id.app_name)
        self.fleet.assignment_ttl_s = assignment_ttl_s
        self._decisions: OrderedDict[str, Decision] = OrderedDict()  # routed, not yet sent

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.fleet.update(replicas)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.fleet.drop(replica_id.unique_id)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        target = kwargs.get("target")
        if target is not None:
            # NOTE: a replica gone by now goes to any other, which answers None for it: a request Serve
            # cannot route stays first in its queue, and every request behind it would wait forever
            return [[by_id[target]]] if target in by_id else [list(by_id.values())]
        route = kwargs.get("route")
        decision = self.fleet.choose(list(by_id), route) if isinstance(route, RouteKey) else None
        # (no pending request: no route and no decision)
        if decision is None or pending_request is None or not isinstance(route, RouteKey):
            # no prompt to route by: the least loaded first
            order = sorted(by_id, key=lambda rid: (self.fleet.load(rid), rid))
            return [[by_id[rid] for rid in order]]
        kwargs["route"] = dataclasses.replace(route, explanation=decision.explanation)
        request_id = pending_request.metadata.internal_request_id
        if request_id not in self._decisions:  # (a retry, every replica full: counted once)
            # recorded now, not when the replica accepts it (`on_request_routed`, a round trip later):
            # a burst for one new document is chosen all at once, and each choice must see the last
            self.fleet.record(decision, route)
            self._decisions[request_id] = decision
        while len(self._decisions) > 4096:  # (requests cancelled before they were sent)
            self._decisions.popitem(last=False)
        order = sorted(decision.costs, key=lambda rid: (decision.costs[rid], rid))
        return [[by_id[rid]] for rid in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        decision = self._decisions.pop(pending_request.metadata.internal_request_id, None)
        route = pending_request.kwargs.get("route")
        if decision is None or not isinstance(route, RouteKey):
            return
        sent = replica_id.unique_id
        if sent != decision.replica:  # the first choice had no room: Serve took the next one
            # (what was recorded for the first choice expires with the assignment window)
            self.fleet.record(dataclasses.replace(decision, replica=sent), route)
