"""A model config.json ties (tie_word_embeddings) whose checkpoint also holds an lm_head: transformers 5 ties the
two only where they are alike, and keeps an lm_head of other values as the model's own; so does tc's head
(weights.own_lm_head, HeadModel.load), in one process and in a cluster, whose head fetches that lm_head too."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster import Cluster, write_topology
from hub_standin import HubStandIn
from model_helpers import OurModel, hf_logits
from tc.generation import Generator
from tc.model.config import ModelConfig
from tc.model.tokenizer import TextTokenizer
from tc.model.qwen2 import HeadModel
from tc.model.weights import WeightIndex, WeightsError, head_names_to_fetch, head_tensor_names, own_lm_head
from tc.model_source import ModelSource
from tc.sampling import SamplingParams
from tiny_families import edited_copy, hf_family_model, write_family_model

PROMPT = [5, 77, 200, 13, 42, 9, 250, 31]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    """A tied Llama 3 (its checkpoint without an lm_head, as transformers saves one)."""
    path = write_family_model(tmp_path_factory.mktemp("tied"), "llama3-rope-tied", seed=6)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    return path


def with_lm_head(tied_dir, path, lm_head) -> None:
    """A copy of `tied_dir` at `path` whose checkpoint holds lm_head(embedding) too; config.json still ties."""
    def add_lm_head(tensors):
        tensors["lm_head.weight"] = lm_head(tensors["model.embed_tokens.weight"])
        return tensors
    edited_copy(tied_dir, path, tensors=add_lm_head)
    assert ModelConfig.from_file(path / "config.json").tie_word_embeddings


def test_an_lm_head_of_other_values_is_the_models_own_as_in_transformers_5(tied_dir, tmp_path, caplog):
    with_lm_head(tied_dir, tmp_path / "own", lambda embedding: embedding.flip(1) * 0.5)
    reference = hf_logits(hf_family_model(tmp_path / "own"), PROMPT)
    with caplog.at_level(logging.WARNING, logger="tc.model.qwen2"):
        ours = OurModel(tmp_path / "own", splits=[2])
    assert "the checkpoint holds an lm_head of its own with other values: the head uses it" in caplog.text
    logits = ours.full_logits(PROMPT)
    assert (logits - reference).abs().max().item() < 1e-4
    assert (logits - OurModel(tied_dir, splits=[2]).full_logits(PROMPT)).abs().max().item() > 1e-2


def test_an_lm_head_alike_the_embedding_is_tied(tied_dir, tmp_path, caplog):
    with_lm_head(tied_dir, tmp_path / "alike", lambda embedding: embedding.clone())
    with caplog.at_level(logging.WARNING, logger="tc.model.qwen2"):
        head = OurModel(tmp_path / "alike").head
    assert head.lm_head.weight.data_ptr() == head.embed_tokens.weight.data_ptr()  # one tensor, two uses
    assert "lm_head" not in caplog.text


def test_an_lm_head_of_another_shape_is_refused(tied_dir, tmp_path):
    with_lm_head(tied_dir, tmp_path / "wrong", lambda embedding: embedding[:, :-1].clone())
    with pytest.raises(WeightsError, match=r"tensor lm_head.weight has shape \[320, 63\], config.json implies "
                                           r"\[320, 64\]"):
        OurModel(tmp_path / "wrong")


def test_a_clusters_head_uses_the_checkpoints_own_lm_head(tied_dir, tmp_path):
    own = tmp_path / "own"
    with_lm_head(tied_dir, own, lambda embedding: embedding.flip(1) * 0.5)
    prompt = "the quick brown fox"
    ids = TextTokenizer.load(own).encode(prompt)
    with torch.inference_mode():
        expected = hf_family_model(own).generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                                 eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    # the text a generation streams holds back a trailing partial character: tc's own generator's text of
    # transformers' tokens is the cluster's to match
    model = OurModel(own)
    local = Generator(model.head, TextTokenizer.load(own), model.pipeline(), torch.float32).generate(
        ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    assert list(local.token_ids) == expected
    topo = write_topology(tmp_path / "t.yaml", own, [{"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}])
    with Cluster(topo, tmp_path) as cluster:
        cluster.start_all(["a", "b"])
        status, body = cluster.post("/v1/completions", {"model": own.name, "prompt": prompt, "max_tokens": NEW_TOKENS,
                                                        "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        assert body["choices"][0]["text"] == local.text
        assert "an lm_head of its own with other values" in cluster.head.output()


def test_the_head_fetches_a_tied_models_own_lm_head_from_a_shard_of_its_own(tied_dir, tmp_path, monkeypatch):
    own = tmp_path / "own"
    with_lm_head(tied_dir, own, lambda embedding: embedding.flip(1) * 0.5)
    tensors = load_file(own / "model.safetensors")
    shards = {"head.safetensors": {n: t for n, t in tensors.items() if not n.startswith("model.layers.")
                                   and n != "lm_head.weight"},
              "lm_head.safetensors": {"lm_head.weight": tensors["lm_head.weight"]},
              "layers.safetensors": {n: t for n, t in tensors.items() if n.startswith("model.layers.")}}
    (own / "model.safetensors").unlink()
    for file, part in shards.items():
        save_file(part, own / file, metadata={"format": "pt"})
    weight_map = {name: file for file, part in shards.items() for name in part}
    (own / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = ModelConfig.from_file(own / "config.json")
    assert "lm_head.weight" not in head_tensor_names(config)

    from huggingface_hub import constants

    with HubStandIn({"acme/tied-own-head": own}) as hub:  # as the head fetches and opens its tensors
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        names = head_names_to_fetch(config)
        fetched = ModelSource("acme/tied-own-head", is_local=False, cache_dir=tmp_path / "cache").fetch_tensors(names)
    assert {p.name for p in fetched.glob("*.safetensors")} == {"head.safetensors", "lm_head.safetensors"}
    index = WeightIndex.open(fetched, only=names)
    assert own_lm_head(config, index)
    head = HeadModel.load(config, index, torch.float32)
    assert torch.equal(head.lm_head.weight, tensors["lm_head.weight"])
