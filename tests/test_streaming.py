"""Streaming: text released by the generation loop, server-sent events in OpenAI's chunk shapes, the official
client's stream iterators, and a client that goes away mid-stream."""
from __future__ import annotations

import dataclasses
import json
import logging
import socket
import threading
import time

import openai
import pytest
import torch
from falcon import testing

from model_helpers import LosesWorkerAtDecode, OurModel
from tiny_model import sentencepiece_tokenizer
from tc.generation import (CompletionText, Generator, LocalPipeline, SequenceState, find_stop, held_back,
                           text_with_offsets)
from tc.head import responses, streaming
from tc.head.api import create_app
from tc.head.http_server import start_http_server
from tc.head.service import GenerationService, Readiness, WorkerLost
from tc.model.tokenizer import TextTokenizer
from tc.sampling import SamplingParams

MODEL = "tiny"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def ready() -> Readiness:
    return Readiness(1, ("w1",), ())


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> OurModel:
    return OurModel(tiny_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> TextTokenizer:
    return TextTokenizer.load(tiny_model_dir)


@pytest.fixture(scope="module")
def generator(model, tokenizer) -> Generator:
    return Generator(model.head, tokenizer, model.pipeline(), torch.float32)


@pytest.fixture(scope="module")
def client(generator) -> testing.TestClient:
    return testing.TestClient(create_app(GenerationService(MODEL, generator.tokenizer, generator, ready)))


def sse_events(body: bytes) -> list[object]:
    """The data of each event in an SSE body: parsed JSON, or the string "[DONE]". Comments are skipped."""
    events = []
    for block in body.decode().split("\n\n"):
        data = [line[len("data: "):] for line in block.split("\n") if line.startswith("data: ")]
        if data:
            text = "\n".join(data)
            events.append(text if text == "[DONE]" else json.loads(text))
    return events


def stream_post(client: testing.TestClient, path: str, body: dict) -> list[object]:
    result = client.simulate_post(path, json={**body, "stream": True})
    assert result.status_code == 200, result.text
    assert result.headers["content-type"] == "text/event-stream"
    events = sse_events(result.content)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


# --- the text the loop releases, pure -------------------------------------------------------------------------

def byte_tokens(tokenizer: TextTokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: the tiny tokenizer has no merges, so every multi-byte character is split."""
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode())
    return ids


def run_text(tokenizer: TextTokenizer, ids: list[int], stops: tuple[str, ...]) -> tuple[list[str], str]:
    """Push `ids` one by one as the loop does; return the released pieces and the final text."""
    state = CompletionText(tokenizer, stops)
    pieces = []
    for token in ids:
        state.push(token, None)
        if state.stop_at is not None:
            break
        pieces.append(state.release().text)
    final, rest, _ = state.finish()
    return pieces + [rest], final


@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキスト", "emoji 🙂 and ünïcödé", "a\u0301b"])
def test_multi_byte_characters_are_never_released_broken(tokenizer, text):
    pieces, final = run_text(tokenizer, byte_tokens(tokenizer, text), ())
    assert "".join(pieces) == final == text
    assert all("\ufffd" not in p for p in pieces)
    # a character of n bytes shows up whole, once its last byte is in
    assert sum(1 for p in pieces if p) == len(text)


@pytest.mark.parametrize("text, stops, final", [
    ("abENxENDyy", ("END",), "abENx"),
    ("abcd", ("cx", "bcd"), "a"),
    ("x日本y", ("本y",), "x日"),
    ("one\n\ntwo", ("\n\n",), "one"),
    ("no stop here", ("zzz",), "no stop here"),
    ("stop at the start", ("stop",), ""),
])
def test_stop_strings_never_leak_into_a_released_piece(tokenizer, text, stops, final):
    pieces, got = run_text(tokenizer, byte_tokens(tokenizer, text), stops)
    assert got == final and "".join(pieces) == final
    shown = ""
    for piece in pieces:
        shown += piece
        # nothing released is the start of a stop string that the text then completed
        assert not any(s in shown for s in stops)


def test_partial_stop_prefixes_are_held_only_while_they_may_complete(tokenizer):
    state = CompletionText(tokenizer, ("END",))
    released = []
    for token in byte_tokens(tokenizer, "xEN"):
        state.push(token, None)
        released.append(state.release().text)
    assert released == ["x", "", ""]  # "E" and "EN" may yet become "END"
    state.push(byte_tokens(tokenizer, "!")[0], None)  # not a "D": "EN" was plain text after all
    assert state.release().text == "EN!"


class CountingStop(str):
    """A stop string that counts how often its characters are read (each index or slice)."""

    reads = 0

    def __getitem__(self, key):
        self.reads += 1
        return super().__getitem__(key)


def test_text_already_shown_is_not_read_again_for_the_start_of_a_stop_string(tokenizer):
    """held_back read every end of the whole text up to a stop string's length, at every token: a request with
    32 stop strings of 30k characters (a 1 MiB body holds them) took the scheduler 30 ms a token once its text
    was 16k characters long, for every sequence in the batch. Only what is not shown yet can start one."""
    stop = CountingStop("q" + "ab" * 2000)
    state = CompletionText(tokenizer, (stop,))
    text, pieces, reads = "hello world " * 50 + "qabab!", [], []
    for token in byte_tokens(tokenizer, text):
        before = stop.reads
        state.push(token, None)
        pieces.append(state.release().text)
        reads.append(stop.reads - before)
    assert pieces[-6:] == ["", "", "", "", "", "qabab!"]  # held while it may start the stop string
    assert "".join(pieces) == text
    assert max(reads) <= 2 * len("qabab!")  # before: more than the text has characters (902 for its 606)


def test_held_back_and_find_stop():
    assert held_back("abc", ("cde",)) == 1 and held_back("abcd", ("cde",)) == 2
    assert held_back("abc", ("xyz",)) == 0 and held_back("", ("a",)) == 0
    assert held_back("aaa", ("aab",)) == 2
    assert find_stop("xxENDyEND", ("END",), 0) == 2 and find_stop("xxENDyEND", ("END",), 3) == 6
    assert find_stop("abc", ("c", "b"), 0) == 1 and find_stop("abc", (), 0) is None


def test_tokens_are_released_with_their_text(tokenizer):
    ids = byte_tokens(tokenizer, "a日b")  # 1 + 3 + 1 bytes
    state = CompletionText(tokenizer, ())
    per_step = []
    for token in ids:
        state.push(token, None)
        per_step.append([t.id for t in state.release().tokens])
    assert per_step == [[ids[0]], [], [], ids[1:4], [ids[4]]]
    assert [t.offset for t in state.tokens] == [0, 1, 1, 1, 2]


class CountingTokenizer(TextTokenizer):
    """The real tokenizer, counting the token ids it decodes."""

    decoded = 0

    def decode(self, ids, skip_special_tokens: bool = True, kept: frozenset[int] = frozenset()) -> str:
        self.decoded += len(ids)
        return super().decode(ids, skip_special_tokens, kept)


def test_text_of_u_fffd_goes_out_as_it_comes_and_decodes_each_token_a_bounded_number_of_times(tokenizer):
    """U+FFFD in the text itself (mojibake: the character, or bytes that never make one) is not a character cut
    short: it goes out a few tokens behind, and each token is decoded a bounded number of times. Before, the
    decoder held it all until a whole other character came, decoding every held token again at each one: an
    echoed prompt of 30k of them kept the head busy for a minute, and a stream of them showed nothing."""
    counting = CountingTokenizer(**{f.name: getattr(tokenizer, f.name) for f in dataclasses.fields(tokenizer)})
    ids = byte_tokens(tokenizer, "ok " + "\ufffd" * 600) + [byte_tokens(tokenizer, "\x80")[1]] * 600
    assert tokenizer.decode(ids[-600:]) == "\ufffd" * 600  # a lone continuation byte reads as U+FFFD
    whole, offsets = text_with_offsets(counting, ids)
    assert whole == tokenizer.decode(ids) == "ok " + "\ufffd" * 1200
    assert counting.decoded < 40 * len(ids)  # it was about len(ids) ** 2 / 2
    # each token's offset is where its character starts, or at most a few characters before (held while its
    # text might yet be a character cut short, which spans at most 4 tokens); before, every one of them was 3
    starts = [*range(3), *(3 + i // 3 for i in range(1800)), *range(603, 1203)]
    assert offsets == sorted(offsets)
    assert all(start - 4 <= offset <= start for offset, start in zip(offsets, starts))

    state = CompletionText(tokenizer, ())
    shown = ""
    for token in ids[-600:]:
        state.push(token, None)
        shown += state.release().text
    assert len(shown) >= 600 - 4  # a character's bytes span at most 4 tokens
    assert shown + state.finish()[1] == "\ufffd" * 600


@pytest.fixture(scope="module")
def qwen_tokenizer(demo_model_dir) -> TextTokenizer:
    """The demo model's byte-level BPE tokenizer, whose merges split some characters across tokens."""
    return TextTokenizer.load(demo_model_dir)


SPLIT_TEXT = "ab🦜日本🜀!"  # 🦜 is two tokens there (F09FA6 + 9C), 🜀 three (F09F + 9C + 80)


@pytest.mark.parametrize("stops", [(), ("zz", "🜀!")])
def test_a_completion_cut_inside_a_character_ends_as_the_tokenizer_decodes_it(qwen_tokenizer, stops):
    ids = qwen_tokenizer.encode(SPLIT_TEXT)
    cut_inside = 0
    for end in range(1, len(ids) + 1):
        pieces, final = run_text(qwen_tokenizer, ids[:end], stops)
        whole = qwen_tokenizer.decode(ids[:end])  # a broken last character reads U+FFFD
        cut = whole.find("🜀!") if stops else -1  # the one stop string this text spells, at its very end
        expected = whole if cut < 0 else whole[:cut]
        assert final == expected and "".join(pieces) == final, (end, stops)
        cut_inside += whole.endswith("\ufffd")
    assert cut_inside == 3  # after 🦜's first token and after 🜀's first and second


def test_a_stop_string_in_the_text_of_a_broken_character_s_tokens_cuts_the_reply(qwen_tokenizer):
    ids = qwen_tokenizer.encode("Hi 🦜")
    assert qwen_tokenizer.decode(ids[:2]) == "Hi \ufffd"  # the second token is " " and the emoji's first bytes
    sequence = SequenceState(1, qwen_tokenizer.encode("Say hi"), SamplingParams(max_tokens=2, stop=(" ",)),
                             qwen_tokenizer, context_length=64)
    steps = [sequence.add_token(token) for token in ids[:2]]
    completion = steps[-1].completion
    assert completion is not None and (completion.text, completion.finish_reason) == ("Hi", "stop")
    assert "".join(step.text for step in steps) == "Hi"


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory) -> TextTokenizer:
    """Llama 2's kind of tokenizer: a character no piece spells is byte tokens, which decode as one run."""
    path = tmp_path_factory.mktemp("sentencepiece")
    sentencepiece_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return TextTokenizer.load(path)


def test_a_completion_cut_after_byte_tokens_of_a_whole_character_keeps_that_character(sentencepiece):
    ids = sentencepiece.encode("the 日本")  # 日 and 本 are three byte tokens each
    assert len(ids) == 8
    pieces, final = run_text(sentencepiece, ids[:-1], ())  # 本's last byte never comes
    # 日 went out whole; what is left is 本's two bytes, as they decode: U+FFFD for each (ByteFallback's way)
    assert final == "".join(pieces) == "the 日" + sentencepiece.decode(ids[-3:-1]) == "the 日\ufffd\ufffd"


# --- the generator: one loop for both ------------------------------------------------------------------------

@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=30, temperature=0),
    SamplingParams(max_tokens=30, temperature=0, logprobs=3),
    SamplingParams(max_tokens=30, temperature=0.9, seed=7, top_k=40),
    SamplingParams(max_tokens=30, temperature=0, stop=("\x10",), logprobs=0),
])
def test_stream_steps_join_to_the_completion(generator, tokenizer, params):
    prompt_ids = tokenizer.encode("Say this is a test")
    steps = list(generator.stream(prompt_ids, params))
    completion = steps[-1].completion
    assert completion is not None and all(s.completion is None for s in steps[:-1])
    assert "".join(s.text for s in steps) == completion.text
    assert tuple(t for s in steps for t in s.tokens) == completion.tokens
    assert tuple(t.id for t in completion.tokens) == completion.token_ids
    # one step per pipeline call: the prefill gives the first token, each decode the next (EOS takes one more)
    count = completion.completion_tokens
    assert len(steps) == count or (completion.finish_reason == "stop" and len(steps) == count + 1)
    whole = generator.generate(prompt_ids, params)
    assert (whole.text, whole.token_ids, whole.finish_reason) == (completion.text, completion.token_ids,
                                                                  completion.finish_reason)


def test_closing_a_stream_early_leaves_the_generator_usable(generator, tokenizer):
    prompt_ids = tokenizer.encode("Hello")
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)  # at least the two steps taken below
    expected = generator.generate(prompt_ids, params)
    steps = generator.stream(prompt_ids, params)
    next(steps), next(steps)
    steps.close()
    assert generator.generate(prompt_ids, params).token_ids == expected.token_ids


# --- server-sent events through the app ------------------------------------------------------------------------

def joined_text(events: list[dict], key: str) -> str:
    if key == "text":
        return "".join(e["choices"][0]["text"] for e in events if e["choices"])
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])


@pytest.mark.parametrize("prompt, extra", [
    ("Say this is a test", {}),
    ("Hello", {"stop": ["\x10", "zz"]}),
    ("abc", {"max_tokens": 1}),
])
def test_streamed_completion_equals_the_whole_one(client, prompt, extra):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}
    whole = client.simulate_post(COMPLETIONS, json=body).json
    events = stream_post(client, COMPLETIONS, body)
    ids = {e["id"] for e in events}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    assert all(e["object"] == "text_completion" and e["model"] == MODEL and "usage" not in e for e in events)
    assert joined_text(events, "text") == whole["choices"][0]["text"]
    assert [e["choices"][0]["finish_reason"] for e in events][:-1] == [None] * (len(events) - 1)
    assert events[-1]["choices"][0] == {"text": "", "index": 0, "logprobs": None,
                                        "finish_reason": whole["choices"][0]["finish_reason"]}


def test_streamed_chat_equals_the_whole_one_and_reports_usage(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 10,
            "temperature": 0, "ignore_eos": True}
    whole = client.simulate_post(CHAT, json=body).json
    events = stream_post(client, CHAT, {**body, "stream_options": {"include_usage": True}})
    assert all(e["object"] == "chat.completion.chunk" and e["id"].startswith("chatcmpl-") for e in events)
    assert len({e["id"] for e in events}) == 1 and len({e["created"] for e in events}) == 1
    first, last, usage = events[0], events[-2], events[-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    assert all(e["usage"] is None for e in events[:-1])
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert joined_text(events, "content") == whole["choices"][0]["message"]["content"]
    # OpenAI's padding against reading a reply's length off the wire, asked for or not: tc's chunks carry none
    for obfuscation in (False, True):
        padded = stream_post(client, CHAT, {**body, "stream_options": {"include_usage": True,
                                                                       "include_obfuscation": obfuscation}})
        assert [{k: v for k, v in e.items() if k not in ("id", "created")} for e in padded] == \
            [{k: v for k, v in e.items() if k not in ("id", "created")} for e in events]


def test_streamed_logprobs_join_to_the_whole_ones(client):
    body = {"model": MODEL, "prompt": "Say this is a test", "max_tokens": 12, "temperature": 0, "logprobs": 2,
            "ignore_eos": True}
    whole = client.simulate_post(COMPLETIONS, json=body).json["choices"][0]["logprobs"]
    events = stream_post(client, COMPLETIONS, body)
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"] is not None]
    joined = {key: [v for p in parts for v in p[key]] for key in whole}
    assert joined == whole and len(whole["tokens"]) == 12
    chat_body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                 "temperature": 0, "logprobs": True, "top_logprobs": 3, "ignore_eos": True}
    whole = client.simulate_post(CHAT, json=chat_body).json["choices"][0]["logprobs"]
    events = stream_post(client, CHAT, chat_body)
    content = [c for e in events if e["choices"][0]["logprobs"] for c in e["choices"][0]["logprobs"]["content"]]
    assert content == whole["content"] and len(content) == 8


def test_streamed_echo_starts_with_the_prompt(client, tokenizer):
    body = {"model": MODEL, "prompt": "Say this", "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 1}
    whole = client.simulate_post(COMPLETIONS, json=body).json["choices"][0]
    assert whole["text"].startswith("Say this")
    events = stream_post(client, COMPLETIONS, body)
    assert events[0]["choices"][0]["text"] == "Say this"
    assert events[0]["choices"][0]["logprobs"]["tokens"][0] == "S"
    assert joined_text(events, "text") == whole["text"]
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"] is not None]
    assert [v for p in parts for v in p["text_offset"]] == whole["logprobs"]["text_offset"]


def cut_inside_a_character(generator: Generator, prompt_ids: list[int], most: int = 24) -> list[int]:
    """The greedy completion's first tokens up to the first that leaves its text inside a character (its decoded
    text ends in U+FFFD), found here rather than written down: which tokens a random model chooses may differ
    with a CPU's rounding."""
    ids = list(generator.generate(prompt_ids, SamplingParams(max_tokens=most, temperature=0)).token_ids)
    for count in range(1, len(ids) + 1):
        if generator.tokenizer.decode(ids[:count]).endswith("\ufffd"):
            return ids[:count]
    raise AssertionError(f"no greedy completion of {most} tokens ends inside a character here: {ids}")


def texts_by_choice(events: list[dict], key: str) -> dict[int, str]:
    joined: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            piece = choice["text"] if key == "text" else choice["delta"].get("content", "")
            joined[choice["index"]] = joined.get(choice["index"], "") + piece
    return joined


def a_stop_not_in(text: str) -> str:
    """A non-ASCII stop string that `text` does not hold (so it cuts nothing, but is looked for)."""
    return next(stop for stop in ("é", "ü", "ñ", "ß") if stop not in text)


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}, {"stop": "non-ASCII"}, {"n": 2}, {"echo": True}])
def test_a_completion_cut_inside_a_character_keeps_it(client, generator, tokenizer, extra):
    prompt = "Say this is a test"
    ids = cut_inside_a_character(generator, tokenizer.encode(prompt))
    expected = tokenizer.decode(ids)  # its last character broken: U+FFFD
    if "stop" in extra:
        extra = {"stop": ["zz", a_stop_not_in(expected)]}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": len(ids), "temperature": 0, **extra}
    if extra.get("echo"):
        expected = prompt + expected
    whole = client.simulate_post(COMPLETIONS, json=body).json
    assert [c["text"] for c in whole["choices"]] == [expected] * extra.get("n", 1)
    events = stream_post(client, COMPLETIONS, {**body, "stream_options": {"include_usage": True}})
    assert texts_by_choice(events, "text") == {i: expected for i in range(extra.get("n", 1))}
    assert events[-1]["usage"] == whole["usage"]
    if "logprobs" in extra:  # the last token's text starts where the text before it, whole, ends
        assert whole["choices"][0]["logprobs"]["text_offset"][-1] == len(tokenizer.decode(ids[:-1]))


@pytest.mark.parametrize("extra", [{}, {"logprobs": True}, {"stop": ["zz"]}, {"n": 2}])
def test_a_chat_reply_cut_inside_a_character_keeps_it(client, generator, tokenizer, extra):
    messages = [{"role": "user", "content": "Hi there"}]
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    ids = cut_inside_a_character(generator, prompt_ids)
    expected = tokenizer.decode(ids)
    body = {"model": MODEL, "messages": messages, "max_tokens": len(ids), "temperature": 0, **extra}
    whole = client.simulate_post(CHAT, json=body).json
    assert [c["message"]["content"] for c in whole["choices"]] == [expected] * extra.get("n", 1)
    events = stream_post(client, CHAT, body)
    assert texts_by_choice(events, "content") == {i: expected for i in range(extra.get("n", 1))}


def test_stream_that_fails_midway_ends_with_an_error_event(model, tokenizer):
    generator = Generator(model.head, tokenizer, LosesWorkerAtDecode(model.stages), torch.float32)
    client = testing.TestClient(create_app(GenerationService(MODEL, tokenizer, generator, ready)))
    result = client.simulate_post(COMPLETIONS, json={"model": MODEL, "prompt": "Hello", "max_tokens": 10,
                                                     "ignore_eos": True, "stream": True})
    assert result.status_code == 200
    events = sse_events(result.content)
    assert "[DONE]" not in events
    assert events[-1]["error"]["type"] == "worker_lost" and "w1" in events[-1]["error"]["message"]
    # its place was given back: the next request runs
    assert client.simulate_post(COMPLETIONS, json={"model": MODEL, "prompt": "Hello", "max_tokens": 2}
                                ).status_code == 200


# --- a live server: the openai client, and a client that goes away -----------------------------------------------

class SlowPipeline(LocalPipeline):
    """The real stages with a pause per decode step, so a generation lasts long enough to walk away from."""

    def __init__(self, stages, pause_s: float):
        super().__init__(stages)
        self.pause_s = pause_s
        self.steps: list[tuple[int, ...]] = []  # the sequences of each step

    def run(self, entries, hidden):
        self.steps.append(tuple(e.sequence for e in entries))
        time.sleep(self.pause_s)
        return super().run(entries, hidden)


@pytest.fixture(scope="module")
def slow(model, tokenizer):
    pipeline = SlowPipeline(model.stages, pause_s=0.05)
    generator = Generator(model.head, tokenizer, pipeline, torch.float32)
    service = GenerationService(MODEL, tokenizer, generator, ready)
    server = start_http_server(create_app(service), "127.0.0.1", 0, threads=4)
    yield server, service, pipeline
    server.stop()


@pytest.fixture(scope="module")
def live(generator):
    server = start_http_server(create_app(GenerationService(MODEL, generator.tokenizer, generator, ready)),
                               "127.0.0.1", 0, threads=4)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def openai_client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_openai_client_streams_completions(openai_client):
    whole = openai_client.completions.create(model=MODEL, prompt="Say this is a test", max_tokens=10,
                                             temperature=0, extra_body={"ignore_eos": True})
    chunks = list(openai_client.completions.create(model=MODEL, prompt="Say this is a test", max_tokens=10,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                   stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 10


def test_openai_client_streams_chat(openai_client):
    messages = [{"role": "user", "content": "Hello"}]
    whole = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                  logprobs=True, top_logprobs=2)
    stream = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                   logprobs=True, top_logprobs=2, stream=True,
                                                   stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob, t.bytes) for t in streamed] == \
        [(t.token, t.logprob, t.bytes) for t in whole.choices[0].logprobs.content]
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_openai_client_raises_on_a_mid_stream_error_event(model, tokenizer):
    class LosingPipeline(LocalPipeline):
        def run(self, entries, hidden):
            if entries[0].start > 0:
                raise WorkerLost("w2", "no heartbeat for 9.0s")
            return super().run(entries, hidden)

    generator = Generator(model.head, tokenizer, LosingPipeline(model.stages), torch.float32)
    server = start_http_server(create_app(GenerationService(MODEL, tokenizer, generator, ready)), "127.0.0.1", 0,
                               threads=2)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, stream=True,
                                           extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError, match="worker w2 was lost"):
            list(stream)
    finally:
        server.stop()


def read_sse_events(sock: socket.socket, count: int) -> bytes:
    """Read from a raw HTTP response until `count` data events have arrived."""
    received = b""
    while received.count(b"\ndata: ") + received.startswith(b"data: ") < count:
        chunk = sock.recv(4096)
        assert chunk, received
        received += chunk
    return received


def test_a_client_that_goes_away_frees_the_cluster(slow, caplog):
    server, service, pipeline = slow
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 200, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    with caplog.at_level(logging.INFO, logger="tc.head.api"):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        head = read_sse_events(sock, 3)
        assert head.startswith(b"HTTP/1.1 200 ") and b"text/event-stream" in head
        abandoned = pipeline.steps[-1][0]
        steps_when_gone = len(pipeline.steps)
        sock.close()  # walk away with ~190 tokens (~10 s of decoding) still to come
        gone_at = time.perf_counter()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)
        reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0,
                                          extra_body={"ignore_eos": True})
        waited = time.perf_counter() - gone_at
        deadline = time.monotonic() + 10
        while service.running:
            assert time.monotonic() < deadline, "the abandoned generation kept running"
            time.sleep(0.01)
    assert reply.usage.completion_tokens == 2
    # The server learns the client is gone when a write fails, and the sequence leaves the batch at the next step.
    # A write fails only after the kernel has taken one more into its buffer and the peer's reset has come back,
    # and Waitress reports it from its own thread: 2 steps on a quiet machine (one already running at the close),
    # 4 seen on one busy with other tests. Either way far from the ~190 the generation had left.
    abandoned_steps = sum(abandoned in step for step in pipeline.steps[steps_when_gone:])
    assert abandoned_steps <= 6, abandoned_steps
    assert waited < 2.0, waited
    assert service.running == 0 and service.queue_depth == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "tc.head.api"]
    assert any(" finish=abandoned " in line for line in lines), lines


def post_stream(port: int, body: dict) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def test_a_stream_queued_behind_a_full_batch_is_answered_at_once_and_leaves_when_its_client_does(
        model, tokenizer, monkeypatch):
    """A queued stream sent nothing, not even its status line, until its first token: behind a batch of long
    generations a proxy (60 s) or a client's headers timeout gave up on it. Now the status line and a comment go
    out after IDLE_KEEPALIVE_S, and its client leaving frees its place in the queue at once."""
    monkeypatch.setattr(streaming, "IDLE_KEEPALIVE_S", 0.2)
    pipeline = SlowPipeline(model.stages, pause_s=0.05)
    service = GenerationService(MODEL, tokenizer, Generator(model.head, tokenizer, pipeline, torch.float32), ready,
                                max_batch=1)
    server = start_http_server(create_app(service), "127.0.0.1", 0, threads=4)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    running = post_stream(server.port, body)
    queued = None
    try:
        read_sse_events(running, 2)  # in the batch, ~10 s of decoding to come
        queued = post_stream(server.port, body)
        head = b""
        while streaming.KEEPALIVE not in head.partition(b"\r\n\r\n")[2]:  # the body's first (chunked) bytes
            chunk = queued.recv(4096)
            assert chunk, head
            head += chunk
        assert head.startswith(b"HTTP/1.1 200 ") and b"data:" not in head
        assert service.queue_depth == 1 and service.running == 1
        queued.close()
        deadline = time.monotonic() + 5
        while service.queue_depth:
            assert time.monotonic() < deadline, "the stream left the queue, yet its request stayed in it"
            time.sleep(0.05)
        assert service.running == 1  # the first one runs on
    finally:
        running.close()
        if queued is not None:
            queued.close()
        server.stop()


def test_concurrent_streams_run_together_and_each_gets_its_own_text(slow):
    server, _, pipeline = slow
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    prompts = ["Hello", "def f(x):", "Once upon"]
    texts: dict[str, str] = {}
    errors: list[BaseException] = []

    def ask(prompt: str) -> None:
        try:
            chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            texts[prompt] = "".join(c.choices[0].text for c in chunks)
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    solo = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in prompts}
    before = len(pipeline.steps)
    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and texts == solo
    assert max(len(step) for step in pipeline.steps[before:]) == 3  # all three in one step: a batch


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1e", "\r", "\n"])
def test_an_event_is_one_line_for_every_reader(char):
    """Text with a character that str.splitlines (and so requests' iter_lines) ends a line at stays one line of
    the stream, and reads back the same: U+2028, U+2029 and U+0085 went out raw and split the JSON."""
    from tc.head.streaming import sse

    event = sse({"text": f"a{char}b", "n": 1})
    assert event.endswith(b"\n\n") and len(event[:-2].decode().splitlines()) == 1
    assert json.loads(event[len(b"data: "):-2]) == {"text": f"a{char}b", "n": 1}


class PausingPipeline(LocalPipeline):
    """The real stages, with one step (the `at`-th run, from 1) waiting `pause_s` first, as a step waits through a
    lost worker's resume grace period."""

    def __init__(self, stages, at: int, pause_s: float):
        super().__init__(stages)
        self.at, self.pause_s, self.runs = at, pause_s, 0

    def run(self, entries, hidden):
        self.runs += 1
        if self.runs == self.at:
            time.sleep(self.pause_s)
        return super().run(entries, hidden)


@pytest.mark.parametrize("path", [COMPLETIONS, "/v1/responses"])
@pytest.mark.parametrize("at", [1, 2], ids=["first step", "later step"])
def test_a_stream_whose_step_waits_long_writes_keep_alives_meanwhile(model, tokenizer, monkeypatch, path, at):
    """A keep-alive went out between steps only: a step that waited (a resume's grace period, up to minutes) left
    the stream silent, and a proxy's idle timeout (nginx's 60 s) cut it. Now one goes out each time
    IDLE_KEEPALIVE_S passes without a step. The first step too (a long prompt read, or a queue behind a full
    batch): nothing at all went out before it, not even the status line."""
    monkeypatch.setattr(streaming, "IDLE_KEEPALIVE_S", 0.1)
    monkeypatch.setattr(responses, "IDLE_KEEPALIVE_S", 0.1)
    pipeline = PausingPipeline(model.stages, at=at, pause_s=1.0)  # 1: the prompt's step, 2: the first decode step
    generator = Generator(model.head, tokenizer, pipeline, torch.float32)
    client = testing.TestClient(create_app(GenerationService(MODEL, tokenizer, generator, ready)))
    asked = {"prompt": "Hello", "max_tokens": 4} if path == COMPLETIONS else {"input": "Hello", "max_output_tokens": 4}
    result = client.simulate_post(path, json={"model": MODEL, "stream": True, "temperature": 0, **asked})
    assert result.status_code == 200, result.text
    assert pipeline.runs >= 2  # the paused step ran
    # one before each step after the first (three at most) and ~10 in the second's pause
    assert result.content.count(streaming.KEEPALIVE) >= 8, result.content
