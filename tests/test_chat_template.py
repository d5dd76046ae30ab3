"""Chat templates from wherever a model directory keeps them, rendered as transformers renders them."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from falcon import testing
from tokenizers import processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

from model_helpers import OurModel
from tiny_model import CHATML_TEMPLATE, byte_tokenizer, write_tiny_model
from tc.generation import Generator
from tc.head.api import create_app
from tc.head.service import GenerationService, Readiness
from tc.model.chat_template import ChatTemplateError, ChatTemplates
from tc.model.tokenizer import TextTokenizer, TokenizerError

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
CHATML_PROMPT = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]
# a template that shows tools the way Qwen's does (tojson), and tells the tool_use template from the default
TOOL_TEMPLATE = ("TOOLS{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
                 "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
OTHER = "OTHER {{ messages | length }} {{ eos_token }}"


def tokenizer_dir(path: Path, config: dict | None = None) -> Path:
    """A model directory holding only tokenizer files (and no template unless a layout adds one)."""
    path.mkdir(parents=True, exist_ok=True)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, **(config or {})}))
    return path


def render(model_dir: Path, tools: list | None = None, **load) -> str:
    return TextTokenizer.load(model_dir, **load).apply_chat_template(MESSAGES, tools=tools)


def test_in_tokenizer_config(tmp_path):
    assert render(tokenizer_dir(tmp_path, {"chat_template": CHATML_TEMPLATE})) == CHATML_PROMPT


def test_named_list_in_tokenizer_config_picks_default_then_tool_use(tmp_path):
    model = tokenizer_dir(tmp_path, {"chat_template": [{"name": "tool_use", "template": TOOL_TEMPLATE},
                                                       {"name": "default", "template": CHATML_TEMPLATE}]})
    assert render(model) == CHATML_PROMPT
    assert render(model, tools=TOOLS).startswith("TOOLS{\"type\": \"function\"")


def test_named_list_without_tool_use_renders_tools_with_default(tmp_path):
    model = tokenizer_dir(tmp_path, {"chat_template": [{"name": "default", "template": TOOL_TEMPLATE}]})
    assert "get_weather" in render(model, tools=TOOLS)


def test_chat_template_jinja_file(tmp_path):
    model = tokenizer_dir(tmp_path)
    (model / "chat_template.jinja").write_text(CHATML_TEMPLATE, encoding="utf-8")
    assert render(model) == CHATML_PROMPT


def test_jinja_file_wins_over_tokenizer_config(tmp_path):
    model = tokenizer_dir(tmp_path, {"chat_template": OTHER})
    (model / "chat_template.jinja").write_text(CHATML_TEMPLATE, encoding="utf-8")
    assert render(model) == CHATML_PROMPT


def test_chat_template_json_file(tmp_path):
    model = tokenizer_dir(tmp_path)
    (model / "chat_template.json").write_text(json.dumps({"chat_template": CHATML_TEMPLATE}), encoding="utf-8")
    assert render(model) == CHATML_PROMPT


def test_directory_saved_by_transformers(tmp_path):
    """What a current transformers release writes: chat_template.jinja, additional_chat_templates/, no key."""
    saved = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(), eos_token="<|im_end|>")
    saved.chat_template = {"default": CHATML_TEMPLATE, "tool_use": TOOL_TEMPLATE}
    saved.save_pretrained(str(tmp_path))
    assert (tmp_path / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    ours = TextTokenizer.load(tmp_path)
    assert ours.apply_chat_template(MESSAGES) == saved.apply_chat_template(MESSAGES, tokenize=False,
                                                                            add_generation_prompt=True)
    assert ours.apply_chat_template(MESSAGES, tools=TOOLS) == saved.apply_chat_template(
        MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True)


def test_topology_override_wins_over_everything(tmp_path):
    model = tokenizer_dir(tmp_path / "model", {"chat_template": OTHER})
    (model / "chat_template.jinja").write_text(OTHER, encoding="utf-8")
    override = tmp_path / "mine.jinja"
    override.write_text(CHATML_TEMPLATE, encoding="utf-8")
    assert render(model, chat_template=override) == CHATML_PROMPT


def test_override_supplies_a_template_to_a_model_without_one(tmp_path):
    model = tokenizer_dir(tmp_path / "model")
    override = tmp_path / "mine.jinja"
    override.write_text(CHATML_TEMPLATE, encoding="utf-8")
    assert render(model, chat_template=override) == CHATML_PROMPT


def test_no_template_anywhere_is_one_clear_error(tmp_path):
    tokenizer = TextTokenizer.load(tokenizer_dir(tmp_path))
    with pytest.raises(ChatTemplateError) as info:
        tokenizer.apply_chat_template(MESSAGES)
    message = str(info.value)
    for place in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json", "chat_template: in the "
                  "topology file", "/v1/completions"):
        assert place in message


def test_special_tokens_reach_the_template(tmp_path):
    model = tokenizer_dir(tmp_path, {"chat_template": OTHER, "unk_token": {"content": "<unk>"}})
    assert render(model) == "OTHER 2 <|im_end|>"
    (model / "chat_template.jinja").write_text("{{ unk_token }}|{{ pad_token }}", encoding="utf-8")
    assert render(model) == "<unk>|<|endoftext|>"


def test_a_special_token_set_to_null_is_undefined_as_in_transformers(tmp_path):
    """Qwen's tokenizer_config.json sets bos_token and unk_token to null: a template reading them saw "None"."""
    template = "{{ bos_token }}{% if unk_token is defined %}unk{% endif %}{{ messages[0].content }}{{ eos_token }}"
    model = tokenizer_dir(tmp_path, {"chat_template": template, "unk_token": None,
                                     "tokenizer_class": "PreTrainedTokenizerFast"})
    theirs = AutoTokenizer.from_pretrained(str(model)).apply_chat_template(MESSAGES, tokenize=False,
                                                                            add_generation_prompt=True)
    assert render(model) == theirs == "Be brief.<|im_end|>"


@pytest.mark.parametrize(("layout", "phrase"), [
    ("bad json", "is not valid JSON"),
    ("json without key", "has no chat_template key"),
    ("bad list", r"chat_template\[0\] is not \{"),
    ("override syntax", "line 1"),
    ("override missing", "does not exist"),
])
def test_broken_template_files_fail_at_load(tmp_path, layout, phrase):
    model = tokenizer_dir(tmp_path / "model")
    override = None
    if layout == "bad json":
        (model / "chat_template.json").write_text("{", encoding="utf-8")
    elif layout == "json without key":
        (model / "chat_template.json").write_text("{}", encoding="utf-8")
    elif layout == "bad list":
        tokenizer_dir(model, {"chat_template": [{"name": "default"}]})
    elif layout == "override syntax":
        override = tmp_path / "bad.jinja"
        override.write_text("{% for m in messages %}", encoding="utf-8")
    else:
        override = tmp_path / "absent.jinja"
    with pytest.raises(TokenizerError, match=phrase):
        TextTokenizer.load(model, chat_template=override)


@pytest.mark.parametrize("template", [
    "{{ messages[0].content + 1 }}",  # TypeError inside the template
    "{{ messages[5].content }}{{ raise_exception('five messages at least') }}",
    "{{ messages[0].nope.deeper }}",  # undefined attribute of undefined
    "{{ 1 / 0 }}",
])
def test_template_failures_are_client_errors(template):
    with pytest.raises(ChatTemplateError):
        ChatTemplates({"default": template}, "test").render(MESSAGES)


def test_a_tool_schema_nested_past_python_s_recursion_is_a_client_error():
    """A request's JSON may nest nearly as deep as Python recurses; writing it with tojson, further down the
    stack, went past the limit: a RecursionError, the client's request answered as our 500."""
    template = Path(__file__).with_name("qwen25_chat_template.jinja").read_text(encoding="utf-8")
    parameters: dict = {}
    for _ in range(sys.getrecursionlimit()):
        parameters = {"a": parameters}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    with pytest.raises(ChatTemplateError, match="RecursionError"):
        ChatTemplates({"default": template}, "test").render(MESSAGES, tools=tools)


def test_several_templates_and_no_default_is_a_clear_error():
    templates = ChatTemplates({"a": "A", "b": "B"}, "somewhere")
    with pytest.raises(ChatTemplateError, match="named a, b and none is \"default\""):
        templates.render(MESSAGES)


def test_sandbox_refuses_reaching_python_internals():
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        ChatTemplates({"default": escape}, "test").render(MESSAGES)


def test_rendering_equals_transformers_with_tools_and_tool_calls():
    """Qwen2.5's template shape (tools, assistant tool_calls, tool results) renders as transformers does."""
    template = Path(__file__).with_name("qwen25_chat_template.jinja").read_text(encoding="utf-8")
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 21}"}]
    ours = ChatTemplates({"default": template}, "test").render(messages, tools=TOOLS)
    theirs = render_jinja_template([messages], tools=TOOLS, chat_template=template, add_generation_prompt=True)
    assert ours == theirs[0][0]
    assert "<tools>" in ours and "<tool_response>" in ours and '"arguments": {"city": "Paris"}' in ours


def test_chat_is_served_for_a_model_whose_template_is_only_in_chat_template_jinja(tmp_path):
    """The reported failure: a directory written by current transformers got a 400 "no chat template"."""
    model_dir = write_tiny_model(tmp_path, seed=0)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "chat_template.jinja").write_text(config.pop("chat_template"), encoding="utf-8")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    model, tokenizer = OurModel(model_dir), TextTokenizer.load(model_dir)
    service = GenerationService("tiny", tokenizer, Generator(model.head, tokenizer, model.pipeline(), torch.float32),
                                lambda: Readiness(1, ("w",), ()))
    reply = testing.TestClient(create_app(service)).simulate_post("/v1/chat/completions", json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 3, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json["usage"]["prompt_tokens"] == len(tokenizer.encode(CHATML_PROMPT))


def test_the_tokenizer_s_bos_once_in_a_chat_prompt_and_in_a_completion_prompt(tmp_path):
    """A tokenizer that adds a BOS itself, as Llama's and Gemma's tokenizer.json do, and a template that writes
    one too (Llama 3's): a chat prompt holds it once, and a completion's prompt gets it as transformers gives it."""
    model_dir = write_tiny_model(tmp_path, seed=0)
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens(["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
        special_tokens=[("<|begin_of_text|>", tokenizer.token_to_id("<|begin_of_text|>"))])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    template = (Path(__file__).parent / "chat_templates" / "llama3.jinja").read_text(encoding="utf-8")
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": template,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    theirs = AutoTokenizer.from_pretrained(str(model_dir))
    model, ours = OurModel(model_dir), TextTokenizer.load(model_dir)
    service = GenerationService("tiny", ours, Generator(model.head, ours, model.pipeline(), torch.float32),
                                lambda: Readiness(1, ("w",), ()))
    client = testing.TestClient(create_app(service))
    chat = client.simulate_post("/v1/chat/completions", json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 1, "temperature": 0})
    assert chat.status_code == 200, chat.text
    ids = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids.count(theirs.bos_token_id) == 1
    assert chat.json["usage"]["prompt_tokens"] == len(ids)
    completion = client.simulate_post("/v1/completions", json={
        "model": "tiny", "prompt": "Once upon", "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 0})
    assert completion.status_code == 200, completion.text
    ids = theirs("Once upon")["input_ids"]
    assert ids[0] == theirs.bos_token_id
    assert completion.json["usage"]["prompt_tokens"] == len(ids)
    assert completion.json["choices"][0]["logprobs"]["tokens"][0] == "<|begin_of_text|>"


def test_a_request_s_variables_reach_the_template_beside_its_own():
    templates = ChatTemplates({"default": "{{ messages | length }} {{ eos_token }} {{ mood | default('plain') }}"
                                          "{% if think is false %} no-think{% endif %}"},
                              "test", {"eos_token": "<|im_end|>"})
    assert templates.render(MESSAGES) == "2 <|im_end|> plain"
    assert templates.render(MESSAGES, variables={"mood": "terse", "think": False}) == "2 <|im_end|> terse no-think"


@pytest.mark.parametrize("name", ["messages", "tools", "add_generation_prompt", "eos_token", "mask_token",
                                  "raise_exception", "strftime_now", "range", "namespace", "self"])
def test_a_request_s_variable_cannot_replace_one_the_template_is_given(name):
    """The conversation, special tokens and helpers are the server's: a request's variable by one of their names
    would replace them (a `range` or `namespace` of its own breaks every template that loops or counts)."""
    with pytest.raises(ValueError, match=f"own variables cannot be given: {name}$"):
        ChatTemplates({"default": CHATML_TEMPLATE}, "test").render(MESSAGES, variables={name: 1})


CONTINUED = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


@pytest.mark.parametrize("template, content, expected_end", [
    # the template keeps the text as it is, trailing space and all: the model goes on after the space
    (CHATML_TEMPLATE, "Well, ", "<|im_start|>assistant\nWell, "),
    # a template that trims the text (Llama 3's) leaves no trailing space to go on after
    (CHATML_TEMPLATE.replace("message['content']", "(message['content'] | trim)"), " Well, ",
     "<|im_start|>assistant\nWell,"),
    # the text said earlier in the conversation too: the prompt ends at its last place, the final message
    ("{% for m in messages %}[{{ m.content }}]{% endfor %}", "Hi", "[Hi][Hi"),
])
def test_continuing_the_final_message_ends_the_prompt_where_its_text_does(template, content, expected_end):
    messages = [CONTINUED[0], {"role": "assistant", "content": content}]
    rendered = ChatTemplates({"default": template}, "test").render(messages, add_generation_prompt=False,
                                                                   continue_final_message=True)
    assert rendered.endswith(expected_end)
    theirs = render_jinja_template([messages], chat_template=template, continue_final_message=True)[0][0]
    assert rendered == theirs


@pytest.mark.parametrize("template, content", [
    ("{% for m in messages %}{{ m.role }}{% endfor %}", "Hello"),  # the template leaves the text out
    (CHATML_TEMPLATE.replace("message['content']", "(message['content'] | upper)"), "Hello"),  # changes it
    (CHATML_TEMPLATE, "  "),  # there is no text to continue
])
def test_a_final_message_with_no_place_to_continue_from_is_a_client_error(template, content):
    messages = [CONTINUED[0], {"role": "assistant", "content": content}]
    with pytest.raises(ChatTemplateError, match="continue_final_message"):
        ChatTemplates({"default": template}, "test").render(messages, add_generation_prompt=False,
                                                            continue_final_message=True)


def test_continuing_the_final_message_and_opening_a_turn_are_not_asked_at_once():
    with pytest.raises(ValueError, match="add_generation_prompt"):
        ChatTemplates({"default": CHATML_TEMPLATE}, "test").render(CONTINUED, continue_final_message=True)
