"""The decoder every family builds (Qwen2 was the first), in plain PyTorch, cut for pipeline stages.

What differs between families (biases, q/k norms, Gemma's norms and soft-capping, sliding windows, rotary
scaling, experts) is decided when a layer is built, from its ModelConfig (tc/model/config.py); the forward
passes only test what the layer was built with.

The head runs `HeadModel` (embedding, final norm, lm_head); each worker runs one `Stage`, a contiguous
half-open range [start, end) of decoder layers keyed by their global layer numbers. Module attribute names are
the safetensors key names, so a checkpoint loads with no renaming, except two fused layers: q/k/v_proj load into
one qkv_proj and gate/up_proj into one gate_up_proj (their rows one after another; weights.layer_sources says
which checkpoint tensors fill which tensor of a layer), so a decode step runs four products per layer instead of
seven.

A stage runs a ragged batch: the rows of several sequences, each a `Span` of consecutive positions with its own
KV cache, side by side in one [1, rows, hidden] tensor. Every product runs once over all the rows (a decode step
of eight sequences reads each weight once, not eight times); rotary takes each row's own position, and attention
runs span by span against that span's cache, except that in bf16 on an x86-64 CPU every decode row (a span of
one position) goes to the native kernel in one call per layer (native.Kernels.decode_attention). A row's result
never depends on the other rows beside it, up to the last bits of a product that the BLAS may block differently
for a different row count.
"""
from __future__ import annotations

import array
import ctypes
import functools
import logging
import math
import os
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import native
from .config import ModelConfig
from .decode_plan import DecodePlan, Plans
from .dense import PRODUCTS, Linear, pack_linears
from .greedy_plan import GreedyPlan
from .greedy_screen import MAX_TIME_SHARE, GreedyScreen, screens
from .kv_cache import KVCache
from .probe import cache_sweeper, race
from .rope import Rope, Rotary, rotate_, rotate_wide_
from .quant import Quantization
from .weights import LM_HEAD, WeightIndex, WeightsError, head_tensor_names, layer_prefix, layer_sources, own_lm_head

log = logging.getLogger(__name__)

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_compute_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The torch dtype `device` computes `name` in, falling back (with a warning) where it cannot.

    CPUs have no fast fp16 matmul in general, so fp16 on a CPU computes in fp32 (bf16 is the fast CPU choice).
    bf16 needs an Ampere or newer CUDA GPU, and macOS 14 or newer on MPS; elsewhere it computes in fp16.
    Raises ValueError for an unknown name.
    """
    try:
        dtype = COMPUTE_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown compute dtype {name!r}; use one of {sorted(COMPUTE_DTYPES)}") from None
    kind = torch.device(device).type
    if dtype == torch.float16 and kind == "cpu":
        log.warning("fp16 compute requested on a CPU: computing in fp32 instead (use bf16 for speed)")
        return torch.float32
    if dtype == torch.bfloat16 and not device_supports_bf16(device):
        log.warning("%s has no native bf16: computing in fp16 instead", device)
        return torch.float16
    return dtype


def compute_dtype_name(dtype: torch.dtype) -> str:
    """The topology's name for a compute dtype (the inverse of COMPUTE_DTYPES)."""
    for name, known in COMPUTE_DTYPES.items():
        if known == dtype:
            return name
    raise ValueError(f"{dtype} is not a compute dtype; expected one of {list(COMPUTE_DTYPES.values())}")


def cuda_capability_has_bf16(capability: tuple[int, int]) -> bool:
    """Whether a CUDA GPU of compute capability (major, minor) computes bf16 natively: Ampere (8.0) and newer.

    Not torch.cuda.is_bf16_supported(): by default it counts emulation (True on a T4, V100 or Pascal card, which
    then run bf16 several times slower than fp16), and it asks about the current device, not the assigned one.
    """
    return tuple(capability) >= (8, 0)


def device_supports_bf16(device: torch.device | str) -> bool:
    """Whether `device` (cpu, cuda:N, mps) has native bf16: the fact every 16-bit dtype choice follows."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return True
    if dev.type == "cuda":
        return cuda_capability_has_bf16(torch.cuda.get_device_capability(dev))
    if dev.type == "mps":
        return mps_supports_bf16()
    return False


def half_dtype(device: torch.device | str) -> torch.dtype:
    """The 16-bit float type `device` keeps quantization scales in and feeds the packed kernels: bf16 where it
    has it (fp32's exponent range), fp16 elsewhere (MPS before macOS 14, CUDA before Ampere)."""
    return torch.bfloat16 if device_supports_bf16(device) else torch.float16


@functools.lru_cache(maxsize=None)
def mps_supports_bf16() -> bool:
    """Whether MPS can hold bf16 tensors (macOS 14 and newer); asked once, since the answer cannot change."""
    try:
        torch.ones(1, dtype=torch.bfloat16, device="mps")
        return True
    except (RuntimeError, TypeError):
        return False


@functools.lru_cache(maxsize=None)
def sdpa_has_enable_gqa() -> bool:
    """Whether this torch's scaled_dot_product_attention takes enable_gqa (torch 2.5 and newer).

    Asked of torch itself by a tiny call on the CPU rather than read from the version string, so a build with a
    backported or removed argument is judged by what it does. (The builtin has no inspectable signature.)
    """
    q = torch.zeros(1, 2, 1, 4)
    kv = torch.zeros(1, 1, 1, 4)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


MPS_GQA_FIXED = (2, 7)  # pytorch issue 149132: MPS SDPA with enable_gqa aborts the process before this release


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as "2.6.0+cu124" or "2.7.0.dev20250311"."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def must_expand_kv_heads(device_type: str, has_enable_gqa: bool, release: tuple[int, int]) -> bool:
    """Whether a prefill must repeat the KV heads up to the query heads instead of passing enable_gqa to SDPA.

    Yes where SDPA has no enable_gqa (torch 2.4), and on MPS before torch 2.7, whose SDPA with enable_gqa dies in
    an MPSGraph shape check ("LLVM ERROR: Failed to infer result type(s)", pytorch issue 149132) and takes the
    whole process with it; that it spared us with the cache's non-contiguous slices was luck, not a guarantee.
    """
    return not has_enable_gqa or (device_type == "mps" and release < MPS_GQA_FIXED)


@functools.lru_cache(maxsize=None)
def expand_kv_heads_on(device_type: str) -> bool:
    """must_expand_kv_heads for this process's torch, decided once per device type."""
    return must_expand_kv_heads(device_type, sdpa_has_enable_gqa(), torch_release(torch.__version__))


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                      causal: bool, expand_kv: bool, scale: float | None = None) -> torch.Tensor:
    """SDPA of q [B, H, L, D] against keys, values [B, H_kv, T, D], H a multiple of H_kv -> [B, H, L, D].

    expand_kv repeats each KV head for its H / H_kv query heads (what enable_gqa does inside SDPA), for the
    torch builds where enable_gqa is missing or unsafe (must_expand_kv_heads); the result is the same.
    """
    grouped = keys.shape[1] != q.shape[1]
    if grouped and expand_kv:
        repeats = q.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(repeats, dim=1)  # [B, H, T, D], contiguous copies
        values = values.repeat_interleave(repeats, dim=1)
        grouped = False
    if grouped:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=True,
                                              scale=scale)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=scale)


def softcapped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                         scale: float, cap: float) -> torch.Tensor:
    """Attention whose scores pass through cap * tanh(scores / cap) before the softmax (Gemma 2), which SDPA
    cannot do: q [B, H, L, D], keys and values [B, H_kv, T, D], mask [L, T] of visible keys -> [B, H, L, D].
    The softmax runs in fp32, as transformers' eager attention does."""
    repeats = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(repeats, dim=1), values.repeat_interleave(repeats, dim=1)  # [B, H, T, D]
    scores = torch.tanh(q @ keys.transpose(-1, -2) * (scale / cap)) * cap  # [B, H, L, T]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ values


def visible_keys(position_start: int, length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[L, T] mask of the keys each query of positions [position_start, +L) sees: every earlier position and
    itself, or with a sliding window only those less than `window` positions back (transformers' rule)."""
    q_pos = torch.arange(position_start, position_start + length, device=device)[:, None]
    k_pos = torch.arange(position_start + length, device=device)[None, :]
    mask = k_pos <= q_pos
    return mask if window is None else mask & (k_pos > q_pos - window)


class RMSNorm(nn.Module):
    """RMS normalisation, scaled by its weight, or by (offset + weight) where a family stores weight - offset
    (Gemma's offset 1, which scales in fp32 before rounding, as its reference does; `scale_in_fp32` asks that of
    a norm without an offset, as OLMo 2's reference does)."""

    # None: bf16 rows on a CPU take the native norm (norm.c, the same roundings in one call) where it runs and its
    # probe finds it faster; False: always PyTorch's operators; True: the native norm wherever it runs
    native: bool | None = None

    def __init__(self, size: int, eps: float, offset: float = 0.0, scale_in_fp32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset
        self.fp32_scaled = bool(offset) or scale_in_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32_scaled:
            normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
            return (normed * (self.offset + self.weight.float())).to(x.dtype)
        kernels = self._kernels(x)
        if kernels is not None:
            return kernels.rms_norm(x, self.weight, self.eps)
        # normalise in fp32 as the reference does (one fused op, the same bits as its five), then scale in the
        # compute dtype
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)

    def native_call(self, x: torch.Tensor, y: torch.Tensor, planned: bool = True) -> native.Call | None:
        """The native call that writes this norm of x into y; None where the native norm does not take x. `planned`
        as _kernels takes it: a decode plan's, wherever the kernel agrees; False: only where forward itself takes
        it (the head's greedy plan, which must give the bits of HeadModel.logits)."""
        kernels = None if self.fp32_scaled else self._kernels(x, planned=planned)
        return None if kernels is None else kernels.rms_norm_call(x, self.weight, self.eps, y)

    def _kernels(self, x: torch.Tensor, planned: bool = False) -> native.Kernels | None:
        """The native kernels where this norm of x is theirs (norm.c), else None; `planned`: for a decode plan,
        which takes the kernel wherever it agrees with its reference, not only where its probe found it faster."""
        if (self.native is not False and x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16
                and x.device.type == "cpu" and x.is_contiguous()
                and (self.native or (native.norm_agrees() if planned else native.norm_faster_than_torch()))):
            return native.kernels()
        return None


class LayerNorm(RMSNorm):
    """A layer norm without a bias (Cohere's): the mean subtracted, then normalised and scaled by the weight, all
    in fp32 before rounding to the compute dtype, in its reference's operations (so fp32 gives its bits). No
    native kernel takes it."""

    def __init__(self, size: int, eps: float, offset: float = 0.0, scale_in_fp32: bool = True):
        assert not offset, "a layer norm whose weight is stored less an offset"
        super().__init__(size, eps, scale_in_fp32=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        centered = wide - wide.mean(-1, keepdim=True)
        normed = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype)


def norm(config: ModelConfig, size: int | None = None, kind: type[RMSNorm] | None = None) -> RMSNorm:
    """An RMSNorm (or `kind` of one) of the family's kind over `size` features (default: the hidden size): a
    LayerNorm where the family's norms are layer norms."""
    kind = kind or (LayerNorm if config.layer_norms else RMSNorm)
    return kind(size or config.hidden_size, config.rms_norm_eps, config.norm_offset, config.norms_scale_in_fp32)


class HeadsNorm(RMSNorm):
    """An RMSNorm over all the heads of a projection at once, given them as [..., heads, D] (OLMo 2's q_norm and
    k_norm, which normalise q_proj's and k_proj's whole outputs), so that Attention calls it as it calls a norm
    of each head."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(-2)).view(x.shape)


def qk_norm(config: ModelConfig, heads: int) -> RMSNorm | None:
    """The norm of a projection's `heads` query or key heads before the rotation: of each head, of all of them
    at once (qk_norm_whole), or None where the family has none."""
    if not config.qk_norm:
        return None
    if config.qk_norm_whole:
        return norm(config, heads * config.head_dim, HeadsNorm)
    return norm(config, config.head_dim)


def pre_norm(config: ModelConfig) -> nn.Module:
    """The norm before attention or the MLP: an RMSNorm, or none at all (OLMo 2 normalises their outputs alone)."""
    return norm(config) if config.pre_norms else nn.Identity()


@dataclass(frozen=True)
class Span:
    """One sequence's rows in a ragged batch: `length` positions from `start`, stored in and attending to `cache`."""

    cache: KVCache
    start: int
    length: int


def _native_decode_row(span: Span) -> bool:
    """Whether a span is one decode row whose cache the native attention can write: one position, bfloat16."""
    return span.length == 1 and span.cache.kv.dtype == torch.bfloat16


def _plan_takes(span: Span) -> bool:
    """Whether a decode plan takes a span: one decode row, or several that continue a cache (a draft, draft.py),
    each a row of its own. A prompt's first positions are read by the modules, whose attention takes them at once."""
    return span.cache.kv.dtype == torch.bfloat16 and (span.length == 1 or span.start > 0)


class Attention(nn.Module):
    # None: a prefill expands the KV heads where this torch and device need it (expand_kv_heads_on); True or False
    # forces the choice, so the two ways can be compared on any machine
    expand_kv: bool | None = None
    # None: decode rows take the native attention where it runs and its probe finds it faster; False: always SDPA;
    # True: the native attention wherever it runs
    native_decode: bool | None = None

    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, q, kv = config.hidden_size, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        # q_proj, k_proj, v_proj, fused on loading (or already fused in the checkpoint)
        self.qkv_proj = Linear(hidden, q + 2 * kv, bias=config.qkv_bias)
        self.o_proj = Linear(q, hidden, bias=config.o_bias)
        # Qwen3 and Gemma 3 normalise each query and key head before rotating it, OLMo 2 all of q's and of k's
        self.q_norm = qk_norm(config, self.n_heads)
        self.k_norm = qk_norm(config, self.n_kv_heads)
        self.scale = config.attn_scale  # None: SDPA's own head_dim ** -0.5
        self.softcap = config.attn_softcap
        window = config.window(layer)
        self.sliding = window is not None  # its rotary tables are the sliding layers' own where a family has them
        # A window no shorter than the context hides no key from any position (Phi-3.5-mini and Phi-4-mini give
        # 262144 for 131072 positions): masked by it, the layer only lost the native decode and the decode plan.
        self.window = window if window is not None and window < config.context_length else None
        self.rotates = config.rotates(layer)  # False: q and k go in unrotated (SmolLM3's NoPE layers)
        # True: q and k rotate in fp32, rounded once (ERNIE 4.5, Cohere, OLMo 2 and 3), which the native attention
        # does not: they rotate before it (and no decode plan takes them)
        self.rotates_wide = config.rotate_in_fp32
        self.query_scaling = config.query_scaling  # Ministral 3's: queries scaled by position once rotated

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spans: Sequence[Span],
                layer: int) -> torch.Tensor:
        _, rows, _ = x.shape  # [1, rows, hidden]: the spans' rows one after another
        h, h_kv, d = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(1, rows, h + 2 * h_kv, d)  # [1, rows, heads, D]: q heads, k heads, v heads
        if self.q_norm is not None:
            qkv = torch.cat((self.q_norm(qkv[:, :, :h]), self.k_norm(qkv[:, :, h:h + h_kv]), qkv[:, :, h + h_kv:]), 2)
        kernels = self._decode_kernels(qkv)
        if kernels is not None and all(_native_decode_row(span) for span in spans):
            # a decode step the native kernel takes whole: it rotates the query and key heads itself (in the
            # compute dtype), which spares rotate_'s operators (each several times its hot-loop cost in a step whose
            # weights swept the caches)
            rotary = None
            if self.rotates and (self.rotates_wide or scales_queries(self.query_scaling, spans)):
                self.rotate(qkv[:, :, :h + h_kv], cos, sin)
                self._scale_queries(qkv[:, :, :h], spans)
            elif self.rotates:
                rotary = cos, sin
            out = qkv.new_empty(1, rows, h * d)
            self._decode_natively(kernels, qkv, out, list(enumerate(spans)), layer, rotary)
            return self.o_proj(out)
        if self.rotates:
            self.rotate(qkv[:, :, :h + h_kv], cos, sin)
            self._scale_queries(qkv[:, :, :h], spans)
        if len(spans) == 1:
            return self.o_proj(self._attend(qkv, spans[0], layer))
        out = qkv.new_empty(1, rows, h * d)
        decoded: list[tuple[int, Span]] = []  # (row, span) of the decode rows the native kernel takes
        row = 0
        for span in spans:
            if kernels is not None and _native_decode_row(span):
                decoded.append((row, span))
            else:
                out[:, row:row + span.length] = self._attend(qkv[:, row:row + span.length], span, layer)
            row += span.length
        if decoded:
            self._decode_natively(kernels, qkv, out, decoded, layer)
        return self.o_proj(out)

    def rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate query and key heads [1, rows, heads, D] in place, as this layer's family rotates them: in the
        compute dtype, or in fp32 rounded once (by the tables Rotary gives: fp32 ones where it is `wide`)."""
        (rotate_wide_ if self.rotates_wide else rotate_)(qk, cos, sin)

    def _scale_queries(self, q: torch.Tensor, spans: Sequence[Span]) -> None:
        """Rotated query heads [1, rows, H, D], the spans' rows, times each row's query_scaling factor in place, as
        transformers' get_llama_4_attn_scale computes it; rows inside the original context (factor 1) as they are."""
        if not scales_queries(self.query_scaling, spans):
            return
        assert self.query_scaling is not None
        beta, original = self.query_scaling
        row = 0
        for span in spans:
            first = max(span.start, original)  # the span's first position past the original context
            if first < span.start + span.length:
                positions = torch.arange(first, span.start + span.length, device=q.device)
                factor = 1 + beta * torch.log(1 + torch.floor(positions / original))
                at = row + first - span.start
                q[:, at:row + span.length] *= factor[:, None, None].to(q.dtype)
            row += span.length

    def _decode_natively(self, kernels: native.Kernels, qkv: torch.Tensor, out: torch.Tensor,
                         decoded: Sequence[tuple[int, Span]], layer: int,
                         rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """The native attention of the decode rows `decoded` ((row, span) pairs) of qkv [1, rows, heads, D] into
        out [1, rows, H * D], their keys and values cached; rotary: every row's cos and sin, for a kernel that is
        to rotate them (else qkv is rotated already)."""
        rows = qkv.shape[1]
        kernels.decode_attention(qkv[0].view(rows, -1), out[0], [r for r, _ in decoded],
                                 [s.cache.layer_slot(layer, s.start) for _, s in decoded],
                                 [s.start for _, s in decoded], self.n_heads, self.n_kv_heads,
                                 self.score_scale, rotary)

    @property
    def score_scale(self) -> float:
        """What the scores are multiplied by: the family's own scale, or SDPA's default head_dim ** -0.5."""
        return self.scale if self.scale is not None else self.head_dim ** -0.5

    def _decode_kernels(self, qkv: torch.Tensor, planned: bool = False) -> native.Kernels | None:
        """The native kernels where this layer's decode rows take their attention (attention.c), else None:
        bf16 on a CPU, no sliding window or soft-capped scores, heads the kernel takes, and a probe that found it
        faster than SDPA here (unless native_decode forces the choice); `planned`: for a decode plan, where
        agreeing with its reference is enough."""
        if self.native_decode is False or self.window is not None or self.softcap is not None:
            return None
        if qkv.dtype != torch.bfloat16 or qkv.device.type != "cpu" \
                or not native.attention_shape_ok(self.n_heads, self.n_kv_heads, self.head_dim):
            return None
        if self.native_decode is None \
                and not (native.attention_agrees() if planned else native.attention_faster_than_torch()):
            return None
        return native.kernels()

    def _attend(self, qkv: torch.Tensor, span: Span, layer: int) -> torch.Tensor:
        """One span's attention: qkv [1, L, heads, D] of its rows -> [1, L, H * D], its keys and values cached."""
        length, position_start = qkv.shape[1], span.start
        h, h_kv = self.n_heads, self.n_kv_heads
        kv = qkv[:, :, h:].unflatten(2, (2, h_kv)).permute(2, 0, 3, 1, 4)  # [2, 1, H_kv, L, D], a view
        keys, values = span.cache.update(layer, position_start, kv)  # [1, H_kv, T, D] each, T = start + L
        if length == 1 and self.softcap is None:
            # One query sees every cached position (with a sliding window, the last `window` of them: the rest are
            # sliced off, not masked), so the query heads sharing a KV head can go in as a block of queries against
            # it: no head is repeated and no mask is needed. (SDPA's own GQA path for bf16 took 8x longer at 128
            # positions and 30x at 2048; the masked path, 4.5x at 2048 behind a window of 512.)
            first = 0 if self.window is None else max(0, position_start + 1 - self.window)
            q = qkv[:, 0, :h].unflatten(1, (h_kv, h // h_kv))  # [1, H_kv, H / H_kv, D]
            out = F.scaled_dot_product_attention(q, keys[:, :, first:], values[:, :, first:], scale=self.scale)
            return out.reshape(1, 1, -1)  # [1, H_kv, H / H_kv, D] -> [1, 1, H * D]
        if self.window is not None or self.softcap is not None:
            return self._attend_masked(qkv[:, :, :h].transpose(1, 2), keys, values, position_start)
        q = qkv[:, :, :h].transpose(1, 2)  # [1, H, L, D]
        if position_start == 0:
            mask, causal = None, True
        else:  # a chunk after cached positions: query i sees keys up to position_start + i
            q_pos = torch.arange(position_start, position_start + length, device=qkv.device)
            k_pos = torch.arange(position_start + length, device=qkv.device)
            mask, causal = k_pos[None, :] <= q_pos[:, None], False  # [L, T]
        expand = self.expand_kv if self.expand_kv is not None else expand_kv_heads_on(q.device.type)
        out = grouped_attention(q, keys, values, mask, causal, expand, self.scale)  # [1, H, L, D]
        return out.transpose(1, 2).reshape(1, length, -1)

    def _attend_masked(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       position_start: int) -> torch.Tensor:
        """Attention of q [B, H, L, D] through a sliding window and/or soft-capped scores -> [B, L, H * D]."""
        b, _, length, _ = q.shape
        mask = visible_keys(position_start, length, self.window, q.device)  # [L, T]
        if self.softcap is not None:
            scale = self.score_scale
            out = softcapped_attention(q, keys, values, mask, scale, self.softcap)
        else:
            expand = self.expand_kv if self.expand_kv is not None else expand_kv_heads_on(q.device.type)
            out = grouped_attention(q, keys, values, mask, False, expand, self.scale)
        return out.transpose(1, 2).reshape(b, length, -1)


class MLP(nn.Module):
    """The gated feed-forward: down(act(gate(x)) * up(x)), gate and up as one product."""

    # None: a decode step's bf16 rows on a CPU take the native silu(gate) * up (act.c) where its probe finds it
    # faster; False: always PyTorch's operators; True: the native one wherever it runs
    native_act: bool | None = None

    def __init__(self, config: ModelConfig, inner: int | None = None, bias: bool | None = None):
        super().__init__()
        hidden, inner = config.hidden_size, inner or config.intermediate_size
        bias = config.mlp_bias if bias is None else bias
        self.gate_up_proj = Linear(hidden, 2 * inner, bias=bias)  # gate_proj, up_proj, fused on loading
        self.down_proj = Linear(inner, hidden, bias=bias)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"  # else silu (ModelConfig allows these two)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        kernels = self._act_kernels(gate_up)
        if kernels is not None:
            return self.down_proj(kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # [B, L, inner] each, views of this call's output
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate, inplace=True)
        return self.down_proj(act * up)

    def _act_kernels(self, gate_up: torch.Tensor, planned: bool = False) -> native.Kernels | None:
        """The native kernels where silu(gate) * up of these rows is theirs (act.c), else None: silu, a decode
        step's few contiguous bf16 rows on a CPU, and a probe that found it faster than PyTorch's operators there
        (unless native_act forces the choice); `planned`: for a decode plan, where agreeing with its reference is
        enough."""
        if self.native_act is False or self.gelu or gate_up.dtype != torch.bfloat16 \
                or gate_up.device.type != "cpu" or gate_up.numel() > native.ACT_ROWS * gate_up.shape[-1] \
                or not gate_up.is_contiguous():
            return None
        if self.native_act is None \
                and not (native.silu_mul_agrees() if planned else native.silu_mul_faster_than_torch()):
            return None
        return native.kernels()


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = pre_norm(config)
        self.self_attn = Attention(config, layer)
        # the norm before the MLP; with sandwich norms (Gemma) the one after attention, and two more around the MLP
        # (OLMo 2: only those after attention and the MLP, the others nn.Identity); none in a parallel block
        # (Cohere), whose MLP reads input_layernorm's output as attention does
        self.parallel = config.parallel_block
        if not self.parallel:
            self.post_attention_layernorm = norm(config)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = pre_norm(config)
            self.post_feedforward_layernorm = norm(config)
        if config.has_experts(layer):
            from .moe import SparseMoE  # the experts build on MLP above

            self.mlp = SparseMoE(config)  # whatever the checkpoint calls the block (Mixtral's block_sparse_moe)
        else:
            self.mlp = MLP(config)

    def forward(self, x, cos, sin, spans, layer):
        if self.parallel:  # x + attention + MLP, added in that order as the reference adds them
            normed = self.input_layernorm(x)
            h = x + self.self_attn(normed, cos, sin, spans, layer)
            return h.add_(self.mlp(normed))
        if self.sandwich:
            attn = self.self_attn(self.input_layernorm(x), cos, sin, spans, layer)
            h = x + self.post_attention_layernorm(attn)
            return h.add_(self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))))
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, spans, layer)  # x is the caller's
        return h.add_(self.mlp(self.post_attention_layernorm(h)))


def scales_queries(query_scaling: tuple[float, int] | None, spans: Sequence[Span]) -> bool:
    """Whether a step's queries need ModelConfig.query_scaling: a span reaches past the original context."""
    return query_scaling is not None and any(s.start + s.length > query_scaling[1] for s in spans)


def _exact_factor(factor: float | None) -> bool:
    """Whether multiplying or dividing float32 logits by `factor` (HeadModel.logit_scale, logits_scaling; None:
    none) changes no logit's order or ties: a power of two scales each (normal) float exactly. Cohere's published
    scales all are, and Granite's divisors (8, 16) too."""
    return factor is None or (factor > 0 and math.frexp(factor)[0] == 0.5)


def _give_back_freed_memory() -> None:
    """Return the C heap's free pages to the OS, where the C library is glibc (a no-op elsewhere).

    Loading frees what it read through (slabs and float temporaries of quantized weights, a plain weight once its
    packed copy is allocated) between allocations it keeps; glibc keeps such holes in its heap instead of
    unmapping them, and a 12-layer bf16 stage held ~100 MB of them (RSS 698 MB for 358 MB of weights, 598 MB when
    each layer gives them back, as the unpacked stage had).
    """
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def folded_scales(config: ModelConfig) -> dict[str, float]:
    """The linear layers of a decoder layer whose output the family multiplies by a constant, by that constant,
    which their weights and biases take as they load: Granite's residual_multiplier on o_proj and down_proj. In fp32
    (W * m) x differs from (W x) * m by a rounding of each product; the layer then spends nothing on it."""
    multiplier = config.residual_multiplier
    if multiplier is None:
        return {}
    assert config.experts is None, "a residual multiplier is folded into a dense MLP's down_proj only"
    return {"self_attn.o_proj": multiplier, "mlp.down_proj": multiplier}


def _load_layer(layer: nn.Module, index: WeightIndex, prefix: str, sources: dict[str, dict[str, tuple[int, ...]]],
                dtype: torch.dtype, device: torch.device | str, quantization: Quantization | None,
                scales: dict[str, float] | None = None, rows: list[int] | None = None) -> None:
    """Fill a layer built on the meta device from the checkpoint tensors named `prefix` + each source, the weights
    and biases of the modules in `scales` (folded_scales) multiplied by their factor in `dtype`, and qkv_proj's
    rows in the order `rows` gives (ModelConfig.rotary_rows), where given.

    Everything that stays in `dtype` (norms, biases, routers, and every weight without quantization) comes first,
    each tensor read straight into its place; then each linear weight to quantize streams in by slabs of rows and
    replaces its Linear by the quantized module, the bias loaded before kept as it is. A qkv_proj whose rows are
    reordered is read whole first (a few MB: the rows of one head are spread over the checkpoint's tensor).
    """
    quantize = quantization is not None and quantization.quantizes
    scales = scales or {}
    order = None if rows is None else torch.tensor(rows)
    reordered = ("self_attn.qkv_proj",)
    streamed: list[tuple[str, list[str]]] = []
    for target, parts in sources.items():
        names = [prefix + part for part in parts]
        path, _, attr = target.rpartition(".")
        module = layer.get_submodule(path)
        _check_fits(target, getattr(module, attr), index.stacked_shape(names))
        if quantize and isinstance(module, nn.Linear) and attr == "weight":
            streamed.append((path, names))
            continue
        tensor = index.load_rows(names, dtype)
        if order is not None and path in reordered:
            tensor = tensor.index_select(0, order)
        if path in scales:
            tensor.mul_(scales[path])
        setattr(module, attr, nn.Parameter(tensor.to(device), requires_grad=False))
    for path, names in streamed:
        assert quantization is not None
        linear = layer.get_submodule(path)
        scale = scales.get(path)
        pieces = index.row_slabs(names, dtype) if order is None or path not in reordered else \
            [(0, index.load_rows(names, dtype).index_select(0, order))]
        slabs = ((row, (slab if scale is None else slab.mul_(scale)).to(device)) for row, slab in pieces)
        quantized = quantization.linear(slabs, tuple(linear.weight.shape), device, linear.bias, dtype)
        parent, _, name = path.rpartition(".")
        setattr(layer.get_submodule(parent), name, quantized)
    unfilled = [n for n, t in [*layer.named_parameters(), *layer.named_buffers()] if t.is_meta]
    assert not unfilled, f"weights.layer_sources names no checkpoint tensor for {unfilled}"


def _check_fits(target: str, built: torch.Tensor, stored: tuple[int, ...]) -> None:
    if tuple(built.shape) != stored:
        raise WeightsError(f"the checkpoint's tensors for {target} stack to {list(stored)}; the layer config.json "
                           f"describes holds {list(built.shape)}. The checkpoint does not match config.json")


def _local_rotary(config: ModelConfig, device: torch.device | str) -> Rotary | None:
    """The rotary tables of the sliding-window layers where they differ from the others' (Gemma 3), else None."""
    if config.local_rope is None or config.local_rope == config.rope or not config.sliding_windows:
        return None
    return _rotary(config, config.local_rope, device)


def _rotary(config: ModelConfig, rope: Rope, device: torch.device | str) -> Rotary:
    """The rotary tables of `rope` (the model's, or its sliding layers' own) for this model's heads."""
    return Rotary(config.head_dim, rope, device, config.context_length, config.rotary_dim, config.fp32_rotary_tables)


class StepInterrupted(Exception):
    """A stage's step given up between two layers (Stage.forward_batch's `interrupted`)."""


class Stage(nn.Module):
    """Decoder layers [start, end) of a model: one worker's share of the pipeline."""

    # True: a decode step whose layers' small parts can all take their native kernels runs as one DecodePlan
    # (decode_plan.py); False: always through the modules, so that their own choices can be tested
    decode_plans: bool = True

    def __init__(self, config: ModelConfig, start: int, end: int, device: torch.device | str = "cpu"):
        super().__init__()
        if not 0 <= start < end <= config.num_hidden_layers:
            raise ValueError(f"layer range [{start}, {end}) is not inside [0, {config.num_hidden_layers})")
        self.config, self.start, self.end = config, start, end
        # keyed by global layer number, so state-dict names match the checkpoint's
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, i) for i in range(start, end)})
        self.rotary = _rotary(config, config.rope, device)
        self.local_rotary = _local_rotary(config, device)
        self._plans = Plans()  # by what a plan's calls depend on (_plan_key)

    @classmethod
    def load(cls, config: ModelConfig, index: WeightIndex, start: int, end: int,
             dtype: torch.dtype, device: torch.device | str = "cpu", quantization: Quantization | None = None,
             progress: Callable[[int, int], None] | None = None, pack: bool | None = None) -> "Stage":
        """Build layers [start, end) from the checkpoint, reading only their bytes, in `dtype` on `device`.

        Layers load one at a time. With `quantization`, each linear weight is quantized as its rows stream from the
        file, a slab of at most weights.SLAB_BYTES at a time, so the peak memory is the quantized stage plus one
        slab and its float temporaries: no layer, and no linear layer, is ever whole in 16 bits. The linear layers
        left unquantized then take the fastest product this CPU has for their shape (`dense.pack_linears`; `pack`
        as its `force`).
        Raises WeightsError for a checkpoint tensor that is missing or does not fit the layer config.json implies.
        """
        with torch.device("meta"):
            stage = cls(config, start, end)
        for done, i in enumerate(range(start, end), 1):
            layer = stage.layers[str(i)]
            _load_layer(layer, index, layer_prefix(i), layer_sources(config, i), dtype, device, quantization,
                        folded_scales(config), config.rotary_rows())
            pack_linears(layer, force=pack)
            _give_back_freed_memory()
            if progress is not None:
                progress(done, end - start)
        stage.rotary = _rotary(config, config.rope, device)
        stage.local_rotary = _local_rotary(config, device)
        return stage.eval()

    def new_cache(self, capacity: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        c = self.config
        return KVCache(list(range(self.start, self.end)), c.num_key_value_heads, c.head_dim, capacity,
                       dtype, device)

    def forward(self, hidden: torch.Tensor, cache: KVCache, position_start: int) -> torch.Tensor:
        """Run one sequence's hidden states [1, L, hidden] at positions [position_start, +L) through every layer."""
        return self.forward_batch(hidden, [Span(cache, position_start, hidden.shape[1])])

    @torch.inference_mode()
    def forward_batch(self, hidden: torch.Tensor, spans: Sequence[Span],
                      interrupted: Callable[[], bool] | None = None) -> torch.Tensor:
        """Run a ragged batch [1, rows, hidden], the spans' rows one after another, through every layer.
        `interrupted`, asked before each layer: where it says so, the step is given up (StepInterrupted), its
        caches part-written (a worker whose head went away: no one is left to read the output)."""
        if hidden.shape[0] != 1 or hidden.shape[1] != sum(s.length for s in spans):
            raise ValueError(f"hidden states {list(hidden.shape)} do not hold the spans' "
                             f"{sum(s.length for s in spans)} rows as [1, rows, hidden]")
        plan = self._decode_plan(hidden.dtype, hidden.device.type, spans)
        if plan is not None:
            hidden = plan.run(hidden, *_plan_rows(spans), self.rotary)
            for span in spans:
                span.cache.length = span.start + span.length
            return hidden
        cos, sin = self.rotary.span_tables(spans, hidden.dtype)
        local = (cos, sin) if self.local_rotary is None else \
            self.local_rotary.span_tables(spans, hidden.dtype)  # sliding layers' own (Gemma 3)
        for done, (key, layer) in enumerate(self.layers.items()):
            if interrupted is not None and interrupted():
                raise StepInterrupted(f"the step was given up after {done} of the stage's {len(self.layers)} layers")
            if layer.self_attn.sliding:
                hidden = layer(hidden, *local, spans, int(key))
                continue
            hidden = layer(hidden, cos, sin, spans, int(key))
        for span in spans:
            span.cache.length = span.start + span.length
        return hidden

    @torch.inference_mode()
    def decode_bytes(self, hidden: bytes | bytearray | memoryview, spans: Sequence[Span]) -> bytearray | None:
        """A decode step of CPU rows given as their bf16 bytes (C order, as the wire carries a [1, rows, hidden]
        hidden state) -> the output rows' bytes, through the stage's decode plan; None where no plan takes the
        step (forward_batch runs it then). A worker's hop thus makes no tensor of the rows it passes on."""
        plan = self._decode_plan(torch.bfloat16, "cpu", spans)
        if plan is None:
            return None
        out = plan.run_bytes(hidden, *_plan_rows(spans), self.rotary)
        for span in spans:
            span.cache.length = span.start + span.length
        return out

    def _decode_plan(self, dtype: torch.dtype, device_type: str, spans: Sequence[Span]) -> DecodePlan | None:
        """The plan for a step of `dtype` rows on `device_type`: bf16 decode rows on the CPU (one position of each
        sequence, or a few consecutive ones: _plan_takes), at most the native.ACT_ROWS the activation kernel takes,
        through layers whose norms, attention and activation all take their native kernels for that many rows
        (made once, and kept while it is current); else None."""
        rows = sum(s.length for s in spans)
        if not self.decode_plans or dtype != torch.bfloat16 or device_type != "cpu" or rows > native.ACT_ROWS \
                or not all(_plan_takes(s) for s in spans) or self.local_rotary is not None \
                or scales_queries(self.config.query_scaling, spans):  # the plan's attention rotates the queries
            return None
        key = self._plan_key(rows)
        if key in self._plans:
            plan = self._plans[key]
            if plan is None or plan.current():  # None: these layers decline such steps
                return plan
            self._plans.clear()  # the stage changed: the others are stale too, and hold what it let go
        plan = self._plans[key] = DecodePlan.make(self.layers, rows)
        return plan

    @staticmethod
    def _plan_key(rows: int) -> tuple:
        """What a plan's calls were chosen by, beside the modules (DecodePlan.current checks those): the rows, the
        threads each kernel is told to use, and the switches that send a layer's parts to PyTorch instead."""
        kernels = native.kernels()
        prefetch = (tuple(kernels.prefetch_rows.values()) + tuple(kernels.prefetch_ahead.values())
                    + tuple(kernels.streams.values()) if kernels is not None else ())
        return (rows, torch.get_num_threads(), RMSNorm.native, Attention.native_decode, MLP.native_act, prefetch)


def _plan_rows(spans: Sequence[Span]) -> tuple[list[KVCache], list[int]]:
    """Each row's cache and position for a decode plan: a span of several rows (a draft) is that many positions of
    its sequence, which the native attention stores before any of them attends."""
    caches = [s.cache for s in spans for _ in range(s.length)]
    return caches, [s.start + i for s in spans for i in range(s.length)]


def _screen_turned_off() -> bool:
    return os.environ.get("TC_GREEDY_SCREEN", "1") == "0"


def _may_screen(weight: torch.Tensor) -> bool:
    """Whether HeadModel.screen_greedy could give this lm_head weight a screen (its probe then decides)."""
    return not _screen_turned_off() and screens(weight) and native.kernels() is not None


class HeadModel(nn.Module):
    """What the head owns: token embedding, final norm and lm_head (tied to the embedding or not)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # given a weight (the checkpoint's replaces it as it loads), not drawn at random: on the meta device that
        # draw imported sympy and ~800 other modules, ~1 s of every head's start
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.norm = norm(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.embedding_scale = config.embedding_scale  # Gemma: sqrt(hidden), rounded to the compute dtype
        self.final_softcap = config.final_softcap
        self.logits_scaling = config.logits_scaling  # Granite divides its logits by it
        self.logit_scale = config.logit_scale  # Cohere multiplies them by it
        self.greedy_screen: GreedyScreen | None = None  # screen_greedy's, for the lm_head it was made for
        self._greedy_plan: GreedyPlan | None = None  # an int8 lm_head's (greedy_tokens)
        # the lm_head no plan takes (not asked again), weakly: a module set as an attribute would become a
        # submodule, and a replaced one is not kept
        self._greedy_plan_declined: weakref.ref | None = None

    @classmethod
    def load(cls, config: ModelConfig, index: WeightIndex, dtype: torch.dtype,
             device: torch.device | str = "cpu", pack: bool | None = False) -> "HeadModel":
        """The head's tensors from the checkpoint.

        With pack=None (or True), an lm_head of its own takes the fastest product this CPU has for its shape
        (`dense.pack_linears`, `pack` as its `force`). Off by default: packing briefly holds the matrix twice (the
        largest one of a small model), which is only worth it for an lm_head that stays in the compute dtype, while
        a head in int8 or int4 quantizes its lm_head after loading. An lm_head tied to the embedding is never
        packed, since that would hold the matrix twice for good; with pack=None it may take the native product,
        which reads the embedding's own tensor. Nor, with pack=None, is one that a greedy screen can take
        (`screen_greedy`): the screen reads the rows it keeps from the plain weight, which the blocked layout
        replaces, and a probe that found the blocked product fastest (as one did under load) cost greedy steps
        the screen: the demo's lm_head in 5-6 ms on a 2-core Xeon against 12 for the native product and 15 for the
        blocked one. Steps that need every logit then take the native or plain product."""
        with torch.device("meta"):
            head = cls(config)
        names = head_tensor_names(config)
        own = own_lm_head(config, index)
        tensors = {n: t.to(device) for n, t in index.load(names + [LM_HEAD] if own else names, dtype=dtype).items()}
        if own and torch.equal(tensors[LM_HEAD], tensors["model.embed_tokens.weight"]):
            del tensors[LM_HEAD]  # the embedding's values: tied, one tensor
        elif own:
            log.warning("config.json ties the lm_head to the embedding (tie_word_embeddings), but the checkpoint holds "
                        "an lm_head of its own with other values: the head uses it, as transformers 5 does (setting "
                        "tie_word_embeddings to false in config.json says so)")
        head.embed_tokens.weight = nn.Parameter(tensors["model.embed_tokens.weight"], requires_grad=False)
        head.norm.weight = nn.Parameter(tensors["model.norm.weight"], requires_grad=False)
        lm = tensors.get(LM_HEAD, tensors["model.embed_tokens.weight"])  # tied: one tensor, two uses
        head.lm_head.weight = nn.Parameter(lm, requires_grad=False)
        if LM_HEAD in tensors:
            pack_linears(head, force=pack, allowed=("plain", "native") if pack is None and _may_screen(lm) else
                         PRODUCTS)
        elif pack is None:
            pack_linears(head, allowed=("plain", "native"))
        return head.eval()

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._scaled(self.embed_tokens(token_ids))  # [B, L] -> [B, L, hidden]

    def embed_ids(self, ids: Sequence[int]) -> torch.Tensor:
        """`embed` for a step's token ids given as ints, one row each: [1, len(ids), hidden], the same rows bit for
        bit as torch.tensor on the list and nn.Embedding. The head's path for every step, on caches its lm_head has
        just swept, where each PyTorch call costs tens of microseconds: one id (a decode step of one sequence) is
        its row copied, several are read with one index_select on an index made from the ints' bytes. Timed after
        a cache sweep, one id took 115 µs through the index and inference mode, 44 µs as a copy of its row.
        No inference mode: the weight needs no gradient, and entering the mode cost ~28 µs of those."""
        weight = self.embed_tokens.weight
        if len(ids) == 1 and 0 <= ids[0] < weight.shape[0]:  # past the vocabulary: index_select says so below
            return self._scaled(weight[ids[0]].view(1, 1, -1).clone())
        index = torch.frombuffer(array.array("q", ids), dtype=torch.int64) if ids else \
            torch.empty(0, dtype=torch.int64)
        if weight.device.type != "cpu":
            index = index.to(weight.device)
        return self._scaled(weight.index_select(0, index).unsqueeze(0))

    def _scaled(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.embedding_scale is not None:
            hidden = hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype)
        return hidden

    def screen_greedy(self) -> GreedyScreen | None:
        """Give greedy steps an int8 screen of a bf16 lm_head (greedy_screen.py) where the native int8 product
        streams it faster than the lm_head's own product streams the bf16 weight: timed here once, on one row
        of this machine's threads, the weights coming from memory as in a step. Call it once the lm_head is
        final (after quantize_linears: a quantized lm_head has nothing to screen). Returns the screen, or None
        (also where the screen cannot be made: a weight row that is not finite, no memory for the copy).
        TC_GREEDY_SCREEN=0 turns it off, for a head whose memory cannot spare the copy (half the lm_head's)."""
        self.greedy_screen = None
        if _screen_turned_off():
            log.info("greedy steps read the whole lm_head: its int8 screen is off (TC_GREEDY_SCREEN=0)")
            return None
        weight = getattr(self.lm_head, "weight", None)
        kernels = native.kernels()
        if kernels is None or not screens(weight):
            return None
        started = time.perf_counter()
        try:
            screen = GreedyScreen(weight, kernels)
            x = self.norm(self.embed_ids([0]))[0].contiguous()  # a row of the model's scale; its values do not matter
            # each after a sweep of the caches, as dense.fastest_product times one row: an int8 copy that fits
            # the last-level cache where the bf16 weight does not would otherwise be timed from the cache
            screened_s, full_s = race([lambda: screen.screen(x), lambda: self.lm_head(x)], runs=3,
                                      before=cache_sweeper(), clock=time.perf_counter)
        except (ValueError, MemoryError) as exc:  # a speed-up only: the head serves as well without it
            log.warning("greedy steps read the whole bf16 lm_head: no int8 screen of it (%s)", exc)
            return None
        if screened_s > MAX_TIME_SHARE * full_s:
            log.info("greedy steps read the whole bf16 lm_head: its int8 screen took %.1f ms against %.1f ms here",
                     screened_s * 1e3, full_s * 1e3)
            return None
        log.info("greedy steps screen the lm_head in int8 (%.1f MiB more memory, made in %.1f s): %.1f ms against "
                 "%.1f ms for the bf16 product", screen.nbytes / (1 << 20), time.perf_counter() - started,
                 screened_s * 1e3, full_s * 1e3)
        self.greedy_screen = screen
        return screen

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """The index of each row's largest logit for final hidden states [1, rows, hidden], as greedy() would find
        it in `logits(hidden)`: from the greedy screen of a bf16 lm_head, or an int8 lm_head's greedy plan
        (greedy_plan.py); None where neither answers (no screen or plan, or the screen answers none for a row that
        is not finite or too wide a choice, or the plan takes no such rows): the caller then takes the logits."""
        screen = self.greedy_screen
        if screen is not None and screen.weight is getattr(self.lm_head, "weight", None):  # this lm_head's
            return self._screened_tokens(screen, hidden)
        exact = _exact_factor(self.logits_scaling) and _exact_factor(self.logit_scale)
        if not exact or self.final_softcap is not None:
            # logits need more than the product: operations whose rounding may tie logits the product keeps apart
            return None
        plan = self._greedy_plan
        if plan is None or not plan.current(self.norm, self.lm_head):
            plan = self._make_greedy_plan()
        return None if plan is None else plan.tokens(hidden)

    def _make_greedy_plan(self) -> GreedyPlan | None:
        """A greedy plan for this norm and lm_head where one takes them; asked once for each lm_head."""
        self._greedy_plan = None
        if self._greedy_plan_declined is not None and self._greedy_plan_declined() is self.lm_head:
            return None
        if GreedyPlan.takes(self.norm, self.lm_head):
            self._greedy_plan = GreedyPlan(self.norm, self.lm_head)
        else:
            self._greedy_plan_declined = weakref.ref(self.lm_head)
        return self._greedy_plan

    @torch.inference_mode()
    def _screened_tokens(self, screen: GreedyScreen, hidden: torch.Tensor) -> list[int] | None:
        normed = self.norm(hidden)[0]
        if normed.dtype != torch.bfloat16:
            return None
        # logits_scaling and logit_scale need no part here: one positive divisor or factor, which moves no argmax,
        # and ties no two bf16 logits (they lie much further apart than a float32 rounding)
        found = screen.candidates(normed.contiguous(), self.final_softcap)
        if found is None:
            return None
        ids, logits = found
        if self.final_softcap is not None:  # as logits() applies it: monotonic, but its rounding may tie two
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return ids[logits.argmax(dim=1)].tolist()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, L, vocab] for final hidden states [B, L, hidden]: the lm_head's output widened, which
        an int8 lm_head writes as float32 itself (quant.Int8Linear.widened)."""
        normed = self.norm(hidden)
        widened = getattr(self.lm_head, "widened", None)
        logits = widened(normed) if widened is not None else self.lm_head(normed).float()
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
