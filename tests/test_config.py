"""config.json as transformers 4.x and 5.x write it: the rotary base from either layout, and what tc refuses."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_helpers import OurModel, hf_logits, hf_model
from tc.model.config import ConfigError, Qwen2Config
from tiny_model import tiny_config, write_tiny_model

PROMPT = [5, 77, 200, 13, 42, 42, 9, 250, 31, 120, 64, 3]
QWEN25_THETA = 1_000_000.0  # Qwen2.5's rotary base; a reader that falls back to 10000 gets it wrong
_ABSENT = object()  # a key left out of config.json

# What transformers 4.4x's Qwen2Config.save_pretrained wrote (Qwen2.5's published config.json has these keys):
# rope_theta at the top level and rope_scaling null, no rope_parameters.
V4_KEYS = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": 256,
    "hidden_act": "silu", "initializer_range": 0.02, "max_window_layers": 28, "model_type": "qwen2",
    "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": QWEN25_THETA, "sliding_window": 4096,
    "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.45.2", "use_cache": True,
    "use_sliding_window": False,
}
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "vocab_size", "max_position_embeddings")


def write_v4_config(model_dir: Path, **changes) -> dict:
    shapes = {k: tiny_config()[k] for k in SHAPE_KEYS}
    config = {**V4_KEYS, **shapes, **changes}
    config = {k: v for k, v in config.items() if v is not _ABSENT}
    (model_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return config


def write_v5_config(model_dir: Path, **kwargs) -> dict:
    """config.json exactly as the installed transformers (5.x) saves it."""
    from transformers import Qwen2Config as HFQwen2Config

    shapes = {k: tiny_config()[k] for k in SHAPE_KEYS}
    HFQwen2Config(**shapes, eos_token_id=256, **kwargs).save_pretrained(str(model_dir))
    return json.loads((model_dir / "config.json").read_text(encoding="utf-8"))



def hf_theta(model_dir: Path) -> float:
    """The rotary base transformers itself resolves for this directory."""
    from transformers import AutoConfig

    return float(AutoConfig.from_pretrained(str(model_dir)).rope_parameters["rope_theta"])


def assert_logits_match_transformers(model_dir: Path) -> None:
    ours = OurModel(model_dir).full_logits(PROMPT)
    ref = hf_logits(hf_model(model_dir), PROMPT)
    assert (ours - ref).abs().max().item() < 1e-4


def test_v5_layout_reads_rope_parameters(tmp_path):
    model_dir = write_tiny_model(tmp_path, seed=4)
    written = write_v5_config(model_dir, rope_parameters={"rope_type": "default", "rope_theta": QWEN25_THETA})
    assert "rope_theta" not in written and written["rope_parameters"]["rope_theta"] == QWEN25_THETA
    config = Qwen2Config.from_file(model_dir / "config.json")
    assert config.rope_theta == QWEN25_THETA == hf_theta(model_dir)
    assert_logits_match_transformers(model_dir)


def test_v4_layout_reads_top_level_rope_theta(tmp_path):
    model_dir = write_tiny_model(tmp_path, seed=4)
    write_v4_config(model_dir)
    config = Qwen2Config.from_file(model_dir / "config.json")
    assert config.rope_theta == QWEN25_THETA == hf_theta(model_dir)
    assert_logits_match_transformers(model_dir)


@pytest.mark.parametrize("layout", ["v4", "v5"])
def test_an_absent_rope_theta_takes_what_transformers_takes(tmp_path, layout):
    model_dir = write_tiny_model(tmp_path, seed=4)
    if layout == "v4":
        write_v4_config(model_dir, rope_theta=_ABSENT)
    else:
        written = write_v5_config(model_dir)
        del written["rope_parameters"]["rope_theta"]  # a hand-trimmed file: rope_type alone
        (model_dir / "config.json").write_text(json.dumps(written))
    assert Qwen2Config.from_file(model_dir / "config.json").rope_theta == hf_theta(model_dir)


def test_the_wire_copy_of_a_v5_config_keeps_its_theta(tmp_path):
    """Workers parse ASSIGNMENT's config, which is to_dict() of the head's: it must give the same config back."""
    written = write_v5_config(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": QWEN25_THETA})
    config = Qwen2Config.from_dict(written)
    assert config.rope_theta == QWEN25_THETA
    assert Qwen2Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def v5(**changes) -> dict:
    base = {**{k: tiny_config()[k] for k in SHAPE_KEYS}, "model_type": "qwen2", "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": QWEN25_THETA}}
    return {**base, **changes}


def v4(**changes) -> dict:
    return {**{k: tiny_config()[k] for k in SHAPE_KEYS}, **V4_KEYS, **changes}


REFUSED = {
    "v5 longrope_v2": (v5(rope_parameters={"rope_type": "longrope_v2", "rope_theta": 1e6, "long_factor": [1.0],
                                           "short_factor": [1.0]}),
                       r"rope_parameters\.rope_type = 'longrope_v2'.*rope scaling is not supported"),
    "v4 su (old 'type' key)": (v4(rope_scaling={"type": "su", "long_factor": [1.0]}),
                               r"rope_scaling\.type = 'su'.*rope scaling is not supported"),
    "longrope outside Phi-3": (
        v5(rope_parameters={"rope_type": "longrope", "rope_theta": 1e6, "long_factor": [1.0], "short_factor": [1.0],
                            "original_max_position_embeddings": 64}),
        r"rope_parameters rope type 'longrope' for a model that is not Phi-3; tc computes longrope for "
        r"Phi3ForCausalLM only"),
    "dynamic from a shorter original context": (
        v4(rope_scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64}),
        r"original_max_position_embeddings = 64 below max_position_embeddings = 256"),
    "linear without a factor": (v5(rope_parameters={"rope_type": "linear", "rope_theta": 1e6}),
                                r"rope_parameters\.factor = None; rope_type 'linear' needs it"),
    "llama3 with a key it does not read": (
        v5(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192, "rope_theta": 1e6, "beta_fast": 32}),
        r"rope_parameters\.beta_fast = 32, which tc does not apply with rope_type 'llama3'"),
    "a factor on default rope": (v5(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "factor": 2.0}),
                                 r"rope_parameters\.factor = 2\.0"),
    "per-layer-type rope": (v5(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
                            r"rope_parameters\.full_attention"),
    "rope_parameters not a mapping": (v5(rope_parameters=[1e6]), r"rope_parameters = \[1000000\.0\]"),
    "partial rotary": (v4(partial_rotary_factor=0.5), r"partial_rotary_factor = 0\.5"),
    "two different thetas": (v5(rope_theta=10000.0), r"rope_theta = 10000\.0.*rope_parameters\.rope_theta = "),
    "a theta that is not a number": (v4(rope_theta="1e6"), r"rope_theta = '1e6'.*positive number"),
    "a zero theta": (v5(rope_parameters={"rope_type": "default", "rope_theta": 0}), r"rope_theta = 0"),
    "sliding window": (v4(use_sliding_window=True), r"use_sliding_window = True.*sliding window attention"),
    "gelu": (v4(hidden_act="gelu"), r"hidden_act = 'gelu'.*silu"),
    "an odd head_dim": (v4(head_dim=15), r"head_dim = 15; rotary embeddings need a positive even head size"),
    "an unknown architecture": (v4(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox"),
                                r"unsupported model: model_type='gpt_neox', architectures=\['GPTNeoXForCausalLM'\]; "
                                r"tc runs Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM"),
    "a known family with another head": (v4(architectures=["Qwen2ForSequenceClassification"]),
                                         r"architectures=\['Qwen2ForSequenceClassification'\]; tc runs"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_tc_cannot_honour_is_refused_by_name(case):
    data, message = REFUSED[case]
    with pytest.raises(ConfigError, match=message):
        Qwen2Config.from_dict(data)


@pytest.mark.parametrize("data", [
    v4(),
    v4(rope_scaling={"rope_type": "default"}),
    v4(use_sliding_window=False, sliding_window=32768, max_window_layers=21),
    v4(hidden_act=_ABSENT),  # transformers' default is silu
    v4(head_dim=16, partial_rotary_factor=1.0),  # what tc computes anyway
    v5(rope_theta=QWEN25_THETA),  # both layouts, agreeing
    v5(rope_parameters={"rope_theta": QWEN25_THETA}),  # rope_type absent means default
    v4(rope_scaling={"type": "dynamic", "factor": 2.0}),  # old 'type' key; plain inside the context
    v4(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),  # Qwen2.5's
], ids=["v4", "v4 default scaling", "sliding window off", "no hidden_act", "matching head_dim", "both layouts",
        "no rope_type", "v4 dynamic", "v4 yarn"])
def test_what_tc_can_honour_loads(data):
    data = {k: v for k, v in data.items() if v is not _ABSENT}
    assert Qwen2Config.from_dict(data).rope_theta == QWEN25_THETA
