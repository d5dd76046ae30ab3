"""Qwen's image-text checkpoints (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) run as the language model inside them, on text:
their MRoPE is plain RoPE there, the settings are read where transformers 5 reads them (the top level of the
published Qwen2(.5)-VL files, text_config since), and each class ties its lm_head as transformers does. Parity,
batching, quantization and head + 2 workers run in test_families.py ("qwen2.5-vl", "qwen3-vl");
here what is particular to these wrappers, each against transformers' own model of the same files (decode plans:
test_decode_plan.py)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from model_helpers import OurModel
from tc.model.config import ConfigError, ModelConfig
from tiny_families import SHAPES, edited_copy, hf_family_model, write_family_model

PROMPT = [5, 77, 200, 13, 42, 9, 250, 31, 120, 64, 3]


def reference_logits(model_dir) -> torch.Tensor:
    with torch.inference_mode():
        return hf_family_model(model_dir)(torch.tensor([PROMPT])).logits[0]


def assert_runs_as_transformers(model_dir) -> torch.Tensor:
    """tc's logits of the directory (two stages) against transformers', prefilled and step by step; tc's."""
    ours = OurModel(model_dir, splits=[2])
    reference = reference_logits(model_dir)
    logits = ours.full_logits(PROMPT)
    assert (logits - reference).abs().max().item() < 1e-4
    assert (ours.cached_logits(PROMPT, split=4) - reference).abs().max().item() < 1e-4
    return logits


@pytest.fixture(scope="module")
def qwen25_dir(tmp_path_factory):
    return write_family_model(tmp_path_factory.mktemp("qwen2.5-vl"), "qwen2.5-vl", seed=3)


def flattened(config: dict, rope: dict) -> dict:
    """config.json as Qwen2(.5)-VL is published: the language model's keys at the top level, 4.x's rotary
    layout (`rope_scaling` naming mrope, the base beside it)."""
    text = {k: v for k, v in config.pop("text_config").items() if k not in ("model_type", "rope_parameters")}
    return {**config, **text, "rope_theta": 1e6, "rope_scaling": rope}


def test_the_published_flat_form_runs_as_transformers_reads_it(qwen25_dir, tmp_path):
    stored = load_file(qwen25_dir / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.bias" in stored and any(n.startswith("visual.") for n in stored)
    flat = edited_copy(qwen25_dir, tmp_path / "flat",
                       config=lambda c: flattened(c, {"type": "mrope", "mrope_section": [2, 3, 3]}))
    config = ModelConfig.from_file(flat / "config.json")
    assert (config.model_type, config.qkv_bias, config.rope.type, config.rope.theta) == ("qwen2", True, "default", 1e6)
    assert ModelConfig.from_dict(config.to_dict()) == config  # what a worker reads from ASSIGNMENT
    logits = assert_runs_as_transformers(flat)
    assert torch.equal(logits, OurModel(qwen25_dir, splits=[2]).full_logits(PROMPT))  # the same model either way


def test_a_yarn_scaled_mrope_scales_the_text_positions_as_transformers_does(qwen25_dir, tmp_path):
    # Qwen2.5-VL's model card's long-context setting: yarn beside the MRoPE sections
    yarn = edited_copy(qwen25_dir, tmp_path / "yarn",
                       config=lambda c: flattened(c, {"type": "yarn", "mrope_section": [2, 3, 3], "factor": 4.0,
                                                      "original_max_position_embeddings": 8}))
    assert ModelConfig.from_file(yarn / "config.json").rope.type == "yarn"
    logits = assert_runs_as_transformers(yarn)
    assert (logits - OurModel(qwen25_dir, splits=[2]).full_logits(PROMPT)).abs().max().item() > 1e-2


def test_qwen2_5_vl_ties_where_text_config_says_so_as_older_saves_did(tmp_path):
    tied = write_family_model(tmp_path / "tied", "qwen2.5-vl", seed=3, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(tied / "model.safetensors")

    def flag_inside(config):
        config["text_config"]["tie_word_embeddings"], config["tie_word_embeddings"] = True, False
        return config
    edited_copy(tied, tmp_path / "inside", config=flag_inside)
    assert ModelConfig.from_file(tmp_path / "inside" / "config.json").tie_word_embeddings
    assert_runs_as_transformers(tmp_path / "inside")


def test_qwen3_vl_ties_where_the_top_level_says_so_unless_the_checkpoint_holds_another_lm_head(tmp_path):
    untied = write_family_model(tmp_path / "untied", "qwen3-vl", seed=3)

    def top_level_tied(config):
        config["tie_word_embeddings"], config["text_config"]["tie_word_embeddings"] = True, False
        return config

    def no_lm_head(tensors):
        del tensors["lm_head.weight"]  # as a tied checkpoint is saved
        return tensors
    tied = edited_copy(untied, tmp_path / "tied", tensors=no_lm_head, config=top_level_tied)
    assert ModelConfig.from_file(tied / "config.json").tie_word_embeddings
    logits = assert_runs_as_transformers(tied)
    untied_logits = OurModel(untied, splits=[2]).full_logits(PROMPT)
    assert (logits - untied_logits).abs().max().item() > 1e-2
    # tied by the flag, but with the untied checkpoint's own lm_head, different from the embedding: it is used
    edited_copy(untied, tmp_path / "flag-only", config=top_level_tied)
    assert torch.equal(assert_runs_as_transformers(tmp_path / "flag-only"), untied_logits)
    inside = json.loads((untied / "config.json").read_text())
    inside["text_config"]["tie_word_embeddings"] = True  # transformers 5 reads only the top level for Qwen3-VL
    assert not ModelConfig.from_dict(inside).tie_word_embeddings


def test_keys_left_out_take_the_text_config_classes_defaults():
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    text = {k: v for k, v in SHAPES.items() if k != "num_key_value_heads"}
    text.update(num_attention_heads=32, hidden_size=256, rms_norm_eps=1e-6)  # heads for 8 or 32 KV heads
    for architecture, config_class, extra in [("Qwen2_5_VLForConditionalGeneration", Qwen2_5_VLConfig, {}),
                                              ("Qwen3VLForConditionalGeneration", Qwen3VLConfig, {"head_dim": 16})]:
        # the top level's base and shapes are not the language model's once there is a text_config
        data = {"architectures": [architecture], "text_config": {**text, **extra}, "rope_theta": 10000.0,
                "num_key_value_heads": 1}
        ours, theirs = ModelConfig.from_dict(data), config_class(text_config={**text, **extra}).text_config
        assert ours.num_key_value_heads == theirs.num_key_value_heads and ours.rope.theta == \
            theirs.rope_parameters["rope_theta"], architecture
    flat = {"architectures": ["Qwen2VLForConditionalGeneration"], **text}  # the published form, no base named
    assert (ModelConfig.from_dict(flat).num_key_value_heads, ModelConfig.from_dict(flat).rope.theta) == (8, 1e6)


def test_qwen2_vl_runs_as_transformers(tmp_path):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = {**SHAPES, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6}}
    vision = dict(depth=1, embed_dim=32, hidden_size=SHAPES["hidden_size"], num_heads=2)
    torch.manual_seed(5)
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():  # larger than transformers' init, so logits differ clearly
            param.copy_(torch.randn(param.shape) * (1.0 if "embed_tokens" in name or param.dim() == 1 else 0.08))
    model.save_pretrained(str(tmp_path / "qwen2-vl"))
    config = ModelConfig.from_file(tmp_path / "qwen2-vl" / "config.json")
    assert (config.model_type, config.qkv_bias, config.rope.theta) == ("qwen2", True, 1e6)
    assert_runs_as_transformers(tmp_path / "qwen2-vl")


def test_what_tc_would_not_compute_as_transformers_does_is_refused():
    with pytest.raises(ConfigError, match="no text_config; the language model of a Qwen3VLForConditionalGeneration "
                                          "checkpoint is described there"):
        ModelConfig.from_dict({"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl"})
    text = {**SHAPES, "rms_norm_eps": 1e-6, "model_type": "qwen2_vl_text"}
    with pytest.raises(ConfigError, match="text_config = 7"):
        ModelConfig.from_dict({"architectures": ["Qwen2VLForConditionalGeneration"], "text_config": 7})
    sliding = {**text, "use_sliding_window": True}
    with pytest.raises(ConfigError, match="use_sliding_window"):
        ModelConfig.from_dict({"architectures": ["Qwen2VLForConditionalGeneration"], "text_config": sliding})
    unknown = {**text, "rope_parameters": {"rope_type": "mrope", "mrope_section": [2, 3, 3], "beta": 1.0}}
    with pytest.raises(ConfigError, match="beta"):  # a key no rotary type of tc's reads, MRoPE's set aside
        ModelConfig.from_dict({"architectures": ["Qwen2VLForConditionalGeneration"], "text_config": unknown})
