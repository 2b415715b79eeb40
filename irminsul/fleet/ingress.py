"""The fleet's one OpenAI-compatible front: reads each request, renders its prompt, forwards it by content.

The ingress serves every path `irminsul serve` has by forwarding the request's bytes (method,
path, headers, body) to a replica, which answers with the single server's own handlers
(`replica.py`), so parsing, errors, streaming, tenants and keys behave exactly as they do there.
What the ingress adds: the API key is checked before the body is read (a 401 costs no body), the
body is read within `--max-request-bytes` and `--timeout-body` (a 408 past it), the prompt is
rendered on a worker thread for the router (`prompt.py`), and a replica that dies before it sent
anything is replaced by another:

- an answer that is not a stream is buffered whole, so it is retried on another replica until it is
  complete;
- a stream is retried until its first chunk arrives; once the client has seen output, a replica that
  dies ends the stream with an error event (as the server ends a failed stream) and `[DONE]`.

A retried answer carries `x-irminsul-attempts: N`; `/metrics` counts retries, requests no replica
answered and streams cut, under `replica="ingress"`. With a Redis tier, the ingress also asks the
store which of the prompt's chunks it holds (`store_keys.py`), for the router's store credit.

`/health` is a 503 `starting` until every replica has started once (start-up is a state, not an
error: no replica is waited on), then 200 `ok`, 200 `degraded` while some of the replicas serve, and
503 `down` when none does; `/metrics` is every replica's exposition, each sample labelled with
`replica="<id>"` (per replica, not summed: a histogram's buckets and a gauge of the pool are a
replica's own).
"""

# NOTE: no `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request)
import asyncio
import dataclasses
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from irminsul.fleet.asgi import Forwarded
from irminsul.fleet.metrics import labelled
from irminsul.fleet.prompt import PromptReader
from irminsul.fleet.ray_router import fleet_view
from irminsul.fleet.replica import Head
from irminsul.fleet.store_keys import StoreKeys
from irminsul.server.body import read_body
from irminsul.server.config import ServerConfig
from irminsul.server.errors import APIError
from irminsul.server.serving_base import sse

log = logging.getLogger("irminsul.fleet")

ROUTED = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/cache/chunks"}
KEYED = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize", "/detokenize"}
ATTEMPTS = 3  # replicas one request may be tried on
TARGETED_TIMEOUT_S = 10.0  # a call to one named replica (metrics, a snapshot)
HEALTH_TIMEOUT_S = 2.0  # a replica's health: a probe must answer well within a load balancer's timeout
_DROPPED = {b"content-length", b"transfer-encoding", b"connection"}
_REPLICA_GONE = (RayActorError, ActorUnavailableError)

api = FastAPI(title="Irminsul fleet", openapi_url=None, docs_url=None, redoc_url=None)


class _ReplicaGone(Exception):
    pass


@serve.ingress(api)
class FleetIngress:
    # (an async __init__, which Serve awaits: replica.py)
    async def __init__(  # type: ignore[misc]  # (Serve awaits it; mypy wants __init__ -> None)
        self,
        replicas,
        config: ServerConfig,
        replica_deployment: str = "IrminsulReplica",
        expected_replicas: int = 1,
        vllm: bool = False,
    ):
        """`vllm`: the replicas are vLLM's (`vllm_replica.py`): completions are tokenized as vLLM does, and
        chats, which vLLM renders with the checkpoint's own template, route by load."""
        from irminsul.bundled import bundled_model
        from irminsul.model.tokenizer import Tokenizer
        from irminsul.server.chat import ChatRenderer

        if vllm:
            from irminsul.fleet.vllm_replica import VllmTokenizer

            assert config.model is not None, "a vLLM fleet names its model"
            self.reader = PromptReader(config, await asyncio.to_thread(VllmTokenizer, config.model), None)
        else:
            tokenizer = await asyncio.to_thread(Tokenizer, config.model or bundled_model("mla"))
            self.reader = PromptReader(config, tokenizer, ChatRenderer(tokenizer))
        self.config, self.replicas, self.expected_replicas = config, replicas, expected_replicas
        self.started = False  # every replica has served once: fewer is `degraded` from then on, not `starting`
        self.fleet = fleet_view(replica_deployment, serve.get_replica_context().app_name)
        self._store: StoreKeys | None = None
        self.retries = self.unanswered = self.streams_cut = 0  # the ingress's own counters (/metrics)
        self._snapshots = asyncio.ensure_future(self._fetch_snapshots())
        self._router = asyncio.ensure_future(self._start_router())

    # -- the fleet's own endpoints --------------------------------------------------------

    @api.get("/health")
    async def health(self):
        states = {
            rid: "ok" if v is True else "down" for rid, v in (await self._each("healthy", HEALTH_TIMEOUT_S)).items()
        }
        ready = sum(v == "ok" for v in states.values())
        self.started = self.started or ready >= self.expected_replicas
        if not self.started:
            status = "starting"
        else:
            status = "ok" if ready >= self.expected_replicas else "degraded" if ready else "down"
        body = {"status": status, "replicas_ready": ready, "replicas": self.expected_replicas, "replica_status": states}
        return JSONResponse(body, status_code=200 if status in ("ok", "degraded") else 503)

    @api.get("/metrics")
    async def metrics(self):
        texts = {rid: t for rid, t in (await self._each("prometheus")).items() if isinstance(t, str)}
        texts["ingress"] = self._own_metrics()
        return Response(labelled(texts), media_type="text/plain; version=0.0.4")

    def _own_metrics(self) -> str:
        lines = []
        for name, value, what in (
            (
                "irminsul_fleet_retries_total",
                self.retries,
                "requests sent to another replica because the one answering stopped before the client saw output",
            ),
            (
                "irminsul_fleet_unanswered_total",
                self.unanswered,
                f"requests answered 503 after {ATTEMPTS} replicas stopped before answering",
            ),
            (
                "irminsul_fleet_streams_cut_total",
                self.streams_cut,
                "streams ended with an error event because their replica stopped after output was sent",
            ),
        ):
            lines += [f"# HELP {name} {what}", f"# TYPE {name} counter", f"{name} {value}"]
        return "\n".join(lines) + "\n"

    async def _start_router(self) -> None:
        """The router starts with the handle's first call, which waits for a replica: it waits here, in
        the background, so that no endpoint waits on a fleet that is starting."""
        try:
            await self.replicas.options(method_name="healthy").remote(target=None)
        except Exception as e:  # (the replicas' failures are theirs to report: Serve logs them)
            log.debug("the first call to the replicas failed: %s", e)

    async def _each(self, method: str, timeout_s: float = TARGETED_TIMEOUT_S) -> dict:
        """`method` called on every replica the router knows, none while it knows none (an exception
        in place of an answer that failed or took longer than `timeout_s`)."""
        answers = {}
        # NOTE: one after another: Serve gives the calls one request makes the same internal request
        # id, and its router matches a routed replica to a pending call by that id (concurrent calls
        # of one request would wait on each other forever)
        for rid in self.fleet.replicas:
            try:
                answers[rid] = await self._targeted(method, rid, timeout_s)
            except Exception as e:
                answers[rid] = e
        return answers

    async def _targeted(self, method: str, replica_id: str | None, timeout_s: float = TARGETED_TIMEOUT_S):
        response = self.replicas.options(method_name=method).remote(target=replica_id)
        try:
            return await asyncio.wait_for(response, timeout_s)
        except TimeoutError:
            response.cancel()
            raise

    async def _fetch_snapshots(self) -> None:
        """The whole chunk set of each replica whose periods the router's view cannot continue
        (a new router, a replica it never saw, or one it fell behind on)."""
        while True:
            await asyncio.sleep(0.25)
            for rid in list(self.fleet.stale):
                try:
                    if (snapshot := await self._targeted("journal_snapshot", rid)) is not None:
                        self.fleet.restore(rid, snapshot)
                except Exception as e:  # (gone, or slow: the next round tries again)
                    log.debug("no snapshot from replica %s: %s", rid, e)

    # -- everything else: forwarded -------------------------------------------------------

    def _route_key(self, path: str, request, body: bytes):
        """(On a worker thread.) The prompt for the router, with the chunks the shared store holds."""
        route = self.reader.route_key(path, request, body)
        store = self._store_keys()
        if route is None or store is None:
            return route
        return dataclasses.replace(route, stored=store.found(self.fleet.fingerprints(route)))

    def _store_keys(self) -> StoreKeys | None:
        """The shared store's keys, once a replica said their prefix (None without a Redis tier)."""
        prefix, url = self.fleet.meta.get("store_prefix"), self.config.store.redis_url
        if self._store is None and prefix and url:
            self._store = StoreKeys(url, prefix)
        return self._store

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def forward(self, request: Request, path: str):
        path = "/" + path
        try:
            if path in KEYED:
                self.reader.key_tenant(request)  # (a 401 before the body is read)
            body = await self._read_body(request)
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        route = None
        if path in ROUTED:
            self.reader.max_chars = self.fleet.meta.get("max_prompt_chars", self.reader.max_chars)
            route = await asyncio.to_thread(self._route_key, path, request, body)
        headers = tuple((k.lower(), v) for k, v in request.headers.raw)
        client = (request.client.host, request.client.port) if request.client else None
        forwarded = Forwarded(request.method, path, request.url.query.encode(), headers, body, client)
        for attempt in range(ATTEMPTS):
            try:
                answer = await self._answer(forwarded, route)
            except _ReplicaGone as e:
                log.warning("a replica stopped before answering %s (%s); trying another", path, e)
                await asyncio.sleep(0.2 * (attempt + 1))  # (Serve drops the dead replica meanwhile)
                if attempt + 1 < ATTEMPTS:
                    self.retries += 1
                continue
            if attempt:  # (a retried answer says so: the replicas it was tried on)
                answer.headers["x-irminsul-attempts"] = str(attempt + 1)
            return answer
        self.unanswered += 1
        error = APIError(503, f"{ATTEMPTS} replicas stopped before answering this request; retry later")
        return JSONResponse(error.body(), status_code=503)

    async def _read_body(self, request: Request) -> bytes:
        """The body within --max-request-bytes and --timeout-body: Serve's proxy has no deadline of its own,
        so a client that never finishes its body would hold the request (and its memory) for ever."""
        try:
            return await asyncio.wait_for(read_body(request, self.config.max_request_bytes), self.config.timeout_body)
        except TimeoutError:
            raise APIError(408, "the request's body did not arrive in time (--timeout-body)") from None

    async def _answer(self, forwarded: Forwarded, route) -> Response:
        stream = self.replicas.options(stream=True).http.remote(forwarded, route=route)
        handed_over = False
        try:
            head = await self._next(stream)
            if not isinstance(head, Head):
                raise _ReplicaGone("it answered nothing")
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers if k not in _DROPPED}
            if not headers.get("content-type", "").startswith("text/event-stream"):
                chunks = []
                while (chunk := await self._next(stream)) is not None:
                    chunks.append(chunk)
                return Response(b"".join(chunks), status_code=head.status, headers=headers)
            first = await self._next(stream)  # (the client has seen nothing until this arrives)
            handed_over = True
            return StreamingResponse(self._rest(stream, first), status_code=head.status, headers=headers)
        finally:
            if not handed_over:
                stream.cancel()

    @staticmethod
    async def _next(stream):
        """The next item of a replica's answer, None at its end; _ReplicaGone if the replica died."""
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            return None
        except _REPLICA_GONE as e:
            raise _ReplicaGone(type(e).__name__) from None

    async def _rest(self, stream, first):
        try:
            if first is not None:
                yield first
            while (chunk := await self._next(stream)) is not None:
                yield chunk
        except _ReplicaGone:
            self.streams_cut += 1
            e = APIError(
                502, "the replica serving this stream stopped; the output above is incomplete", type="server_error"
            )
            yield sse(e.body())
            yield "data: [DONE]\n\n"
        finally:
            stream.cancel()
