"""Mistral: Llama with a sliding window on every layer where config.json sets one. Mistral Small 3.1 and 3.2's
image-text checkpoints run as the Mistral language model inside them, on text; Ministral 3's as the Ministral 3
one (yarn, and queries scaled by position past the original context)."""
from __future__ import annotations

import copy
import math
from typing import Any

from ..config import ConfigError, ModelConfig, common_fields, flag, require
from ..rope import ROPE_LAYOUTS
from .image_text import as_read, language_model_settings


# MistralConfig's where config.json leaves it out (not one KV head per query head)
MISTRAL_DEFAULTS = {"num_key_value_heads": 8}
# Ministral3Config's where config.json leaves them out, its rotary embedding included
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                   "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
                   "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}
MINISTRAL3_OWN_KEYS = ("llama_4_scaling_beta", "max_position_embeddings")  # in its rotary dict, not the rotation's
MINISTRAL3_DEFAULTS = {"num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "vocab_size": 131072,
                       "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 34,
                       "num_attention_heads": 32, "max_position_embeddings": 262144}


def parse(data: dict[str, Any]) -> ModelConfig:
    values = common_fields(data, "mistral", defaults=MISTRAL_DEFAULTS)
    # left out, it is transformers' MistralConfig default (4096, Mistral 7B v0.1's); null turns it off (v0.3)
    return ModelConfig(**values, sliding_windows=_windows(data, 4096, values["num_hidden_layers"]))


def _windows(data: dict[str, Any], default: int | None, layers: int) -> tuple[int, ...]:
    """Every layer's sliding window: config.json's `sliding_window` (`default`, the config class's, where left
    out) on each of the `layers`; () where it is null (or 0). Raises ConfigError for one that is not a whole
    number."""
    window = data.get("sliding_window", default)
    window = None if window is None else require({"sliding_window": window}, "sliding_window")
    return (window,) * layers if window else ()


def parse_ministral3(data: dict[str, Any]) -> ModelConfig:
    """Ministral 3 (Ministral3ForCausalLM, and the language model of its image-text checkpoints): Mistral's layers
    under yarn, each query scaled by its position once rotated, past the original context (`query_scaling`)."""
    source = copy.deepcopy(data)  # config.json as read: what crosses the wire, for each worker to read the same way
    if all(data.get(key) is None for key in ROPE_LAYOUTS):
        data = {**data, "rope_parameters": MINISTRAL3_ROPE}
    ropes = {key: data[key] for key in ROPE_LAYOUTS if data.get(key) is not None}
    for key, rope in ropes.items():
        if not isinstance(rope, dict):
            raise ConfigError(f"config.json sets {key} = {rope!r}; expected an object such as "
                              '{"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 16384, ...}')
    # the rotary embedding's own keys go to common_fields; the query scaling's are read here, and the model's
    # context that Ministral3Config writes beside them is read at the top level, as transformers reads it
    values = common_fields({**data, **{key: {k: v for k, v in rope.items() if k not in MINISTRAL3_OWN_KEYS}
                                       for key, rope in ropes.items()}}, "ministral3", defaults=MINISTRAL3_DEFAULTS)
    values["source"] = source
    key, rope = next(iter(ropes.items()))  # the one common_fields reads where both are given (alike, or refused)
    beta = rope.get("llama_4_scaling_beta")
    # where the rotary embedding names no original context, transformers takes the model's, as tc's yarn does
    original = rope.get("original_max_position_embeddings", values["max_position_embeddings"])
    # transformers scales every query by these two, and fails without either
    if type(beta) not in (int, float) or not 0 <= beta < math.inf \
            or type(original) not in (int, float) or not 0 < original < math.inf or original != int(original):
        raise ConfigError(f"config.json sets {key}.llama_4_scaling_beta = {beta!r} and "
                          f"{key}.original_max_position_embeddings = {original!r}; Ministral 3 scales its queries "
                          "by both: a non-negative number, and a whole number of positions such as 16384")
    # no window where config.json names none, as Ministral3Config takes it
    return ModelConfig(**values, sliding_windows=_windows(data, None, values["num_hidden_layers"]),
                       query_scaling=(float(beta), int(original)))


def parse_mistral3(data: dict[str, Any]) -> ModelConfig:
    """Mistral Small 3.1 / 3.2 and Ministral 3 (Mistral3ForConditionalGeneration): `text_config` as a Mistral's (or
    a Ministral 3's, where it says so), tied where the top level says so (true where left out, Mistral3Config's), as
    transformers 5 ties this class. The published files leave it out and hold an lm_head of their own, which the
    head then uses, as transformers 5 does (weights.own_lm_head)."""
    text = data.get("text_config")
    ministral3 = isinstance(text, dict) and text.get("model_type") == "ministral3"
    settings = language_model_settings(data, "ministral3" if ministral3 else "mistral")
    tied = flag(data, "tie_word_embeddings", True)
    if ministral3:
        return as_read(parse_ministral3({**settings, "tie_word_embeddings": tied}), data)
    return as_read(parse({**settings, "model_type": "mistral", "tie_word_embeddings": tied}), data)
