"""Tool calls in what a model wrote: the forms models really emit, parsed into OpenAI's `tool_calls`. Pure.

Theory of operation: a chat template shows the model the tools and tells it how to call one; each model family
then writes calls its own way:

- Hermes / Qwen:  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call, maybe
  after some text;
- Qwen3-Coder, Qwen3.5, Seed-OSS: the same blocks (Seed-OSS's `<seed:tool_call>`) holding XML,
  `<function=f>\\n<parameter=k>\\nvalue\\n</parameter>\\n</function>` (one function or more; Qwen3-Coder
  now and then leaves the block's opening out), each value typed by the tool's parameters' schema (_xml_value);
- Llama 3:        `{"name": "f", "parameters": {...}}` as the whole reply (calls apart by `;`), after a
  `<|python_tag|>` special token that decoding drops;
- Mistral:        `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`, or `[TOOL_CALLS]f[ARGS]{...}` in its
  newer tokenizers (both markers are special tokens, so decoded text often holds the bare JSON array);
- Phi-4-mini:     `functools[{"name": "f", "arguments": {...}}, ...]`, maybe after some text;
- Command R7B / Command A: `<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "f", "parameters": {...}}, ...]
  <|END_ACTION|>`, after its plan (which the model writes between thinking markers: reasoning.py's);
- small models (the demo model at temperature 0): the bare object `{"name": "f", "arguments": {...}}`, maybe
  in a ```json fence.

A marker that is a token of its own may be marked special in the tokenizer, so that decoding would drop it (Mistral's
always are; so are some models' `<tool_call>`): `marker_tokens` finds those once, and a reply to a request that
offers tools keeps their text (SamplingParams.kept_tokens), as vLLM's parsers and llama.cpp's preserved tokens do.

`parse_tool_calls` reads a whole reply. A block or object becomes a call only if it is of that shape and names one
of the request's tools; anything else stays content, so a malformed call is text, never an error.
With calls, the content is the text around them (None when that is only whitespace); without, it is the reply
exactly as written.

`ToolCallStream` does the same for a reply that arrives in pieces: it releases content as soon as no call can
start in it, holds the rest, hands out each block's call as soon as the block closes, and at the end settles
everything with `parse_tool_calls` itself, so joining what it released equals the whole reply's parse.
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from ..model.tokenizer import TextTokenizer

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
SEED_OPEN, SEED_CLOSE = "<seed:tool_call>", "</seed:tool_call>"
BLOCKS = ((HERMES_OPEN, HERMES_CLOSE), (SEED_OPEN, SEED_CLOSE))  # a call each, JSON or XML
MISTRAL_MARKER, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
PHI4_MARKER = "functools["  # Phi-4-mini's: the word, then the array of calls (whose "[" the marker includes)
COHERE_OPEN, COHERE_CLOSE = "<|START_ACTION|>", "<|END_ACTION|>"
PYTHON_TAG = "<|python_tag|>"
BARE_FUNCTION = "<function="  # Qwen3-Coder's call, which it now and then writes without the <tool_call> before it
# may start a call anywhere in a reply
MARKERS = (HERMES_OPEN, SEED_OPEN, BARE_FUNCTION, MISTRAL_MARKER, PHI4_MARKER, COHERE_OPEN)
# the markers a parse needs to see (PYTHON_TAG only ever comes before a bare call, which reads the same without it)
TOKEN_MARKERS = (*(m for pair in BLOCKS for m in pair), MISTRAL_MARKER, MISTRAL_ARGS, MISTRAL_CALL_ID, COHERE_OPEN,
                 COHERE_CLOSE)
_FENCE = re.compile(r"^```(?:json)?\s*\n?(.*?)\n?```$", re.DOTALL)
# NAME, maybe [CALL_ID]ID (Mistral Small 3.2's, whose id tc replaces with one of its own), maybe [ARGS], then {...}
_MISTRAL_NAMED = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]+\s*)?(?:\[ARGS\])?\s*(\{.*)$",
                            re.DOTALL)


# each offered tool's name, to its parameters' JSON schema (None where the request gives none)
Tools = Mapping[str, "Mapping[str, Any] | None"]


@dataclass(frozen=True)
class ToolCall:
    """One call as OpenAI shows it: `arguments` is the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedReply:
    content: str | None
    calls: tuple[ToolCall, ...]


def _arguments(value: Any) -> str | None:
    """The JSON text of a call's arguments (an object, or a string holding one); None if they are neither."""
    try:
        if isinstance(value, str):
            value = json.loads(value)
        # NaN and Infinity, which Python's json reads, are no JSON a client reads: such arguments are no call
        return json.dumps(value, ensure_ascii=False, allow_nan=False) if isinstance(value, dict) else None
    except (ValueError, RecursionError):  # not JSON; or nested past what json reads, which a model can write
        return None


def _call(value: Any, tools: Tools, new_id: Callable[[], str]) -> ToolCall | None:
    """A call object ({"name", "arguments" | "parameters"}, or OpenAI's {"function": {...}}), else None."""
    if not isinstance(value, dict):
        return None
    if "name" not in value and isinstance(value.get("function"), dict):  # {"type": "function", "function": {...}}
        value = value["function"]
    name = value.get("name")
    if not isinstance(name, str) or name not in tools:
        return None
    key = "arguments" if "arguments" in value else "parameters" if "parameters" in value else None
    if key is None:
        return None
    arguments = _arguments(value[key])
    return ToolCall(new_id(), name, arguments) if arguments is not None else None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are each given once: a key given twice is no call (json keeps the last, where a stream
    read the first: tool_calls._may_be_call)."""
    value = dict(pairs)
    if len(value) != len(pairs):
        raise ValueError("a key given twice")
    return value


def _json_values(text: str, unique_keys: bool = False) -> Iterator[Any]:
    """The JSON values in `text`, apart by whitespace, `;` or `,`. Raises ValueError on anything else (with
    `unique_keys`, an object that gives a key twice too)."""
    decoder = json.JSONDecoder(object_pairs_hook=_unique_keys if unique_keys else None)
    at = 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in ";,"):
            at += 1
        if at == len(text):
            return
        value, at = decoder.raw_decode(text, at)
        yield value


# The keys a bare call object may start with: _call reads {"name", "arguments" | "parameters"} in any order, and
# {"type": "function", "function": {...}} (with OpenAI's "id" first, as its replies write a call). An object that
# starts with another key is an answer in JSON, whatever keys follow, so a stream can send it from that key on.
CALL_KEYS = ("name", "arguments", "parameters", "type", "function", "id")


def _bare_calls(text: str, tools: Tools, new_id: Callable[[], str]) -> list[ToolCall] | None:
    """The calls when `text` is nothing but call objects (or arrays of them); None when it is anything else."""
    text = text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):].strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    if not text.startswith(("{", "[")):
        return None
    calls: list[ToolCall] = []
    try:
        for value in _json_values(text, unique_keys=True):
            if value == []:  # no call: text, as a stream takes it from the "]" on (_may_start_bare_call)
                return None
            for item in value if isinstance(value, list) else [value]:
                if not isinstance(item, dict) or next(iter(item), None) not in CALL_KEYS:
                    return None  # what a stream sends as text from its first key on (_may_be_call)
                call = _call(item, tools, new_id)
                if call is None:
                    return None
                calls.append(call)
    except (ValueError, RecursionError):  # json's errors; RecursionError for absurd nesting
        return None
    return calls or None


_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
# a value ends at </parameter>, or (where the model left that out) at the next parameter or the function's end
_XML_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
_TYPE_NAMES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (type(None), "null"),
               (dict, "object"), (list, "array"))
_NOT_READ = object()


def _schema_types(schema: Any, depth: int = 0) -> set[str]:
    """The JSON types a parameter's schema allows: its `type`, its anyOf / oneOf branches' (pydantic writes an
    Optional[int] so), its enum's and const's values'; empty where it names none (a $ref, or no schema)."""
    if not isinstance(schema, Mapping) or depth > 8:
        return set()
    named = schema.get("type")
    types = {named} if isinstance(named, str) else {t for t in named if isinstance(t, str)} \
        if isinstance(named, list) else set()
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            types.update(t for branch in schema[key] for t in _schema_types(branch, depth + 1))
    values = list(schema["enum"]) if isinstance(schema.get("enum"), list) else []
    values += [schema["const"]] if "const" in schema else []
    types.update(next(name for kind, name in _TYPE_NAMES if isinstance(value, kind)) for value in values
                 if isinstance(value, tuple(kind for kind, _ in _TYPE_NAMES)))
    return types | ({"integer"} if "number" in types else set())  # a number may be written as a whole one


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity, which Python's json reads and no client does


def _literal(text: str) -> Any:
    """The value `text` spells as JSON, or as a Python literal (True, {'a': 1}: what these templates write for an
    earlier call's arguments, with jinja's `| string`, and so what the model copies); _NOT_READ where neither.
    ast.literal_eval builds constants only: it runs nothing."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        pass
    try:
        value = ast.literal_eval(text.strip())
        return json.loads(json.dumps(value, allow_nan=False))  # as JSON: tuples as lists; sets, bytes refused
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return _NOT_READ


def _xml_value(text: str, schema: Any) -> Any:
    """A parameter's value as its schema types it, as llama.cpp reads it: the value the text spells (JSON, or a
    Python literal) where it is of a type other than string that the schema allows; else the text as written (a
    parameter that may only be a string, a schema that names no type, a value of no allowed type)."""
    types = _schema_types(schema) - {"string"}
    if not types:
        return text
    value = _literal(text)
    if value is _NOT_READ or isinstance(value, str):
        return text
    kind = next(name for cls, name in _TYPE_NAMES if isinstance(value, cls))  # bool before int: it is one too
    return value if kind in types else text


def _xml_call(name: str, body: str, tools: Tools, new_id: Callable[[], str]) -> ToolCall | None:
    """The call to `name` whose `<parameter=KEY>VALUE</parameter>` elements are `body` (each value on lines of its
    own, or not), where `name` is an offered tool; else None."""
    if name not in tools:
        return None
    schema = tools[name]
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    properties = properties if isinstance(properties, Mapping) else {}
    arguments: dict[str, Any] = {}
    at = 0
    while body[at:].strip():
        parameter = _XML_PARAMETER.match(body, at)
        if parameter is None:
            return None
        text = parameter.group(2).removeprefix("\n").removesuffix("\n")  # the lines the value is written on
        arguments[parameter.group(1)] = _xml_value(text, properties.get(parameter.group(1)))
        at = parameter.end()
    return ToolCall(new_id(), name, json.dumps(arguments, ensure_ascii=False))


def _xml_calls(block: str, tools: Tools, new_id: Callable[[], str]) -> list[ToolCall] | None:
    """Qwen3-Coder's, Qwen3.5's and Seed-OSS's calls: one `<function=NAME>...</function>` or more; else None."""
    calls: list[ToolCall] = []
    at = 0
    while block[at:].strip():
        function = _XML_FUNCTION.match(block, at)
        call = None if function is None else _xml_call(function.group(1), function.group(2), tools, new_id)
        if function is None or call is None:
            return None
        calls.append(call)
        at = function.end()
    return calls or None


def _block_calls(block: str, tools: Tools, new_id: Callable[[], str]) -> list[ToolCall] | None:
    """The calls in the text between a block's markers (one JSON object, or the XML form), else None."""
    if block.lstrip().startswith(BARE_FUNCTION):
        return _xml_calls(block, tools, new_id)
    try:
        values = list(_json_values(block))
    except (ValueError, RecursionError):
        return None
    call = _call(values[0], tools, new_id) if len(values) == 1 else None
    return None if call is None else [call]


def _next_block(text: str, at: int) -> tuple[int, str, str] | None:
    """(where, opening marker, closing marker) of the first call block that opens in `text` from `at`; a bare
    `<function=` opens one with no marker of its own, closed by </tool_call> (or the end)."""
    found = [(text.find(opening, at), opening, closing) for opening, closing in BLOCKS]
    found.append((text.find(BARE_FUNCTION, at), "", HERMES_CLOSE))
    found = [hit for hit in found if hit[0] >= 0]
    return min(found, key=lambda hit: hit[0]) if found else None


def _blocks(text: str, tools: Tools, new_id: Callable[[], str]) -> tuple[list[str], list[ToolCall]]:
    """(the text outside valid blocks, in pieces; the calls). A block left open at the end runs to the end.

    Whitespace just before a call goes with the call (a stream cannot know it is trailing until the call comes).
    """
    content: list[str] = []
    calls: list[ToolCall] = []
    at = 0
    while True:
        block = _next_block(text, at)
        if block is None:
            content.append(text[at:])
            return content, calls
        start, opening, closing = block
        end = text.find(closing, start)
        stop = end + len(closing) if end >= 0 else len(text)
        found = _block_calls(text[start + len(opening):end if end >= 0 else len(text)], tools, new_id)
        if found is None:
            content.append(text[at:stop])  # not a call: it stays text
        else:
            content.append(text[at:start].rstrip())
            calls.extend(found)
        at = stop


def _mistral(text: str, tools: Tools, new_id: Callable[[], str]) -> tuple[list[str], list[ToolCall]]:
    """[TOOL_CALLS] then a JSON array (or objects), or NAME[ARGS]{...}, once per call. All valid, or no calls."""
    head, _, rest = text.partition(MISTRAL_MARKER)
    calls: list[ToolCall] = []
    for part in rest.split(MISTRAL_MARKER):
        named = _MISTRAL_NAMED.match(part)
        found: list[ToolCall | None] | None
        if named and not part.lstrip().startswith(("{", "[")):
            try:
                found = [_call({"name": named.group(1), "arguments": json.loads(named.group(2))}, tools, new_id)]
            except (ValueError, RecursionError):
                found = None
        else:
            found = list(_bare_calls(part, tools, new_id) or [])
        if not found or any(call is None for call in found):
            return [text], []
        calls.extend(call for call in found if call is not None)
    return [head], calls


def _phi4(text: str, tools: Tools, new_id: Callable[[], str]) -> tuple[list[str], list[ToolCall]]:
    """functools[...] once, the array of calls ending the reply. All valid, or no calls."""
    head, _, rest = text.partition(PHI4_MARKER)
    found = _bare_calls("[" + rest, tools, new_id)
    return ([head], found) if found else ([text], [])


def _cohere(text: str, tools: Tools, new_id: Callable[[], str]) -> tuple[list[str], list[ToolCall]]:
    """<|START_ACTION|> then a JSON array of {"tool_call_id", "tool_name", "parameters"}, then <|END_ACTION|> (or
    the end: max_tokens may come first). All valid, or no calls; the text after the block stays content."""
    head, _, rest = text.partition(COHERE_OPEN)
    block, _, tail = rest.partition(COHERE_CLOSE)
    try:
        values = list(_json_values(block))
    except (ValueError, RecursionError):
        return [text], []
    items = values[0] if len(values) == 1 and isinstance(values[0], list) else values
    calls = [_call({"name": item.get("tool_name"), "arguments": item.get("parameters")} if isinstance(item, dict)
                   else None, tools, new_id) for item in items]
    if not calls or any(call is None for call in calls):
        return [text], []
    return [head, tail], [call for call in calls if call is not None]


def parse_tool_calls(text: str, tools: Tools, new_id: Callable[[], str]) -> ParsedReply:
    """The reply `text` split into content and calls to the `tools` offered; `new_id` makes call ids. The forms
    are tried in turn, a marker's first, and the first that finds calls gives them: a marker may also be plain
    words (even in a bare call's arguments)."""
    forms = ((_next_block(text, 0) is not None, _blocks), (MISTRAL_MARKER in text, _mistral),
             (COHERE_OPEN in text, _cohere), (PHI4_MARKER in text, _phi4))
    pieces: list[str] = [text]
    calls: list[ToolCall] = []
    for present, form in forms:
        if present:
            pieces, calls = form(text, tools, new_id)
            if calls:
                break
    else:
        bare = _bare_calls(text, tools, new_id)
        pieces, calls = ([], bare) if bare else ([text], [])
    if not calls:
        return ParsedReply(text, ())
    content = "".join(pieces).rstrip()
    return ParsedReply(content if content.strip() else None, tuple(calls))


def marker_tokens(tokenizer: TextTokenizer) -> frozenset[int]:
    """The ids of the tool-call markers that are special tokens of this tokenizer: text decoding would drop."""
    ids = (tokenizer.token_id(marker) for marker in TOKEN_MARKERS)
    return frozenset(i for i in ids if i is not None and i in tokenizer.special_ids)


def _may_start_bare_call(text: str, tools: Tools) -> bool:
    """Whether a reply that starts with `text` (its leading whitespace gone) may still be bare calls, as
    `_bare_calls` reads them: an object that may be a call to one of `tools` (_may_be_call), or an array of them,
    maybe after <|python_tag|>, maybe in a ```json fence. Text that can no longer be ("```python", "[1, 2]",
    "Sure", '{"answer"') is content from its first character."""
    if PYTHON_TAG.startswith(text):
        return True
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):].lstrip()
    if "```".startswith(text):
        return True
    if text.startswith("```"):
        text = text[3:]
        if "json".startswith(text):
            return True
        text = text.removeprefix("json").lstrip()
    if not text:
        return True
    if text[0] == "{":
        return _may_be_call(text, tools)
    rest = text[1:].lstrip()
    return text[0] == "[" and (not rest or (rest[0] == "{" and _may_be_call(rest, tools)))


def _may_be_call(text: str, tools: Tools) -> bool:
    """Whether `text`, the start of a JSON object, may still be a call: its first key one a call has, and where
    that is "name", its value the name (or the start of the name) of an offered tool. A reply of JSON that is no
    call (an answer in JSON beside tools offered) then streams from its first key on, not all at its end."""
    key, rest = _leading_string(text[1:].lstrip())
    if key is None:  # no key yet, or a character no key starts with ("}": an empty object is no call either)
        return not rest
    if rest is None:  # the key goes on
        return any(k.startswith(key) for k in CALL_KEYS)
    if key != "name":
        return key in CALL_KEYS
    rest = rest.lstrip()
    if not rest:
        return True
    if rest[0] != ":":
        return False
    name, after = _leading_string(rest[1:].lstrip())
    if name is None:
        return not after
    return any(tool.startswith(name) for tool in tools) if after is None else name in tools


def _leading_string(text: str) -> tuple[str | None, str | None]:
    """The JSON string `text` starts with, and the text after it; (the start of the string, None) where it does
    not end yet; (None, text) where `text` starts with no string (an empty `text` included). A string with an
    escape counts as one that may be anything: (its raw start, None) until it ends, then what it decodes to."""
    if not text or text[0] != '"':
        return None, text
    at = 1
    while at < len(text):
        if text[at] == "\\":
            at += 2
            continue
        if text[at] == '"':
            try:
                return json.loads(text[:at + 1]), text[at + 1:]
            except ValueError:  # a bad escape: no JSON, so no call
                return "", text[at + 1:]
        at += 1
    return ("" if "\\" in text else text[1:]), None


def _held_marker_tail(text: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of a marker: a call may be starting."""
    longest = 0
    for marker in MARKERS:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest


class ToolCallStream:
    """Content and calls of a reply that arrives in pieces. `push` each piece of text, then `finish` once.

    Each returns (content to send now, calls to send now). Joining all content equals the whole reply's
    `parse_tool_calls(...).content` (None counting as ""), and the calls are its calls, in order (only the
    first unless `parallel`).
    """

    def __init__(self, tools: Tools, new_id: Callable[[], str], *, parallel: bool = True):
        self.tools, self.new_id, self.parallel = tools, new_id, parallel
        self.text = ""
        self.released = 0  # text[:released] went out as content, or was a call
        self.content = ""  # the content sent
        self.found = 0  # calls found so far (sent, or dropped when not parallel)

    def _take(self, calls: list[ToolCall]) -> list[ToolCall]:
        """The calls that go out: all of them, or only a reply's first when calls may not be parallel."""
        taken = calls if self.parallel else calls[:max(0, 1 - self.found)]
        self.found += len(calls)
        return taken

    def _safe_end(self) -> int:
        """Where the text from `released` that cannot be part of a call ends."""
        at_start = not self.text[:self.released].strip()
        if at_start and _may_start_bare_call(self.text.lstrip(), self.tools):
            return self.released  # a bare call may fill the whole reply (and "`" may become "```"): hold it all
        hits = [i for i in (self.text.find(m, self.released) for m in MARKERS) if i >= 0]
        end = min(hits) if hits else len(self.text) - _held_marker_tail(self.text)
        # trailing whitespace waits: before a call it is dropped, before more text it goes out
        return self.released + len(self.text[self.released:end].rstrip())

    def _closed_block(self) -> tuple[list[ToolCall], int] | None:
        """The calls in a block that starts where the text sent ends and has closed, with its end."""
        block = _next_block(self.text, self.released)
        if block is None or self.text[self.released:block[0]].strip():
            return None
        start, opening, closing = block
        end = self.text.find(closing, start)
        if end < 0:
            return None
        calls = _block_calls(self.text[start + len(opening):end], self.tools, self.new_id)
        return (calls, end + len(closing)) if calls is not None else None  # a malformed block waits for the end

    def push(self, piece: str) -> tuple[str, list[ToolCall]]:
        self.text += piece
        content, calls = "", []
        while True:
            safe = self._safe_end()
            content += self.text[self.released:safe]
            self.released = safe
            block = self._closed_block()
            if block is None:
                break
            calls += self._take(block[0])
            self.released = block[1]
        self.content += content
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        parsed = parse_tool_calls(self.text, self.tools, self.new_id)
        content = parsed.content or ""
        if not content.startswith(self.content):  # _safe_end holds back whatever a call could still claim
            raise AssertionError(f"streamed content {self.content!r} is not the start of {content!r}")
        rest, self.content = content[len(self.content):], content
        return rest, self._take(list(parsed.calls[self.found:]))
