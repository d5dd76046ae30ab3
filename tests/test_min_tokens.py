"""`min_tokens` and `ignore_eos`: completions of a guaranteed length, whatever the model would rather do.

A tiny random model's continuation depends on its seed and on the CPU's rounding, so a test that needs a
completion of some length must not rely on the model not choosing EOS. These fields make that length a request
setting. To prove that EOS really is held off, the tests declare the token the model chooses first to be EOS:
a real tokenizer whose EOS is the model's own favourite.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from falcon import testing

from model_helpers import OurModel
from tc.generation import Generator
from tc.head.api import create_app
from tc.head.service import GenerationService, Readiness
from tc.model.tokenizer import TextTokenizer
from tc.sampling import SamplingParams, choose, new_rng

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> OurModel:
    return OurModel(tiny_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> TextTokenizer:
    return TextTokenizer.load(tiny_model_dir)


def first_choice(model: OurModel, tokenizer: TextTokenizer) -> int:
    """The token greedy decoding picks first for PROMPT."""
    generator = Generator(model.head, tokenizer, model.pipeline(), torch.float32)
    completion = generator.generate(tokenizer.encode(PROMPT), SamplingParams(max_tokens=1, temperature=0,
                                                                             ignore_eos=True))
    return completion.token_ids[0]


@pytest.fixture(scope="module")
def eos_first(model, tokenizer) -> tuple[Generator, int]:
    """A generator whose tokenizer calls the model's first greedy choice EOS, and that token."""
    favourite = first_choice(model, tokenizer)
    eager = dataclasses.replace(tokenizer, eos_token_ids=frozenset({favourite}))
    return Generator(model.head, eager, model.pipeline(), torch.float32), favourite


def test_without_min_tokens_the_declared_eos_ends_the_completion_at_once(eos_first):
    generator, _ = eos_first
    completion = generator.generate(generator.tokenizer.encode(PROMPT), SamplingParams(max_tokens=8, temperature=0))
    assert completion.token_ids == () and completion.finish_reason == "stop"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_holds_eos_off_until_reached(eos_first, temperature):
    generator, eos = eos_first
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=3, min_tokens=6)
    completion = generator.generate(generator.tokenizer.encode(PROMPT), params)
    assert len(completion.token_ids) >= 6
    assert eos not in completion.token_ids[:6]
    assert eos not in completion.token_ids  # an EOS after the minimum ends the completion instead of joining it
    assert completion.finish_reason == ("length" if len(completion.token_ids) == 12 else "stop")


def test_ignore_eos_keeps_the_eos_token_and_runs_to_max_tokens(eos_first):
    generator, eos = eos_first
    completion = generator.generate(generator.tokenizer.encode(PROMPT),
                                    SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
    assert completion.token_ids[0] == eos and len(completion.token_ids) == 7
    assert completion.finish_reason == "length"


def test_stop_strings_count_only_from_min_tokens(model, tokenizer):
    generator = Generator(model.head, tokenizer, model.pipeline(), torch.float32)
    prompt = tokenizer.encode(PROMPT)
    free = generator.generate(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    stop = free.text[:1]  # a stop string the free-running text starts with
    assert stop, "the tiny model's first token decodes to no text; pick another prompt"
    cut = generator.generate(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=(stop,)))
    assert cut.text == "" and cut.finish_reason == "stop"
    held = generator.generate(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=(stop,),
                                                     min_tokens=10))
    assert held.token_ids == free.token_ids and held.text == free.text and held.finish_reason == "length"


def test_choose_never_picks_a_banned_token():
    logits = torch.tensor([0.0, 5.0, 1.0, 4.0])
    greedy = SamplingParams(temperature=0)
    assert choose(logits, greedy, None, new_rng(0)) == 1
    assert choose(logits, greedy, None, new_rng(0), banned=frozenset({1})) == 3
    sampled = SamplingParams(temperature=1.0)
    picks = {choose(logits, sampled, None, new_rng(seed), banned={1, 3}) for seed in range(200)}
    assert picks <= {0, 2} and picks == {0, 2}


# --- the HTTP fields ---------------------------------------------------------------------------------------------

def ready() -> Readiness:
    return Readiness(1, ("w1",), ())


@pytest.fixture(scope="module")
def eos_first_client(eos_first) -> testing.TestClient:
    generator, _ = eos_first
    return testing.TestClient(create_app(GenerationService("tiny", generator.tokenizer, generator, ready)))


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
])
def test_http_min_tokens_and_ignore_eos(eos_first_client, route, body):
    base = {"model": "tiny", "max_tokens": 6, "temperature": 0, **body}
    if route == "/v1/completions":  # the prompt whose first choice was declared EOS
        plain = eos_first_client.simulate_post(route, json=base).json
        assert plain["usage"]["completion_tokens"] == 0 and plain["choices"][0]["finish_reason"] == "stop"
    for extra in ({"min_tokens": 6}, {"ignore_eos": True}):
        reply = eos_first_client.simulate_post(route, json={**base, **extra})
        assert reply.status_code == 200, reply.text
        assert reply.json["usage"]["completion_tokens"] == 6
        assert reply.json["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("route, body, default", [
    ("/v1/completions", {"prompt": PROMPT}, "it is 16 (OpenAI's default here)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
     "the room the messages leave in the context"),
])
def test_min_tokens_over_a_max_tokens_left_out_says_what_max_tokens_was_taken_to_be(eos_first_client, route, body,
                                                                                 default):
    """The request sent no max_tokens: the error says so, and where the number it is measured against comes from,
    rather than quote a max_tokens the client never sent."""
    reply = eos_first_client.simulate_post(route, json={"model": "tiny", "min_tokens": 10**6, **body})
    assert reply.status_code == 400 and reply.json["error"]["param"] == "min_tokens", reply.text
    message = reply.json["error"]["message"]
    assert "max_tokens, which the request leaves out" in message and default in message, message


@pytest.mark.parametrize("extra, message", [
    ({"min_tokens": -1}, "'min_tokens' must be at least 0"),
    ({"min_tokens": "3"}, "'min_tokens' must be an integer"),
    ({"min_tokens": 7}, "'min_tokens' (7) must not be more than max_tokens (6)"),
    ({"ignore_eos": 1}, "'ignore_eos' must be a boolean"),
])
def test_http_bad_values_are_400s_naming_the_field(eos_first_client, extra, message):
    reply = eos_first_client.simulate_post("/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                                    "max_tokens": 6, **extra})
    assert reply.status_code == 400
    assert message in reply.json["error"]["message"]
    assert reply.json["error"]["param"] == next(iter(extra))


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
])
def test_min_tokens_past_the_room_the_context_leaves_is_a_400(eos_first_client, eos_first, route, body):
    """A max_tokens past the context is cut to the room there is, and min_tokens with it was taken: the reply ran,
    EOS held off, to the context's end and was still short of it. It is refused, with the room there is."""
    context = eos_first[0].context_length
    reply = eos_first_client.simulate_post(route, json={"model": "tiny", "max_tokens": context, "min_tokens": context,
                                                        **body})
    assert reply.status_code == 400 and reply.json["error"]["param"] == "min_tokens", reply.text
    assert f"'min_tokens' ({context}) is more than the" in reply.json["error"]["message"]
    assert f"tokens the context ({context}) holds after the prompt's" in reply.json["error"]["message"]
