"""OLMo 2: Llama's attention and MLP with norms after each of them and none before, and q_norm and k_norm over
the whole of q_proj's and k_proj's outputs (all heads at once) before the rotation; its norms scale in fp32 before
rounding to the compute dtype, as Gemma's do, and q and k rotate in fp32 by fp32 tables, rounded once, as its
reference rotates them."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig, common_fields, flag


def parse(data: dict[str, Any]) -> ModelConfig:
    bias = flag(data, "attention_bias")  # on q, k, v and o alike
    return ModelConfig(**common_fields(data, "olmo2"), qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_whole=True,
                       sandwich_norms=True, pre_norms=False, norms_scale_in_fp32=True, rotate_in_fp32=True,
                       fp32_rotary_tables=True)
