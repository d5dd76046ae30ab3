"""Unquantized linear layers, each on the fastest product this machine has for its shape.

Theory of operation
-------------------
A decode step multiplies one activation row by every weight matrix, so its speed is how fast each product streams
its weight. On x86 CPUs with bf16 arithmetic, `F.linear` on a bf16 weight in the checkpoint's plain [out, in]
layout is far from that: oneDNN, which runs it, rearranges the weight into its own blocked layout as it goes.
`torch.ops.mkldnn._reorder_linear_weight` does that rearrangement once (the freezing pass of torch.compile's
inductor does the same) and `torch.ops.mkldnn._linear_pointwise` then multiplies by the blocked weight. On an
AVX512-BF16 EPYC this doubled the one-row rate (8-9 GB/s on one core to 15-18) and gave the same bits. The
blocked weight takes the same bytes as the plain one and replaces it (`PackedLinear`).

Faster still for the one row of a decode step is the native product (native.py's bf16dot.c), which reads the
plain weight row by row in order and streams it at the memory's rate: on the same EPYC 24-38 GB/s where the
blocked product made 13-26, over the demo model's shapes. It is for a few rows only: each pass of up to 8 rows
reads the whole weight, and at 4-8 rows it is about as fast as the blocked product for weights with short rows
and half as fast for long ones (their activation rows no longer fit L1). So `NativeLinear` keeps the plain weight
and gives larger inputs (prefill) to F.linear, which multiplies 64 rows and more about as fast as the blocked
layout.

Which product is fastest is never assumed from the CPU model: `fastest_product(out, in, dtype)` times them on a
weight of that shape, for one row (decode), 8 rows (a batch's decode step) and a block of rows (prefill), once per
process and shape, checks that they agree, and `pack_linears` gives each layer the one that is fastest on one row
without losing a batch step or a prefill by much (native, blocked, or plain). It applies to a loaded module, on
the CPU, in bf16 only: fp32 is the reference dtype, whose results stay those of the reference ops, and fp16
computes in fp32 on CPUs.

`Linear` is the plain path: nn.Linear, except that on CPUs without bf16 arithmetic its multi-token bf16 products
run in fp32 (`cpu_bf16_matmul_is_slow`).
"""
from __future__ import annotations

import functools
import logging
import platform
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

from . import native
from .probe import cache_sweeper, one_thread, race

log = logging.getLogger(__name__)

UPCAST_MIN_TOKENS = 8  # one decode token is memory-bound, where bf16's smaller reads win
UPCAST_SLAB_BYTES = 64 << 20  # fp32 weight rows converted at a time for such products (float_linear)
PACKED_DTYPES = (torch.bfloat16,)  # fp16 computes in fp32 on CPUs (qwen2.resolve_compute_dtype)
PROBE_ROWS = 4096  # the probe times a slab of at most this many output rows: an lm_head's speed per row, cheaply
PROBE_BLOCK = 64  # rows of activations standing for a prefill in the probe
PROBE_FEW = 8  # ... and for a decode step of a batch of sequences
BLOCK_SLACK = 2.0  # a product's prefill may be at most this much slower than the fastest (see fastest_product)
FEW_SLACK = 2.0  # ... and a batch's decode step this much
TIE = 1.1  # one-row times this close are a tie: the native product takes it, else the faster batch step
PRODUCTS = ("plain", "packed", "native")  # F.linear (Linear), oneDNN blocked (PackedLinear), NativeLinear


@functools.lru_cache(maxsize=None)
def cpu_bf16_matmul_is_slow() -> bool:
    """Whether this CPU multiplies bf16 matrices much slower than fp32 ones.

    x86 CPUs without AVX512-BF16 or AMX have no bf16 arithmetic: a bf16 prefill-sized product ran 5-7x slower
    than fp32 on one (AMD EPYC, AVX2). There, multi-token bf16 inputs are better multiplied in fp32, converting
    the weight on the fly. Where the flags cannot be read (not Linux), a short timing decides.
    """
    flags = native.cpu_flags()
    if flags is not None and platform.machine().lower() in ("x86_64", "amd64", "i686"):
        return not ({"avx512_bf16", "amx_bf16"} & flags)
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
            return float_linear(x, self.weight, self.bias)
        return super().forward(x)


_upcast = threading.local()  # each thread's buffer for float_linear's slabs of weight rows


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear of bf16 x and weight computed in fp32 and rounded back to bf16: the weight converted at most
    UPCAST_SLAB_BYTES of it at a time into a buffer the calling thread keeps, each slab's columns of the output
    multiplied on their own (on the EPYC below, the same bits as converting it whole). Converted whole, into a
    fresh tensor each call, a weight over glibc's 32 MB mapping threshold had every page of its copy faulted in
    again every time: on a 2-core Zen 3 EPYC the demo's fused gate/up projection ([9728, 896], 35 MB in fp32)
    took 1.6-2.6x as long for 8 to 128 rows (26 ms against 13 for 64) and 1.2x for 512, and 12 demo layers read a
    256-token prompt chunk in 0.82x the time so (`python bench/profile_step.py --modes fp16 --context 256
    --against REV`). The buffer stays with its thread: up to UPCAST_SLAB_BYTES (one weight row where that is
    larger) for each thread that makes such products, where the copies it replaces came and went."""
    out_features, in_features = weight.shape
    rows = max(1, UPCAST_SLAB_BYTES // (4 * in_features))
    wanted = min(out_features, rows) * in_features
    buffer = kept_buffer(_upcast, wanted, torch.float32)
    weight, xf = weight.detach(), x.float()  # the kept buffer never joins an autograd graph
    if out_features <= rows:
        weight_f = _converted(buffer, weight)
        return F.linear(xf, weight_f, None if bias is None else bias.float()).to(x.dtype)
    y = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
    for start in range(0, out_features, rows):
        end = min(out_features, start + rows)
        y[..., start:end] = F.linear(xf, _converted(buffer, weight[start:end]),
                                     None if bias is None else bias[start:end].float())
    return y


def kept_buffer(store: threading.local, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """`numel` values of `dtype` on the CPU, the start of a buffer that `store` keeps for the calling thread and
    grows as needed: for products that convert weights each call, where a fresh tensor of tens of MB would cost
    its page faults every time."""
    buffer = getattr(store, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        # a normal tensor even when made under inference_mode (a model's forward): an inference tensor could not
        # be written again outside it (a layer's speed probe, under no_grad)
        with torch.inference_mode(False):
            buffer = store.buffer = torch.empty(numel, dtype=dtype, device="cpu")
    return buffer[:numel]


def _converted(buffer: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`weight` [rows, in] in float32, written over the start of `buffer`."""
    with torch.no_grad():
        return buffer[:weight.numel()].view(weight.shape).copy_(weight)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] plain weight -> oneDNN's blocked layout for it (an opaque mkldnn tensor of the same bytes)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)  # laid out for a batch of 1 row


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.lru_cache(maxsize=None)
def can_pack(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this torch and CPU hold a weight of `dtype` in oneDNN's blocked layout at all: an AVX2-only CPU
    has no bf16 path for it (oneDNN asks for avx512bw/vl/dq or avx_ne_convert)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        _pack(torch.ones(16, 16, dtype=dtype))
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        log.info("no blocked oneDNN layout for %s on this CPU (%s)", dtype, exc)
        return False
    return True


def fastest_product(out_features: int, in_features: int, dtype: torch.dtype, allowed: tuple[str, ...] = PRODUCTS
                    ) -> str:
    """Which of the `allowed` PRODUCTS a weight of this shape should take on this CPU (probed once per shape and
    process; "plain" where none of them qualifies).

    Times each on a random weight of at most PROBE_ROWS rows (shapes that differ only beyond that share a probe)
    for one activation row (decode) as a step runs it, on every thread with the weight streamed from memory; and,
    on one thread from cache (steady timings: probe.py), for PROBE_FEW rows (a batch's decode step) and PROBE_BLOCK
    rows (prefill: the blocked product's own, F.linear's for the native one). F.linear and the blocked product
    qualify where their prefill is within BLOCK_SLACK of the fastest's and their batch step within FEW_SLACK of the
    fastest's. The native product stands in for F.linear on a decode step's few rows and leaves it the rest (its
    prefill is F.linear's), so it is judged against F.linear: it qualifies where its batch step is within FEW_SLACK
    of F.linear's. Of those that qualify, the fastest on one row wins; on a near tie there (within TIE) the native
    product where it is among them (a decode plan calls it directly, where it calls any other product as a module:
    a dispatch and a copy more, which the probe does not time), else the one faster on the batch step (a near tie
    on one row is noise; the batch step's difference is not), in PRODUCTS' order on a full tie.

    The slacks keep out a product that loses the other work several times over, while the one-row lead decides:
    a CPU without bf16 arithmetic, where `Linear` multiplies in fp32, loses a blocked prefill 4x and more, and the
    native product of a weight with long rows (the demo's [896, 4864]) lost 8 rows 2x before bf16dot.c read such
    weights in tiles. The cache-held timings differ from a step's by tens of percent, and oneDNN's blocked product
    ran some shapes 2-3x faster in some processes than in others. On a 2-core Sapphire Rapids VM the probe found the
    native product 1.15-1.3x slower than the fastest for 8 rows of the demo's shapes (1.9x for [896, 896] in a
    process where the blocked product ran fast), and F.linear's prefill 1.3x the blocked product's (2.1x in such
    a process), where a step found the native product 0.7-0.85x as slow as F.linear on 8 rows (1.2x for
    [896, 4864]) and 1.5-2x faster than either on one row. Judging the native product against the fastest of all,
    with slacks of 1.25 and 1.5 and one row timed from cache on one thread, gave the demo's projections to the
    native product in one process and to F.linear or the blocked product, at 50-60% of its one-row rate, in the
    next.

    Only the allowed products (and F.linear, always possible) compete, so a weight that may not be blocked is never
    measured against the blocked product. A blocked product must also agree with F.linear.
    """
    if dtype not in PACKED_DTYPES:
        return "plain"
    one_s, few_s, block_s = _probe(min(out_features, PROBE_ROWS), in_features, dtype)
    candidates = [p for p in one_s if p in allowed or p == "plain"]
    qualified = [p for p in candidates if p != "native"
                 and block_s[p] <= BLOCK_SLACK * min(block_s[c] for c in candidates)
                 and few_s[p] <= FEW_SLACK * min(few_s[c] for c in candidates)] or ["plain"]
    if "native" in candidates and few_s["native"] <= FEW_SLACK * few_s["plain"]:
        qualified.append("native")  # last: PRODUCTS' order
    fastest = min(one_s[p] for p in qualified)
    tied = [p for p in qualified if one_s[p] <= TIE * fastest]
    return "native" if "native" in tied else min(tied, key=lambda p: few_s[p])


def native_bf16_available() -> bool:
    """Whether the native bf16 product is there to be chosen on this machine (built, and agreeing)."""
    return _native_bf16() is not None


@functools.lru_cache(maxsize=None)
def _native_bf16() -> native.Kernels | None:
    """The native kernels, where their bf16 product agrees with its reference."""
    kernels = native.kernels()
    if kernels is None or not native.agrees("bf16 product",
                                            native.check_bf16_linear(kernels, torch.Generator().manual_seed(2))):
        return None
    return kernels


@functools.lru_cache(maxsize=None)
def _probe(out_features: int, in_features: int, dtype: torch.dtype
           ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Seconds of each product available here for one row, PROBE_FEW rows and PROBE_BLOCK rows."""
    gen = torch.Generator().manual_seed(0)
    plain = Linear(in_features, out_features, bias=True, dtype=dtype)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(plain.weight.shape, generator=gen) * in_features ** -0.5)
        plain.bias.copy_(torch.randn(plain.bias.shape, generator=gen))
    one = torch.randn(1, in_features, generator=gen).to(dtype)
    few = torch.randn(PROBE_FEW, in_features, generator=gen).to(dtype)
    block = torch.randn(PROBE_BLOCK, in_features, generator=gen).to(dtype)
    weight, bias = plain.weight.detach(), plain.bias.detach()
    with torch.no_grad():
        want = plain(block)
    runs = {"plain": lambda x: plain(x)}
    packed = _packed_or_none(weight, bias, block, want)
    if packed is not None:
        runs["packed"] = lambda x: _packed_linear(x, packed, bias)
    if dtype == torch.bfloat16 and _native_bf16() is not None:
        runs["native"] = NativeLinear.from_linear(plain)  # the same weight, read by the native kernel
    # one row is timed as a step runs it, on every thread with the weight streamed from memory, in wall time: how
    # well a product spreads one row over the threads is most of its speed there. On a 2-core Sapphire Rapids VM
    # oneDNN's blocked product took one row on one thread (as long on two threads as on one) where the native
    # product halved its time; timed from cache on one thread, the blocked product at times ran 3x its step rate.
    # The CPU time of every thread, the clock before, counts a thread spinning at a barrier while the other waits
    # for a core: with a cluster's processes loading at once on the machine, it timed the native product up to 3x
    # slow and gave the blocked one a stage's gate/up products, which then ran 2x slower in its steps (+15 ms a
    # 12-layer bf16 step). Races take the machine's probe lock (probe.py), and the best of several turns leaves
    # out the turns another process took a core in. The prefill and batch timings, which compute more per weight
    # byte, stay steady ones on one thread (probe.py)
    def timed(x: torch.Tensor, products: dict, turns: int, **how) -> dict[str, float]:
        return dict(zip(products, race([lambda run=run: run(x) for run in products.values()], turns, **how)))

    with torch.no_grad():
        one_s = timed(one, runs, 7, before=cache_sweeper(), clock=time.perf_counter)  # its buffer freed after
        with one_thread():
            few_s = timed(few, runs, 5)
            block_s = timed(block, {p: run for p, run in runs.items() if p != "native"}, 3)
    block_s["native"] = block_s["plain"]  # a NativeLinear's prefill is F.linear's: timed once
    log.info("%s [%d, %d] products, us for 1 row (every thread, from memory) / %d / %d rows (one thread): %s",
             dtype, out_features, in_features, PROBE_FEW, PROBE_BLOCK,
             ", ".join(f"{p} {one_s[p] * 1e6:.0f} / {few_s[p] * 1e6:.0f} / {block_s[p] * 1e6:.0f}" for p in one_s))
    return one_s, few_s, block_s


def _packed_or_none(weight: torch.Tensor, bias: torch.Tensor, block: torch.Tensor, want: torch.Tensor
                    ) -> torch.Tensor | None:
    """`weight` in oneDNN's blocked layout, or None where this torch has none or its product disagrees."""
    if not can_pack(weight.dtype):
        return None
    try:
        packed = _pack(weight)
        got = _packed_linear(block, packed, bias)
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        log.info("no blocked oneDNN product for %s on this CPU (%s)", weight.dtype, exc)
        return None
    err = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))
    if err > 1e-2:
        log.warning("the blocked oneDNN product disagrees with F.linear (relative error %.1e); not using it", err)
        return None
    return packed


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


_logged_choices: dict[tuple[int, int], str] = {}  # the product pack_linears last logged for each shape


def pack_linears(module: nn.Module, *, force: bool | None = None, allowed: tuple[str, ...] = PRODUCTS) -> int:
    """Give each CPU nn.Linear below `module` in bf16 the fastest product here: a PackedLinear or a NativeLinear
    in its place where `fastest_product` finds one of them fastest for its shape, of those `allowed`.

    force=None asks `fastest_product` per shape; True packs every one that can be packed (blocked: none where
    `can_pack` says this CPU cannot); False changes nothing. A Linear shared by several parents stays shared.
    Returns how many were replaced.
    """
    if force is False:
        return 0
    replacements: dict[int, nn.Module] = {}
    chosen: dict[tuple[int, int], str] = {}
    for parent in list(module.modules()):
        for name, child in list(parent._modules.items()):  # named_children() would skip a repeated child
            if not isinstance(child, nn.Linear):
                continue
            w = child.weight
            if w.device.type != "cpu" or w.dtype not in PACKED_DTYPES:
                continue
            if id(child) not in replacements:
                if force:
                    product = "packed" if can_pack(w.dtype) else "plain"
                else:
                    product = fastest_product(child.out_features, child.in_features, w.dtype, allowed)
                chosen[child.out_features, child.in_features] = product
                if product == "plain" or isinstance(child, NativeLinear):
                    continue
                replacements[id(child)] = (PackedLinear if product == "packed" else NativeLinear).from_linear(child)
            setattr(parent, name, replacements[id(child)])
    new = {shape: product for shape, product in chosen.items() if _logged_choices.get(shape) != product}
    if new:  # what a stage's speed depends on, for whoever reads the log: once a shape per process, not per layer
        _logged_choices.update(new)
        log.info("bf16 products: %s", ", ".join(f"{list(shape)} {product}" for shape, product in new.items()))
    return len(replacements)


class NativeLinear(Linear):
    """A Linear whose products of up to a few activation rows (a decode step's) run in the native bf16 kernel
    (native.Kernels.bf16_linear), which streams the plain weight at the memory's rate; larger inputs (prefill)
    take F.linear as Linear does. The weight is the same plain [out, in] parameter, so quantizing one (or reading
    its weight) is as for any nn.Linear."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "NativeLinear":
        kernels = _native_bf16()
        if kernels is None:
            raise ValueError("NativeLinear needs the native kernels and their bf16 product (native.kernels())")
        native.one_row_prefetch("bf16")  # once per process: whether one row prefetches its weights here
        with torch.device("meta"):
            layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        layer.weight = nn.Parameter(linear.weight.detach().contiguous(), requires_grad=False)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().to(linear.weight.dtype).contiguous(), requires_grad=False)
        layer._kernels = kernels
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = self._parameters  # plain dict lookups: nn.Module.__getattr__ costs ~1 us per parameter
        weight, bias = params["weight"], params["bias"]
        if self._takes(x, weight, bias):
            return self._kernels.bf16_product(x.contiguous(), weight, bias)
        return super().forward(x)

    def native_calls(self, x: torch.Tensor, y: torch.Tensor) -> list[native.Call] | None:
        """The native calls that write this product of contiguous x into y as forward would compute it, for a
        decode plan; None where forward would not take the native kernel for x."""
        params = self._parameters
        weight, bias = params["weight"], params["bias"]
        if not x.is_contiguous() or not self._takes(x, weight, bias):
            return None
        return [self._kernels.bf16_call(x, weight, bias, y)]

    def _takes(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether the native kernel takes x: the kernel reads raw memory, so anything but the layout it was made
        for (a weight or bias replaced since, an input of another width, one that needs a gradient) takes
        F.linear, which checks and raises."""
        kernels = self._kernels
        return (kernels is not None and x.numel() <= kernels.bf16_rows_per_pass * self.in_features
                and x.shape[-1] == self.in_features and x.dtype == torch.bfloat16 and x.device.type == "cpu"
                and not x.requires_grad and weight.shape[0] == self.out_features
                and native.bf16_operands_ok(self.in_features, weight, bias))

    def extra_repr(self) -> str:
        rows = self._kernels.bf16_rows_per_pass if self._kernels is not None else 0
        return super().extra_repr() + f", path=native up to {rows} rows"
