"""Image-text checkpoints (Gemma 3's 4B-27B: Gemma3ForConditionalGeneration; Mistral Small 3.1 / 3.2:
Mistral3ForConditionalGeneration) run as the causal LM inside them, on text: their language model's tensors are
read under a causal LM's names, whichever of the names such checkpoints carry, and the vision tower's are never
read. Parity with transformers, batching, quantization and head + 2 workers run in test_families.py (the
"gemma3-image-text" and "mistral3-image-text" families); here what is particular to the wrappers (Qwen's:
test_qwen_vl_models.py)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from hub_standin import HubStandIn
from model_helpers import OurModel
from tc.model.config import ConfigError, ModelConfig
from tc.model.weights import WeightIndex, WeightsError, causal_lm_name, layer_tensor_names
from tc.model_source import ModelSource
from tiny_families import edited_copy, hf_family_model, write_family_model

PROMPT = [5, 77, 200, 13, 42, 9, 250, 31]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_family_model(tmp_path_factory.mktemp("image-text"), "gemma3-image-text", seed=4)


def renamed_copy(model_dir, path, rename) -> dict[str, torch.Tensor]:
    """A copy of `model_dir` whose tensors are stored under rename(name); returns them as stored."""
    edited_copy(model_dir, path, tensors=lambda tensors: {rename(name): t for name, t in tensors.items()})
    return load_file(path / "model.safetensors")


def logits_as_transformers(model_dir) -> torch.Tensor:
    """tc's logits of the directory (two stages), checked against transformers'."""
    with torch.inference_mode():
        reference = hf_family_model(model_dir)(torch.tensor([PROMPT])).logits[0]
    ours = OurModel(model_dir, splits=[2]).full_logits(PROMPT)
    assert (ours - reference).abs().max().item() < 1e-4
    return ours


def test_the_language_model_is_read_and_the_vision_tower_is_not(model_dir):
    stored = load_file(model_dir / "model.safetensors")
    assert any(n.startswith("vision_tower.") for n in stored) and "language_model.model.norm.weight" in stored
    index = WeightIndex.open(model_dir)
    assert "model.norm.weight" in index.tensors and "model.layers.3.mlp.down_proj.weight" in index.tensors
    config = ModelConfig.from_file(model_dir / "config.json")
    assert config.model_type == "gemma3_text" and config.num_hidden_layers == 4
    index.validate(config)
    index.refuse_unused_in_layers(config, 0, 4)


def test_a_copy_stored_under_the_in_memory_names_runs_the_same(model_dir, tmp_path):
    # transformers 4.52-4.x named the language model "model.language_model." in memory; some re-saved copies do too
    tensors = renamed_copy(model_dir, tmp_path / "resaved", lambda n: n.replace("language_model.model.",
                                                                                 "model.language_model."))
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in tensors
    expected = OurModel(model_dir, splits=[2]).full_logits(PROMPT)
    assert torch.equal(OurModel(tmp_path / "resaved", splits=[2]).full_logits(PROMPT), expected)
    with torch.inference_mode():
        reference = hf_family_model(model_dir)(torch.tensor([PROMPT])).logits[0]
    assert (expected - reference).abs().max().item() < 1e-4


def test_a_tensor_stored_under_both_names_is_refused_naming_both(model_dir, tmp_path):
    def twice(tensors):
        tensors["model.language_model.norm.weight"] = tensors["language_model.model.norm.weight"].clone()
        return tensors
    edited_copy(model_dir, tmp_path / "twice", tensors=twice)
    with pytest.raises(WeightsError, match="language_model.model.norm.weight and model.language_model.norm.weight "
                                           "are both the language model's model.norm.weight"):
        WeightIndex.open(tmp_path / "twice")


def test_an_untied_lm_head_is_the_top_levels_call_as_in_transformers(model_dir, tmp_path):
    def own_lm_head(tensors):
        tensors["language_model.lm_head.weight"] = tensors["language_model.model.embed_tokens.weight"] * -0.5
        return tensors

    def untie(config):
        config["tie_word_embeddings"] = False  # text_config's copy stays true, as transformers saves it
        assert config["text_config"]["tie_word_embeddings"] is True
        return config
    untied = edited_copy(model_dir, tmp_path / "untied", tensors=own_lm_head, config=untie)
    assert not ModelConfig.from_file(untied / "config.json").tie_word_embeddings
    ours = logits_as_transformers(untied)
    assert (ours - OurModel(model_dir, splits=[2]).full_logits(PROMPT)).abs().max().item() > 1e-2


def test_causal_lm_names():
    assert causal_lm_name("language_model.model.layers.7.mlp.up_proj.weight") == "model.layers.7.mlp.up_proj.weight"
    assert causal_lm_name("model.language_model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert causal_lm_name("language_model.lm_head.weight") == "lm_head.weight"
    for name in ("model.layers.0.mlp.up_proj.weight", "vision_tower.head.probe", "lm_head.weight",
                 "multi_modal_projector.mm_input_projection_weight"):
        assert causal_lm_name(name) == name


def test_a_sharded_checkpoint_from_the_hub_fetches_only_the_shards_of_the_layers_asked(model_dir, tmp_path,
                                                                                     monkeypatch):
    sharded = tmp_path / "sharded"
    hf_family_model(model_dir).save_pretrained(str(sharded), max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, sharded / name)
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    config = ModelConfig.from_file(sharded / "config.json")
    wanted = layer_tensor_names(config, 2, 4)
    shards = {weight_map["language_model." + n] for n in wanted}
    assert 1 < len(shards) < len(set(weight_map.values()))  # some shards, not all, hold layers 2-3

    from huggingface_hub import constants

    with HubStandIn({"acme/gemma-3-tiny-it": sharded}) as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        fetched = ModelSource("acme/gemma-3-tiny-it", is_local=False, cache_dir=tmp_path / "cache").fetch_tensors(
            wanted)
    assert {p.name for p in fetched.glob("*.safetensors")} == shards
    index = WeightIndex.open(fetched, only=wanted)
    index.validate(config, only=wanted)
    assert set(index.load(wanted)) == set(wanted)


def test_keys_a_text_config_leaves_out_take_gemma3_text_configs_defaults():
    from transformers import Gemma3Config

    text = {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34, "sliding_window": 1024,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "model_type": "gemma3_text"}
    data = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
            "vision_config": {"model_type": "siglip_vision_model"}, "eos_token_id": [1, 106]}
    ours, theirs = ModelConfig.from_dict(data), Gemma3Config(**{k: v for k, v in data.items()
                                                                if k != "architectures"}).text_config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.sliding_windows == tuple(None if t == "full_attention" else 1024 for t in theirs.layer_types)
    assert (ours.rope.type, ours.rope.param("factor"), ours.rope.theta) == ("linear", 8.0, 1_000_000.0)
    assert (ours.local_rope.type, ours.local_rope.theta) == ("default", 10_000.0)
    assert ModelConfig.from_dict(ours.to_dict()) == ours  # the wire copy is config.json as read


def test_a_final_softcap_the_two_transformers_disagree_on_is_refused():
    data = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {"final_logit_softcapping": 30.0}}
    with pytest.raises(ConfigError, match="final_logit_softcapping = 30.0, which transformers 4 applies"):
        ModelConfig.from_dict(data)
    data["text_config"]["final_logit_softcapping"] = None
    assert ModelConfig.from_dict(data).final_softcap is None


def test_a_text_config_that_is_not_gemma3_text_is_refused():
    data = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {"model_type": "llama"}}
    with pytest.raises(ConfigError, match="text_config sets model_type = 'llama'"):
        ModelConfig.from_dict(data)
    with pytest.raises(ConfigError, match="text_config = 7"):
        ModelConfig.from_dict({**data, "text_config": 7})


@pytest.fixture(scope="module")
def mistral3_dir(tmp_path_factory):
    return write_family_model(tmp_path_factory.mktemp("mistral3"), "mistral3-image-text", seed=4)


def test_mistral3_as_published_keeps_its_own_lm_head_as_transformers_5_does(mistral3_dir, tmp_path):
    def as_published(config):
        del config["tie_word_embeddings"], config["text_config"]["tie_word_embeddings"]  # the published files lack them
        return config
    published = edited_copy(mistral3_dir, tmp_path / "published", config=as_published)
    assert "language_model.lm_head.weight" in load_file(published / "model.safetensors")
    ours = ModelConfig.from_file(published / "config.json")
    # tied by Mistral3Config's default, but the checkpoint's lm_head differs from the embedding: it is used
    assert (ours.model_type, ours.tie_word_embeddings, ours.sliding_windows) == ("mistral", True, (5,) * 4)
    logits = logits_as_transformers(published)
    assert torch.equal(logits, OurModel(mistral3_dir, splits=[2]).full_logits(PROMPT))


def test_mistral3_saved_tied_by_transformers_5_runs_tied(mistral3_dir, tmp_path):
    # Mistral3ForConditionalGeneration's own save of a tied model: the top level true, text_config's copy false, and
    # no lm_head
    def no_lm_head(tensors):
        del tensors["language_model.lm_head.weight"]
        return tensors

    def tied_at_the_top(config):
        config["tie_word_embeddings"], config["text_config"]["tie_word_embeddings"] = True, False
        return config
    tied = edited_copy(mistral3_dir, tmp_path / "tied", tensors=no_lm_head, config=tied_at_the_top)
    assert ModelConfig.from_file(tied / "config.json").tie_word_embeddings
    ours = logits_as_transformers(tied)
    assert (ours - OurModel(mistral3_dir, splits=[2]).full_logits(PROMPT)).abs().max().item() > 1e-2


def test_a_mistral3_whose_language_model_is_not_a_mistral_is_refused():
    data = {"architectures": ["Mistral3ForConditionalGeneration"], "text_config": {"model_type": "llama"}}
    with pytest.raises(ConfigError, match="text_config sets model_type = 'llama'; this checkpoint's language "
                                          "model is a mistral"):
        ModelConfig.from_dict(data)
    with pytest.raises(ConfigError, match="no text_config"):
        ModelConfig.from_dict({"architectures": ["Mistral3ForConditionalGeneration"]})


def test_a_ministral3_text_config_that_names_nothing_else_is_ministral3_configs_defaults():
    """Ministral 3's image-text checkpoints name their language model a `ministral3`: one that gives no more reads
    as Ministral3Config's defaults, yarn and its query scaling included, as transformers builds it."""
    import transformers

    config = ModelConfig.from_dict({"architectures": ["Mistral3ForConditionalGeneration"],
                                    "text_config": {"model_type": "ministral3"}})
    theirs = transformers.Mistral3Config(text_config={"model_type": "ministral3"}).text_config
    rope = theirs.rope_parameters
    assert (config.model_type, config.hidden_size, config.intermediate_size, config.num_hidden_layers,
            config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.vocab_size,
            config.rms_norm_eps, config.max_position_embeddings, config.sliding_windows) == \
        ("ministral3", theirs.hidden_size, theirs.intermediate_size, theirs.num_hidden_layers,
         theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim, theirs.vocab_size,
         theirs.rms_norm_eps, theirs.max_position_embeddings, ())
    assert (config.rope.type, config.rope.theta, config.rope.param("factor"),
            config.rope.param("original_max_position_embeddings"), config.query_scaling) == \
        ("yarn", rope["rope_theta"], rope["factor"], rope["original_max_position_embeddings"],
         (rope["llama_4_scaling_beta"], rope["original_max_position_embeddings"]))
