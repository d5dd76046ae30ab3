"""The tool-call parser on what models of several families really write, whole and in pieces."""
from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tc.head.tool_calls import ParsedReply, ToolCall, ToolCallStream, parse_tool_calls

# the offered tools, by name, with their parameters' schemas (which type a value written in the XML form)
NAMES = {
    "get_weather": {"type": "object", "properties": {"location": {"type": "string"}, "days": {"type": "integer"},
                                                      "unit": {"type": ["string", "null"]}}},
    "get_time": {"type": "object", "properties": {}},
    "search": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "number"},
                                                 "exact": {"type": "boolean"}, "filters": {"type": "object"},
                                                 "tags": {"type": "array"},
                                                 # pydantic's Optional[int], and an enum that names no type
                                                 "page": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                                                 "level": {"enum": [1, 2, 3]}}},
    "ping": None,  # no parameters given
}
PARIS = '{"location": "Paris"}'


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parse(text: str) -> ParsedReply:
    return parse_tool_calls(text, NAMES, ids())


def calls(reply: ParsedReply) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in reply.calls]


# (family, what the model wrote as decoded text, expected content, expected calls)
RECORDED = [
    ("qwen2.5 hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>',
     None, [("get_weather", {"location": "Paris"})]),
    ("qwen2.5 two calls",
     '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>',
     None, [("get_weather", {"location": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})]),
    ("hermes with text first", "Let me check that for you.\n<tool_call>\n"
     '{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}\n</tool_call>',
     "Let me check that for you.", [("get_weather", {"location": "Paris", "unit": "celsius"})]),
    ("hermes left open at EOS", '<tool_call>\n{"name": "search", "arguments": {"query": "tc"}}',
     None, [("search", {"query": "tc"})]),
    ("demo model bare object", '{"name": "get_weather", "arguments": {"location": "Paris"}}',
     None, [("get_weather", {"location": "Paris"})]),
    ("bare object in a fence", '```json\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n```',
     None, [("get_weather", {"location": "Paris"})]),
    ("llama 3.1 json (python_tag dropped)", '{"name": "get_weather", "parameters": {"location": "Paris"}}',
     None, [("get_weather", {"location": "Paris"})]),
    ("llama 3.1 with python_tag", '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Paris"}}',
     None, [("get_weather", {"location": "Paris"})]),
    ("llama 3.2 two calls", '{"name": "get_weather", "parameters": {"location": "Paris"}}; '
     '{"name": "get_time", "parameters": {"timezone": "CET"}}',
     None, [("get_weather", {"location": "Paris"}), ("get_time", {"timezone": "CET"})]),
    ("llama type function", '{"type": "function", "name": "get_weather", "parameters": {"location": "Paris"}}',
     None, [("get_weather", {"location": "Paris"})]),
    ("mistral v3 array", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"location": "Paris"}}, '
     '{"name": "get_time", "arguments": {"timezone": "CET"}}]',
     None, [("get_weather", {"location": "Paris"}), ("get_time", {"timezone": "CET"})]),
    ("mistral marker dropped", '[{"name": "get_weather", "arguments": {"location": "Paris"}}]',
     None, [("get_weather", {"location": "Paris"})]),
    ("mistral v11 args", '[TOOL_CALLS]get_weather[ARGS]{"location": "Paris"}',
     None, [("get_weather", {"location": "Paris"})]),
    ("mistral v11 two", '[TOOL_CALLS]get_weather[ARGS]{"location": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
     None, [("get_weather", {"location": "Paris"}), ("get_time", {})]),
    ("phi-4-mini functools", 'functools[{"name": "get_weather", "arguments": {"location": "Paris"}}, '
     '{"name": "get_time", "arguments": {"timezone": "CET"}}]',
     None, [("get_weather", {"location": "Paris"}), ("get_time", {"timezone": "CET"})]),
    ("phi-4-mini after text", 'I will look it up.\nfunctools[{"name": "search", "arguments": {"query": "tc"}}]',
     "I will look it up.", [("search", {"query": "tc"})]),
    ("bare call mentioning functools[", '{"name": "search", "arguments": {"query": "functools[ in python"}}',
     None, [("search", {"query": "functools[ in python"})]),
    ("arguments as a json string", '{"name": "get_weather", "arguments": "{\\"location\\": \\"Paris\\"}"}',
     None, [("get_weather", {"location": "Paris"})]),
    ("openai shape", '{"type": "function", "function": {"name": "search", "arguments": {"query": "x"}}}',
     None, [("search", {"query": "x"})]),
    # Qwen3-Coder / Qwen3.5: XML in the block, each value on lines of its own
    ("qwen3-coder xml", '<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n'
     '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>',
     None, [("get_weather", {"location": "Paris", "days": 3})]),
    ("qwen3-coder xml after text, two calls", 'Let me check.\n\n<tool_call>\n<function=get_time>\n</function>\n'
     '</tool_call>\n<tool_call>\n<function=search>\n<parameter=query>\nbest "tc" 42\nsecond line\n</parameter>\n'
     '<parameter=limit>\n2.5\n</parameter>\n<parameter=exact>\ntrue\n</parameter>\n<parameter=filters>\n'
     '{"lang": "en"}\n</parameter>\n<parameter=tags>\n["a", 1]\n</parameter>\n</function>\n</tool_call>',
     "Let me check.", [("get_time", {}), ("search", {"query": 'best "tc" 42\nsecond line', "limit": 2.5,
                                                     "exact": True, "filters": {"lang": "en"}, "tags": ["a", 1]})]),
    # a string parameter keeps text that reads as JSON; one that may be null takes null; a value of a type the
    # schema does not allow, or a parameter it does not name, stays text
    ("xml values typed by the schema", '<tool_call>\n<function=get_weather>\n<parameter=location>\n123\n'
     '</parameter>\n<parameter=unit>\nnull\n</parameter>\n<parameter=days>\nthree\n</parameter>\n'
     '<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>',
     None, [("get_weather", {"location": "123", "unit": None, "days": "three", "extra": "7"})]),
    ("xml to a tool without parameters' schema", '<tool_call><function=ping><parameter=n>1</parameter>'
     '</function></tool_call>', None, [("ping", {"n": "1"})]),
    ("seed-oss xml", '<seed:tool_call>\n<function=get_weather>\n<parameter=location>Paris</parameter>\n'
     '<parameter=days>2</parameter>\n</function>\n</seed:tool_call>',
     None, [("get_weather", {"location": "Paris", "days": 2})]),
    ("xml block left open at EOS", '<tool_call>\n<function=get_time>\n</function>\n',
     None, [("get_time", {})]),
    # values as these templates render an earlier call's (jinja's `| string`: True, Python's dicts), which the
    # model copies; types from anyOf and enum; NaN, no JSON, stays text
    ("xml python literals", '<tool_call>\n<function=search>\n<parameter=exact>\nTrue\n</parameter>\n'
     "<parameter=filters>\n{'lang': 'en', 'n': (1, 2)}\n</parameter>\n<parameter=page>\n4\n</parameter>\n"
     '<parameter=level>\n2\n</parameter>\n<parameter=limit>\nNaN\n</parameter>\n</function>\n</tool_call>',
     None, [("search", {"exact": True, "filters": {"lang": "en", "n": [1, 2]}, "page": 4, "level": 2,
                        "limit": "NaN"})]),
    ("xml parameter left open", "<tool_call>\n<function=get_time>\n<parameter=x>\n1\n<parameter=y>\n2\n"
     "</function>\n</tool_call>", None, [("get_time", {"x": "1", "y": "2"})]),
    ("xml two functions in a block", "<tool_call>\n<function=get_time>\n</function>\n<function=search>\n"
     "<parameter=limit>\n3\n</parameter>\n</function>\n</tool_call>",
     None, [("get_time", {}), ("search", {"limit": 3})]),
    # Qwen3-Coder now and then leaves out the <tool_call> before its function
    ("xml without its block's opening", "Let me look.\n<function=get_weather>\n<parameter=location>\nParis\n"
     "</parameter>\n</function>\n</tool_call>", "Let me look.", [("get_weather", {"location": "Paris"})]),
    ("mistral small 3.2 call id", '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"location": "Paris"}',
     None, [("get_weather", {"location": "Paris"})]),
    ("bare call mentioning <function=", '{"name": "search", "arguments": {"query": "<function=get_time>"}}',
     None, [("search", {"query": "<function=get_time>"})]),
    # Command R7B: its plan, then the action block (its thinking markers are special tokens, decoded away)
    ("command r7b action", 'I will look up the weather in Paris.<|START_ACTION|>[\n    {"tool_call_id": "0", '
     '"tool_name": "get_weather", "parameters": {"location": "Paris"}}\n]<|END_ACTION|>',
     "I will look up the weather in Paris.", [("get_weather", {"location": "Paris"})]),
    ("command r7b two actions", '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", '
     '"parameters": {"location": "Paris"}},\n    {"tool_call_id": "1", "tool_name": "get_time", "parameters": {}}'
     '\n]<|END_ACTION|>', None, [("get_weather", {"location": "Paris"}), ("get_time", {})]),
    ("command r7b block left open", '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "search", '
     '"parameters": {"query": "tc"}}]', None, [("search", {"query": "tc"})]),
    ("command a single object", '<|START_ACTION|>{"tool_name": "search", "parameters": {"query": "tc"}}'
     '<|END_ACTION|>', None, [("search", {"query": "tc"})]),
]

NOT_CALLS = [
    ("plain answer", "The weather in Paris today is sunny with a temperature of 18 degrees Celsius."),
    ("json that is not a call", '{"temperature_c": 18, "condition": "sunny"}'),
    ("unknown tool", '{"name": "launch_rocket", "arguments": {}}'),
    ("call without arguments key", '{"name": "get_weather", "location": "Paris"}'),
    ("arguments not an object", '{"name": "get_weather", "arguments": [1, 2]}'),
    ("malformed json in a block", '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Par\n</tool_call>'),
    ("truncated bare object", '{"name": "get_weather", "arguments": {"location": "Pa'),
    ("call then prose", '{"name": "get_weather", "arguments": {"location": "Paris"}} and then I will answer'),
    ("array of numbers", "[1, 2, 3]"),
    ("code fence of python", "```python\nprint('hi')\n```"),
    ("mistral marker then junk", "[TOOL_CALLS] not json at all"),
    ("phi-4-mini marker then junk", "functools[not json]"),
    ("xml unknown tool", "<tool_call>\n<function=launch>\n</function>\n</tool_call>"),
    ("xml function left open", "<tool_call>\n<function=get_time>\n<parameter=x>\n1\n</parameter>\n</tool_call>"),
    ("xml with stray text", "<tool_call>\n<function=get_time>\nnow please\n</function>\n</tool_call>"),
    ("xml bare function not offered", "Try <function=launch>\n</function> in the shell."),
    ("json arguments of NaN", '{"name": "search", "arguments": {"limit": NaN}}'),
    ("command r7b unknown tool", '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "launch_rocket", '
     '"parameters": {}}]<|END_ACTION|>'),
    ("command r7b one of two bad", '<|START_ACTION|>[{"tool_name": "get_time", "parameters": {}}, '
     '{"tool_name": "get_time"}]<|END_ACTION|>'),
    ("command r7b empty block", "<|START_ACTION|>[]<|END_ACTION|>"),
    ("command r7b marker then junk", "<|START_ACTION|>not json<|END_ACTION|>"),
    ("python's functools", "import functools\n\n@functools.lru_cache\ndef f(x):\n    return [x]"),
    ("empty", ""),
    # no call in the array: not a reply of calls only, which a stream would have sent as text from its "]"
    ("an empty array before a call", '[]\n{"name": "get_time", "arguments": {}}'),
    ("deep nesting", "[" * 5000 + "]" * 5000),
]


@pytest.mark.parametrize(("text", "content", "expected"), [r[1:] for r in RECORDED], ids=[r[0] for r in RECORDED])
def test_recorded_calls(text, content, expected):
    reply = parse(text)
    assert reply.content == content
    assert calls(reply) == expected
    assert [c.id for c in reply.calls] == [f"call_{i}" for i in range(len(expected))]
    assert all(json.loads(c.arguments) is not None for c in reply.calls)


@pytest.mark.parametrize("text", [r[1] for r in NOT_CALLS], ids=[r[0] for r in NOT_CALLS])
def test_text_that_is_not_a_call_stays_content_exactly(text):
    assert parse(text) == ParsedReply(text, ())


def test_a_malformed_block_stays_text_beside_a_good_one():
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": oops}\n</tool_call>')
    reply = parse(text)
    assert calls(reply) == [("get_weather", {"location": "Paris"})]
    assert reply.content == '\n<tool_call>\n{"name": oops}\n</tool_call>'


def test_arguments_keep_non_ascii_text():
    reply = parse('{"name": "get_weather", "arguments": {"location": "Zürich"}}')
    assert reply.calls[0].arguments == '{"location": "Zürich"}'


def stream_in(pieces: list[str], parallel: bool = True) -> tuple[str, list[ToolCall]]:
    stream = ToolCallStream(NAMES, ids(), parallel=parallel)
    content, found = "", []
    for piece in pieces:
        text, new = stream.push(piece)
        content, found = content + text, found + new
    text, new = stream.finish()
    return content + text, found + new


ALL_TEXTS = [r[1] for r in RECORDED] + [r[1] for r in NOT_CALLS[:-1]] + [
    "Sure.\n\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\nDone.",
    "Checking <tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call> and <tool_call>{\"name\": \"x\"}",
    "I will use <tool_c but not really",
    "   \n  {\"name\": \"get_time\", \"arguments\": {}}  \n",
    "`not a fence",
    "Answer first. [TOOL_CALLS][{\"name\": \"search\", \"arguments\": {\"query\": \"q\"}}]",
    "[TOOL_CALLS] [{\"name\": \"get_time\", \"arguments\": {}}]",
    "```python\nprint(1)\n```\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>",
    "```\n{\"name\": \"get_time\", \"arguments\": {}}\n```",
    "``` json\n{\"name\": \"get_time\", \"arguments\": {}}\n```",
    "[ {\"name\": \"get_time\", \"arguments\": {}} ]",
    "[1, 2] are the numbers",
    "Let me see. functools[{\"name\": \"get_time\", \"arguments\": {}}]",
    "functools[{\"name\": \"get_time\", \"arguments\": {}}] and more",
    "Plan: \n<|START_ACTION|>[{\"tool_name\": \"get_time\", \"parameters\": {}}]<|END_ACTION|> after",
    "I will use <|START_ACT but not really",
    "Plan.\n<seed:tool_call><function=get_time></function></seed:tool_call> then <tool_call><function=x>",
    "<seed:tool_c is not a block",
    "```json\n{\"answer\": 42, \"name\": \"get_time\", \"arguments\": {}}\n```",
    "{\"name\": \"launch\", \"arguments\": {}}",
    "{\"name\" : \"get_tim\"}",
    "{\"arguments\": {}, \"name\": \"get_time\"}",
    "{\"id\": \"c1\", \"type\": \"function\", \"function\": {\"name\": \"get_time\", \"arguments\": {}}}",
    "[{\"type\": \"function\", \"name\": \"get_time\", \"parameters\": {}}]",
    "[{\"title\": \"x\"}, {\"name\": \"get_time\", \"arguments\": {}}]",
    "{\"na\\u006de\": \"get_time\", \"arguments\": {}}",
    "{\"n\\u0061me\": \"laun\\u0063h\", \"arguments\": {}}",
    "{\"bad\\q\": 1}",
    "{}",
    # a name given twice, and a name beside a wrapper's: the stream reads the first name, as the whole does now
    "{\"name\": \"x\", \"name\": \"get_weather\", \"arguments\": {}}",
    "{\"name\": \"other\", \"function\": {\"name\": \"get_weather\", \"arguments\": {}}}",
]


@pytest.mark.parametrize("text", ALL_TEXTS)
def test_streamed_in_two_pieces_at_every_offset_equals_whole(text):
    whole = parse(text)
    for cut in range(len(text) + 1):
        content, found = stream_in([text[:cut], text[cut:]])
        assert content == (whole.content or ""), cut
        assert [(c.name, c.arguments) for c in found] == [(c.name, c.arguments) for c in whole.calls], cut


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(ALL_TEXTS), st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_streamed_in_any_pieces_equals_whole(text, cuts):
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    content, found = stream_in([text[a:b] for a, b in zip(bounds, bounds[1:])])
    whole = parse(text)
    assert content == (whole.content or "")
    assert [(c.name, c.arguments) for c in found] == [(c.name, c.arguments) for c in whole.calls]


def test_stream_sends_plain_text_at_once_and_a_call_when_its_block_closes():
    stream = ToolCallStream(NAMES, ids())
    assert stream.push("Let me look ") == ("Let me look", [])  # the space waits: a call may follow
    assert stream.push("that up.\n<tool") == (" that up.", [])
    assert stream.push('_call>\n{"name": "get_time", "arguments": {}}\n') == ("", [])
    content, found = stream.push("</tool_call>")
    assert content == "" and [(c.id, c.name, c.arguments) for c in found] == [("call_0", "get_time", "{}")]
    assert stream.finish() == ("", [])


@pytest.mark.parametrize(("opening", "more"), [("```py", "thon\nx = 1"), ("[1", ", 2]"), ("[here]", "(x.html)")])
def test_stream_sends_a_reply_that_opens_as_no_call_can_at_once(opening, more):
    # a bare call is an object or an array of objects, maybe in a ```json fence: these can be none
    stream = ToolCallStream(NAMES, ids())
    assert stream.push(opening) == (opening, [])
    assert stream.push(more) == (more, [])


def test_stream_sends_a_json_answer_from_its_first_key_not_at_its_end():
    """Beside tools offered, a reply in JSON (response_format, or a model that answers so) went out whole at its
    end; an object whose first key no call starts with, or whose name no offered tool has, is content from there."""
    for reply, sent_by in [('```json\n{"answer": 42}\n```', '```json\n{"an'),  # "arguments" starts "ar"
                           ('[{"title": "x", "year": 1999}]', '[{"ti'),  # "type" starts "t"
                           ('{"name": "launch", "arguments": {}}', '{"name": "l'),
                           ('{"name": "get_timer", "arguments": {}}', '{"name": "get_timer'),
                           ('{"names": ["a"]}', '{"names')]:
        stream = ToolCallStream(NAMES, ids())
        content = ""
        for end in range(1, len(reply) + 1):
            content += stream.push(reply[end - 1])[0]
            assert bool(content) == (end >= len(sent_by)), (reply, end, content)
        assert content + stream.finish()[0] == reply


def test_stream_holds_a_reply_that_may_still_be_a_bare_call():
    for opening in ["{", "[", "[ {", "```", "```js", "```json\n", "```\n[", "<|python_tag|>", '{"na', '{"name": "get_',
                    '{"id": "c', '{"type"', '{ "arguments"', '[{"function"', '{"name":"search"', '{"n\\u0061']:
        assert ToolCallStream(NAMES, ids()).push(opening) == ("", []), opening


def test_stream_without_parallel_calls_sends_only_the_first():
    text = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {"query": "q"}}</tool_call>')
    content, found = stream_in([text], parallel=False)
    assert [c.name for c in found] == ["get_time"]
    content, found = stream_in([text[:30], text[30:]], parallel=False)
    assert [c.name for c in found] == ["get_time"]


DEEP_ARRAY = "[" * 20_000 + "]" * 20_000  # JSON nested far past what Python's json reads (its recursion limit)
DEEP_OBJECT = '{"a": ' * 20_000 + "1" + "}" * 20_000


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_time", "arguments": ' + json.dumps(DEEP_ARRAY) + "}</tool_call>",
    '{"name": "get_time", "arguments": ' + json.dumps(DEEP_OBJECT) + "}",
    "[TOOL_CALLS]get_time[ARGS]" + DEEP_OBJECT,
    '<|START_ACTION|>[{"tool_name": "get_time", "parameters": ' + DEEP_OBJECT + "}]",
], ids=["hermes, arguments as text", "bare, arguments as text", "mistral named", "command r7b"])
def test_arguments_nested_past_what_json_reads_stay_text(text):
    """A model can write JSON nested deeper than Python's json reads (a few hundred tokens of brackets): its
    RecursionError escaped the parser, a 500 for the whole reply (or an error event ending the stream)."""
    assert parse(text) == ParsedReply(text, ())
    assert stream_in([text]) == (text, [])
