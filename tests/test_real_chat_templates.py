"""The real chat templates of the families tc runs, fed what a client sends, render as transformers renders them.

The templates in chat_templates/ are the models' own (tokenizer_config.json's `chat_template` on the Hub, and the
one TRL's trainer writes into the models it fine-tunes); each model directory here pairs one with the special
tokens its tokenizer_config.json names and the byte tokenizer.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from falcon import testing
from transformers import AutoTokenizer

from model_helpers import OurModel
from tiny_model import byte_tokenizer, write_tiny_model
from tc.generation import Generator
from tc.head.api import create_app
from tc.head.api_requests import parse_chat_request
from tc.head.responses import translate
from tc.head.service import GenerationService, Readiness
from tc.head.streaming import new_call_id
from tc.head.tool_calls import parse_tool_calls
from tc.model.chat_template import ChatTemplateError
from tc.model.tokenizer import TextTokenizer

HERE = Path(__file__).parent
LLAMA3 = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
SENTENCEPIECE = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
GEMMA = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
COHERE = {"bos_token": "<BOS_TOKEN>", "eos_token": "<|END_OF_TURN_TOKEN|>", "pad_token": "<PAD>"}
GLM = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
QWEN = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
SEED = {"bos_token": "<seed:bos>", "eos_token": "<seed:eos>", "pad_token": "<seed:pad>"}
# family: (its template, the special tokens of its tokenizer_config.json)
FAMILIES = {
    "qwen2.5": (HERE / "qwen25_chat_template.jinja", QWEN),
    "qwen3": (HERE / "chat_templates/qwen3.jinja", QWEN),
    # what TRL's SFT trainer saves with a Qwen2.5 model it fine-tuned: marks {% generation %} for transformers
    "qwen2.5-trl-training": (HERE / "chat_templates/qwen2.5-trl-training.jinja", QWEN),
    "llama2": (HERE / "chat_templates/llama2.jinja", SENTENCEPIECE),
    "llama3": (HERE / "chat_templates/llama3.jinja", LLAMA3),
    "llama3.2": (HERE / "chat_templates/llama3.2.jinja", LLAMA3),
    "smollm2": (HERE / "chat_templates/smollm2.jinja",
                {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}),
    "mixtral-v0.1": (HERE / "chat_templates/mixtral-v0.1.jinja", SENTENCEPIECE),  # Mistral 7B v0.1's too
    "mistral-v0.2": (HERE / "chat_templates/mistral-v0.2.jinja", SENTENCEPIECE),
    "mistral-v0.3": (HERE / "chat_templates/mistral-v0.3.jinja", SENTENCEPIECE),
    "phi3": (HERE / "chat_templates/phi3.jinja", {**SENTENCEPIECE, "eos_token": "<|endoftext|>"}),
    "gemma2": (HERE / "chat_templates/gemma2.jinja", GEMMA),
    "gemma3": (HERE / "chat_templates/gemma3.jinja", GEMMA),
    # GLM-4-9B-Chat's as llama.cpp's tests keep it (its tool prompt's text shortened, its tools read from a
    # message's own `tools`, not the request's), and GLM-Edge's
    "glm4": (HERE / "chat_templates/glm4.jinja", GLM),
    "glm-edge": (HERE / "chat_templates/glm-edge.jinja", GLM),
    # Command R7B's tool_use template (its tokenizer_config.json names three)
    "command-r7b-tool-use": (HERE / "chat_templates/command-r7b-tool-use.jinja", COHERE),
    # templates that show tools, and render calls, in the XML form (<function=...><parameter=...>)
    "qwen3-coder": (HERE / "chat_templates/qwen3-coder.jinja", QWEN),
    "seed-oss": (HERE / "chat_templates/seed-oss.jinja", SEED),
}
# the families whose template renders calls and their results
TOOL_FAMILIES = ("qwen2.5", "qwen2.5-trl-training", "qwen3", "llama3.2", "mistral-v0.3", "qwen3-coder", "seed-oss")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city («Paris»)",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]
CALL_ID = "Xy7Qa9Lm2"  # nine letters and digits: an id every template here takes
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hi"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "developer": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "turns": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
              {"role": "assistant", "content": "Hello! "}, {"role": "user", "content": "Again"}],
    "not alternating": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    "tools": [{"role": "user", "content": "Weather in Paris?"}],
    "tool result": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": CALL_ID, "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                    {"role": "tool", "tool_call_id": CALL_ID, "content": "{\"temp_c\": 21}"}],
}


def model_dir(path: Path, family: str) -> Path:
    template, specials = FAMILIES[family]
    path.mkdir(parents=True, exist_ok=True)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        **specials, "chat_template": template.read_text(encoding="utf-8"),
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


def ours(directory: Path, body: dict) -> str:
    """The prompt tc makes of a chat request's body."""
    request = parse_chat_request({"model": "m", **body})
    tools = [tool.as_template_input() for tool in request.offered_tools] or None
    return TextTokenizer.load(directory).apply_chat_template(
        [m.as_template_input() for m in request.messages], request.add_generation_prompt, tools=tools,
        continue_final_message=request.continue_final_message, variables=request.template_variables)


def theirs(directory: Path, body: dict) -> str:
    """transformers' prompt for the same messages: `developer` read as `system`, and a call's arguments as the
    object their JSON text holds (what tc, like vLLM, hands the template: templates write them with tojson).
    The body's chat-template fields are handed over as vLLM hands them."""
    messages = []
    for message in body["messages"]:
        message = {**message, "role": "system" if message["role"] == "developer" else message["role"]}
        if "tool_calls" in message:
            message["tool_calls"] = [{**call, "function": {**call["function"], "arguments": json.loads(
                call["function"]["arguments"])}} for call in message["tool_calls"]]
        messages.append(message)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    continues = body.get("continue_final_message", False)
    return tokenizer.apply_chat_template(messages, tools=body.get("tools"), tokenize=False,
                                         add_generation_prompt=body.get("add_generation_prompt", not continues),
                                         continue_final_message=continues, **body.get("chat_template_kwargs", {}))


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_real_templates_render_as_transformers_does(tmp_path, family, conversation):
    directory = model_dir(tmp_path, family)
    body = {"messages": CONVERSATIONS[conversation]}
    if conversation in ("tools", "tool result"):
        body["tools"] = TOOLS
    try:
        expected = theirs(directory, body)
    except Exception as exc:  # the template refuses these messages: tc answers with the template's own words
        with pytest.raises(ChatTemplateError, match=re.escape(str(exc).split("!")[0][:40])):
            ours(directory, body)
    else:
        assert_alike(ours(directory, body), expected, directory, body)


def assert_alike(rendered: str, expected: str, directory: Path, body: dict) -> None:
    """`rendered` is transformers' prompt `expected`, or the one it renders now: a template that writes today's date
    (Llama 3.2's) may see the day change between two renders, once at most."""
    assert rendered == expected or rendered == theirs(directory, body)


@pytest.mark.parametrize("family", TOOL_FAMILIES)
def test_call_ids_tc_makes_render_back_in_every_family_that_calls_tools(tmp_path, family):
    """The ids tc gives calls come back in the next request; Mistral's template refuses any id not 9 long."""
    call_id = new_call_id()
    body = {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "21 C"}]}
    directory = model_dir(tmp_path, family)
    expected = theirs(directory, body)
    assert_alike(ours(directory, body), expected, directory, body)


def test_a_message_the_template_refuses_is_a_400_in_its_words(tmp_path):
    """Gemma's template refuses a system message: the client gets a 400 saying so, not a 500."""
    model_dir = write_tiny_model(tmp_path, seed=0)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = FAMILIES["gemma2"][0].read_text(encoding="utf-8")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    model, tokenizer = OurModel(model_dir), TextTokenizer.load(model_dir)
    service = GenerationService("tiny", tokenizer, Generator(model.head, tokenizer, model.pipeline(), torch.float32),
                                lambda: Readiness(1, ("w",), ()))
    reply = testing.TestClient(create_app(service)).simulate_post("/v1/chat/completions", json={
        "model": "tiny", "messages": CONVERSATIONS["system"], "max_tokens": 1})
    assert reply.status_code == 400, reply.text
    error = reply.json["error"]
    assert (error["code"], error["param"], error["message"]) == ("chat_template_error", "messages",
                                                                 "System role not supported")


# an answer begun for the model, as clients prefill one: its trailing space is the template's to keep or trim
PREFILLED = [{"role": "user", "content": "Write a haiku about autumn."},
             {"role": "assistant", "content": "Crimson leaves drift down, "}]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_continued_final_message_renders_as_transformers_continues_it(tmp_path, family):
    """continue_final_message: the prompt ends where the assistant's text does, with no end of its turn after it."""
    directory = model_dir(tmp_path, family)
    body = {"messages": PREFILLED, "continue_final_message": True, "add_generation_prompt": False}
    expected = theirs(directory, body)
    rendered = ours(directory, body)
    assert_alike(rendered, expected, directory, body)
    assert rendered.rstrip().endswith("Crimson leaves drift down,")
    whole = ours(directory, {"messages": PREFILLED, "add_generation_prompt": False})
    assert whole.startswith(rendered)
    # the turn's end is what was cut; GLM-4's template ends no turn (the next one's role tag begins it)
    assert (whole.strip() == rendered.strip()) == (family == "glm4")


@pytest.mark.parametrize("family", ["qwen2.5", "qwen2.5-trl-training", "smollm2"])
def test_a_continued_message_is_the_opened_turn_with_its_text(tmp_path, family):
    """In a ChatML template the continued prompt is exactly the prompt that opens the assistant's turn after the
    earlier messages, followed by the assistant's words so far (here the template keeps their trailing space)."""
    directory = model_dir(tmp_path, family)
    opened = ours(directory, {"messages": PREFILLED[:1]})
    assert ours(directory, {"messages": PREFILLED, "continue_final_message": True}) == \
        opened + PREFILLED[1]["content"]


# how gpt-oss's template reads a reasoning effort: a variable beside the messages, when given
EFFORT_TEMPLATE = ("{%- if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
                   "{%- for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")


def test_a_reasoning_effort_reaches_the_template_as_its_variable(tmp_path):
    """Chat's reasoning_effort and the Responses API's reasoning.effort reach the chat template as the variable
    `reasoning_effort`, as chat_template_kwargs would give it, and as transformers hands it over; left out, the
    template sees no such variable."""
    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        **QWEN, "chat_template": EFFORT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}))
    messages = CONVERSATIONS["system"]
    assert ours(tmp_path, {"messages": messages}) == "system: Be brief.\nuser: Hi\n"
    low = ours(tmp_path, {"messages": messages, "reasoning_effort": "low"})
    assert low == "Reasoning: low\nsystem: Be brief.\nuser: Hi\n"
    given = {"messages": messages, "chat_template_kwargs": {"reasoning_effort": "low"}}
    assert ours(tmp_path, given) == theirs(tmp_path, given) == low
    chat = translate({"model": "m", "instructions": "Be brief.", "input": "Hi", "reasoning": {"effort": "low"}}).chat
    assert ours(tmp_path, {k: v for k, v in chat.items() if k != "model"}) == low


def test_qwen3_sees_enable_thinking_from_chat_template_kwargs(tmp_path):
    """Qwen3's clients turn its thinking off with chat_template_kwargs {"enable_thinking": false}: the template
    then opens the turn with an empty <think> block, which the model reads as thinking done."""
    directory = model_dir(tmp_path, "qwen3")
    messages = CONVERSATIONS["system"]
    thinking = ours(directory, {"messages": messages})
    for value in (False, True):
        body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": value}}
        assert ours(directory, body) == theirs(directory, body)
    off = ours(directory, {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    assert off == thinking + "<think>\n\n</think>\n\n"


@pytest.mark.parametrize("family", ["qwen3-coder", "seed-oss"])
def test_a_call_as_the_template_writes_it_parses_back_to_the_same_call(tmp_path, family):
    """These families are taught to call tools as their template renders a call (the XML form): tc reads that
    text back as the call it came from, each value typed by the tool's schema."""
    directory = model_dir(tmp_path, family)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}}
    arguments = {"city": "Paris", "days": 3, "zip": "75001"}
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    called = {"role": "assistant", "content": "", "tool_calls": [
        {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]}
    prompt = ours(directory, {"messages": asked, "tools": [tool]})
    turn = ours(directory, {"messages": [*asked, called], "tools": [tool], "add_generation_prompt": False})
    assert turn.startswith(prompt)
    reply = turn[len(prompt):].rsplit(FAMILIES[family][1]["eos_token"], 1)[0]  # what the model writes, to its EOS
    parsed = parse_tool_calls(reply, {"get_weather": tool["function"]["parameters"]}, new_call_id)
    assert parsed.content is None
    (call,) = parsed.calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", arguments)
