"""ERNIE 4.5's dense models (ERNIE-4.5-0.3B: Ernie4_5ForCausalLM): Llama's layer with every head rotating in
interleaved pairs (2j, 2j + 1), which tc turns as its own pairs on q/k rows reordered as they load
(ModelConfig.rotary_rows), in fp32 by fp32 tables whatever the compute dtype, as its reference rotates; and
`use_bias` on every projection of attention and the MLP alike."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig, common_fields, flag

# Ernie4_5Config's where config.json leaves them out: 2 KV heads, heads of 128, rotary base 5e5, tied embeddings
ERNIE_DEFAULTS = {"num_key_value_heads": 2, "head_dim": 128, "rms_norm_eps": 1e-05}
ERNIE_THETA = 500000.0


def parse(data: dict[str, Any]) -> ModelConfig:
    bias = flag(data, "use_bias")
    return ModelConfig(**common_fields(data, "ernie4_5", tie_default=True, default_theta=ERNIE_THETA,
                                       defaults=ERNIE_DEFAULTS),
                       qkv_bias=bias, o_bias=bias, mlp_bias=bias, rotary_interleaved=True, rotate_in_fp32=True,
                       fp32_rotary_tables=True)
