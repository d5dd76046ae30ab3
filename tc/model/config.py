"""Qwen2 model configuration, read from a HuggingFace config.json.

Field names are the config.json keys, so a reader can check one against the other.

Two layouts are in use. transformers 4.x writes the rotary base at the top level (`rope_theta`) beside
`rope_scaling` (null, or a dict naming a scaling type); transformers 5.x writes `rope_parameters`
({rope_type, rope_theta, ...}) instead. Both are read. Whatever tc would compute differently from
transformers (scaled RoPE, sliding window attention, another activation) is refused by name rather than run
wrongly.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

MODEL_TYPE = "qwen2"
SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM",)
# What transformers takes when config.json names no rotary base, in both layouts: 4.x's Qwen2Config defaults
# rope_theta to 10000.0, and 5.x's falls back to RotaryEmbeddingConfigMixin.default_theta, also 10000.0.
DEFAULT_ROPE_THETA = 10000.0
# Keys a plain-RoPE rope_scaling / rope_parameters dict may hold ("type" is the older spelling of "rope_type").
# Anything else there (factor, partial_rotary_factor, per-layer-type dicts) changes RoPE in ways tc does not.
PLAIN_ROPE_KEYS = ("rope_type", "type", "rope_theta")
ROPE_LAYOUTS = ("rope_scaling", "rope_parameters")


class ConfigError(ValueError):
    """config.json is missing, unreadable, or describes a model tc cannot run."""


@dataclass(frozen=True)
class Qwen2Config:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Qwen2Config":
        """Build from config.json's dict (either transformers layout). Raises ConfigError naming what is wrong."""
        archs = data.get("architectures") or []
        model_type = data.get("model_type")
        if model_type != MODEL_TYPE and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ConfigError(
                f"unsupported model: model_type={model_type!r}, architectures={archs!r}; "
                "tc runs Qwen2/Qwen2.5 causal LMs (model_type 'qwen2')"
            )
        _refuse_unsupported(data)
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "rope_theta":
                values[f.name] = rope_theta(data)
            elif f.name in data:
                values[f.name] = data[f.name]
            elif f.name == "num_key_value_heads":
                values[f.name] = data["num_attention_heads"]
            elif f.name == "tie_word_embeddings":
                values[f.name] = False  # HF's Qwen2Config default
            else:
                raise ConfigError(f"config.json has no {f.name!r}; is this a Qwen2 model?")
        config = cls(**values)
        if config.hidden_size % config.num_attention_heads:
            raise ConfigError("hidden_size must be a multiple of num_attention_heads")
        if config.num_attention_heads % config.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        head_dim = data.get("head_dim")
        if head_dim is not None and head_dim != config.head_dim:
            raise ConfigError(f"config.json sets head_dim = {head_dim!r}, but tc's Qwen2 uses hidden_size / "
                              f"num_attention_heads = {config.head_dim}; this checkpoint is not one tc can run")
        return config

    @classmethod
    def from_file(cls, path: Path) -> "Qwen2Config":
        """Read config.json at `path`. Raises ConfigError."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path} holds a {type(data).__name__}, not a JSON object")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """The fields as config.json names them (what crosses the wire in ASSIGNMENT), in the 4.x layout."""
        return {"model_type": MODEL_TYPE, **asdict(self)}


def _refuse_unsupported(data: dict[str, Any]) -> None:
    """Raise ConfigError for a setting transformers would honour and tc's Qwen2 would silently ignore."""
    hidden_act = data.get("hidden_act", "silu")  # transformers' default
    if hidden_act != "silu":
        raise ConfigError(f"config.json sets hidden_act = {hidden_act!r}; tc's Qwen2 MLP computes silu only")
    if data.get("use_sliding_window"):
        raise ConfigError(f"config.json sets use_sliding_window = {data['use_sliding_window']!r}; sliding window "
                          "attention is not implemented in tc (every layer attends to the whole context)")
    partial = data.get("partial_rotary_factor")
    if partial is not None and partial != 1.0:
        raise ConfigError(f"config.json sets partial_rotary_factor = {partial!r}; tc rotates the whole head")


def rope_theta(data: dict[str, Any]) -> float:
    """The rotary base config.json gives, from either layout. Raises ConfigError for RoPE tc cannot compute.

    A base given in more than one place must agree; none at all means DEFAULT_ROPE_THETA, as in transformers.
    """
    found: dict[str, Any] = {}
    if data.get("rope_theta") is not None:
        found["rope_theta"] = data["rope_theta"]
    for key in ROPE_LAYOUTS:
        rope = data.get(key)
        if rope is None:  # 4.x writes "rope_scaling": null for plain RoPE
            continue
        if not isinstance(rope, dict):
            raise ConfigError(f"config.json sets {key} = {rope!r}; expected an object such as "
                              '{"rope_type": "default", "rope_theta": 1000000.0}')
        _check_plain_rope(key, rope)
        if rope.get("rope_theta") is not None:
            found[f"{key}.rope_theta"] = rope["rope_theta"]
    for where, value in found.items():
        if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"config.json sets {where} = {value!r}; the rotary base must be a positive number")
    if len({float(v) for v in found.values()}) > 1:
        given = ", ".join(f"{where} = {value!r}" for where, value in found.items())
        raise ConfigError(f"config.json gives two rotary bases ({given}); keep one of them")
    return float(next(iter(found.values()), DEFAULT_ROPE_THETA))


def _check_plain_rope(key: str, rope: dict[str, Any]) -> None:
    for type_key in ("rope_type", "type"):
        rope_type = rope.get(type_key, "default")
        if rope_type != "default":
            raise ConfigError(f"config.json sets {key}.{type_key} = {rope_type!r}; tc computes plain RoPE only "
                              "(rope_type 'default'): rope scaling is not supported yet")
    for name, value in rope.items():
        if name not in PLAIN_ROPE_KEYS:
            raise ConfigError(f"config.json sets {key}.{name} = {value!r}, which tc does not apply; tc computes "
                              f"plain RoPE from {', '.join(PLAIN_ROPE_KEYS)} only")
