"""Phi-3: Mistral's layer, with q/k/v and gate/up stored fused in the checkpoint (qkv_proj, gate_up_proj); its
long-context checkpoints (Phi-3.5-mini, Phi-3-mini-128k, Phi-4-mini) scale their rotary embedding with longrope,
and Phi-4-mini rotates only the first partial_rotary_factor of each head."""
from __future__ import annotations

import copy
from typing import Any

from ..config import ConfigError, ModelConfig, common_fields, require
from ..rope import ROPE_LAYOUTS

# Phi3Config's original_max_position_embeddings where config.json names none
DEFAULT_ORIGINAL_CONTEXT = 4096


def parse(data: dict[str, Any]) -> ModelConfig:
    values = common_fields(_longrope_named(data), "phi3", partial_rotary=True, longrope=True)
    values["source"] = copy.deepcopy(data)  # as read: each worker names the scaling the same way
    if values["rope"].type not in ("default", "longrope"):
        # transformers' Phi3Config takes longrope only: no Phi-3 scales its rotary embedding another way, and
        # transformers refuses the file that says so
        raise ConfigError(f"config.json gives Phi3ForCausalLM rope scaling {values['rope'].type!r}; Phi-3 scales "
                          "its rotary embedding with longrope only")
    window = None if data.get("sliding_window") is None else require(data, "sliding_window")
    return ModelConfig(**values, fused_qkv=True, fused_gate_up=True,
                       sliding_windows=(window,) * values["num_hidden_layers"] if window else ())


def _longrope_named(data: dict[str, Any]) -> dict[str, Any]:
    """config.json with the names older Phi-3 files give longrope ("su", and "yarn" beside longrope's two lists)
    replaced by "longrope", as transformers' Phi3Config reads them (the 128k Phi-3-mini's first files said "su"),
    and longrope's pre-training context where Phi3Config takes it: the top-level original_max_position_embeddings
    (4096 where config.json leaves it out), which wins over the rotary dict's. Raises ConfigError where the two
    disagree, or where only the rotary dict gives one (Phi3Config would take 4096 over it)."""
    found = dict(data)
    name = "original_max_position_embeddings"
    for key in ROPE_LAYOUTS:
        rope = data.get(key)
        if not isinstance(rope, dict):
            continue
        for kind in ("rope_type", "type"):
            if rope.get(kind) == "su" or rope.get(kind) == "yarn" and "long_factor" in rope:
                found[key] = rope = {**rope, kind: "longrope"}
        if "longrope" not in (rope.get("rope_type"), rope.get("type")):
            continue
        top, inner = data.get(name), rope.get(name)
        if inner is not None and top != inner:
            raise ConfigError(f"config.json sets {key}.{name} = {inner!r} and {name} = {top!r}; Phi3ForCausalLM "
                              f"reads the top-level {name} (4096 where it is missing): give the same value in both, "
                              "or the top-level one alone")
        found[key] = {**rope, name: DEFAULT_ORIGINAL_CONTEXT if top is None else top}
    return found
