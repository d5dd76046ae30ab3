"""Mixture-of-experts families: Qwen2-MoE (with a gated shared expert), Qwen3-MoE (q/k norms) and Mixtral."""
from __future__ import annotations

from typing import Any

from ..config import ConfigError, Experts, ModelConfig, common_fields, flag, require, within_limit
from .qwen2 import refuse_sliding_window


def _sparse_layers(data: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """Which layers hold experts: every decoder_sparse_step-th one, except mlp_only_layers (transformers' rule)."""
    step = data.get("decoder_sparse_step", 1)
    only_mlp = set(data.get("mlp_only_layers") or [])
    if type(step) is not int or step < 1:
        raise ConfigError(f"config.json sets decoder_sparse_step = {step!r}; expected a positive integer")
    return tuple(i not in only_mlp and (i + 1) % step == 0 for i in range(layers))


def _qwen_experts(data: dict[str, Any], family: str, shared: bool) -> Experts:
    values = common_fields(data, family)
    # Qwen's published files say num_experts; transformers 5.x writes Mixtral's name, num_local_experts
    count_key = "num_experts" if data.get("num_experts") is not None else "num_local_experts"
    return Experts(count=within_limit(count_key, require(data, count_key, int, family)),
                   top_k=require(data, "num_experts_per_tok"),
                   intermediate_size=require(data, "moe_intermediate_size"),
                   normalize_top_k=flag(data, "norm_topk_prob"),
                   shared_intermediate_size=require(data, "shared_expert_intermediate_size") if shared else 0,
                   layers=_sparse_layers(data, values["num_hidden_layers"]))


def parse_qwen2_moe(data: dict[str, Any]) -> ModelConfig:
    refuse_sliding_window(data, "qwen2_moe")
    bias = "qkv_bias" not in data or flag(data, "qkv_bias")  # absent: transformers' Qwen2MoeConfig default
    return ModelConfig(**common_fields(data, "qwen2_moe"), qkv_bias=bias,
                       experts=_qwen_experts(data, "qwen2_moe", shared=True))


def parse_qwen3_moe(data: dict[str, Any]) -> ModelConfig:
    refuse_sliding_window(data, "qwen3_moe")
    bias = flag(data, "attention_bias")
    return ModelConfig(**common_fields(data, "qwen3_moe"), qkv_bias=bias, o_bias=bias, qk_norm=True,
                       experts=_qwen_experts(data, "qwen3_moe", shared=False))


def parse_mixtral(data: dict[str, Any]) -> ModelConfig:
    values = common_fields(data, "mixtral", default_theta=1_000_000.0)  # transformers' MixtralConfig default
    window = None if data.get("sliding_window") is None else require(data, "sliding_window")
    experts = Experts(count=within_limit("num_local_experts", require(data, "num_local_experts", int, "mixtral")),
                      top_k=require(data, "num_experts_per_tok"),
                      intermediate_size=values["intermediate_size"], normalize_top_k=True,
                      block_name="block_sparse_moe", projections=("w1", "w3", "w2"))
    return ModelConfig(**values, experts=experts,
                       sliding_windows=(window,) * values["num_hidden_layers"] if window else ())
