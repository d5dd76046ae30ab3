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
the flag there); Qwen3-VL where the top level says so.
"""
from __future__ import annotations

from typing import Any, Callable

from ..config import ModelConfig, flag
from ..rope import ROPE_LAYOUTS
from . import qwen2, qwen3
from .image_text import as_read, language_model_settings
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


def _language_model(data: dict[str, Any], text_type: str, flat: bool) -> dict[str, Any]:
    """The language model's settings (image_text.language_model_settings), its rotary settings as plain RoPE."""
    settings = language_model_settings(data, text_type, flat=flat)
    for key in ROPE_LAYOUTS:
        if key in settings:
            settings[key] = _plain_rope(settings[key])
    return settings


def _image_text(data: dict[str, Any], text_type: str, parse: Callable[..., ModelConfig], default_theta: float,
                tied: bool, flat: bool) -> ModelConfig:
    settings = _language_model(data, text_type, flat)
    return as_read(parse({**settings, "tie_word_embeddings": tied}, default_theta=default_theta), data)


def parse_qwen2_vl(data: dict[str, Any], text_type: str = "qwen2_vl_text") -> ModelConfig:
    """Qwen2-VL's language model (Qwen2VLForConditionalGeneration): Qwen2's layer, a rotary base of 1e6 where
    config.json gives none (Qwen2VLTextConfig's)."""
    text = data.get("text_config")
    tied = flag(data, "tie_word_embeddings") or (isinstance(text, dict) and flag(text, "tie_word_embeddings"))
    return _image_text(data, text_type, qwen2.parse, 1_000_000.0, tied, flat=True)


def parse_qwen2_5_vl(data: dict[str, Any]) -> ModelConfig:
    """Qwen2.5-VL's language model (Qwen2_5_VLForConditionalGeneration): Qwen2-VL's, under its own type name."""
    return parse_qwen2_vl(data, "qwen2_5_vl_text")


def parse_qwen3_vl(data: dict[str, Any]) -> ModelConfig:
    """Qwen3-VL's language model (Qwen3VLForConditionalGeneration): Qwen3's layer, a rotary base of 5e5 where
    config.json gives none (Qwen3VLTextConfig's)."""
    return _image_text(data, "qwen3_vl_text", qwen3.parse, 500_000.0, flag(data, "tie_word_embeddings"),
                       flat=False)
