"""Qwen2 model configuration, read from a HuggingFace config.json.

Field names are the config.json keys, so a reader can check one against the other.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM",)


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
        """Build from config.json's dict. Raises ConfigError naming what is wrong."""
        archs = data.get("architectures") or []
        model_type = data.get("model_type")
        if model_type != "qwen2" and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ConfigError(
                f"unsupported model: model_type={model_type!r}, architectures={archs!r}; "
                "tc runs Qwen2/Qwen2.5 causal LMs (model_type 'qwen2')"
            )
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in data:
                values[f.name] = data[f.name]
            elif f.name == "num_key_value_heads":
                values[f.name] = data["num_attention_heads"]
            elif f.name == "tie_word_embeddings":
                values[f.name] = False  # HF's Qwen2Config default
            elif f.name == "rope_theta":
                values[f.name] = 10000.0
            else:
                raise ConfigError(f"config.json has no {f.name!r}; is this a Qwen2 model?")
        if data.get("rope_scaling"):
            raise ConfigError("config.json sets rope_scaling, which tc does not support yet")
        config = cls(**values)
        if config.hidden_size % config.num_attention_heads:
            raise ConfigError("hidden_size must be a multiple of num_attention_heads")
        if config.num_attention_heads % config.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        return config

    @classmethod
    def from_file(cls, path: Path) -> "Qwen2Config":
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from exc
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """The fields as config.json names them (what crosses the wire in ASSIGNMENT)."""
        return {"model_type": "qwen2", **asdict(self)}
