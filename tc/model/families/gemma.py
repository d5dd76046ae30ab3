"""Gemma 1, 2 and 3 (text): embeddings times sqrt(hidden), (1 + w) norms, gelu-tanh. Gemma 1 (CodeGemma, Gemma
1.1) is Llama's layer otherwise; Gemma 2 and 3 add norms after attention and the MLP, scale queries by
query_pre_attn_scalar and alternate sliding and global layers; Gemma 2 soft-caps attention scores and logits, Gemma
3 normalises q and k and gives its sliding layers a rotary base of their own. Gemma 3's image-text checkpoints run
as the Gemma 3 language model inside them, on text."""
from __future__ import annotations

import copy
import math
from typing import Any, Callable

from ..config import ConfigError, ModelConfig, common_fields, flag, layer_windows, require
from ..rope import Rope, parse_rope
from .image_text import as_read, language_model_settings

# What transformers' Gemma2Config and Gemma3TextConfig take for a key config.json leaves out, where it is not what
# every family takes (common_fields): a file that leaves them out (written by hand, or by a tool that writes only
# what differs from the defaults) runs as it does there.
GEMMA_DEFAULTS = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                  "hidden_activation": "gelu_pytorch_tanh"}
GEMMA2_DEFAULTS = {**GEMMA_DEFAULTS, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
# GemmaConfig's (Gemma 1): heads of 256, 16 KV heads rather than one per query head, and its own activation key
GEMMA1_DEFAULTS = {"head_dim": 256, "num_key_value_heads": 16, "hidden_act": "gelu_pytorch_tanh"}
GEMMA3_THETA, GEMMA3_LOCAL_THETA = 1_000_000.0, 10_000.0  # Gemma3TextConfig.default_theta: global and local
# Gemma3TextConfig's shapes, which an image-text checkpoint's text_config leaves out where they are these
GEMMA3_DEFAULTS = {**GEMMA_DEFAULTS, "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                   "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                   "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6}


def _refuse_bidirectional(data: dict[str, Any]) -> None:
    if flag(data, "use_bidirectional_attention"):  # EmbeddingGemma's: transformers then lets every token see all
        raise ConfigError("config.json sets use_bidirectional_attention = true; tc runs Gemma as a causal language "
                          "model, each token attending to those before it")


def parse_gemma(data: dict[str, Any]) -> ModelConfig:
    _refuse_bidirectional(data)
    # Gemma 1.0's files say hidden_act "gelu", which GemmaConfig reads as the tanh approximation the models were
    # trained with; transformers 4.x before 4.48 read hidden_activation instead (Gemma 1.1's files name it, leaving
    # hidden_act out), so a file whose two keys disagree runs differently by version, and is refused
    act = data.get("hidden_act")
    act = GEMMA1_DEFAULTS["hidden_act"] if act in ("gelu", None) else act
    other = data.get("hidden_activation")
    if other is not None and other != act:
        raise ConfigError(f"config.json sets hidden_activation = {other!r} and hidden_act = "
                          f"{data.get('hidden_act')!r}; transformers before 4.48 computes a Gemma's MLP with the "
                          f"first, later versions with {act!r}, so tc computes neither")
    values = common_fields({**data, "hidden_act": act}, "gemma", tie_default=True, defaults=GEMMA1_DEFAULTS)
    values["source"] = copy.deepcopy(data)
    bias = flag(data, "attention_bias")
    return ModelConfig(**values, qkv_bias=bias, o_bias=bias, norm_offset=1.0,
                       embedding_scale=math.sqrt(values["hidden_size"]))


def _gemma(data: dict[str, Any], family: str, slides: Callable[[int], bool], defaults: dict[str, Any],
           default_theta: float = 10_000.0) -> dict[str, Any]:
    """The fields Gemma 2 and 3 share; `slides(layer)` says which layers slide when config.json (as 4.x wrote
    it) lists no layer_types; `defaults` fill the keys config.json leaves out (an explicit null stays null)."""
    _refuse_bidirectional(data)
    values = common_fields(data, family, tie_default=True, act_key="hidden_activation", default_theta=default_theta,
                           defaults=defaults)
    data = {**defaults, **data}  # for the keys read here
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
    caps = {**GEMMA2_DEFAULTS, **data}  # soft caps the file leaves out are 50 and 30; null turns one off
    return ModelConfig(**_gemma(data, "gemma2", lambda i: i % 2 == 0, GEMMA2_DEFAULTS),
                       qkv_bias=flag(data, "attention_bias"), o_bias=flag(data, "attention_bias"),
                       attn_softcap=_cap(caps, "attn_logit_softcapping"),
                       final_softcap=_cap(caps, "final_logit_softcapping"))


def parse_gemma3(data: dict[str, Any]) -> ModelConfig:
    params = data.get("rope_parameters")
    per_type = isinstance(params, dict) and "full_attention" in params
    # the per-layer-type rope dict is read below; the rest as every family's
    # Gemma 3: every sliding_window_pattern-th layer attends globally, the others slide
    pattern = data.get("sliding_window_pattern", 6)
    if type(pattern) is not int or pattern < 1:
        raise ConfigError(f"config.json sets sliding_window_pattern = {pattern!r}; expected a positive integer")
    values = _gemma({k: v for k, v in data.items() if not (per_type and k == "rope_parameters")}, "gemma3_text",
                    lambda i: (i + 1) % pattern != 0, GEMMA3_DEFAULTS, GEMMA3_THETA)
    values["source"] = copy.deepcopy(data)
    # 4.x: the sliding layers turn at rope_local_base_freq, unscaled whatever rope_scaling does to the global ones
    local_theta = parse_rope({"rope_local_base_freq": data.get("rope_local_base_freq")}, "rope_local_base_freq",
                             GEMMA3_LOCAL_THETA).theta
    rope, local = values["rope"], Rope(local_theta)
    if per_type:  # 5.x: one rope per layer type, each taking the 4.x base where it names none
        context = {"max_position_embeddings": values["max_position_embeddings"]}  # Gemma3TextConfig's where left out
        rope = parse_rope({"rope_parameters": params["full_attention"], **context}, default_theta=rope.theta)
        local = parse_rope({"rope_parameters": params.get("sliding_attention"), **context}, default_theta=local_theta)
    values["rope"] = rope
    return ModelConfig(**values, qkv_bias=flag(data, "attention_bias"),
                       o_bias=flag(data, "attention_bias"), qk_norm=True,
                       attn_softcap=_cap(data, "attn_logit_softcapping"),
                       final_softcap=_cap(data, "final_logit_softcapping"), local_rope=local)


def parse_gemma3_image_text(data: dict[str, Any]) -> ModelConfig:
    """Gemma 3's image-text checkpoints (Gemma3ForConditionalGeneration: 4B, 12B, 27B) as the causal LM inside
    them, on text alone: `text_config` (Gemma3TextConfig's defaults where it leaves keys out, as transformers
    fills them), with the top level's token ids where it has none of its own (image_text.py). Whether the lm_head
    is the embedding is the top level's `tie_word_embeddings` (true where left out), as transformers 5 ties this
    class (text_config's copy of the flag is saved true whatever the top level says). The vision tower's tensors
    are never read (weights.causal_lm_name)."""
    settings = language_model_settings(data, "gemma3_text", default_text={})  # none: Gemma3Config's default
    cap = (data.get("text_config") or {}).get("final_logit_softcapping")
    if cap is not None:  # transformers 4's inner causal LM caps, 5's class never
        raise ConfigError(f"config.json's text_config sets final_logit_softcapping = {cap!r}, which transformers 4 "
                          "applies to this model's logits and transformers 5 does not, so tc computes neither")
    tied = {"tie_word_embeddings": data.get("tie_word_embeddings", True)}
    config = parse_gemma3({**settings, "model_type": "gemma3_text", **tied})
    return as_read(config, data)
