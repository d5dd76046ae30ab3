"""The OpenAI-compatible HTTP API (SPEC.md 6): a Falcon WSGI app over a `GenerationService`.

Resources are thin: read the body, parse it (`api_requests`), call the service, serialise the reply. Every
failure, ours or Falcon's own (unknown route, wrong method, bad header), leaves through one error handler as an
OpenAI error body `{"error": {"message", "type", "param", "code"}}`, so clients never see an HTML page.
Handlers are synchronous; the service serialises generations, and Waitress runs each request in its own thread.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import falcon

from ..generation import Completion
from ..model.tokenizer import ChatTemplateError, TextTokenizer
from .api_requests import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    BodyTooLarge,
    ModelNotFound,
    RequestError,
    check_model,
    check_prompt_tokens,
    decode_json_body,
    parse_chat_request,
    parse_completion_request,
)
from .service import ClusterNotReady, GenerationService, QueueFull, ServiceError, StageFailed, WorkerLost

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: far above any prompt that fits a context window
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


def _snake(text: str) -> str:
    return "_".join(text.lower().replace("-", " ").split())


def error_reply(exc: BaseException, request_line: str) -> ErrorReply:
    """The reply for any exception a request raised; `request_line` is "METHOD /path" for messages."""
    if isinstance(exc, ModelNotFound):
        return ErrorReply(404, "invalid_request_error", exc.message, exc.param, exc.code)
    if isinstance(exc, BodyTooLarge):
        return ErrorReply(413, "invalid_request_error", exc.message, exc.param, exc.code)
    if isinstance(exc, RequestError):
        return ErrorReply(400, "invalid_request_error", exc.message, exc.param, exc.code)
    if isinstance(exc, ChatTemplateError):
        return ErrorReply(400, "invalid_request_error", str(exc), "messages", "chat_template_error")
    if isinstance(exc, ClusterNotReady):
        return ErrorReply(503, "cluster_not_ready", str(exc), None, "cluster_not_ready",
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
    return ErrorReply(500, "internal_error", INTERNAL_ERROR_MESSAGE, None, "internal_error")


def _falcon_error_reply(exc: falcon.HTTPError, request_line: str) -> ErrorReply:
    headers = tuple((exc.headers or {}).items())
    if isinstance(exc, falcon.HTTPNotFound):
        return ErrorReply(404, "invalid_request_error",
                          f"Invalid URL ({request_line}); this server serves GET /v1/models, "
                          "GET /v1/models/{model}, POST /v1/completions and POST /v1/chat/completions",
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


def model_card(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": OWNED_BY}


def _usage(completion: Completion) -> dict[str, int]:
    return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens,
            "total_tokens": completion.prompt_tokens + completion.completion_tokens}


def completion_body(completion: Completion, model_id: str, created: int) -> dict[str, Any]:
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": created,
        "model": model_id,
        "choices": [{"text": completion.text, "index": 0, "logprobs": None,
                     "finish_reason": completion.finish_reason}],
        "usage": _usage(completion),
    }


def chat_completion_body(completion: Completion, model_id: str, created: int) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": created,
        "model": model_id,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": completion.text},
                     "logprobs": None, "finish_reason": completion.finish_reason}],
        "usage": _usage(completion),
    }


def _vocab_size(tokenizer: TextTokenizer) -> int:
    # token ids the tokenizer can decode; rows of the embedding beyond it are padding
    return tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)


def read_json_body(req: falcon.Request, max_body_bytes: int) -> dict[str, Any]:
    """The request's JSON object. Raises BodyTooLarge before reading a body declared over the limit."""
    declared = req.content_length  # Falcon raises HTTPInvalidHeader for a malformed one
    if declared is not None and declared > max_body_bytes:
        raise BodyTooLarge(declared, max_body_bytes)
    body = req.bounded_stream.read(max_body_bytes + 1)
    if len(body) > max_body_bytes:
        raise BodyTooLarge(None, max_body_bytes)
    return decode_json_body(body)


class ModelsResource:
    def __init__(self, model_id: str):
        self.model_id = model_id

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = {"object": "list", "data": [model_card(self.model_id)]}

    def on_get_one(self, req: falcon.Request, resp: falcon.Response, model_id: str) -> None:
        if model_id != self.model_id:
            raise ModelNotFound(model_id, self.model_id, param=None)
        resp.media = model_card(self.model_id)


class HealthResource:
    """GET /health: the process answers. GET /health/ready: 200 once every planned worker serves, else 503."""

    def __init__(self, service: GenerationService):
        self.service = service

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = {"status": "ok"}

    def on_get_ready(self, req: falcon.Request, resp: falcon.Response) -> None:
        readiness = self.service.readiness()
        resp.status = 200 if readiness.is_ready else 503
        resp.media = {"ready": readiness.is_ready, "required_nodes": readiness.required,
                      "ready_nodes": list(readiness.ready), "missing_nodes": list(readiness.missing)}


class CompletionsResource:
    def __init__(self, service: GenerationService, max_body_bytes: int):
        self.service, self.max_body_bytes = service, max_body_bytes

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        request = parse_completion_request(read_json_body(req, self.max_body_bytes))
        check_model(request.model, self.service.model_id)
        if isinstance(request.prompt, str):
            prompt_ids = self.service.tokenizer.encode(request.prompt)
        else:
            prompt_ids = list(request.prompt)
        check_prompt_tokens(prompt_ids, self.service.context_length, _vocab_size(self.service.tokenizer), "prompt")
        completion = self.service.complete(prompt_ids, request.sampling.to_params(DEFAULT_COMPLETION_MAX_TOKENS))
        req.context.completion = completion
        resp.media = completion_body(completion, self.service.model_id, int(time.time()))


class ChatCompletionsResource:
    def __init__(self, service: GenerationService, max_body_bytes: int):
        self.service, self.max_body_bytes = service, max_body_bytes

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        request = parse_chat_request(read_json_body(req, self.max_body_bytes))
        check_model(request.model, self.service.model_id)
        rendered = self.service.tokenizer.apply_chat_template(
            [m.as_template_input() for m in request.messages], add_generation_prompt=True)
        prompt_ids = self.service.tokenizer.encode(rendered)
        check_prompt_tokens(prompt_ids, self.service.context_length, _vocab_size(self.service.tokenizer),
                            "messages")
        # as in OpenAI's chat API, no max_tokens means: until the context is full
        params = request.sampling.to_params(default_max_tokens=self.service.context_length - len(prompt_ids))
        completion = self.service.complete(prompt_ids, params)
        req.context.completion = completion
        resp.media = chat_completion_body(completion, self.service.model_id, int(time.time()))


class RequestLog:
    """Middleware: one INFO line per request with its status, token counts and duration."""

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        req.context.started = time.perf_counter()
        req.context.completion = None

    def process_response(self, req: falcon.Request, resp: falcon.Response, resource: object,
                         req_succeeded: bool) -> None:
        seconds = time.perf_counter() - req.context.started
        completion: Completion | None = req.context.completion
        tokens = (f" prompt_tokens={completion.prompt_tokens} completion_tokens={completion.completion_tokens}"
                  if completion is not None else "")
        log.info("%s %s %d%s %.3fs", req.method, req.path, resp.status_code, tokens, seconds)


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


def create_app(service: GenerationService, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> falcon.App:
    """The WSGI app serving `service` under /v1. Request bodies over `max_body_bytes` get a 413."""
    app = falcon.App(middleware=[RequestLog()])
    app.req_options.strip_url_path_trailing_slash = True
    models = ModelsResource(service.model_id)
    app.add_route("/v1/models", models)
    # model ids such as "Qwen/Qwen2.5-0.5B-Instruct" hold slashes, so the id takes the rest of the path
    app.add_route("/v1/models/{model_id:path}", models, suffix="one")
    health = HealthResource(service)
    app.add_route("/health", health)
    app.add_route("/health/ready", health, suffix="ready")
    app.add_route("/v1/completions", CompletionsResource(service, max_body_bytes))
    app.add_route("/v1/chat/completions", ChatCompletionsResource(service, max_body_bytes))
    # one handler for everything, Falcon's own HTTPError included (it has a default handler of its own)
    app.add_error_handler([Exception, falcon.HTTPError], _handle_error)
    return app
