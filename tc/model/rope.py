"""Rotary position embedding parameters: what config.json says, and the inverse frequencies it implies.

Two layouts are in use. transformers 4.x writes the rotary base at the top level (`rope_theta`) beside
`rope_scaling` (null, or a dict naming a scaling type); transformers 5.x writes `rope_parameters`
({rope_type, rope_theta, ...}) instead. Both are read, and a base given in both places must agree.

Scaling types tc computes, each as transformers' ROPE_INIT_FUNCTIONS does: `default`, `linear` (frequencies
divided by `factor`) and `llama3` (low frequencies divided by `factor`, high ones kept, a smooth ramp between).
Anything else (`dynamic`, `yarn`, `longrope`, partial rotary) is refused by name rather than run wrongly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ConfigError

# What transformers takes when config.json names no rotary base, in both layouts: 4.x's configs default
# rope_theta to 10000.0, and 5.x's fall back to RotaryEmbeddingConfigMixin.default_theta, also 10000.0.
DEFAULT_ROPE_THETA = 10000.0
ROPE_LAYOUTS = ("rope_scaling", "rope_parameters")
# The keys each scaling type reads ("type" is the older spelling of "rope_type"); any other key changes RoPE in
# a way tc does not compute, so it is refused.
COMMON_KEYS = ("rope_type", "type", "rope_theta")
SCALING_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class Rope:
    """One rotary embedding: its base, and its scaling type with that type's parameters (sorted (key, value))."""

    theta: float
    type: str = "default"
    params: tuple[tuple[str, float], ...] = ()

    def param(self, name: str) -> float:
        return dict(self.params)[name]


def parse_rope(data: dict[str, Any], theta_key: str = "rope_theta") -> Rope:
    """The rotary embedding config.json gives, from either layout. Raises ConfigError for RoPE tc cannot compute.

    `theta_key` names the top-level base (Gemma 3's sliding layers read `rope_local_base_freq`).
    """
    found: dict[str, Any] = {}
    if data.get(theta_key) is not None:
        found[theta_key] = data[theta_key]
    scaling: tuple[str, dict[str, Any]] | None = None
    for key in ROPE_LAYOUTS:
        rope = data.get(key)
        if rope is None:  # 4.x writes "rope_scaling": null for plain RoPE
            continue
        if not isinstance(rope, dict):
            raise ConfigError(f"config.json sets {key} = {rope!r}; expected an object such as "
                              '{"rope_type": "default", "rope_theta": 1000000.0}')
        rope_type = _scaling_type(key, rope)
        if rope_type != "default":
            if scaling is not None and (scaling[1] != rope):
                raise ConfigError(f"config.json sets both {scaling[0]} and {key} to different rope scalings; "
                                  "keep one of them")
            scaling = (key, rope)
        if rope.get("rope_theta") is not None:
            found[f"{key}.rope_theta"] = rope["rope_theta"]
    for where, value in found.items():
        if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"config.json sets {where} = {value!r}; the rotary base must be a positive number")
    if len({float(v) for v in found.values()}) > 1:
        given = ", ".join(f"{where} = {value!r}" for where, value in found.items())
        raise ConfigError(f"config.json gives two rotary bases ({given}); keep one of them")
    theta = float(next(iter(found.values()), DEFAULT_ROPE_THETA))
    if scaling is None:
        return Rope(theta)
    key, rope = scaling
    rope_type = _scaling_type(key, rope)
    params = []
    for name in SCALING_KEYS[rope_type]:
        value = rope.get(name)
        if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"config.json sets {key}.{name} = {value!r}; rope_type {rope_type!r} needs it to be "
                              "a positive number")
        params.append((name, float(value)))
    if rope_type == "llama3" and dict(params)["high_freq_factor"] <= dict(params)["low_freq_factor"]:
        raise ConfigError(f"config.json sets {key}.high_freq_factor <= low_freq_factor; llama3 rope scaling needs "
                          "high_freq_factor > low_freq_factor")
    return Rope(theta, rope_type, tuple(params))


def _scaling_type(key: str, rope: dict[str, Any]) -> str:
    """The scaling type `rope` names, after checking tc computes it and that it holds no key tc would ignore."""
    types = {rope[k] for k in ("rope_type", "type") if k in rope}
    if len(types) > 1:
        raise ConfigError(f"config.json sets {key}.rope_type and {key}.type to different values {sorted(types)}")
    rope_type = next(iter(types), "default")
    if rope_type not in SCALING_KEYS:
        raise ConfigError(f"config.json sets {key}.{'rope_type' if 'rope_type' in rope else 'type'} = "
                          f"{rope_type!r}; tc computes rope types {', '.join(map(repr, SCALING_KEYS))} only: this "
                          "rope scaling is not supported yet")
    allowed = COMMON_KEYS + SCALING_KEYS[rope_type]
    for name, value in rope.items():
        if name == "partial_rotary_factor" and value == 1.0:
            continue  # what tc computes anyway: the whole head rotates
        if name not in allowed:
            raise ConfigError(f"config.json sets {key}.{name} = {value!r}, which tc does not apply with rope_type "
                              f"{rope_type!r}; tc reads {', '.join(allowed)} there")
    return rope_type


def inv_freq(rope: Rope, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The inverse frequencies [D/2] of `rope` for heads of `head_dim`, computed as transformers does (fp32)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    freq = 1.0 / (rope.theta ** exponents)  # [D/2]
    if rope.type == "linear":
        return freq / rope.param("factor")
    if rope.type == "llama3":
        factor, low, high = rope.param("factor"), rope.param("low_freq_factor"), rope.param("high_freq_factor")
        old_context = rope.param("original_max_position_embeddings")
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / freq
        # wavelengths longer than the trained context are stretched by `factor`, shorter ones than
        # old_context / high kept, and those between blended by where they fall
        scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    assert rope.type == "default", rope.type
    return freq
