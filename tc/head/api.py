"""The OpenAI-compatible HTTP API (docs/api.md): a Falcon WSGI app over a `GenerationService`.

Resources are thin: read the body, parse it (`api_requests`), call the service, shape the reply (`streaming`:
whole, or as server-sent events); /v1/responses is served as a chat completion told in its own shapes
(`responses`). Every failure, ours or Falcon's own (unknown route, wrong method, bad header), leaves through one
error handler as an OpenAI error body `{"error": {"message", "type", "param", "code"}}`, so clients never see an
HTML page; a failure after a stream has started is its last event instead. Handlers are synchronous; the service
serialises generations, and Waitress runs each request in its own thread. Pages of the origins in
`head.cors_origins` may call it from a browser (`Cors`); with `head.api_keys`, a /v1 request must carry one
(`api_keys.ApiKeys`). While the head still loads its model, `create_loading_app` serves the same routes, with what
can be answered before (loading.py).
"""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import falcon

from ..constraint import AfterToken, GrammarEngine
from ..generation import Completion, text_with_offsets
from ..model.tokenizer import ChatTemplateError, token_bound
from ..batch_memory import BatchPlan
from ..planner import Plan
from ..sampling import SamplingParams
from .api_requests import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    BodyTooLarge,
    ChatRequest,
    ModelNotFound,
    RequestError,
    UnsupportedEncoding,
    UnsupportedMediaType,
    check_logit_bias,
    check_min_tokens,
    check_model,
    check_prompt_tokens,
    decode_json_body,
    parse_chat_request,
    parse_completion_request,
    says_json,
)
from .api_keys import ApiKeys, Unauthorized
from .fill_in_middle import FIM_SPELLINGS, FimTokens
from .loading import HeadLoading, StillLoading
from .metrics import Metrics
from .service import (ClientGone, ClusterNotReady, GenerationGroup, GenerationService, GenerationStream,
                      GenerationSummary, QueueFull, Readiness, ServiceError, ShuttingDown, StageFailed, WorkerLost)
from .reasoning import ThinkTokens, reasoning_tokens
from .responses import ResponseEventStream, ResponseShape, ResponsesReply, Translation, translate
from .structured_output import StructuredOutput
from .tool_calls import marker_tokens
from .streaming import (ChatReply, CompletionReply, EventStream, Reasoning, ReplyContext, ReplyFormat, TokenText,
                        ToolCalling)

log = logging.getLogger(__name__)
PROBE_PATHS = frozenset({"/health", "/health/ready", "/metrics"})  # what load balancers and Prometheus ask, often

DEFAULT_MAX_BODY_BYTES = 1 << 20  # without a model's context to go by; also what a body holds beside its tokens
# What a token of the prompt may take in a body, generously: a token id with its comma and space is 8 bytes, a
# token of text up to a few characters, each 6 bytes when JSON escapes it (\uXXXX: clients that write ASCII JSON,
# Python's json.dumps among them, so for every CJK character).
BODY_BYTES_PER_TOKEN = 32
OWNED_BY = "truecluster"
RETRY_AFTER_S = "1"  # OpenAI's client honours Retry-After when it retries 429 and 503 replies
INTERNAL_ERROR_MESSAGE = "The server had an error while processing your request; its log has the details"


@dataclass(frozen=True)
class ErrorReply:
    """One error as the client sees it: an HTTP status and an OpenAI error object."""

    status: int
    type: str
    message: str
    param: str | None = None
    code: str | None = None
    headers: tuple[tuple[str, str], ...] = ()

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Headers a page may read only where a reply exposes them: clients wait by Retry-After after a 429 or a 503, and
# WWW-Authenticate says what a 401 wants (head.api_keys)
CORS_EXPOSED_HEADERS = ("Retry-After", "WWW-Authenticate")


def allowed_origin(cors_origins: tuple[str, ...], origin: str | None) -> str | None:
    """The Access-Control-Allow-Origin of a reply to a request from `origin` (its Origin header), None for none:
    Cors's decision, for the replies that do not pass through the app (Waitress's refusals, the 503s while the
    server stops)."""
    if origin is None or not cors_origins:
        return None
    if cors_origins == ("*",):
        return "*"
    return origin if origin in cors_origins else None


class Cors(falcon.CORSMiddleware):
    """Middleware: lets pages of `cors_origins` (head.cors_origins; ("*",): any) call the API from a browser.

    Falcon's policy: every reply to an allowed origin carries Access-Control-Allow-Origin, errors included (the
    error handler has run by then) and streams too (the headers leave before the body); a preflight to a route
    is answered with its methods and the request headers it asks for, so Authorization and Content-Type pass, and
    so do the X-Stainless-* headers the OpenAI clients add, which a fixed list would refuse. No credentials: the
    API reads no cookies.
    """

    def __init__(self, cors_origins: tuple[str, ...]):
        super().__init__(allow_origins="*" if cors_origins == ("*",) else cors_origins,
                         expose_headers=list(CORS_EXPOSED_HEADERS))

    def process_response(self, req: falcon.Request, resp: falcon.Response, resource: object,
                         req_succeeded: bool) -> None:
        super().process_response(req, resp, resource, req_succeeded)
        if self.allow_origins != "*":  # the reply names the origin it answers: a cache must not give it to another
            resp.append_header("Vary", "Origin")


def _snake(text: str) -> str:
    return "_".join(text.lower().replace("-", " ").split())


def error_reply(exc: BaseException, request_line: str) -> ErrorReply:
    """The reply for any exception a request raised; `request_line` is "METHOD /path" for messages."""
    if isinstance(exc, Unauthorized):  # RFC 6750: a 401 names the scheme it wants
        return ErrorReply(401, "invalid_request_error", exc.message, None, "invalid_api_key",
                          (("WWW-Authenticate", "Bearer"),))
    if isinstance(exc, ModelNotFound):
        return ErrorReply(404, "invalid_request_error", exc.message, exc.param, exc.code)
    if isinstance(exc, BodyTooLarge):
        return ErrorReply(413, "invalid_request_error", exc.message, exc.param, exc.code)
    if isinstance(exc, UnsupportedEncoding):  # RFC 9110: a 415 says which codings are read, in Accept-Encoding
        return ErrorReply(415, "invalid_request_error", exc.message, exc.param, exc.code,
                          (("Accept-Encoding", "identity"),))
    if isinstance(exc, UnsupportedMediaType):
        return ErrorReply(415, "invalid_request_error", exc.message, exc.param, exc.code)
    if isinstance(exc, RequestError):
        return ErrorReply(400, "invalid_request_error", exc.message, exc.param, exc.code)
    if isinstance(exc, ChatTemplateError):
        return ErrorReply(400, "invalid_request_error", str(exc), "messages", "chat_template_error")
    if isinstance(exc, ClusterNotReady):
        return ErrorReply(503, "cluster_not_ready", str(exc), None, "cluster_not_ready",
                          (("Retry-After", RETRY_AFTER_S),))
    if isinstance(exc, ShuttingDown):
        return ErrorReply(503, "service_unavailable", str(exc), None, "shutting_down",
                          (("Retry-After", RETRY_AFTER_S),))
    if isinstance(exc, StillLoading):
        return ErrorReply(503, "service_unavailable", str(exc), None, "model_loading",
                          (("Retry-After", RETRY_AFTER_S),))
    if isinstance(exc, QueueFull):
        return ErrorReply(429, "rate_limit_exceeded", str(exc), None, "server_busy",
                          (("Retry-After", RETRY_AFTER_S),))
    if isinstance(exc, WorkerLost):
        return ErrorReply(503, "worker_lost", str(exc), None, "worker_lost")
    if isinstance(exc, StageFailed):
        return ErrorReply(502, "worker_error", str(exc), None, "worker_error")
    if isinstance(exc, ServiceError):
        return ErrorReply(503, "service_unavailable", str(exc), None, "service_unavailable")
    if isinstance(exc, falcon.HTTPError):
        return _falcon_error_reply(exc, request_line)
    if isinstance(exc, ClientGone):  # nginx's status for it: the reply goes nowhere, the log and metrics say why
        return ErrorReply(499, "client_closed_request", str(exc), None, "client_closed_request")
    return ErrorReply(500, "internal_error", INTERNAL_ERROR_MESSAGE, None, "internal_error")


def _falcon_error_reply(exc: falcon.HTTPError, request_line: str) -> ErrorReply:
    headers = tuple((exc.headers or {}).items())
    if isinstance(exc, falcon.HTTPNotFound):
        return ErrorReply(404, "invalid_request_error",
                          f"Invalid URL ({request_line}); this server serves GET /v1/models, "
                          "GET /v1/models/{model}, POST /v1/completions, POST /v1/chat/completions, "
                          "POST /v1/responses, GET /v1/cluster, GET /health, GET /health/ready and GET /metrics",
                          None, "unknown_url", headers)
    if isinstance(exc, falcon.HTTPMethodNotAllowed):
        allowed = (exc.headers or {}).get("Allow", "")
        return ErrorReply(405, "invalid_request_error",
                          f"Method not allowed ({request_line}); this URL accepts {allowed}", None,
                          "method_not_allowed", headers)
    status = exc.status_code
    # Falcon's default title is the status line ("400 Bad Request"); the code wants only the reason
    number, _, reason = exc.title.partition(" ")
    title = reason if number.isdigit() and reason else exc.title
    message = f"{title}: {exc.description}" if exc.description else title
    return ErrorReply(status, "invalid_request_error" if status < 500 else "internal_error", message, None,
                      _snake(title), headers)


def server_error_reply(status: int, reason: str, detail: str) -> ErrorReply:
    """The reply for a request the HTTP server refuses itself, before the app sees it (Waitress's own errors:
    malformed framing, headers or a body over its caps, a transfer coding it does not read)."""
    if status == 500:
        return ErrorReply(500, "internal_error", INTERNAL_ERROR_MESSAGE, None, "internal_error")
    return ErrorReply(status, "invalid_request_error", f"{reason}: {detail}" if detail else reason, None,
                      _snake(reason))


def body_limit(context_length: int) -> int:
    """The request body a model's context calls for (head.max_body_mb unset): a prompt that fills the context, in
    any JSON a client writes, with room beside it for messages, tools and fields. A fixed 1 MiB held no 128k-token
    prompt of token ids, nor one of CJK text as Python's json.dumps writes it."""
    return DEFAULT_MAX_BODY_BYTES + context_length * BODY_BYTES_PER_TOKEN


def model_card(model_id: str, context_length: int) -> dict[str, Any]:
    # max_model_len as vLLM names it: clients that fit prompts to the context read it there
    return {"id": model_id, "object": "model", "created": 0, "owned_by": OWNED_BY, "max_model_len": context_length}


def _vocab_size(service: GenerationService) -> int:
    return token_bound(service.tokenizer, service.generator.head.config.vocab_size)


def read_json_body(req: falcon.Request, max_body_bytes: int) -> dict[str, Any]:
    """The request's JSON object. Raises BodyTooLarge before reading a body declared over the limit, and
    UnsupportedEncoding before reading one in a content coding (gzip, br, ...): it is no JSON as it stands, and
    reading it as if the header were not there would misread it.

    The body is read as JSON whatever its Content-Type: `curl -d` labels it a form
    (application/x-www-form-urlencoded), as llama.cpp's server reads it too. A body that is no JSON, sent with
    a Content-Type that is not JSON's, raises UnsupportedMediaType (a 415 naming that type), which says more
    than the JSON parser's complaint about its first character."""
    encoding = (req.get_header("Content-Encoding") or "").strip()
    if encoding and any(part.strip().lower() != "identity" for part in encoding.split(",")):
        raise UnsupportedEncoding(encoding)
    declared = req.content_length  # Falcon raises HTTPInvalidHeader for a malformed one
    if declared is not None and declared > max_body_bytes:
        raise BodyTooLarge(declared, max_body_bytes)
    body = req.bounded_stream.read(max_body_bytes + 1)
    if len(body) > max_body_bytes:
        raise BodyTooLarge(None, max_body_bytes)
    try:
        return decode_json_body(body)
    except RequestError as exc:
        if exc.code == "invalid_json" and body.strip() and not says_json(req.content_type):
            raise UnsupportedMediaType(req.content_type) from exc
        raise


class ModelsResource:
    def __init__(self, model_id: str, context_length: int):
        self.card = model_card(model_id, context_length)

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = {"object": "list", "data": [self.card]}

    def on_get_one(self, req: falcon.Request, resp: falcon.Response, model_id: str) -> None:
        if model_id != self.card["id"]:
            raise ModelNotFound(model_id, self.card["id"], param=None)
        resp.media = self.card

    # HEAD is GET without the body (Falcon drops it), as HTTP requires of every GET resource: uptime monitors and
    # load balancers check with it
    on_head, on_head_one = on_get, on_get_one


class HealthResource:
    """GET /health: the process answers. GET /health/ready: 200 once every planned worker serves, else 503."""

    def __init__(self, service: GenerationService):
        self.service = service

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = {"status": "ok"}

    def on_get_ready(self, req: falcon.Request, resp: falcon.Response) -> None:
        readiness = self.service.readiness()
        resp.status = 200 if readiness.is_ready else 503
        resp.media = _readiness_body(readiness)

    on_head, on_head_ready = on_get, on_get_ready  # see ModelsResource


class LoadingResource:
    """While the head loads its model: /health and /health/ready answer 503 with what it is doing, and every route
    that needs the model (the generations, /v1/cluster) a 503 model_loading."""

    def __init__(self, loading: HeadLoading):
        self.loading = loading

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.status = 503
        resp.media = {"status": "loading", "loading": self.loading.now().body()}
        resp.set_header("Retry-After", RETRY_AFTER_S)

    def on_get_ready(self, req: falcon.Request, resp: falcon.Response) -> None:
        # the shape /health/ready has once loaded, with the workers loaded meanwhile: not ready while the head loads
        resp.status = 503
        resp.media = {**_readiness_body(self.loading.workers()), "ready": False, "loading": self.loading.now().body()}
        resp.set_header("Retry-After", RETRY_AFTER_S)

    def on_get_refused(self, req: falcon.Request, resp: falcon.Response) -> None:
        raise StillLoading(self.loading.now())

    on_head, on_head_ready, on_head_refused = on_get, on_get_ready, on_get_refused  # see ModelsResource
    on_post_generation = on_get_refused


class ClusterView(Protocol):
    """What GET /v1/cluster shows of the workers (the head's WorkerRegistry is one)."""

    plan: Plan
    batch: BatchPlan

    def snapshot(self) -> list[dict[str, Any]]:
        """One row per planned node: state, device, layers, memory, seconds since last heard."""


def plan_body(plan: Plan | None, batch: BatchPlan) -> dict[str, Any] | None:
    """The plan for /v1/cluster; None while the head waits for its workers to plan from their speeds."""
    if plan is None:
        return None
    return {"num_layers": plan.num_layers, "total_weight_bytes": plan.total_weight_bytes,
            "max_batch": batch.max_batch,
            "stages": [{"node_id": s.node_id, "layers": [s.start, s.end], "device": s.device, "dtype": s.dtype,
                        "weight_bytes": s.weight_bytes, "memory_bytes": s.memory_bytes,
                        "kv_bytes_per_sequence": batch.slot_bytes[s.node_id],
                        "predicted_decode_ms": None if s.decode_s is None else round(s.decode_s * 1000, 3)}
                       for s in plan.stages]}


def _readiness_body(readiness: Readiness) -> dict[str, Any]:
    return {"ready": readiness.is_ready, "required_nodes": readiness.required,
            "ready_nodes": list(readiness.ready), "missing_nodes": list(readiness.missing)}


class ClusterResource:
    """GET /v1/cluster: readiness, the queue, the plan and each node's state (plan null, nodes [] in-process)."""

    def __init__(self, service: GenerationService, cluster: ClusterView | None):
        self.service, self.cluster = service, cluster

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        body: dict[str, Any] = {"object": "cluster", "model": self.service.model_id,
                                **_readiness_body(self.service.readiness()),
                                "queue": {"waiting": self.service.queue_depth, "running": self.service.running,
                                          "limit": self.service.max_queue},
                                "batch": {"slots": self.service.max_batch, "in_use": self.service.running,
                                          "kept": self.service.kept,
                                          "prefill_chunk": self.service.prefill_chunk,
                                          "tokens_per_s": round(self.service.tokens_per_s(), 2),
                                          "sequences": self.service.sequences()},
                                "plan": None, "nodes": []}
        if self.cluster is not None:
            body["plan"], body["nodes"] = plan_body(self.cluster.plan, self.cluster.batch), self.cluster.snapshot()
        resp.media = body

    on_head = on_get  # see ModelsResource


class MetricsResource:
    """GET /metrics: Prometheus's text format."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.data, resp.content_type = self.metrics.render()

    on_head = on_get  # see ModelsResource


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of choice `index` of a request: its seed, when one is given, moved on by the index (modulo
    the signed 64-bit range), so that every choice is reproducible and none repeats another."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index + 2**63) % 2**64 - 2**63)


def merge_choices(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """One whole reply of several choices from one body per choice: choices indexed in order, usage summed (the
    prompt counted once: it is the same prompt)."""
    merged = dict(bodies[0])
    merged["choices"] = [{**body["choices"][0], "index": i} for i, body in enumerate(bodies)]
    completion_tokens = sum(body["usage"]["completion_tokens"] for body in bodies)
    prompt_tokens = bodies[0]["usage"]["prompt_tokens"]
    merged["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                       "total_tokens": prompt_tokens + completion_tokens}
    return merged


class _Generation:
    """Serving one generation request, whole or streamed, of one or more choices; shared by the endpoints.
    `events` is the stream's WSGI body: the chat and completion chunks' EventStream, or the Responses' own."""

    def __init__(self, service: GenerationService):
        self.service = service

    def serve(self, req: falcon.Request, resp: falcon.Response, prompt_ids: list[int], params: SamplingParams,
              make_reply: Callable[[], ReplyFormat], request_id: str, include_usage: bool, stream: bool,
              n: int = 1, events: type[EventStream] = EventStream) -> None:
        if n > self.service.max_batch:
            raise RequestError(f"'n' is {n}, but this server generates at most {self.service.max_batch} sequences "
                               "at once (its batch: head.max_batch, or what the nodes' memory holds); ask for fewer "
                               "choices", param="n", code="invalid_value")
        # Waitress's check that the client has closed its connection (channel_request_lookahead gives it)
        gone = req.env.get("waitress.client_disconnected")
        # a reply object per choice (chat replies keep state), made before the choices hold places in the batch
        replies = [make_reply() for _ in range(n)]
        group = self.service.queue_choices(prompt_ids, [choice_params(params, i) for i in range(n)], gone)
        req.context.request_id, req.context.generation = request_id, group
        if not stream:
            with group:
                generations = group.wait()
                assert generations is not None  # waited for without a bound
                bodies = [reply.whole(_drain(generation, gone)) for reply, generation in zip(replies, generations)]
            resp.media = bodies[0] if n == 1 else merge_choices(bodies)
            return
        started, request_line = req.context.started, f"{req.method} {req.path}"

        def on_close(events: EventStream) -> None:
            _log_generation(request_line, 200, time.perf_counter() - started, request_id, group.summary())

        try:
            resp.stream = events(group, replies, include_usage=include_usage, on_close=on_close,
                                 error_body=lambda exc: _stream_error_body(exc, request_line))
        except BaseException:
            group.close()  # nobody else holds them yet to give their places back
            raise
        req.context.deferred_log = True  # the reply ends when the stream does: it logs then
        resp.content_type = "text/event-stream"
        resp.set_header("Cache-Control", "no-cache")
        resp.set_header("X-Accel-Buffering", "no")  # reverse proxies must not hold events back


def _drain(generation: GenerationStream, gone: Callable[[], bool] | None) -> Completion:
    """generation.drain(), given up once the client is `gone` (looked at every step): its place in the batch goes
    back within a step, as a stream's does, where a client that timed out held it to max_tokens."""
    for _ in generation:
        if gone is not None and gone():
            raise ClientGone(f"the client closed the connection after {generation.completion_tokens} tokens")
    assert generation.completion is not None
    return generation.completion


def _stream_error_body(exc: Exception, request_line: str) -> dict[str, Any]:
    reply = error_reply(exc, request_line)
    if reply.status == 500:
        log.error("%s failed while streaming", request_line, exc_info=exc)
    else:
        log.warning("%s: %s (while streaming)", request_line, reply.message)
    return reply.body()


class CompletionsResource:
    def __init__(self, service: GenerationService, max_body_bytes: int, token_text: TokenText):
        self.service, self.max_body_bytes, self.token_text = service, max_body_bytes, token_text
        self.generation = _Generation(service)
        self.fim = FimTokens.find(service.tokenizer.token_id, service.tokenizer.leading_ids())

    def _fill_in_middle(self, prompt_ids: list[int], suffix: str) -> list[int]:
        if self.fim is None:
            known = "; ".join(", ".join(spelling) for spelling in FIM_SPELLINGS)
            raise RequestError(f"'suffix' needs a model trained to fill in the middle, whose vocabulary has the three "
                               f"tokens of one of these spellings: {known}; this model's has not. Leave out suffix",
                               param="suffix", code="unsupported_value")
        return self.fim.prompt(prompt_ids, self.service.tokenizer.encode_literal(suffix))

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        request = parse_completion_request(read_json_body(req, self.max_body_bytes))
        check_model(request.model, self.service.model_id)
        if isinstance(request.prompt, str):
            # a text prompt starts as the model was trained to read a text (Llama's, Gemma's BOS); the prefix of a
            # fill in the middle comes after the FIM token
            tokenizer = self.service.tokenizer
            prompt_ids = tokenizer.encode_prompt(request.prompt) if request.suffix is None else \
                tokenizer.encode_literal(request.prompt)
        else:
            prompt_ids = list(request.prompt)
        if request.suffix is not None:
            prompt_ids = self._fill_in_middle(prompt_ids, request.suffix)
        params = request.sampling.to_params(DEFAULT_COMPLETION_MAX_TOKENS, default_is="OpenAI's default here",
                                            prompt_logprobs=request.echo, continues_prompt=True,
                                            defaults=self.service.sampling_defaults)
        # max_tokens 0 (with echo: the prompt scored) generates nothing, so its prompt may fill the context
        check_prompt_tokens(prompt_ids, self.service.context_length, _vocab_size(self.service), "prompt",
                            generates=params.max_tokens > 0)
        check_min_tokens(params.min_tokens, len(prompt_ids), self.service.context_length)
        check_logit_bias(params.logit_bias, _vocab_size(self.service))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        context = ReplyContext(request_id, int(time.time()), self.service.model_id,
                               request.streaming.include_usage)
        echo_text = text_with_offsets(self.service.tokenizer, prompt_ids)[0] if request.echo else None
        self.generation.serve(req, resp, prompt_ids, params,
                              lambda: CompletionReply(context, self.token_text, logprobs=params.logprobs,
                                                      echo_text=echo_text),
                              request_id, request.streaming.include_usage, request.streaming.stream,
                              request.sampling.n)


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request made ready to generate: its prompt's tokens, its sampling (with the grammar of a structured
    reply or a forced call), and how its reply reads tool calls and thinking."""

    prompt_ids: list[int]
    params: SamplingParams
    tools: ToolCalling | None
    reasoning: Reasoning | None

    def reply(self, context: ReplyContext, token_text: TokenText) -> ChatReply:
        return ChatReply(context, token_text, logprobs=self.params.logprobs, tools=self.tools,
                         reasoning=self.reasoning)


class ChatPrompts:
    """What both chat-shaped endpoints (/v1/chat/completions, /v1/responses) do with a parsed chat request before
    generating: the template, the prompt's checks, the sampling, the grammar, the thinking and the tools."""

    def __init__(self, service: GenerationService, structured: StructuredOutput, think: ThinkTokens | None):
        self.service, self.structured, self.think = service, structured, think
        self.markers = marker_tokens(service.tokenizer)  # special tokens that spell a tool call's markers

    def prepare(self, request: ChatRequest) -> ChatPrompt:
        offered = request.offered_tools  # tool_choice "none" shows the model no tools, so it answers in text
        rendered = self.service.tokenizer.apply_chat_template(
            [m.as_template_input() for m in request.messages], add_generation_prompt=request.add_generation_prompt,
            tools=[t.as_template_input() for t in offered] or None,
            continue_final_message=request.continue_final_message, variables=request.template_variables)
        prompt_ids = self.service.tokenizer.encode(rendered)
        check_prompt_tokens(prompt_ids, self.service.context_length, _vocab_size(self.service),
                            "messages")
        # as in OpenAI's chat API, no max_tokens means: until the context is full
        room = self.service.context_length - len(prompt_ids)
        # a continued message's text goes on from its last words: a SentencePiece word's space stays at its start
        params = request.sampling.to_params(room, default_is="the room the messages leave in the context",
                                            continues_prompt=request.continue_final_message,
                                            defaults=self.service.sampling_defaults)
        check_min_tokens(params.min_tokens, len(prompt_ids), self.service.context_length)
        check_logit_bias(params.logit_bias, _vocab_size(self.service))
        if request.prediction:  # guesses for a greedy reply's next tokens (draft.py): they change none of them
            params = dataclasses.replace(params, draft_reference=tuple(self.service.tokenizer.encode(
                request.prediction)))
        opened = self.think is not None and self.think.opened_in(prompt_ids, self.service.tokenizer.eos_token_ids)
        grammar = self.structured.grammar(request)
        if grammar is not None and opened:
            # the thinking the prompt began is free; the grammar holds for the answer, from </think> on
            assert self.think is not None
            grammar = AfterToken(grammar, self.think.close, self.service.generator.head.config.vocab_size)
        params = dataclasses.replace(params, constraint=grammar)
        tools = (ToolCalling({t.name: t.parameters for t in offered}, parallel=request.parallel_tool_calls,
                             legacy=request.legacy_functions) if offered else None)
        if tools is not None:  # a call's markers stay in the text its parser reads
            params = dataclasses.replace(params, kept_tokens=self.markers)
        reasoning = None if self.think is None else Reasoning(self.think, opened,
                                                              split=request.reasoning_format != "none")
        return ChatPrompt(prompt_ids, params, tools, reasoning)


class ChatCompletionsResource:
    def __init__(self, service: GenerationService, max_body_bytes: int, token_text: TokenText,
                 prompts: ChatPrompts):
        self.service, self.max_body_bytes, self.token_text = service, max_body_bytes, token_text
        self.prompts = prompts
        self.generation = _Generation(service)

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        request = parse_chat_request(read_json_body(req, self.max_body_bytes))
        check_model(request.model, self.service.model_id)
        prompt = self.prompts.prepare(request)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        context = ReplyContext(request_id, int(time.time()), self.service.model_id,
                               request.streaming.include_usage)
        self.generation.serve(req, resp, prompt.prompt_ids, prompt.params,
                              lambda: prompt.reply(context, self.token_text),
                              request_id, request.streaming.include_usage, request.streaming.stream,
                              request.sampling.n)


class ResponsesResource:
    """POST /v1/responses: the request translated into a chat request (responses.py), served as one, and its reply
    told in the Responses' shapes. A refusal names the field the client sent, not the chat one it became."""

    def __init__(self, service: GenerationService, max_body_bytes: int, token_text: TokenText,
                 prompts: ChatPrompts):
        self.service, self.max_body_bytes, self.token_text = service, max_body_bytes, token_text
        self.prompts = prompts
        self.generation = _Generation(service)

    def _prepare(self, translation: Translation) -> tuple[ChatRequest, ChatPrompt]:
        try:
            request = parse_chat_request(translation.chat)
            check_model(request.model, self.service.model_id)
            return request, self.prompts.prepare(request)
        except RequestError as exc:
            exc.param, exc.message = translation.blame(exc.param), translation.reword(exc.message)
            raise
        except ChatTemplateError as exc:
            raise RequestError(str(exc), param="input", code="chat_template_error") from exc

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        translation = translate(read_json_body(req, self.max_body_bytes))
        request, prompt = self._prepare(translation)
        shape = ResponseShape(self.service.model_id, translation.echo)
        context = ReplyContext(shape.id, shape.created_at, self.service.model_id)
        self.generation.serve(req, resp, prompt.prompt_ids, prompt.params,
                              lambda: ResponsesReply(prompt.reply(context, self.token_text), shape),
                              shape.id, False, request.streaming.stream, events=ResponseEventStream)


def _log_generation(request_line: str, status: int, seconds: float, request_id: str,
                    summary: GenerationSummary) -> None:
    log.info("%s %d id=%s prompt_tokens=%d completion_tokens=%d wait=%.3fs ttft=%.3fs tokens_per_s=%.1f finish=%s "
             "%.3fs", request_line, status, request_id, summary.prompt_tokens, summary.completion_tokens,
             summary.queue_wait_s, summary.time_to_first_token_s, summary.decode_tokens_per_s, summary.outcome,
             seconds)


class RequestLog:
    """Middleware: counts each request, and logs one INFO line when it ends.

    A generation's line has its id, token counts, time to first token and decode rate. A streamed reply ends
    after Falcon is done with it, so its line comes from the stream's close().
    """

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        req.context.started = time.perf_counter()
        req.context.generation = None
        req.context.deferred_log = False

    def process_response(self, req: falcon.Request, resp: falcon.Response, resource: object,
                         req_succeeded: bool) -> None:
        self.metrics.observe_request(req.method, req.uri_template or "unmatched", resp.status_code)
        if req.context.deferred_log:
            return
        seconds = time.perf_counter() - req.context.started
        generation: GenerationGroup | None = req.context.generation
        if generation is not None:
            _log_generation(f"{req.method} {req.path}", resp.status_code, seconds, req.context.request_id,
                            generation.summary())
        else:
            # a probe answered as probes are (ready, not ready) is DEBUG: a load balancer's health check every few
            # seconds and Prometheus's scrapes would otherwise bury what the cluster does under their lines
            probe = req.path in PROBE_PATHS and resp.status_code in (200, 503)
            log.log(logging.DEBUG if probe else logging.INFO, "%s %s %d %.3fs", req.method, req.path,
                    resp.status_code, seconds)


def _handle_error(req: falcon.Request, resp: falcon.Response, ex: Exception, params: dict[str, Any]) -> None:
    reply = error_reply(ex, f"{req.method} {req.path}")
    if reply.status == 500:
        log.error("%s %s failed", req.method, req.path, exc_info=ex)
    elif reply.status >= 500:
        log.warning("%s %s: %s", req.method, req.path, reply.message)
    resp.status = reply.status
    resp.media = reply.body()
    for name, value in reply.headers:
        resp.set_header(name, value)


def create_app(service: GenerationService, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               cluster: ClusterView | None = None, cors_origins: tuple[str, ...] = (),
               reasoning: bool | None = None, api_keys: tuple[str, ...] = ()) -> falcon.App:
    """The WSGI app serving `service` under /v1, with /health, /metrics and GET /v1/cluster.

    Request bodies over `max_body_bytes` get a 413. `cluster` (the head's WorkerRegistry) fills /v1/cluster's
    plan and nodes; without it (a single process) they are null and empty. Browser pages of `cors_origins`
    (("*",): any) may call it (`Cors`); with none, replies carry no CORS headers. `reasoning` is the topology's
    reasoning_content (None: auto): whether chat replies give a thinking model's thinking apart from its answer.
    With `api_keys` (head.api_keys), the /v1 routes want one of them (api_keys.py).
    Raises ReasoningUnavailable for reasoning True on a model without think tokens.
    """
    app = _new_app(service.metrics, cors_origins, api_keys)
    models = ModelsResource(service.model_id, service.context_length)
    app.add_route("/v1/models", models)
    # model ids such as "Qwen/Qwen2.5-0.5B-Instruct" hold slashes, so the id takes the rest of the path
    app.add_route("/v1/models/{model_id:path}", models, suffix="one")
    health = HealthResource(service)
    app.add_route("/health", health)
    app.add_route("/health/ready", health, suffix="ready")
    app.add_route("/v1/cluster", ClusterResource(service, cluster))
    app.add_route("/metrics", MetricsResource(service.metrics))
    token_text = TokenText(service.tokenizer)
    app.add_route("/v1/completions", CompletionsResource(service, max_body_bytes, token_text))
    tokenizer, vocab_size = service.tokenizer, service.generator.head.config.vocab_size  # the logits' width
    structured = StructuredOutput(lambda: GrammarEngine.load(tokenizer.tokenizer, vocab_size,
                                                             tokenizer.eos_token_ids))
    think, _ = reasoning_tokens(tokenizer, reasoning)
    prompts = ChatPrompts(service, structured, think)
    app.add_route("/v1/chat/completions", ChatCompletionsResource(service, max_body_bytes, token_text, prompts))
    app.add_route("/v1/responses", ResponsesResource(service, max_body_bytes, token_text, prompts))
    return app


def create_loading_app(loading: HeadLoading, metrics: Metrics, cors_origins: tuple[str, ...] = (),
                       api_keys: tuple[str, ...] = ()) -> falcon.App:
    """The app the head serves while it loads its model (loading.py), on the routes of create_app's: /v1/models and
    /metrics answer what they already can, the rest a 503 that says the model is loading (LoadingResource).

    Give create_app's service the same `metrics`: the requests answered meanwhile stay counted once it serves.
    """
    app = _new_app(metrics, cors_origins, api_keys)
    models = ModelsResource(loading.model_id, loading.context_length)
    app.add_route("/v1/models", models)
    app.add_route("/v1/models/{model_id:path}", models, suffix="one")
    waiting = LoadingResource(loading)
    app.add_route("/health", waiting)
    app.add_route("/health/ready", waiting, suffix="ready")
    app.add_route("/v1/cluster", waiting, suffix="refused")
    app.add_route("/metrics", MetricsResource(metrics))
    # POST only, as create_app's: another method gets the 405 it will get then
    app.add_route("/v1/completions", waiting, suffix="generation")
    app.add_route("/v1/chat/completions", waiting, suffix="generation")
    app.add_route("/v1/responses", waiting, suffix="generation")
    return app


def _new_app(metrics: Metrics, cors_origins: tuple[str, ...], api_keys: tuple[str, ...]) -> falcon.App:
    """An app with what both of the head's apps share: the request log, the CORS policy (where origins are given),
    the API keys (where keys are given), and one error handler for everything, Falcon's own HTTPError included (it
    has a default handler of its own)."""
    middleware: list[object] = [RequestLog(metrics)]
    if cors_origins:
        middleware.append(Cors(cors_origins))
    if api_keys:  # last: a request it refuses has been through the others, whose replies' headers its 401 gets
        middleware.append(ApiKeys(api_keys))
    app = falcon.App(middleware=middleware)
    app.req_options.strip_url_path_trailing_slash = True
    app.add_error_handler([Exception, falcon.HTTPError], _handle_error)
    return app
