"""A thinking model's thinking apart from its answer on /v1/chat/completions: message.reasoning_content and
delta.reasoning_content, as vLLM's and llama.cpp's servers give them.

The model is a tiny random Qwen3 with the real Qwen3 chat template and a byte tokenizer that has <think> and
</think> as added tokens, as Qwen3's has. Its replies are forced by logit_bias: each token of a reply gets a bias far
above the next one's, and a repetition penalty so large that a token once written (or in the prompt) falls behind
every biased token not written yet, so the reply spells the biased tokens in the order of their biases whatever
the random weights' own logits (a few units apart; the biases are 8 apart).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from pathlib import Path

import openai
import pytest
import torch
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from tokenizers import AddedToken, Tokenizer

from cluster import Cluster, write_topology
from model_helpers import OurModel
from tiny_families import write_family_model
from tiny_model import byte_tokenizer
from tc.generation import CompletionText, Completion, Generator, LocalPipeline, Step
from tc.head.api import create_app
from tc.head.http_server import start_http_server
from tc.head.main import splits_reasoning
from tc.head.reasoning import ReasoningSplit, ReasoningUnavailable, ThinkTokens, reasoning_tokens, thinks
from tc.head.responses import ResponseShape, ResponsesReply
from tc.head.service import GenerationService, Readiness
from tc.head.streaming import ChatReply, Reasoning, ReplyContext, TokenText, ToolCalling
from tc.head.tool_calls import marker_tokens
from tc.model.chat_template import ChatTemplates
from tc.model.tokenizer import TextTokenizer
from tc.topology import TopologyError

QWEN3_TEMPLATE = (Path(__file__).parent / "chat_templates/qwen3.jinja").read_text(encoding="utf-8")
# DeepSeek-R1's way (and newer Qwen3 templates'): the generation prompt opens the thinking itself
OPENING_TEMPLATE = QWEN3_TEMPLATE.replace("{{- '<|im_start|>assistant\\n' }}",
                                          "{{- '<|im_start|>assistant\\n<think>\\n' }}")
EOS = "<|endoftext|>"  # the tiny model's end of sequence, which the prompt never holds
HI = [{"role": "user", "content": "Hi"}]
THOUGHT, ANSWER = " Ok.", "\rYo!"  # what the model writes inside and after its think block, each character once


def thinking_tokenizer() -> Tokenizer:
    tokenizer = byte_tokenizer()
    # as in Qwen3's tokenizer.json: added, not special, so decoded text keeps them
    tokenizer.add_tokens([AddedToken("<think>", special=False, normalized=False),
                          AddedToken("</think>", special=False, normalized=False)])
    return tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = write_family_model(tmp_path_factory.mktemp("qwen3-thinking"), "qwen3", max_position_embeddings=2048)
    thinking_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": QWEN3_TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def generator(model_dir) -> Generator:
    model = OurModel(model_dir)
    return Generator(model.head, TextTokenizer.load(model_dir), model.pipeline(), torch.float32)


def serve(generator: Generator, template: str | None = None, **app_options):
    tokenizer = generator.tokenizer
    if template is not None:
        tokenizer = dataclasses.replace(tokenizer, chat_templates=ChatTemplates({"default": template}, "test"))
    # a pipeline of its own: each server's generator numbers its sequences from 1
    generator = Generator(generator.head, tokenizer, LocalPipeline(generator.pipeline.stages), generator.dtype)
    service = GenerationService("tiny", tokenizer, generator, lambda: Readiness(1, ("w",), ()))
    return start_http_server(create_app(service, **app_options), "127.0.0.1", 0, threads=2)


@pytest.fixture(scope="module")
def servers(generator):
    """A live server with the model's own (Qwen3) template, and one whose template opens the thinking itself."""
    running = {"qwen3": serve(generator), "opening": serve(generator, OPENING_TEMPLATE)}
    yield {name: openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
           for name, server in running.items()}
    for server in running.values():
        server.stop()


def forced(tokenizer: TextTokenizer, *pieces: str) -> dict:
    """The request fields that make the model write `pieces` (token texts: a tag, or one byte each) in this order,
    then end."""
    ids = []
    for piece in (*pieces, EOS):
        found = tokenizer.token_id(piece)
        ids += [found] if found is not None else tokenizer.encode(piece)
    assert len(set(ids)) == len(ids), "a token the penalty would hold back the second time"
    bias = {str(token): 100 - 8 * i for i, token in enumerate(ids)}
    return {"temperature": 0, "max_tokens": len(ids), "extra_body": {"logit_bias": bias, "repetition_penalty": 1e6}}


def thinking_reply(tokenizer: TextTokenizer) -> dict:
    return forced(tokenizer, "<think>", *THOUGHT, "</think>", *ANSWER)


def with_fields(fields: dict, **extra) -> dict:
    """`fields` with more of tc's own request fields."""
    return {**fields, "extra_body": {**fields["extra_body"], **extra}}


def test_the_model_is_found_to_think_and_the_demo_model_is_not(generator, demo_model_dir):
    tokens, why = thinks(generator.tokenizer)
    assert tokens is not None and (tokens.open_text, tokens.close_text) == ("<think>", "</think>"), why
    demo = TextTokenizer.load(demo_model_dir)
    assert thinks(demo)[0] is None and reasoning_tokens(demo, None)[0] is None
    with pytest.raises(ReasoningUnavailable, match="remove the key, or set it to auto"):
        reasoning_tokens(demo, True)
    # think tokens, but a template that never writes them: a model that does not think (forced on, it is split)
    plain = dataclasses.replace(generator.tokenizer, chat_templates=ChatTemplates({"default": "{{ messages }}"}, "t"))
    assert thinks(plain)[0] is None and reasoning_tokens(plain, True)[0] == tokens
    assert reasoning_tokens(generator.tokenizer, False) == (None, "reasoning_content: false in the topology")


def test_the_thinking_is_reasoning_content_and_the_answer_content(servers, generator):
    client = servers["qwen3"]
    fields = thinking_reply(generator.tokenizer)
    inline = client.chat.completions.create(model="tiny", messages=HI, **with_fields(fields, reasoning_format="none"))
    # as before, asked for: the thinking inline, tags and all
    assert inline.choices[0].message.content == f"<think>{THOUGHT}</think>{ANSWER}"
    reply = client.chat.completions.create(model="tiny", messages=HI, **fields)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHT.strip(), ANSWER.strip())
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == inline.usage.completion_tokens == 2 + len(THOUGHT) + len(ANSWER)


def test_a_reasoning_format_this_server_does_not_know_is_refused_by_name(servers):
    with pytest.raises(openai.BadRequestError) as caught:
        servers["qwen3"].chat.completions.create(model="tiny", messages=HI, max_tokens=1,
                                                 extra_body={"reasoning_format": "hidden"})
    assert caught.value.body["param"] == "reasoning_format"
    assert "use auto, deepseek, none" in caught.value.body["message"]


def chunks_of(client, model: str = "tiny", **request) -> list:
    return list(client.chat.completions.create(model=model, stream=True, **request))


def test_streamed_thinking_comes_before_the_answer_and_joins_into_the_whole_reply(servers, generator):
    client = servers["qwen3"]
    fields = thinking_reply(generator.tokenizer)
    whole = client.chat.completions.create(model="tiny", messages=HI, logprobs=True, top_logprobs=2, **fields)
    chunks = chunks_of(client, messages=HI, logprobs=True, top_logprobs=2, stream_options={"include_usage": True},
                       **fields)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    kinds = [("reasoning" if getattr(d, "reasoning_content", None) else "content") for d in deltas
             if getattr(d, "reasoning_content", None) or d.content]
    assert kinds == sorted(kinds, key=lambda kind: kind == "content") and "reasoning" in kinds and "content" in kinds
    thinking = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    answer = "".join(d.content or "" for d in deltas)
    assert (thinking, answer) == (whole.choices[0].message.reasoning_content, whole.choices[0].message.content)
    assert "<think>" not in thinking + answer and "</think>" not in thinking + answer
    # the log-probability entries cover every token, tags and thinking included, as the whole reply's do
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]
    assert len(entries) == whole.usage.completion_tokens == chunks[-1].usage.completion_tokens
    assert entries[0].token == "<think>"


def test_a_reply_that_never_closes_its_thinking_is_all_reasoning(servers, generator):
    client = servers["qwen3"]
    fields = thinking_reply(generator.tokenizer)
    fields["max_tokens"] = 1 + len(THOUGHT)  # cut before </think>
    reply = client.chat.completions.create(model="tiny", messages=HI, **fields)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "length"
    assert (message.reasoning_content, message.content) == (THOUGHT.strip(), None)
    deltas = [c.choices[0].delta for c in chunks_of(client, messages=HI, **fields) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == THOUGHT.strip()
    assert "".join(d.content or "" for d in deltas) == ""


def test_a_template_that_opens_the_thinking_starts_the_reply_in_it(servers, generator):
    fields = forced(generator.tokenizer, *THOUGHT, "</think>", *ANSWER)  # no <think>: the prompt wrote it
    for stream in (False, True):
        if stream:
            deltas = [c.choices[0].delta for c in chunks_of(servers["opening"], messages=HI, **fields) if c.choices]
            thinking = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
            answer = "".join(d.content or "" for d in deltas)
        else:
            message = servers["opening"].chat.completions.create(model="tiny", messages=HI, **fields)
            thinking, answer = message.choices[0].message.reasoning_content, message.choices[0].message.content
        assert (thinking, answer) == (THOUGHT.strip(), ANSWER.strip())
    # the same reply after a prompt that opened nothing is no thinking: all of it is the answer
    reply = servers["qwen3"].chat.completions.create(model="tiny", messages=HI, **fields).choices[0].message
    assert (reply.reasoning_content, reply.content) == (None, f"{THOUGHT}</think>{ANSWER}")


def test_a_think_tag_a_user_typed_opens_no_thinking(servers, generator):
    fields = forced(generator.tokenizer, *ANSWER)
    typed = [{"role": "user", "content": "What is <think>?"}]  # the tokenizer reads it as the tag's token
    reply = servers["qwen3"].chat.completions.create(model="tiny", messages=typed, **fields).choices[0].message
    assert (reply.reasoning_content, reply.content) == (None, ANSWER)


def test_enable_thinking_false_closes_the_thinking_in_the_prompt_and_the_reply_is_the_answer(servers, generator):
    fields = with_fields(forced(generator.tokenizer, *ANSWER), chat_template_kwargs={"enable_thinking": False})
    for client in servers.values():  # the opening template writes the empty block after its own <think>
        reply = client.chat.completions.create(model="tiny", messages=HI, **fields).choices[0].message
        assert (reply.reasoning_content, reply.content) == (None, ANSWER)


EMPTY_OBJECT = {"type": "json_schema", "json_schema": {"name": "empty", "schema": {
    "type": "object", "properties": {}, "additionalProperties": False}}}  # whatever the model: "{}"


def test_a_response_format_holds_from_the_first_token_where_the_reply_has_not_begun_thinking(servers, generator):
    # the grammar allows no <think> to start it: all of the reply is the answer
    fields = thinking_reply(generator.tokenizer)
    reply = servers["qwen3"].chat.completions.create(model="tiny", messages=HI, response_format=EMPTY_OBJECT,
                                                     **fields)
    assert (reply.choices[0].message.reasoning_content, reply.choices[0].message.content) == (None, "{}")


def test_a_response_format_holds_for_the_answer_after_the_thinking_the_prompt_began(servers, generator):
    fields = {**forced(generator.tokenizer, *THOUGHT, "</think>"), "max_tokens": 20}
    for stream in (False, True):
        request = dict(model="tiny", messages=HI, response_format=EMPTY_OBJECT, **fields)
        if stream:
            chunks = chunks_of(servers["opening"], **request)
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            thinking = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
            answer, finish = "".join(d.content or "" for d in deltas), chunks[-1].choices[0].finish_reason
        else:
            reply = servers["opening"].chat.completions.create(**request)
            message, finish = reply.choices[0].message, reply.choices[0].finish_reason
            thinking, answer = message.reasoning_content, message.content
        # the thinking as the bias wrote it, free of the grammar; then the only JSON the schema allows, and the end
        assert (thinking, answer, finish) == (THOUGHT.strip(), "{}", "stop")


def test_an_assistant_turns_reasoning_content_sent_back_reaches_the_template(servers, generator):
    """Qwen3's template writes an assistant turn's thinking back in the turns since the last query (a tool loop)."""
    called = {"role": "assistant", "content": "", "reasoning_content": "Weather needs the tool.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}
    messages = [*HI, called, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    reply = servers["qwen3"].chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    without = [*HI, {**called, "reasoning_content": None}, messages[2]]
    shorter = servers["qwen3"].chat.completions.create(model="tiny", messages=without, max_tokens=1)
    written = generator.tokenizer.encode("<think>\nWeather needs the tool.\n</think>\n\n")
    assert reply.usage.prompt_tokens - shorter.usage.prompt_tokens == len(written)
    with pytest.raises(openai.BadRequestError, match="only for assistant messages"):
        servers["qwen3"].chat.completions.create(model="tiny", max_tokens=1,
                                                 messages=[{**HI[0], "reasoning_content": "mine"}])


def test_the_topology_can_turn_it_off(generator):
    server = serve(generator, reasoning=False)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        message = client.chat.completions.create(model="tiny", messages=HI,
                                                 **thinking_reply(generator.tokenizer)).choices[0].message
        assert message.content == f"<think>{THOUGHT}</think>{ANSWER}"
        assert getattr(message, "reasoning_content", None) is None
    finally:
        server.stop()


def test_the_demo_model_replies_as_before(demo_model_dir):
    model = OurModel(demo_model_dir, dtype=torch.bfloat16)
    generator = Generator(model.head, TextTokenizer.load(demo_model_dir), model.pipeline(), torch.bfloat16)
    service = GenerationService("demo", generator.tokenizer, generator, lambda: Readiness(1, ("w",), ()))
    server = start_http_server(create_app(service), "127.0.0.1", 0, threads=2)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        reply = client.chat.completions.create(model="demo", messages=HI, max_tokens=8, temperature=0)
        assert "reasoning_content" not in reply.choices[0].message.model_dump()
        deltas = [c.choices[0].delta for c in chunks_of(client, "demo", messages=HI, max_tokens=8, temperature=0)
                  if c.choices]
        assert all("reasoning_content" not in d.model_dump() for d in deltas)
        assert "".join(d.content or "" for d in deltas) == reply.choices[0].message.content
    finally:
        server.stop()


# --- the split, step by step, against the whole reply -----------------------------------------------------------

def steps_of(tokenizer: TextTokenizer, text: str, stops: tuple[str, ...] = (),
             kept: frozenset[int] = frozenset()) -> tuple[list[Step], Completion]:
    """The steps the generation loop releases for a reply spelled `text` (its tags as their tokens); `kept`: the
    special tokens whose text it keeps (a request with tools keeps a call's markers)."""
    ids = tokenizer.encode(text)
    state = CompletionText(tokenizer, stops, (), kept)
    steps = []
    for token in ids:
        state.push(token, None)
        if state.stop_at is not None:
            break
        steps.append(state.release())
    final, rest, tokens = state.finish()
    completion = Completion(tuple(t.id for t in state.tokens), final, "stop", 5, 0.0, 0.0, tuple(state.tokens))
    steps.append(Step(rest, tokens, completion))
    return steps, completion


def chat_reply(tokenizer: TextTokenizer, opened: bool, tools: bool = False) -> ChatReply:
    counter = itertools.count()
    calling = ToolCalling(dict.fromkeys({"get_weather"}), new_id=lambda: f"call_{next(counter)}") if tools else None
    return ChatReply(ReplyContext("chatcmpl-1", 0, "tiny"), TokenText(tokenizer), logprobs=None, tools=calling,
                     reasoning=Reasoning(ThinkTokens.find(tokenizer), opened))


def streamed(reply: ChatReply, steps: list[Step]) -> ChatCompletion:
    state = ChatCompletionStreamState()
    chunks = reply.opening(steps[0])
    for step in steps:
        chunks += reply.deltas(step)
    chunks += reply.closing(steps[-1].completion)
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return state.get_final_completion()


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CASES = [  # (reply, prompt opened the thinking, stop strings, thinking, answer)
    ("<think>\nPlan it.\n</think>\n\nHello!", False, (), "Plan it.", "Hello!"),
    ("Plan it.\n</think>\n\nHello!", True, (), "Plan it.", "Hello!"),
    ("<think>\n\n</think>\n\nHello!", False, (), None, "Hello!"),
    ("<think>\nStill thinking", False, (), "Still thinking", None),
    ("Hello! </think> is a tag", False, (), None, "Hello! </think> is a tag"),
    ("<think>a </think> b</think>c", False, (), "a", " b</think>c"),
    ("<think>Plan</think>Hi. STOP here", False, ("STOP",), "Plan", "Hi. "),
    ("<think>Plan STOP</think>Hi.", False, ("STOP",), "Plan", None),
    ("<think>Plan</thi", False, ("</thi",), "Plan", None),
    ("<think>Plan</think>\r\n\n    indented()", False, (), "Plan", "    indented()"),
]


@pytest.mark.parametrize(("text", "opened", "stops", "thinking", "answer"), CASES)
def test_each_step_split_joins_into_the_whole_reply(generator, text, opened, stops, thinking, answer):
    tokenizer = generator.tokenizer
    steps, completion = steps_of(tokenizer, text, stops)
    whole = ChatCompletion.model_validate(chat_reply(tokenizer, opened).whole(completion)).choices[0].message
    assert (whole.reasoning_content, whole.content) == (thinking, answer)
    joined = streamed(chat_reply(tokenizer, opened), steps).choices[0].message
    assert (getattr(joined, "reasoning_content", None) or None, joined.content or None) == (thinking, answer or None)


def responses_events(reply: ResponsesReply, steps: list[Step]) -> list[dict]:
    """The Responses events of a streamed reply, as ResponseEventStream sends them (without their SSE framing)."""
    chunks = reply.chat.opening(steps[0])
    for step in steps:
        chunks += reply.chat.deltas(step)
    chunks += reply.chat.closing(steps[-1].completion)
    sent = [*reply.opening(), *(e for chunk in chunks for e in reply.events(chunk)),
            *reply.closing(steps[-1].completion)]
    events = [json.loads(event.split(b"\ndata: ", 1)[1]) for event in sent]
    for event in events:
        TypeAdapter(ResponseStreamEvent).validate_python(event)
    return events


@pytest.mark.parametrize(("text", "opened", "stops", "thinking", "answer"), CASES)
def test_on_v1_responses_the_thinking_is_a_reasoning_item_whole_and_streamed(generator, text, opened, stops,
                                                                            thinking, answer):
    tokenizer = generator.tokenizer
    steps, completion = steps_of(tokenizer, text, stops)
    shape = ResponseShape("tiny", {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True})
    whole = Response.model_validate(ResponsesReply(chat_reply(tokenizer, opened), shape).whole(completion))
    reasoning = [item.content[0].text for item in whole.output if item.type == "reasoning"]
    assert reasoning == ([thinking] if thinking else [])
    assert (whole.output_text or None) == answer
    events = responses_events(ResponsesReply(chat_reply(tokenizer, opened), shape), steps)
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == (thinking or "")
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == (answer or "")
    final = Response.model_validate(events[-1]["response"])
    assert [item.type for item in final.output] == [item.type for item in whole.output]


def test_tags_a_tokenizer_marks_special_split_the_reply_though_decoding_drops_them(generator):
    """Where the think tokens are special, the reply's text has no tags: their tokens' offsets still split it."""
    special = byte_tokenizer()
    special.add_special_tokens([AddedToken("<think>", special=True), AddedToken("</think>", special=True)])
    tokenizer = dataclasses.replace(generator.tokenizer, tokenizer=special)
    assert ThinkTokens.find(tokenizer).close_text == ""
    steps, completion = steps_of(tokenizer, "<think>\nPlan it.\n</think>\n\nHello!")
    assert completion.text == "\nPlan it.\n\n\nHello!"
    whole = ChatCompletion.model_validate(chat_reply(tokenizer, False).whole(completion)).choices[0].message
    joined = streamed(chat_reply(tokenizer, False), steps).choices[0].message
    assert (whole.reasoning_content, whole.content) == (joined.reasoning_content, joined.content) == \
        ("Plan it.", "Hello!")


def test_a_split_at_every_offset_is_the_same_split(generator):
    """The text arriving in any two pieces, the tags' tokens with the piece that ends their text."""
    tokenizer = generator.tokenizer
    tokens = ThinkTokens.find(tokenizer)
    steps, completion = steps_of(tokenizer, "<think>\n Plan </thi it.\n</think>\n\n Hello </think>")
    infos = completion.tokens
    whole = ReasoningSplit(tokens, opened=False)
    expected = whole.finish(completion.text, infos)
    for cut in range(len(completion.text) + 1):
        split = ReasoningSplit(tokens, opened=False)
        first = [t for t in infos if t.offset + len(tokenizer.decode([t.id])) <= cut]
        thinking, answer = split.push(completion.text[:cut], first)
        more = split.finish(completion.text[cut:], infos[len(first):])
        assert (thinking + more[0], answer + more[1]) == expected, cut
    assert expected == ("Plan </thi it.", " Hello </think>")


def test_tool_calls_are_read_from_the_answer_not_the_thinking(generator):
    tokenizer = generator.tokenizer
    for text, calls in ((f"<think>Call it? {CALL}</think>No need.", 0), (f"<think>Call it.</think>\n{CALL}", 1)):
        steps, completion = steps_of(tokenizer, text)
        whole = ChatCompletion.model_validate(chat_reply(tokenizer, False, tools=True).whole(completion))
        joined = streamed(chat_reply(tokenizer, False, tools=True), steps)
        for reply in (whole, joined):
            message = reply.choices[0].message
            assert len(message.tool_calls or []) == calls
            assert message.reasoning_content.startswith("Call it")
            assert (reply.choices[0].finish_reason == "tool_calls") == bool(calls)
        assert whole.choices[0].message.content == ("No need." if not calls else None)


def test_the_head_logs_what_it_decided_and_refuses_to_force_it_on_a_model_without_think_tokens(
        generator, tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="tc.head.main")
    assert splits_reasoning(generator.tokenizer, None)
    assert "chat replies give the thinking in reasoning_content: the vocabulary has <think> and </think> tokens " \
           "and the chat template writes them" in caplog.text
    plain = TextTokenizer.load(tiny_model_dir)
    assert not splits_reasoning(plain, None)
    assert "chat replies keep any thinking in content: the vocabulary has no <think> and </think>" in caplog.text
    with pytest.raises(TopologyError) as caught:
        splits_reasoning(plain, True)
    assert caught.value.key_path == "reasoning_content" and "set it to auto" in caught.value.message


@pytest.mark.parametrize("setting", ["auto", False])
def test_a_cluster_s_head_splits_as_its_topology_says(tmp_path, model_dir, generator, setting):
    """The head and a worker as processes, the topology's reasoning_content read by the head at load."""
    topology = write_topology(tmp_path / "t.yaml", model_dir, [{"id": "a", "device": "cpu"}],
                              reasoning_content=setting)
    with Cluster(topology, tmp_path) as cluster:
        cluster.start_all(["a"])
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=120)
        message = client.chat.completions.create(model=model_dir.name, messages=HI,
                                                 **thinking_reply(generator.tokenizer)).choices[0].message
        if setting == "auto":
            assert (message.reasoning_content, message.content) == (THOUGHT.strip(), ANSWER.strip())
            assert "chat replies give the thinking in reasoning_content" in cluster.head.output()
        else:
            assert message.content == f"<think>{THOUGHT}</think>{ANSWER}"
            assert "chat replies keep any thinking in content: reasoning_content: false" in cluster.head.output()


def test_seed_oss_thinks_between_its_own_tags_and_calls_in_its_own_block(generator):
    """Seed-OSS writes `<seed:think>...</seed:think>` (and calls in `<seed:tool_call>`): its thinking is
    reasoning_content as Qwen3's is, found from its vocabulary and the template that writes the tags."""
    seed = byte_tokenizer()
    seed.add_tokens(["<seed:think>", "</seed:think>", "<seed:tool_call>", "</seed:tool_call>"])
    template = (Path(__file__).parent / "chat_templates/seed-oss.jinja").read_text(encoding="utf-8")
    tokenizer = dataclasses.replace(generator.tokenizer, tokenizer=seed,
                                    chat_templates=ChatTemplates({"default": template}, "seed-oss"))
    tokens, why = thinks(tokenizer)
    assert tokens is not None and tokens.tags == ("<seed:think>", "</seed:think>"), why
    assert (tokens.open, tokens.close) == (seed.token_to_id("<seed:think>"), seed.token_to_id("</seed:think>"))
    reply = ("<seed:think>The user wants the weather.</seed:think><seed:tool_call>\n<function=get_weather>\n"
             "<parameter=city>Paris</parameter>\n</function>\n</seed:tool_call>")
    steps, completion = steps_of(tokenizer, reply)
    whole = ChatCompletion.model_validate(chat_reply(tokenizer, False, tools=True).whole(completion))
    joined = streamed(chat_reply(tokenizer, False, tools=True), steps)
    assert whole.choices[0].message.content is None  # a stream's client joins no content into ""
    for message in (whole.choices[0].message, joined.choices[0].message):
        assert (message.reasoning_content, message.content or None) == ("The user wants the weather.", None)
        (call,) = message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})


def test_command_r7b_plans_between_its_thinking_tags_and_acts_in_its_action_block(generator):
    """Command R7B writes its plan between <|START_THINKING|> and <|END_THINKING|>, special tokens decoding drops,
    then its calls in an action block whose markers a request with tools keeps: the plan is reasoning_content (as
    llama.cpp returns it), the block the calls."""
    cohere = byte_tokenizer()
    cohere.add_special_tokens(["<|START_THINKING|>", "<|END_THINKING|>", "<|START_ACTION|>", "<|END_ACTION|>",
                               "<|START_RESPONSE|>", "<|END_RESPONSE|>"])
    template = (Path(__file__).parent / "chat_templates/command-r7b-tool-use.jinja").read_text(encoding="utf-8")
    tokenizer = dataclasses.replace(generator.tokenizer, tokenizer=cohere,
                                    chat_templates=ChatTemplates({"default": template}, "command-r7b"))
    tokens, why = thinks(tokenizer)
    assert tokens is not None and tokens.tags == ("<|START_THINKING|>", "<|END_THINKING|>"), why
    reply = ('<|START_THINKING|>I will look up the weather.<|END_THINKING|><|START_ACTION|>[\n    {"tool_call_id": '
             '"0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}\n]<|END_ACTION|>')
    steps, completion = steps_of(tokenizer, reply, kept=marker_tokens(tokenizer))
    whole = ChatCompletion.model_validate(chat_reply(tokenizer, False, tools=True).whole(completion))
    joined = streamed(chat_reply(tokenizer, False, tools=True), steps)
    assert whole.choices[0].message.content is None
    for message in (whole.choices[0].message, joined.choices[0].message):
        assert (message.reasoning_content, message.content or None) == ("I will look up the weather.", None)
        (call,) = message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    # a reply in words: its response markers, special too, leave the answer alone
    steps, completion = steps_of(tokenizer, "<|START_THINKING|>Greet.<|END_THINKING|><|START_RESPONSE|>Hello!"
                                            "<|END_RESPONSE|>", kept=marker_tokens(tokenizer))
    message = ChatCompletion.model_validate(chat_reply(tokenizer, False, tools=True).whole(completion))
    assert (message.choices[0].message.reasoning_content, message.choices[0].message.content) == ("Greet.", "Hello!")
