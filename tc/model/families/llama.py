"""Llama 2 and 3.x (llama3 rope scaling), SmolLM2, TinyLlama: the plain decoder, biases only where asked."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig, common_fields, flag


def parse(data: dict[str, Any]) -> ModelConfig:
    bias = flag(data, "attention_bias")  # transformers puts it on q, k, v and o alike
    return ModelConfig(**common_fields(data, "llama"), qkv_bias=bias, o_bias=bias,
                       mlp_bias=flag(data, "mlp_bias"))
