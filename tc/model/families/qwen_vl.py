"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (image-text checkpoints) as the language model inside them, on text.

Their language model is Qwen2's layer (2-VL, 2.5-VL: q/k/v biases) or Qwen3's (3-VL: q and k norms) under a
multimodal rotary embedding (MRoPE): each token has three positions (time, height, width) and `mrope_section`
says which frequencies turn by which. A text token's three positions are one and the same, so on text MRoPE is the
ordinary rotary embedding at that position whatever the sections (interleaved, as Qwen3-VL's are, or not), and the
language model runs as the Qwen2 or Qwen3 family with the MRoPE keys set aside. The vision tower's tensors are
never read (weights.causal_lm_name reads the language model's under a causal LM's names).

Where the settings are, as transformers 5 reads them: Qwen2-VL and Qwen2.5-VL are published with the language
model's keys at config.json's top level, and saved since with a `text_config`; Qwen3-VL always has a text_config.
Qwen2(.5)-VL ties its lm_head to the embedding where the top level says so or text_config does (older saves kept
the flag there); Qwen3-VL where the top level says so; either keeps an lm_head of the checkpoint's own that differs
from the embedding (weights.own_lm_head), as transformers 5 does.
"""
from __future__ import annotations

from typing import Any, Callable

from ..config import ModelConfig, flag
from ..rope import ROPE_LAYOUTS
from . import qwen2, qwen3
from .image_text import as_read, language_model_settings

# the text config classes' rotary base and KV heads where config.json leaves them out (Qwen2VLTextConfig's, as
# Qwen2_5_VLTextConfig's; Qwen3VLTextConfig's), where not what tc's Qwen2 and Qwen3 families take
QWEN2_VL_THETA, QWEN2_VL_DEFAULTS = 1_000_000.0, {"num_key_value_heads": 8}
QWEN3_VL_THETA, QWEN3_VL_DEFAULTS = 500_000.0, {"num_key_value_heads": 32}
# what an MRoPE adds to a rotary setting: which frequencies read which of a token's three (equal, on text) positions
MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def _plain_rope(rope: Any) -> Any:
    """A rotary setting less its MRoPE keys; the "mrope" type is transformers' name for the default one there."""
    if not isinstance(rope, dict):
        return rope  # parse_rope says what is wrong with it
    rope = {key: value for key, value in rope.items() if key not in MROPE_KEYS}
    for key in ("rope_type", "type"):
        if rope.get(key) == "mrope":
            rope[key] = "default"
    return rope


def _image_text(data: dict[str, Any], parse: Callable[..., ModelConfig], default_theta: float,
                defaults: dict[str, Any], tied: bool, flat: bool) -> ModelConfig:
    """The language model's settings (image_text.language_model_settings: transformers builds the family's text
    config class whatever text_config's model_type says), its rotary settings as plain RoPE, parsed by `parse`."""
    settings = language_model_settings(data, None, flat=flat, defaults=defaults)
    for key in ROPE_LAYOUTS:
        if key in settings:
            settings[key] = _plain_rope(settings[key])
    return as_read(parse({**settings, "tie_word_embeddings": tied}, default_theta=default_theta), data)


def parse_qwen2_vl(data: dict[str, Any]) -> ModelConfig:
    """Qwen2-VL's and Qwen2.5-VL's language model (Qwen2VLForConditionalGeneration,
    Qwen2_5_VLForConditionalGeneration: one text model): Qwen2's layer, with their text config's defaults."""
    text = data.get("text_config")
    tied = flag(data, "tie_word_embeddings") or (isinstance(text, dict) and flag(text, "tie_word_embeddings"))
    return _image_text(data, qwen2.parse, QWEN2_VL_THETA, QWEN2_VL_DEFAULTS, tied, flat=True)


def parse_qwen3_vl(data: dict[str, Any]) -> ModelConfig:
    """Qwen3-VL's language model (Qwen3VLForConditionalGeneration): Qwen3's layer, with Qwen3VLTextConfig's
    defaults."""
    return _image_text(data, qwen3.parse, QWEN3_VL_THETA, QWEN3_VL_DEFAULTS, flag(data, "tie_word_embeddings"),
                       flat=False)
