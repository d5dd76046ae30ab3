"""Request bodies of the OpenAI-compatible API, parsed into frozen values. No I/O, no HTTP.

Theory of operation: the API reads the raw body, `decode_json_body` turns it into a JSON object, and
`parse_completion_request` / `parse_chat_request` check every field against what OpenAI documents and what
this server implements. Anything else in the body is refused by name rather than ignored, so a client never
believes a parameter took effect when it did not. Every refusal is a `RequestError` that names the offending
field (`param`) and a short machine-readable `code`; the API turns it into an OpenAI error body.

As in OpenAI's API, an optional field sent as `null` means the same as leaving it out; so does a field this server
does not implement, sent as `null` (clients built on the openai package pass their unset settings through as null).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..model.chat_template import RESERVED_VARIABLES
from ..sampling import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# OpenAI takes 4; editors' fill-in-the-middle templates send more (a Qwen2.5-Coder's lists 9: its end of text and
# its FIM and chat tokens), as may lm-evaluation-harness. Each is looked for in the text at every token: 32 is cheap.
MAX_STOP_STRINGS = 32
MAX_LOGPROBS = 20  # alternatives per token: OpenAI's limit for chat's top_logprobs (legacy completions: 5)
MAX_CHOICES = 16  # choices per request (n); each is a sequence in the batch, so head.max_batch bounds it too
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty, as OpenAI documents them
CHAT_ROLES = ("system", "user", "assistant", "tool")
# The deprecated function-calling form, which clients written for it still send (Dify's function-call mode, older
# LangChain agents): `functions` and `function_call` in the request, an assistant message's `function_call` and a
# `function` message with its result. It is read as tools with one call a turn, and answered in its own form.
FUNCTION_ROLE = "function"
FUNCTION_CALLS = ("none", "auto")
# OpenAI's name for the system role in requests to its newer models, which its clients and SDK examples now send;
# a chat template knows it as "system", which is what it is taken for.
DEVELOPER_ROLE = "developer"
MAX_TOOLS = 128  # OpenAI's limit
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
TOOL_CHOICES = ("none", "auto", "required")
_SEED_RANGE = (-(2**63), 2**63)  # a signed 64-bit integer, as OpenAI documents `seed`
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 bans a token, 100 makes it the only choice
MAX_LOGIT_BIAS = 300  # tokens one request may bias: each is an entry of a tensor made for every token chosen
_TOKEN_KEY = re.compile(r"[0-9]{1,10}")  # a logit_bias key: a token id as a decimal string (ASCII digits only)
# chat_template_kwargs: a few switches (Qwen3's enable_thinking, a reasoning effort), not documents; the prompt the
# template makes of them is bounded by the context, but the work of reading and rendering them is bounded here
MAX_TEMPLATE_VARIABLES = 32
MAX_TEMPLATE_VARIABLES_CHARS = 16 * 1024  # of their JSON, written compactly
TEMPLATE_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # a name a template can read as a plain variable
# what the request itself sets, under its own fields: in chat_template_kwargs, they would say two things at once
_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "tools", "messages")


class RequestError(Exception):
    """A request this server refuses as written. `param` names the field at fault (None: the whole body)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ModelNotFound(RequestError):
    """The request names a model this server does not serve."""

    def __init__(self, requested: str, served: str, *, param: str | None = "model"):
        super().__init__(f"The model '{requested}' does not exist here; this server serves '{served}'",
                         param=param, code="model_not_found")


class BodyTooLarge(RequestError):
    """The request body is over the server's size limit."""

    def __init__(self, size: int | None, limit: int):
        size_text = f"{size} bytes" if size is not None else "over this server's limit"
        super().__init__(f"the request body is {size_text}; this server accepts at most {limit} bytes (its "
                         "operator sets that with head.max_body_mb in the topology file)", code="request_too_large")


class UnsupportedEncoding(RequestError):
    """The request body comes in a content coding (gzip, br, ...) this server does not decode."""

    def __init__(self, encoding: str):
        super().__init__(f"the request body's Content-Encoding is {encoding!r}; this server reads only bodies sent "
                         "as they are (identity): send the JSON uncompressed", code="unsupported_content_encoding")


class UnsupportedMediaType(RequestError):
    """A body that is no JSON, sent with a Content-Type that does not say JSON either (a form, multipart, text)."""

    def __init__(self, content_type: str):
        super().__init__(f"the request body is sent as {content_type!r} and is not JSON; this server reads only "
                         "JSON: send a JSON object with the header Content-Type: application/json (with curl: "
                         "-H 'Content-Type: application/json')", code="unsupported_media_type")


def says_json(content_type: str | None) -> bool:
    """Whether a Content-Type names JSON: application/json or a +json type, whatever its parameters; no
    Content-Type at all counts as JSON, which is all this server reads."""
    if not content_type:
        return True
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/")
                                                 and media_type.endswith("+json"))


@dataclass(frozen=True)
class SamplingFields:
    """The sampling fields shared by both endpoints; `max_tokens` None means the endpoint's default."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_k: int = 0  # 0: off (a client's -1 means the same)
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # alternatives per token; None: no log-probabilities at all
    min_tokens: int = 0  # vLLM's extension: no EOS and no stop string before this many tokens
    ignore_eos: bool = False  # vLLM's extension: EOS does not end the completion
    n: int = 1  # choices: that many sequences of the same prompt, each sampled on its own
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value), by token id; not yet checked against a vocab
    cache_prompt: bool = True  # llama.cpp's extension: False reads the whole prompt, whatever caches are kept
    given: frozenset[str] = frozenset()  # the fields the request sent: the model's defaults fill in the others

    def to_params(self, default_max_tokens: int, *, default_is: str = "", prompt_logprobs: bool = False,
                  continues_prompt: bool = False, defaults: Mapping[str, float] | None = None) -> SamplingParams:
        """Raises RequestError when min_tokens is over the completion's max_tokens. `default_is` says where
        `default_max_tokens` comes from, for that error where the request left max_tokens out. `defaults`: the
        model's own values (sampling_defaults.py) for the sampling fields the request left out."""
        if defaults:
            filled = {name: value for name, value in defaults.items() if name not in self.given}
            if filled.get("temperature", self.temperature) == 0:  # greedy: the argmax asked for, no penalty on it
                filled = {"temperature": 0.0} if "temperature" in filled else {}
            return dataclasses.replace(self, **filled, given=self.given | set(filled)).to_params(
                default_max_tokens, default_is=default_is, prompt_logprobs=prompt_logprobs,
                continues_prompt=continues_prompt)
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        if self.min_tokens > max_tokens >= 0:  # a negative max_tokens is SamplingParams' to refuse
            given = f"max_tokens ({max_tokens})" if self.max_tokens is not None else \
                f"max_tokens, which the request leaves out, so it is {max_tokens} ({default_is})"
            raise RequestError(f"'min_tokens' ({self.min_tokens}) must not be more than {given}",
                               param="min_tokens", code="invalid_value")
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              stop=self.stop, seed=self.seed, top_k=self.top_k, min_p=self.min_p,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, logprobs=self.logprobs,
                              prompt_logprobs=prompt_logprobs and self.logprobs is not None,
                              min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, continues_prompt=continues_prompt,
                              logit_bias=self.logit_bias, cache_prompt=self.cache_prompt)


@dataclass(frozen=True)
class StreamFields:
    """`stream` and `stream_options`: whether to answer with server-sent events, and with a usage chunk."""

    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | tuple[int, ...]  # text to encode, or token ids given by the client
    sampling: SamplingFields
    streaming: StreamFields = StreamFields()
    echo: bool = False  # the reply's text (and log-probabilities) start with the prompt's
    suffix: str | None = None  # fill in the middle: the text that comes after the completion


@dataclass(frozen=True)
class MessageToolCall:
    """A call an earlier assistant message made, as the client sends it back: `arguments` is JSON text."""

    id: str
    name: str
    arguments: str

    def as_template_input(self) -> dict[str, Any]:
        # templates write the arguments with `tojson`, so they get the object, not its JSON text (as vLLM does)
        try:
            arguments: Any = json.loads(self.arguments)
        except (ValueError, RecursionError):  # not JSON, or nested past what json reads: the text as it is
            arguments = self.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str | None  # None: an assistant message that only calls tools
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: tuple[MessageToolCall, ...] = ()
    reasoning_content: str | None = None  # an assistant's thinking, as this server's replies give it back

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates expect it (only the keys that were given)."""
        # "" rather than None: templates concatenate content, and an assistant's calls come with no text
        message: dict[str, Any] = {"role": self.role, "content": self.content if self.content is not None else ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [call.as_template_input() for call in self.tool_calls]
        if self.reasoning_content is not None:  # Qwen3's template writes it back in the turns after the last query
            message["reasoning_content"] = self.reasoning_content
        return message


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and its arguments' JSON schema."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] | None = None
    strict: bool = False

    def as_template_input(self) -> dict[str, Any]:
        """The tool as transformers hands it to chat templates (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """`none`, `auto`, `required`, or `function` with the one tool's `name`; `auto` and `required` may be held to
    the tools named in `allowed` (OpenAI's allowed_tools: the list of tools stays whole, so a client's prompt
    cache holds, and each request allows some of them)."""

    mode: str
    name: str | None = None
    allowed: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ResponseFormat:
    """`text` (anything), `json_object` (any JSON object) or `json_schema` (JSON valid under `schema`)."""

    type: str = "text"
    name: str | None = None
    schema: Mapping[str, Any] | None = None  # None with json_schema: any JSON value
    strict: bool = False


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingFields
    streaming: StreamFields = StreamFields()
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True
    response_format: ResponseFormat = ResponseFormat()
    add_generation_prompt: bool = True  # the template opens the assistant's turn after the messages
    continue_final_message: bool = False  # the reply continues the final (assistant) message's text instead
    template_variables: Mapping[str, Any] = field(default_factory=dict)  # chat_template_kwargs
    reasoning_format: str = "auto"  # "none": a thinking model's thinking stays in content, tags and all
    prediction: str | None = None  # the text the reply is expected to repeat much of (OpenAI's predicted output)
    legacy_functions: bool = False  # the tools came as `functions`: the reply's call is a `function_call`

    @property
    def tools_field(self) -> str:
        """The field the request's tools came in, for errors that name it."""
        return "functions" if self.legacy_functions else "tools"

    def tool_param(self, index: int) -> str:
        """Where the request holds tool `index`'s function object, for errors that name it."""
        return f"functions[{index}]" if self.legacy_functions else f"tools[{index}].function"

    @property
    def offered_tools(self) -> tuple[Tool, ...]:
        """The tools the model is shown and may call: none for "none", only the named one for a function."""
        if self.tool_choice.mode == "none":
            return ()
        if self.tool_choice.mode == "function":
            return tuple(t for t in self.tools if t.name == self.tool_choice.name)
        if self.tool_choice.allowed is not None:
            return tuple(t for t in self.tools if t.name in self.tool_choice.allowed)
        return self.tools


# Fields some OpenAI clients send on every request with their default value. That value asks for exactly what
# this server does anyway, so such a request is served as written; any other value is refused like any unknown
# field. Values are compared with their JSON type, so `false` never passes for `0`.
_COMPLETION_NEUTRAL: dict[str, tuple[Any, ...]] = {"best_of": (None, 1)}
# Chat fields of OpenAI's that a client may send set to what this server does anyway: nothing stored, the default
# service tier, text out
_CHAT_NEUTRAL: dict[str, tuple[Any, ...]] = {"store": (None, False), "service_tier": (None, "auto", "default"),
                                             "modalities": (None, ["text"]), "audio": (None,)}

_COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "stop", "n", "stream", "stream_options",
                            "seed", "user", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                            "repetition_penalty", "logprobs", "min_tokens", "ignore_eos", "logit_bias", "cache_prompt"})
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "suffix"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                 "parallel_tool_calls", "response_format", "chat_template_kwargs",
                                 "add_generation_prompt", "continue_final_message", "reasoning_format",
                                 "metadata", "prompt_cache_key", "safety_identifier", "prediction",  # _check_hints
                                 "reasoning_effort", "functions", "function_call"}
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# llama.cpp's server's names: "deepseek" (its default) and "auto" split the thinking into reasoning_content
REASONING_FORMATS = ("auto", "deepseek", "none")
_JSON_SCHEMA_FIELDS = frozenset({"name", "description", "schema", "strict"})
# The openai client's parse() and stream() helpers add their own reading of a reply to its message object, and send
# it back when that object is appended to the conversation: `parsed` (the content read into the response_format's
# type), a call's `function.parsed_arguments` (its arguments read into the tool's type) and a streamed call's
# `index`. They repeat what `content` and `arguments` hold, which is what the template renders, so any value of
# theirs is taken and left unused.
# `cache_control` ({"type": "ephemeral"}) marks where a prompt cache may end, on a message, a text part or a tool:
# Anthropic's hint, which Roo Code, Kilo Code, Cline and qwen-code send to OpenAI-compatible servers where prompt
# caching is on, and LiteLLM passes through. tc keeps caches of its own accord (head.prefix_cache), so it is taken
# and left unused.
_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_call_id", "tool_calls", "parsed", "refusal",
                             "reasoning_content", "function_call", "cache_control"})
# what the openai client sends back when a reply's message object is appended to the conversation as it is
_MESSAGE_NEUTRAL: dict[str, tuple[Any, ...]] = {"audio": (None,), "annotations": (None, [])}
_TOOL_FIELDS = frozenset({"type", "function", "cache_control"})
_FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "strict"})
_CALL_FIELDS = frozenset({"id", "type", "function", "index"})
_TEXT_PART_FIELDS = frozenset({"type", "text", "cache_control"})
_CALL_FUNCTION_FIELDS = frozenset({"name", "arguments", "parsed_arguments"})
# include_obfuscation asks OpenAI to pad each chunk with random characters (against reading a reply's length off
# the wire); tc's chunks carry no padding either way, so both values are taken
_STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})
# chat's reasoning_effort (and the Responses API's reasoning.effort): the values OpenAI takes. The chat template
# sees the value as its variable `reasoning_effort` (gpt-oss's reads it); a template that does not read it, as most
# do not, renders the same prompt without it
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode_json_body(body: bytes) -> dict[str, Any]:
    """The JSON object in `body`. Raises RequestError when it is empty, not UTF-8 JSON, or not an object."""
    if not body.strip():
        raise RequestError("the request body is empty; send a JSON object", code="invalid_json")
    try:
        # parse_constant: NaN and Infinity are not JSON, though Python's json module accepts them by default
        # "utf-8-sig": a byte order mark before the JSON is dropped, as RFC 8259 lets a parser do (editors and
        # PowerShell on Windows write one); json.loads refuses it
        value = json.loads(body.decode("utf-8-sig"), parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise RequestError(f"the request body is not UTF-8: {exc}", code="invalid_json") from exc
    except ValueError as exc:  # json.JSONDecodeError is a ValueError, as is _reject_constant's
        raise RequestError(f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    except RecursionError as exc:  # json.loads recurses once per level of nesting
        raise RequestError("the request body is nested too deeply to be a request", code="invalid_json") from exc
    if not isinstance(value, dict):
        raise RequestError(f"the request body must be a JSON object, not {_json_type(value)}",
                           code="invalid_type")
    _check_unicode(value)
    return value


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")  # UTF-8 has no encoding for a surrogate; the codec finds one at C speed
    except UnicodeEncodeError:
        return True
    return False


def _check_unicode(body: dict[str, Any]) -> None:
    """Refuse strings holding a lone UTF-16 surrogate (JSON's "\\ud800"): not text, so not for the tokenizer.

    A surrogate pair in JSON decodes to one character; only an unpaired half is left as a surrogate.
    """
    pending: list[tuple[Any, str]] = [(body, "")]  # a loop, not recursion: the body may be deeply nested
    while pending:
        value, path = pending.pop()
        if isinstance(value, str) and _has_lone_surrogate(value):
            raise RequestError(f"'{path}' holds an unpaired UTF-16 surrogate, which is not a character; send "
                               "valid Unicode text", param=path or None, code="invalid_value")
        if isinstance(value, dict):
            for key, item in value.items():
                if _has_lone_surrogate(key):
                    raise RequestError(f"a key in '{path or 'the body'}' holds an unpaired UTF-16 surrogate",
                                       param=path or None, code="invalid_value")
                pending.append((item, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            pending.extend((item, f"{path}[{i}]") for i, item in enumerate(value))


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _same_json(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def _check_fields(body: Mapping[str, Any], known: frozenset[str], neutral: Mapping[str, tuple[Any, ...]]) -> None:
    for name in body:
        if name in known or body[name] is None:  # null: as if left out (the module's docstring)
            continue
        if name in neutral:
            if any(_same_json(body[name], allowed) for allowed in neutral[name]):
                continue
            shown = ", ".join(json.dumps(v) for v in neutral[name])
            raise RequestError(f"unsupported field '{name}': this server implements only {shown} for it",
                               param=name, code="unsupported_parameter")
        raise RequestError(f"unsupported field '{name}': this server does not implement it; remove it",
                           param=name, code="unsupported_parameter")


def _required(body: Mapping[str, Any], name: str, where: str = "") -> Any:
    value = body.get(name)  # absent and null are the same to OpenAI
    if value is None:
        raise RequestError(f"missing required field '{where}{name}'", param=where + name,
                           code="missing_required_parameter")
    return value


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise RequestError(f"'{param}' must be a string, not {_json_type(value)}", param=param,
                           code="invalid_type")
    return value


def _integer(value: Any, param: str) -> int:
    # bool is an int subclass in Python; JSON true is not an integer
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{param}' must be an integer, not {_json_type(value)}", param=param,
                           code="invalid_type")
    return value


def _number(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"'{param}' must be a number, not {_json_type(value)}", param=param,
                           code="invalid_type")
    try:
        number = float(value)
    except OverflowError:  # an integer literal with hundreds of digits
        number = math.inf
    if not math.isfinite(number):  # 1e999 parses as infinity
        raise RequestError(f"'{param}' is out of range", param=param, code="invalid_value")
    return number


def _max_tokens(value: Any, param: str, least: int = 1) -> int:
    tokens = _integer(value, param)
    if tokens < least:
        raise RequestError(f"'{param}' must be at least {least}, not {tokens}", param=param, code="invalid_value")
    return tokens


def _temperature(value: Any) -> float:
    temperature = _number(value, "temperature")
    if not 0 <= temperature <= 2:
        raise RequestError(f"'temperature' must be between 0 and 2, not {value}", param="temperature",
                           code="invalid_value")
    return temperature


def _top_p(value: Any) -> float:
    top_p = _number(value, "top_p")
    if not 0 < top_p <= 1:
        raise RequestError(f"'top_p' must be greater than 0 and at most 1, not {value}", param="top_p",
                           code="invalid_value")
    return top_p


def _min_p(value: Any) -> float:
    min_p = _number(value, "min_p")
    if not 0 <= min_p <= 1:
        raise RequestError(f"'min_p' must be between 0 and 1 (0 turns it off), not {value}", param="min_p",
                           code="invalid_value")
    return min_p


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise RequestError(f"'stop' must be a string or an array of strings, not {_json_type(value)}",
                           param="stop", code="invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, not {len(stops)}",
                           param="stop", code="invalid_value")
    for i, stop in enumerate(stops):
        _string(stop, f"stop[{i}]" if isinstance(value, list) else "stop")
        if not stop:
            raise RequestError("stop strings must not be empty", param="stop", code="invalid_value")
    return tuple(stops)


def _seed(value: Any) -> int:
    seed = _integer(value, "seed")
    if not _SEED_RANGE[0] <= seed < _SEED_RANGE[1]:
        raise RequestError("'seed' must fit a signed 64-bit integer", param="seed", code="invalid_value")
    return seed


def _boolean(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise RequestError(f"'{param}' must be a boolean, not {_json_type(value)}", param=param,
                           code="invalid_type")
    return value


def _choices(value: Any) -> int:
    n = _integer(value, "n")
    if not 1 <= n <= MAX_CHOICES:
        raise RequestError(f"'n' must be between 1 and {MAX_CHOICES}, not {n}", param="n", code="invalid_value")
    return n


def _check_user(body: Mapping[str, Any]) -> None:
    user = body.get("user")
    if user is not None:
        _string(user, "user")  # accepted for compatibility; it changes nothing here


def check_metadata(metadata: Any) -> None:
    """OpenAI's `metadata` (chat's and the Responses API's): null, or an object of strings."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise RequestError(f"'metadata' must be an object of strings, not {_json_type(metadata)}", param="metadata",
                           code="invalid_type")
    for key, value in metadata.items():
        _string(value, f"metadata.{key}")


def _check_hints(body: Mapping[str, Any]) -> str | None:
    """Chat fields of OpenAI's that change no reply, checked as OpenAI checks them: `metadata` (tags for a stored
    completion: nothing is stored), `prompt_cache_key` and `safety_identifier` (hints for its cache routing and
    abuse detection), left unused; and `prediction` (a predicted output, which only makes a reply sooner: a greedy
    one takes its guesses from it, draft.py), whose text is returned (None: there is none)."""
    check_metadata(body.get("metadata"))
    for name in ("prompt_cache_key", "safety_identifier"):
        if body.get(name) is not None:
            _string(body[name], name)
    prediction = body.get("prediction")
    if prediction is not None:
        prediction = _object(prediction, "prediction", frozenset({"type", "content"}))
        if prediction.get("type") != "content":
            raise RequestError(f"'prediction.type' is {json.dumps(prediction.get('type'))}; it must be \"content\"",
                               param="prediction.type", code="invalid_value")
        return _content(_required(prediction, "content", "prediction."), "prediction.content")
    return None


def _streaming(body: Mapping[str, Any]) -> StreamFields:
    stream = body.get("stream")
    stream = _boolean(stream, "stream") if stream is not None else False
    options = body.get("stream_options")
    if options is None:
        return StreamFields(stream)
    if not stream:
        raise RequestError("'stream_options' is only allowed with \"stream\": true", param="stream_options",
                           code="invalid_value")
    if not isinstance(options, dict):
        raise RequestError(f"'stream_options' must be an object, not {_json_type(options)}",
                           param="stream_options", code="invalid_type")
    for key in options:
        if key not in _STREAM_OPTIONS and options[key] is not None:
            raise RequestError(f"unsupported field 'stream_options.{key}': this server implements only "
                               "include_usage and include_obfuscation", param=f"stream_options.{key}",
                               code="unsupported_parameter")
    if options.get("include_obfuscation") is not None:
        _boolean(options["include_obfuscation"], "stream_options.include_obfuscation")
    include = options.get("include_usage")
    return StreamFields(True, _boolean(include, "stream_options.include_usage") if include is not None else False)


def _top_k(value: Any) -> int:
    top_k = _integer(value, "top_k")
    if top_k < -1:
        raise RequestError(f"'top_k' must be a positive integer, or 0 or -1 for no limit, not {top_k}",
                           param="top_k", code="invalid_value")
    return max(top_k, 0)


def _penalty(name: str) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        penalty = _number(value, name)
        if not PENALTY_RANGE[0] <= penalty <= PENALTY_RANGE[1]:
            raise RequestError(f"'{name}' must be between {PENALTY_RANGE[0]:g} and {PENALTY_RANGE[1]:g}, "
                               f"not {value}", param=name, code="invalid_value")
        return penalty
    return parse


def _repetition_penalty(value: Any) -> float:
    penalty = _number(value, "repetition_penalty")
    if penalty <= 0:
        raise RequestError(f"'repetition_penalty' must be greater than 0 (1 means none), not {value}",
                           param="repetition_penalty", code="invalid_value")
    return penalty


def _alternatives(value: Any, param: str) -> int:
    count = _integer(value, param)
    if not 0 <= count <= MAX_LOGPROBS:
        raise RequestError(f"'{param}' must be between 0 and {MAX_LOGPROBS}, not {count}", param=param,
                           code="invalid_value")
    return count


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (decimal strings) to numbers in LOGIT_BIAS_RANGE, as (token id, value) pairs by
    token id. Whether the ids are in the model's vocabulary is check_logit_bias's to say."""
    if not isinstance(value, dict):
        raise RequestError(f"'logit_bias' must be an object mapping token ids to numbers, not {_json_type(value)}",
                           param="logit_bias", code="invalid_type")
    if len(value) > MAX_LOGIT_BIAS:
        raise RequestError(f"'logit_bias' has {len(value)} entries; this server takes at most {MAX_LOGIT_BIAS}",
                           param="logit_bias", code="invalid_value")
    bias: dict[int, float] = {}
    for key, number in value.items():
        if not _TOKEN_KEY.fullmatch(key):
            raise RequestError(f"'logit_bias' keys must be token ids, such as \"50256\"; {json.dumps(key)} is not one",
                               param="logit_bias", code="invalid_value")
        token = int(key)
        if token in bias:  # "7" and "007"
            raise RequestError(f"'logit_bias' names token {token} more than once", param="logit_bias",
                               code="invalid_value")
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise RequestError(f"'logit_bias' values must be numbers; token {token}'s is {_json_type(number)}",
                               param="logit_bias", code="invalid_type")
        low, high = LOGIT_BIAS_RANGE
        if not low <= number <= high:  # a float compares with an integer of any size exactly, never overflowing
            raise RequestError(f"'logit_bias' values must be between {low:g} and {high:g}; token {token}'s is not",
                               param="logit_bias", code="invalid_value")
        bias[token] = float(number)
    return tuple(sorted(bias.items()))


SAMPLING_PARSERS: dict[str, Callable[[Any], Any]] = {
    "temperature": _temperature, "top_p": _top_p, "stop": _stop, "seed": _seed, "top_k": _top_k, "min_p": _min_p,
    "presence_penalty": _penalty("presence_penalty"), "frequency_penalty": _penalty("frequency_penalty"),
    "repetition_penalty": _repetition_penalty,
    "min_tokens": lambda value: _max_tokens(value, "min_tokens", least=0),
    "ignore_eos": lambda value: _boolean(value, "ignore_eos"), "n": _choices, "logit_bias": _logit_bias,
    "cache_prompt": lambda value: _boolean(value, "cache_prompt"),
}


def _sampling(body: Mapping[str, Any], max_tokens: int | None, logprobs: int | None) -> SamplingFields:
    given = {name: parse(body[name]) for name, parse in SAMPLING_PARSERS.items() if body.get(name) is not None}
    return SamplingFields(max_tokens=max_tokens, logprobs=logprobs, **given, given=frozenset(given))


def _completion_logprobs(body: Mapping[str, Any]) -> int | None:
    """Legacy completions: `logprobs` is the number of alternatives per token (0: the chosen token's only)."""
    value = body.get("logprobs")
    return _alternatives(value, "logprobs") if value is not None else None


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat: `logprobs` is a boolean, and `top_logprobs` the number of alternatives, which needs it true."""
    wanted = body.get("logprobs")
    wanted = _boolean(wanted, "logprobs") if wanted is not None else False
    top = body.get("top_logprobs")
    if top is None:
        return 0 if wanted else None
    count = _alternatives(top, "top_logprobs")
    if not wanted:
        raise RequestError("'top_logprobs' needs \"logprobs\": true", param="top_logprobs", code="invalid_value")
    return count


def _token_ids(values: list[Any], param: str) -> tuple[int, ...]:
    if not values:
        raise RequestError(f"'{param}' must not be empty", param=param, code="invalid_value")
    for i, value in enumerate(values):
        if _integer(value, f"{param}[{i}]") < 0:
            raise RequestError(f"'{param}[{i}]' is a negative token id ({value})", param=param,
                               code="invalid_value")
    return tuple(values)


def _prompt(value: Any) -> str | tuple[int, ...]:
    """A string, one string in an array, an array of token ids, or one such array in an array."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise RequestError(f"'prompt' must be a string or an array, not {_json_type(value)}", param="prompt",
                           code="invalid_type")
    if not value:
        raise RequestError("'prompt' must not be an empty array", param="prompt", code="invalid_value")
    if any(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return _token_ids(value, "prompt")
    if len(value) != 1:
        raise RequestError(f"'prompt' holds {len(value)} prompts; this server takes one prompt per request",
                           param="prompt", code="unsupported_value")
    (only,) = value
    if isinstance(only, str):
        return only
    if isinstance(only, list):
        return _token_ids(only, "prompt[0]")
    raise RequestError(f"'prompt[0]' must be a string or an array of token ids, not {_json_type(only)}",
                       param="prompt", code="invalid_type")


def parse_completion_request(body: Mapping[str, Any]) -> CompletionRequest:
    """Validate a /v1/completions body. Raises RequestError naming the first field at fault."""
    _check_fields(body, _COMPLETION_FIELDS, _COMPLETION_NEUTRAL)
    model = _string(_required(body, "model"), "model")
    prompt = _prompt(_required(body, "prompt"))
    _check_user(body)
    streaming = _streaming(body)
    echo = body.get("echo")
    echo = _boolean(echo, "echo") if echo is not None else False
    suffix = body.get("suffix")
    if suffix is not None:
        suffix = _string(suffix, "suffix")
        if echo:  # the model reads prefix and suffix in one prompt; there is no single text to echo
            raise RequestError("'suffix' and \"echo\": true cannot be combined; drop one", param="suffix",
                               code="invalid_value")
    max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        # with echo, 0 asks only for the prompt back (with its log-probabilities), as OpenAI allows
        max_tokens = _max_tokens(max_tokens, "max_tokens", least=0 if echo else 1)
    return CompletionRequest(model, prompt, _sampling(body, max_tokens, _completion_logprobs(body)), streaming,
                             echo, suffix)


def _content(value: Any, param: str) -> str:
    """Message content: a string, or an array of text parts (joined with newlines, as vLLM does)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise RequestError(f"'{param}' must be a string or an array of text parts, not {_json_type(value)}",
                           param=param, code="invalid_type")
    if not value:
        raise RequestError(f"'{param}' must not be an empty array", param=param, code="invalid_value")
    texts = []
    for i, part in enumerate(value):
        part_param = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise RequestError(f"'{part_param}' must be an object, not {_json_type(part)}", param=part_param,
                               code="invalid_type")
        if part.get("type") != "text":
            raise RequestError(f"'{part_param}.type' is {json.dumps(part.get('type'))}; only \"text\" parts are "
                               "supported", param=f"{part_param}.type", code="unsupported_value")
        _object(part, part_param, _TEXT_PART_FIELDS)
        texts.append(_string(_required(part, "text", f"{part_param}."), f"{part_param}.text"))
    return "\n".join(texts)


def _object(value: Any, param: str, known: frozenset[str],
            neutral: Mapping[str, tuple[Any, ...]] | None = None) -> Mapping[str, Any]:
    """`value` as a JSON object holding only `known` keys (and `neutral` ones at their neutral values)."""
    if not isinstance(value, dict):
        raise RequestError(f"'{param}' must be an object, not {_json_type(value)}", param=param,
                           code="invalid_type")
    for key in value:
        if key in known or value[key] is None:  # null: as if left out (the module's docstring)
            continue
        if neutral and key in neutral and any(_same_json(value[key], v) for v in neutral[key]):
            continue
        raise RequestError(f"unsupported field '{param}.{key}': this server does not implement it; remove it",
                           param=f"{param}.{key}", code="unsupported_parameter")
    return value


def _function_type(value: Mapping[str, Any], param: str) -> None:
    kind = _required(value, "type", f"{param}.")
    if kind != "function":
        raise RequestError(f"'{param}.type' is {json.dumps(kind)}; only \"function\" is supported",
                           param=f"{param}.type", code="unsupported_value")


def _message_tool_call(value: Any, param: str) -> MessageToolCall:
    call = _object(value, param, _CALL_FIELDS)
    _function_type(call, param)
    call_id = _string(_required(call, "id", f"{param}."), f"{param}.id")
    function = _object(_required(call, "function", f"{param}."), f"{param}.function", _CALL_FUNCTION_FIELDS)
    name = _string(_required(function, "name", f"{param}.function."), f"{param}.function.name")
    arguments = _required(function, "arguments", f"{param}.function.")
    if isinstance(arguments, dict):  # as transformers' examples write them, and vLLM takes them: the object itself
        arguments = json.dumps(arguments, ensure_ascii=False)
    arguments = _string(arguments, f"{param}.function.arguments")
    return MessageToolCall(call_id, name, arguments)


def _message(value: Any, index: int) -> ChatMessage:
    param = f"messages[{index}]"
    value = _object(value, param, _MESSAGE_FIELDS, _MESSAGE_NEUTRAL)
    role = _string(_required(value, "role", f"{param}."), f"{param}.role")
    if role == DEVELOPER_ROLE:
        role = "system"
    if role == FUNCTION_ROLE:
        return _function_result(value, param)
    if role not in CHAT_ROLES:
        raise RequestError(f"'{param}.role' is '{role}'; use one of {', '.join((*CHAT_ROLES, DEVELOPER_ROLE))}",
                           param=f"{param}.role", code="invalid_value")
    calls: tuple[MessageToolCall, ...] = ()
    if value.get("tool_calls") is not None:
        if role != "assistant":
            raise RequestError(f"'{param}.tool_calls' is only for assistant messages, not {role}",
                               param=f"{param}.tool_calls", code="invalid_value")
        listed = value["tool_calls"]
        if not isinstance(listed, list):
            raise RequestError(f"'{param}.tool_calls' must be an array, not {_json_type(listed)}",
                               param=f"{param}.tool_calls", code="invalid_type")
        calls = tuple(_message_tool_call(c, f"{param}.tool_calls[{i}]") for i, c in enumerate(listed))
    if value.get("function_call") is not None:
        calls = _legacy_call(value, role, param, index)
    refusal = _assistant_text(value, "refusal", role, param)
    reasoning = _assistant_text(value, "reasoning_content", role, param)
    if (value.get("tool_calls") is not None or calls) and value.get("content") is None:
        # an assistant message that only calls tools has no text; nor has one whose calls are an empty array, which
        # clients send back as they got it (servers that answer "tool_calls": [] on every reply)
        content = None
    elif refusal is not None and value.get("content") is None:
        # a model that declined says so in `refusal`, with no content (OpenAI's replies): a conversation carried
        # over from one holds it, and it is what the assistant said
        content = refusal
    elif role == "assistant" and value.get("content") is None:
        # a reply with no text: a thinking model stopped by max_tokens before its answer (tc's own replies give
        # its thinking in reasoning_content and content null), sent back as the client got it
        content = ""
    else:
        content = _content(_required(value, "content", f"{param}."), f"{param}.content")
    name = value.get("name")
    tool_call_id = value.get("tool_call_id")
    if role == "tool" and tool_call_id is None:
        raise RequestError(f"missing required field '{param}.tool_call_id': a tool message answers the call "
                           "with that id", param=f"{param}.tool_call_id", code="missing_required_parameter")
    return ChatMessage(role, content,
                       name=_string(name, f"{param}.name") if name is not None else None,
                       tool_call_id=_string(tool_call_id, f"{param}.tool_call_id") if tool_call_id is not None
                       else None, tool_calls=calls, reasoning_content=reasoning)


def _legacy_call(message: Mapping[str, Any], role: str, param: str, index: int) -> tuple[MessageToolCall]:
    """An assistant message's deprecated `function_call`, as a tool call whose id is the message's index (nine
    digits: Mistral's templates take only ids of nine letters and digits); `function` messages after it answer it."""
    if role != "assistant":
        raise RequestError(f"'{param}.function_call' is only for assistant messages, not {role}",
                           param=f"{param}.function_call", code="invalid_value")
    if message.get("tool_calls"):
        raise RequestError(f"'{param}' has both 'tool_calls' and the deprecated 'function_call'; send only "
                           "'tool_calls'", param=f"{param}.function_call", code="invalid_value")
    call = _object(message["function_call"], f"{param}.function_call", _CALL_FUNCTION_FIELDS)
    name = _string(_required(call, "name", f"{param}.function_call."), f"{param}.function_call.name")
    arguments = _string(_required(call, "arguments", f"{param}.function_call."), f"{param}.function_call.arguments")
    return (MessageToolCall(f"{index:09d}", name, arguments),)


def _function_result(message: Mapping[str, Any], param: str) -> ChatMessage:
    """A deprecated `function` message: the result of a function called by `function_call`, read as a tool
    message. Its call's id is found once all messages are read (`_answer_function_calls`)."""
    for key in ("tool_calls", "tool_call_id", "function_call", "refusal", "reasoning_content"):
        if message.get(key) is not None:
            raise RequestError(f"'{param}.{key}' is not for a function message", param=f"{param}.{key}",
                               code="invalid_value")
    name = _string(_required(message, "name", f"{param}."), f"{param}.name")
    content = message.get("content")  # OpenAI's schema lets it be null: a function that returned nothing
    return ChatMessage("tool", _content(content, f"{param}.content") if content is not None else "", name=name)


def _answer_function_calls(messages: tuple[ChatMessage, ...], given: list[Any]) -> tuple[ChatMessage, ...]:
    """Each `function` message (a tool message with no tool_call_id) linked to the latest earlier call of its
    function, as the deprecated form pairs them, by name; a result of no call stays unlinked, as it came."""
    calls: dict[str, str] = {}
    linked = []
    for message, sent in zip(messages, given):
        for call in message.tool_calls:
            calls[call.name] = call.id
        if sent.get("role") == FUNCTION_ROLE and message.name in calls:
            message = dataclasses.replace(message, tool_call_id=calls[message.name])
        linked.append(message)
    return tuple(linked)


def _assistant_text(message: Mapping[str, Any], field: str, role: str, param: str) -> str | None:
    """A text field only an assistant message may carry (`refusal`, `reasoning_content`), or None."""
    value = message.get(field)
    if value is None:
        return None
    if role != "assistant":
        raise RequestError(f"'{param}.{field}' is only for assistant messages, not {role}", param=f"{param}.{field}",
                           code="invalid_value")
    return _string(value, f"{param}.{field}")


def _tool(value: Any, index: int) -> Tool:
    param = f"tools[{index}]"
    tool = _object(value, param, _TOOL_FIELDS)
    _function_type(tool, param)
    return _function(_required(tool, "function", f"{param}."), f"{param}.function")


def _function(value: Any, param: str) -> Tool:
    """A function object (a tool's `function`, or an entry of the deprecated `functions`)."""
    function = _object(value, param, _FUNCTION_FIELDS)
    name = _string(_required(function, "name", f"{param}."), f"{param}.name")
    if not TOOL_NAME.match(name):
        raise RequestError(f"'{param}.name' is {json.dumps(name)}; a function name is 1 to 64 letters, "
                           "digits, '_' or '-'", param=f"{param}.name", code="invalid_value")
    description = function.get("description")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise RequestError(f"'{param}.parameters' must be a JSON schema object, not "
                           f"{_json_type(parameters)}", param=f"{param}.parameters", code="invalid_type")
    strict = function.get("strict")
    return Tool(name, _string(description, f"{param}.description") if description is not None else None,
                parameters, _boolean(strict, f"{param}.strict") if strict is not None else False)


def _tools(body: Mapping[str, Any], field: str = "tools") -> tuple[Tool, ...]:
    """`tools`, or the deprecated `functions` (an array of the function objects themselves)."""
    value = body.get(field)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise RequestError(f"'{field}' must be an array, not {_json_type(value)}", param=field, code="invalid_type")
    if len(value) > MAX_TOOLS:
        raise RequestError(f"'{field}' may hold at most {MAX_TOOLS} functions, not {len(value)}", param=field,
                           code="invalid_value")
    tools = tuple(_tool(t, i) if field == "tools" else _function(t, f"{field}[{i}]") for i, t in enumerate(value))
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            where = f"tools[{i}].function" if field == "tools" else f"{field}[{i}]"
            raise RequestError(f"'{field}[{i}]' repeats the function name {json.dumps(tool.name)}; give each "
                               "function its own name", param=f"{where}.name", code="invalid_value")
        seen.add(tool.name)
    return tools


def _legacy_functions(body: Mapping[str, Any]) -> tuple[tuple[Tool, ...], ToolChoice]:
    """The deprecated `functions` and `function_call`, as tools and a tool_choice (OpenAI's defaults: "auto" with
    functions, "none" without). They do not mix with `tools` and `tool_choice`, which say the same thing."""
    for modern, legacy in (("tools", "functions"), ("tool_choice", "function_call"), ("tool_choice", "functions"),
                           ("tools", "function_call")):
        if body.get(modern) is not None and body.get(legacy) not in (None, []):  # clients send [] for none
            raise RequestError(f"'{legacy}' (the deprecated form) cannot be combined with '{modern}'; send 'tools' "
                               "and 'tool_choice' only", param=legacy, code="invalid_value")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and _boolean(parallel, "parallel_tool_calls"):
        raise RequestError("'parallel_tool_calls' goes with 'tools': a reply to 'functions' carries one "
                           "function_call", param="parallel_tool_calls", code="invalid_value")
    tools = _tools(body, "functions")
    value = body.get("function_call")
    if value is None:
        return tools, ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in FUNCTION_CALLS:
            raise RequestError(f"'function_call' is {json.dumps(value)}; use \"none\", \"auto\" or "
                               '{"name": ...}', param="function_call", code="invalid_value")
        return tools, ToolChoice(value)  # "auto" without functions offers none, as tool_choice's does
    chosen = _object(value, "function_call", frozenset({"name"}))
    choice = ToolChoice("function", _string(_required(chosen, "name", "function_call."), "function_call.name"))
    if choice.name not in {t.name for t in tools}:
        raise RequestError(f"'function_call' names the function {json.dumps(choice.name)}, which is not in "
                           "'functions'", param="function_call.name", code="invalid_value")
    return tools, choice


def _tool_choice(body: Mapping[str, Any], tools: tuple[Tool, ...]) -> ToolChoice:
    value = body.get("tool_choice")
    if value is None:
        return ToolChoice("auto" if tools else "none")  # OpenAI's defaults
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise RequestError(f"'tool_choice' is {json.dumps(value)}; use \"none\", \"auto\", \"required\" or "
                               '{"type": "function", "function": {"name": ...}}', param="tool_choice",
                               code="invalid_value")
        choice = ToolChoice(value)
    elif isinstance(value, dict) and value.get("type") == "allowed_tools":
        choice = _allowed_tools(value, tools)
    else:
        # without tools, the error below says what is missing
        choice = ToolChoice("function", _named_function(value, "tool_choice", _TOOL_FIELDS,
                                                        {t.name for t in tools} if tools else None))
    if choice.mode in ("required", "function") and not tools:
        raise RequestError(f"'tool_choice' {json.dumps(value)} needs 'tools' to choose from", param="tool_choice",
                           code="invalid_value")
    return choice


def _allowed_tools(value: Mapping[str, Any], tools: tuple[Tool, ...]) -> ToolChoice:
    """{"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": [{"type": "function",
    "function": {"name": ...}}, ...]}}: `mode` among the tools named, each one of 'tools'."""
    spec = _object(_required(_object(value, "tool_choice", frozenset({"type", "allowed_tools"})), "allowed_tools",
                             "tool_choice."), "tool_choice.allowed_tools", frozenset({"mode", "tools"}))
    mode = _required(spec, "mode", "tool_choice.allowed_tools.")
    if mode not in ("auto", "required"):
        raise RequestError(f"'tool_choice.allowed_tools.mode' is {json.dumps(mode)}; use \"auto\" or \"required\"",
                           param="tool_choice.allowed_tools.mode", code="invalid_value")
    listed = _required(spec, "tools", "tool_choice.allowed_tools.")
    if not isinstance(listed, list) or not listed:
        raise RequestError("'tool_choice.allowed_tools.tools' must be a non-empty array of "
                           '{"type": "function", "function": {"name": ...}}', param="tool_choice.allowed_tools.tools",
                           code="invalid_value")
    offered = {t.name for t in tools}
    return ToolChoice(mode, allowed=tuple(
        _named_function(entry, f"tool_choice.allowed_tools.tools[{i}]", frozenset({"type", "function"}), offered)
        for i, entry in enumerate(listed)))


def _named_function(value: Any, param: str, fields: frozenset[str], offered: set[str] | None) -> str:
    """The name in {"type": "function", "function": {"name": ...}} at `param` (an object of `fields`), one of
    `offered` where that is given."""
    chosen = _object(value, param, fields)
    _function_type(chosen, param)
    function = _object(_required(chosen, "function", f"{param}."), f"{param}.function", frozenset({"name"}))
    name = _string(_required(function, "name", f"{param}.function."), f"{param}.function.name")
    if offered is not None and name not in offered:
        raise RequestError(f"'{param}' names the function {json.dumps(name)}, which is not in 'tools'",
                           param=f"{param}.function.name", code="invalid_value")
    return name


def _response_format(body: Mapping[str, Any]) -> ResponseFormat:
    value = body.get("response_format")
    if value is None:
        return ResponseFormat()
    fmt = _object(value, "response_format", frozenset({"type", "json_schema"}))
    kind = _required(fmt, "type", "response_format.")
    if kind not in _RESPONSE_FORMATS:
        raise RequestError(f"'response_format.type' is {json.dumps(kind)}; use \"text\", \"json_object\" or "
                           "\"json_schema\"", param="response_format.type", code="invalid_value")
    if kind != "json_schema":
        if fmt.get("json_schema") is not None:
            raise RequestError(f"'response_format.json_schema' is only for \"type\": \"json_schema\", not {kind}",
                               param="response_format.json_schema", code="invalid_value")
        return ResponseFormat(kind)
    where = "response_format.json_schema"
    spec = _object(_required(fmt, "json_schema", "response_format."), where, _JSON_SCHEMA_FIELDS)
    name = _string(_required(spec, "name", where + "."), where + ".name")
    if not TOOL_NAME.match(name):
        raise RequestError(f"'{where}.name' is {json.dumps(name)}; a name is 1 to 64 letters, digits, '_' or '-'",
                           param=where + ".name", code="invalid_value")
    if spec.get("description") is not None:
        _string(spec["description"], where + ".description")
    schema = spec.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise RequestError(f"'{where}.schema' must be a JSON schema object, not {_json_type(schema)}",
                           param=where + ".schema", code="invalid_type")
    strict = spec.get("strict")
    return ResponseFormat(kind, name, schema, _boolean(strict, where + ".strict") if strict is not None else False)


def _template_variables(body: Mapping[str, Any]) -> dict[str, Any]:
    """`chat_template_kwargs`: variables the chat template sees beside the messages (vLLM's field)."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    param = "chat_template_kwargs"
    if not isinstance(value, dict):
        raise RequestError(f"'{param}' must be an object of the chat template's variables, not {_json_type(value)}",
                           param=param, code="invalid_type")
    if len(value) > MAX_TEMPLATE_VARIABLES:
        raise RequestError(f"'{param}' has {len(value)} variables; this server takes at most "
                           f"{MAX_TEMPLATE_VARIABLES}", param=param, code="invalid_value")
    for name in value:
        if not TEMPLATE_VARIABLE.fullmatch(name):
            raise RequestError(f"'{param}' names the variable {json.dumps(name)}; a template variable's name is "
                               "a letter or '_' then letters, digits or '_' (64 at most)", param=param,
                               code="invalid_value")
        if name in _TEMPLATE_FIELDS:
            raise RequestError(f"'{param}.{name}' is the request's own field: send \"{name}\" beside "
                               f"\"{param}\", not in it", param=f"{param}.{name}", code="invalid_value")
        if name in RESERVED_VARIABLES:
            raise RequestError(f"'{param}.{name}' is a variable this server gives the chat template itself (the "
                               "conversation, the model's special tokens, the template's helpers); a request "
                               "cannot replace it", param=f"{param}.{name}", code="invalid_value")
    try:
        size = len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
    except RecursionError as exc:  # nested deeper than Python writes JSON
        raise RequestError(f"'{param}' is nested too deeply", param=param, code="invalid_value") from exc
    if size > MAX_TEMPLATE_VARIABLES_CHARS:
        raise RequestError(f"'{param}' is {size} characters of JSON; this server takes at most "
                           f"{MAX_TEMPLATE_VARIABLES_CHARS}", param=param, code="invalid_value")
    return value


def _generation_prompt(body: Mapping[str, Any], messages: tuple[ChatMessage, ...]) -> tuple[bool, bool]:
    """`add_generation_prompt` and `continue_final_message`, as vLLM reads them. The first is true unless the second
    is: a client that asks to continue the final message needs no second word that no new turn is to open."""
    value = body.get("continue_final_message")
    continues = _boolean(value, "continue_final_message") if value is not None else False
    value = body.get("add_generation_prompt")
    opens = _boolean(value, "add_generation_prompt") if value is not None else not continues
    if not continues:
        return opens, False
    if opens:
        raise RequestError("'continue_final_message' and 'add_generation_prompt' cannot both be true: one continues "
                           "the final message, the other opens a new turn after it; send \"add_generation_prompt\": "
                           "false, or leave it out", param="continue_final_message", code="invalid_value")
    final, where = messages[-1], f"messages[{len(messages) - 1}]"
    if final.role != "assistant":
        raise RequestError(f"'continue_final_message' continues the final message, which must be the assistant's; "
                           f"{where} is a {final.role} message", param="continue_final_message",
                           code="invalid_value")
    if final.tool_calls:
        # the template writes the calls after the text, which is where the prompt would end: they would be lost
        raise RequestError(f"'continue_final_message' continues the final message's text; {where} also calls "
                           "tools, which would be left out", param="continue_final_message", code="invalid_value")
    if not (final.content or "").strip():
        raise RequestError(f"'continue_final_message' continues the final message's text, and {where} has none; "
                           "to open the assistant's turn, send \"add_generation_prompt\": true instead",
                           param="continue_final_message", code="invalid_value")
    return False, True


def parse_chat_request(body: Mapping[str, Any]) -> ChatRequest:
    """Validate a /v1/chat/completions body. Raises RequestError naming the first field at fault."""
    _check_fields(body, _CHAT_FIELDS, _CHAT_NEUTRAL)
    model = _string(_required(body, "model"), "model")
    messages = _required(body, "messages")
    if not isinstance(messages, list):
        raise RequestError(f"'messages' must be an array, not {_json_type(messages)}", param="messages",
                           code="invalid_type")
    if not messages:
        raise RequestError("'messages' must hold at least one message", param="messages", code="invalid_value")
    parsed = _answer_function_calls(tuple(_message(m, i) for i, m in enumerate(messages)), messages)
    _check_user(body)
    prediction = _check_hints(body)
    streaming = _streaming(body)
    # max_completion_tokens is the newer name for max_tokens; both may be sent, but not disagreeing
    limits = {name: _max_tokens(body[name], name) for name in ("max_tokens", "max_completion_tokens")
              if body.get(name) is not None}
    if len(set(limits.values())) > 1:
        raise RequestError("'max_tokens' and 'max_completion_tokens' disagree; send only one",
                           param="max_completion_tokens", code="invalid_value")
    max_tokens = next(iter(limits.values()), None)
    legacy = body.get("functions") not in (None, []) or body.get("function_call") is not None
    if legacy:
        tools, tool_choice = _legacy_functions(body)
        parallel = False
    else:
        tools = _tools(body)
        tool_choice = _tool_choice(body, tools)
        parallel = body.get("parallel_tool_calls")
        parallel = _boolean(parallel, "parallel_tool_calls") if parallel is not None else True
    response_format = _response_format(body)
    sampling = _sampling(body, max_tokens, _chat_logprobs(body))
    if response_format.type != "text" and tool_choice.mode in ("required", "function"):
        raise RequestError("'response_format' cannot be combined with a tool_choice that forces a call; the reply "
                           "is the call", param="response_format", code="invalid_value")
    constrained = response_format.type != "text" or tool_choice.mode in ("required", "function")
    for name in ("min_tokens", "ignore_eos"):
        if constrained and body.get(name) not in (None, 0, False):
            # the grammar decides where the reply ends: it allows only the end once the JSON is complete
            raise RequestError(f"'{name}' cannot be combined with response_format or a forced tool call",
                               param=name, code="invalid_value")
    opens, continues = _generation_prompt(body, parsed)
    return ChatRequest(model, parsed, sampling, streaming, tools, tool_choice, parallel, response_format, opens,
                       continues, _reasoning_effort(body, _template_variables(body)), _reasoning_format(body),
                       prediction, legacy)


def _reasoning_effort(body: Mapping[str, Any], variables: dict[str, Any]) -> dict[str, Any]:
    """`variables` (chat_template_kwargs) with `reasoning_effort`, where the request sets it, for the chat template
    (REASONING_EFFORTS says why); refused where chat_template_kwargs gives the variable another value."""
    effort = body.get("reasoning_effort")
    if effort is None:
        return variables
    if effort not in REASONING_EFFORTS:
        shown = json.dumps(effort) if isinstance(effort, str) else _json_type(effort)
        raise RequestError(f"'reasoning_effort' is {shown}; use one of {', '.join(REASONING_EFFORTS)}",
                           param="reasoning_effort", code="invalid_value")
    if variables.get("reasoning_effort") not in (None, effort):
        raise RequestError("'reasoning_effort' and 'chat_template_kwargs.reasoning_effort' disagree; send one",
                           param="reasoning_effort", code="invalid_value")
    return {**variables, "reasoning_effort": effort}


def _reasoning_format(body: Mapping[str, Any]) -> str:
    """`reasoning_format`, as llama.cpp's server reads it: "none" leaves a thinking model's thinking in content."""
    value = body.get("reasoning_format")
    if value is None:
        return "auto"
    if value not in REASONING_FORMATS:
        shown = json.dumps(value) if isinstance(value, str) else _json_type(value)
        raise RequestError(f"'reasoning_format' is {shown}; use {', '.join(REASONING_FORMATS)} (\"none\" keeps the "
                           "thinking in content)", param="reasoning_format", code="invalid_value")
    return value


def check_model(requested: str, served: str) -> None:
    """Raise ModelNotFound unless `requested` is the served model."""
    if requested != served:
        raise ModelNotFound(requested, served)


def check_logit_bias(bias: tuple[tuple[int, float], ...], vocab_size: int) -> None:
    """Refuse a logit_bias naming a token id the model's tokenizer does not have."""
    outside = next((token for token, _ in bias if token >= vocab_size), None)
    if outside is not None:
        raise RequestError(f"'logit_bias' names token id {outside}, outside this model's vocabulary "
                           f"(0..{vocab_size - 1})", param="logit_bias", code="invalid_value")


def check_min_tokens(min_tokens: int, prompt_tokens: int, context_length: int) -> None:
    """Refuse a min_tokens the context cannot hold after the prompt: the reply would run, EOS held off, to the
    context's end and still be short of it."""
    room = context_length - prompt_tokens
    if min_tokens > room:
        raise RequestError(f"'min_tokens' ({min_tokens}) is more than the {room} tokens the context ({context_length})"
                           f" holds after the prompt's {prompt_tokens}; ask for fewer, or send a shorter prompt",
                           param="min_tokens", code="invalid_value")


def check_prompt_tokens(prompt_ids: list[int], context_length: int, vocab_size: int, param: str,
                        generates: bool = True) -> None:
    """Refuse a prompt the model cannot take: empty, holding unknown token ids, or filling the context (past it,
    where nothing is to be generated: a prompt scored with echo and max_tokens 0 may fill it)."""
    if not prompt_ids:
        raise RequestError("the prompt is empty; send at least one token of text", param=param,
                           code="invalid_value")
    too_big = next((t for t in prompt_ids if t >= vocab_size), None)
    if too_big is not None:
        raise RequestError(f"token id {too_big} is outside the vocabulary (0..{vocab_size - 1})", param=param,
                           code="invalid_value")
    if len(prompt_ids) >= context_length + (0 if generates else 1):
        what = f"the {param} {'are' if param == 'messages' else 'is'} {len(prompt_ids)} tokens"
        raise RequestError(
            f"This model's maximum context length is {context_length} tokens, but {what}"
            f"{', leaving no room to generate' if generates else ''}; shorten the {param}",
            param=param, code="context_length_exceeded")
