"""OLMo 3: OLMo 2's layer (norms after attention and the MLP, q_norm and k_norm over all heads at once) with a
sliding window on the layers layer_types names (Olmo3Config's rule where it names none: all but every fourth),
which turn at a rotary base of their own: rope_parameters per layer type, as transformers 5.x writes it, or, in
4.x's layout, rope_theta and rope_scaling for the full-attention layers and plain RoPE at 500000 for the others."""
from __future__ import annotations

import copy
from typing import Any

from ..config import ConfigError, ModelConfig, common_fields, flag, layer_windows
from ..rope import Rope, parse_rope

OLMO3_THETA = 500_000.0  # Olmo3Config.default_theta
OLMO3_WINDOW = 4096  # Olmo3Config's sliding_window where config.json leaves it out; null turns it off


def parse(data: dict[str, Any]) -> ModelConfig:
    params = data.get("rope_parameters")
    per_type = isinstance(params, dict) and bool({"full_attention", "sliding_attention"} & set(params))
    if per_type and data.get("rope_scaling") is not None:
        # Olmo3Config folds it into the full-attention layers' entry; two places for one thing, so keep one
        raise ConfigError(f"config.json sets rope_scaling = {data['rope_scaling']!r} beside rope_parameters by layer "
                          "type; give the scaling in rope_parameters.full_attention alone")
    values = common_fields({k: v for k, v in data.items() if not (per_type and k == "rope_parameters")}, "olmo3",
                           default_theta=OLMO3_THETA)
    values["source"] = copy.deepcopy(data)
    rope = values["rope"]
    if per_type:  # each type's base where it names one; else 5.x's: rope_theta or 500000 full, 500000 sliding
        context = {"max_position_embeddings": data.get("max_position_embeddings")}
        local = parse_rope({"rope_parameters": params.get("sliding_attention"), **context}, default_theta=OLMO3_THETA)
        rope = parse_rope({"rope_parameters": params.get("full_attention"), **context}, default_theta=rope.theta)
    elif rope.theta != OLMO3_THETA:
        # transformers 4.x turns the sliding layers at rope_theta, 5.x at 500000 whatever rope_theta says
        raise ConfigError(f"config.json sets rope_theta = {data.get('rope_theta')!r} without rope_parameters by "
                          "layer type; transformers 4.x turns the sliding layers at that base, 5.x at "
                          f"{OLMO3_THETA:g}, so tc computes neither")
    else:
        local = Rope(OLMO3_THETA)
    values["rope"] = rope
    layers = values["num_hidden_layers"]
    types = data.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
    window = data.get("sliding_window", OLMO3_WINDOW)
    if window is None and isinstance(types, list) and "sliding_attention" in types:
        raise ConfigError("config.json sets sliding_window = null while layer_types holds sliding_attention; "
                          "transformers' sliding layers need a window")
    windows = layer_windows({"layer_types": types, "sliding_window": window}, layers)
    bias = flag(data, "attention_bias")  # on q, k, v and o alike
    return ModelConfig(**values, qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_whole=True,
                       sandwich_norms=True, pre_norms=False, norms_scale_in_fp32=True, sliding_windows=windows,
                       local_rope=local, rotate_in_fp32=True, fp32_rotary_tables=True)  # rotated as OLMo 2's
