"""Granite 3.x: Llama with four multipliers. Embeddings times embedding_multiplier, attention scores times
attention_multiplier (in place of head_dim ** -0.5), attention's and the MLP's outputs times residual_multiplier
before each joins the residual, logits divided by logits_scaling."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig, common_fields, flag, positive_number

MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


def parse(data: dict[str, Any]) -> ModelConfig:
    # GraniteConfig's default for each is 1, the attention scale's included
    embedding, attention, residual, logits = (positive_number(data, key, 1.0) for key in MULTIPLIERS)
    bias = flag(data, "attention_bias")  # on q, k, v and o alike, as Llama's
    # the head multiplies the embeddings by the multiplier rounded to the compute dtype (as Gemma's scale), where
    # transformers rounds the product alone; Granite 3.x's, 12, is exact in every one of them
    return ModelConfig(**common_fields(data, "granite"), qkv_bias=bias, o_bias=bias, mlp_bias=flag(data, "mlp_bias"),
                       embedding_scale=None if embedding == 1 else embedding, attn_scale=attention,
                       residual_multiplier=None if residual == 1 else residual,
                       logits_scaling=None if logits == 1 else logits)
