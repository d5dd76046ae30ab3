"""OpenAI's Responses API (POST /v1/responses) as a translation of the chat API's (docs/api.md).

A Responses request says what a chat request says in other words: `input` items are messages, function calls and
their outputs; `instructions` is a system message; tools are written flat; `text.format` is `response_format`.
`translate` rewrites the body into a chat body, which the chat endpoint's own parser and generation then serve,
and `Translation.blame` renames the field a refusal names back to the one the client sent. The reply goes the
other way: `ResponsesReply` wraps the chat reply of the same generation and turns its message into output items
(reasoning, message, function calls), whole or as the Responses' typed stream events (`ResponseEventStream`).

tc keeps nothing between requests, so what needs a stored response (`previous_response_id`, `conversation`,
`background`, stored `prompt` templates) is refused, naming the field: the client sends the whole conversation
in `input` instead.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from ..generation import Completion, Step
# the chat parser's own checks, so that a Responses field is refused in the same words as a chat one
from .api_requests import (SAMPLING_PARSERS, REASONING_EFFORTS, RequestError, _boolean, _check_fields, _json_type,
                           _object, _required, _string, check_metadata)
from .service import GenerationGroup
from .streaming import IDLE_KEEPALIVE_S, KEEPALIVE, ChatReply, EventStream, sse

# Fields translated into the chat body, or only echoed back in the response
_FIELDS = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools",
                     "tool_choice", "parallel_tool_calls", "text", "metadata", "user", "store", "reasoning",
                     "truncation", "previous_response_id", "conversation", "background", "include", "prompt",
                     "prompt_cache_key", "safety_identifier", "service_tier", "stream_options", "top_logprobs"})
# chat's sampling fields that the Responses API has no name for (min_p, top_k, seed, stop, ...): refused by name
# with where they are taken, rather than as fields this server does not implement
_CHAT_ONLY = (frozenset(SAMPLING_PARSERS) | {"logprobs", "top_logprobs"}) - _FIELDS
INPUT_ROLES = ("user", "assistant", "system", "developer")
# what the openai client sends back when a reply's output items are appended to the next request's input
_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
# (`parsed`: what the client's responses.parse() read the text as, which it may send back with it; unused)
_PART_KEYS = frozenset({"type", "text", "annotations", "logprobs", "parsed"})
_TEXT_PARTS = ("input_text", "output_text")
# ... and a function call item as the SDK dumps it (model_dump: its null async, caller and namespace too)
_CALL_KEYS = frozenset({"type", "call_id", "name", "arguments", "id", "status", "async", "async_", "caller",
                        "namespace", "parsed_arguments"})
_OUTPUT_KEYS = frozenset({"type", "call_id", "output", "id", "status"})
_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
_FORMAT_KEYS = frozenset({"type", "name", "schema", "strict", "description"})
_REASONING_KEYS = frozenset({"effort", "summary", "generate_summary"})
_TEXT_KEYS = frozenset({"format", "verbosity"})
# text.verbosity: how long OpenAI's models make their answers; taken and echoed, with no effect on tc's models
VERBOSITIES = ("low", "medium", "high")
# stream_options: OpenAI's padding of each event against reading a reply's length off the wire, which tc's events
# carry neither way (as chat's)
_STREAM_OPTION_KEYS = frozenset({"include_obfuscation"})
REASONING_SUMMARIES = ("auto", "concise", "detailed")
NO_STORE = ("tc keeps no responses between requests; send the whole conversation in 'input' (the earlier input "
            "items, then the response's output items)")


def _text_field(item: Mapping[str, Any], key: str, param: str) -> str:
    """item[key], required and a string (`param`: where item is)."""
    return _string(_required(item, key, f"{param}."), f"{param}.{key}")


@dataclass
class Translation:
    """A Responses body as a chat body, and where each chat message came from, to name the client's own field
    when the chat parser refuses something."""

    chat: dict[str, Any]
    echo: dict[str, Any]  # the request's settings as the response repeats them
    # per chat message: the field it came from, and whether its sub-fields are named as in chat (a message item)
    # or not (a function call, its output, `instructions`)
    sources: list[tuple[str, bool]] = field(default_factory=list)

    def reword(self, message: str) -> str:
        """A refusal's message with each field it quotes ('max_completion_tokens') named as the client sent it."""
        return re.sub(r"'([A-Za-z_][\w.\[\]]*)'", lambda quoted: f"'{self.blame(quoted[1])}'", message)

    def blame(self, param: str | None) -> str | None:
        """The Responses field for the chat field `param` that a refusal names."""
        if param is None:
            return None
        message = re.match(r"messages\[(\d+)\](.*)", param)
        if message and int(message[1]) < len(self.sources):
            source, same_fields = self.sources[int(message[1])]
            return source + message[2] if same_fields else source
        tool = re.match(r"tools\[(\d+)\]\.function(.*)", param)
        if tool:
            return f"tools[{tool[1]}]{tool[2]}"
        for chat, ours in (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
                           ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                           ("tool_choice.function", "tool_choice")):
            if param == chat or param.startswith(chat + "."):
                return ours + param[len(chat):]
        return param


def _refuse_stored_state(body: Mapping[str, Any]) -> None:
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise RequestError(f"'{name}' is not supported: {NO_STORE}", param=name, code="unsupported_parameter")
    if body.get("prompt") is not None:
        raise RequestError("'prompt' (a stored prompt template) is not supported: tc stores no prompts; send the "
                           "text in 'instructions' and 'input'", param="prompt", code="unsupported_parameter")
    for name in ("background", "store"):
        if body.get(name) is not None:
            _boolean(body[name], name)
    if body.get("background") not in (None, False):
        raise RequestError("'background' is not supported: tc answers while the request is open and keeps no "
                           "responses to fetch later; leave it out, or send \"stream\": true for the text as it "
                           "comes", param="background", code="unsupported_value")
    if body.get("truncation") not in (None, "disabled", "auto"):
        raise RequestError(f"'truncation' is {json.dumps(body['truncation'])}; use \"disabled\" or leave it out",
                           param="truncation", code="invalid_value")
    if body.get("truncation") == "auto":
        raise RequestError("'truncation' \"auto\" is not supported: tc does not drop parts of a conversation to fit "
                           "the context; leave it out, or send \"disabled\" (a conversation too long for the "
                           "context gets a 400)", param="truncation", code="unsupported_value")
    include = body.get("include")
    if include is not None and not isinstance(include, list):
        raise RequestError(f"'include' must be an array of strings, not {_json_type(include)}", param="include",
                           code="invalid_type")
    for i, selector in enumerate(include or ()):
        # Encrypted reasoning is asked for by clients that keep no state on the server (store false) so as to send
        # earlier reasoning back; tc's reasoning items are plain, and earlier reasoning is not read again anyway.
        if selector != "reasoning.encrypted_content":
            raise RequestError(f"'include[{i}]' is {json.dumps(selector)}: tc has none of the extra output it selects "
                               "(logprobs, tool results); leave it out (\"reasoning.encrypted_content\" is accepted, "
                               "and reasoning comes as plain text)", param=f"include[{i}]", code="unsupported_value")


def _text_parts(value: Any, param: str) -> str | list[dict[str, Any]]:
    """Message content (a string, or input_text / output_text parts) in chat's form."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise RequestError(f"'{param}' must be a string or an array of input_text parts, not {_json_type(value)}",
                           param=param, code="invalid_type")
    parts = []
    for j, part in enumerate(value):
        where = f"{param}[{j}]"
        part = _object(part, where, _PART_KEYS)
        if part.get("type") not in _TEXT_PARTS:
            raise RequestError(f"'{where}.type' is {json.dumps(part.get('type'))}; this server reads only text: "
                               "\"input_text\" (or \"output_text\" in an assistant's message)",
                               param=f"{where}.type", code="unsupported_value")
        parts.append({"type": "text", "text": _text_field(part, "text", where)})
    return parts


class _Messages:
    """The chat messages of a Responses `input`, each with the field it came from."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.sources: list[tuple[str, bool]] = []

    def add(self, message: dict[str, Any], source: str, same_fields: bool) -> None:
        self.messages.append(message)
        self.sources.append((source, same_fields))

    def message(self, item: Mapping[str, Any], param: str) -> None:
        item = _object(item, param, _MESSAGE_KEYS)
        role = _required(item, "role", f"{param}.")
        if role not in INPUT_ROLES:
            raise RequestError(f"'{param}.role' is {json.dumps(role)}; use one of {', '.join(INPUT_ROLES)}",
                               param=f"{param}.role", code="invalid_value")
        content = _text_parts(_required(item, "content", f"{param}."), f"{param}.content")
        self.add({"role": "system" if role == "developer" else role, "content": content}, param, True)

    def function_call(self, item: Mapping[str, Any], param: str) -> None:
        item = _object(item, param, _CALL_KEYS)
        call = {"id": _text_field(item, "call_id", param), "type": "function",
                "function": {"name": _text_field(item, "name", param),
                             "arguments": _text_field(item, "arguments", param)}}
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant":
            # calls that follow the assistant's text, or each other, are that one turn of the assistant's
            last.setdefault("tool_calls", []).append(call)
            return
        self.add({"role": "assistant", "content": None, "tool_calls": [call]}, param, False)

    def function_call_output(self, item: Mapping[str, Any], param: str) -> None:
        item = _object(item, param, _OUTPUT_KEYS)
        call_id = _text_field(item, "call_id", param)
        output = _text_parts(_required(item, "output", f"{param}."), f"{param}.output")
        self.add({"role": "tool", "tool_call_id": call_id, "content": output}, param, False)


def _input(body: Mapping[str, Any], messages: _Messages) -> None:
    value = body.get("input")
    if value is None:
        raise RequestError("missing required field 'input': the text, or an array of messages", param="input",
                           code="missing_required_parameter")
    if isinstance(value, str):
        messages.add({"role": "user", "content": value}, "input", False)
        return
    if not isinstance(value, list):
        raise RequestError(f"'input' must be a string or an array of input items, not {_json_type(value)}",
                           param="input", code="invalid_type")
    if not value:
        raise RequestError("'input' must hold at least one item", param="input", code="invalid_value")
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"'{param}' must be an object, not {_json_type(item)}", param=param, code="invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            messages.message(item, param)
        elif kind == "function_call":
            messages.function_call(item, param)
        elif kind == "function_call_output":
            messages.function_call_output(item, param)
        elif kind == "reasoning":
            continue  # as the chat API: earlier thinking is not shown to the model again
        elif kind == "item_reference":
            raise RequestError(f"'{param}' is an item_reference to {json.dumps(item.get('id'))}: {NO_STORE}. A "
                               "client that refers to earlier items does so when it believes they were stored: send "
                               "\"store\": false (the AI SDK: providerOptions.openai.store = false)",
                               param=f"{param}.type", code="unsupported_value")
        else:
            raise RequestError(f"'{param}.type' is {json.dumps(kind)}; this server reads \"message\", "
                               "\"function_call\", \"function_call_output\" and \"reasoning\" items",
                               param=f"{param}.type", code="unsupported_value")


def _tools(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise RequestError(f"'tools' must be an array, not {_json_type(value)}", param="tools", code="invalid_type")
    tools = []
    for i, tool in enumerate(value):
        param = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise RequestError(f"'{param}' must be an object, not {_json_type(tool)}", param=param, code="invalid_type")
        if tool.get("type") != "function":
            raise RequestError(f"'{param}.type' is {json.dumps(tool.get('type'))}; this server runs no tools of its "
                               "own (web or file search, code, computer use, MCP): only \"function\" tools, which "
                               "the client runs", param=f"{param}.type", code="unsupported_value")
        tool = _object(tool, param, _TOOL_KEYS)
        _text_field(tool, "name", param)  # the echo below reads it before the chat parser
        tools.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return tools


def _tool_choice(value: Any) -> Any:
    if not isinstance(value, dict):
        return value  # "none", "auto", "required", or what the chat parser refuses
    if value.get("type") == "allowed_tools":  # the Responses API's flat form, in the chat API's
        allowed = _object(value, "tool_choice", frozenset({"type", "mode", "tools"}))
        listed = allowed.get("tools")
        tools = [{"type": t.get("type"), "function": {k: v for k, v in t.items() if k != "type"}}
                 if isinstance(t, dict) else t for t in listed] if isinstance(listed, list) else listed
        return {"type": "allowed_tools", "allowed_tools": {"mode": allowed.get("mode"), "tools": tools}}
    if value.get("type") != "function":
        raise RequestError(f"'tool_choice.type' is {json.dumps(value.get('type'))}; use \"none\", \"auto\", "
                           "\"required\", {\"type\": \"function\", \"name\": ...} or {\"type\": \"allowed_tools\", "
                           "...}", param="tool_choice.type",
                           code="unsupported_value")
    chosen = _object(value, "tool_choice", frozenset({"type", "name"}))
    return {"type": "function", "function": {"name": _required(chosen, "name", "tool_choice.")}}


def _response_format(value: Any) -> dict[str, Any]:
    text = _object(value, "text", _TEXT_KEYS)
    verbosity = text.get("verbosity")
    if verbosity is not None and verbosity not in VERBOSITIES:
        raise RequestError(f"'text.verbosity' is {json.dumps(verbosity)}; use one of {', '.join(VERBOSITIES)}",
                           param="text.verbosity", code="invalid_value")
    if text.get("format") is None:
        return {"type": "text"}
    fmt = _object(text["format"], "text.format", _FORMAT_KEYS)
    if fmt.get("type") != "json_schema":
        return dict(fmt)  # "text" and "json_object" read the same in chat
    _required(fmt, "schema", "text.format.")  # optional in chat's response_format, required here
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def _stream_options(body: Mapping[str, Any]) -> None:
    """`stream_options`, as chat reads it: only beside "stream": true; nothing in it changes the events."""
    options = body.get("stream_options")
    if options is None:
        return
    stream = body.get("stream")
    if stream is not None:
        _boolean(stream, "stream")  # a wrong type is named as such before what it keeps from stream_options
    if stream is not True:
        raise RequestError("'stream_options' is only allowed with \"stream\": true", param="stream_options",
                           code="invalid_value")
    options = _object(options, "stream_options", _STREAM_OPTION_KEYS)
    if options.get("include_obfuscation") is not None:
        _boolean(options["include_obfuscation"], "stream_options.include_obfuscation")


def _reasoning(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    reasoning = _object(value, "reasoning", _REASONING_KEYS)
    for key, setting in reasoning.items():
        # the values OpenAI takes: echoed back, another would fail the client's own reading of the response
        choices = REASONING_EFFORTS if key == "effort" else REASONING_SUMMARIES
        if setting is not None and setting not in choices:
            raise RequestError(f"'reasoning.{key}' is {json.dumps(setting)}; use one of {', '.join(choices)}",
                               param=f"reasoning.{key}", code="invalid_value")
    return {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")}


def translate(body: Mapping[str, Any]) -> Translation:
    """The chat body for a Responses body. Raises RequestError, naming the Responses field, for what the
    translation itself cannot take; what the chat parser refuses later goes through `Translation.blame`."""
    for name in body:
        if name in _CHAT_ONLY and body[name] is not None:
            raise RequestError(f"unsupported field '{name}': /v1/responses does not take it, "
                               "/v1/chat/completions does; send the request there, or remove it", param=name,
                               code="unsupported_parameter")
    _check_fields(body, _FIELDS, {})
    _refuse_stored_state(body)
    _stream_options(body)
    top = body.get("top_logprobs")
    if top is not None and (type(top) is not int or top != 0):  # not False, not 0.0: the integer 0 asks for none
        raise RequestError("'top_logprobs' is not supported on /v1/responses: tc gives no log-probabilities here "
                           "(the output_text logprobs that 'include' selects); send the request to "
                           "/v1/chat/completions with \"logprobs\": true and top_logprobs", param="top_logprobs",
                           code="unsupported_parameter")
    messages = _Messages()
    instructions = body.get("instructions")
    if instructions is not None:
        messages.add({"role": "system", "content": _string(instructions, "instructions")}, "instructions", False)
    _input(body, messages)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages.messages}
    for ours, theirs in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("stream", "stream"), ("parallel_tool_calls", "parallel_tool_calls"),
                         ("user", "user"), ("prompt_cache_key", "prompt_cache_key"),  # chat checks these three
                         ("safety_identifier", "safety_identifier"), ("service_tier", "service_tier")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    text: dict[str, Any] = {"format": {"type": "text"}}
    if body.get("text") is not None:
        chat["response_format"] = _response_format(body["text"])
        text = {"format": body["text"].get("format") or {"type": "text"}}
        if body["text"].get("verbosity") is not None:
            text["verbosity"] = body["text"]["verbosity"]
    reasoning = _reasoning(body.get("reasoning"))
    if reasoning is not None and reasoning["effort"] is not None:
        chat["reasoning_effort"] = reasoning["effort"]  # for the chat template, as chat's own field
    metadata = body.get("metadata")
    check_metadata(metadata)
    parallel = body.get("parallel_tool_calls")
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": metadata or {}, "parallel_tool_calls": True if parallel is None else parallel,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": [_echo_tool(t["function"]) for t in chat.get("tools", ())], "text": text,
            "reasoning": reasoning, "truncation": "disabled", "user": body.get("user"),
            "store": False}
    return Translation(chat, echo, messages.sources)


def _echo_tool(function: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "function", "name": function["name"], "description": function.get("description"),
            "parameters": function.get("parameters"), "strict": bool(function.get("strict"))}


# --- the reply ------------------------------------------------------------------------------------------------------

def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(chat_usage: Mapping[str, Any]) -> dict[str, Any]:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    # the thinking's tokens are not counted apart: the generation counts tokens, not what the reply made of them
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _outcome(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """The response's status and incomplete_details for the chat reply's finish_reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _end_items(output: list[dict[str, Any]], status: str) -> list[dict[str, Any]]:
    """The last item of an incomplete response is incomplete too: it is where the generation stopped."""
    if status == "incomplete" and output:
        output[-1] = {**output[-1], "status": "incomplete"}
    return output


@dataclass
class ResponseShape:
    """What every response object of one request repeats: its id, time, model and the request's echoes."""

    model: str
    echo: dict[str, Any]
    id: str = field(default_factory=lambda: _new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
             incomplete: dict[str, str] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": error, "incomplete_details": incomplete, "model": self.model, "output": output,
                "usage": usage, **self.echo}


class ResponsesReply:
    """The reply of one Responses request, over the chat reply of its generation. `whole` converts the chat body;
    streamed, `ResponseEventStream` feeds the chat chunks to `events`, which turns them into typed events."""

    def __init__(self, chat: ChatReply, shape: ResponseShape):
        self.chat, self.shape = chat, shape
        self._sequence = 0
        self._output: list[dict[str, Any]] = []  # the items done so far
        self._open: dict[str, Any] | None = None  # the item being streamed: its kind, id, index and text
        self._finish: str | None = None

    def whole(self, completion: Completion) -> dict[str, Any]:
        body = self.chat.whole(completion)
        choice = body["choices"][0]
        message = choice["message"]
        output: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            output.append(_reasoning_item(_new_id("rs"), message["reasoning_content"], "completed"))
        calls = message.get("tool_calls") or []
        content = message.get("content")
        if content or (content is not None and not output and not calls):
            output.append(_message_item(_new_id("msg"), content, "completed"))
        for call in calls:
            output.append(_call_item(_new_id("fc"), call["id"], call["function"]["name"],
                                     call["function"]["arguments"], "completed"))
        status, incomplete = _outcome(choice["finish_reason"])
        return self.shape.body(status, _end_items(output, status), _usage(body["usage"]), incomplete)

    # --- streamed -------------------------------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> bytes:
        """One server-sent event of `kind`, named on its `event:` line as OpenAI's are, numbered in order."""
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\n" + sse(payload)

    def opening(self) -> Iterator[bytes]:
        started = self.shape.body("in_progress", [], None)
        yield self.event("response.created", response=started)
        yield self.event("response.in_progress", response=started)

    def _open_item(self, kind: str, item: dict[str, Any]) -> Iterator[bytes]:
        index = len(self._output)
        self._open = {"kind": kind, "item": item, "index": index, "text": ""}
        yield self.event("response.output_item.added", output_index=index, item=item)
        if kind == "message":
            yield self.event("response.content_part.added", item_id=item["id"], output_index=index,
                             content_index=0, part=_text_part(""))
        elif kind == "reasoning":
            yield self.event("response.content_part.added", item_id=item["id"], output_index=index,
                             content_index=0, part={"type": "reasoning_text", "text": ""})

    def _close_item(self, status: str = "completed") -> Iterator[bytes]:
        if self._open is None:
            return
        opened, self._open = self._open, None
        kind, item, index, text = opened["kind"], opened["item"], opened["index"], opened["text"]
        where = {"item_id": item["id"], "output_index": index}
        if kind == "message":
            yield self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
            yield self.event("response.content_part.done", **where, content_index=0, part=_text_part(text))
            done = _message_item(item["id"], text, status)
        elif kind == "reasoning":
            yield self.event("response.reasoning_text.done", **where, content_index=0, text=text)
            yield self.event("response.content_part.done", **where, content_index=0,
                             part={"type": "reasoning_text", "text": text})
            done = _reasoning_item(item["id"], text, status)
        else:
            yield self.event("response.function_call_arguments.done", **where, arguments=text, name=item["name"])
            done = _call_item(item["id"], item["call_id"], item["name"], text, status)
        self._output.append(done)
        yield self.event("response.output_item.done", output_index=index, item=done)

    def _text(self, kind: str, text: str) -> Iterator[bytes]:
        if self._open is None or self._open["kind"] != kind:
            yield from self._close_item()
            if kind == "message":
                yield from self._open_item(kind, _message_item(_new_id("msg"), None, "in_progress"))
            else:
                yield from self._open_item(kind, _reasoning_item(_new_id("rs"), None, "in_progress"))
        assert self._open is not None
        self._open["text"] += text
        where = {"item_id": self._open["item"]["id"], "output_index": self._open["index"], "content_index": 0}
        if kind == "message":
            yield self.event("response.output_text.delta", **where, delta=text, logprobs=[])
        else:
            yield self.event("response.reasoning_text.delta", **where, delta=text)

    def _call(self, delta: Mapping[str, Any]) -> Iterator[bytes]:
        if "id" in delta:  # a call's first delta: its id and name (ChatReply: then its arguments)
            yield from self._close_item()
            item = _call_item(_new_id("fc"), delta["id"], delta["function"]["name"], "", "in_progress")
            yield from self._open_item("function_call", item)
            return
        arguments = delta["function"]["arguments"]
        assert self._open is not None and self._open["kind"] == "function_call"
        self._open["text"] += arguments
        yield self.event("response.function_call_arguments.delta", item_id=self._open["item"]["id"],
                         output_index=self._open["index"], delta=arguments)

    def events(self, chunk: Mapping[str, Any]) -> Iterator[bytes]:
        """The events of one chat chunk."""
        choice = chunk["choices"][0]
        delta = choice["delta"]
        if delta.get("reasoning_content"):
            yield from self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            yield from self._text("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            yield from self._call(call)
        if choice["finish_reason"] is not None:
            self._finish = choice["finish_reason"]

    def closing(self, completion: Completion) -> Iterator[bytes]:
        """The last item's end, then the whole response."""
        if self._open is None and not self._output:  # nothing generated: an empty message, as the whole reply has
            yield from self._open_item("message", _message_item(_new_id("msg"), None, "in_progress"))
        status, incomplete = _outcome(self._finish)
        yield from self._close_item("incomplete" if status == "incomplete" else "completed")
        usage = _usage(self.chat.usage_chunk(completion)["usage"])
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield self.event(kind, response=self.shape.body(status, self._output, usage, incomplete))

    def failed(self, error: Mapping[str, Any]) -> bytes:
        """The last event of a stream that broke off: the response, failed, with what the error reply says."""
        code = "rate_limit_exceeded" if error.get("code") == "server_busy" else "server_error"
        return self.event("response.failed", response=self.shape.body(
            "failed", self._output, None, error={"code": code, "message": error["message"]}))


class ResponseEventStream(EventStream):
    """EventStream for /v1/responses: one generation, its steps read as chat chunks and told as Responses events
    (`event:` lines, no `[DONE]`). A failure is a `response.failed` event; a client that leaves is noticed as
    EventStream notices it, by the SSE comment written before each next step."""

    def __init__(self, group: GenerationGroup, replies: list[ResponsesReply], *, include_usage: bool,
                 error_body: Callable[[Exception], dict[str, Any]], on_close: Callable[[EventStream], None]):
        self.reply = replies[0]
        super().__init__(group, list(replies), include_usage=include_usage, error_body=error_body,
                         on_close=on_close)

    def _step_events(self, step: Step, first: bool) -> Iterator[bytes]:
        chat = self.reply.chat
        chunks = chat.opening(step) if first else []
        chunks += chat.deltas(step)
        if step.completion is not None:
            chunks += chat.closing(step.completion)
        for chunk in chunks:
            yield from self.reply.events(chunk)

    def _events(self) -> Iterator[bytes]:
        try:
            yield from self.reply.opening()  # the response as created: the request is in, its text to come
            first = True
            generation, = yield from self._started()
            for step in generation.steps(IDLE_KEEPALIVE_S):
                if step is None:
                    yield KEEPALIVE
                    continue
                yield from self._step_events(step, first)
                first = False
                if step.completion is not None:
                    yield from self.reply.closing(step.completion)
                    return
                yield KEEPALIVE  # see EventStream._events
        except Exception as exc:  # the client hears of it in the stream; the log has the rest
            yield self.reply.failed(self._error_body(exc)["error"])
