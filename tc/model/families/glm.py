"""GLM-4 (glm-4-9b-chat-hf, GLM-Edge: GlmForCausalLM) and GLM-4-0414 (GLM-4-9B/32B-0414, GLM-Z1:
Glm4ForCausalLM): Llama's layer with biases on q/k/v alone (none on o_proj), gate/up stored fused as gate_up_proj,
and the first partial_rotary_factor (half, where config.json names none) of each head rotating in interleaved
pairs (2j, 2j + 1), which tc turns as its own pairs on q/k rows reordered as they load (ModelConfig.rotary_rows).
GLM-4-0414 adds Gemma 2's sandwich norms, rounded as Llama's, under names of its own."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig, common_fields, flag

# GlmConfig's and Glm4Config's where config.json leaves them out: 2 KV heads and heads of 128 whatever
# hidden_size / num_attention_heads gives, and half of each head rotating (where neither the top level nor the
# rotary dict names a factor)
GLM_DEFAULTS = {"num_key_value_heads": 2, "head_dim": 128, "rms_norm_eps": 1.5625e-07}
DEFAULT_PARTIAL_ROTARY = 0.5
# tc's sandwich norms (Gemma 2's names) -> GLM-4-0414's: after attention, before the MLP, after the MLP
GLM4_NORMS = (("post_attention_layernorm.weight", "post_self_attn_layernorm.weight"),
              ("pre_feedforward_layernorm.weight", "post_attention_layernorm.weight"),
              ("post_feedforward_layernorm.weight", "post_mlp_layernorm.weight"))


def parse_glm(data: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**_fields(data, "glm"), **_attention(data))


def parse_glm4(data: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**_fields(data, "glm4"), **_attention(data), sandwich_norms=True,
                       checkpoint_names=GLM4_NORMS)


def _fields(data: dict[str, Any], family: str) -> dict[str, Any]:
    return common_fields(data, family, defaults=GLM_DEFAULTS, partial_rotary=True,
                         default_partial_rotary=DEFAULT_PARTIAL_ROTARY)


def _attention(data: dict[str, Any]) -> dict[str, Any]:
    return dict(qkv_bias=flag(data, "attention_bias", True), rotary_interleaved=True, fused_gate_up=True)
