"""The language model inside an image-text checkpoint (Gemma 3's, Mistral 3's, Qwen's VL models), run on text.

Such a config.json describes the language model in `text_config` beside the vision tower's `vision_config`; the
family parses those settings as its text family does, with the top level's keys where text_config has none of
its own (eos_token_id), and what crosses the wire is config.json as read. The checkpoint's language model
tensors are read under a causal LM's names (weights.causal_lm_name) and the vision tower's are never read.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

from ..config import ConfigError, ModelConfig

# config.json keys of an image-text model that are not its language model's
IMAGE_TEXT_KEYS = ("architectures", "model_type", "text_config", "vision_config")


def language_model_settings(data: dict[str, Any], text_type: str, *, flat: bool = False,
                            default_text: dict[str, Any] | None = None) -> dict[str, Any]:
    """The language model's settings: text_config's over the top level's. Where there is no text_config, `flat`
    takes the top level's alone (the language model's keys kept there, as Qwen2(.5)-VL is published) and
    `default_text` stands in for it (the config class's default text model); else it is refused. Raises
    ConfigError for a text_config that is not a `text_type`'s."""
    text = data.get("text_config")
    outer = {key: value for key, value in data.items() if key not in IMAGE_TEXT_KEYS}
    if text is None:
        if flat:
            text = outer
        elif default_text is not None:
            text = default_text
        else:
            raise ConfigError(f"config.json has no text_config; the language model of a {data.get('architectures')} "
                              "checkpoint is described there")
    if not isinstance(text, dict):
        raise ConfigError(f"config.json sets text_config = {text!r}; expected the language model's settings")
    if text.get("model_type", text_type) != text_type:
        raise ConfigError(f"config.json's text_config sets model_type = {text.get('model_type')!r}; this "
                          f"checkpoint's language model is a {text_type}")
    return {**outer, **text}


def as_read(config: ModelConfig, data: dict[str, Any]) -> ModelConfig:
    """`config` carrying config.json as read, which is what crosses the wire: each worker parses it the same way."""
    return dataclasses.replace(config, source=copy.deepcopy(data))
