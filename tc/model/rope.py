"""Rotary position embeddings: what config.json says, the inverse frequencies it implies, the cos/sin tables
(`Rotary`) and the rotation itself (`rotate_`, whose roundings native decode attention repeats).

Two layouts are in use. transformers 4.x writes the rotary base at the top level (`rope_theta`) beside
`rope_scaling` (null, or a dict naming a scaling type); transformers 5.x writes `rope_parameters`
({rope_type, rope_theta, ...}) instead. Both are read, and a base given in both places must agree.

Scaling types tc computes, each as transformers' ROPE_INIT_FUNCTIONS does: `default`, `linear` (frequencies
divided by `factor`), `llama3` (low frequencies divided by `factor`, high ones kept, a smooth ramp between),
`yarn` (the same idea with YaRN's ramp, and cos/sin scaled by an attention factor) and `dynamic` (NTK scaling,
which transformers applies only to sequences longer than max_position_embeddings: tc never runs one, since a
request's cache is capped at that context, so inside it dynamic RoPE is plain RoPE) and `longrope` (Phi-3's: each
frequency divided by its own factor from one of two lists, cos/sin scaled by an attention factor; see
`longrope_factors` for which list; Phi-3's family only). Partial rotary (Phi-4-mini's) rotates the first pairs
of the tables and leaves the rest still (`Rotary`), for a family that asks for it. Anything else (a dynamic
scaling from an original context shorter than the model's) is refused by name rather than run wrongly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .errors import ConfigError

# What transformers takes when config.json names no rotary base, in both layouts: 4.x's configs default
# rope_theta to 10000.0, and 5.x's fall back to RotaryEmbeddingConfigMixin.default_theta, also 10000.0. A family
# whose config class says otherwise (Mixtral, Gemma 3) passes its own to parse_rope.
DEFAULT_ROPE_THETA = 10000.0
ROPE_LAYOUTS = ("rope_scaling", "rope_parameters")
# The keys each scaling type reads ("type" is the older spelling of "rope_type"); any other key changes RoPE in
# a way tc does not compute, so it is refused.
COMMON_KEYS = ("rope_type", "type", "rope_theta")
SCALING_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("original_max_position_embeddings",),  # and its two lists: LONGROPE_LISTS
}
LONGROPE_LISTS = ("short_factor", "long_factor")
# keys a type may leave out, and transformers' default for each (None: derived, see attention_scaling)
OPTIONAL_KEYS = {
    "dynamic": {"original_max_position_embeddings": None},
    "yarn": {"beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": None, "mscale": None, "mscale_all_dim": None,
             "truncate": True},
    "longrope": {"factor": None, "attention_factor": None},
}


@dataclass(frozen=True)
class Rope:
    """One rotary embedding: its base, and its scaling type with that type's parameters (sorted (key, value));
    longrope's two lists of factors, one per frequency, beside them."""

    theta: float
    type: str = "default"
    params: tuple[tuple[str, float], ...] = ()
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def param(self, name: str, default: float | None = None) -> float:
        value = dict(self.params).get(name, default)
        assert value is not None, f"{self.type} rope without {name}"
        return value


def parse_rope(data: dict[str, Any], theta_key: str = "rope_theta", default_theta: float = DEFAULT_ROPE_THETA,
               rotary_dim: int | None = None, longrope: bool = False) -> Rope:
    """The rotary embedding config.json gives, from either layout. Raises ConfigError for RoPE tc cannot compute.

    `theta_key` names the top-level base (Gemma 3's sliding layers read `rope_local_base_freq`); `default_theta` is
    the base when config.json gives none, which is the family's (transformers' MixtralConfig takes 1e6, most 1e4).
    `rotary_dim`: the leading dimensions of each head that rotate, where a family rotates part of it (config.py's
    `rotary_dim`, which has read partial_rotary_factor wherever it is); None: the whole head rotates, and a
    partial_rotary_factor other than 1 is refused. `longrope`: the family scales with longrope (Phi-3, whose
    parse settles its pre-training context first); elsewhere longrope is refused, as tc matches it against
    transformers for Phi-3 alone.
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
        rope_type = _scaling_type(key, rope, rotary_dim is not None, longrope)
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
    theta = float(next(iter(found.values()), default_theta))
    if scaling is None:
        return Rope(theta)
    key, rope = scaling
    rope_type = _scaling_type(key, rope, rotary_dim is not None, longrope)
    params = []
    for name in SCALING_KEYS[rope_type]:
        value = rope.get(name)
        if value is None and name == "original_max_position_embeddings":
            # Phi-3's files give the pre-training context at the top level, beside max_position_embeddings; for the
            # others transformers takes the model's context where the file names none, and the ramp between kept
            # and stretched frequencies sits there
            value = data.get(name) if rope_type == "longrope" else data.get("max_position_embeddings")
        if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"config.json sets {key}.{name} = {value!r}; rope_type {rope_type!r} needs it to be "
                              "a positive number")
        params.append((name, float(value)))
    for name, default in OPTIONAL_KEYS.get(rope_type, {}).items():
        value = rope.get(name, default)
        if value is None:
            continue
        if type(value) not in (bool, int, float) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"config.json sets {key}.{name} = {value!r}; expected a non-negative number")
        params.append((name, float(value)))
    if rope_type == "longrope":
        return _longrope(key, rope, data, theta, params, rotary_dim)
    if rope_type == "llama3" and dict(params)["high_freq_factor"] <= dict(params)["low_freq_factor"]:
        raise ConfigError(f"config.json sets {key}.high_freq_factor <= low_freq_factor; llama3 rope scaling needs "
                          "high_freq_factor > low_freq_factor")
    if rope_type == "dynamic":
        # transformers grows the base only past original_max_position_embeddings (default: the model's
        # context), which tc never reaches when they are the same; refused when the file says otherwise
        original = dict(params).get("original_max_position_embeddings")
        context = data.get("max_position_embeddings")
        if original is not None and original != context:
            raise ConfigError(f"config.json sets {key}.original_max_position_embeddings = {original:g} below "
                              f"max_position_embeddings = {context!r}: dynamic rope scaling would change inside the "
                              "context tc serves, which tc does not compute")
    return Rope(theta, rope_type, tuple(params))


def _longrope(key: str, rope: dict[str, Any], data: dict[str, Any], theta: float,
              params: list[tuple[str, float]], rotary_dim: int | None) -> Rope:
    """longrope's Rope: its two lists (one factor a frequency, each positive), and `factor` where the file gives
    none as transformers derives it, the model's context over the pre-training one (what the attention factor's
    default is made from)."""
    if rotary_dim is None:
        rotary_dim = data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"]
    lists = []
    for name in LONGROPE_LISTS:
        value = rope.get(name)
        if not (isinstance(value, list) and len(value) == rotary_dim // 2 and all(
                type(v) in (int, float) and math.isfinite(v) and v > 0 for v in value)):
            raise ConfigError(f"config.json sets {key}.{name} = {_short(value)}; longrope needs a list of "
                              f"{rotary_dim // 2} positive numbers there, one for each rotary frequency")
        lists.append(tuple(float(v) for v in value))
    found = dict(params)
    if "factor" not in found:
        found["factor"] = data["max_position_embeddings"] / found["original_max_position_embeddings"]
    return Rope(theta, "longrope", tuple(sorted(found.items())), *lists)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _scaling_type(key: str, rope: dict[str, Any], partial: bool = False, longrope: bool = False) -> str:
    """The scaling type `rope` names, after checking tc computes it (longrope only where `longrope`) and that it
    holds no key tc would ignore (`partial`: its partial_rotary_factor is read elsewhere, config.py's
    rotary_dim)."""
    types = {rope[k] for k in ("rope_type", "type") if k in rope}
    if len(types) > 1:
        raise ConfigError(f"config.json sets {key}.rope_type and {key}.type to different values {sorted(types)}")
    rope_type = next(iter(types), "default")
    if rope_type not in SCALING_KEYS:
        raise ConfigError(f"config.json sets {key}.{'rope_type' if 'rope_type' in rope else 'type'} = "
                          f"{rope_type!r}; tc computes rope types {', '.join(map(repr, SCALING_KEYS))} only: this "
                          "rope scaling is not supported yet")
    if rope_type == "longrope" and not longrope:
        raise ConfigError(f"config.json sets {key} rope type 'longrope' for a model that is not Phi-3; tc computes "
                          "longrope for Phi3ForCausalLM only")
    allowed = COMMON_KEYS + SCALING_KEYS[rope_type] + tuple(OPTIONAL_KEYS.get(rope_type, ()))
    if rope_type == "longrope":
        allowed += LONGROPE_LISTS
    for name, value in rope.items():
        if name == "partial_rotary_factor" and (value == 1.0 or partial):
            continue  # what tc computes anyway (the whole head rotates), or read where the family rotates part
        if name not in allowed:
            raise ConfigError(f"config.json sets {key}.{name} = {value!r}, which tc does not apply with rope_type "
                              f"{rope_type!r}; tc reads {', '.join(allowed)} there")
    return rope_type


def longrope_factors(rope: Rope, context: int) -> tuple[float, ...]:
    """The list of factors longrope divides its frequencies by for a model serving `context` positions a sequence
    (ModelConfig.context_length): the long list where that is more than the pre-training context, else the short
    one. Chosen once for the context served, as llama.cpp chooses by its context size, so that every
    position of a sequence is rotated alike. transformers chooses per sequence instead: the short list until the
    sequence passes the pre-training context, then (Phi-3's generate drops the cache and computes it again) the
    long one for all of it. The two agree wherever a sequence stays on the served context's side of the line:
    every sequence, with a context_length at most the pre-training context."""
    long = context > rope.param("original_max_position_embeddings")
    return rope.long_factor if long else rope.short_factor


def inv_freq(rope: Rope, head_dim: int, device: torch.device | str = "cpu",
             context: int | None = None) -> torch.Tensor:
    """The inverse frequencies [D/2] of `rope` for heads of `head_dim`, computed as transformers does (fp32), for
    a model that serves `context` positions a sequence: longrope's depend on it, and need it given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    if rope.type == "longrope":
        if context is None:
            raise ValueError("longrope's frequencies depend on the context served: give it")
        factors = torch.tensor(longrope_factors(rope, context), dtype=torch.float32, device=device)
        return 1.0 / (factors * rope.theta ** exponents)
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
    if rope.type == "yarn":
        return _yarn_inv_freq(rope, head_dim, freq)
    assert rope.type in ("default", "dynamic"), rope.type  # dynamic: plain inside the context (module docstring)
    return freq


def attention_scaling(rope: Rope) -> float:
    """The factor cos and sin are multiplied by: YaRN's and longrope's attention factors, 1 for every other type."""
    if rope.type not in ("yarn", "longrope"):
        return 1.0
    given = dict(rope.params).get("attention_factor")
    if given is not None:
        return given
    if rope.type == "longrope":  # transformers' _compute_longrope_parameters
        factor, original = rope.param("factor"), rope.param("original_max_position_embeddings")
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factor, mscale, mscale_all = rope.param("factor"), rope.param("mscale", 0.0), rope.param("mscale_all_dim", 0.0)

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if mscale and mscale_all:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all))
    return get_mscale(factor)


def _yarn_inv_freq(rope: Rope, dim: int, freq: torch.Tensor) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are interpolated
    (divided by factor), those turning more than beta_fast times kept, with a linear ramp between."""
    factor, original = rope.param("factor"), rope.param("original_max_position_embeddings")
    beta_fast, beta_slow = rope.param("beta_fast"), rope.param("beta_slow")

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.param("truncate"):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=freq.device) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, device=freq.device).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # [D/2]: 1 where the frequency is kept as it is
    return interpolation * (1 - keep) + extrapolation * keep


class Rotary:
    """cos/sin tables for rotary position embeddings: computed in fp32, grown on demand, kept per dtype."""

    def __init__(self, head_dim: int, rope: Rope | float, device: torch.device | str, context: int | None = None,
                 rotary_dim: int | None = None, wide: bool = False):
        """context: the positions a sequence may use (ModelConfig.context_length), which longrope's frequencies
        depend on. rotary_dim: where only some of each head's dimensions rotate (ModelConfig.rotary_dim), how
        many; their frequencies then take the first rotary_dim / 2 pairs of the tables, and the rest of the head
        (pairs of frequency 0: cos 1, sin 0, unscaled) passes through as it is. The layer's q/k rows are ordered
        to match as they load (ModelConfig.rotary_rows). wide: the tables are fp32 whatever dtype is asked for
        (ModelConfig.fp32_rotary_tables: q and k then rotate by rotate_wide_)."""
        rope = rope if isinstance(rope, Rope) else Rope(float(rope))
        self.head_dim = head_dim
        self.inv_freq = inv_freq(rope, rotary_dim or head_dim, device, context)  # [R/2], scaled as the config says
        self.attention_scaling = attention_scaling(rope)  # YaRN's and longrope's factor on cos and sin; else 1
        self.wide = wide
        self.size = 0  # positions the tables cover
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, start: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [L, 1, D] for positions [start, start + L) in `dtype` (fp32 where wide), sin in `rotate_`'s
        form."""
        dtype = torch.float32 if self.wide else dtype
        end = start + length
        if end > self.size:
            self.size = max(end, 2 * self.size, 256)
            self._tables.clear()
        if dtype not in self._tables:
            positions = torch.arange(self.size, device=self.inv_freq.device).float()
            freqs = torch.outer(positions, self.inv_freq)  # [T, R/2]
            cos, sin = freqs.cos(), freqs.sin()
            if self.attention_scaling != 1.0:
                cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
            passing = self.head_dim // 2 - freqs.shape[1]  # pairs that do not rotate (partial rotary)
            if passing:
                cos = torch.cat((cos, cos.new_ones(self.size, passing)), dim=-1)
                sin = torch.cat((sin, sin.new_zeros(self.size, passing)), dim=-1)
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # [T, D]: rotate_half's minus
            # sign folded into the table
            self._tables[dtype] = cos.to(dtype)[:, None], sin.to(dtype)[:, None]  # [T, 1, D]
        cos, sin = self._tables[dtype]
        return cos[start:end], sin[start:end]

    def table_addresses(self, end: int, dtype: torch.dtype) -> tuple[int, int]:
        """Where the cos and sin tables in `dtype` start (position p's row is p * D values on, as `tables` slices
        them), grown to cover positions [0, end): what a decode plan copies its rows from, where slicing each
        would take a tensor op. CPU tables only; the addresses hold until the tables next grow."""
        if self.inv_freq.device.type != "cpu" or self.wide:
            raise ValueError(f"table addresses are for CPU tables in the compute dtype; these are on "
                             f"{self.inv_freq.device}{' and fp32' if self.wide else ''}")
        if end > self.size or dtype not in self._tables:
            self.tables(end - 1, 1, dtype)
        cos, sin = self._tables[dtype]
        return cos.data_ptr(), sin.data_ptr()

    def span_tables(self, spans: Sequence[Any], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [rows, 1, D] for the rows of a ragged batch (qwen2.Span: `length` rows from `start`), each at
        its own position."""
        if len(spans) == 1:
            return self.tables(spans[0].start, spans[0].length, dtype)
        parts = [self.tables(s.start, s.length, dtype) for s in spans]
        return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding in place: x * cos + rotate_half(x) * sin, with transformers' roundings.

    x: [B, L, heads, D]; cos, sin: [L, 1, D] from `Rotary.tables`, whose sin has its first half negated, so
    rotate_half(x) * sin = cat(-x2, x1) * sin is the halves swapped, times that table, exactly.
    """
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [B, L, heads, D], a new tensor
    x.mul_(cos).add_(swapped.mul_(sin))


def rotate_wide_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """rotate_ in fp32, x rounded to its dtype once at the end, as ERNIE 4.5's and Cohere's references rotate
    whatever the compute dtype (ModelConfig.rotate_in_fp32); the tables' values as given (ERNIE's fp32, Cohere's
    rounded to the compute dtype)."""
    wide = x.float()
    rotate_(wide, cos, sin)
    x.copy_(wide)
