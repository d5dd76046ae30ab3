"""The language model inside an image-text checkpoint (Gemma 3's, Mistral 3's, Qwen's VL models), run on text.

Such a config.json describes the language model in `text_config` beside the vision tower's `vision_config`; the
family parses those settings as its text family does, with the top level's token ids where text_config has none
of its own, and what crosses the wire is config.json as read. The checkpoint's language model tensors are read
under a causal LM's names (weights.causal_lm_name) and the vision tower's are never read.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

from ..config import ConfigError, ModelConfig

# config.json keys of an image-text model that are not its language model's
IMAGE_TEXT_KEYS = ("architectures", "model_type", "text_config", "vision_config")
# the top level's keys a language model's settings take where text_config has none of its own
TOKEN_KEYS = ("eos_token_id", "bos_token_id", "pad_token_id")


def language_model_settings(data: dict[str, Any], text_type: str | None, *, flat: bool = False,
                            default_text: dict[str, Any] | None = None,
                            defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The language model's settings, as transformers 5 builds its text config: text_config's, with the text
    config class's `defaults` for keys it leaves out where they are not what tc's text family takes (an explicit
    null stays null), and the top level's token ids where it names none (transformers' generation reads them there).
    No other key of the top level: transformers reads none of them once there is a text_config. Where there is
    none, `flat` takes the top level's keys (the language model's kept there, as Qwen2(.5)-VL is published) and
    `default_text` stands in for it (the config class's default text model); else it is refused. Raises
    ConfigError for a text_config that is not a `text_type`'s (None: any, where transformers builds one class
    whatever it says)."""
    text = data.get("text_config")
    outer = {key: value for key, value in data.items() if key not in IMAGE_TEXT_KEYS}
    if text is None and flat:
        return {**(defaults or {}), **outer}
    if text is None and default_text is None:
        architectures = data.get("architectures") or [data.get("model_type")]
        raise ConfigError(f"config.json has no text_config; the language model of a {architectures[0]} checkpoint "
                          "is described there")
    text = default_text if text is None else text
    if not isinstance(text, dict):
        raise ConfigError(f"config.json sets text_config = {text!r}; expected the language model's settings")
    if text_type is not None and text.get("model_type", text_type) != text_type:
        raise ConfigError(f"config.json's text_config sets model_type = {text.get('model_type')!r}; this "
                          f"checkpoint's language model is a {text_type}")
    tokens = {key: outer[key] for key in TOKEN_KEYS if key in outer}
    return {**(defaults or {}), **tokens, **text}


def as_read(config: ModelConfig, data: dict[str, Any]) -> ModelConfig:
    """`config` carrying config.json as read, which is what crosses the wire: each worker parses it the same way."""
    return dataclasses.replace(config, source=copy.deepcopy(data))
