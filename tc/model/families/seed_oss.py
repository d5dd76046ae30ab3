"""Seed-OSS (ByteDance's Seed-OSS-36B: SeedOssForCausalLM): Llama's layer with biases on q/k/v
(`attention_bias`, on by default) apart from o_proj's (`attention_out_bias`, off by default)."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig, common_fields, flag

# SeedOssConfig's where config.json leaves them out: 8 KV heads, heads of 128
SEED_OSS_DEFAULTS = {"num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-06}


def parse(data: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**common_fields(data, "seed_oss", defaults=SEED_OSS_DEFAULTS),
                       qkv_bias=flag(data, "attention_bias", True), o_bias=flag(data, "attention_out_bias"),
                       mlp_bias=flag(data, "mlp_bias"))
