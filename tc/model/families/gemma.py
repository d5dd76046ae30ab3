"""Gemma 2 and Gemma 3 (text): embeddings times sqrt(hidden), (1 + w) norms before and after attention and the
MLP, gelu-tanh, queries scaled by query_pre_attn_scalar, sliding and global layers alternating; Gemma 2 soft-caps
attention scores and logits, Gemma 3 normalises q and k and gives its sliding layers a rotary base of their own."""
from __future__ import annotations

import copy
import math
from typing import Any, Callable

from ..config import ConfigError, ModelConfig, common_fields, flag, layer_windows, require
from ..rope import parse_rope


def _gemma(data: dict[str, Any], family: str, slides: Callable[[int], bool]) -> dict[str, Any]:
    """The fields Gemma 2 and 3 share; `slides(layer)` says which layers slide when config.json (as 4.x wrote
    it) lists no layer_types."""
    values = common_fields(data, family, tie_default=True, act_key="hidden_activation")
    scalar = require(data, "query_pre_attn_scalar", (int, float), family)
    windows = layer_windows(data, values["num_hidden_layers"])
    if not windows and data.get("sliding_window") is not None and data.get("layer_types") is None:
        windows = tuple(require(data, "sliding_window") if slides(i) else None
                        for i in range(values["num_hidden_layers"]))
    return {**values, "norm_offset": 1.0, "sandwich_norms": True, "embedding_scale": math.sqrt(values["hidden_size"]),
            "attn_scale": float(scalar) ** -0.5, "sliding_windows": windows}


def _cap(data: dict[str, Any], key: str) -> float | None:
    value = data.get(key)
    if value is not None and (type(value) not in (int, float) or value <= 0):
        raise ConfigError(f"config.json sets {key} = {value!r}; expected a positive number or null")
    return None if value is None else float(value)


def parse_gemma2(data: dict[str, Any]) -> ModelConfig:
    # Gemma 2 alternates: even layers slide, odd ones attend globally
    return ModelConfig(**_gemma(data, "gemma2", lambda i: i % 2 == 0), qkv_bias=flag(data, "attention_bias"),
                       o_bias=flag(data, "attention_bias"),
                       attn_softcap=_cap(data, "attn_logit_softcapping"),
                       final_softcap=_cap(data, "final_logit_softcapping"))


def parse_gemma3(data: dict[str, Any]) -> ModelConfig:
    params = data.get("rope_parameters")
    per_type = isinstance(params, dict) and "full_attention" in params
    # the per-layer-type rope dict is read below; the rest as every family's
    # Gemma 3: every sliding_window_pattern-th layer attends globally, the others slide
    pattern = data.get("sliding_window_pattern", 6)
    if type(pattern) is not int or pattern < 1:
        raise ConfigError(f"config.json sets sliding_window_pattern = {pattern!r}; expected a positive integer")
    values = _gemma({k: v for k, v in data.items() if not (per_type and k == "rope_parameters")}, "gemma3_text",
                    lambda i: (i + 1) % pattern != 0)
    values["source"] = copy.deepcopy(data)
    rope, local = values["rope"], values["rope"]
    if per_type:  # 5.x: one rope per layer type
        rope = parse_rope({"rope_parameters": params["full_attention"]})
        local = parse_rope({"rope_parameters": params.get("sliding_attention", params["full_attention"])})
    elif data.get("rope_local_base_freq") is not None:  # 4.x: the sliding layers' base beside rope_theta
        local = parse_rope({"rope_theta": data["rope_local_base_freq"]})
    values["rope"] = rope
    return ModelConfig(**values, qkv_bias=flag(data, "attention_bias"),
                       o_bias=flag(data, "attention_bias"), qk_norm=True,
                       attn_softcap=_cap(data, "attn_logit_softcapping"),
                       final_softcap=_cap(data, "final_logit_softcapping"), local_rope=local)
