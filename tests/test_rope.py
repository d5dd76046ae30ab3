"""Rotary scaling as config.json carries it: our inverse frequencies and cos/sin factor against transformers'
own ROPE_INIT_FUNCTIONS, bit for bit."""
from __future__ import annotations

import pytest
import torch

from tc.model.config import ConfigError
from tc.model.qwen2 import Rotary
from tc.model.rope import attention_scaling, inv_freq, parse_rope

HEAD_DIM = 64
CONTEXT = 4096
SCALINGS = {
    "default": {"rope_type": "default", "rope_theta": 1e6},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "llama3 (Llama 3.1's)": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    "yarn (Qwen2.5's)": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                         "rope_theta": 1e6},
    "yarn with betas and mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                                   "beta_fast": 16, "beta_slow": 2, "mscale": 0.7, "mscale_all_dim": 0.5,
                                   "rope_theta": 10000.0},
    "yarn without its original context": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
    "llama3 without its original context": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "rope_theta": 500000.0},
    "yarn with its attention factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                                       "attention_factor": 1.2, "truncate": False, "rope_theta": 1e6},
}


def hf_rope(parameters: dict) -> tuple[torch.Tensor, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=CONTEXT,
                         rope_parameters=dict(parameters))
    kind = parameters["rope_type"]
    if kind == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[kind](config, "cpu")


@pytest.mark.parametrize("name", SCALINGS)
def test_inverse_frequencies_and_factor_equal_transformers(name):
    rope = parse_rope({"rope_parameters": SCALINGS[name], "max_position_embeddings": CONTEXT})
    want_freq, want_factor = hf_rope(SCALINGS[name])
    assert torch.equal(inv_freq(rope, HEAD_DIM), want_freq)
    assert attention_scaling(rope) == pytest.approx(want_factor, rel=0, abs=0)


@pytest.mark.parametrize("given", [{}, {"factor": 8.0}, {"attention_factor": 1.3}])
@pytest.mark.parametrize("served", [CONTEXT // 8, CONTEXT // 8 + 1, CONTEXT])
def test_longrope_frequencies_and_factor_equal_transformers(given, served):
    """Phi-3.5-mini's kind (a pre-training context an eighth of the model's): the list transformers takes for a
    sequence of `served` positions, which tc takes for every sequence of a context of that many; the attention
    factor from `factor`, from the two contexts where the file gives none, or as given."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    lists = {"short_factor": [1.0 + i / 16 for i in range(HEAD_DIM // 2)],
             "long_factor": [1.0 + i for i in range(HEAD_DIM // 2)]}
    parameters = {"rope_type": "longrope", "rope_theta": 10000.0, **lists, **given}
    data = {"hidden_size": HEAD_DIM * 4, "num_attention_heads": 4, "max_position_embeddings": CONTEXT,
            "original_max_position_embeddings": CONTEXT // 8}
    rope = parse_rope({**data, "rope_scaling": parameters}, longrope=True)
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["longrope"](Phi3Config(**data, rope_parameters=dict(parameters)),
                                                             "cpu", seq_len=served)
    assert torch.equal(inv_freq(rope, HEAD_DIM, context=served), want_freq)
    assert attention_scaling(rope) == pytest.approx(want_factor, rel=0, abs=0) and want_factor > 1
    with pytest.raises(ValueError, match="longrope's frequencies depend on the context served"):
        inv_freq(rope, HEAD_DIM)
    with pytest.raises(ConfigError, match="tc computes longrope for Phi3ForCausalLM only"):
        parse_rope({**data, "rope_scaling": parameters})


def test_the_tables_carry_yarns_factor():
    rope = parse_rope({"rope_parameters": SCALINGS["yarn (Qwen2.5's)"], "max_position_embeddings": CONTEXT})
    cos, _ = Rotary(HEAD_DIM, rope, "cpu").tables(0, 1, torch.float32)
    assert attention_scaling(rope) > 1 and cos[0, 0, 0].item() == pytest.approx(attention_scaling(rope))


@pytest.mark.parametrize(("parameters", "message"), [
    ({"rope_type": "yarn", "original_max_position_embeddings": 1024, "rope_theta": 1e6},
     r"factor = None; rope_type 'yarn' needs it"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 8192}, r"high_freq_factor <= low_freq_factor"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": "32"},
     r"beta_fast = '32'"),
    ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}, r"low_freq_factor = 1\.0, which tc does not "
                                                                      r"apply with rope_type 'linear'"),
])
def test_an_incomplete_or_foreign_scaling_is_refused(parameters, message):
    with pytest.raises(ConfigError, match=message):
        parse_rope({"rope_parameters": parameters, "max_position_embeddings": CONTEXT})


def test_table_addresses_are_where_the_tables_rows_are_and_grow_them():
    rotary = Rotary(8, 10000.0, "cpu")
    cos_at, sin_at = rotary.table_addresses(300, torch.bfloat16)  # past the first tables' 256 positions
    assert rotary.size >= 300
    cos, sin = rotary.tables(299, 1, torch.bfloat16)  # [1, 1, D]: row 299
    assert cos.data_ptr() == cos_at + 299 * 8 * 2 and sin.data_ptr() == sin_at + 299 * 8 * 2
    assert rotary.table_addresses(10, torch.bfloat16) == (cos_at, sin_at)  # covered: the same tables
