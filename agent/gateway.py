"""The gateway: an OpenAI-compatible HTTP API in front of a fleet's heads.

Text exists only here: requests are authenticated, validated (:mod:`.openai_schema`), rendered
and tokenized (:mod:`.prompts`), admitted to one head (:mod:`.admission`: every pipeline group
of every plan given has a head, and a request goes to the ready one with the most free
capacity), sent to that head as token ids (:mod:`.headlink`), and the tokens that come back are
detokenized and cut at stop strings (:mod:`.textstream`) into OpenAI responses or server-sent
events ending in ``data: [DONE]``.

Invariants:
- every admitted request ends in exactly one of: finished at its head, or a ``cancel`` sent to
  its head (stop string matched, client went away, error), so no slot on any stage leaks;
- a request waits for its first output before the response starts, so a refusal (busy, not
  ready, bad input) is an HTTP status with an OpenAI-shaped error body, not a broken stream;
- a client that disconnects is noticed within ``DISCONNECT_CHECK_SECONDS``;
- text work whose cost grows with the request (parsing and validating the body, rendering,
  tokenizing a prompt; detokenizing a burst of over ``DETOKENIZE_INLINE_TOKENS``) runs in a small thread pool, never in the event
  loop, so one huge prompt does not stall other streams or ``/healthz``; a token or a few are
  detokenized in the loop (a short window each: a thread hop would cost more than the decode);
- a request its head fails (a broken chain, a head gone silent) is tried again on another ready
  (or healing: see below) head, at most ``retries`` times and never twice on one head, while
  nothing of it has reached the client: a streamed request until its first token, a non-streamed
  one until it finishes.
- a request that finds no head ready while some are healing (alive, a pipeline paused for a lost
  stage or answering late: :mod:`.headlink`) waits in line for one, up to the replay deadline.
- a streamed request whose head fails it after text was sent (the head died, or its pipeline
  stayed paused for a lost stage over ``FAILOVER_SECONDS`` while another head is ready) fails
  over: the prompt plus every token the head sent is submitted as a continuation to another
  ready head (at most ``MAX_FAILOVERS`` times), which counts those tokens as the stream's output
  (its length rules, its sampler's draws and penalties), and the client's stream goes on from
  where it was, through the same detokenizer, with an undisturbed run's tokens. A head paused
  for a lost stage with no other head ready is waited for: its replay deadline ends the stream
  if it does not heal.

One module over 400 lines because a request's life (checks, admission, the head's stream, the
response's two shapes) shares :class:`Job` and the invariants above; the parts that stand alone
(schema, prompts, admission, the head link, text) are modules of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from modelfleet import __version__

from ..engine.errors import ErrorCode, ModelfleetError
from ..engine.sampling import SamplingParams, TokenLogprobs
from ..engine.spec import load_spec
from ..plan import FleetPlan, PlanError
from . import transport as wire
from .admission import Abandoned, Admission, Busy
from .headlink import HeadLink, Inbox
from .openai_schema import (
    _OFF_VALUES,
    SEED_MAX,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    describe,
    lone_surrogate,
)
from .prompts import PromptError, Prompts
from .sse import DONE, IDS_MARK, TEXT_MARK, TokenChunks, data_frame
from .structured import ToolCallParser, chat_messages, grammar_spec, split_tool_calls
from .textstream import Piece, TextStream

log = logging.getLogger("modelfleet.gateway")
DISCONNECT_CHECK_SECONDS = 0.2
# A request whose head answers but has not reported ready (nor paused) for this long fails: its
# chain may be gone, and then no answer (not even an error) would ever come. A head that does not
# answer at all is gone after its own measured deadline (agent.headlink).
HEAD_SILENCE_SECONDS = 5.0
# A stream whose head is alive but paused (a lost stage, see agent.head) this long moves to another
# ready head, if there is one: shorter than the head's replay deadline, longer than a quick restart.
FAILOVER_SECONDS = 15.0
MAX_FAILOVERS = 3
TEXT_THREADS = 2  # tokenizing threads: prompts beyond these wait their turn, off the event loop
DETOKENIZE_INLINE_TOKENS = 16
ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/metrics")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class GatewayConfig:
    plan: FleetPlan
    max_streams: int | None  # streams per head; None: each plan's serving.max_streams
    max_queue: int
    queue_timeout_seconds: float
    api_keys: frozenset[str] = frozenset()
    metrics_auth: bool = False
    max_body_bytes: int = 4 << 20
    model_dir: Path | None = None  # default: the plan's model path
    keys: wire.KeyPair | None = None  # the fleet's CURVE keys, when the head requires them
    ready_poll_seconds: float = 0.5
    more_plans: tuple[FleetPlan, ...] = ()  # further fleets serving the same served_name
    retries: int = 1  # further heads a request its head failed may be tried on

    @classmethod
    def of(cls, plan: FleetPlan, **overrides: Any) -> GatewayConfig:
        """The queue's limits default to the (first) plan's serving limits; ``None`` overrides are ignored."""
        serving = plan.serving
        limits = dict(max_streams=None, max_queue=serving.max_queue,
                      queue_timeout_seconds=serving.queue_timeout_seconds)  # fmt: skip
        return cls(plan=plan, **{**limits, **{k: v for k, v in overrides.items() if v is not None}})

    @property
    def plans(self) -> tuple[FleetPlan, ...]:
        return (self.plan, *self.more_plans)

    def heads(self) -> list[tuple[str, int]]:
        """(address, stream limit) of every head: each group of each plan, in order."""
        heads = [(group.stages[0].address, self.max_streams or plan.streams_per_group)
                 for plan in self.plans for group in plan.groups]  # fmt: skip
        name = self.plan.model.served_name
        for p, plan in enumerate(self.plans):
            if plan.model.served_name != name:
                raise PlanError(f"plan {p + 1} serves {plan.model.served_name!r} but plan 1 serves {name!r}; "
                                "the fleets behind one gateway must serve one model.served_name")  # fmt: skip
        addresses = [address for address, _ in heads]
        if duplicate := next((a for a in addresses if addresses.count(a) > 1), None):
            raise PlanError(f"the head at {duplicate} appears in more than one group or plan")
        return heads


class ApiKeysError(ModelfleetError):
    """The API keys given cannot guard the gateway (none in a source that was given, a bad line)."""


def parse_api_keys(text: str, where: str) -> list[str]:
    """Keys of an API keys file: one per line; ``#`` starts a comment, on a line of its own or
    after the key; blank lines are skipped. A key holds no whitespace and no ``#``."""
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        key = line.split("#", 1)[0].strip()
        if any(c.isspace() for c in key):
            raise ApiKeysError(f"{where}, line {number}: a key cannot hold whitespace; write one key per line "
                               "(a comment after a key starts with #)")  # fmt: skip
        keys += [key] if key else []
    return keys


def load_api_keys(path: Path | None, env_value: str | None, no_auth: bool = False) -> frozenset[str]:
    """Keys from a file (:func:`parse_api_keys`) and from MF_API_KEYS (comma-separated). Fails
    closed: a source that is given but holds no key is an error, not an open gateway; serving
    without keys takes ``no_auth`` (and then no source may be given)."""
    keys: list[str] = []
    given = []
    if path is not None:
        keys += parse_api_keys(path.read_text(), f"the API keys file {str(path)!r}")
        given.append(f"the API keys file {str(path)!r}")
    if env_value:
        keys += parse_api_keys(env_value.replace(",", "\n"), "MF_API_KEYS")
        given.append("MF_API_KEYS")
    if no_auth and given:
        raise ApiKeysError(f"--no-auth serves without API keys, but {' and '.join(given)} was given; drop one")
    if given and not keys:
        raise ApiKeysError(f"{' and '.join(given)} holds no API key (only blank lines or # comments), so every "
                           "request would be accepted; add a key (one per line), or pass --no-auth to serve "
                           "without keys")  # fmt: skip
    return frozenset(keys)


class ApiError(Exception):
    """An HTTP error with an OpenAI-shaped body: {"error": {message, type, param, code}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}  # fmt: skip

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_seconds: int | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_seconds = retry_after_seconds

    def body(self) -> dict[str, Any]:
        kind = self.TYPES.get(self.status, "invalid_request_error" if 400 <= self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_seconds)} if self.retry_after_seconds is not None else {}
        if self.status == 401:  # RFC 9110: a 401 names the scheme that would be accepted
            headers["WWW-Authenticate"] = 'Bearer realm="modelfleet"'
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


Body = CompletionRequest | ChatCompletionRequest | TokenizeRequest | DetokenizeRequest
REQUEST_MODELS: dict[str, type[Body]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema of ``app`` with each generating route's request body: the handlers read
    the body themselves (size limit first, then the model), so FastAPI cannot see the model."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in REQUEST_MODELS.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        _off_values_only(body)
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        ref = {"$ref": f"#/components/schemas/{model.__name__}"}
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": ref}},
        }
    return schema


def _off_values_only(body: dict[str, Any]) -> None:
    """Fields accepted only when off (openai_schema's ``_OFF_VALUES``) are ``Any`` to pydantic, so
    that the refusal can name them; the schema lists the values accepted, as the validator does."""
    for name, allowed in _OFF_VALUES.items():
        if name in body.get("properties", {}):
            body["properties"][name] = {"enum": list(allowed), "description": "accepted only when off"}


class BugsAnswered(APIRoute):
    """A route whose handler's bug (any exception but an HTTP error) becomes a 500 ApiError
    inside the app, like any other error: Starlette's last-resort handler for ``Exception``
    re-raises after answering, and the server then closes the keep-alive connection, so the
    client's next request on it would be reset. (A bug inside a streamed body, once the response
    started, still ends that response.)"""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answered(request: Request) -> Response:
            try:
                return await handler(request)
            except (ApiError, StarletteHTTPException):
                raise
            except Exception as exc:
                log.exception("unexpected error serving %s", request.url.path)
                raise ApiError(500, f"internal error: {type(exc).__name__}") from None

        return answered


@dataclass(frozen=True)
class HeadFailure:
    """How the gateway answers a head's error code: the HTTP status, whether the message is a
    stage's failure (prefixed for the client), and the ``reason`` label of a retry on another
    head (None: every head would answer alike, or the request's queue time is spent)."""

    status: int
    retry: str | None
    prefix: str = ""
    param: str | None = None
    retry_after_seconds: int | None = None


HEAD_FAILURES: dict[ErrorCode, HeadFailure] = {
    ErrorCode.INPUT: HeadFailure(400, None, param="prompt"),
    ErrorCode.CONTEXT_LENGTH: HeadFailure(400, None, param="prompt"),
    ErrorCode.BUSY: HeadFailure(429, "head_refused", retry_after_seconds=1),
    ErrorCode.QUEUE_TIMEOUT: HeadFailure(429, None, retry_after_seconds=1),
    ErrorCode.NOT_READY: HeadFailure(503, "head_refused", retry_after_seconds=1),
    ErrorCode.STAGE_LOST: HeadFailure(503, "stream_failed", "the fleet is not ready: ", retry_after_seconds=1),
    ErrorCode.UNAVAILABLE: HeadFailure(503, "stream_failed", "the fleet is not ready: ", retry_after_seconds=1),
    ErrorCode.REPLAY_TIMEOUT: HeadFailure(503, "stream_failed", "the fleet is not ready: ", retry_after_seconds=1),
    ErrorCode.CAPACITY: HeadFailure(500, "stream_failed", "the fleet failed the request: "),
    ErrorCode.MALFORMED: HeadFailure(500, "stream_failed", "the fleet failed the request: "),
    ErrorCode.INTERNAL: HeadFailure(500, "stream_failed", "the fleet failed the request: "),
}
CANCELLED_BY_HEAD = HeadFailure(500, None, "the fleet failed the request: ")


def head_failure(finish_reason: str, code: str | None) -> HeadFailure:
    """The answer to a head's ``cancelled``, or to its ``error`` with ``code``."""
    if finish_reason != "error" or code is None:
        return CANCELLED_BY_HEAD
    return HEAD_FAILURES[ErrorCode(code)]


def head_error(failure: HeadFailure, code: str | None, message: str) -> ApiError:
    """The head's refusal or failure as the HTTP error a client can act on (OpenAI's ``code``
    field carries the fleet's error code)."""
    return ApiError(failure.status, failure.prefix + message, failure.param, code, failure.retry_after_seconds)


class HeadsCollector:
    """Per-head series, labelled by the head's address: whether it is ready, and its streams."""

    def __init__(self, heads: list[HeadLink], admission: Admission):
        self.heads, self.admission = heads, admission

    def collect(self) -> Iterator[GaugeMetricFamily]:
        ready = GaugeMetricFamily("modelfleet_gateway_head_ready", "1 while this head reports ready.",
                                  labels=["head"])  # fmt: skip
        active = GaugeMetricFamily("modelfleet_gateway_head_active_streams", "Requests streaming on this head.",
                                   labels=["head"])  # fmt: skip
        limit = GaugeMetricFamily("modelfleet_gateway_head_max_streams", "This head's stream limit.", labels=["head"])
        for h, head in enumerate(self.heads):
            ready.add_metric([head.address], 1 if head.ready else 0)
            active.add_metric([head.address], self.admission.active_by_head[h])
            limit.add_metric([head.address], self.admission.limits[h])
        yield from (ready, active, limit)


class GatewayMetrics:
    def __init__(self, admission: Admission, heads: list[HeadLink]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("modelfleet_gateway_requests_total", "HTTP requests answered, by endpoint and status.",
                                ["endpoint", "status"], registry=r)  # fmt: skip
        self.time_to_first_token = Histogram("modelfleet_gateway_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.", buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.inter_token_latency = Histogram("modelfleet_gateway_inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of a request.", buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.e2e_request = Histogram("modelfleet_gateway_e2e_request_seconds",
            "Seconds from a request's arrival to its last token.", buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.prompt_tokens = Counter("modelfleet_gateway_prompt_tokens_total", "Prompt tokens admitted.", registry=r)
        self.generation_tokens = Counter("modelfleet_gateway_generation_tokens_total", "Tokens generated.", registry=r)
        self.retries = Counter("modelfleet_gateway_retries_total",
                               "Requests a head failed before any of their text was sent, tried on another head.",
                               ["reason"], registry=r)  # fmt: skip
        self.failovers = Counter("modelfleet_gateway_failovers_total",
                                 "Streams whose head failed them after text was sent, continued on another head.",
                                 ["reason"], registry=r)  # fmt: skip
        queue = Gauge("modelfleet_gateway_queue_depth", "Requests waiting for a free stream.", registry=r)
        queue.set_function(lambda: len(admission.waiting))
        active = Gauge("modelfleet_gateway_active_streams", "Requests streaming (admitted).", registry=r)
        active.set_function(lambda: admission.active)
        ready = Gauge("modelfleet_gateway_ready", "1 while at least one head reports ready.", registry=r)
        ready.set_function(lambda: 1 if any(h.ready for h in heads) else 0)
        heads_ready = Gauge("modelfleet_gateway_heads_ready", "Heads that report ready.", registry=r)
        heads_ready.set_function(lambda: sum(1 for h in heads if h.ready))
        r.register(HeadsCollector(heads, admission))  # type: ignore[arg-type]

    def answered(self, path: str, status: int) -> None:
        self.requests.labels(endpoint=path if path in ENDPOINTS else "other", status=str(status)).inc()


@dataclass
class Job:
    """One admitted-to-be request, its prompt and its response's identity."""

    body: CompletionRequest | ChatCompletionRequest
    prompt_ids: list[int]
    params: SamplingParams
    model: str
    arrived: float
    chat: bool
    index: int = 0  # the choice's index in the response
    prompt_index: int = 0  # which prompt of the request (a batch's)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    token_ids: list[int] = field(default_factory=list)  # sent to the client (a fresh retry starts over)
    generated: list[int] = field(default_factory=list)  # every token the heads sent (a continuation's prompt tail)
    failovers: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token sent, when asked
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # by prompt position (echo with logprobs)
    heads_tried: list[int] = field(default_factory=list)  # head indices, in the order of the attempts
    first_token_seen: bool = False  # by any attempt: time to first token is observed once
    checked_at: float = 0.0  # time.monotonic() when the client and head were last checked
    # the server tells the streamed response of a disconnect itself, which then ends the stream
    # (Starlette listens for it under ASGI spec < 2.4), so polling the client is not needed
    disconnect_watched: bool = False
    tool_calls: ToolCallParser | None = None  # a streamed chat that may call tools: its text split as it comes

    def __post_init__(self) -> None:
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    streamed_chars: int = 0  # the echo and the token texts streamed so far: completions' text_offset goes on from it

    def usage(self) -> dict[str, int]:
        prompt, generated = len(self.prompt_ids), len(self.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def _usage(jobs: list[Job]) -> dict[str, int]:
    """A request's usage: each prompt counted once, every choice's tokens (best_of's unreturned too)."""
    prompts = {job.prompt_index: len(job.prompt_ids) for job in jobs}
    prompt, generated = sum(prompts.values()), sum(len(job.token_ids) for job in jobs)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


@dataclass
class Text:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token id, when asked


@dataclass
class Outputs:
    """The head's outputs for one request that were waiting together, merged."""

    token_ids: list[int]
    finish_reason: str | None
    code: str | None
    error: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token id, when asked
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # by prompt position

    @classmethod
    def of(cls, msg: wire.OutputMsg) -> Outputs:
        outputs = cls(list(msg.token_ids), msg.finish_reason, msg.code, msg.error, [r.value() for r in msg.logprobs])
        outputs.prompt_logprobs = {r.row: r.value() for r in msg.prompt_logprobs}
        return outputs

    def add(self, msg: wire.OutputMsg) -> None:
        self.token_ids += msg.token_ids
        self.logprobs += [r.value() for r in msg.logprobs]
        self.prompt_logprobs.update((r.row, r.value()) for r in msg.prompt_logprobs)
        self.finish_reason, self.code, self.error = msg.finish_reason, msg.code, msg.error


@dataclass
class Finish:
    reason: str
    error: ApiError | None = None
    retry: str | None = None  # with an error that another head may not repeat: the retries_total reason


class ClientGone(Exception):
    """The HTTP client disconnected while its request ran."""


class HeadSilent(Exception):
    """The head stopped reporting ready while a request waited for it (it may be gone)."""


class HeadPaused(HeadSilent):
    """The head is alive but its pipeline has been paused for a lost stage too long, and another head is ready."""


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        plan = config.plan
        model_dir = config.model_dir or Path(plan.model.path)
        self.spec = load_spec(model_dir)
        self.context_length = min(p.serving.context_length for p in config.plans)
        self.prompts = Prompts(model_dir, self.spec.vocab_size, self.context_length, self.spec.eos_token_ids)
        heads = config.heads()
        self.heads = [HeadLink(address, config.keys, config.ready_poll_seconds, DISCONNECT_CHECK_SECONDS)
                      for address, _ in heads]  # fmt: skip
        self.admission = Admission([limit for _, limit in heads], config.max_queue, config.queue_timeout_seconds,
                                   ready=lambda h: self.heads[h].ready, healing=lambda h: self.heads[h].healing,
                                   heal_timeout_seconds=max(p.serving.replay_timeout_seconds for p in config.plans))  # fmt: skip
        self.metrics = GatewayMetrics(self.admission, self.heads)
        self.model_name = plan.model.served_name
        self.created = int(time.time())  # /v1/models' "created": when this gateway began serving the model
        self.text_pool = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="gateway-text")
        self.app = self._build_app()

    @property
    def ready(self) -> bool:
        """At least one head reports ready."""
        return any(head.ready for head in self.heads)

    def _check_serving(self) -> None:
        """A request is taken while some head is ready or healing (it waits in line for it)."""
        if not self.ready and not any(head.healing for head in self.heads):
            raise ApiError(503, "the fleet is not ready (no head reports ready); retry shortly",
                           retry_after_seconds=1)  # fmt: skip

    # ---- the HTTP surface -----------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            for head in self.heads:
                await head.start()
            try:
                yield
            finally:
                for head in self.heads:
                    await head.stop()
                self.text_pool.shutdown(wait=False, cancel_futures=True)

        app = FastAPI(title="modelfleet gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
        app.router.route_class = BugsAnswered

        @app.exception_handler(ApiError)
        async def on_api_error(request: Request, exc: ApiError) -> Response:
            self.metrics.answered(request.url.path, exc.status)
            return exc.response()

        @app.exception_handler(StarletteHTTPException)
        async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
            self.metrics.answered(request.url.path, exc.status_code)
            return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").response()

        @app.exception_handler(Exception)
        async def on_bug(request: Request, exc: Exception) -> Response:
            log.exception("unexpected error serving %s", request.url.path)
            self.metrics.answered(request.url.path, 500)
            return ApiError(500, f"internal error: {type(exc).__name__}").response()

        app.add_api_route("/healthz", self.healthz, methods=["GET"])
        app.add_api_route("/health", self.healthz, methods=["GET"])  # vLLM's name, which guidellm probes
        app.add_api_route("/version", self.version, methods=["GET"])
        app.add_api_route("/readyz", self.readyz, methods=["GET"])
        app.add_api_route("/metrics", self.metrics_text, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self.model_card, methods=["GET"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        served_schema = openapi_schema(app)
        app.openapi = lambda: served_schema  # type: ignore[method-assign]  # what /openapi.json answers
        return app

    async def healthz(self) -> Response:
        return PlainTextResponse("ok\n")

    async def readyz(self) -> Response:
        ready = sum(1 for head in self.heads if head.ready)
        if ready:
            return PlainTextResponse(f"ready: {ready} of {len(self.heads)} heads\n")
        return PlainTextResponse(f"not ready: none of the {len(self.heads)} heads reports ready\n", status_code=503)

    async def metrics_text(self, request: Request) -> Response:
        if self.config.metrics_auth:
            self._authorize(request)
        self.metrics.answered("/metrics", 200)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def version(self) -> Response:
        return JSONResponse({"version": __version__})

    def _card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "modelfleet",
                "root": self.model_name, "parent": None, "max_model_len": self.context_length}  # fmt: skip

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        self.metrics.answered("/v1/models", 200)
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model_card(self, request: Request, model_id: str) -> Response:
        self._authorize(request)
        self._check_model(model_id)
        self.metrics.answered("/v1/models", 200)
        return JSONResponse(self._card())

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt (or chat messages, rendered) -> its token ids, as generation sees them."""
        self._authorize(request)
        body = await self._body(TokenizeRequest, request)
        self._check_model(body.model)
        if body.messages is not None:
            messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]
            ids = await self._prompt_off_loop(lambda: self.prompts.chat(messages, body.add_generation_prompt))
        else:
            assert body.prompt is not None
            ids = await self._prompt_off_loop(lambda: self.prompts.completion(body.prompt))
        answer: dict[str, Any] = {"count": len(ids), "max_model_len": self.context_length, "tokens": ids,
                                  "token_strs": self.prompts.token_strings(ids) if body.return_token_strs else None}  # fmt: skip
        return JSONResponse(answer)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: token ids -> text."""
        self._authorize(request)
        body = await self._body(DetokenizeRequest, request)
        self._check_model(body.model)
        text = self._prompt(lambda: [self.prompts.text(body.tokens)])[0]
        return JSONResponse({"prompt": text})

    async def completions(self, request: Request) -> Response:
        arrived = time.perf_counter()
        self._authorize(request)
        body = await self._body(CompletionRequest, request)
        assert isinstance(body, CompletionRequest)
        self._check_model(body.model)
        prompts = [await self._prompt_off_loop(lambda p=p: self.prompts.completion(p)) for p in body.prompt_values]  # type: ignore[misc]
        grammar = await self._grammar(body)
        return await self._serve_all(request, self._jobs(body, prompts, arrived, grammar))

    async def chat_completions(self, request: Request) -> Response:
        arrived = time.perf_counter()
        self._authorize(request)
        body = await self._body(ChatCompletionRequest, request)
        assert isinstance(body, ChatCompletionRequest)
        self._check_model(body.model)
        template = self.prompts.chat_template
        messages, extra = chat_messages(body, template.variables if template is not None else frozenset())
        ids = await self._prompt_off_loop(
            lambda: self.prompts.chat(messages, body.add_generation_prompt, body.continue_final_message, extra)
        )
        grammar = await self._grammar(body)
        return await self._serve_all(request, self._jobs(body, [ids], arrived, grammar))

    async def _grammar(self, body: CompletionRequest | ChatCompletionRequest) -> str | None:
        """The request's grammar spec (:mod:`.structured`), checked in the text pool (a large schema takes ms)."""
        if self.prompts.tokenizer is None and (
            (body.response_format is not None and body.response_format.type != "text")
            or (isinstance(body, ChatCompletionRequest) and body.calls_tools)
        ):
            raise ApiError(400, "structured output needs the checkpoint's tokenizer.json, which it does not have",
                           "response_format")  # fmt: skip
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.text_pool, lambda: self._prompt_value(lambda: grammar_spec(body)))

    # ---- checks ---------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if not self.config.api_keys:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        given_bytes = given.strip().encode()
        # compare with every key (no early exit) so timing says nothing about which one matched
        matched = False
        for key in self.config.api_keys:
            matched |= hmac.compare_digest(given_bytes, key.encode())
        if scheme.lower() != "bearer" or not matched:
            raise ApiError(
                401, "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )

    async def _body(self, model: type[Body], request: Request) -> Any:
        """The body, read here, parsed and validated in the text pool (a 4 MiB body costs tens of ms)."""
        raw = await self._raw(request)
        return await asyncio.get_running_loop().run_in_executor(self.text_pool, self._parse, model, raw)

    @classmethod
    def _parse(cls, model: type[Body], raw: bytes) -> Any:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {str(exc)[:200]}") from None
        return cls._validate(model, data)

    async def _raw(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        too_big = ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    def _validate(model: type[Body], data: Any) -> Any:
        if not isinstance(data, dict):
            raise ApiError(400, f"the request body must be a JSON object, not {type(data).__name__}")
        if (where := lone_surrogate(data)) is not None:
            raise ApiError(400, f"{where} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair), "
                                "which is not text; send the character itself or a complete surrogate pair", where)  # fmt: skip
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            message, param = describe(exc)
            raise ApiError(400, message, param) from None

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")  # fmt: skip

    @staticmethod
    def _prompt(make: Any) -> list[int]:
        return list(Gateway._prompt_value(make))

    @staticmethod
    def _prompt_value(make: Callable[[], Any]) -> Any:
        try:
            return make()
        except PromptError as exc:
            raise ApiError(400, str(exc), exc.param) from None

    async def _prompt_off_loop(self, make: Callable[[], list[int]]) -> list[int]:
        """:meth:`_prompt` in the text pool: rendering and tokenizing cost grows with the prompt."""
        return await asyncio.get_running_loop().run_in_executor(self.text_pool, self._prompt, make)

    async def _detokenize(self, text: TextStream, token_ids: Sequence[int]) -> Piece:
        if len(token_ids) <= DETOKENIZE_INLINE_TOKENS:
            return text.push(token_ids)
        return await asyncio.get_running_loop().run_in_executor(self.text_pool, text.push, token_ids)

    def _params(self, body: CompletionRequest | ChatCompletionRequest, prompt_tokens: int,
                logprobs: int | None, seed: int | None, grammar: str | None = None) -> SamplingParams:  # fmt: skip
        """``logprobs``: alternatives the tail reports per token (None: none); ``seed``: this
        choice's; ``grammar``: the structured-output spec its tokens must follow."""
        # max_tokens 0 (echo, scoring the prompt) runs one step, whose token the client never sees
        max_tokens = max(1, self._prompt(lambda: [self.prompts.max_tokens(prompt_tokens, body.max_tokens)])[0])
        echo = isinstance(body, CompletionRequest) and body.echo
        eos = () if body.ignore_eos else self.prompts.eos_token_ids
        asked = self._prompt(lambda: self.prompts.check_stop_ids(body.stop_token_ids or []))
        stop_ids = tuple(dict.fromkeys([*eos, *asked]))
        bias = body.logit_bias_pairs
        if bad := next(((i, t) for i, (t, _) in enumerate(bias) if t >= self.spec.vocab_size), None):
            raise ApiError(400, f"logit_bias names token {bad[1]}, outside the vocabulary [0, {self.spec.vocab_size})",
                           "logit_bias")  # fmt: skip
        return SamplingParams(
            temperature=body.temperature, top_p=body.top_p, top_k=max(0, body.top_k), min_p=body.min_p, seed=seed,
            max_tokens=max_tokens, stop_token_ids=stop_ids, logprobs=logprobs,
            prompt_logprobs=body.top_logprobs_asked if echo else None,
            frequency_penalty=body.frequency_penalty or 0.0, presence_penalty=body.presence_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0, min_tokens=body.min_tokens,
            logit_bias_ids=tuple(t for t, _ in bias), logit_bias_values=tuple(b for _, b in bias), grammar=grammar,
        )  # fmt: skip

    def _jobs(self, body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
              arrived: float, grammar: str | None = None) -> list[Job]:  # fmt: skip
        """One stream per prompt and choice: n of each (best_of, when larger, ranked at the end).
        Choice c of a seeded request samples with seed + c, so the choices differ and repeat."""
        chat = isinstance(body, ChatCompletionRequest)
        best_of = body.best_of if isinstance(body, CompletionRequest) and body.best_of else body.n
        asked = body.top_logprobs_asked
        # ranking best_of > n needs each choice's log-probability, reported or not
        logprobs = asked if best_of == body.n or asked is not None else 0
        jobs = []
        for p, ids in enumerate(prompts):
            for c in range(best_of):
                seed = None if body.seed is None else (body.seed + c) % (SEED_MAX + 1)
                params = self._params(body, len(ids), logprobs, seed, grammar)
                jobs.append(Job(body, ids, params, self.model_name, arrived, chat, index=p * best_of + c,
                                prompt_index=p))  # fmt: skip
                if isinstance(body, ChatCompletionRequest) and body.stream and body.calls_tools:
                    jobs[-1].tool_calls = ToolCallParser()
        return jobs

    # ---- serving --------------------------------------------------------------------------

    async def _serve(self, request: Request, job: Job) -> Response:
        path = request.url.path
        self._check_serving()
        events = self._generate(request, job)
        try:
            first = await anext(events)  # admission and the head's first answer happen here
            if isinstance(first, Finish) and first.error is not None:
                raise first.error
        except Busy as exc:
            raise ApiError(exc.status, str(exc), retry_after_seconds=exc.retry_after_seconds) from None
        except (ClientGone, Abandoned):
            self.metrics.answered(path, 499)
            return Response(status_code=499)
        except BaseException:
            await events.aclose()
            raise
        if job.body.stream:
            self.metrics.answered(path, 200)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            watched = _streaming_watches_disconnect(request.scope)
            return StreamingResponse(self._sse(job, first, events, watched), media_type="text/event-stream",
                                     headers=headers)  # fmt: skip
        try:
            payload = await self._collect(job, _chain(first, events))
        except ClientGone:
            self.metrics.answered(path, 499)
            return Response(status_code=499)
        self.metrics.answered(path, 200)
        return JSONResponse(payload)

    async def _generate(self, request: Request, job: Job) -> AsyncGenerator[Text | Finish, None]:
        """Text pieces, then one Finish, of the first attempt its head does not fail while none of
        it reached the client: a streamed attempt's pieces pass on at once, a non-streamed one's
        once it succeeds, so the client never sees a part of a failed attempt."""
        failure: Finish | None = None
        text: TextStream | None = None  # kept by a continuation, new for a fresh try
        while True:
            held: list[Text] = []
            continuing = bool(job.body.stream and job.generated)
            if not continuing:
                text = TextStream(self.prompts.tokenizer, job.body.stop_strings)
            assert text is not None
            if continuing and self._at_length(job):  # the head died between the last token and its finish
                yield Text(text.finish(), [])
                yield Finish("length")
                return
            async with contextlib.aclosing(self._attempt(request, job, failure, text)) as events:
                try:
                    async for event in events:
                        if isinstance(event, Text):
                            if job.body.stream:
                                yield event
                            else:
                                held.append(event)
                            continue
                        streamed = bool(job.body.stream and job.generated)
                        if event.retry is None or not (self._may_fail_over(job) if streamed else self._may_retry(job)):
                            for piece in held:
                                yield piece
                            yield event
                            return
                        failure = event
                        break
                except Busy as exc:  # a continuation found no head in time: its stream ends with the error
                    if not continuing:
                        raise
                    yield Finish("error", ApiError(exc.status, str(exc), retry_after_seconds=exc.retry_after_seconds))
                    return
            assert failure is not None and failure.retry is not None
            if job.body.stream and job.generated:
                job.failovers += 1
                self.metrics.failovers.labels(reason=failure.retry).inc()
            else:
                self.metrics.retries.labels(reason=failure.retry).inc()

    def _at_length(self, job: Job) -> bool:
        """The stream has all its tokens (max_tokens, or the context is full): nothing to continue."""
        generated = len(job.generated)
        return generated >= job.params.max_tokens or len(job.prompt_ids) + generated >= self.context_length

    def _may_fail_over(self, job: Job) -> bool:
        """A continuation is left, and a head other than the last one reports ready or is healing
        (admission waits for it, up to the replay deadline)."""
        others = [h for h, head in enumerate(self.heads) if (head.ready or head.healing) and h != job.heads_tried[-1]]
        return job.failovers < MAX_FAILOVERS and bool(others)

    def _may_retry(self, job: Job) -> bool:
        """Retries are left, and some head the request has not been on reports ready or is healing."""
        untried = [h for h, head in enumerate(self.heads) if (head.ready or head.healing) and h not in job.heads_tried]
        return len(job.heads_tried) <= self.config.retries and bool(untried)

    async def _attempt(
        self, request: Request, job: Job, after: Finish | None, text: TextStream
    ) -> AsyncGenerator[Text | Finish, None]:
        """One try on one head (not one tried before; ``after``: the last try's failure): text
        pieces, then one Finish; the slot and the head's stream are released in every case. A
        streamed request with tokens sent goes on as a continuation (prompt + those tokens)."""
        continuing = bool(job.body.stream and job.generated)
        waited = 0.0 if continuing else time.perf_counter() - job.arrived  # a continuation waits from its failover
        avoid = frozenset(job.heads_tried[-1:] if continuing else job.heads_tried)
        async with self.admission.slot(request.is_disconnected, avoid, waited) as h:
            head = self.heads[h]
            if after is not None and after.error is not None:
                what = (
                    f"after {len(job.generated)} tokens; continued"
                    if continuing
                    else "before any of it was sent; retried"
                )
                log.warning("request %s: head %s failed it %s (%s: %s) on head %s", job.id,
                            self.heads[job.heads_tried[-1]].address, what, after.retry, after.error.message,
                            head.address)  # fmt: skip
            job.heads_tried.append(h)
            prompt, params = job.prompt_ids, job.params
            if continuing:  # the head counts the output so far as the stream's (its length rules, its
                # sampler's draws and penalties); the prompt's log-probabilities were sent already
                prompt = [*job.prompt_ids, *job.generated]
                params = dataclasses.replace(job.params, prompt_logprobs=None)
            else:
                job.token_ids, job.generated, job.logprobs, job.prompt_logprobs = [], [], [], {}
            self.metrics.prompt_tokens.inc(len(prompt))
            request_id, inbox = head.submit(prompt, params, len(prompt) - len(job.prompt_ids))
            done, last_token_at = False, None
            try:
                while True:
                    try:
                        msg = await self._next(request, job, inbox, head)
                    except HeadSilent as exc:
                        reason = "head_paused" if isinstance(exc, HeadPaused) else "head_silent"
                        yield Finish("error", ApiError(503, str(exc), retry_after_seconds=1), reason)
                        return
                    job.prompt_logprobs.update(msg.prompt_logprobs)
                    if msg.token_ids and job.body.max_tokens == 0:  # the one step that scored the prompt
                        msg.token_ids, msg.logprobs = [], []
                    if msg.token_ids:
                        last_token_at = self._observe_tokens(job, len(msg.token_ids), last_token_at)
                        job.generated += msg.token_ids
                        piece = await self._detokenize(text, msg.token_ids)
                        job.token_ids += piece.token_ids
                        logprobs = msg.logprobs[: len(piece.token_ids)]
                        job.logprobs += logprobs
                        self.metrics.generation_tokens.inc(len(piece.token_ids))
                        yield Text(piece.text, piece.token_ids, logprobs)
                        if piece.stopped:
                            break  # the finally cancels the stream at the head
                    if msg.finish_reason is not None:
                        done = True
                        if msg.finish_reason in ("error", "cancelled"):
                            message = msg.error or "the head cancelled the request"
                            failure = head_failure(msg.finish_reason, msg.code)
                            yield Finish("error", head_error(failure, msg.code, message), failure.retry)
                            return
                        tail = text.finish()
                        yield Text(tail, [])
                        break
                self.metrics.e2e_request.observe(time.perf_counter() - job.arrived)
                yield Finish("stop" if text.stopped else msg.finish_reason or "stop")
            finally:
                if done:
                    head.forget(request_id)
                else:
                    head.cancel(request_id)

    def _observe_tokens(self, job: Job, count: int, last_token_at: float | None) -> float:
        """The latency histograms for ``count`` tokens that arrived together; returns their arrival
        time. Time to first token is the first of any attempt's (a streamed request is retried
        only before its first token, so for it this is the token the client got first)."""
        now = time.perf_counter()
        if last_token_at is not None:
            self.metrics.inter_token_latency.observe(now - last_token_at)
        elif not job.first_token_seen:
            job.first_token_seen = True
            self.metrics.time_to_first_token.observe(now - job.arrived)
        for _ in range(count - 1):
            self.metrics.inter_token_latency.observe(0.0)
        return now

    async def _next(self, request: Request, job: Job, inbox: Inbox, head: HeadLink) -> Outputs:
        """The outputs waiting (at least one, merged up to a finish: a gateway that fell behind,
        or tokens of one stream that arrived in one turn, go out in one chunk); checks on the way
        that the client is still there and the head alive."""
        outputs = Outputs.of(await self._first(request, job, inbox, head))
        while outputs.finish_reason is None and inbox.items:
            outputs.add(inbox.items.popleft())
        return outputs

    async def _first(self, request: Request, job: Job, inbox: Inbox, head: HeadLink) -> wire.OutputMsg:
        """The oldest output. The checks run when the head link wakes the waiting inbox (every
        DISCONNECT_CHECK_SECONDS) and, for a stream whose tokens come faster, by the clock; no
        timer is made per wait."""
        woken = False
        while True:
            now = time.monotonic()
            if woken or now - job.checked_at >= DISCONNECT_CHECK_SECONDS:
                job.checked_at = now
                if not job.disconnect_watched and await request.is_disconnected():
                    raise ClientGone()
                self._check_head(head)
            if inbox.items:
                return inbox.items.popleft()
            woken = await inbox.wait()

    def _check_head(self, head: HeadLink) -> None:
        """A head gone (no /status answer within its measured deadline) fails its requests; a
        paused one only once another head is ready; one whose answers are late is waited for."""
        if head.ready:
            return
        if head.gone:
            raise HeadSilent(f"the head at {head.address} has not answered for over {head.silence_deadline():.0f} s")
        if head.paused:
            if head.silent_for() > FAILOVER_SECONDS and any(h.ready for h in self.heads if h is not head):
                raise HeadPaused(f"the pipeline of the head at {head.address} has been paused for a lost stage "
                                 f"over {FAILOVER_SECONDS:g} s")  # fmt: skip
            return
        if head.answering and head.silent_for() > HEAD_SILENCE_SECONDS:
            raise HeadSilent(f"the head at {head.address} has not reported ready for over {HEAD_SILENCE_SECONDS:g} s")

    async def _collect(self, job: Job, events: AsyncIterator[Text | Finish]) -> dict[str, Any]:
        choice = await self._choice(job, events)
        return self._response(job, [choice], job.usage())

    def _response(self, job: Job, choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
        kind = "chat.completion" if job.chat else "text_completion"
        return {"id": job.id, "object": kind, "created": job.created, "model": job.model, "choices": choices,
                "usage": usage}  # fmt: skip

    async def _choice(self, job: Job, events: AsyncIterator[Text | Finish]) -> dict[str, Any]:
        """One choice of a non-streamed response, from its job's events."""
        pieces: list[str] = []
        finish = Finish("stop")
        async for event in events:
            if isinstance(event, Text):
                pieces.append(event.text)
            else:
                finish = event
        if finish.error is not None:
            raise finish.error
        text = "".join(pieces)
        choice: dict[str, Any] = {"index": job.index, "logprobs": None, "finish_reason": finish.reason}
        asked = job.body.top_logprobs_asked
        if job.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if isinstance(job.body, ChatCompletionRequest) and job.body.calls_tools:
                content, calls = split_tool_calls(text)
                if calls:
                    choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                    choice["finish_reason"] = "tool_calls" if finish.reason == "stop" else finish.reason
            if asked is not None:
                choice["logprobs"] = {"content": self._chat_logprobs(job.token_ids, job.logprobs, asked)}
        else:
            echo = self._echo(job)
            choice["text"] = echo + text
            if asked is not None:
                ids, entries = self._with_echo(job, job.token_ids, job.logprobs, bool(echo))
                choice["logprobs"] = self._completion_logprobs(ids, entries, asked, 0)
        if job.body.return_token_ids:
            choice.update(prompt_token_ids=job.prompt_ids, token_ids=job.token_ids)
        return choice

    def _echo(self, job: Job) -> str:
        body = job.body
        return self.prompts.text(job.prompt_ids) if isinstance(body, CompletionRequest) and body.echo else ""

    def _token_text(self, token_id: int) -> str:
        return self.prompts.token_strings([token_id])[0]

    @staticmethod
    def _with_echo(job: Job, ids: list[int], logprobs: list[TokenLogprobs],
                   echo: bool) -> tuple[list[int], list[TokenLogprobs | None]]:  # fmt: skip
        """The prompt's ids and log-probabilities (none for its first token) before ``ids``', when echoed."""
        if not echo:
            return ids, list(logprobs)
        prompt = [job.prompt_logprobs.get(q) for q in range(len(job.prompt_ids))]
        return [*job.prompt_ids, *ids], [*prompt, *logprobs]

    def _completion_logprobs(self, ids: list[int], logprobs: list[TokenLogprobs | None], top: int,
                             offset: int) -> dict[str, Any]:  # fmt: skip
        """OpenAI's completions shape: tokens, token_logprobs, top_logprobs ({text: logprob} of the
        ``top`` alternatives and the token itself, as vLLM gives them; null for an echoed prompt's
        first token) and text_offset."""
        tokens = [self._token_text(t) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        tops = [
            None if lp is None else
            {**{self._token_text(a): v for a, v in zip(lp.top_ids[:top], lp.top_logprobs[:top], strict=True)},
             tokens[i]: lp.logprob}
            for i, lp in enumerate(logprobs)
        ]  # fmt: skip
        return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
                "top_logprobs": tops, "text_offset": offsets}  # fmt: skip

    def _chat_logprobs(self, ids: list[int], logprobs: list[TokenLogprobs], top: int) -> list[dict[str, Any]]:
        """OpenAI's chat shape: per token its text, logprob, UTF-8 bytes and the ``top`` alternatives."""

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return [
            {**entry(t, lp.logprob),
             "top_logprobs": [entry(a, v) for a, v in zip(lp.top_ids[:top], lp.top_logprobs[:top], strict=True)]}
            for t, lp in zip(ids, logprobs, strict=False)
        ]  # fmt: skip

    # ---- several choices: n > 1, best_of, a batch of prompts ----------------------------------

    async def _serve_all(self, request: Request, jobs: list[Job]) -> Response:
        """One job is :meth:`_serve`'s; several run at once (each admitted on its own) and their
        choices are merged: a non-streamed response once all finished (best_of ranked by each
        choice's log-probability), a streamed one as their chunks come, each with its index."""
        if len(jobs) == 1:
            return await self._serve(request, jobs[0])
        path = request.url.path
        self._check_serving()
        for job in jobs[1:]:
            job.id = jobs[0].id
        streams = [self._generate(request, job) for job in jobs]
        stream = jobs[0].body.stream
        # the first event of each (streamed), or each whole choice; one failure cancels the others
        tasks: list[asyncio.Task[Any]] = [
            asyncio.create_task(anext(events) if stream else self._choice(job, events))  # type: ignore[arg-type]
            for job, events in zip(jobs, streams, strict=True)
        ]
        try:
            results = await asyncio.gather(*tasks)
            for first in results if stream else ():
                if isinstance(first, Finish) and first.error is not None:
                    raise first.error
        except BaseException as exc:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for events in streams:
                await events.aclose()
            if isinstance(exc, Busy):
                raise ApiError(exc.status, str(exc), retry_after_seconds=exc.retry_after_seconds) from None
            if isinstance(exc, ClientGone | Abandoned):
                self.metrics.answered(path, 499)
                return Response(status_code=499)
            raise
        self.metrics.answered(path, 200)
        if stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            merged = self._merged(jobs, list(results), streams)
            return StreamingResponse(self._sse_all(jobs, merged), media_type="text/event-stream", headers=headers)
        return JSONResponse(self._response(jobs[0], self._best(jobs, list(results)), _usage(jobs)))

    @staticmethod
    def _best(jobs: list[Job], choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The n choices of each prompt with the highest log-probability (all of them when best_of is n)."""
        n = jobs[0].body.n
        kept = []
        for p in sorted({job.prompt_index for job in jobs}):
            mine = [(job, c) for job, c in zip(jobs, choices, strict=True) if job.prompt_index == p]
            if len(mine) > n:
                mine = sorted(mine, key=lambda jc: -sum(lp.logprob for lp in jc[0].logprobs))[:n]
            for k, (_, choice) in enumerate(mine):
                if jobs[0].body.top_logprobs_asked is None:
                    choice["logprobs"] = None  # asked only to rank them
                kept.append({**choice, "index": p * n + k})
        return kept

    async def _merged(self, jobs: list[Job], firsts: list[Text | Finish],
                      streams: list[AsyncGenerator[Text | Finish, None]]) -> AsyncIterator[tuple[Job, Text | Finish]]:  # fmt: skip
        """Every job's events, as they come, each with its job; an error ends them all."""
        queue: asyncio.Queue[tuple[Job, Text | Finish | None]] = asyncio.Queue()

        async def pump(job: Job, events: AsyncGenerator[Text | Finish, None]) -> None:
            try:
                async for event in events:
                    await queue.put((job, event))
            finally:
                await queue.put((job, None))

        for job, first in zip(jobs, firsts, strict=True):
            queue.put_nowait((job, first))
        tasks = [asyncio.create_task(pump(job, events)) for job, events in zip(jobs, streams, strict=True)]
        try:
            running = len(tasks)
            while running:
                job, event = await queue.get()
                if event is None:
                    running -= 1
                    continue
                yield job, event
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for events in streams:
                await events.aclose()

    async def _sse_all(self, jobs: list[Job], merged: AsyncIterator[tuple[Job, Text | Finish]]) -> AsyncIterator[bytes]:
        started: set[int] = set()
        try:
            async for job, event in merged:
                if isinstance(event, Finish) and event.error is not None:
                    yield data_frame(event.error.body())
                    break
                for chunk in self._chunks(job, event, first=job.index not in started):
                    yield data_frame(chunk)
                started.add(job.index)
            else:
                if jobs[0].body.include_usage:
                    yield data_frame({**self._envelope(jobs[0]), "choices": [], "usage": _usage(jobs)})
            yield DONE
        finally:
            await _close(merged)

    async def _sse(self, job: Job, first: Text | Finish, events: AsyncIterator[Text | Finish],
                   disconnect_watched: bool = False) -> AsyncIterator[bytes]:  # fmt: skip
        """The chunks of ``first`` (not an error: that was answered with a status) and of the
        events after it; a token chunk after the first is spliced into a template made once per
        stream (see :mod:`.sse`), the others are built whole. ``disconnect_watched``: the response
        ends this stream itself when the client goes away (from here on, no need to poll it)."""
        job.disconnect_watched = disconnect_watched
        with_ids = job.body.return_token_ids
        tokens = self._token_chunks(job)
        try:
            for opening in self._chunks(job, first, first=True):  # the first says something (the role, at least)
                yield data_frame(opening)
            async for event in events:
                if type(event) is Text and job.body.top_logprobs_asked is None and job.tool_calls is None:
                    if event.text or (with_ids and event.token_ids):
                        yield tokens.frame(event.text, event.token_ids)
                    continue
                if isinstance(event, Finish) and event.error is not None:
                    yield data_frame(event.error.body())
                    break
                for chunk in self._chunks(job, event, first=False):
                    yield data_frame(chunk)
            else:
                if job.body.include_usage:
                    yield data_frame({**self._envelope(job), "choices": [], "usage": job.usage()})
            yield DONE
        finally:
            await _close(events)

    def _token_chunks(self, job: Job) -> TokenChunks:
        """The template of the stream's token chunks after the first: :meth:`_chunk`'s, markers in place."""
        chunk = self._chunk(job, Text(TEXT_MARK, []), first=False)
        assert chunk is not None
        if job.body.return_token_ids:
            chunk["choices"][0]["token_ids"] = IDS_MARK
        return TokenChunks.of(chunk)

    def _chunks(self, job: Job, event: Text | Finish, first: bool) -> list[dict[str, Any]]:
        """The chunks of one event: :meth:`_chunk`'s, or for a chat that may call tools, its text
        split into content and each tool call completed (one delta with the whole call, in
        OpenAI's shape), and ``tool_calls`` for the finish of a stream that called any."""
        parser = job.tool_calls
        if parser is None:
            return [c] if (c := self._chunk(job, event, first)) is not None else []
        calls: list[dict[str, Any]] = []
        if isinstance(event, Text):
            content, calls = parser.push(event.text)
            event = Text(content, event.token_ids, event.logprobs)
        else:
            rest = parser.finish()
            chunks = [c] if rest and (c := self._chunk(job, Text(rest, []), first)) is not None else []
            reason = "tool_calls" if parser.calls and event.reason == "stop" else event.reason
            return [*chunks, *([c] if (c := self._chunk(job, Finish(reason), first and not chunks)) else [])]
        chunks = [c] if (c := self._chunk(job, event, first)) is not None else []
        done = len(parser.calls) - len(calls)
        for k, call in enumerate(calls):
            choice = {"index": job.index, "delta": {"tool_calls": [{"index": done + k, **call}]}, "logprobs": None,
                      "finish_reason": None}  # fmt: skip
            chunks.append({**self._envelope(job), "choices": [choice]})
        return chunks

    def _chunk(self, job: Job, event: Text | Finish, first: bool) -> dict[str, Any] | None:
        text, token_ids = (event.text, event.token_ids) if isinstance(event, Text) else ("", [])
        logprobs = event.logprobs if isinstance(event, Text) else []
        reason = event.reason if isinstance(event, Finish) else None
        with_ids = job.body.return_token_ids
        asked = job.body.top_logprobs_asked
        if not text and not reason and not first and not (with_ids and token_ids) and not logprobs:
            return None
        choice: dict[str, Any] = {"index": job.index, "logprobs": None, "finish_reason": reason}
        if job.chat:
            choice["delta"] = (
                ({"role": "assistant", "content": text} if first else {"content": text}) if not reason else {}
            )
            if asked is not None and logprobs:
                choice["logprobs"] = {"content": self._chat_logprobs(token_ids, logprobs, asked)}
        else:
            echo = first and isinstance(job.body, CompletionRequest) and job.body.echo
            text = self._echo(job) + text if echo else text
            choice["text"] = text
            if asked is not None and (logprobs or echo):
                ids, entries = self._with_echo(job, token_ids, logprobs, echo)
                choice["logprobs"] = self._completion_logprobs(ids, entries, asked, job.streamed_chars)
                job.streamed_chars += sum(len(token) for token in choice["logprobs"]["tokens"])
        if with_ids:
            choice["token_ids"] = token_ids
            if first:
                choice["prompt_token_ids"] = job.prompt_ids
        return {**self._envelope(job), "choices": [choice]}

    @staticmethod
    def _envelope(job: Job) -> dict[str, Any]:
        kind = "chat.completion.chunk" if job.chat else "text_completion"
        envelope: dict[str, Any] = {"id": job.id, "object": kind, "created": job.created, "model": job.model}
        if job.body.include_usage:
            envelope["usage"] = None
        return envelope


def _streaming_watches_disconnect(scope: Mapping[str, Any]) -> bool:
    """Starlette's StreamingResponse listens for ``http.disconnect`` beside the stream, and
    cancels it at once, when the server speaks ASGI spec < 2.4 (uvicorn's is 2.3); from 2.4 on it
    learns of a gone client only from a failed write."""
    spec = str(scope.get("asgi", {}).get("spec_version", "2.0"))
    try:
        return tuple(int(part) for part in spec.split(".")) < (2, 4)
    except ValueError:
        return False


async def _chain(first: Text | Finish, rest: AsyncIterator[Text | Finish]) -> AsyncIterator[Text | Finish]:
    try:
        yield first
        async for event in rest:
            yield event
    finally:
        await _close(rest)


async def _close(events: AsyncIterator[Any]) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


def create_app(config: GatewayConfig) -> FastAPI:
    return Gateway(config).app
