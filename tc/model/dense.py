"""Unquantized linear layers, each on the fastest product PyTorch offers on this machine for its shape.

Theory of operation
-------------------
A decode step multiplies one activation row by every weight matrix, so its speed is how fast each product streams
its weight. On x86 CPUs with bf16 arithmetic, `F.linear` on a bf16 weight in the checkpoint's plain [out, in]
layout is far from that: oneDNN, which runs it, rearranges the weight into its own blocked layout as it goes.
`torch.ops.mkldnn._reorder_linear_weight` does that rearrangement once (the freezing pass of torch.compile's
inductor does the same) and `torch.ops.mkldnn._linear_pointwise` then multiplies by the blocked weight. On an
AVX512-BF16 EPYC this doubled the one-row rate (8-9 GB/s on one core to 15-18) and gave the same bits. The
blocked weight takes the same bytes as the plain one and replaces it (`PackedLinear`).

Whether it is faster is never assumed from the CPU model: `packed_is_faster(out, in, dtype)` times both products
on a weight of that shape, for one row (decode) and for a block of rows (prefill), once per process and shape,
checks that they agree, and the weight is packed only where the blocked product wins one row clearly and does
not lose the block. `pack_linears` applies that to a loaded module, on the CPU, in bf16 only: fp32 is the
reference dtype, whose results stay those of the reference ops, and fp16 computes in fp32 on CPUs.

`Linear` is the plain path: nn.Linear, except that on CPUs without bf16 arithmetic its multi-token bf16 products
run in fp32 (`cpu_bf16_matmul_is_slow`).
"""
from __future__ import annotations

import functools
import logging
import platform

import torch
import torch.nn.functional as F
from torch import nn

from .probe import one_thread, race

log = logging.getLogger(__name__)

UPCAST_MIN_TOKENS = 8  # one decode token is memory-bound, where bf16's smaller reads win
PACKED_DTYPES = (torch.bfloat16,)  # fp16 computes in fp32 on CPUs (qwen2.resolve_compute_dtype)
PROBE_ROWS = 4096  # the probe times a slab of at most this many output rows: an lm_head's speed per row, cheaply
PROBE_BLOCK = 64  # rows of activations standing for a prefill in the probe
PACK_MIN_GAIN = 1.25  # the blocked product must be this much faster on one row to be worth a second path
BLOCK_SLACK = 1.5  # and at most this much slower on a block (see packed_is_faster)


@functools.lru_cache(maxsize=None)
def cpu_bf16_matmul_is_slow() -> bool:
    """Whether this CPU multiplies bf16 matrices much slower than fp32 ones.

    x86 CPUs without AVX512-BF16 or AMX have no bf16 arithmetic: a bf16 prefill-sized product ran 5-7x slower
    than fp32 on one (AMD EPYC, AVX2). There, multi-token bf16 inputs are better multiplied in fp32, converting
    the weight on the fly. Where the flags cannot be read (not Linux), a short timing decides.
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        flags = None
    if flags is not None and platform.machine().lower() in ("x86_64", "amd64", "i686"):
        return not ({"avx512_bf16", "amx_bf16"} & set(flags))
    x, w = torch.randn(64, 1024), torch.randn(1024, 1024)
    xb, wb = x.bfloat16(), w.bfloat16()
    with one_thread():
        bf16_s, fp32_s = race([lambda: F.linear(xb, wb), lambda: F.linear(xb.float(), wb.float())], 5)
    return bf16_s > 1.5 * fp32_s


class Linear(nn.Linear):
    """nn.Linear whose multi-token bf16 products run in fp32 on CPUs where bf16 matmul is slow (same result
    up to rounding, several times faster prefill there). Quantization replaces it like any nn.Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() >= 2
                and x.shape[-2] >= UPCAST_MIN_TOKENS and cpu_bf16_matmul_is_slow()):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return super().forward(x)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] plain weight -> oneDNN's blocked layout for it (an opaque mkldnn tensor of the same bytes)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)  # laid out for a batch of 1 row


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_is_faster(out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    """Whether the blocked oneDNN product beats `Linear` on this CPU for a weight of this shape (probed once).

    Times both on a random weight of at most PROBE_ROWS rows (shapes that differ only beyond that share a probe),
    on one thread: one activation row must be PACK_MIN_GAIN times faster, and a PROBE_BLOCK-row block not clearly
    slower (BLOCK_SLACK: prefill timings on a shared machine swing by tens of percent, while a CPU whose blocked
    bf16 prefill really loses, one without bf16 arithmetic where `Linear` multiplies in fp32, loses several times
    over); the outputs must agree.
    """
    return _probe(min(out_features, PROBE_ROWS), in_features, dtype)


@functools.lru_cache(maxsize=None)
def _probe(out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    gen = torch.Generator().manual_seed(0)
    plain = Linear(in_features, out_features, bias=True, dtype=dtype)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(plain.weight.shape, generator=gen) * in_features ** -0.5)
        plain.bias.copy_(torch.randn(plain.bias.shape, generator=gen))
    one = torch.randn(1, in_features, generator=gen).to(dtype)
    block = torch.randn(PROBE_BLOCK, in_features, generator=gen).to(dtype)
    try:
        packed = _pack(plain.weight.detach())
        got = _packed_linear(block, packed, plain.bias.detach())
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        log.info("no blocked oneDNN product for %s on this CPU (%s); using F.linear", dtype, exc)
        return False
    with torch.no_grad():
        want = plain(block)
        err = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))
        if err > 1e-2:
            log.warning("the blocked oneDNN product disagrees with F.linear (relative error %.1e); using F.linear",
                        err)
            return False
        bias = plain.bias.detach()
        with one_thread():  # see probe.py: steady timings on a shared machine
            one_s = race([lambda: plain(one), lambda: _packed_linear(one, packed, bias)], 7)
            block_s = race([lambda: plain(block), lambda: _packed_linear(block, packed, bias)], 3)
    times = {"plain one": one_s[0], "packed one": one_s[1], "plain block": block_s[0], "packed block": block_s[1]}
    faster = (times["plain one"] >= PACK_MIN_GAIN * times["packed one"]
              and times["packed block"] <= BLOCK_SLACK * times["plain block"])
    log.info("%s [%d, %d] products: one row %.0f us plain, %.0f us blocked; %d rows %.0f us plain, %.0f us blocked: "
             "%s", dtype, out_features, in_features, times["plain one"] * 1e6, times["packed one"] * 1e6, PROBE_BLOCK,
             times["plain block"] * 1e6, times["packed block"] * 1e6, "blocked" if faster else "plain")
    return faster


class PackedLinear(nn.Module):
    """A linear layer whose weight is held in oneDNN's blocked layout (see the module docstring).

    Buffers: packed (opaque mkldnn tensor, the weight's bytes), bias. CPU only, in the weight's dtype; the layout
    cannot move to another device or dtype (pack after moving). `dense_weight()` gives the plain weight back, for
    quantizing a packed layer.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES:
            raise ValueError(f"PackedLinear takes a 2-D CPU weight in one of {PACKED_DTYPES}, got "
                             f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", _pack(weight.detach()))
        self.register_buffer("bias", None if bias is None else bias.detach().to(weight.dtype))

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PackedLinear":
        return cls(linear.weight, linear.bias)

    def dense_weight(self) -> torch.Tensor:
        """The plain [out, in] weight (a new tensor)."""
        return self._buffers["packed"].to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers  # plain dict lookups: nn.Module.__getattr__ costs ~1 us per buffer
        return _packed_linear(x, buffers["packed"], buffers["bias"])  # [..., out]

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module's own signature
        probe = fn(torch.empty(0, dtype=self._buffers["packed"].dtype))
        if probe.device.type != "cpu" or probe.dtype != self._buffers["packed"].dtype:
            raise ValueError(f"PackedLinear holds a oneDNN CPU layout in {self._buffers['packed'].dtype} and cannot "
                             f"become {probe.dtype} on {probe.device}; move or cast the model before packing it")
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"path=oneDNN blocked"


def pack_linears(module: nn.Module, *, force: bool | None = None) -> int:
    """Replace each CPU nn.Linear below `module` in bf16 by a PackedLinear where that is faster here.

    force=None asks `packed_is_faster` per shape; True packs every one that can be packed; False packs nothing.
    A Linear shared by several parents stays shared. Returns how many were packed.
    """
    if force is False:
        return 0
    replacements: dict[int, nn.Module] = {}
    for parent in list(module.modules()):
        for name, child in list(parent._modules.items()):  # named_children() would skip a repeated child
            if not isinstance(child, nn.Linear):
                continue
            w = child.weight
            if w.device.type != "cpu" or w.dtype not in PACKED_DTYPES:
                continue
            if id(child) not in replacements:
                if not (force or packed_is_faster(child.out_features, child.in_features, w.dtype)):
                    continue
                replacements[id(child)] = PackedLinear.from_linear(child)
            setattr(parent, name, replacements[id(child)])
    return len(replacements)
