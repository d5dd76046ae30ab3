"""EXAONE 4.0: OLMo 2's norms (after attention and the MLP, none before) with Qwen3's q and k norms over each head,
and, where config.json sets a sliding window, hybrid attention: the layers layer_types names sliding attend within
the window and rotate q and k, the full-attention layers rotate nothing (NoPE). Without a window every layer
attends to the whole context and rotates (EXAONE 4.0 1.2B)."""
from __future__ import annotations

from typing import Any

from ..config import ConfigError, ModelConfig, common_fields, layer_windows, require

EXAONE4_WINDOW, EXAONE4_PATTERN = 4096, 4  # Exaone4Config's sliding_window and sliding_window_pattern defaults
EXAONE4_DEFAULTS = {"num_key_value_heads": 32}  # Exaone4Config's where left out (not one KV head per query head)


def _layer_types(data: dict[str, Any], layers: int, window: int | None) -> list[str]:
    """layer_types, or Exaone4Config's rule where config.json names none: every pattern-th layer full, the rest
    sliding (the rule needs a window and a whole number: transformers fails on a file without them)."""
    types = data.get("layer_types")
    if types is not None:
        return types
    pattern = data.get("sliding_window_pattern", EXAONE4_PATTERN)
    if window is None or type(pattern) is not int or pattern < 1:
        raise ConfigError(f"config.json names no layer_types, with sliding_window = {window!r} and "
                          f"sliding_window_pattern = {pattern!r}; give layer_types (a \"sliding_attention\" or "
                          "\"full_attention\" per layer), as EXAONE 4.0's files do")
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def parse(data: dict[str, Any]) -> ModelConfig:
    values = common_fields(data, "exaone4", defaults=EXAONE4_DEFAULTS)
    layers = values["num_hidden_layers"]
    window = data.get("sliding_window", EXAONE4_WINDOW)
    if window is not None:
        require({"sliding_window": window}, "sliding_window")
    types = _layer_types(data, layers, window)
    if window is None and isinstance(types, list) and "sliding_attention" in types:
        raise ConfigError("config.json sets sliding_window = null while layer_types holds sliding_attention; "
                          "transformers' sliding layers need a window")
    windows = layer_windows({"layer_types": types, "sliding_window": window}, layers)
    # with a window, only the sliding layers rotate (none, where none slides); without one, every layer does
    rope_layers = tuple(kind == "sliding_attention" for kind in types) if window is not None else ()
    return ModelConfig(**values, qk_norm=True, sandwich_norms=True, pre_norms=False, sliding_windows=windows,
                       rope_layers=rope_layers)
