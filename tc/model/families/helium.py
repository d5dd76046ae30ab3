"""Helium (Kyutai's helium-1-2b: HeliumForCausalLM): Llama's layer with every head rotating in interleaved pairs
(2j, 2j + 1), turned as tc's own pairs on q/k rows reordered as they load (ModelConfig.rotary_rows), norms that
scale in fp32 before rounding to the compute dtype (as OLMo 2's), and biases on q/k/v only where asked."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig, common_fields, flag

# HeliumConfig's where config.json leaves them out: 20 KV heads (its query heads' number), heads of 128, eps 1e-8,
# rotary base 1e5
HELIUM_DEFAULTS = {"num_key_value_heads": 20, "head_dim": 128, "rms_norm_eps": 1e-08}
HELIUM_THETA = 100000.0


def parse(data: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**common_fields(data, "helium", default_theta=HELIUM_THETA, defaults=HELIUM_DEFAULTS),
                       qkv_bias=flag(data, "attention_bias"), mlp_bias=flag(data, "mlp_bias"),
                       norms_scale_in_fp32=True, rotary_interleaved=True)
