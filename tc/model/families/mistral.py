"""Mistral: Llama with a sliding window on every layer where config.json sets one. Mistral Small 3.1 and 3.2's
image-text checkpoints run as the Mistral language model inside them, on text."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig, common_fields, flag, require
from .image_text import as_read, language_model_settings


# MistralConfig's where config.json leaves it out (not one KV head per query head)
MISTRAL_DEFAULTS = {"num_key_value_heads": 8}


def parse(data: dict[str, Any]) -> ModelConfig:
    values = common_fields(data, "mistral", defaults=MISTRAL_DEFAULTS)
    # left out, it is transformers' MistralConfig default (4096, Mistral 7B v0.1's); null turns it off (v0.3)
    window = data.get("sliding_window", 4096)
    window = None if window is None else require({"sliding_window": window}, "sliding_window")
    return ModelConfig(**values, sliding_windows=(window,) * values["num_hidden_layers"] if window else ())


def parse_mistral3(data: dict[str, Any]) -> ModelConfig:
    """Mistral Small 3.1 / 3.2 (Mistral3ForConditionalGeneration): `text_config` as a Mistral's, tied where the top
    level says so (true where left out, Mistral3Config's), as transformers 5 ties this class. The published files
    leave it out and hold an lm_head of their own, which the head then uses, as transformers 5 does
    (weights.own_lm_head)."""
    settings = language_model_settings(data, "mistral")
    tied = flag(data, "tie_word_embeddings", True)
    return as_read(parse({**settings, "model_type": "mistral", "tie_word_embeddings": tied}), data)
