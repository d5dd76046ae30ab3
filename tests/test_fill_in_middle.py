"""Fill in the middle on /v1/completions: the prompt is wrapped in the model's FIM tokens around the suffix."""
from __future__ import annotations

import json

import pytest
import torch
from falcon import testing
from tokenizers import Tokenizer, processors

from model_helpers import OurModel
from tiny_model import SPECIAL_TOKENS, write_tiny_model
from tc.generation import Generator
from tc.head.api import create_app
from tc.head.fill_in_middle import FIM_MIDDLE, FIM_PREFIX, FIM_SPELLINGS, FIM_SUFFIX, FimTokens
from tc.head.service import GenerationService, Readiness
from tc.model.tokenizer import TextTokenizer
from tc.sampling import SamplingParams

FIM_IDS = {FIM_PREFIX: 259, FIM_SUFFIX: 260, FIM_MIDDLE: 261}  # after the byte tokens and the ChatML specials


def test_prompt_is_prefix_suffix_middle():
    tokens = FimTokens.find(FIM_IDS.get)
    assert tokens == FimTokens(259, 260, 261)
    assert tokens.prompt([1, 2], [3]) == [259, 1, 2, 260, 3, 261]
    assert tokens.prompt([1], []) == [259, 1, 260, 261]


def test_a_vocabulary_missing_any_fim_token_has_none():
    assert FimTokens.find({FIM_PREFIX: 1, FIM_SUFFIX: 2}.get) is None


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory):
    """The tiny model with the three FIM tokens added to its vocabulary."""
    model_dir = write_tiny_model(tmp_path_factory.mktemp("fim"), seed=0)
    data = json.loads((model_dir / "tokenizer.json").read_text())
    for text, token_id in FIM_IDS.items():
        data["added_tokens"].append({"id": token_id, "content": text, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    (model_dir / "tokenizer.json").write_text(json.dumps(data))
    tokenizer = TextTokenizer.load(model_dir)
    assert [tokenizer.token_id(t) for t in (*SPECIAL_TOKENS, *FIM_IDS)] == [256, 257, 258, 259, 260, 261]
    model = OurModel(model_dir)
    return Generator(model.head, tokenizer, model.pipeline(), torch.float32)


def test_suffix_completes_the_middle(fim_model):
    service = GenerationService("tiny", fim_model.tokenizer, fim_model, lambda: Readiness(1, ("w",), ()))
    client = testing.TestClient(create_app(service))
    reply = client.simulate_post("/v1/completions", json={"model": "tiny", "prompt": "def f(x):\n    ",
                                                          "suffix": "\n\nf(1)\n", "max_tokens": 6,
                                                          "temperature": 0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    tok = fim_model.tokenizer
    ids = [259, *tok.encode("def f(x):\n    "), 260, *tok.encode("\n\nf(1)\n"), 261]
    expected = fim_model.generate(ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert reply.json["choices"][0]["text"] == expected.text
    assert reply.json["usage"]["prompt_tokens"] == len(ids)
    # token-id prompts are wrapped the same way
    reply = client.simulate_post("/v1/completions", json={"model": "tiny", "prompt": tok.encode("def f(x):\n    "),
                                                          "suffix": "\n\nf(1)\n", "max_tokens": 6,
                                                          "temperature": 0, "ignore_eos": True})
    assert reply.json["choices"][0]["text"] == expected.text


def test_a_prefix_or_suffix_that_spells_a_special_token_is_read_as_its_characters(fim_model):
    """Code that names "<|fim_middle|>" (an editor filling in the middle of a FIM prompt builder) became the token
    itself, and the model read the middle to be at the wrong place; the prefix and suffix are now plain text."""
    service = GenerationService("tiny", fim_model.tokenizer, fim_model, lambda: Readiness(1, ("w",), ()))
    client = testing.TestClient(create_app(service))
    tok = fim_model.tokenizer
    prefix, suffix = 'MIDDLE = "<|fim_middle|>"\n', '\nEND = "<|fim_suffix|><|endoftext|>"\n'
    reply = client.simulate_post("/v1/completions", json={"model": "tiny", "prompt": prefix, "suffix": suffix,
                                                          "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    ids = [259, *tok.encode_literal(prefix), 260, *tok.encode_literal(suffix), 261]
    assert len(tok.encode_literal(prefix)) == len(prefix.encode()) and not set(ids[1:-1]) & {256, 257, 258, 261}
    assert reply.json["usage"]["prompt_tokens"] == len(ids)
    expected = fim_model.generate(ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert reply.json["choices"][0]["text"] == expected.text
    assert tok.encode("<|fim_middle|>") == [261]  # the shared tokenizer reads the token, where a template writes it


@pytest.mark.parametrize("spelling, bos", [(FIM_SPELLINGS[1], False), (FIM_SPELLINGS[2], True)],
                         ids=["starcoder", "deepseek-coder"])
def test_the_other_families_spellings_fill_in_the_middle_after_the_bos_a_text_gets(tmp_path, spelling, bos):
    """StarCoder's and Granite Code's <fim_prefix>, DeepSeek-Coder's <｜fim▁begin｜> (whose tokenizer starts every
    text with its BOS, which it was trained to read first here too): the module named them, and a suffix was a
    400 for them."""
    model_dir = write_tiny_model(tmp_path, seed=0)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    data = json.loads(tokenizer.to_str())
    for text, token_id in zip(spelling, (259, 260, 261)):
        data["added_tokens"].append({"id": token_id, "content": text, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    tokenizer = Tokenizer.from_str(json.dumps(data))
    if bos:  # the BOS a text starts with: <|endoftext|> (256) stands in for DeepSeek's
        tokenizer.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                                 special_tokens=[("<|endoftext|>", 256)])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    model = OurModel(model_dir)
    generator = Generator(model.head, TextTokenizer.load(model_dir), model.pipeline(), torch.float32)
    service = GenerationService("tiny", generator.tokenizer, generator, lambda: Readiness(1, ("w",), ()))
    reply = testing.TestClient(create_app(service)).simulate_post("/v1/completions", json={
        "model": "tiny", "prompt": "def f(x):\n    ", "suffix": "\n\nf(1)\n", "max_tokens": 4, "temperature": 0,
        "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    tok = generator.tokenizer
    ids = [*([256] if bos else []), 259, *tok.encode("def f(x):\n    "), 260, *tok.encode("\n\nf(1)\n"), 261]
    assert reply.json["usage"]["prompt_tokens"] == len(ids)
    expected = generator.generate(ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert reply.json["choices"][0]["text"] == expected.text


# What an editor's autocomplete sends a Qwen2.5-Coder as stop strings beside its fill-in-the-middle prompt: more than
# the 4 OpenAI takes
CODER_STOPS = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
               "<|file_sep|>", "<|im_start|>", "<|im_end|>"]


def test_an_editors_autocomplete_request_with_its_nine_stop_strings_is_served(fim_model):
    service = GenerationService("tiny", fim_model.tokenizer, fim_model, lambda: Readiness(1, ("w",), ()))
    client = testing.TestClient(create_app(service))
    body = {"model": "tiny", "prompt": "def f(x):\n    ", "suffix": "\n\nf(1)\n", "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    plain = client.simulate_post("/v1/completions", json=body)
    stopped = client.simulate_post("/v1/completions", json={**body, "stop": CODER_STOPS})
    assert stopped.status_code == 200, stopped.text
    # none of them is in the text (the special tokens are left out of it), so the text is the one without them
    assert stopped.json["choices"][0]["text"] == plain.json["choices"][0]["text"]
    text = plain.json["choices"][0]["text"]
    if len(text) > 1:  # and one of them that is in it cuts it there
        cut = client.simulate_post("/v1/completions", json={**body, "stop": [*CODER_STOPS, text[1:]]})
        assert cut.json["choices"][0]["text"] == text[:text.index(text[1:])]
