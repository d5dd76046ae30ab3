"""Granite 3.x: Llama with four multipliers. Embeddings times embedding_multiplier, attention scores times
attention_multiplier (in place of head_dim ** -0.5), attention's and the MLP's outputs times residual_multiplier
before each joins the residual, logits divided by logits_scaling."""
from __future__ import annotations

import math
from typing import Any

from ..config import ConfigError, ModelConfig, common_fields, flag

MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


def _multiplier(data: dict[str, Any], key: str) -> float:
    value = data.get(key, 1.0)  # GraniteConfig's default for each, the attention scale's included
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"config.json sets {key} = {value!r}; expected a positive number")
    return float(value)


def parse(data: dict[str, Any]) -> ModelConfig:
    embedding, attention, residual, logits = (_multiplier(data, key) for key in MULTIPLIERS)
    bias = flag(data, "attention_bias")  # on q, k, v and o alike, as Llama's
    # the head multiplies the embeddings by the multiplier rounded to the compute dtype (as Gemma's scale), where
    # transformers rounds the product alone; Granite 3.x's, 12, is exact in every one of them
    return ModelConfig(**common_fields(data, "granite"), qkv_bias=bias, o_bias=bias, mlp_bias=flag(data, "mlp_bias"),
                       embedding_scale=None if embedding == 1 else embedding, attn_scale=attention,
                       residual_multiplier=None if residual == 1 else residual,
                       logits_scaling=None if logits == 1 else logits)
