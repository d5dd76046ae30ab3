"""Mistral: Llama with a sliding window on every layer where config.json sets one. Mistral Small 3.1 and 3.2's
image-text checkpoints run as the Mistral language model inside them, on text."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig, common_fields, flag, require
from .image_text import as_read, language_model_settings


def parse(data: dict[str, Any]) -> ModelConfig:
    values = common_fields(data, "mistral")
    # left out, it is transformers' MistralConfig default (4096, Mistral 7B v0.1's); null turns it off (v0.3)
    window = data.get("sliding_window", 4096)
    window = None if window is None else require({"sliding_window": window}, "sliding_window")
    return ModelConfig(**values, sliding_windows=(window,) * values["num_hidden_layers"] if window else ())


def parse_mistral3(data: dict[str, Any]) -> ModelConfig:
    """Mistral Small 3.1 / 3.2 (Mistral3ForConditionalGeneration): `text_config` as a Mistral's, tied where it
    says so (untied where it says nothing, MistralConfig's default). That is where transformers 4 reads the flag;
    transformers 5 reads the top level's (true where left out, as the published files leave it) but keeps the
    checkpoint's own lm_head where it holds one, and every published checkpoint does: the two agree there. A
    checkpoint with no lm_head of its own and no flag in text_config is refused for the missing tensor."""
    settings = language_model_settings(data, "mistral")
    tied = flag(data["text_config"], "tie_word_embeddings")
    return as_read(parse({**settings, "model_type": "mistral", "tie_word_embeddings": tied}), data)
