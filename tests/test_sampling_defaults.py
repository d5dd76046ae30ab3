"""The model's own sampling (generation_config.json) for the fields a request leaves out: read and checked as a
request's are, applied only where the request is silent, and served by a real head."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from falcon import testing

from cluster import Cluster, write_topology
from model_helpers import OurModel
from tc.generation import Generator
from tc.head.api import create_app
from tc.head.sampling_defaults import read_sampling_defaults
from tc.head.service import GenerationService, Readiness
from tc.model.tokenizer import TextTokenizer
from tc.sampling import SamplingParams
from tiny_model import write_tiny_model

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen", seed=11)
    config = json.loads((path / "generation_config.json").read_text()) \
        if (path / "generation_config.json").exists() else {}
    # greedy with a repetition penalty (under 1: it moves this random model's argmax), and a top_p out of range,
    # which is left out
    config.update({"do_sample": True, "temperature": 0.0, "repetition_penalty": 0.5, "top_p": 7})
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def generator(model_dir) -> Generator:
    model = OurModel(model_dir)
    return Generator(model.head, TextTokenizer.load(model_dir), model.pipeline(), torch.float32)


def test_the_files_fields_are_read_as_a_requests_are(model_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert read_sampling_defaults(model_dir) == {"temperature": 0.0, "repetition_penalty": 0.5}
    assert "'top_p' must be greater than 0 and at most 1, not 7" in caplog.text
    assert read_sampling_defaults(tmp_path) == {}  # no file: the API's own defaults


def test_a_request_takes_the_model_s_values_for_what_it_leaves_out_only(generator, model_dir):
    served = testing.TestClient(create_app(GenerationService(
        "tiny", generator.tokenizer, generator, lambda: Readiness(1, ("w1",), ()),
        sampling_defaults=read_sampling_defaults(model_dir))))
    ask = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}
    silent = served.simulate_post("/v1/completions", json=ask).json["choices"][0]["text"]
    ids = generator.tokenizer.encode(PROMPT)
    # greedy by the model's temperature: its argmax, which the model's penalty does not move
    greedy = generator.generate(ids, SamplingParams(12, temperature=0, ignore_eos=True))
    penalised = generator.generate(ids, SamplingParams(12, temperature=0, repetition_penalty=0.5, ignore_eos=True))
    assert silent == greedy.text != penalised.text
    asked = served.simulate_post("/v1/completions", json={**ask, "repetition_penalty": 0.5}).json
    assert asked["choices"][0]["text"] == penalised.text  # asked for: applied
    # a request's own value wins: sampled at temperature 1 with the seed, the penalty still the model's
    sampled = served.simulate_post("/v1/completions", json={**ask, "temperature": 1.0, "seed": 5}).json
    expected = generator.generate(ids, SamplingParams(12, temperature=1.0, seed=5, repetition_penalty=0.5,
                                                      ignore_eos=True))
    assert sampled["choices"][0]["text"] == expected.text
    chat = served.simulate_post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "ignore_eos": True})
    again = served.simulate_post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "ignore_eos": True})
    assert chat.status_code == 200 and chat.json["choices"][0] == again.json["choices"][0]  # greedy: the same


def test_a_head_serves_the_model_s_sampling_and_says_so(tmp_path, model_dir, generator):
    topology = write_topology(tmp_path / "t.yaml", model_dir, [{"id": "a", "device": "cpu"}])
    with Cluster(topology, tmp_path) as cluster:
        cluster.start_all(["a"])
        status, body = cluster.post("/v1/completions", {"model": "tiny-qwen", "prompt": PROMPT, "max_tokens": 10,
                                                        "ignore_eos": True})
        assert status == 200
        ids = generator.tokenizer.encode(PROMPT)
        expected = generator.generate(ids, SamplingParams(10, temperature=0, ignore_eos=True))
        assert body["choices"][0]["text"] == expected.text
        assert ("sampling for requests that leave it out, from the model's generation_config.json: temperature 0, "
                "repetition_penalty 0.5") in cluster.head.output()
