"""What OpenAI clients ask of a local server, on the real demo model through a head and two worker processes.

One cluster serves the whole module (starting it is most of the time): fill in the middle, tool calls with the
official `openai` client (whole, streamed, and the final answer from the tool's result; the deprecated `functions`
form too), structured output (`parse` with a pydantic model; schema-valid replies across seeds and temperatures),
sampling settings beyond OpenAI's (min_p), and the Responses API. Its topology sets an API key (head.api_keys), so
every client here sends one, as against a server that asks for one.
"""
from __future__ import annotations

import ast
import json
import urllib.error
import urllib.request

import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel

from cluster import Cluster, write_topology

pytestmark = [pytest.mark.demo, pytest.mark.slow]

MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct"
API_KEY = "sk-demo-9f2c4e7a1b8d3f60"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, demo_model_dir):
    workdir = tmp_path_factory.mktemp("demo-openai")
    nodes = [{"id": "w0", "device": "cpu"}, {"id": "w1", "device": "cpu"}]
    topology = write_topology(workdir / "t.yaml", demo_model_dir, nodes, dtype="fp32", head={"api_keys": [API_KEY]})
    with Cluster(topology, workdir, api_key=API_KEY) as running:
        running.start_all(["w0", "w1"])
        yield running


def test_fill_in_the_middle_of_a_python_function(cluster):
    status, body = cluster.post("/v1/completions", {
        "model": MODEL_NAME, "prompt": "def add(a, b):\n    ", "suffix": "\n\nprint(add(2, 3))\n",
        "max_tokens": 8, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["text"].startswith("return a + b"), body


# what editors send to stop Qwen2.5-Coder's fill-in-the-middle (Continue's list): special tokens all, none of them EOS
FIM_STOPS = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
             "<|file_sep|>", "<|im_start|>", "<|im_end|>"]


def test_a_stop_string_that_names_a_special_token_stops_the_reply(cluster):
    """A reply's text leaves special tokens out, so a stop string naming one was never found and the completion ran
    on to max_tokens past it. Forced by logit_bias, the model writes <|file_sep|> first: the reply ends there."""
    file_sep = 151664  # <|file_sep|> in Qwen2.5's vocabulary
    status, body = cluster.post("/v1/completions", {
        "model": MODEL_NAME, "prompt": "def add(a, b):\n    ", "suffix": "\n\nprint(add(2, 3))\n", "max_tokens": 8,
        "temperature": 0, "stop": FIM_STOPS[:4], "logit_bias": {str(file_sep): 100}})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body  # not among these stops
    status, body = cluster.post("/v1/completions", {
        "model": MODEL_NAME, "prompt": "def add(a, b):\n    ", "suffix": "\n\nprint(add(2, 3))\n", "max_tokens": 8,
        "temperature": 0, "stop": FIM_STOPS, "logit_bias": {str(file_sep): 100}})
    assert status == 200, body
    assert (body["choices"][0]["finish_reason"], body["choices"][0]["text"]) == ("stop", ""), body
    assert body["usage"]["completion_tokens"] == 1, body
    # with min_tokens the stop's token is not chosen before them, as EOS is not (nor shows its text meanwhile)
    status, body = cluster.post("/v1/completions", {
        "model": MODEL_NAME, "prompt": "def add(a, b):\n    ", "suffix": "\n\nprint(add(2, 3))\n", "max_tokens": 8,
        "temperature": 0, "stop": FIM_STOPS, "logit_bias": {str(file_sep): 100}, "min_tokens": 2})
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop", body
    assert body["usage"]["completion_tokens"] == 3 and "<|" not in body["choices"][0]["text"], body


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object",
                   "properties": {"location": {"type": "string", "description": "City name, e.g. Paris"}},
                   "required": ["location"]}}}
SYSTEM = {"role": "system", "content": "You are a helpful assistant. When a tool result arrives, answer the user in "
                                       "one plain sentence."}
QUESTION = {"role": "user", "content": "What's the weather like in Paris today?"}
WEATHER_RESULT = {"location": "Paris", "temperature_c": 18, "condition": "sunny"}


@pytest.fixture(scope="module")
def client(cluster):
    return OpenAI(base_url=cluster.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def weather_call(client):
    return client.chat.completions.create(model=MODEL_NAME, messages=[QUESTION], tools=[WEATHER_TOOL],
                                          temperature=0, max_tokens=64)


def test_openai_client_gets_a_parsed_weather_call(weather_call):
    choice = weather_call.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and len(call.id) == 9 and call.id.isalnum()
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"location": "Paris"}


def test_the_async_client_gets_the_same_call_two_at_once(cluster, weather_call):
    """openai.AsyncOpenAI, as async apps use it: two requests in flight at once (they share the batch)."""
    import asyncio

    from openai import AsyncOpenAI

    async def ask_twice():
        client = AsyncOpenAI(base_url=cluster.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)
        try:
            return await asyncio.gather(*(client.chat.completions.create(
                model=MODEL_NAME, messages=[QUESTION], tools=[WEATHER_TOOL], temperature=0, max_tokens=64)
                for _ in range(2)))
        finally:
            await client.close()

    want = weather_call.choices[0].message.tool_calls[0].function
    for reply in asyncio.run(ask_twice()):
        assert reply.choices[0].finish_reason == "tool_calls"
        (call,) = reply.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (want.name, json.loads(want.arguments))


def test_streamed_call_deltas_join_into_the_same_call(client, weather_call):
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=[QUESTION], tools=[WEATHER_TOOL],
                                                temperature=0, max_tokens=64, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            if delta.function is not None:
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    whole = weather_call.choices[0].message.tool_calls[0]
    assert finish == "tool_calls"
    assert list(calls) == [0]
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()
    assert (calls[0]["name"], calls[0]["arguments"]) == (whole.function.name, whole.function.arguments)


def test_final_answer_uses_the_tool_result(client, weather_call):
    call = weather_call.choices[0].message.tool_calls[0]
    messages = [SYSTEM, QUESTION, weather_call.choices[0].message,  # the client's own message object, sent back
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps(WEATHER_RESULT)}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER_TOOL],
                                           tool_choice="none", temperature=0, max_tokens=40)
    answer = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls
    assert "sunny" in answer and "18" in answer, answer


def test_the_deprecated_functions_form_calls_and_answers_as_tools_do(client, weather_call):
    """Clients written for `functions` / `function_call` (older agents) get the same call in their form, and the
    same answer from a `function` message with the result."""
    reply = client.chat.completions.create(model=MODEL_NAME, messages=[QUESTION], functions=[WEATHER_TOOL["function"]],
                                           temperature=0, max_tokens=64)
    choice, want = reply.choices[0], weather_call.choices[0].message.tool_calls[0].function
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None, choice
    assert (choice.message.function_call.name, choice.message.function_call.arguments) == (want.name, want.arguments)
    messages = [SYSTEM, QUESTION, choice.message,
                {"role": "function", "name": "get_weather", "content": json.dumps(WEATHER_RESULT)}]
    answer = client.chat.completions.create(model=MODEL_NAME, messages=messages, functions=[WEATHER_TOOL["function"]],
                                            function_call="none", temperature=0, max_tokens=40).choices[0]
    assert answer.finish_reason == "stop" and answer.message.function_call is None
    assert "sunny" in answer.message.content and "18" in answer.message.content, answer.message.content


class City(BaseModel):
    name: str
    country: str
    population_millions: float


CITY_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40},
    "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
    "is_capital": {"type": "boolean"}},
    "required": ["city", "country", "landmarks", "is_capital"], "additionalProperties": False}


def test_a_reply_in_a_code_block_streams_as_it_is_written_with_tools_offered(client):
    """With tools offered, a reply's start is held while it may be a bare call (in a ```json fence too): one that
    opened with ```python, which can be none, was held whole and came out in one piece at its end."""
    stream = client.chat.completions.create(model=MODEL_NAME, tools=[WEATHER_TOOL], temperature=0, max_tokens=40,
                                            stream=True, messages=[{"role": "user", "content": (
                                                "Write a Python function that adds two numbers. Reply with only "
                                                "a code block.")}])
    pieces = [chunk.choices[0].delta.content for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
    assert "".join(pieces).startswith("```python"), pieces
    assert len(pieces) > 10, pieces  # a piece a token or so, as without tools


def test_openai_parse_returns_a_pydantic_object(client):
    reply = client.chat.completions.parse(
        model=MODEL_NAME, temperature=0, max_tokens=60, response_format=City,
        messages=[{"role": "user", "content": "Give the name, country and population of Paris as JSON."}])
    city = reply.choices[0].message.parsed
    assert isinstance(city, City), reply
    assert city.name == "Paris" and city.country == "France"


@pytest.mark.parametrize(("temperature", "seed"), [(0, None), (0.9, 1), (0.9, 2), (1.5, 3)])
def test_json_schema_replies_validate_across_seeds_and_temperatures(client, temperature, seed):
    reply = client.chat.completions.create(
        model=MODEL_NAME, temperature=temperature, seed=seed, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA,
                                                                 "strict": True}},
        messages=[{"role": "user", "content": "Describe Rome as JSON."}])
    assert reply.choices[0].finish_reason == "stop", reply
    jsonschema.validate(json.loads(reply.choices[0].message.content), CITY_SCHEMA)


def test_qwen_s_suggested_sampling_settings_write_code_and_min_p_1_is_greedy(client):
    """The settings Qwen's model cards give (min_p among them, which OpenAI's API lacks) are served and write
    code; min_p = 1 keeps only the most likely token, so even at a high temperature the text is the greedy one."""
    messages = [{"role": "user", "content": "Write a Python function that reverses a string. Only the code."}]
    suggested = dict(temperature=0.7, top_p=0.8, seed=5, extra_body={"top_k": 20, "min_p": 0.05,
                                                                      "repetition_penalty": 1.05})
    code = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=120, **suggested)
    assert "def " in code.choices[0].message.content, code
    ask = dict(model=MODEL_NAME, messages=messages, max_tokens=24)
    greedy = client.chat.completions.create(temperature=0, **ask).choices[0].message.content
    for seed in (1, 2):
        hot = client.chat.completions.create(temperature=1.5, seed=seed, extra_body={"min_p": 1}, **ask)
        assert hot.choices[0].message.content == greedy


def prompt_tokens_read(cluster: Cluster) -> float:
    """tc_prompt_tokens_total from the head's /metrics: prompt positions the pipeline has read."""
    with urllib.request.urlopen(cluster.url + "/metrics", timeout=30) as reply:
        lines = reply.read().decode().splitlines()
    return float(next(line.split()[-1] for line in lines if line.startswith("tc_prompt_tokens_total ")))


def test_n_sampled_choices_are_each_the_seeded_request_alone(cluster, client):
    """n = 3 reads the prompt once on the workers and copies its caches; each choice is still the text that the
    request with its seed (seed + index) gets alone."""
    messages = [{"role": "user", "content": "Write a Python one-liner that sums a list."}]
    ask = dict(model=MODEL_NAME, messages=messages, temperature=0.8, max_tokens=16)
    read_before = prompt_tokens_read(cluster)
    together = client.chat.completions.create(n=3, seed=11, **ask)
    assert prompt_tokens_read(cluster) - read_before == together.usage.prompt_tokens  # read once for three
    assert [c.index for c in together.choices] == [0, 1, 2]
    for i, choice in enumerate(together.choices):
        alone = client.chat.completions.create(seed=11 + i, **ask).choices[0].message.content
        assert choice.message.content == alone
    assert len({c.message.content for c in together.choices}) > 1
    assert together.usage.prompt_tokens == client.chat.completions.create(seed=11, **ask).usage.prompt_tokens


def test_many_threads_at_once_each_get_their_own_answer(cluster, client):
    """The official client from eight threads at once, different prompts and lengths: they share the pipeline's
    steps (the batch), and each answer is the one that request gets alone, up to a genuine tie in fp32."""
    import threading
    prompts = ["def is_prime(n):", "# reverse a string in Python\n", "SELECT name FROM users", "class Point:",
               "import os\n", "def quicksort(items):", "for i in range(3):", "// add two numbers in C\n"]
    lengths = [24, 16, 12, 20, 8, 24, 10, 14]
    alone = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=n, temperature=0, logprobs=2,
                                       extra_body={"ignore_eos": True}) for p, n in zip(prompts, lengths)]
    together: dict[int, str] = {}

    def ask(i: int) -> None:
        together[i] = client.completions.create(model=MODEL_NAME, prompt=prompts[i], max_tokens=lengths[i],
                                                temperature=0, extra_body={"ignore_eos": True}).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    for i, solo in enumerate(alone):
        text, want = together[i], solo.choices[0].text
        if text == want:
            continue
        # where they part, the solo run's two best tokens must have been a tie (model_helpers.NEAR_TIE)
        at = next((k for k, (a, b) in enumerate(zip(text, want)) if a != b), min(len(text), len(want)))
        logprobs = solo.choices[0].logprobs
        index = max(k for k, offset in enumerate(logprobs.text_offset) if offset <= at)
        best, second = sorted(logprobs.top_logprobs[index].values(), reverse=True)[:2]
        assert best - second < 1e-3, (prompts[i], text, want)
    assert cluster.get("/v1/cluster")[1]["batch"]["in_use"] == 0


def test_the_next_turn_of_a_chat_reads_only_the_new_message(client):
    """A chat sent back whole with the reply and a new message: the head continues the first turn's caches on the
    workers (head.prefix_cache), reads only what is new, and the reply is the one a fresh reading gives (up to a
    genuine tie in fp32)."""
    messages = [{"role": "system", "content": "You are a careful Python programmer."},
                {"role": "user", "content": "Write a Python function that returns the square of x."}]
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=48)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Now add a docstring to it."}]
    ask = dict(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=32)
    second = client.chat.completions.create(**ask)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens < cached < second.usage.prompt_tokens, second.usage
    assert_same_as_a_fresh_reading(client, ask, second.choices[0].message.content)


def assert_same_as_a_fresh_reading(client, ask: dict, text: str) -> None:
    """`text` is the reply a reading of the whole prompt gives (cache_prompt false), up to a genuine tie."""
    fresh = client.chat.completions.create(logprobs=True, top_logprobs=2, extra_body={"cache_prompt": False}, **ask)
    assert fresh.usage.prompt_tokens_details is None
    want = fresh.choices[0].message.content
    if text != want:  # where they part, the fresh reading's two best tokens must have been a tie
        at = next((k for k, (a, b) in enumerate(zip(text, want)) if a != b), min(len(text), len(want)))
        spelled = 0
        for entry in fresh.choices[0].logprobs.content:
            if spelled + len(entry.token) > at:
                best, second_best = sorted(t.logprob for t in entry.top_logprobs)[::-1][:2]
                assert best - second_best < 1e-3, (text, want)
                break
            spelled += len(entry.token)


def test_another_chat_with_the_same_system_prompt_reads_only_its_own_messages(client):
    """Two conversations that open with the same long system prompt: the second starts from a copy of the part
    the first's kept cache shares with it (head.prefix_cache), and its reply is a fresh reading's."""
    system = ("You are a senior Python reviewer. Answer with code only, in one fenced block, no prose. Follow PEP 8, "
              "add type hints to every function, prefer the standard library, never use global state, keep "
              "functions short, name things for what they are, and raise ValueError with a clear message on bad "
              "input. Tests use pytest; do not write them unless asked.")
    asks = [dict(model=MODEL_NAME, temperature=0, max_tokens=24,
                 messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
            for question in ("Write a function that reverses a string.", "Write a function that sums a list.")]
    first = client.chat.completions.create(**asks[0])
    second = client.chat.completions.create(**asks[1])
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 64 <= cached < min(first.usage.prompt_tokens, second.usage.prompt_tokens), second.usage
    assert_same_as_a_fresh_reading(client, asks[1], second.choices[0].message.content)


# an answer begun for the model, as clients prefill one: the function's first line, for the model to go on from
SQUARE = [{"role": "user", "content": "Write a Python function square(x) that returns x squared. Only the code."},
          {"role": "assistant", "content": "def square(x):\n"}]


def test_a_continued_message_ends_the_real_template_s_prompt_where_its_text_ends(demo_model_dir):
    """On Qwen2.5's own template: the prompt is the one that opens the assistant's turn, then the text so far, with
    none of the end of its turn that the template writes after a message (its eos token and a newline)."""
    from transformers import AutoTokenizer

    from tc.model.tokenizer import TextTokenizer

    ours = TextTokenizer.load(demo_model_dir)
    continued = ours.apply_chat_template(SQUARE, add_generation_prompt=False, continue_final_message=True)
    assert continued == ours.apply_chat_template(SQUARE[:1]) + SQUARE[1]["content"]
    closed = ours.apply_chat_template(SQUARE, add_generation_prompt=False)
    assert closed == continued + ours.special_tokens["eos_token"] + "\n"
    theirs = AutoTokenizer.from_pretrained(str(demo_model_dir))
    assert continued == theirs.apply_chat_template(SQUARE, continue_final_message=True, tokenize=False)


def test_a_prefilled_answer_is_continued_whole_and_streamed(client, demo_model_dir):
    """continue_final_message through the head and its workers: the reply goes on from the prefilled first line,
    so the two together are the function (a new turn would start over, in prose or a code fence)."""
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(str(demo_model_dir)).apply_chat_template(
        SQUARE, continue_final_message=True, tokenize=True, return_dict=False)
    ask = dict(model=MODEL_NAME, messages=SQUARE, temperature=0, max_tokens=24, stop=["```", "\n\n"],
               extra_body={"continue_final_message": True, "add_generation_prompt": False})
    reply = client.chat.completions.create(**ask)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(**ask,
                                                                                                        stream=True))
    for text in (reply.choices[0].message.content, streamed):
        (function,) = ast.parse(SQUARE[1]["content"] + text).body  # read, not run
        assert isinstance(function, ast.FunctionDef) and function.name == "square", text
        assert any(isinstance(node, ast.Return) for node in ast.walk(function)), text


def test_a_template_variable_the_template_does_not_read_changes_nothing(client):
    """Qwen3's clients send enable_thinking with every request; Qwen2.5's template has no such variable, so the
    request is served with the prompt it has without it (as transformers and vLLM render it)."""
    ask = dict(model=MODEL_NAME, messages=SQUARE[:1], max_tokens=1, temperature=0)
    plain = client.chat.completions.create(**ask)
    quiet = client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert quiet.usage.prompt_tokens == plain.usage.prompt_tokens


def test_a_client_without_the_key_is_refused_and_costs_the_cluster_nothing(cluster, client):
    """head.api_keys on the demo cluster: the openai client with a wrong key gets its AuthenticationError (a 401 of
    OpenAI's shape), a request with no key at all the same, and neither is generated: the head's token counters do
    not move. With the key, the same request is answered."""
    import openai

    def generated() -> float:
        with urllib.request.urlopen(cluster.url + "/metrics", timeout=30) as reply:  # open without a key
            text = reply.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(("tc_prompt_tokens_total", "tc_completion_tokens_total")))

    before = generated()
    stranger = OpenAI(base_url=cluster.url + "/v1", api_key="sk-not-this-servers-key", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as refused:
        stranger.completions.create(model=MODEL_NAME, prompt="def add(a, b):", max_tokens=4)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    assert "sk-not-this-servers-key" not in str(refused.value)
    request = urllib.request.Request(cluster.url + "/v1/completions", data=json.dumps(
        {"model": MODEL_NAME, "prompt": "def add(a, b):", "max_tokens": 4}).encode())
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(request, timeout=60)
    assert missing.value.code == 401 and missing.value.headers["WWW-Authenticate"] == "Bearer"
    assert json.loads(missing.value.read())["error"]["code"] == "invalid_api_key"
    assert generated() == before
    answered = client.completions.create(model=MODEL_NAME, prompt="def add(a, b):", max_tokens=4, temperature=0)
    assert answered.usage.completion_tokens == 4 and generated() > before


def test_the_responses_api_writes_the_function_whole_and_streamed(client):
    """client.responses.create, as OpenAI's quick-starts call it, through the key: the text the whole response
    gives, and the same text joined from the stream's deltas, whose last event carries the whole response."""
    ask = dict(model=MODEL_NAME, input="Write a Python function that adds two numbers.", max_output_tokens=48,
               temperature=0)
    whole = client.responses.create(**ask)
    assert "def " in whole.output_text, whole.output_text
    assert whole.usage.output_tokens <= 48 and whole.status in ("completed", "incomplete")
    events = list(client.responses.create(stream=True, **ask))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].type == f"response.{whole.status}" and events[-1].response.output_text == whole.output_text
