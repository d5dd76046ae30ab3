"""Weight-only quantization of linear layers: int8 per output channel, int4 per group.

Theory of operation
-------------------
A quantized weight is a value (`Int8Weight`, `Int4Weight`): integer codes plus the scales (and zero points) that
map them back to real numbers, with every fact needed to read them (shape, group size, nibble order) spelled out
as fields. `quantize_*` and `dequantize_*` are pure functions between such values and float tensors; the
dequantize functions are the reference that every faster path is checked against.

`Int8Linear` and `Int4Linear` are drop-in replacements for `nn.Linear`. Decode is memory-bound, so reading fewer
weight bytes per token is where the speed comes from. Each module therefore runs one of three paths (`path`):

- portable: plain PyTorch ops on the stored codes (works on every device PyTorch supports);
- packed kernel: PyTorch's own weight-only kernels (`aten._weight_int8pack_mm`, and the `_weight_int4pack_mm`
  family), which read the codes directly and never build a float copy of the weight;
- native: on x86-64 CPUs, products compiled for the machine at run time that also quantize the activations and
  multiply codes by codes (tc/model/native.py): taken by default (use_kernel=None) where they build, agree with
  their reference and beat the packed kernel in a probe; use_kernel=True or False asks for one of the other two.

Whether a device (cpu, cuda:N, mps) has a working kernel is decided once per process by a tiny probe that runs
the kernel and compares it with the dequantize reference (`int8_kernel_available`, `int4_kernel_available`);
shape constraints that the kernels do not check themselves, which differ by device type, are checked here
before a module picks the kernel (`int8_kernel_shape_ok`). A module built for
the kernel stores its codes in the kernel's layout instead of the portable one, so it never holds both, and its
buffers always take exactly `quantized_nbytes(...)` bytes (the bias, if any, is extra and kept as loaded).

The packed kernels compute in bfloat16 (see `_KERNEL_DTYPE`): on x86 CPUs only their bfloat16 variants are
vectorised (the float32 and float16 variants are scalar loops, several times slower than a float32 matmul), and
the CUDA int4 kernel accepts nothing else. Activations in another dtype are converted on the way in and the
output converted back; the bfloat16 rounding of the activations (relative 2^-9) is far below the weight
quantization error that the caller already accepted by choosing int8 or int4. A device without bfloat16 (MPS
before macOS 14) is never handed one: quantize_linears' `half_dtype` puts int4 scales in float16 there (which
the portable path reads) and runs the int8 kernel in float16.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from . import native
from .dense import PROBE_ROWS, PackedLinear, kept_buffer
from .probe import one_thread, race

log = logging.getLogger(__name__)

WEIGHT_MODES = ("fp16", "int8", "int4")
DEFAULT_GROUP_SIZE = 128

INT8_MAX = 127
INT4_LEVELS = 16  # codes 0..15; a code c stands for (c - INT4_OFFSET) * scale + zero
INT4_OFFSET = 8
INT4_PARAM_DTYPE = torch.bfloat16  # scales and zero points: fp32's exponent range, and what the kernels read
# ... or fp16, on a device without bf16 (MPS before macOS 14): a 2-byte type either way, so sizes do not change
INT4_PARAM_DTYPES = (torch.bfloat16, torch.float16)
INT4_PACKING = "row-major [out, padded_in / 2] uint8; low nibble = even column, high nibble = odd column"
INT4_KERNEL_GROUP_SIZES = (32, 64, 128, 256)  # the only group sizes the aten int4 kernels accept

_KERNEL_DTYPE = torch.bfloat16
# The packed int8 kernel's shape rule per device type, (N, K) multiples: the x86 kernel steps K by 8 (AVX2) or 16
# (AVX-512) with aligned loads and no tail loop; the MPS kernel works in tiles of 32 along both. A device type
# not listed gets the strictest rule known, and its probe decides the rest.
INT8_KERNEL_MULTIPLES = {"cpu": (1, 16), "mps": (32, 32)}
_INT8_KERNEL_MULTIPLES_OTHER = (32, 32)
PREFILL_MIN_ROWS = 64  # activation rows from which an int8 product may take the portable path (see Int8Linear)
DENSE_PREFILL_PROBE_ROWS = 128  # ... if the probe finds it DENSE_PREFILL_MIN_GAIN times faster for this many
DENSE_PREFILL_MIN_GAIN = 1.25
# tc's native products go dense from the first of these row counts at which the probe finds the dense way
# DENSE_PREFILL_MIN_GAIN times faster; with fewer, the conversion outweighs the gain (int4 [9728, 896] at 64 rows:
# 2.7 ms dense against 2.1 native, at 256: 3.9 against 8.0, on a Sapphire Rapids VM). The gain grows with the
# rows, and where it is near the margin at 128 (1.1-1.4x for the demo's shapes on a 2-core Xeon, whose probe then
# kept every layer native) it is 1.5-1.8x at 256 and 1.7-2.5x at 512: a 512-token prompt takes the dense way there.
NATIVE_DENSE_ROWS = (DENSE_PREFILL_PROBE_ROWS, 2 * DENSE_PREFILL_PROBE_ROWS, 4 * DENSE_PREFILL_PROBE_ROWS)
NATIVE_DENSE_MIN_ROWS = NATIVE_DENSE_ROWS[0]
_ALIGNMENT = 64  # bytes; the x86 int8 kernel uses aligned vector loads on the activation rows
_CHUNK_ELEMENTS = 1 << 20  # quantize this many weights at a time: float temporaries of 4 MiB (faster than 16)
_INT8_DENSE_SLAB_ROWS = 4096  # rows of int8 codes converted at a time by the portable path
# bf16 weight bytes the native dense prefill converts at a time: a whole matrix of a model the demo's size, so each
# product is one large GEMM (per-slab products of a few hundred rows ran at half the rate); slabs on larger models,
# whose scratch stays this size (_native_dense)
_NATIVE_DENSE_SLAB_BYTES = 32 << 20


class QuantizationError(ValueError):
    """A weight, mode or group size that cannot be quantized as asked; the message says what would work."""


class KernelUnavailableError(RuntimeError):
    """A packed kernel was demanded (use_kernel=True) for a device or shape it does not support."""


def head_weight_mode(mode: str) -> str:
    """The weight mode of the head's lm_head for a cluster in `mode`.

    lm_head is the largest matrix of a small model, so quantizing it saves most; but every logit passes through
    it, so under int4 it stays at 8 bits (as llama.cpp's Q4_K_M keeps its output matrix at 6 bits). Measured on the
    demo model (bench/perplexity.py): int4 everywhere +11.7% perplexity, int4 layers with an int8 lm_head +9.0%;
    an int4 lm_head of smaller groups, which would read 37% fewer bytes than int8 at 32, still misses the 10% bar
    (bench/perplexity.py's text, int4 layers: groups of 64 +11.1%, of 32 +10.7%).
    """
    return "int8" if mode == "int4" else mode


def quantized_nbytes(shape: tuple[int, int], mode: str, group_size: int = DEFAULT_GROUP_SIZE) -> int:
    """Bytes a linear weight of `shape` [out, in] takes in memory in weight mode `mode`.

    This is exactly what `Int8Linear` / `Int4Linear` hold in buffers on either path (bias not included).
    int4 pads in_features up to a whole number of groups, and the padding is stored too.
    Raises QuantizationError for an unknown mode or an unusable group size.
    """
    out_features, in_features = shape
    if mode == "fp16":
        return out_features * in_features * 2
    if mode == "int8":
        return out_features * in_features + out_features * 4  # int8 codes + fp32 scale per row
    if mode == "int4":
        _check_group_size(group_size)
        groups = -(-in_features // group_size)
        param_bytes = INT4_PARAM_DTYPE.itemsize
        # two codes per byte over the padded width, + a scale and a zero point per group
        return out_features * groups * group_size // 2 + out_features * groups * 2 * param_bytes
    raise QuantizationError(f"unknown weight mode {mode!r}; expected one of {WEIGHT_MODES}")


def _check_group_size(group_size: int) -> None:
    if not isinstance(group_size, int) or group_size <= 0 or group_size % 2:
        raise QuantizationError(
            f"int4 group_size must be a positive even integer (two codes share a byte), got {group_size!r}; "
            f"{DEFAULT_GROUP_SIZE} is the default and {INT4_KERNEL_GROUP_SIZES} can use the packed kernels"
        )


def _check_weight(w: torch.Tensor) -> tuple[int, int]:
    shape = _check_shape(tuple(w.shape))
    if not w.is_floating_point():
        raise QuantizationError(f"expected a floating-point weight, got {w.dtype}")
    return shape


def _check_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) != 2 or shape[0] <= 0 or shape[1] <= 0:
        raise QuantizationError(f"expected a non-empty 2-D weight [out, in], got shape {tuple(shape)}")
    return int(shape[0]), int(shape[1])


def _row_chunks(rows: int, cols: int) -> list[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMENTS // cols)
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def _not_finite(r0: int, r1: int) -> QuantizationError:
    """The error for rows [r0, r1) of a weight holding NaN or infinite values. The quantizers find them in the
    per-row or per-group extremes they compute anyway (amax and amin carry a NaN or an inf through): a test of every
    value (torch.isfinite) took ~1.5 ms a chunk, 0.7 s of a 6.4 s int4 load of the demo model."""
    return QuantizationError(f"the weight has NaN or infinite values in rows {r0}..{r1 - 1}; the checkpoint is "
                             "damaged or was saved in a dtype that overflowed")


RowSlabs = Iterable[tuple[int, torch.Tensor]]  # (first row, rows [n, in]) of one weight, in order, covering it


def _float_chunks(slabs: RowSlabs, shape: tuple[int, int], width: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(r0, r1, rows [r0, r1) as float32) of a weight of `shape` that arrives as `slabs`, at most _CHUNK_ELEMENTS
    values of `width` columns at a time whatever the slabs' size, so the float temporaries stay bounded.

    Raises QuantizationError for slabs that are not float, have other columns, or do not tile the rows in order.
    The values are not checked here: each quantizer checks the extremes it computes (_not_finite).
    """
    rows, cols = shape
    at = 0
    for first, slab in slabs:
        if first != at or slab.dim() != 2 or slab.shape[1] != cols or first + slab.shape[0] > rows:
            raise QuantizationError(f"a slab of shape {tuple(slab.shape)} at row {first} does not continue a "
                                    f"[{rows}, {cols}] weight after its first {at} rows; slabs must tile its rows "
                                    "in order")
        if not slab.is_floating_point():
            raise QuantizationError(f"expected a floating-point weight, got {slab.dtype}")
        for r0, r1 in _row_chunks(slab.shape[0], width):
            yield first + r0, first + r1, slab[r0:r1].float()
        at = first + slab.shape[0]
    if at != rows:
        raise QuantizationError(f"the slabs hold the first {at} rows of a weight of {rows}")


# ---------------------------------------------------------------------------------------------------- int8


@dataclass(frozen=True, eq=False)
class Int8Weight:
    """Symmetric per-output-channel int8: W[r] ~= qweight[r] * scale[r]."""

    qweight: torch.Tensor  # int8 [out, in], codes in [-127, 127]
    scale: torch.Tensor  # float32 [out]; 0 for an all-zero row
    shape: tuple[int, int]  # (out_features, in_features)

    def __post_init__(self) -> None:
        if self.qweight.dtype != torch.int8 or tuple(self.qweight.shape) != self.shape:
            raise QuantizationError(f"qweight must be int8 {self.shape}, got {self.qweight.dtype} "
                                    f"{tuple(self.qweight.shape)}")
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != (self.shape[0],):
            raise QuantizationError(f"scale must be float32 [{self.shape[0]}], got {self.scale.dtype} "
                                    f"{tuple(self.scale.shape)}")


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Quantize a [out, in] weight: scale = max|W[row]| / 127, q = round(W / scale).clamp(-127, 127).

    Works on the weight's device; computes in float32, a slab of rows at a time.
    Raises QuantizationError for a weight that is not a non-empty 2-D float tensor.
    """
    return quantize_int8_slabs([(0, w)], _check_weight(w), w.device)


def quantize_int8_slabs(slabs: RowSlabs, shape: tuple[int, int], device: torch.device | str) -> Int8Weight:
    """quantize_int8 of a weight of `shape` that arrives a slab of rows at a time (each row's codes and scale
    depend on that row alone, so the result is the same bits whatever the slabs), on `device`: a caller that
    reads the slabs from a file never holds the whole float weight.
    Raises QuantizationError for an empty shape or slabs that do not tile it (see _float_chunks)."""
    rows, cols = _check_shape(shape)
    qweight = torch.empty(rows, cols, dtype=torch.int8, device=device)
    scale = torch.empty(rows, dtype=torch.float32, device=device)
    for r0, r1, chunk in _float_chunks(slabs, (rows, cols), cols):  # chunk [n, in]
        s = chunk.abs().amax(dim=1) / INT8_MAX  # [n]
        if not bool(torch.isfinite(s).all()):
            raise _not_finite(r0, r1)
        divisor = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero row quantizes to zeros
        qweight[r0:r1] = torch.round(chunk / divisor[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        scale[r0:r1] = s
    return Int8Weight(qweight, scale, (rows, cols))


def dequantize_int8(w: Int8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference weight [out, in]: qweight.float() * scale[:, None], then cast to `dtype`."""
    return (w.qweight.float() * w.scale[:, None]).to(dtype)


# ---------------------------------------------------------------------------------------------------- int4


@dataclass(frozen=True, eq=False)
class Int4Weight:
    """Group-wise asymmetric int4 with a float zero point.

    Column j of row r belongs to group g = j // group_size and reads back as
    (code[r, j] - 8) * scales[r, g] + zeros[r, g], code in 0..15. Asymmetric because a group's weights are rarely
    centred on zero, so all 16 levels land inside [min, max] instead of one sign's half being wasted; and because
    `(code - 8) * scale + zero` is exactly what PyTorch's int4 kernels compute, so the portable and the packed
    paths read the same codes the same way. in_features that is not a multiple of group_size is padded with
    copies of the row's last column (which leaves the last group's min and max as they were); the padding is
    stored, and dequantize drops it.

    Scales and zero points are bfloat16, the kernels' format. The zero point's rounding (up to |zero| * 2^-9) is
    absorbed by widening the step until the grid still spans the group, so every weight stays within half a step;
    the cost is a coarser step only for groups whose spread is tiny next to their mean, which trained weights
    (groups centred near zero) do not have.
    """

    packed: torch.Tensor  # uint8 [out, padded_in / 2], see `packing`
    scales: torch.Tensor  # bfloat16 [out, groups]
    zeros: torch.Tensor  # bfloat16 [out, groups]
    shape: tuple[int, int]  # (out_features, in_features) before padding
    group_size: int
    packing: str = INT4_PACKING

    @property
    def groups(self) -> int:
        return -(-self.shape[1] // self.group_size)

    @property
    def padded_in_features(self) -> int:
        return self.groups * self.group_size

    def __post_init__(self) -> None:
        _check_group_size(self.group_size)
        if self.packing != INT4_PACKING:
            raise QuantizationError(f"unknown int4 packing {self.packing!r}; this build reads {INT4_PACKING!r}")
        out = self.shape[0]
        want = (out, self.padded_in_features // 2)
        if self.packed.dtype != torch.uint8 or tuple(self.packed.shape) != want:
            raise QuantizationError(f"packed must be uint8 {want} for shape {self.shape} and group size "
                                    f"{self.group_size}, got {self.packed.dtype} {tuple(self.packed.shape)}")
        for name in ("scales", "zeros"):
            t = getattr(self, name)
            if t.dtype != self.scales.dtype or t.dtype not in INT4_PARAM_DTYPES or tuple(t.shape) != (out, self.groups):
                raise QuantizationError(f"{name} must be {' or '.join(map(str, INT4_PARAM_DTYPES))} (scales and "
                                        f"zeros alike) [{out}, {self.groups}], got {t.dtype} {tuple(t.shape)}")


def _round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest `dtype` value >= x, for x >= 0 (float32 in, `dtype` out; dtype bfloat16 or float16)."""
    y = x.to(dtype)
    below = y.float() < x
    # for a non-negative finite bfloat16 or float16, the next representable value up is the next bit pattern
    bumped = (y.view(torch.int16) + 1).view(dtype)
    return torch.where(below, bumped, y)


def _int4_codes_and_params(g: torch.Tensor, param_dtype: torch.dtype
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (uint8, 0..15) and `param_dtype` scale, zero for float32 groups g [n, groups, group_size].

    The grid zero + (c - 8) * scale, c = 0..15, must cover [min, max] of each group *after* scale and zero are
    rounded to param_dtype, or the error at the ends could exceed half a step. So the zero point is rounded first,
    then the step is widened just enough to reach both ends from the rounded zero, and rounded up.
    """
    lo = g.amin(dim=-1)  # [n, groups]
    hi = g.amax(dim=-1)
    step = (hi - lo) / (INT4_LEVELS - 1)
    zero = (lo + INT4_OFFSET * step).to(param_dtype)  # code 0 lands on lo, code 15 on hi
    z = zero.float()
    need = torch.maximum(step, torch.maximum((z - lo) / INT4_OFFSET, (hi - z) / (INT4_LEVELS - 1 - INT4_OFFSET)))
    scale = _round_up(need.clamp_min(0), param_dtype)
    s = scale.float()
    divisor = torch.where(s > 0, s, torch.ones_like(s))  # a constant group: every code is 8, reading back `zero`
    codes = torch.round((g - z[..., None]) / divisor[..., None]) + INT4_OFFSET
    return codes.clamp_(0, INT4_LEVELS - 1).to(torch.uint8), scale, zero


def quantize_int4(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE,
                  param_dtype: torch.dtype = INT4_PARAM_DTYPE) -> Int4Weight:
    """Quantize a [out, in] weight to int4 codes per group of `group_size` input columns.

    in_features need not be a multiple of group_size: the last group is padded (see Int4Weight). Scales and zero
    points are `param_dtype`: bfloat16, or float16 for a device without bfloat16.
    Works on the weight's device; computes in float32, a slab of rows at a time.
    Raises QuantizationError for a bad weight, group size or param_dtype, or for a weight whose scales overflow
    float16.
    """
    _check_group_size(group_size)
    return quantize_int4_slabs([(0, w)], _check_weight(w), w.device, group_size, param_dtype)


def quantize_int4_slabs(slabs: RowSlabs, shape: tuple[int, int], device: torch.device | str,
                        group_size: int = DEFAULT_GROUP_SIZE, param_dtype: torch.dtype = INT4_PARAM_DTYPE
                        ) -> Int4Weight:
    """quantize_int4 of a weight of `shape` that arrives a slab of rows at a time (groups run along a row, so the
    result is the same bits whatever the slabs), on `device`: a caller that reads the slabs from a file never
    holds the whole float weight.
    Raises what quantize_int4 does, and QuantizationError for slabs that do not tile the shape (_float_chunks)."""
    _check_group_size(group_size)
    if param_dtype not in INT4_PARAM_DTYPES:
        raise QuantizationError(f"int4 scales can be {' or '.join(map(str, INT4_PARAM_DTYPES))}, not {param_dtype}")
    rows, cols = _check_shape(shape)
    groups = -(-cols // group_size)
    padded = groups * group_size
    packed = torch.empty(rows, padded // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(rows, groups, dtype=param_dtype, device=device)
    zeros = torch.empty(rows, groups, dtype=param_dtype, device=device)
    for r0, r1, chunk in _float_chunks(slabs, (rows, cols), padded):  # chunk [n, in]
        if padded > cols:
            chunk = torch.cat([chunk, chunk[:, -1:].expand(-1, padded - cols)], dim=1)  # [n, padded]
        codes, s, z = _int4_codes_and_params(chunk.reshape(r1 - r0, groups, group_size), param_dtype)
        if not bool(torch.isfinite(s).all() & torch.isfinite(z).all()):  # a NaN or inf in a group makes both so
            if not bool(torch.isfinite(chunk).all()):
                raise _not_finite(r0, r1)
            fix = "quantize on a device with bfloat16 or use int8" if param_dtype == torch.float16 else "use int8"
            raise QuantizationError(f"rows {r0}..{r1 - 1} have groups whose int4 scale or zero point overflows "
                                    f"{str(param_dtype).removeprefix('torch.')}; {fix}")
        codes = codes.view(r1 - r0, padded // 2, 2)  # [n, padded/2, (even, odd)]
        packed[r0:r1] = codes[..., 0] | (codes[..., 1] << 4)
        scales[r0:r1] = s
        zeros[r0:r1] = z
    return Int4Weight(packed, scales, zeros, (rows, cols), group_size)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, n/2] in INT4_PACKING order -> codes uint8 [out, n]."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).view(packed.shape[0], packed.shape[1] * 2)  # [out, n]


def dequantize_int4(w: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference weight [out, in]: (code - 8) * scale + zero per group, computed in float32."""
    out, cols = w.shape
    codes = unpack_int4(w.packed).view(out, w.groups, w.group_size).float()  # [out, groups, group_size]
    deq = (codes - INT4_OFFSET) * w.scales.float()[..., None] + w.zeros.float()[..., None]
    return deq.view(out, w.padded_in_features)[:, :cols].to(dtype)


def _int8_dense(x2: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(x2 [M, in] @ qweight.T) * scale in x2's dtype, converting the codes _INT8_DENSE_SLAB_ROWS rows at a time, so
    the converted copy stays small whatever the matrix (an lm_head's would be hundreds of MB). Rows are
    independent, so slabs give the same bits as the whole."""
    rows, dtype = scale.shape[0], x2.dtype
    if rows <= _INT8_DENSE_SLAB_ROWS:
        return F.linear(x2, qweight.to(dtype)) * scale.to(dtype)
    y = x2.new_empty(x2.shape[0], rows)  # [M, out]
    for r0 in range(0, rows, _INT8_DENSE_SLAB_ROWS):
        r1 = min(rows, r0 + _INT8_DENSE_SLAB_ROWS)
        torch.mul(F.linear(x2, qweight[r0:r1].to(dtype)), scale[r0:r1].to(dtype), out=y[:, r0:r1])
    return y


_scratch = threading.local()  # each thread's bf16 buffer for the native dense prefill's converted rows


def _native_dense(x2: torch.Tensor, rows: int, rows_into: Callable[[int, int, torch.Tensor], torch.Tensor],
                  scale: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [M, K] @ W.T (times `scale` per output row, where given) in x2's dtype, for a weight of `rows` rows in the
    native kernels' tiled layout, of which rows_into(r0, r1, out) writes rows [r0, r1) into out [r1 - r0, K] as
    bfloat16 (native.Kernels.int4_rows, int8_rows): converted into this thread's scratch, _NATIVE_DENSE_SLAB_BYTES
    at a time, and multiplied densely. Rows are independent, so slabs give the same bits as the whole.

    x2 is multiplied as the native products see it, quantized to int8 per row and 32 columns and back
    (Kernels.quantized_activations): a batch's rows all go one way, and a decode row beside a prompt's chunk must
    come out as it would alone, through the native product, up to the last bits (unquantized, it moved a row of
    an int4 stage by 3% of its largest value)."""
    k, dtype = x2.shape[1], x2.dtype
    # int8 codes times the activations, before the row scales bring them back, can pass fp16's 65504: that product
    # is made in float32 (bf16 and float32 have the range)
    compute = torch.float32 if scale is not None and dtype == torch.float16 else dtype
    x2 = native.kernels().quantized_activations(x2).to(compute)
    slab = max(native.TILE_ROWS, _NATIVE_DENSE_SLAB_BYTES // (2 * k) // native.TILE_ROWS * native.TILE_ROWS)
    buffer = kept_buffer(_scratch, min(rows, slab) * k, torch.bfloat16)  # fresh, 4x the conversion's time
    if rows <= slab:
        y = F.linear(x2, rows_into(0, rows, buffer.view(rows, k)).to(compute))
        return (y if scale is None else y * scale.to(compute)).to(dtype)
    y = x2.new_empty(x2.shape[0], rows)
    for r0 in range(0, rows, slab):
        r1 = min(rows, r0 + slab)
        part = F.linear(x2, rows_into(r0, r1, buffer[:(r1 - r0) * k].view(r1 - r0, k)).to(compute))
        if scale is None:
            y[:, r0:r1] = part
        else:
            torch.mul(part, scale[r0:r1].to(compute), out=y[:, r0:r1])
    return y.to(dtype)


def _int4_portable_linear(x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          group_size: int) -> torch.Tensor:
    """x2 [M, padded_in] @ dequantized weight.T, in x2's dtype, from the portable buffers.

    Even and odd columns are dequantized and multiplied separately (x2[:, 0::2] against the low nibbles, x2[:, 1::2]
    against the high ones), which skips interleaving the nibbles back into one [out, in] matrix, the slowest step
    of unpacking on CPU. Codes become signed (code - 8) while still int8, so only two float ops touch the weight.
    """
    out, groups = scales.shape
    dtype = x2.dtype
    s = scales.to(dtype)[..., None]  # [out, groups, 1]
    z = zeros.to(dtype)[..., None]
    y = None
    for column, nibbles in ((0, packed & 0x0F), (1, packed >> 4)):
        signed = nibbles.view(torch.int8) - INT4_OFFSET  # [out, padded_in / 2], exact in int8
        w = (signed.view(out, groups, group_size // 2).to(dtype) * s + z).view(out, -1)  # [out, padded_in / 2]
        part = F.linear(x2[:, column::2], w)
        y = part if y is None else y + part
    assert y is not None
    return y


# ------------------------------------------------------------------------------------------ kernel probes


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def _kernel_x(x2: torch.Tensor, dtype: torch.dtype = _KERNEL_DTYPE) -> torch.Tensor:
    """x [M, K] as the kernels need it: `dtype`, contiguous, and starting on an aligned address."""
    if x2.dtype != dtype:
        return x2.to(dtype).contiguous()
    if not x2.is_contiguous() or x2.data_ptr() % _ALIGNMENT:
        return x2.clone(memory_format=torch.contiguous_format)
    return x2


def int8_kernel_multiples(device_type: str) -> tuple[int, int]:
    """(N, K): out_features and in_features must be multiples of these for the int8 kernel on `device_type`."""
    return INT8_KERNEL_MULTIPLES.get(device_type, _INT8_KERNEL_MULTIPLES_OTHER)


def int8_kernel_shape_ok(out_features: int, in_features: int, device_type: str) -> bool:
    """Whether the int8 kernel of `device_type` takes an [out, in] weight (see INT8_KERNEL_MULTIPLES). The kernels
    do not all check this themselves: a shape they do not expect reads past a row or computes garbage."""
    n, k = int8_kernel_multiples(device_type)
    return out_features % n == 0 and in_features % k == 0


def _int8_kernel(x2: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                 dtype: torch.dtype = _KERNEL_DTYPE) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(_kernel_x(x2, dtype), qweight, scale.to(dtype))


@functools.lru_cache(maxsize=None)
def int8_kernel_available(device: str, dtype: torch.dtype = _KERNEL_DTYPE) -> bool:
    """Whether aten._weight_int8pack_mm runs on `device` (cpu, cuda:N, mps) with `dtype` activations and agrees
    with the reference (probed once per device and dtype: two GPUs of one machine need not be alike).

    A device without `dtype` (bfloat16 on MPS before macOS 14) raises TypeError there, which means unavailable.
    """
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen)
    x = torch.randn(3, 256, generator=gen)
    qw = quantize_int8(w)
    ref = x.to(dtype).float() @ dequantize_int8(qw).T
    try:
        dev = torch.device(device)
        y = _int8_kernel(x.to(dev), qw.qweight.to(dev), qw.scale.to(dev), dtype).cpu()
    except (RuntimeError, NotImplementedError, AttributeError, TypeError) as exc:
        log.info("int8 packed kernel unavailable on %s for %s (%s); using the portable path", device, dtype, exc)
        return False
    err = _relative_error(y, ref)
    ok = err < 2e-2
    log.info("int8 packed kernel on %s for %s: %s (relative error %.2e)", device, dtype, "in use" if ok else
             "disagrees with the reference, using the portable path", err)
    return ok


def _dense_from_rows(what: str, path: str, dense_way: str, row_counts: tuple[int, ...],
                     product: Callable[[torch.Tensor], object], dense: Callable[[torch.Tensor], object],
                     rows_of: Callable[[int], torch.Tensor]) -> int | None:
    """The first of `row_counts` for which dense(x) runs DENSE_PREFILL_MIN_GAIN times faster than product(x), x =
    rows_of(count), timed on one thread (probe.py: steady timings on a shared machine), with the timings logged;
    None where it wins at none of them."""
    timed, found = [], None
    with one_thread():
        for count in row_counts:
            x = rows_of(count)
            product_s, dense_s = race([lambda: product(x), lambda: dense(x)], 5)
            timed.append((count, product_s, dense_s))
            if product_s >= DENSE_PREFILL_MIN_GAIN * dense_s:
                found = count
                break
    _scratch.buffer = None  # a product's size, not the probe's, is what a prefill keeps
    log.info("%s x %s rows: %s %s us, %s %s us: %s", what, " / ".join(str(c) for c, _, _ in timed), path,
             " / ".join(f"{p * 1e6:.0f}" for _, p, _ in timed), dense_way,
             " / ".join(f"{d * 1e6:.0f}" for _, _, d in timed),
             path if found is None else f"dense from {found} rows")
    return found


@functools.lru_cache(maxsize=None)
def _int8_dense_prefill_probe(rows: int, in_features: int, dtype: torch.dtype, path: str = "kernel") -> int | None:
    """The timing behind int8_dense_prefill_from_rows, against PyTorch's kernel (at DENSE_PREFILL_PROBE_ROWS rows)
    or (path "native") tc's native product (at each of NATIVE_DENSE_ROWS in turn), whose dense way first lays the
    tiled codes back out, as Int8Linear's does: the rows from which the dense way wins, or None."""
    gen = torch.Generator().manual_seed(0)
    qweight = torch.randint(-INT8_MAX, INT8_MAX + 1, (rows, in_features), dtype=torch.int8, generator=gen)
    scale = torch.rand(rows, generator=gen) / INT8_MAX
    if path == "native":
        kernels, tiled = native.kernels(), native.tile_int8(qweight)
        product = lambda x: kernels.int8_linear(x, tiled, scale)  # noqa: E731
        dense = lambda x: _native_dense(x, rows, functools.partial(kernels.int8_rows, tiled), scale)  # noqa: E731
    else:
        product = lambda x: _int8_kernel(x, qweight, scale)  # noqa: E731
        dense = lambda x: F.linear(x, qweight.to(dtype)) * scale.to(dtype)  # noqa: E731
    return _dense_from_rows(f"int8 [{rows}, {in_features}] of {dtype}", path, "codes converted + dense product",
                            NATIVE_DENSE_ROWS if path == "native" else (DENSE_PREFILL_PROBE_ROWS,), product, dense,
                            lambda count: torch.randn(count, in_features, generator=gen).to(dtype))


def int8_dense_prefill_from_rows(out_features: int, in_features: int, dtype: torch.dtype, path: str = "kernel"
                                  ) -> int | None:
    """From how many rows of `dtype` activations, on this CPU, an int8 [out, in] weight times them runs faster by
    converting the codes to `dtype` and multiplying densely than through the packed kernel (PREFILL_MIN_ROWS, where
    it does at DENSE_PREFILL_PROBE_ROWS), or with path "native" through tc's native product (the first of
    NATIVE_DENSE_ROWS where it does); None where it does not (probed once per shape, on a slab of at most
    PROBE_ROWS rows, on one thread).

    The kernel's time grows with every row, while the conversion costs the same for any number, so the dense way
    gains with the rows: 0.8-1.2x at 16 rows, 1.3-1.8x at 64 and 1.8-2.3x at 128 on one AVX512-BF16 EPYC. The
    dense way must win by DENSE_PREFILL_MIN_GAIN: the two ways round differently, so a choice that flipped between
    processes with the timing's noise would let one request's text depend on which worker process decided what.
    Fewer rows (a decode step's one) stay on the kernel.
    """
    if path == "native":
        if native.kernels() is None or not native.shape_ok_int8(out_features, in_features):
            return None
    elif not int8_kernel_available("cpu") or not int8_kernel_shape_ok(out_features, in_features, "cpu"):
        return None
    found = _int8_dense_prefill_probe(min(out_features, PROBE_ROWS), in_features, dtype, path)
    return None if found is None else found if path == "native" else PREFILL_MIN_ROWS


@functools.lru_cache(maxsize=None)
def _int4_dense_prefill_probe(rows: int, padded_in: int, group_size: int, dtype: torch.dtype) -> int | None:
    """The timing behind int4_dense_prefill_from_rows: tc's native product against its dense way."""
    # codes and parameters drawn as they are, no float weight made: a worker's loading peaks at its weights and one
    # layer (tests/test_load_memory.py)
    gen = torch.Generator().manual_seed(0)
    groups = padded_in // group_size
    packed, scales, zeros = native.tile_int4(
        torch.randint(0, 256, (rows, padded_in // 2), dtype=torch.uint8, generator=gen),
        (torch.rand(rows, groups, generator=gen) / 8).to(_KERNEL_DTYPE), torch.zeros(rows, groups, dtype=_KERNEL_DTYPE))
    kernels = native.kernels()
    product = lambda x: kernels.int4_linear(x, packed, scales, zeros, group_size)  # noqa: E731
    rows_into = functools.partial(kernels.int4_rows, packed, scales, zeros, group_size)
    dense = lambda x: _native_dense(x, rows, rows_into)  # noqa: E731
    return _dense_from_rows(f"int4 [{rows}, {padded_in}] of {dtype}", "native", "dequantized + dense product",
                            NATIVE_DENSE_ROWS, product, dense,
                            lambda count: torch.randn(count, padded_in, generator=gen).to(dtype))


def int4_dense_prefill_from_rows(out_features: int, padded_in: int, group_size: int, dtype: torch.dtype
                                 ) -> int | None:
    """From how many rows of `dtype` activations, on this CPU, a tiled int4 [out, padded_in] weight times them runs
    faster dequantized to bfloat16 and multiplied densely than through tc's native product (the first of
    NATIVE_DENSE_ROWS where it does), as int8_dense_prefill_from_rows finds for int8 (the same margin and reasons);
    None where it does not. A CPU with bfloat16 matrix units gains most: 2x at 256 rows of the demo's MLP on a
    Sapphire Rapids VM with AMX."""
    if native.kernels() is None or not native.shape_ok_int4(out_features, padded_in, group_size):
        return None
    return _int4_dense_prefill_probe(min(out_features, PROBE_ROWS), padded_in, group_size, dtype)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (a no-op on the CPU, whose ops return when done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _device_best_time(fn, device: torch.device, runs: int) -> float:
    """The least wall time (s) of one call of fn over `runs`, after a warm-up, each waited for on the device."""
    fn()
    synchronize(device)
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def int8_paths_by_speed(kernel_decode_s: float, dense_decode_s: float, kernel_prefill_s: float,
                        dense_prefill_s: float) -> tuple[bool, bool]:
    """(use the kernel at all, send prefill-sized products to the dense path) from timings of one decode row and
    of PREFILL_MIN_ROWS rows. A kernel that loses at decode, its whole point, is not used; one that wins there
    still gives prefill to the dense path where that is DENSE_PREFILL_MIN_GAIN times faster."""
    use_kernel = kernel_decode_s <= dense_decode_s
    return use_kernel, use_kernel and kernel_prefill_s >= DENSE_PREFILL_MIN_GAIN * dense_prefill_s


@functools.lru_cache(maxsize=None)
def int8_device_speed_probe(device: str, rows: int, in_features: int, dtype: torch.dtype,
                            kernel_dtype: torch.dtype = _KERNEL_DTYPE) -> tuple[bool, bool]:
    """int8_paths_by_speed for an int8 [rows, in] weight with `dtype` activations on an accelerator (cpu works too,
    for a test), timed by wall clock with the device waited for: a few milliseconds, once per device and shape.
    (On the CPU the loaded worker uses int8_dense_prefill_from_rows, which times thread CPU time instead.)"""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    qweight = torch.randint(-INT8_MAX, INT8_MAX + 1, (rows, in_features), dtype=torch.int8, generator=gen).to(dev)
    scale = (torch.rand(rows, generator=gen) / INT8_MAX).to(dev)
    times = []
    for m in (1, PREFILL_MIN_ROWS):
        x = torch.randn(m, in_features, generator=gen).to(dev, dtype)
        times.append(_device_best_time(lambda: _int8_kernel(x, qweight, scale, kernel_dtype), dev, 5))
        times.append(_device_best_time(lambda: _int8_dense(x, qweight, scale), dev, 5))
    use_kernel, dense_prefill = int8_paths_by_speed(*times)
    log.info("int8 [%d, %d] on %s in %s: kernel %.0f / %.0f us, dense %.0f / %.0f us (1 / %d rows): %s", rows,
             in_features, device, dtype, times[0] * 1e6, times[2] * 1e6, times[1] * 1e6, times[3] * 1e6,
             PREFILL_MIN_ROWS, "dense" if not use_kernel else "kernel, dense prefill" if dense_prefill else "kernel")
    return use_kernel, dense_prefill


@dataclass(frozen=True)
class _Int4Kernel:
    """How one device type's int4 kernel wants its weight: PyTorch has two packers with different inputs."""

    device_type: str
    high_nibble_even: bool  # GPU packer input: uint8 [N, K/2], even column in the high nibble (gpt-fast order)

    def pack(self, packed: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """Int4Weight.packed uint8 [N, K/2] -> the kernel's packed weight; N*K/2 bytes in every layout.

        On CPU it packs a slab of rows at a time so the int32 codes the packer takes never exist for the whole
        matrix: the CPU packer lays rows out in independent blocks of 32 or 64, so slabs whose row count is a
        multiple of 64 pack to consecutive slices of the whole result. GPU layouts are packed in one go (their
        row tiling is not something to rely on, and a GPU holds the uint8 codes easily).

        in_place (CPU): write each packed slab over the codes it was made from (the same rows of the same
        [N, K/2] bytes, already read), so the matrix is never held twice; `packed` is then the result. Raises
        KernelUnavailableError if the packer refuses a slab after earlier ones were written over (their codes are
        gone: there is no portable path to fall back to), RuntimeError if it refuses the first.
        """
        rows, half_k = packed.shape
        step = max(64, (_CHUNK_ELEMENTS // (half_k * 2)) // 64 * 64) if self.device_type == "cpu" else rows
        out: torch.Tensor | None = packed if in_place and step < rows else None
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            try:
                part = self._pack_slab(packed[r0:r1])
            except RuntimeError as exc:
                if out is packed and r0 > 0:
                    raise KernelUnavailableError(f"the int4 packer refused rows {r0}..{r1 - 1} of a [{rows}, "
                                                 f"{2 * half_k}] weight after packing the rows before them in "
                                                 f"place: {exc}; quantize it with use_kernel=False") from exc
                raise
            if r1 - r0 == rows:
                return part
            if out is None:
                out = part.new_empty((rows, *part.shape[1:]))  # [N, K/2] uint8
            out[r0:r1] = part
        assert out is not None
        return out

    def _pack_slab(self, packed: torch.Tensor) -> torch.Tensor:
        codes = unpack_int4(packed)  # [n, K]
        inner_k_tiles = next(t for t in (8, 4, 2) if codes.shape[1] % (16 * t) == 0)
        if self.device_type == "cpu":
            return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), inner_k_tiles)
        if self.high_nibble_even:
            packed = (codes[:, 0::2] << 4) | codes[:, 1::2]  # [n, K/2]
        return torch.ops.aten._convert_weight_to_int4pack(packed.contiguous(), inner_k_tiles)

    def mm(self, x2: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor
           ) -> torch.Tensor:
        x2 = _kernel_x(x2)
        if self.device_type == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, group_size, scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm(x2, packed, group_size, scales_and_zeros)


def _int4_kernel_shape_ok(out_features: int, padded_in: int, group_size: int) -> bool:
    # the CPU packer tiles N by 16 (the GPU one by 8); K must hold a whole number of 32-wide k-tiles
    return group_size in INT4_KERNEL_GROUP_SIZES and out_features % 16 == 0 and padded_in % 32 == 0


def _scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """[out, groups] x2 -> the kernels' [groups, out, 2] (scale, zero), bfloat16."""
    return torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(_KERNEL_DTYPE)


@functools.lru_cache(maxsize=None)
def int4_kernel_available(device: str) -> _Int4Kernel | None:
    """The int4 kernel for `device` (cpu, cuda:N, mps) if it runs there and agrees with the reference (probed once
    per device: two GPUs of one machine need not be alike), else None. The kernels read bfloat16 scales, so a
    device without bfloat16 (its TypeError) has none.

    On GPUs the nibble order the packer expects has changed across PyTorch versions, so both are tried.
    """
    device_type = torch.device(device).type
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(32, 256, generator=gen)
    x = torch.randn(3, 256, generator=gen)
    qw = quantize_int4(w, 64)
    ref = x.to(_KERNEL_DTYPE).float() @ dequantize_int4(qw).T
    candidates = [_Int4Kernel("cpu", False)] if device_type == "cpu" else \
        [_Int4Kernel(device_type, True), _Int4Kernel(device_type, False)]
    dev = torch.device(device)
    reason = "no candidate agreed with the reference"
    for kernel in candidates:
        try:
            packed = kernel.pack(qw.packed.to(dev))
            y = kernel.mm(x.to(dev), packed, 64, _scales_and_zeros(qw.scales, qw.zeros).to(dev)).cpu()
        except (RuntimeError, NotImplementedError, AttributeError, TypeError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            continue
        err = _relative_error(y, ref)
        if err < 2e-2:
            log.info("int4 packed kernel on %s: in use (relative error %.2e)", device, err)
            return kernel
        reason = f"relative error {err:.2e} against the reference"
    log.info("int4 packed kernel unavailable on %s (%s); using the portable path", device, reason)
    return None


# ---------------------------------------------------------------------------------------------- modules


def native_allowed(compute_dtype: torch.dtype | None) -> bool:
    """Whether a layer computing in `compute_dtype` (None: not known) may take the native path, which quantizes
    its activations to int8. Not in float32: a node computes in float32 to stay closest to the reference, and
    there its activations keep what PyTorch's kernels give them (bfloat16 rounding, 2^-9 relative, where int8
    blocks round at ~2^-8 of their largest value, far coarser beside an outlier)."""
    return compute_dtype != torch.float32


def native_by_default(mode: str, device_type: str, compute_dtype: torch.dtype | None) -> bool:
    """Whether `mode` ("int8", "int4") layers on `device_type` computing in `compute_dtype` take the native path
    when not told otherwise (use_kernel=None) and their shape allows: on a CPU, outside float32, where the native
    products built and beat PyTorch's kernel (native.faster_than_torch)."""
    return device_type == "cpu" and native_allowed(compute_dtype) and native.faster_than_torch(mode)


def _resolve_use_kernel(use_kernel: bool | None, available: bool, what: str) -> bool:
    if use_kernel is None:
        return available
    if use_kernel and not available:
        raise KernelUnavailableError(f"{what}; pass use_kernel=None to fall back to the portable path")
    return use_kernel


class _QuantLinear(nn.Module):
    """Shared by Int8Linear / Int4Linear: shape attributes, bias, and keeping buffers in their storage dtype."""

    in_features: int
    out_features: int
    uses_kernel: bool  # PyTorch's packed kernel
    path: str  # "native", "kernel" (PyTorch's packed kernel) or "portable"
    _fixed_dtypes: dict[str, torch.dtype]  # buffer name -> dtype it must keep
    _kernel_device_type: str | None  # set when the buffers are in a device-specific kernel layout

    def _init_bias(self, bias: torch.Tensor | None) -> None:
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise QuantizationError(f"bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
        self.register_buffer("bias", None if bias is None else bias.detach())

    def _init_dense_rows(self, dense: bool | None, dtype: torch.dtype | None,
                         probe: Callable[[], int | None]) -> None:
        """On the native path, from how many rows of `dtype` a product takes the dense way: `dense` True, from
        NATIVE_DENSE_MIN_ROWS; False, never; None, from the rows `probe()` finds it faster (None: never)."""
        from_rows = NATIVE_DENSE_MIN_ROWS if dense else None
        if dense is None and dtype is not None:
            from_rows = probe()
        self.dense_prefill_dtype = dtype if from_rows is not None else None  # None: every product native
        self.dense_from_rows = from_rows or NATIVE_DENSE_MIN_ROWS

    def _finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Kernel output [M, out] -> x's dtype, plus bias, shaped [..., out].

        A decode step is a few microseconds of kernel on small layers, so every op skipped here counts: casts
        only when dtypes differ, and the bias added in place (y is this call's fresh output).
        """
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        bias = self._buffers["bias"]
        if bias is not None:
            native.add_bias_(y, bias)
        return y.view(*x.shape[:-1], self.out_features)  # [..., out]

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module's own signature
        # .to(dtype) would cast the float scales too; the kernels read them in a fixed dtype and quantized_nbytes
        # counts that dtype, so they are put back. A kernel layout is specific to its device type and cannot be
        # moved; quantize after moving instead.
        if self._kernel_device_type is not None:
            target = fn(torch.empty(0, device=self._kernel_device_type)).device.type
            if target != self._kernel_device_type:
                raise QuantizationError(
                    f"{type(self).__name__} holds a {self._kernel_device_type} kernel layout and cannot move to "
                    f"{target}; move the float model first and quantize it there")
        super()._apply(fn, recurse)
        for name, dtype in self._fixed_dtypes.items():
            buf = self._buffers[name] if name in self._buffers else None
            if buf is not None and buf.dtype != dtype:
                self._buffers[name] = buf.to(dtype)
        self._after_apply()
        return self

    def _after_apply(self) -> None:
        """Hook for a subclass whose path depends on the device its buffers are on."""

    def extra_repr(self) -> str:
        path = {"kernel": "packed kernel"}.get(self.path, self.path)
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, path={path}"


class Int8Linear(_QuantLinear):
    """nn.Linear with int8 weights (symmetric, per output channel). Buffers: qweight, scale, bias.

    The portable path computes (x @ qweight.T) * scale: the per-row scale factors out of the dot product, so no
    float copy of the weight is scaled, and the codes convert to x's dtype exactly (|q| <= 127).

    With the kernel, prefill-sized products (PREFILL_MIN_ROWS activation rows or more) in `prefill_dtype` may take
    the portable path instead: the kernel's time grows with every row, while the portable path converts the codes
    once and then runs the dense product at its own, much higher rate per row. A load-time probe per shape decides
    (`int8_dense_prefill_from_rows`; `dense_prefill` overrides it). Both paths read the same codes.
    """

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None = None, *, use_kernel: bool | None = None,
                 prefill_dtype: torch.dtype | None = None, dense_prefill: bool | None = None,
                 kernel_dtype: torch.dtype = _KERNEL_DTYPE, tile_in_place: bool = False):
        """kernel_dtype: what the packed kernel computes in (bfloat16, or float16 on a device without it).
        tile_in_place: the caller gives `weight` up, so the native path re-lays its codes out where they lie.
        Raises KernelUnavailableError if use_kernel=True and the device or shape has no int8 kernel."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self._use_kernel = use_kernel
        self._prefill_dtype, self._dense_prefill = prefill_dtype, dense_prefill
        self._kernel_dtype = kernel_dtype
        self._device = str(weight.qweight.device)
        self._fixed_dtypes = {"scale": torch.float32}
        if (use_kernel is None and native.shape_ok_int8(self.out_features, self.in_features)
                and native_by_default("int8", weight.qweight.device.type, prefill_dtype)):
            self._init_native(weight, bias, tile_in_place)
            return
        self.uses_kernel = self._choose_path(self._device)
        self.path = "kernel" if self.uses_kernel else "portable"
        self._kernel_device_type = None  # int8 codes are the same on both paths and every device
        qweight = weight.qweight
        if qweight.data_ptr() % _ALIGNMENT or not qweight.is_contiguous():
            qweight = qweight.clone(memory_format=torch.contiguous_format)  # the kernel's aligned loads
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", weight.scale)
        self._init_bias(bias)

    def _init_native(self, weight: Int8Weight, bias: torch.Tensor | None, in_place: bool) -> None:
        """Codes in the native kernels' tiled layout (native.tile_int8); prefill-sized products in the prefill
        dtype may convert them and multiply densely instead, where a probe finds that faster."""
        self.path, self.uses_kernel = "native", False
        self._kernel_device_type = "cpu"  # the tiled layout is for this CPU's kernels
        self._native = native.kernels()
        native.one_row_prefetch("int8")  # once per process: whether one row prefetches its weights here
        self._init_dense_rows(self._dense_prefill, self._prefill_dtype, lambda: int8_dense_prefill_from_rows(
            self.out_features, self.in_features, self._prefill_dtype, "native"))
        qweight = weight.qweight if in_place else weight.qweight.clone()
        self.register_buffer("qweight", native.tile_int8(qweight.contiguous()))
        self.register_buffer("scale", weight.scale)
        self._init_bias(bias)

    def _choose_path(self, device: str) -> bool:
        device_type = torch.device(device).type
        shape_ok = int8_kernel_shape_ok(self.out_features, self.in_features, device_type)
        n, k = int8_kernel_multiples(device_type)
        rule = " and ".join(f"{what} must be a multiple of {m}" for what, m in (("out_features", n), ("in_features", k))
                            if m > 1)
        uses_kernel = _resolve_use_kernel(
            self._use_kernel, shape_ok and int8_kernel_available(device, self._kernel_dtype),
            f"no int8 packed kernel for {(self.out_features, self.in_features)} in {self._kernel_dtype} on {device}"
            + ("" if shape_ok else f" ({rule} on {device_type})"))
        dense = self._dense_prefill
        if uses_kernel and device_type != "cpu" and self._use_kernel is None and self._prefill_dtype is not None:
            # accuracy passed; on an accelerator the kernel must also beat the dense product it replaces
            faster, dense_prefill = int8_device_speed_probe(device, min(self.out_features, PROBE_ROWS),
                                                            self.in_features, self._prefill_dtype, self._kernel_dtype)
            uses_kernel = faster
            dense = dense_prefill if dense is None else dense
        if dense is None:
            dense = (uses_kernel and device_type == "cpu" and self._prefill_dtype is not None
                     and int8_dense_prefill_from_rows(self.out_features, self.in_features, self._prefill_dtype)
                     is not None)
        # the dtype whose prefill-sized products take the portable path, or None
        self.dense_prefill_dtype = self._prefill_dtype if uses_kernel and dense else None
        return uses_kernel

    def _after_apply(self) -> None:
        # the codes mean the same everywhere, so a moved layer just picks the path its new device offers
        device = str(self._buffers["qweight"].device)
        if device != self._device and self.path != "native":
            self._device = device
            self.uses_kernel = self._choose_path(device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, use_kernel: bool | None = None,
                    dense_prefill: bool | None = None, kernel_dtype: torch.dtype = _KERNEL_DTYPE) -> "Int8Linear":
        """Quantize `linear`'s weight on its device; the bias is kept as it is. Its dtype is the prefill dtype."""
        return cls(quantize_int8(linear.weight.detach()), linear.bias, use_kernel=use_kernel,
                   prefill_dtype=linear.weight.dtype, dense_prefill=dense_prefill, kernel_dtype=kernel_dtype,
                   tile_in_place=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers  # plain dict lookups: nn.Module.__getattr__ costs ~1 us per buffer
        qweight, scale = buffers["qweight"], buffers["scale"]
        if self._decode_rows(x):
            return self._native.int8_product(x, qweight, scale, buffers["bias"])
        x2 = x.reshape(-1, self.in_features)  # [M, in]
        if self.path == "native":
            if x2.shape[0] < self.dense_from_rows or x.dtype != self.dense_prefill_dtype:
                y = self._native.int8_linear(x2, qweight, scale)
            else:
                y = _native_dense(x2, scale.shape[0], functools.partial(self._native.int8_rows, qweight), scale)
        elif self.uses_kernel and (x2.shape[0] < PREFILL_MIN_ROWS or x.dtype != self.dense_prefill_dtype):
            y = _int8_kernel(x2, qweight, scale, self._kernel_dtype)
        elif x.dtype == torch.float16:
            # x @ q.T can pass fp16's 65504 before the scale brings it down, so scale the weight instead
            y = F.linear(x2, qweight.to(x.dtype) * scale.to(x.dtype)[:, None])
        else:
            y = _int8_dense(x2, qweight, scale)
        return self._finish(y, x)

    def widened(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x).float(), the same values: written as float32 by the kernel itself where forward takes
        int8_product for x and there is no bias. The head's lm_head: its decode step's logits would otherwise be
        converted after the product, 600 KB read and written again on caches the product has just swept."""
        if self._decode_rows(x) and self._buffers["bias"] is None:
            return self._native.int8_product(x, self._buffers["qweight"], self._buffers["scale"], None, widened=True)
        return self(x).float()

    def native_calls(self, x: torch.Tensor, y: torch.Tensor) -> list[native.Call] | None:
        """The native calls that write this product of x into y as forward would compute it, for a decode plan;
        None where forward would not take int8_product for x."""
        if not self._decode_rows(x):
            return None
        buffers = self._buffers
        return [self._native.int8_call(x, buffers["qweight"], buffers["scale"], y)] + _bias_calls(y, buffers["bias"])

    def widened_call(self, x: torch.Tensor, y: torch.Tensor) -> native.Call | None:
        """The native call that writes widened(x) into float32 y where widened takes the kernel for x, for the
        head's greedy plan (greedy_plan.py); None elsewhere."""
        if not self._decode_rows(x) or self._buffers["bias"] is not None:
            return None
        return self._native.int8_call(x, self._buffers["qweight"], self._buffers["scale"], y, widened=True)

    def _decode_rows(self, x: torch.Tensor) -> bool:
        """Whether x is a decode step's few bf16 rows, which the native kernel takes in the fewest operations."""
        return (self.path == "native" and x.dtype == torch.bfloat16 and x.shape[-1] == self.in_features
                and x.is_contiguous() and x.numel() < PREFILL_MIN_ROWS * self.in_features)


def _bias_calls(y: torch.Tensor, bias: torch.Tensor | None) -> list[native.Call]:
    """A quantized product's bias added to its output y (native.add_bias_, the one rule), as a decode plan's call:
    the native sum's where the bias is already of y's bf16 (the same bits, in one call)."""
    if bias is None:
        return []
    return [native.sum_call(y, bias) or (native.add_bias_, (y, bias), None)]


class Int4Linear(_QuantLinear):
    """nn.Linear with group-wise int4 weights.

    Portable path buffers: packed (Int4Weight.packed), scales, zeros; it dequantizes into x's dtype per call and
    runs normal matmuls. Kernel path buffers: packed (the kernel's own layout, same byte count) and
    scales_and_zeros [groups, out, 2]. Either way activations are zero-padded to the padded width when in_features
    needed padding, so the padding columns contribute nothing.
    """

    dense_prefill_dtype: torch.dtype | None = None  # prefill-sized products in this dtype take the dense way,
    dense_from_rows = NATIVE_DENSE_MIN_ROWS  # from this many rows

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None, *, use_kernel: bool | None = None,
                 pack_in_place: bool = False, compute_dtype: torch.dtype | None = None,
                 dense_prefill: bool | None = None):
        """pack_in_place: the caller gives `weight` up (made for this module alone), so on a CPU the kernel layout
        is written over its codes instead of beside them (_Int4Kernel.pack); `weight` must not be read after.
        compute_dtype: the dtype of the activations, where known: float32 ones are not quantized (native_allowed).
        dense_prefill: on the native path, whether prefill-sized products in compute_dtype take the dense way (None:
        from the rows where int4_dense_prefill_from_rows finds it faster; True: from NATIVE_DENSE_MIN_ROWS).
        Raises KernelUnavailableError if use_kernel=True and the device or shape has no int4 kernel."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size = weight.group_size
        self.padded_in_features = weight.padded_in_features
        device_type = weight.packed.device.type
        # the kernels read bfloat16 scales: float16 ones (a device without bfloat16) take the portable path
        params_ok = weight.scales.dtype == _KERNEL_DTYPE
        self._fixed_dtypes = {"scales": weight.scales.dtype, "zeros": weight.scales.dtype,
                              "scales_and_zeros": _KERNEL_DTYPE}
        if (use_kernel is None and params_ok
                and native.shape_ok_int4(self.out_features, self.padded_in_features, self.group_size)
                and native_by_default("int4", device_type, compute_dtype)):
            self._init_native(weight, bias, pack_in_place, compute_dtype, dense_prefill)
            return
        shape_ok = _int4_kernel_shape_ok(self.out_features, self.padded_in_features, self.group_size)
        kernel = int4_kernel_available(str(weight.packed.device)) if shape_ok and params_ok else None
        self.uses_kernel = _resolve_use_kernel(
            use_kernel, kernel is not None,
            f"no int4 packed kernel for {weight.shape} with group size {weight.group_size} on {device_type}"
            + ("" if shape_ok else f" (needs group size in {INT4_KERNEL_GROUP_SIZES} and out_features a "
                                   "multiple of 16)")
            + ("" if params_ok else f" (the kernels read {_KERNEL_DTYPE} scales, not {weight.scales.dtype})"))
        self.path = "kernel" if self.uses_kernel else "portable"
        kernel_packed = None
        if self.uses_kernel:
            assert kernel is not None
            try:
                kernel_packed = kernel.pack(weight.packed, in_place=pack_in_place)
            except KernelUnavailableError:
                raise  # refused halfway through packing in place: the portable codes are gone
            except RuntimeError as exc:  # the probe passed on its small matrix, but this shape is refused
                if use_kernel:
                    raise KernelUnavailableError(f"the int4 packer refused {weight.shape}: {exc}") from exc
                log.warning("int4 packer refused %s on %s (%s); this layer takes the portable path",
                            weight.shape, device_type, exc)
                self.uses_kernel = False
                self.path = "portable"
        if kernel_packed is not None:
            assert kernel is not None
            self._kernel = kernel
            self._kernel_device_type = device_type
            self.register_buffer("packed", kernel_packed)
            self.register_buffer("scales_and_zeros", _scales_and_zeros(weight.scales, weight.zeros))
        else:
            self._kernel_device_type = None
            self.register_buffer("packed", weight.packed)
            self.register_buffer("scales", weight.scales)
            self.register_buffer("zeros", weight.zeros)
        self._init_bias(bias)

    def _init_native(self, weight: Int4Weight, bias: torch.Tensor | None, in_place: bool,
                     compute_dtype: torch.dtype | None, dense: bool | None) -> None:
        """Buffers in the native kernels' tiled layout (native.tile_int4), over the codes where `in_place`;
        prefill-sized products in the compute dtype may dequantize them and multiply densely instead, where a probe
        finds that faster (int4_dense_prefill_from_rows)."""
        self.path, self.uses_kernel = "native", False
        self._kernel_device_type = "cpu"
        self._native = native.kernels()
        native.one_row_prefetch("int4")  # once per process: whether one row prefetches its weights here
        self._init_dense_rows(dense, compute_dtype, lambda: int4_dense_prefill_from_rows(
            self.out_features, self.padded_in_features, self.group_size, compute_dtype))
        packed = weight.packed if in_place else weight.packed.clone()
        packed, scales, zeros = native.tile_int4(packed, weight.scales, weight.zeros)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self._init_bias(bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = DEFAULT_GROUP_SIZE, *,
                    use_kernel: bool | None = None, param_dtype: torch.dtype = INT4_PARAM_DTYPE) -> "Int4Linear":
        """Quantize `linear`'s weight on its device; the bias is kept as it is. Its dtype is the compute dtype."""
        return cls(quantize_int4(linear.weight.detach(), group_size, param_dtype), linear.bias,
                   use_kernel=use_kernel, compute_dtype=linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers  # plain dict lookups: nn.Module.__getattr__ costs ~1 us per buffer
        if self._unpadded_rows(x):
            return self._native.int4_product(x, buffers["packed"], buffers["scales"], buffers["zeros"],
                                             self.group_size, buffers["bias"])
        x2 = x.reshape(-1, self.in_features)  # [M, in]
        if self.padded_in_features > self.in_features:
            x2 = F.pad(x2, (0, self.padded_in_features - self.in_features))  # [M, padded_in]; weights there: any
        if self.path == "native" and x2.shape[0] >= self.dense_from_rows and x.dtype == self.dense_prefill_dtype:
            y = _native_dense(x2, self.out_features, functools.partial(
                self._native.int4_rows, buffers["packed"], buffers["scales"], buffers["zeros"], self.group_size))
        elif self.path == "native":
            y = self._native.int4_linear(x2, buffers["packed"], buffers["scales"], buffers["zeros"], self.group_size)
        elif self.uses_kernel:
            y = self._kernel.mm(x2, buffers["packed"], self.group_size, buffers["scales_and_zeros"])
        else:
            y = _int4_portable_linear(x2, buffers["packed"], buffers["scales"], buffers["zeros"], self.group_size)
        return self._finish(y, x)

    def native_calls(self, x: torch.Tensor, y: torch.Tensor) -> list[native.Call] | None:
        """The native calls that write this product of x into y as forward would compute it, for a decode plan;
        None where forward would not take int4_product for x."""
        if not self._unpadded_rows(x):
            return None
        buffers = self._buffers
        return ([self._native.int4_call(x, buffers["packed"], buffers["scales"], buffers["zeros"], self.group_size, y)]
                + _bias_calls(y, buffers["bias"]))

    def _unpadded_rows(self, x: torch.Tensor) -> bool:
        """Whether x is bf16 rows that need no padding, which the native product takes in the fewest operations
        (but for rows that the dense way takes: forward's first branch)."""
        return (self.path == "native" and x.dtype == torch.bfloat16 and x.shape[-1] == self.padded_in_features
                and self.padded_in_features == self.in_features and x.is_contiguous()
                and (self.dense_prefill_dtype is None or x.numel() < self.dense_from_rows * self.in_features))


@dataclass(frozen=True)
class Quantization:
    """How linear layers are quantized: the weight mode, the int4 group size, the 16-bit float type the device has
    (qwen2.half_dtype: int4 scales and zero points are kept in it and the packed int8 kernel computes in it, so
    nothing asks a device for a dtype it lacks, bfloat16 on MPS before macOS 14), and use_kernel as
    Int8Linear/Int4Linear take it. Mode "fp16" quantizes nothing.

    `quantize_linears` applies it to a built module; Stage.load applies it to each weight as its rows stream from
    the checkpoint (`linear`), so no layer ever exists whole in 16 bits.
    Raises QuantizationError for an unknown mode or, in int4, a bad group size.
    """

    mode: str
    group_size: int = DEFAULT_GROUP_SIZE
    half_dtype: torch.dtype = torch.bfloat16
    use_kernel: bool | None = None

    def __post_init__(self) -> None:
        if self.mode not in WEIGHT_MODES:
            raise QuantizationError(f"unknown weight mode {self.mode!r}; expected one of {WEIGHT_MODES}")
        if self.mode == "int4":
            _check_group_size(self.group_size)

    @property
    def quantizes(self) -> bool:
        return self.mode != "fp16"

    def linear(self, slabs: RowSlabs, shape: tuple[int, int], device: torch.device | str, bias: torch.Tensor | None,
               prefill_dtype: torch.dtype) -> "Int8Linear | Int4Linear":
        """The quantized module, on `device`, for a weight of `shape` whose rows arrive as `slabs` (see
        quantize_*_slabs); `bias` is kept as it is, and prefill_dtype is the dtype the layer computes in (see
        Int8Linear). The weight is made here for the module alone, so int4 codes take the CPU kernel's layout where
        they lie instead of beside a copy (Int4Linear's pack_in_place).
        Raises QuantizationError for mode fp16 or slabs that do not tile `shape`."""
        if self.mode == "int8":
            return Int8Linear(quantize_int8_slabs(slabs, shape, device), bias, use_kernel=self.use_kernel,
                              prefill_dtype=prefill_dtype, kernel_dtype=self.half_dtype, tile_in_place=True)
        if self.mode == "int4":
            return Int4Linear(quantize_int4_slabs(slabs, shape, device, self.group_size, self.half_dtype), bias,
                              use_kernel=self.use_kernel, pack_in_place=True, compute_dtype=prefill_dtype)
        raise QuantizationError("weight mode fp16 quantizes nothing")


def quantize_linears(module: nn.Module, mode: str, group_size: int = DEFAULT_GROUP_SIZE, *,
                     use_kernel: bool | None = None, half_dtype: torch.dtype = torch.bfloat16) -> None:
    """Replace every linear layer below `module` (nn.Linear, or a dense.PackedLinear) by its int8/int4
    counterpart, in place, on the layer's device, as `Quantization(mode, group_size, half_dtype, use_kernel)` says.

    mode "fp16" leaves the module as it is. Raises QuantizationError for an unknown mode, a bad group size, or a
    bare linear layer passed as `module` (there is no parent to put the replacement in; wrap it).
    """
    quantization = Quantization(mode, group_size, half_dtype, use_kernel)
    if not quantization.quantizes:
        return
    if isinstance(module, (nn.Linear, PackedLinear)):
        raise QuantizationError("quantize_linears replaces Linears inside a module; wrap a bare nn.Linear "
                                "(e.g. nn.Sequential(linear)) or call Int8Linear/Int4Linear.from_linear")
    replacements: dict[int, nn.Module] = {}  # id(Linear) -> its replacement, so a shared Linear stays shared
    for parent in list(module.modules()):
        for name, child in list(parent._modules.items()):  # named_children() would skip a repeated child
            if not isinstance(child, (nn.Linear, PackedLinear)):
                continue
            if id(child) not in replacements:
                # a packed layer gives its plain weight back; the codes are the same as for the unpacked layer
                w = child.dense_weight() if isinstance(child, PackedLinear) else child.weight.detach()
                replacements[id(child)] = quantization.linear([(0, w)], _check_weight(w), w.device, child.bias,
                                                              w.dtype)
            setattr(parent, name, replacements[id(child)])
    log.debug("quantized %d linear layers to %s", len(replacements), mode)
