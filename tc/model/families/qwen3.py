"""Qwen3: an RMSNorm over each query and key head (q_norm, k_norm), no q/k/v bias, its own head_dim."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig, common_fields, flag
from ..rope import DEFAULT_ROPE_THETA
from .qwen2 import refuse_sliding_window

# transformers' Qwen3Config takes heads of 128 where config.json names no head_dim, whatever hidden_size /
# num_attention_heads is (as every Qwen3 has them); null still derives it (transformers cannot run one)
DEFAULT_HEAD_DIM = 128


def parse(data: dict[str, Any], default_theta: float = DEFAULT_ROPE_THETA) -> ModelConfig:
    """`default_theta`: the rotary base where config.json gives none (Qwen3-VL's language model takes its own)."""
    refuse_sliding_window(data, "qwen3")
    bias = flag(data, "attention_bias")
    return ModelConfig(**common_fields(data, "qwen3", default_theta=default_theta,
                                       defaults={"head_dim": DEFAULT_HEAD_DIM}),
                       qkv_bias=bias, o_bias=bias, qk_norm=True)
