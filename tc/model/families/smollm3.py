"""SmolLM3: Llama's layer, except that some layers rotate neither queries nor keys (NoPE): config.json's
no_rope_layers (1: the layer rotates, 0: it does not) or, where that is absent, every no_rope_layer_interval-th
layer. With use_sliding_window, a sliding window on the layers layer_types names (SmolLM3Config's own rule where
it names none: the NoPE layers); SmolLM3-3B turns it off."""
from __future__ import annotations

from typing import Any

from ..config import ConfigError, ModelConfig, common_fields, flag, layer_windows, require

SMOLLM3_THETA = 2_000_000.0  # SmolLM3Config.default_theta: the rotary base where config.json gives none


def _rope_layers(data: dict[str, Any], layers: int) -> tuple[bool, ...]:
    listed = data.get("no_rope_layers")
    if listed is None:  # SmolLM3Config's rule: every interval-th layer goes without
        interval = data.get("no_rope_layer_interval", 4)
        if type(interval) is not int or interval < 1:
            raise ConfigError(f"config.json sets no_rope_layer_interval = {interval!r}; expected a positive integer")
        return tuple((i + 1) % interval != 0 for i in range(layers))
    # transformers reads entry i for layer i and lets the list run longer than the layers
    if not isinstance(listed, list) or len(listed) < layers or any(v not in (0, 1) or type(v) is float
                                                                  for v in listed):
        raise ConfigError(f"config.json sets no_rope_layers = {listed!r}; expected a 1 (RoPE) or 0 (none) for each "
                          f"of the {layers} layers")
    return tuple(bool(v) for v in listed[:layers])


def parse(data: dict[str, Any]) -> ModelConfig:
    values = common_fields(data, "smollm3", tie_default=True, default_theta=SMOLLM3_THETA)
    layers = values["num_hidden_layers"]
    rope_layers = _rope_layers(data, layers)
    sliding, window = flag(data, "use_sliding_window"), data.get("sliding_window")
    types = data.get("layer_types")
    if types is None:  # SmolLM3Config's rule: the NoPE layers slide, where a window is on
        types = ["sliding_attention" if sliding and window is not None and not rotates else "full_attention"
                 for rotates in rope_layers]
    elif isinstance(types, list) and "sliding_attention" in types and not (sliding and window is not None):
        # transformers' eager and SDPA masks then slide by layer_types, its flash attention by use_sliding_window
        raise ConfigError(f"config.json's layer_types holds sliding_attention with use_sliding_window = "
                          f"{data.get('use_sliding_window')!r} and sliding_window = {window!r}; transformers' "
                          "attention implementations disagree on such a layer, so tc computes none of them")
    if window is not None:
        require(data, "sliding_window")
    windows = layer_windows({"layer_types": types, "sliding_window": window}, layers)
    bias = flag(data, "attention_bias")  # on q, k, v and o alike, as Llama's
    return ModelConfig(**values, qkv_bias=bias, o_bias=bias, mlp_bias=flag(data, "mlp_bias"),
                       sliding_windows=windows, rope_layers=() if all(rope_layers) else rope_layers)
