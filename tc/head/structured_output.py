"""The grammar a chat request's reply must follow: its response_format, or the tool call it forces.

- `response_format` `json_object`: any JSON object; `json_schema`: JSON valid under its schema.
- `tool_choice` `required`: one call object `{"name": ..., "arguments": {...}}` per line (one only when
  `parallel_tool_calls` is false), each naming one of the tools with arguments valid under its parameters;
  a named function: one call to it. These are the bare objects tool_calls.py reads, so the forced reply is
  always parsed as calls and its arguments always parse.
- `tool_choice` `auto` with a JSON response_format: a call object or the format's JSON; without one, no grammar,
  but the offered tools' parameters are still checked to be JSON schemas.
- A `strict` schema (a tool's, the response_format's) is followed in every keyword, or refused naming what the
  engine does not implement; one that is not leaves those keywords out (`uniqueItems`, `not`, an unknown
  `format`) and follows the rest, as OpenAI refuses them only in strict mode. Each schema is its own: a strict
  tool beside one that is not holds only itself to every keyword.

The engine (tc/constraint.py) is loaded on the first request that needs it. Without it, a response_format is a
400 naming the package to install; a forced tool call is steered by the template alone (tool_calls.py then
never turns text that is not a call into one).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Mapping

from ..constraint import MAX_SCHEMA_NESTING, ConstraintUnavailable, Grammar, GrammarEngine, GrammarError
from .api_requests import ChatRequest, RequestError, ResponseFormat, Tool

ANY_OBJECT: Mapping[str, Any] = {"type": "object"}


# Where a schema's keywords hold schemas: one, a list of them, or a map of names to them. Any other keyword's value
# is data (a const, an enum, a default), whose "$ref" keys are not references.
_ONE_SCHEMA = frozenset({"items", "additionalItems", "additionalProperties", "contains", "else", "if", "not",
                         "propertyNames", "then", "unevaluatedItems", "unevaluatedProperties"})
_SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_SCHEMA_MAPS = frozenset({"$defs", "definitions", "dependentSchemas", "patternProperties", "properties"})


def placed(schema: Any, at: str) -> Any:
    """`schema` as it reads at JSON pointer `at` inside another schema: each reference into its own document
    ("#", "#/$defs/Address", "#/properties/a", as pydantic, zod and MCP tools write them) made to point where that
    document now sits, where it would point into the schema around it or at nothing. A copy; anchors ("#name")
    and other documents' references are left as written. A subschema with an `$id` is a document of its own, its
    references ("#/...", or that `$id` then "#/...") read from it: they are made to point there too, and the `$id`
    left out (kept, it would send them back to it, and two tools with the same `$id` would read each other's
    definitions)."""
    return _placed(schema, (at, ""), at, 0)


def _placed(schema: Any, document: tuple[str, str], here: str, depth: int) -> Any:
    """`placed` below: `document`, the pointer and `$id` ("" for none) of the document whose references are read
    from; `here`, the pointer of `schema`. Deeper than the grammar engine reads, left as is (it refuses it there)."""
    if depth > MAX_SCHEMA_NESTING or not isinstance(schema, dict):
        return schema
    if isinstance(schema.get("$id"), str):
        document = (here, schema["$id"])
    moved: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$id" and isinstance(value, str):
            continue
        if key == "$ref" and isinstance(value, str):
            uri, hashed, fragment = value.partition("#")
            inside = hashed and uri in ("", document[1]) and (fragment == "" or fragment.startswith("/"))
            moved[key] = "#" + document[0] + fragment if inside else value
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            moved[key] = [_placed(item, document, f"{here}/{_escaped(key)}/{i}", depth + 1)
                          for i, item in enumerate(value)]
        elif key in _ONE_SCHEMA:
            moved[key] = _placed(value, document, f"{here}/{_escaped(key)}", depth + 1)
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            moved[key] = {name: _placed(item, document, f"{here}/{_escaped(key)}/{_escaped(name)}", depth + 1)
                          for name, item in value.items()}
        else:
            moved[key] = value
    return moved


def _escaped(name: str) -> str:
    """`name` as a JSON pointer's reference token (RFC 6901): "~" and "/" escaped."""
    return name.replace("~", "~0").replace("/", "~1")


def call_schema(tool: Tool) -> dict[str, Any]:
    """The JSON schema of one call to `tool`, as the bare object models write."""
    return {"type": "object", "properties": {"name": {"const": tool.name},
                                             "arguments": placed(dict(tool.parameters or ANY_OBJECT),
                                                                 "/properties/arguments")},
            "required": ["name", "arguments"], "additionalProperties": False}


def _format_schema(fmt: ResponseFormat) -> Mapping[str, Any] | None:
    if fmt.type == "json_object":
        return ANY_OBJECT
    if fmt.type == "json_schema":
        return fmt.schema if fmt.schema is not None else {}
    return None


class StructuredOutput:
    """Grammars for chat requests, over an engine loaded once, on first need (`load` builds it)."""

    def __init__(self, load: Callable[[], GrammarEngine]):
        self._load = load
        self._engine: GrammarEngine | None = None
        self._lock = threading.Lock()

    def engine(self) -> GrammarEngine:
        """Raises ConstraintUnavailable when the engine's package is missing."""
        with self._lock:  # two first requests at once build it once
            if self._engine is None:
                self._engine = self._load()
            return self._engine

    def grammar(self, request: ChatRequest) -> Grammar | None:
        """The grammar `request`'s reply must follow; None for free text. Raises RequestError."""
        tools = request.offered_tools
        forced = request.tool_choice.mode in ("required", "function")
        fmt = _format_schema(request.response_format)
        if fmt is None and not forced:
            self._check_tools(request)
            return None
        try:
            engine = self.engine()
        except ConstraintUnavailable as exc:
            if fmt is None:
                return None  # a forced call without the engine: the template steers it
            raise RequestError(str(exc), param="response_format", code="unsupported_value") from exc
        # each schema lenient unless it asks to be followed exactly: OpenAI holds one that is not strict to nothing
        calls = [(call_schema(t), not t.strict) for t in tools]
        try:
            if fmt is None and request.parallel_tool_calls and request.tool_choice.mode == "required":
                return engine.json_sequence(calls)
            formats = [] if fmt is None else [(fmt, not _strict(request.response_format))]
            return engine.json_choice(calls + formats)
        except GrammarError as exc:
            raise _schema_at_fault(engine, request, exc) from exc

    def _check_tools(self, request: ChatRequest) -> None:
        """Refuse an offered tool whose parameters are no JSON schema, as a forced call's grammar would refuse it,
        though no grammar follows them here ("auto": the model reads them in its template). What only a grammar
        needs is not asked of them (GrammarEngine.check_schema). Without the engine, as a forced call without it,
        they go to the template unchecked."""
        offered = {tool.name for tool in request.offered_tools}
        if not offered:
            return
        try:
            engine = self.engine()
        except ConstraintUnavailable:
            return
        for index, tool in enumerate(request.tools):
            if tool.name in offered:
                try:
                    engine.check_schema(call_schema(tool))
                except GrammarError as exc:
                    raise RequestError(f"the schema in '{request.tool_param(index)}.parameters' is not a valid "
                                       f"JSON schema: {exc}", param=request.tools_field,
                                       code="invalid_value") from exc


def _strict(fmt: ResponseFormat) -> bool:
    return fmt.type == "json_schema" and bool(fmt.strict)


def _schema_error(where: str, param: str, reason: object) -> RequestError:
    return RequestError(f"the schema in '{where}' uses what this server's grammar engine does not implement, or is "
                        f"invalid: {reason}; see docs/api.md for what is supported", param=param,
                        code="invalid_value")


def _schema_at_fault(engine: GrammarEngine, request: ChatRequest, exc: GrammarError) -> RequestError:
    """The error for a reply's grammar that would not build, naming the schema at fault.

    The engine reads the offered tools' calls and the response_format as one grammar, so its error alone says
    neither which of them is at fault in the request's terms (a broken tool beside a response_format was blamed on
    the format) nor anything short of the whole grammar's text; each is tried on its own to find the one.
    """
    offered = {tool.name for tool in request.offered_tools}
    for index, tool in enumerate(request.tools):
        if tool.name not in offered:
            continue
        try:
            engine.json_schema(call_schema(tool), not tool.strict)
        except GrammarError as own:
            return _schema_error(f"{request.tool_param(index)}.parameters", request.tools_field, own)
    if request.response_format.type == "json_schema":
        return _schema_error("response_format.json_schema.schema", "response_format.json_schema.schema", exc)
    return _schema_error(request.tools_field, request.tools_field, exc)
