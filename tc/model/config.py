"""A decoder-only model's configuration, read from a HuggingFace config.json through its family.

`ModelConfig` says how to build the layers, in tc's own terms (biases, norms, rotary embedding, sliding windows,
experts); each family module in `tc.model.families` maps its config.json keys onto it, and refuses by name
whatever transformers would honour and tc would silently ignore. Field names that exist in config.json keep
their config.json names, so a reader can check one against the other.

The config that crosses the wire (ASSIGNMENT) is config.json's own dict (`to_dict`), which the worker parses
through the same family: the two ends cannot disagree about a field one of them derived.
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .rope import DEFAULT_ROPE_THETA, ROPE_LAYOUTS, Rope, parse_rope

__all__ = ["ConfigError", "DEFAULT_ROPE_THETA", "Experts", "ModelConfig", "Qwen2Config", "Rope", "rope_theta"]

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # what MLP computes (transformers' ACT2FN names)
# Upper bounds far above any real model (the largest have a few hundred layers, hidden sizes near 32k, MLPs near
# 100k, vocabularies near 260k, 128 heads). A bigger value is a damaged file, and believing it would have the
# planner and the head loop over the layers or size tensors until memory runs out.
SIZE_LIMITS = {"hidden_size": 1 << 17, "intermediate_size": 1 << 20, "num_hidden_layers": 4096,
               "num_attention_heads": 4096, "num_key_value_heads": 4096, "head_dim": 1 << 13, "vocab_size": 1 << 22,
               "num_experts": 1 << 14, "num_local_experts": 1 << 14}


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts feed-forward: a router picks `top_k` of `count` experts per token."""

    count: int
    top_k: int
    intermediate_size: int  # each expert's
    normalize_top_k: bool  # renormalise the chosen experts' weights to sum to one
    shared_intermediate_size: int = 0  # Qwen2-MoE's always-on shared expert (0: none)
    layers: tuple[bool, ...] = ()  # per layer: experts (True) or a dense MLP (False); () means every layer
    # checkpoint names: the layer's block ("mlp", Mixtral's "block_sparse_moe") and each expert's gate, up and
    # down projections (Mixtral's w1, w3, w2)
    block_name: str = "mlp"
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # the family's registry key, config.json's model_type
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope: Rope
    hidden_act: str = "silu"
    qkv_bias: bool = False  # biases on q/k/v_proj (Qwen2)
    o_bias: bool = False  # a bias on o_proj (Llama's attention_bias sets both)
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each query and key head before the rotation (Qwen3, Gemma 3)
    qk_norm_whole: bool = False  # with qk_norm: over all heads of each projection at once instead (OLMo 2)
    norm_offset: float = 0.0  # RMSNorms scale by (offset + weight): Gemma stores weight - 1
    norms_scale_in_fp32: bool = False  # RMSNorms scale before rounding to the compute dtype (OLMo 2; Gemma's do too)
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and the MLP too, and one before the MLP
    pre_norms: bool = True  # norms before attention and the MLP; OLMo 2 has only those after (sandwich_norms)
    embedding_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden_size), in the compute dtype)
    # attention's and the MLP's outputs times this before each joins the residual (Granite): folded into o_proj's
    # and down_proj's weights and biases as they load, so a layer computes nothing more for it
    residual_multiplier: float | None = None
    logits_scaling: float | None = None  # logits divided by this (Granite)
    logit_scale: float | None = None  # logits times this (Cohere)
    attn_scale: float | None = None  # scores times this (None: head_dim ** -0.5)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits likewise (Gemma 2)
    sliding_windows: tuple[int | None, ...] = ()  # per layer: keys within this many positions, None: all; ()
    local_rope: Rope | None = None  # the rotary embedding of sliding-window layers, where it differs (Gemma 3)
    rope_layers: tuple[bool, ...] = ()  # per layer: whether it rotates q and k (SmolLM3's NoPE layers do not); (): all
    rotary_dim: int | None = None  # the leading dimensions of each head that rotate (Phi-4-mini's 96 of 128); None: all
    rotary_interleaved: bool = False  # the checkpoint's heads rotate the pairs (2j, 2j + 1), not (j, j + R/2) (GLM)
    rotate_in_fp32: bool = False  # q and k rotate in fp32, rounded once (ERNIE 4.5's, Cohere's, OLMo's references)
    fp32_rotary_tables: bool = False  # with rotate_in_fp32: by fp32 cos/sin, not rounded to the compute dtype (ERNIE,
    # OLMo)
    fused_qkv: bool = False  # the checkpoint stores q/k/v_proj fused already, as qkv_proj (Phi-3)
    fused_gate_up: bool = False  # the checkpoint stores gate/up_proj fused already, as gate_up_proj (Phi-3, GLM)
    # a layer's norms the checkpoint names otherwise: (tc's name, the checkpoint's) under its prefix (GLM-4
    # calls its sandwich norms post_self_attn_layernorm, post_attention_layernorm and post_mlp_layernorm)
    checkpoint_names: tuple[tuple[str, str], ...] = ()
    layer_norms: bool = False  # norms subtract the mean too, and scale in fp32 (Cohere's LayerNorm, without a bias)
    parallel_block: bool = False  # attention and the MLP read one norm of x and join the residual together (Cohere)
    # (beta, original context): queries times 1 + beta * log(1 + floor(position / original context)) once rotated
    # (Ministral 3's, transformers' get_llama_4_attn_scale): exactly 1 inside the original context
    query_scaling: tuple[float, int] | None = None
    experts: Experts | None = None
    context_limit: int | None = None  # the topology's context_length, where it serves less than the model holds
    source: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # config.json as read

    def __post_init__(self) -> None:
        # fp32 tables are for a rotation in fp32: one in the compute dtype would round at each operation by them
        assert self.rotate_in_fp32 or not self.fp32_rotary_tables, "fp32 rotary tables without rotate_in_fp32"

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def model_context(self) -> int:
        """The positions the model itself holds: max_position_embeddings, or, under YaRN scaling, the original
        context times the factor where that is more (the rule vLLM's max_model_len follows: a Qwen2.5 or Qwen3
        checkpoint keeps max_position_embeddings at 32768 or 40960 when its card adds YaRN for 131072). YaRN's
        frequencies and attention factor are the same at every position, so positions past
        max_position_embeddings compute as transformers computes them. Other scalings keep the file's figure:
        linear and llama3 checkpoints give the scaled context there already, and dynamic scaling would change
        past it, which tc does not compute (rope.py)."""
        if self.rope.type == "yarn":
            scaled = int(self.rope.param("original_max_position_embeddings") * self.rope.param("factor"))
            return max(self.max_position_embeddings, scaled)
        return self.max_position_embeddings

    @property
    def context_length(self) -> int:
        """The positions one sequence may use, its prompt and completion together: the model's context, or the
        topology's context_length where that is less (fewer bytes of KV cache for each sequence the plan holds)."""
        return self.model_context if self.context_limit is None else min(self.context_limit, self.model_context)

    def rotary_rows(self) -> list[int] | None:
        """Where a head's rotated pairs are not tc's: the order tc keeps qkv_proj's rows in (tc's row i holds the
        checkpoint's row rotary_rows()[i]); None where they are. tc's rotation (and its native decode attention)
        turns the pairs (j, j + D/2) of the whole head. transformers rotates the pairs (j, j + R/2) of a head's first
        R = rotary_dim dimensions and passes the rest; GLM's the pairs (2j, 2j + 1) of its first R. Each query and
        key head's rows are reordered so that the checkpoint's pair j lands on (j, j + D/2), and the passing
        dimensions on the pairs Rotary leaves still (cos 1, sin 0). Queries and keys move alike, so every score q.k
        is the same sum; values and o_proj keep their order."""
        if self.rotary_dim is None and not self.rotary_interleaved:
            return None
        # a norm of each query or key head would need its weights reordered as well
        assert not self.qk_norm, "q/k norms with reordered q/k rows"
        d = self.head_dim
        r = self.rotary_dim or d
        half, rest = r // 2, (d - r) // 2
        firsts, seconds = (range(0, r, 2), range(1, r, 2)) if self.rotary_interleaved else (range(half),
                                                                                            range(half, r))
        head = [*firsts, *range(r, r + rest), *seconds, *range(r + rest, d)]
        rotated = (self.num_attention_heads + self.num_key_value_heads) * d  # query heads, then key heads
        order = [h * d + i for h in range(rotated // d) for i in head]
        return order + list(range(rotated, rotated + self.num_key_value_heads * d))  # values as they are

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: it attends to every position)."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    def layer_rope(self, layer: int) -> Rope:
        """The rotary embedding `layer` uses."""
        return self.local_rope if self.local_rope is not None and self.window(layer) is not None else self.rope

    def rotates(self, layer: int) -> bool:
        """Whether `layer` applies its rotary embedding to q and k."""
        return self.rope_layers[layer] if self.rope_layers else True

    def has_experts(self, layer: int) -> bool:
        return self.experts is not None and (not self.experts.layers or self.experts.layers[layer])

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """Build from config.json's dict (either transformers layout) through its family.

        Raises ConfigError naming what is wrong: an architecture tc does not run (naming those it does), a
        missing key, a setting tc would not honour.
        """
        from .families import parse_config  # the families build ModelConfigs, so they import this module

        return parse_config(data)

    @classmethod
    def from_file(cls, path: Path) -> "ModelConfig":
        """Read config.json at `path`. Raises ConfigError."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8 text at all
            raise ConfigError(f"cannot read {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path} holds a {type(data).__name__}, not a JSON object")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """config.json's dict as read (what crosses the wire in ASSIGNMENT): from_dict(to_dict()) == self."""
        return copy.deepcopy(self.source)


# The name this class had while tc ran Qwen2 alone.
Qwen2Config = ModelConfig


def require(data: dict[str, Any], key: str, kind: type | tuple[type, ...] = int, family: str = "this") -> Any:
    """config.json's `key`, which must be there and of `kind`. Raises ConfigError naming it."""
    if key not in data or data[key] is None:
        raise ConfigError(f"config.json has no {key!r}; is this a {family} model?")
    value = data[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) or (float in kinds and type(value) is int)
    if type(value) is bool or not ok:
        raise ConfigError(f"config.json sets {key} = {value!r}; expected {' or '.join(k.__name__ for k in kinds)}")
    return value


def positive_number(data: dict[str, Any], key: str, default: float) -> float:
    """config.json's positive number `key`, `default` (the family's config class's) where left out. Raises
    ConfigError for anything else: null, zero, a negative, infinity or a string, which the config classes take and
    then compute garbage with or fail on."""
    value = data.get(key, default)
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"config.json sets {key} = {json.dumps(value)}; expected a positive number such as "
                          f"{default}")
    return float(value)


def within_limit(key: str, value: int) -> int:
    """`value` of size `key`, unless it passes SIZE_LIMITS. Raises ConfigError."""
    if value > SIZE_LIMITS[key]:
        raise ConfigError(f"config.json sets {key} = {value}; no model has that many (tc takes up to "
                          f"{SIZE_LIMITS[key]}): is the file damaged?")
    return value


def flag(data: dict[str, Any], key: str, default: bool = False) -> bool:
    """config.json's boolean `key`, `default` when absent or null. Raises ConfigError for anything but true or
    false: bool() would take the string "false" for true."""
    value = data.get(key)
    if value is None:
        return default
    if type(value) is not bool:
        raise ConfigError(f"config.json sets {key} = {value!r}; expected true or false")
    return value


def token_ids(value: Any, where: str) -> list[int]:
    """The ids of a token id setting such as eos_token_id: an id, a list of ids, or null (none). Raises
    ConfigError naming `where` (the file and key) for anything else, which would otherwise be dropped unread."""
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(type(i) is int for i in ids):
        raise ConfigError(f"{where} = {value!r}; expected a token id (an integer) or a list of them")
    return ids


def common_fields(data: dict[str, Any], family: str, *, tie_default: bool = False,
                  act_key: str = "hidden_act", default_theta: float = DEFAULT_ROPE_THETA,
                  defaults: dict[str, Any] | None = None, partial_rotary: bool = False,
                  default_partial_rotary: float = 1.0, longrope: bool = False) -> dict[str, Any]:
    """The ModelConfig fields every family reads the same way, from config.json's dict; `tie_default`,
    `default_theta` and `defaults` (other keys: an explicit null stays null) are what the family's transformers
    config takes where config.json leaves those out. `source` is config.json as read, defaults not filled in: it
    crosses the wire, and each worker fills them the same way. `partial_rotary`: the family's attention rotates
    only the first partial_rotary_factor of each head where config.json says so (Phi-3's does), or
    `default_partial_rotary` of it where config.json names no factor (GLM's half); elsewhere a factor other than 1
    is refused. `longrope`: the family takes longrope scaling (rope.parse_rope).

    Raises ConfigError for a missing or ill-typed shape, heads that do not divide, or an activation tc lacks.
    """
    source = copy.deepcopy(data)
    data = {**(defaults or {}), **data}
    values: dict[str, Any] = {"model_type": family}
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                "max_position_embeddings"):
        values[key] = require(data, key, int, family)
        if values[key] <= 0:
            raise ConfigError(f"config.json sets {key} = {values[key]!r}; it must be positive")
        if key in SIZE_LIMITS:
            within_limit(key, values[key])
    eps = values["rms_norm_eps"] = float(require(data, "rms_norm_eps", float, family))
    if not math.isfinite(eps) or eps <= 0:  # JSON readers take NaN and Infinity; either makes every norm garbage
        raise ConfigError(f"config.json sets rms_norm_eps = {eps!r}; it must be a small positive number such as 1e-06")
    kv = data.get("num_key_value_heads")
    values["num_key_value_heads"] = (values["num_attention_heads"] if kv is None  # no GQA: a KV head per head
                                     else within_limit("num_key_value_heads", require(data, "num_key_value_heads")))
    heads, kv_heads = values["num_attention_heads"], values["num_key_value_heads"]
    if kv_heads <= 0 or heads % kv_heads:
        raise ConfigError(f"num_attention_heads ({heads}) must be a positive multiple of num_key_value_heads "
                          f"({kv_heads})")
    head_dim = data.get("head_dim")
    if head_dim is None:  # transformers derives it the same way when config.json names none
        if values["hidden_size"] % heads:
            raise ConfigError("hidden_size must be a multiple of num_attention_heads when config.json sets no "
                              "head_dim")
        head_dim = values["hidden_size"] // heads
    values["head_dim"] = require({"head_dim": head_dim}, "head_dim")
    if head_dim <= 0 or head_dim % 2:
        raise ConfigError(f"head_dim = {head_dim!r}; rotary embeddings need a positive even head size")
    within_limit("head_dim", head_dim)
    values["tie_word_embeddings"] = flag(data, "tie_word_embeddings", tie_default)
    token_ids(data.get("eos_token_id"), "config.json sets eos_token_id")  # read by the tokenizer; refused early
    act = data.get(act_key) or "silu"  # transformers' default for every family that names none
    if act not in ACTIVATIONS:
        raise ConfigError(f"config.json sets {act_key} = {act!r}; tc's MLP computes {', '.join(ACTIVATIONS)} only")
    values["hidden_act"] = act
    values["rotary_dim"] = rotary_dim(data, head_dim, partial_rotary, default_partial_rotary)
    values["rope"] = parse_rope(data, default_theta=default_theta, rotary_dim=values["rotary_dim"], longrope=longrope)
    values["source"] = source
    return values


def rotary_dim(data: dict[str, Any], head_dim: int, partial_rotary: bool, default: float = 1.0) -> int | None:
    """The dimensions of each head that rotate, as transformers takes them (int(head_dim * partial_rotary_factor),
    the factor at the top level or in the rotary dict, `default` where neither names one), where that is fewer
    than head_dim; None where the whole head rotates. Raises ConfigError for a factor the family does not apply,
    or one that leaves no whole pair."""
    found = {"partial_rotary_factor": data.get("partial_rotary_factor")}
    for key in ROPE_LAYOUTS:
        if isinstance(data.get(key), dict):
            found[f"{key}.partial_rotary_factor"] = data[key].get("partial_rotary_factor")
    given = {where: value for where, value in found.items() if value is not None}
    for where, value in given.items():
        if type(value) not in (int, float) or not 0 < value <= 1:
            raise ConfigError(f"config.json sets {where} = {value!r}; it must be a number in (0, 1]")
        if value != 1.0 and not partial_rotary:
            raise ConfigError(f"config.json sets {where} = {value!r}; tc rotates the whole head in this family")
    if len({float(v) for v in given.values()}) > 1:
        raise ConfigError(f"config.json gives two partial_rotary_factors ({given}); keep one of them")
    factor = float(next(iter(given.values()), default))
    dims = int(head_dim * factor)
    if dims <= 0 or dims % 2:
        raise ConfigError(f"partial_rotary_factor = {factor!r} rotates {dims} of each head's {head_dim} "
                          "dimensions; rotary embeddings need a positive even number of them")
    return None if dims == head_dim else dims


def rope_theta(data: dict[str, Any]) -> float:
    """The rotary base config.json gives, from either layout (see rope.parse_rope). Raises ConfigError."""
    return parse_rope(data).theta


def hybrid_layers(data: dict[str, Any], layers: int, default_window: int, default_pattern: int
                  ) -> tuple[tuple[int | None, ...], list[str], int | None]:
    """EXAONE 4's and Cohere 2's layers: their sliding_window (`default_window` where left out) and layer_types,
    or where config.json names none the rule their config classes follow: every sliding_window_pattern-th layer
    (`default_pattern` where left out) full, the rest sliding. Returns the per-layer windows (layer_windows), the
    layer types and the window. Raises ConfigError for the rule without a window or a whole pattern, or sliding
    layers without a window (transformers fails on the one and computes no window for the other)."""
    window = data.get("sliding_window", default_window)
    if window is not None:
        require({"sliding_window": window}, "sliding_window")
    types = data.get("layer_types")
    if types is None:
        pattern = data.get("sliding_window_pattern", default_pattern)
        if window is None or type(pattern) is not int or pattern < 1:
            raise ConfigError(f"config.json names no layer_types, with sliding_window = {window!r} and "
                              f"sliding_window_pattern = {pattern!r}; give layer_types (a \"sliding_attention\" or "
                              "\"full_attention\" per layer), or a window and a whole pattern")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if window is None and isinstance(types, list) and "sliding_attention" in types:
        raise ConfigError("config.json sets sliding_window = null while layer_types holds sliding_attention; tc "
                          "runs sliding layers with a window")
    return layer_windows({"layer_types": types, "sliding_window": window}, layers), types, window


def layer_windows(data: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding windows from 5.x's `layer_types` ("sliding_attention" / "full_attention") and
    `sliding_window`; () when no layer slides. Raises ConfigError for a layer type tc does not know."""
    types = data.get("layer_types")
    window = data.get("sliding_window")
    if types is None:
        return ()
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"config.json's layer_types must list one type per layer ({num_layers}), got {types!r}")
    windows: list[int | None] = []
    for kind in types:
        if kind == "full_attention":
            windows.append(None)
        elif kind == "sliding_attention":
            windows.append(require(data, "sliding_window"))
        else:
            raise ConfigError(f"config.json's layer_types holds {kind!r}; tc runs full_attention and "
                              "sliding_attention layers")
    return tuple(windows) if any(w is not None for w in windows) and window is not None else ()
