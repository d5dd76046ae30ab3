"""Cohere's Command R, Aya 23 and Aya Expanse (CohereForCausalLM), Command R7B and Command A (Cohere2ForCausalLM):
one layer norm without a bias (the mean subtracted, scaled in fp32) before attention and the MLP side by side,
whose outputs join the residual together (a parallel block); whole heads rotating in interleaved pairs (q/k rows
reordered as they load, ModelConfig.rotary_rows), in fp32 whatever the compute dtype (by tables rounded to it), as
its reference rotates; tied embeddings; logits times logit_scale. Cohere 2 adds sliding-window layers that rotate
and, every sliding_window_pattern-th layer, full ones that rotate nothing (NoPE). Query and key layer norms
(use_qk_norm: Command R+) are refused."""
from __future__ import annotations

import copy
from typing import Any

from ..config import ConfigError, ModelConfig, common_fields, flag, hybrid_layers, positive_number
from ..rope import DEFAULT_ROPE_THETA

# CohereConfig's and Cohere2Config's where config.json leaves them out (Cohere's own rotary base; Cohere 2 takes 1e4)
DEFAULT_EPS, DEFAULT_LOGIT_SCALE, COHERE_THETA = 1e-5, 0.0625, 500000.0
COHERE2_WINDOW, COHERE2_PATTERN = 4096, 4


def parse_cohere(data: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**_fields(data, "cohere", COHERE_THETA), **_block(data))


def parse_cohere2(data: dict[str, Any]) -> ModelConfig:
    values = _fields(data, "cohere2")
    windows, types, _ = hybrid_layers(data, values["num_hidden_layers"], COHERE2_WINDOW, COHERE2_PATTERN)
    # only the sliding layers rotate: the full ones are NoPE
    return ModelConfig(**values, **_block(data), sliding_windows=windows,
                       rope_layers=tuple(kind == "sliding_attention" for kind in types))


def _fields(data: dict[str, Any], family: str, default_theta: float = DEFAULT_ROPE_THETA) -> dict[str, Any]:
    """common_fields, the norms' epsilon read from layer_norm_eps; `source` as given."""
    eps = positive_number(data, "layer_norm_eps", DEFAULT_EPS)
    values = common_fields({**data, "rms_norm_eps": eps}, family, tie_default=True, default_theta=default_theta)
    values["source"] = copy.deepcopy(data)
    return values


def _block(data: dict[str, Any]) -> dict[str, Any]:
    if flag(data, "use_qk_norm"):
        raise ConfigError("config.json sets use_qk_norm = true (Command R+'s query and key layer norms), which tc "
                          "does not compute yet")
    scale = positive_number(data, "logit_scale", DEFAULT_LOGIT_SCALE)
    bias = flag(data, "attention_bias")  # on q, k, v and o alike
    return dict(qkv_bias=bias, o_bias=bias, layer_norms=True, parallel_block=True, rotary_interleaved=True,
                rotate_in_fp32=True, logit_scale=scale)
