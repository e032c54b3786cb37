"""The front of several engine replicas: reads a request, routes it, relays the answer.

``create_gateway_app(replicas, router, ...)`` returns a FastAPI app with the OpenAI server's routes
(every ``/v1`` call, ``/metrics``, ``/health``). A request body is read under the same size limit,
content-type and API-key checks as `openai_server` (the replica checks again), its prompt tokenized
for the router (`routing.Router`), and the request handed whole to the chosen replica's own
OpenAI app (`ReplicaClient.stream`), whose answer is relayed part by part.

Faults: a replica that dies before its answer began (a non-streaming answer begins when it is
complete, a stream once the engine took the request) is left out and the request re-sent to
another replica; a stream it dies in ends with an OpenAI error event and ``data: [DONE]``. A
replica is out of routing from the first failed call or the ``max_failed_polls``-th failed report
until it reports again (Ray restarts it; a fresh replica reports once its engine is ready).
"""
import asyncio
import contextlib
import json
import time
from typing import AsyncIterator, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from jpaged.entrypoints.openai_server import (APIError, APIKeyMiddleware, JSONContentTypeMiddleware, error_response,
                                              read_body)
from jpaged.entrypoints.training_routes import TRAINING_ROUTES
from jpaged.logger import logger
from jpaged.serve.asgi_call import BODY
from jpaged.serve.routing import Router

PER_REPLICA_ROUTES = TRAINING_ROUTES + ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
REPLICA_HEADER = "x-jpaged-replica"  # which replica answered (a response header)
HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}


class ReplicaUnavailable(Exception):
    """The replica is dead or unreachable (its process ended, it is restarting)."""


class ReplicaClient(Protocol):
    """One engine replica as the gateway reaches it (`jpaged.serve.ray.RayReplicaClient`)."""

    name: str

    def stream(self, method: str, path: str, query: bytes, headers: list, body: bytes) -> AsyncIterator[tuple]:
        """The replica's answer: ``("start", status, headers)``, then ``("body", bytes)`` parts
        (`asgi_call.call_asgi`); raises ReplicaUnavailable when the replica dies."""

    async def report(self) -> dict:
        """The replica's routing report (`replica_report`)."""


def prompt_tokens(path: str, data: dict, tokenizer, chat_template: str | None):
    """(the first prompt's token ids or None, cache_salt) of a request body, as the router sees it:
    the token ids the replica will compute, when the gateway has the tokenizer."""
    salt = data.get("cache_salt") if isinstance(data.get("cache_salt"), str) else None
    try:
        if path == "/v1/completions":
            prompt = data.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                return (tokenizer.encode(prompt) if tokenizer is not None else None), salt
            if isinstance(prompt, list) and all(type(t) is int for t in prompt):
                return prompt, salt
        elif path == "/v1/chat/completions" and tokenizer is not None and isinstance(data.get("messages"), list):
            from jpaged.engine.chat_template import apply_chat_template

            rendered = apply_chat_template(tokenizer, data["messages"], chat_template,
                                           data.get("add_generation_prompt", True) is not False)
            return rendered["prompt_token_ids"], salt
    except Exception:  # noqa: BLE001 -- a prompt the replica will refuse: routed by load, the replica answers
        pass
    return None, salt


class Gateway:
    """The routing state and the request relay of `create_gateway_app`."""

    def __init__(self, replicas: list[ReplicaClient], router: Router, *, tokenizer=None, chat_template=None,
                 max_body_bytes: int, poll_interval: float = 0.5, report_timeout: float = 5.0,
                 max_failed_polls: int = 3):
        self.replicas = {r.name: r for r in replicas}
        self.router, self.tokenizer, self.chat_template = router, tokenizer, chat_template
        self.max_body_bytes, self.poll_interval, self.report_timeout = max_body_bytes, poll_interval, report_timeout
        self.max_failed_polls = max_failed_polls
        self._failed_polls = {name: 0 for name in self.replicas}
        self._down = {name: asyncio.Event() for name in self.replicas}
        self.registry = CollectorRegistry()
        self.requests = Counter("jpaged:router_requests", "Requests the gateway ended, by replica and outcome "
                                "(ok, error: the replica died in its stream, resent: re-sent elsewhere, "
                                "unavailable: no replica ready).", ["replica", "outcome"], registry=self.registry)
        self.prompt_blocks = Counter("jpaged:router_prompt_blocks", "Full prompt blocks the router looked up.",
                                     registry=self.registry)
        self.matched_blocks = Counter("jpaged:router_matched_blocks", "Prompt blocks the chosen replica held.",
                                      ["replica"], registry=self.registry)
        self.registry.register(_ReplicaGauges(self))
        self._merged = _MergedReplicaMetrics()
        self.registry.register(self._merged)

    # Replica state ----------------------------------------------------------------------------------
    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(name) for name in self.replicas))

    async def _poll(self, name: str) -> None:
        state = self.router.replicas[name]
        try:
            report = await asyncio.wait_for(self.replicas[name].report(), self.report_timeout)
        except ReplicaUnavailable:
            self.mark_down(name)
        except Exception as e:  # noqa: BLE001 -- a slow or failing report: out after a few
            self._failed_polls[name] += 1
            if self._failed_polls[name] >= self.max_failed_polls and state.ready:
                logger.warning("gateway: replica %s failed %d reports (%s); out of routing", name,
                               self._failed_polls[name], type(e).__name__)
                self.mark_down(name)
        else:
            if not state.ready:
                logger.info("gateway: replica %s is ready", name)
            self._failed_polls[name] = 0
            self._down[name].clear()
            state.update(report)

    def mark_down(self, name: str) -> None:
        state = self.router.replicas[name]
        if state.ready:
            logger.warning("gateway: replica %s is unavailable; out of routing until it reports again", name)
        state.ready = False
        self._down[name].set()

    async def poll_forever(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.poll_interval)

    async def wait_ready(self, timeout: float) -> bool:
        """Whether some replica reported within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.router.ready() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return bool(self.router.ready())

    # Relay -----------------------------------------------------------------------------------------
    async def _next(self, name: str, parts) -> tuple:
        """The replica's next part; ReplicaUnavailable if it dies (or is found dead) first."""
        down = asyncio.ensure_future(self._down[name].wait())
        part = asyncio.ensure_future(parts.__anext__())
        try:
            await asyncio.wait({down, part}, return_when=asyncio.FIRST_COMPLETED)
            if part.done():
                return part.result()
            raise ReplicaUnavailable(f"replica {name} is unavailable")
        finally:
            down.cancel()
            if not part.done():
                part.cancel()

    async def forward(self, raw: Request) -> Response:
        body = await read_body(raw, self.max_body_bytes)
        path, token_ids, salt = raw.url.path, None, None
        if raw.method == "POST":
            try:
                data = json.loads(body)
            except ValueError:
                data = None
            if isinstance(data, dict):
                token_ids, salt = await asyncio.to_thread(prompt_tokens, path, data, self.tokenizer,
                                                          self.chat_template)
        headers = [(k, v) for k, v in raw.headers.raw if k.lower() not in HOP_HEADERS]
        tried: set[str] = set()
        while True:
            replica, matched = self.router.choose(token_ids, salt, exclude=tried)
            if replica is None:
                self.requests.labels("none", "unavailable").inc()
                raise APIError(503, "no engine replica is ready; retry later", type="server_error",
                               code="no_replica")
            if token_ids is not None and replica.block_size:
                self.prompt_blocks.inc(max(0, (len(token_ids) - 1) // replica.block_size))
                self.matched_blocks.labels(replica.name).inc(matched)
            name = replica.name
            tried.add(name)
            replica.in_flight += 1
            parts = self.replicas[name].stream(raw.method, path, raw.url.query.encode(), headers, body)
            try:
                start = await self._next(name, parts)
            except ReplicaUnavailable:
                replica.in_flight -= 1
                self.mark_down(name)
                self.requests.labels(name, "resent").inc()
                await _close(parts)
                continue
            except BaseException:
                replica.in_flight -= 1
                await _close(parts)
                raise
            return self._respond(name, start, parts)

    def _respond(self, name: str, start: tuple, parts) -> Response:
        _, status, headers = start
        media_type = dict(headers).get(b"content-type", b"").decode("latin-1")
        kept = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k.lower() not in HOP_HEADERS}
        kept[REPLICA_HEADER] = name

        async def relay():
            outcome = "ok"
            try:
                while True:
                    try:
                        kind, chunk = await self._next(name, parts)
                    except StopAsyncIteration:
                        return
                    if kind == BODY:
                        yield chunk
            except ReplicaUnavailable:
                outcome = "error"
                self.mark_down(name)
                if media_type.startswith("text/event-stream"):
                    error = {"error": {"message": f"the engine replica serving this request ({name}) failed; "
                                       "retry", "type": "server_error", "param": None, "code": "replica_failed"}}
                    yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
            finally:
                self.router.replicas[name].in_flight -= 1
                self.requests.labels(name, outcome).inc()
                await _close(parts)

        return StreamingResponse(relay(), status_code=status, headers=kept, media_type=media_type or None)

    # Metrics ---------------------------------------------------------------------------------------
    async def render_metrics(self) -> bytes:
        """The gateway's own series and every ready replica's, each labelled ``replica``."""
        texts = await asyncio.gather(*(self._replica_metrics(r.name) for r in self.router.ready()))
        self._merged.texts = [t for t in texts if t is not None]
        return generate_latest(self.registry)

    async def _replica_metrics(self, name: str):
        try:
            return name, await asyncio.wait_for(_read_all(self.replicas[name].stream("GET", "/metrics", b"", [], b"")),
                                                self.report_timeout)
        except Exception:  # noqa: BLE001 -- a replica going away between report and scrape
            return None


async def _read_all(parts) -> str:
    chunks = [chunk async for kind, *rest in parts if kind == BODY for chunk in rest]
    return b"".join(chunks).decode()


async def _close(parts) -> None:
    try:
        await parts.aclose()
    except Exception:  # noqa: BLE001 -- closing a dead replica's stream
        pass


class _ReplicaGauges:
    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    def collect(self):
        ready = GaugeMetricFamily("jpaged:router_replica_ready", "1 while the replica is in routing.",
                                  labels=["replica"])
        in_flight = GaugeMetricFamily("jpaged:router_in_flight_requests", "Requests sent to the replica, not ended.",
                                      labels=["replica"])
        for state in self.gateway.router.replicas.values():
            ready.add_metric([state.name], float(state.ready))
            in_flight.add_metric([state.name], state.in_flight)
        yield ready
        yield in_flight


class _MergedReplicaMetrics:
    """The replicas' own series (fetched just before a scrape), each sample labelled ``replica``."""

    def __init__(self):
        self.texts: list[tuple[str, str]] = []

    def collect(self):
        families: dict[str, Metric] = {}
        for name, text in self.texts:
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                for s in family.samples:
                    merged.add_sample(s.name, {**s.labels, "replica": name}, s.value, s.timestamp, s.exemplar)
        yield from families.values()


def create_gateway_app(gateway: Gateway, *, api_key: str | None = None) -> FastAPI:
    """The gateway's FastAPI app (see the module docstring); it polls the replicas while it runs."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        poller = asyncio.create_task(gateway.poll_forever())
        yield
        poller.cancel()

    app = FastAPI(title="jpaged gateway", lifespan=lifespan)
    app.state.gateway = gateway
    app.add_middleware(JSONContentTypeMiddleware)
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.get("/health")
    async def health():
        if not gateway.router.ready():
            return error_response(503, "no engine replica is ready", type="server_error", code="no_replica")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(await gateway.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "POST", "OPTIONS"])
    async def forward(raw: Request, path: str):
        if raw.url.path in PER_REPLICA_ROUTES:
            raise APIError(501, f"{raw.url.path} acts on one engine; behind the gateway, call each replica's "
                           "own server", type="server_error", code="not_supported_by_gateway")
        return await gateway.forward(raw)

    return app
