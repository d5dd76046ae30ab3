"""Kernels built for this CPU at run time: int4, int8 and bf16 products and a decode step's small operators, on x86-64.

Theory of operation
-------------------
PyTorch's packed kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) convert every weight to float
before multiplying, so on a CPU they are bound by arithmetic, not by memory: 12-17 GB/s of weights where the
machine streams 23, and their time grows with every activation row (8 rows cost 3-5x one). llama.cpp is faster
because it quantizes the activations to int8 as well and multiplies codes by codes with the CPU's integer
dot-product instructions. `qdot.c` (next to this file) does the same for tc's own int4 and int8 weights: the
activations are quantized per row and per group of columns, and tiles of 8 weight rows meet up to 8 activation
rows in registers, so a batch reads each weight once.

A decode step of a batch has the opposite problem in attention: one query row per sequence against its own
cache is a few microseconds of arithmetic, and PyTorch's SDPA spends ~25 us of dispatch and setup per call, one
call per sequence and layer. `attention.c` stores every sequence's new key and value and attends all of them in
one call per layer (`Kernels.decode_attention`, taken by qwen2.Attention for bf16 decode rows where
`attention_faster_than_torch` finds it faster), in float32 from bfloat16 inputs, as SDPA does.

`norm.c` likewise does a bf16 RMS norm in one call where PyTorch dispatches six operators and two conversions,
and `act.c` the MLP's silu(gate) * up where PyTorch dispatches three, and a decode plan's residual sums and
quantized biases with add_'s bits (`Kernels.add_call`).

`bf16dot.c` multiplies the few activation rows of a decode step by a bf16 weight in its plain [out, in] layout,
reading each weight row whole, in order, which streams at the memory's rate where oneDNN's products do not
(`Kernels.bf16_linear`, taken by dense.NativeLinear where `dense.fastest_product` finds it fastest).

It is C, so it is compiled here, not shipped built: `kernels()` compiles `qdot.c`, `attention.c`, `norm.c`,
`bf16dot.c` and `act.c` into one library once per machine with the C compiler found (`$CC`, words and all, as make
takes it, else cc, gcc or clang; -O3 -march=native -fopenmp, or where that build fails, a compiler or assembler
older than the CPU, for AVX2 and FMA alone, with a warning), caches it in `kernels/` of tc's cache
(tc/cache_dir.py: $TC_CACHE_DIR, else ~/.cache/truecluster) keyed by the sources, the compiler and the CPU, one
process building while the others starting with it wait (_cached; where the cache cannot be written, it builds it
for the process alone, under the system's temporary directory), loads it with ctypes, and checks it against the
references on small inputs. A machine without a compiler, an x86-64 CPU without AVX2 and FMA (as /proc/cpuinfo
lists its flags: no compile is tried), or another architecture gets None and keeps PyTorch's kernels. The library
links the OpenMP runtime by its usual name, which PyTorch has already loaded, so both share one thread pool
(tc/openmp.py). TC_NATIVE_KERNELS=0 turns the whole path off.

What it computes: W dequantized exactly as quant.py's references, times x quantized to int8 per row and per 32
columns (xq = round(x / s), s = max|x| / 127 over the block, as llama.cpp's Q8_0): `quantize_activations(x) @
dequantized W.T`, to float rounding. Blocks of 32 rather than the weights' groups of 128 because hidden states
have outlier channels, which coarsen every other value of their block: on the demo model (bench/perplexity.py)
blocks of 128 cost int8 weights +0.45% perplexity against PyTorch's kernel's +0.02%.

Layouts (same bytes as quant.py's portable ones, so quantized_nbytes still holds): int4 codes as
[N/8, K/8, 8, 4] bytes, byte (t, kb, r, b) holding column 8kb+b of row 8t+r in its low nibble and column
8kb+4+b in its high one, with scales and zeros as [N/8, groups, 8]; int8 codes as [N/8, K/4, 8, 4].
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import IO, Callable, Iterator, Sequence

import torch

from ..cache_dir import cache_path
from .probe import cache_bytes, cache_sweeper, one_thread, probe_lock, race
from .rope import rotate_

try:
    import fcntl
except ImportError:  # Windows: no flock; every process builds for itself
    fcntl = None

log = logging.getLogger(__name__)

# next to this file: the .c files make one library
SOURCES = ("qdot.c", "attention.c", "norm.c", "bf16dot.c", "act.c", "bf16.h")
ABI = 12  # qdot.c's TC_QDOT_ABI: a cached library of another ABI is rebuilt
ATTENTION_ABI = 3  # attention.c's TC_ATTENTION_ABI
NORM_ABI = 1  # norm.c's TC_NORM_ABI
BF16DOT_ABI = 7  # bf16dot.c's TC_BF16DOT_ABI
ACT_ABI = 2  # act.c's TC_ACT_ABI
ACT_ROWS = 16  # rows up to which (a batch's decode step) the native gated activation may be chosen
BATCH_SLACK = 1.1  # ... where it is at most this much slower than PyTorch's for that many rows
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")  # and the target (_target): native, else PLAIN_MARCH, or a test's
PLAIN_MARCH = "avx2"  # built for where -march=native fails: AVX2 and FMA alone
NEEDED_CPU_FLAGS = ("avx2", "fma")  # what every source's #error asks for
COMPILE_TIMEOUT_S = 120
BUILD_LOCK_WAIT_S = COMPILE_TIMEOUT_S + 60  # longer than a build can take: a holder past it is stopped, not building
BUILD_INFIX = ".build-"  # a build directory in the cache: the library's name, this, and tempfile's letters
TILE_ROWS = 8  # weight rows per tile: out_features must be a multiple
ACTIVATION_GROUP = 32  # qdot.c's XGROUP: activations are quantized per this many columns
# activation rows from which each kind of product prefetches its weights (qdot.c, bf16dot.c), unless a probe finds
# that one row pays (one_row_prefetch) ...
PREFETCH_ROWS = {"bf16": 3, "int8": 2, "int4": 2}
# weight bytes ahead that a pass prefetches, unless that probe finds one row faster prefetching FAR_AHEAD ahead
PREFETCH_AHEAD = {"bf16": 1024, "int8": 2048, "int4": 2048}
FAR_AHEAD = 8192
PREFETCH_GAIN = 1.03  # ... by this much for one row streamed from memory
STREAMS = (1, 2, 4, 8)  # weight streams a thread may walk for one row (bf16dot.c's and qdot.c's MAX_STREAMS: the last)
PREFETCH_TURNS = 8  # ... the best of this many turns each
# ... or of as many as fit this budget (s), one at least: 8 turns take 0.6-0.75 s on an idle 2-core VM, where two
# busy loops beside them made a turn 0.25-7 s (each two-thread product waiting a scheduler tick at its barrier), paid
# by every process at every start: a worker restarted beside a serving cluster must load within the resume grace
PREFETCH_BUDGET_S, PREFETCH_MIN_TURNS = 2.0, 1
PREFETCH_PROBE_BYTES = 128 << 20  # ... over at most this much memory (twice the last-level cache)
MIN_GAIN = 1.1  # the probe's margin over PyTorch's kernel before the native path is preferred
PRIVATE_PREFIX = "tc-kernels-"  # a library built for one process where the cache cannot be written (_build)
_SLAB_BYTES = 1 << 20  # weight bytes re-laid out at a time

_VOID_P, _INT = ctypes.c_void_p, ctypes.c_int

# One native call of a plan (decode_plan.py, greedy_plan.py): the function, its arguments, and what went wrong
# where it returns nonzero (None: its result says nothing). Made once for buffers that stay, then called step
# after step (run_calls).
Call = tuple[Callable[..., object], tuple, "str | None"]
Compiler = tuple[str, ...]  # the C compiler's command: its program, then any words $CC gave it ("ccache gcc")


def run_calls(calls: list[Call]) -> None:
    """Make `calls` in order. Raises MemoryError with a call's message where it returns nonzero."""
    for function, args, failure in calls:
        status = function(*args)
        if failure is not None and status:
            raise MemoryError(failure)


def shape_ok_int4(out_features: int, padded_in: int, group_size: int) -> bool:
    return out_features % TILE_ROWS == 0 and group_size % ACTIVATION_GROUP == 0 and padded_in % group_size == 0


def shape_ok_int8(out_features: int, in_features: int) -> bool:
    return out_features % TILE_ROWS == 0 and in_features % ACTIVATION_GROUP == 0


class Kernels:
    """The loaded library: products on tensors in the layouts above."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        self._int4 = lib.tc_int4_linear
        self._int4.argtypes = [_VOID_P, _INT, _INT, _INT, _VOID_P, _VOID_P, _VOID_P, _INT, _INT, _VOID_P, _INT, _INT,
                               _INT, _INT, _INT]
        self._int4.restype = _INT
        self._int8 = lib.tc_int8_linear
        self._int8.argtypes = [_VOID_P, _INT, _INT, _INT, _VOID_P, _VOID_P, _INT, _VOID_P, _INT, _INT, _INT, _INT, _INT]
        self._int8.restype = _INT
        self._attention = lib.tc_decode_attention
        self._attention.argtypes = [_INT, _VOID_P, _VOID_P, _VOID_P, _VOID_P, _VOID_P, _VOID_P, _INT, _INT, _INT,
                                    ctypes.c_float, _VOID_P, _VOID_P, _INT]
        self._attention.restype = _INT
        self._rms_norm = lib.tc_rms_norm
        self._rms_norm.argtypes = [_VOID_P, _VOID_P, _VOID_P, _INT, _INT, ctypes.c_float, _INT]
        self._rms_norm.restype = None
        self._silu_mul = lib.tc_silu_mul
        self._silu_mul.argtypes = [_VOID_P, _INT, _INT, _VOID_P, _INT]
        self._silu_mul.restype = None
        self._add_rows = lib.tc_add_rows
        self._add_rows.argtypes = [_VOID_P, _VOID_P, _INT, _INT, _INT]
        self._add_rows.restype = None
        self._int4_dequantize = lib.tc_int4_dequantize
        self._int4_dequantize.argtypes = [_VOID_P, _VOID_P, _VOID_P, _INT, _INT, _INT, _INT, _VOID_P, _INT]
        self._int4_dequantize.restype = None
        self._int8_dequantize = lib.tc_int8_dequantize
        self._int8_dequantize.argtypes = [_VOID_P, _INT, _INT, _INT, _VOID_P, _INT]
        self._int8_dequantize.restype = None
        self._quantize_activations = lib.tc_quantize_activations
        self._quantize_activations.argtypes = [_VOID_P, _INT, _INT, _INT, _VOID_P, _INT]
        self._quantize_activations.restype = None
        self._bf16 = lib.tc_bf16_linear
        self._bf16.argtypes = [_VOID_P, _INT, _INT, _VOID_P, _INT, _VOID_P, _VOID_P, _INT, _INT, _INT, _INT, _INT]
        self._bf16.restype = None
        self.bf16_tile_bytes = cache_bytes(1) // 2  # activation bytes of a pass beyond which it reads tiles
        self.bf16_rows_per_pass = int(lib.tc_bf16dot_max_rows())
        self.rows_per_pass = int(lib.tc_qdot_rows_per_pass())
        # per kind of product, the activation rows from which a pass prefetches its weights; one_row_prefetch(kind)
        # may lower it to 1
        self.prefetch_rows = dict(PREFETCH_ROWS)
        self.prefetch_ahead = dict(PREFETCH_AHEAD)  # ... and how many weight bytes ahead (one_row_prefetch again)
        # ... and, for one row, how many weight streams a thread walks (one of STREAMS: bf16dot.c's dot_streams,
        # qdot.c's tile streams; one_row_prefetch again)
        self.streams = {"bf16": 1, "int8": 1, "int4": 1}
        if lib.tc_qdot_activation_group() != ACTIVATION_GROUP:
            raise RuntimeError(f"the library quantizes activations per {lib.tc_qdot_activation_group()} columns, "
                               f"expected {ACTIVATION_GROUP}")

    def __deepcopy__(self, memo: dict) -> "Kernels":
        return self  # one loaded library per process: a copied layer shares it

    def __reduce__(self) -> tuple:
        return kernels, ()  # a pickled layer finds the library of the process that loads it

    def int4_linear(self, x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int) -> torch.Tensor:
        """x2 [M, K] (bfloat16 stays bfloat16, anything else computes and returns float32) @ W^T -> [M, N]."""
        x2, bf16 = _activations(x2)
        m, k = x2.shape
        n = packed.shape[0] * TILE_ROWS
        y = torch.empty(m, n, dtype=x2.dtype)
        if self._int4(x2.data_ptr(), bf16, m, k, packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n,
                      group_size, y.data_ptr(), bf16, torch.get_num_threads(), self.prefetch_rows["int4"],
                      self.prefetch_ahead["int4"], self.streams["int4"]):
            raise _no_memory_for_codes(m, k)
        return y

    def int4_product(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
        """int4_linear for contiguous bfloat16 activations x [..., K] (K the padded width), in as few operations as
        it can (quant.Int4Linear's decode path: each costs several times its hot-loop time in a step whose weights
        have just swept the caches) -> [..., N] bfloat16, `bias` added as quant.Int4Linear adds it."""
        k = x.shape[-1]
        n = packed.shape[0] * TILE_ROWS
        y = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
        if self._int4(x.data_ptr(), 1, x.numel() // k, k, packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n,
                      group_size, y.data_ptr(), 1, torch.get_num_threads(), self.prefetch_rows["int4"],
                      self.prefetch_ahead["int4"], self.streams["int4"]):
            raise _no_memory_for_codes(x.numel() // k, k)
        return y if bias is None else add_bias_(y, bias)

    def int8_product(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None, widened: bool = False, rounded: bool = True) -> torch.Tensor:
        """int8_linear as int4_product is int4_linear: contiguous bfloat16 x [..., K] -> [..., N] plus `bias`.

        widened (no bias): the same bfloat16 values written as float32, which the kernel does as it stores them,
        for a caller that wants float32 (the head's logits) and would otherwise convert the whole output after.
        rounded=False (widened only): the float32 sums as they are, not rounded to bfloat16 first (the greedy
        screen's bound counts on no rounding but that of the sums)."""
        if widened and bias is not None:
            raise ValueError("a widened int8 product takes no bias: add it in bfloat16, then widen")
        if not rounded and not widened:
            raise ValueError("an int8 product left unrounded is written in float32: ask for it widened")
        k = x.shape[-1]
        n = scale.shape[0]
        y = torch.empty(*x.shape[:-1], n, dtype=torch.float32 if widened else torch.bfloat16)
        if self._int8(x.data_ptr(), 1, x.numel() // k, k, qweight.data_ptr(), scale.data_ptr(), n, y.data_ptr(),
                      (2 if rounded else 0) if widened else 1, torch.get_num_threads(), self.prefetch_rows["int8"],
                      self.prefetch_ahead["int8"], self.streams["int8"]):
            raise _no_memory_for_codes(x.numel() // k, k)
        return y if bias is None else add_bias_(y, bias)

    def int4_call(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int, y: torch.Tensor) -> Call:
        """int4_product's kernel call for contiguous bfloat16 x [..., K] into y [..., N], for a decode plan."""
        k = x.shape[-1]
        m, n = x.numel() // k, packed.shape[0] * TILE_ROWS
        return (self._int4, (x.data_ptr(), 1, m, k, packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n,
                             group_size, y.data_ptr(), 1, torch.get_num_threads(), self.prefetch_rows["int4"],
                             self.prefetch_ahead["int4"], self.streams["int4"]),
                str(_no_memory_for_codes(m, k)))

    def int8_call(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, y: torch.Tensor,
                  widened: bool = False) -> Call:
        """int8_product's kernel call for contiguous bfloat16 x [..., K] into y [..., N] (bfloat16, or float32
        `widened` as int8_product widens), for a decode plan."""
        k = x.shape[-1]
        m = x.numel() // k
        return (self._int8, (x.data_ptr(), 1, m, k, qweight.data_ptr(), scale.data_ptr(), scale.shape[0],
                             y.data_ptr(), 2 if widened else 1, torch.get_num_threads(), self.prefetch_rows["int8"],
                             self.prefetch_ahead["int8"], self.streams["int8"]),
                str(_no_memory_for_codes(m, k)))

    def bf16_call(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> Call:
        """bf16_product's kernel call (tiled as it would choose) for x [..., K] into y [..., N], for a decode plan;
        the caller has made bf16_product's checks."""
        k = x.shape[-1]
        m = x.numel() // k
        tiled = min(m, self.bf16_rows_per_pass) * k * 2 > self.bf16_tile_bytes
        return (self._bf16, (x.data_ptr(), m, k, weight.data_ptr(), weight.shape[0],
                             None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads(), tiled,
                             self.prefetch_rows["bf16"], self.prefetch_ahead["bf16"], self.streams["bf16"]), None)

    def rms_norm_call(self, x: torch.Tensor, weight: torch.Tensor, eps: float, y: torch.Tensor) -> Call:
        """rms_norm's kernel call for contiguous bfloat16 x [..., n] into y, for a decode plan."""
        n = x.shape[-1]
        return self._rms_norm, (x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps,
                                torch.get_num_threads()), None

    def silu_mul_call(self, gate_up: torch.Tensor, y: torch.Tensor) -> Call:
        """silu_mul's kernel call for contiguous bfloat16 gate_up [..., 2 * inner] into y [..., inner]."""
        inner = gate_up.shape[-1] // 2
        return self._silu_mul, (gate_up.data_ptr(), gate_up.numel() // (2 * inner), inner, y.data_ptr(),
                                torch.get_num_threads()), None

    def add_call(self, y: torch.Tensor, b: torch.Tensor) -> Call:
        """y += b in place for contiguous bfloat16 y [..., n] and b of y's shape or [n] (a bias: added to every
        row), with add_'s bits (act.c), for a decode plan."""
        n = y.shape[-1]
        for t in (y, b):
            if t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"the native sum takes contiguous bf16 CPU tensors, not {t.dtype} "
                                 f"{list(t.shape)} on {t.device}")
        if b.numel() not in (n, y.numel()):
            raise ValueError(f"cannot add {list(b.shape)} to {list(y.shape)}: b is one row or y's shape")
        return self._add_rows, (y.data_ptr(), b.data_ptr(), y.numel() // n, n, 0 if b.numel() == n else n), None

    def add_(self, y: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """add_call's sum, called now; returns y."""
        function, args, _ = self.add_call(y, b)
        function(*args)
        return y

    def decode_attention_call(self, qkv: torch.Tensor, out: torch.Tensor, slots: ctypes.Array,
                              positions: ctypes.Array, capacities: ctypes.Array, rows: ctypes.Array, heads: int,
                              kv_heads: int, scale: float, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> Call:
        """decode_attention's kernel call for every row of qkv [rows, ...] into out [rows, heads * D], rotating
        by rotary's cos and sin [rows, 1, D] (all contiguous bfloat16; None: a layer that rotates nothing, as
        SmolLM3's NoPE layers), for a decode plan: slots (int64),
        positions, capacities and rows (int32) are ctypes arrays of one entry per row, which the plan fills for
        each step (a row's cache storage for this layer, its position, its cache's capacity, and its row)."""
        n = qkv.shape[0]
        d = qkv.shape[-1] // (heads + 2 * kv_heads)
        cos, sin = (None, None) if rotary is None else (t.data_ptr() for t in rotary)
        return (self._attention, (n, slots, positions, capacities, rows, qkv.data_ptr(), out.data_ptr(), heads,
                                  kv_heads, d, scale, cos, sin, torch.get_num_threads()),
                f"no memory for the attention scores of {n} sequences")

    def int8_linear(self, x2: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] @ W^T for W int8 in the tiled layout with a float32 scale per row -> [M, N]."""
        x2, bf16 = _activations(x2)
        m, k = x2.shape
        n = scale.shape[0]
        y = torch.empty(m, n, dtype=x2.dtype)
        if self._int8(x2.data_ptr(), bf16, m, k, qweight.data_ptr(), scale.data_ptr(), n, y.data_ptr(), bf16,
                      torch.get_num_threads(), self.prefetch_rows["int8"], self.prefetch_ahead["int8"],
                      self.streams["int8"]):
            raise _no_memory_for_codes(m, k)
        return y

    def int4_rows(self, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, r0: int,
                  r1: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [r0, r1) (multiples of 8) of a tiled int4 weight, dequantized to plain bfloat16 [r1 - r0,
        K] (into `out`, contiguous, where given): quant.dequantize_int4's values converted to bfloat16, bit for bit."""
        k = packed.shape[1] * 8
        out = _rows_out(r0, r1, packed.shape[0] * TILE_ROWS, k, out)
        if scales.shape != (packed.shape[0], k // group_size, TILE_ROWS) or zeros.shape != scales.shape:
            # the kernel reads K / group_size scales and zero points a row: others would be read past their buffers
            raise ValueError(f"scales and zeros must be [{packed.shape[0]}, {k // group_size}, {TILE_ROWS}] for "
                             f"group_size {group_size}, not {tuple(scales.shape)} and {tuple(zeros.shape)}")
        self._int4_dequantize(packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(), k, group_size,
                              r0 // TILE_ROWS, r1 // TILE_ROWS, out.data_ptr(), torch.get_num_threads())
        return out

    def int8_rows(self, qweight: torch.Tensor, r0: int, r1: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [r0, r1) (multiples of 8) of a tiled int8 weight as plain codes [r1 - r0, K] in bfloat16
        (into `out`, contiguous, where given; exact: |code| <= 127)."""
        k = qweight.shape[1] * 4
        out = _rows_out(r0, r1, qweight.shape[0] * TILE_ROWS, k, out)
        self._int8_dequantize(qweight.data_ptr(), k, r0 // TILE_ROWS, r1 // TILE_ROWS, out.data_ptr(),
                              torch.get_num_threads())
        return out

    def quantized_activations(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] (K a multiple of ACTIVATION_GROUP) as the products see it, in bfloat16: quantize_activations'
        values converted to bfloat16, bit for bit. What a prompt's rows multiplied densely are multiplied as."""
        x2, bf16 = _activations(x2)
        m, k = x2.shape
        out = torch.empty(m, k, dtype=torch.bfloat16)
        self._quantize_activations(x2.data_ptr(), bf16, m, k, out.data_ptr(), torch.get_num_threads())
        return out

    def decode_attention(self, qkv: torch.Tensor, out: torch.Tensor, rows: Sequence[int],
                         slots: Sequence[torch.Tensor], positions: Sequence[int], heads: int, kv_heads: int,
                         scale: float, rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """A decode step's attention for several sequences in one call (attention.c), all bfloat16.

        qkv [rows, (heads + 2 kv_heads) * D] holds each sequence's query, key and value heads in its row rows[i];
        slots[i] is its cache's storage for this layer ([2, 1, kv_heads, capacity, D], contiguous), positions[i]
        its new position. Stores each new key and value at that position and writes the attention over every
        position up to it into out [rows, heads * D], row rows[i]. Other rows of out are left as they are.
        With `rotary` (cos and sin [rows, 1, D] as rope.Rotary gives them, contiguous), the query and key heads
        of row r are first rotated by row r of each, as rope.rotate_ would (qkv itself is left as it is).
        """
        n = len(rows)
        d = qkv.shape[-1] // (heads + 2 * kv_heads)
        if qkv.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or not qkv.is_contiguous() \
                or not out.is_contiguous() or out.shape != (qkv.shape[0], heads * d):
            raise ValueError(f"decode_attention takes contiguous bfloat16 qkv [rows, {heads + 2 * kv_heads} x D] and "
                             f"out [rows, {heads} x D], got {qkv.dtype} {list(qkv.shape)} and {out.dtype} "
                             f"{list(out.shape)}")
        cos = sin = None
        if rotary is not None:
            if any(t.dtype != torch.bfloat16 or not t.is_contiguous() or t.numel() != qkv.shape[0] * d
                   for t in rotary):
                raise ValueError(f"decode_attention's rotary tables are contiguous bfloat16 [rows, 1, D], one row "
                                 f"for each of qkv's {qkv.shape[0]} rows, got "
                                 f"{[(t.dtype, list(t.shape)) for t in rotary]}")
            cos, sin = (t.data_ptr() for t in rotary)
        ints = ctypes.c_int32 * n
        status = self._attention(n, (ctypes.c_int64 * n)(*[s.data_ptr() for s in slots]), ints(*positions),
                                 ints(*[s.shape[-2] for s in slots]), ints(*rows), qkv.data_ptr(), out.data_ptr(),
                                 heads, kv_heads, d, scale, cos, sin, torch.get_num_threads())
        if status == -1:
            raise MemoryError(f"no memory for the attention scores of {n} sequences")
        if status:
            raise ValueError(f"the native attention takes no {heads} query heads over {kv_heads} of size {d}")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * rms_norm(x) for contiguous bfloat16 x [..., n] and weight [n] (norm.c): the reference's
        roundings (normalised in float32, rounded to bfloat16, then scaled and rounded again)."""
        y = torch.empty_like(x)
        n = x.shape[-1]
        self._rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps,
                       torch.get_num_threads())
        return y


    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for contiguous bfloat16 gate_up [..., 2 * inner] (the gate half, then the up half) ->
        [..., inner] (act.c), with PyTorch's roundings up to the last bits of e^x."""
        inner = gate_up.shape[-1] // 2
        y = torch.empty(*gate_up.shape[:-1], inner, dtype=torch.bfloat16)
        self._silu_mul(gate_up.data_ptr(), gate_up.numel() // (2 * inner), inner, y.data_ptr(),
                       torch.get_num_threads())
        return y

    def bf16_linear(self, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    tiled: bool | None = None) -> torch.Tensor:
        """x2 [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N], all bfloat16 (bf16dot.c); weight and bias contiguous.
        Every pass of `bf16_rows_per_pass` rows reads the whole weight, so it is meant for a decode step's few.
        tiled: whether passes of several rows read four weight rows at a time; None decides as bf16_product does.
        The result is the same either way."""
        x2 = x2.contiguous()
        if x2.dtype != torch.bfloat16 or x2.device.type != "cpu" or not bf16_operands_ok(x2.shape[1], weight, bias):
            raise ValueError(f"bf16_linear takes bfloat16 x [M, K], a contiguous weight [N, K] and bias [N] on the "
                             f"CPU, got x {x2.dtype} {list(x2.shape)}, weight {weight.dtype} {list(weight.shape)}"
                             + ("" if bias is None else f", bias {bias.dtype} {list(bias.shape)}"))
        return self.bf16_product(x2, weight, bias, tiled)

    def bf16_product(self, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     tiled: bool | None = None) -> torch.Tensor:
        """bf16_linear without its checks, for a caller that has made them (dense.NativeLinear, once a call, on a
        decode step's path): x2 [..., K] contiguous bfloat16 on the CPU, and bf16_operands_ok(K, weight, bias);
        returns [..., N].

        Unless `tiled` says, a pass reads tiles where its activation rows take more than half of L1 (bf16dot.c's
        dot_tile): there each activation vector comes from L2 for every weight row, and a tile makes one load serve
        four; below that, one weight row after another keeps the hardware prefetcher's single stream."""
        k = x2.shape[-1]
        m, n = x2.numel() // k, weight.shape[0]
        if tiled is None:
            tiled = min(m, self.bf16_rows_per_pass) * k * 2 > self.bf16_tile_bytes
        y = torch.empty(*x2.shape[:-1], n, dtype=torch.bfloat16)
        self._bf16(x2.data_ptr(), m, k, weight.data_ptr(), n, None if bias is None else bias.data_ptr(), y.data_ptr(),
                   torch.get_num_threads(), tiled, self.prefetch_rows["bf16"], self.prefetch_ahead["bf16"],
                   self.streams["bf16"])
        return y


def bf16_operands_ok(k: int, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether Kernels.bf16_linear can read `weight` and `bias` as they are for inputs of width k: bfloat16, in CPU
    memory, contiguous, [N, k] and [N]. It reads raw memory, so anything else must not reach it."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[1] == k and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.bfloat16 and bias.device.type == "cpu" and bias.is_contiguous()
                                  and tuple(bias.shape) == (weight.shape[0],))))


def attention_shape_ok(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether attention.c takes these heads: head_dim a multiple of 8 up to 256, at most 16 query heads per KV."""
    return head_dim % 8 == 0 and head_dim <= 256 and heads % kv_heads == 0 and heads // kv_heads <= 16


def add_bias_(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """y += bias in y's dtype, in place (y is a product's fresh output); returns y. The one rule for every quantized
    product's bias, native or not (quant._QuantLinear._finish)."""
    return y.add_(bias if bias.dtype == y.dtype else bias.to(y.dtype))


def _no_memory_for_codes(rows: int, k: int) -> MemoryError:
    return MemoryError(f"no memory for the int8 codes of {rows} x {k} activations")


def _activations(x2: torch.Tensor) -> tuple[torch.Tensor, int]:
    if x2.dtype != torch.bfloat16 and x2.dtype != torch.float32:
        x2 = x2.float()
    return x2.contiguous(), int(x2.dtype == torch.bfloat16)


# ------------------------------------------------------------------------------------------------ layouts


def _rows_out(r0: int, r1: int, rows: int, k: int, out: torch.Tensor | None) -> torch.Tensor:
    """Where Kernels.int4_rows and int8_rows write rows [r0, r1) of K columns of a weight of `rows` rows: `out`,
    checked, or a new tensor."""
    if r0 % TILE_ROWS or r1 % TILE_ROWS or not 0 <= r0 < r1:  # the kernels write whole tiles
        raise ValueError(f"rows [{r0}, {r1}): both must be multiples of {TILE_ROWS}, the first below the last")
    if r1 > rows:  # the kernels would read past the weight's buffers
        raise ValueError(f"rows [{r0}, {r1}) run past the weight's {rows} rows")
    if out is None:
        return torch.empty(r1 - r0, k, dtype=torch.bfloat16)
    if out.shape != (r1 - r0, k) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous bfloat16 [{r1 - r0}, {k}], not {out.dtype} {tuple(out.shape)}")
    return out


def tile_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Portable int4 buffers (quant.Int4Weight: packed [N, K/2], scales and zeros [N, groups]) -> the tiled layout.

    The codes are re-laid out where they lie, a slab of rows at a time (a slab of whole tiles takes the same bytes
    in both layouts), so `packed` is the result and must not be read as portable codes after."""
    rows, half_k = packed.shape
    k = 2 * half_k
    step = max(TILE_ROWS, _SLAB_BYTES // half_k // TILE_ROWS * TILE_ROWS)
    for r0 in range(0, rows, step):
        slab = packed[r0:r0 + step]
        n = slab.shape[0]
        low, high = slab & 0x0F, slab >> 4  # [n, K/2]: even and odd columns
        codes = torch.stack([low, high], dim=-1).view(n // TILE_ROWS, TILE_ROWS, k // 8, 2, 4)  # (col 8kb+4h+b)
        tiled = codes[:, :, :, 0, :] | (codes[:, :, :, 1, :] << 4)  # [n/8, 8, K/8, 4]
        slab.view(-1).copy_(tiled.permute(0, 2, 1, 3).reshape(-1))
    groups = scales.shape[1]
    return (packed.view(rows // TILE_ROWS, k // 8, TILE_ROWS, 4), _tile_rows(scales, groups),
            _tile_rows(zeros, groups))


def _tile_rows(params: torch.Tensor, groups: int) -> torch.Tensor:
    return params.view(-1, TILE_ROWS, groups).transpose(1, 2).contiguous()  # [N/8, groups, 8]


def tile_int8(qweight: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] -> the tiled layout, in place (see tile_int4)."""
    rows, k = qweight.shape
    step = max(TILE_ROWS, _SLAB_BYTES // k // TILE_ROWS * TILE_ROWS)
    for r0 in range(0, rows, step):
        slab = qweight[r0:r0 + step]
        n = slab.shape[0]
        slab.view(-1).copy_(slab.view(n // TILE_ROWS, TILE_ROWS, k // 4, 4).permute(0, 2, 1, 3).reshape(-1))
    return qweight.view(rows // TILE_ROWS, k // 4, TILE_ROWS, 4)


# ---------------------------------------------------------------------------------------------- references


def quantize_activations(x2: torch.Tensor, group: int = ACTIVATION_GROUP) -> torch.Tensor:
    """x2 [M, K] as the kernels see it: quantized to int8 per row and `group` columns, and back, in float32."""
    x = x2.float()
    g = x.view(x.shape[0], -1, group)  # [M, groups, group]
    amax = g.abs().amax(dim=-1, keepdim=True)
    # as qdot.c computes it: 127 / amax in one float32 division (Python's 127 / tensor is 127 * (1 / tensor), two
    # roundings, which now and then moved a code by one where x * inverse came near a half)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    return (torch.round(g * inverse) * (amax / 127)).view_as(x)


# ------------------------------------------------------------------------------------------------- building


def _compiler() -> Compiler | None:
    """The C compiler's command: $CC, split into words as make and the shell split it ("ccache gcc", "gcc -m64"),
    else the first of cc, gcc and clang on the PATH; None where there is none."""
    cc = os.environ.get("CC", "")
    try:
        words = tuple(shlex.split(cc))
    except ValueError:  # an unclosed quote
        words = ()
    if words and shutil.which(words[0]):
        return words
    if cc.strip():
        log.warning("native kernels: CC=%r names no compiler on the PATH; looking for cc, gcc or clang", cc)
    return next(((name,) for name in ("cc", "gcc", "clang") if shutil.which(name)), None)


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags as Linux lists them (the first "flags" line of /proc/cpuinfo), or None where it does
    not: then a build is tried, and the sources' #error says what it lacks."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return next((frozenset(line.partition(":")[2].split()) for line in f if line.startswith("flags")), None)
    except OSError:
        return None


def _target(march: str) -> str:
    """How the compiler is told to build for `march`: -march=native, -march=haswell, or for PLAIN_MARCH the
    baseline x86-64 with AVX2 and FMA alone (what the sources ask for, and no more: a CPU, or a virtual one, that
    lists them may lack the rest of haswell's set)."""
    return "-march=x86-64 -mavx2 -mfma" if march == PLAIN_MARCH else f"-march={march}"


def _cpu_key() -> str:
    """The CPU's model and flags: -march=native code built on one CPU may not run on another."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor()


def _build(sources: dict[str, bytes], compiler: Compiler, march: str = "native") -> Path:
    """The library compiled from `sources` (file name: text), from the cache or built into it (_cached); where
    there is no cache (tc/cache_dir.py) or it cannot be written, built into a directory of its own under the
    system's temporary one, which the caller removes once it has loaded it (_is_private). Raises RuntimeError with
    the compiler's first error line if it fails."""
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = (*FLAGS, *_target(march).split())
    parts = [part for name in sorted(sources) for part in (name.encode(), sources[name])]
    command = shlex.join([*compiler, *flags]).encode()  # the compiler's own words among them: "gcc -m32" differs
    key = hashlib.sha256(b"\0".join([*parts, command, version.encode(), _cpu_key().encode()]))
    cache = cache_path("kernels")
    if cache is not None:  # else cache_path has said why there is none
        try:
            return _cached(cache / f"native-{key.hexdigest()[:16]}.so", sources, compiler, flags)
        except OSError as exc:  # a read-only home, a full disk: the kernels are still worth building, for this process
            log.warning("native kernels: cannot write their cache %s (%s); building them for this process, as every "
                        "start will until that directory can be written (or TC_CACHE_DIR names one that can)", cache,
                        exc)
    private = Path(tempfile.mkdtemp(prefix=PRIVATE_PREFIX))
    try:
        return _compile(sources, compiler, flags, private)
    except BaseException:
        shutil.rmtree(private, ignore_errors=True)
        raise


def _cached(path: Path, sources: dict[str, bytes], compiler: Compiler, flags: tuple[str, ...]) -> Path:
    """`path`, the cache's library for these sources and flags, built there first where it is missing or cut short.

    The processes of one machine often start at once (a head and its local workers): one builds while the others
    wait for its lock (_build_lock) and then load what it built, and the library appears whole or not at all (a
    rename). Build directories a builder killed mid-build left behind are removed first (_remove_leftovers).
    Raises OSError where the cache cannot be written."""
    if path.is_file() and _whole_library(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(path) as held:
        if path.is_file():
            if _whole_library(path):
                return path  # built while this process waited
            # cut short (written before a crash reached the disk, or copied onto a full one): loading it would map
            # pages past its end and die of SIGBUS on touching them, so it is built again over it
            log.warning("native kernels: %s is cut short (%d bytes); building it again", path, path.stat().st_size)
        if held:
            _remove_leftovers(path)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=path.stem + BUILD_INFIX) as tmp:
            os.replace(_compile(sources, compiler, flags, Path(tmp)), path)
    return path


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[bool]:
    """Hold the lock on building `path` inside (an flock on its .lock file beside it, which the system lets go of
    when its holder dies, mid-build or not); yields whether it is held. Where another process holds it, waits for
    that one to finish, up to BUILD_LOCK_WAIT_S: one that holds it longer is stopped rather than building, and this
    process builds too (the rename keeps the library whole). Without fcntl (Windows) every process builds."""
    if fcntl is None:
        yield False
        return
    with open(path.with_suffix(".lock"), "a") as handle:
        held = _try_lock(handle)
        if held is False:
            log.info("native kernels: another process is building %s; waiting for it", path.name)
            deadline = time.monotonic() + BUILD_LOCK_WAIT_S
            while held is False and time.monotonic() < deadline:
                time.sleep(0.05)
                held = _try_lock(handle)
            if held is False:
                log.warning("native kernels: another process has been building %s for over %.0f s; building it "
                            "here as well", path.name, BUILD_LOCK_WAIT_S)
        yield bool(held)  # closing the file lets the lock go


def _try_lock(handle: IO[str]) -> bool | None:
    """Whether this process now holds the flock on `handle`: False where another holds it, None where the file
    system keeps no locks."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None


def _remove_leftovers(path: Path) -> None:
    """Remove the build directories beside `path` that no process is building in: those of `path` itself, whose
    lock the caller holds, and those of any other library whose lock is free. A builder killed mid-build (SIGKILL,
    the OOM killer, a power cut) leaves its directory behind, and nothing else would ever remove it."""
    for leftover in path.parent.glob("*" + BUILD_INFIX + "*"):
        name = leftover.name.split(BUILD_INFIX)[0]
        if name == path.stem:
            shutil.rmtree(leftover, ignore_errors=True)
            continue
        try:
            with open(leftover.with_name(name + ".lock"), "a") as handle:
                if _try_lock(handle):
                    shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass  # its lock cannot be had: left to the process that can


def _compile(sources: dict[str, bytes], compiler: Compiler, flags: tuple[str, ...], directory: Path) -> Path:
    """The library compiled from `sources` in `directory`, on the disk (fsynced: a crash after its rename leaves
    no empty file under its name). Raises OSError where the directory cannot be written, RuntimeError with what
    the compiler said where it fails."""
    files, out = [directory / name for name in sorted(sources)], directory / "native.so"
    for file in files:
        file.write_bytes(sources[file.name])
    units = [str(f) for f in files if f.suffix == ".c"]  # the header is written beside them, not compiled
    done = subprocess.run([*compiler, *flags, "-o", str(out), *units], capture_output=True, text=True,
                          timeout=COMPILE_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(compiler)} failed: {_first_error(done.stderr)}")
    with open(out, "rb") as built:
        os.fsync(built.fileno())
    return out


def _first_error(stderr: str) -> str:
    """What a failed build's messages say went wrong: the first error, or where the only one is the compiler
    driver's closing line (gcc's "collect2: error: ld returned 1 exit status", clang's "linker command failed"),
    which says nothing of why, the linker's own lines before it (a library not found, a full disk)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    told = [line for line in lines if "ld returned" not in line and "linker command failed" not in line]
    return next((line for line in told if "error" in line), "; ".join(told)[:300] or stderr.strip()[:200])


def _is_private(path: Path) -> bool:
    """Whether `path` is a library _build made for one process, outside the cache."""
    return path.parent.name.startswith(PRIVATE_PREFIX)


def _whole_library(path: Path) -> bool:
    """Whether the library at `path` reaches the end of its ELF section header table, which linkers write last: a
    file cut short anywhere does not. (A library in another format, a Mach-O, is taken as whole.)"""
    with open(path, "rb") as f:
        header = f.read(64)
    if len(header) < 64:
        return False
    if header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:  # not 64-bit little-endian ELF
        return True
    offset = int.from_bytes(header[0x28:0x30], "little")
    entry_size, entries = int.from_bytes(header[0x3A:0x3C], "little"), int.from_bytes(header[0x3C:0x3E], "little")
    return path.stat().st_size >= offset + entry_size * entries


def check(kernels: Kernels) -> float:
    """The worst relative error of the library's int4 and int8 products against their references over a few shapes,
    groups and row counts. (The attention and the norm are checked by their own probes, so that one of them failing
    turns off only itself.)"""
    from . import quant  # quant imports this module

    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for rows, cols, group in ((16, 256, 64), (24, 384, 128)):
        w = torch.randn(rows, cols, generator=gen)
        q4 = quant.quantize_int4(w, group)
        q8 = quant.quantize_int8(w)
        packed, scales, zeros = tile_int4(q4.packed.clone(), q4.scales, q4.zeros)
        qweight = tile_int8(q8.qweight.clone())
        for m in (1, 5, 11):  # one pass, remainders
            x = torch.randn(m, cols, generator=gen)
            for dtype in (torch.float32, torch.bfloat16):
                xd = x.to(dtype)
                ref4 = quantize_activations(xd) @ quant.dequantize_int4(q4).T
                ref8 = quantize_activations(xd) @ quant.dequantize_int8(q8).T
                got4 = kernels.int4_linear(xd, packed, scales, zeros, group).float()
                got8 = kernels.int8_linear(xd, qweight, q8.scale).float()
                # bf16 outputs round to 2^-9; float32 ones agree to float summation order
                for got, ref in ((got4, ref4), (got8, ref8)):
                    worst = max(worst, float((got - ref).norm() / ref.norm()))
    return worst


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What Kernels.rms_norm computes, by PyTorch's operators (qwen2.RMSNorm's own way)."""
    return weight * torch.nn.functional.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """What Kernels.silu_mul computes, by PyTorch's operators (qwen2.MLP's own way)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _check_silu_mul(kernels: Kernels, gen: torch.Generator) -> float:
    """The worst relative error of silu_mul against its reference over a few row counts and widths."""
    worst = 0.0
    for rows, inner in ((1, 64), (3, 100), (20, 72)):  # one row, a tail past the vectors, the threaded path
        gate_up = (torch.randn(rows, 2 * inner, generator=gen) * 4).bfloat16()
        ref = silu_mul_reference(gate_up).float()
        worst = max(worst, float((kernels.silu_mul(gate_up).float() - ref).norm() / ref.norm()))
    return worst


def _check_add(kernels: Kernels, gen: torch.Generator) -> float:
    """0.0 where add_ (residual sums and biases) gives torch's add_'s bits over a few row counts, widths and
    magnitudes apart, else 1.0: the kernel is meant to match them exactly."""
    for rows, n, bias in ((1, 64, False), (3, 200, False), (70, 136, True)):  # one row, a tail, a bias
        y = (torch.randn(rows, n, generator=gen) * 10.0 ** torch.randint(-4, 5, (rows, n), generator=gen)).bfloat16()
        b = (torch.randn(n if bias else rows * n, generator=gen) * 3).bfloat16().reshape(-1 if bias else rows, n)
        if not torch.equal(kernels.add_(y.clone(), b[0] if bias else b), y.add_(b[0] if bias else b)):
            return 1.0
    return 0.0


def _check_norm(kernels: Kernels, gen: torch.Generator) -> float:
    """The worst relative error of rms_norm against its reference over a few row counts and widths."""
    worst = 0.0
    for rows, n in ((1, 64), (5, 200), (70, 136)):  # one row, a tail past the vectors, the threaded path
        x = (torch.randn(rows, n, generator=gen) * 3).bfloat16()
        w = torch.randn(n, generator=gen).bfloat16()
        ref = rms_norm_reference(x, w, 1e-6).float()
        worst = max(worst, float((kernels.rms_norm(x, w, 1e-6).float() - ref).norm() / ref.norm()))
    return worst


def bf16_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What Kernels.bf16_linear computes: the product in float32, rounded to bfloat16 once."""
    return torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float()).bfloat16()


def check_bf16_linear(kernels: Kernels, gen: torch.Generator) -> float:
    """The worst relative error of bf16_linear against its reference over a few shapes: one row and several, a
    width past the vectors, with and without a bias, more rows than one pass takes."""
    worst = 0.0
    for rows, k, n, bias in ((1, 64, 24, False), (3, 100, 40, True), (kernels.bf16_rows_per_pass + 3, 96, 16, True)):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        w = (torch.randn(n, k, generator=gen) * k ** -0.5).bfloat16()
        b = torch.randn(n, generator=gen).bfloat16() if bias else None
        ref = bf16_linear_reference(x, w, b).float()
        worst = max(worst, float((kernels.bf16_linear(x, w, b).float() - ref).norm() / ref.norm()))
    return worst


def decode_attention_reference(qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, heads: int,
                               kv_heads: int, scale: float) -> torch.Tensor:
    """What Kernels.decode_attention computes for one sequence, in float32 by SDPA: qkv [(heads + 2 kv_heads) * D]
    its new row, keys and values [kv_heads, T, D] every position up to and including the new one -> [heads * D]."""
    d = keys.shape[-1]
    q = qkv[:heads * d].float().view(1, kv_heads, heads // kv_heads, d)  # query heads grouped by their KV head
    out = torch.nn.functional.scaled_dot_product_attention(q, keys.float()[None], values.float()[None], scale=scale)
    return out.reshape(-1)


def _check_attention(kernels: Kernels, gen: torch.Generator) -> float:
    """The worst relative error of decode_attention against its reference, and a wrong store counted as 1."""
    worst = 0.0
    for heads, kv_heads, d, positions in ((4, 2, 64, (0, 9, 40)), (6, 1, 24, (17, 3, 8))):
        width = (heads + 2 * kv_heads) * d
        qkv = torch.randn(len(positions) + 1, width, generator=gen).bfloat16()  # row 0 left out: rows 1, 2, 3
        slots = [torch.randn(2, 1, kv_heads, p + 5, d, generator=gen).bfloat16() for p in positions]
        before = [slot.clone() for slot in slots]
        out = torch.zeros(len(positions) + 1, heads * d, dtype=torch.bfloat16)
        cos, sin = (torch.randn(len(positions) + 1, 1, d, generator=gen).bfloat16() for _ in range(2))
        kernels.decode_attention(qkv, out, [1, 2, 3], slots, positions, heads, kv_heads, d ** -0.5, (cos, sin))
        qkv = qkv.clone()
        rotate_(qkv.view(len(positions) + 1, heads + 2 * kv_heads, d)[:, :heads + kv_heads], cos, sin)
        for i, (slot, p) in enumerate(zip(before, positions)):
            slot[:, 0, :, p] = qkv[i + 1, heads * d:].view(2, kv_heads, d)
            if not torch.equal(slots[i], slot):
                return 1.0
            ref = decode_attention_reference(qkv[i + 1], slot[0, 0, :, :p + 1], slot[1, 0, :, :p + 1], heads,
                                             kv_heads, d ** -0.5)
            worst = max(worst, float((out[i + 1].float() - ref).norm() / ref.norm()))
        if out[0].any():
            return 1.0
    return worst


def load(compiler: Compiler, march: str = "native") -> Kernels:
    """The library (SOURCES) built for `march` (a -march name, or PLAIN_MARCH) by `compiler` (or found in the
    cache) and loaded; unchecked. Raises OSError or RuntimeError where that fails."""
    sources = {name: resources.files(__package__).joinpath(name).read_bytes() for name in SOURCES}
    path = _build(sources, compiler, march)
    try:
        lib = ctypes.CDLL(str(path))
    finally:
        if _is_private(path):
            shutil.rmtree(path.parent, ignore_errors=True)  # loaded: the mapping outlives the file
    found = (lib.tc_qdot_abi(), lib.tc_attention_abi(), lib.tc_norm_abi(), lib.tc_bf16dot_abi(), lib.tc_act_abi())
    expected = (ABI, ATTENTION_ABI, NORM_ABI, BF16DOT_ABI, ACT_ABI)
    if found != expected:
        raise RuntimeError(f"{path} has ABIs {found}, expected {expected}")
    return Kernels(lib, path)


@functools.lru_cache(maxsize=None)
def kernels() -> Kernels | None:
    """The native kernels of this machine, built and checked once per process, or None (logged once) where they
    cannot be: turned off, not x86-64, a CPU without AVX2 and FMA, no C compiler, or a build that fails or
    disagrees both for this CPU and, tried after it where the CPU's flags list them, for AVX2 and FMA alone (one
    warning either way)."""
    if os.environ.get("TC_NATIVE_KERNELS", "1") == "0":
        log.info("native kernels: off (TC_NATIVE_KERNELS=0); using PyTorch's")
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        log.info("native kernels: none for %s; using PyTorch's", platform.machine())
        return None
    flags = cpu_flags()
    missing = [flag for flag in NEEDED_CPU_FLAGS if flags is not None and flag not in flags]
    if missing:  # every source's #error would say so, after a compile at every start
        log.info("native kernels: this CPU has no %s; using PyTorch's", " or ".join(missing))
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("native kernels: no C compiler found (set CC, or install gcc); using PyTorch's, at about half "
                    "the quantized decode speed")
        return None
    failures = []  # what each build tried said
    # The AVX2-only build runs AVX2 code whatever the CPU: tried only where the CPU's flags said it has AVX2 and FMA
    # (where they cannot be read, the native build's #error is the only check, and its failure is final).
    for march in ("native", PLAIN_MARCH) if flags is not None else ("native",):
        try:
            loaded = load(compiler, march)
            err = check(loaded)
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
            failures.append(f"{_target(march)}: {exc}")
            continue
        if err <= 1e-2:
            break
        failures.append(f"{_target(march)}: disagrees with the reference (relative error {err:.1e})")
    else:
        log.warning("native kernels: unavailable (%s); using PyTorch's, at about half the decode speed",
                    "; ".join(failures))
        return None
    if failures:  # a compiler or assembler older than the CPU, say: what the CPU has beyond AVX2 goes unused
        log.warning("native kernels: the build for this CPU failed (%s); built for AVX2 and FMA alone instead",
                    failures[0])
    log.info("native kernels: built (%s, %d rows per pass, relative error %.1e)", loaded.path.name,
             loaded.rows_per_pass, err)
    return loaded


# -------------------------------------------------------------------------------------------------- probes


# Whether each small kernel agrees with its reference here, checked once per process: all a decode plan asks
# (decode_plan.py), where the alternative to a kernel is not one PyTorch operator but the whole step through the
# modules; the probes below also time it against that operator, for the modules' own choice.
@functools.lru_cache(maxsize=None)
def norm_agrees() -> bool:
    native = kernels()
    return native is not None and agrees("RMS norm", _check_norm(native, torch.Generator().manual_seed(1)))


@functools.lru_cache(maxsize=None)
def silu_mul_agrees() -> bool:
    native = kernels()
    return native is not None and agrees("gated activation",
                                         _check_silu_mul(native, torch.Generator().manual_seed(1)))


@functools.lru_cache(maxsize=None)
def add_agrees() -> bool:
    native = kernels()
    return native is not None and agrees("bf16 sum", _check_add(native, torch.Generator().manual_seed(1)))


def sum_call(y: torch.Tensor, b: torch.Tensor) -> Call | None:
    """y += b as the native sum's call (Kernels.add_call) where the kernels are here, give add_'s bits, and take
    these operands; None elsewhere, for the caller's PyTorch sum."""
    native = kernels()
    if native is None or not add_agrees():
        return None
    try:
        return native.add_call(y, b)
    except ValueError:  # operands it cannot read
        return None


@functools.lru_cache(maxsize=None)
def attention_agrees() -> bool:
    native = kernels()
    return native is not None and agrees("decode attention",
                                         _check_attention(native, torch.Generator().manual_seed(1)))


@functools.lru_cache(maxsize=None)
def norm_faster_than_torch() -> bool:
    """Whether the native RMS norm agrees with its reference and beats PyTorch's operators (rms_norm_reference) by
    MIN_GAIN on this CPU, timed once per process on one thread for a decode row and a prefill-sized block of rows."""
    native = kernels()
    if not norm_agrees():
        return False
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1024, generator=gen).bfloat16()
    times = []
    for rows in (1, 256):
        x = torch.randn(rows, 1024, generator=gen).bfloat16()
        with one_thread():
            times.append(race([lambda: native.rms_norm(x, w, 1e-6), lambda: rms_norm_reference(x, w, 1e-6)], 5))
    gain = min(theirs / ours for ours, theirs in times)
    log.info("native RMS norm: %.1f / %.0f us for 1 / 256 rows, PyTorch's %.1f / %.0f us: %s", times[0][0] * 1e6,
             times[1][0] * 1e6, times[0][1] * 1e6, times[1][1] * 1e6, "native" if gain >= MIN_GAIN else "PyTorch's")
    return gain >= MIN_GAIN


@functools.lru_cache(maxsize=None)
def silu_mul_faster_than_torch() -> bool:
    """Whether the native gated activation agrees with its reference, beats PyTorch's operators
    (silu_mul_reference) by MIN_GAIN for one decode row and loses by no more than BATCH_SLACK for ACT_ROWS rows (a
    batch's step), on this CPU: timed once per process on one thread, each call after the caches were swept as a
    step's weights sweep them. In a hot loop the two are about even for one row; in a step the native call saved
    ~20 us a layer (PyTorch's three operators find their code and data gone from the caches, one call finds less),
    and a sweep shows it: 104-147 us against 129-176 for one row, 176-195 against 206-219 for 16."""
    native = kernels()
    if not silu_mul_agrees():
        return False
    gen = torch.Generator().manual_seed(0)
    times, sweep = [], cache_sweeper()
    for rows in (1, ACT_ROWS):
        gate_up = torch.randn(rows, 2 * 2048, generator=gen).bfloat16()
        with one_thread():
            times.append(race([lambda: native.silu_mul(gate_up), lambda: silu_mul_reference(gate_up)], 5,
                              before=sweep))
    (one_ours, one_theirs), (many_ours, many_theirs) = times
    chosen = one_theirs >= MIN_GAIN * one_ours and many_ours <= BATCH_SLACK * many_theirs
    log.info("native gated activation: %.1f / %.1f us for 1 / %d rows, PyTorch's %.1f / %.1f us: %s",
             one_ours * 1e6, many_ours * 1e6, ACT_ROWS, one_theirs * 1e6, many_theirs * 1e6,
             "native" if chosen else "PyTorch's")
    return chosen


@functools.lru_cache(maxsize=None)
def one_row_prefetch(kind: str) -> int:
    """The fewest activation rows from which this CPU's `kind` ("bf16", "int8" or "int4") products prefetch their
    weights (qdot.c, bf16dot.c), and how far ahead, settled once per process and set on kernels(): 1 where one
    decode row is PREFETCH_GAIN faster with the prefetch (PREFETCH_AHEAD[kind] or FAR_AHEAD bytes ahead, whichever
    is faster), else PREFETCH_ROWS[kind] (and PREFETCH_AHEAD[kind] for those passes). The same turns also time
    each thread walking its rows as 2, 4 or 8 streams (`Kernels.streams`: bf16dot.c's dot_streams, qdot.c's tile
    streams), which the fastest setting keeps where it is PREFETCH_GAIN faster than one stream left to the hardware.

    Machines differ here, so it is measured, as a step runs it: one row of the demo model's down projection
    ([896, 4864], where a stage's gain concentrates) on the process's threads, its weights streamed from memory
    (copies twice the last-level cache in turn), the settings taking turns and the best turn of each kept (wall
    time: the threads' waits on memory are the point). On a 2-core Zen 4 EPYC an int4 row took 103-145 us with the
    prefetch against 111-186 without (12 demo int4 layers stepped in 6.5-8.5 ms against 6.8-9.3) while an int8 row
    lost a little with it; on a 2-core Sapphire Rapids VM every kind gained 15-30%, and more again from farther
    ahead: one row of [9728, 896] streamed at 16.1 GB/s in bf16 and 14.8 in int4 with FAR_AHEAD against 13.8 and
    12.7 with the nearer prefetch (every demo shape, and 4 rows, gained 5-30% or held). The result does not change.
    On a busy machine the turns stop at PREFETCH_BUDGET_S (the log says so): a choice from fewer turns.
    """
    native = kernels()
    if native is None:
        return PREFETCH_ROWS[kind]
    n, k, group = 896, 4864, 128
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(0)).bfloat16()
    if kind == "bf16":
        weight = torch.full((n, k), 0.01, dtype=torch.bfloat16)  # written: no zero pages

        def run(w: torch.Tensor) -> object:
            return native.bf16_product(x, w, None)
    elif kind == "int8":
        weight = torch.full((n // TILE_ROWS, k // 4, TILE_ROWS, 4), 0x35, dtype=torch.int8)
        scale = torch.full((n,), 0.01)

        def run(w: torch.Tensor) -> object:
            return native.int8_product(x, w, scale, None)
    elif kind == "int4":
        weight = torch.full((n // TILE_ROWS, k // 8, TILE_ROWS, 4), 0x5A, dtype=torch.uint8)
        scales = torch.full((n // TILE_ROWS, k // group, TILE_ROWS), 0.01, dtype=torch.bfloat16)
        zeros = torch.zeros_like(scales)

        def run(w: torch.Tensor) -> object:
            return native.int4_product(x, w, scales, zeros, group, None)
    else:
        raise ValueError(f"no product of kind {kind!r}: bf16, int8 or int4")
    nbytes = weight.numel() * weight.element_size()
    weights = [weight.clone() for _ in range(min(2 * cache_bytes(3), PREFETCH_PROBE_BYTES) // nbytes + 1)]
    default = (PREFETCH_ROWS[kind], PREFETCH_AHEAD[kind], 1)  # one row left to the hardware's prefetch, one stream
    settings = [default, (1, PREFETCH_AHEAD[kind], 1), (1, FAR_AHEAD, 1)]
    settings += [(rows, ahead, streams) for streams in STREAMS[1:] for rows, ahead, _ in settings]
    best = dict.fromkeys(settings, float("inf"))
    probe_started = time.perf_counter()
    with probe_lock():  # wall time, as race's: no other tc process on the machine probes meanwhile
        for turns in range(1, PREFETCH_TURNS + 1):
            for setting in best:
                _set_one_row(native, kind, setting)
                started = time.perf_counter()
                for w in weights:
                    run(w)
                best[setting] = min(best[setting], (time.perf_counter() - started) / len(weights))
            if turns >= PREFETCH_MIN_TURNS and time.perf_counter() - probe_started > PREFETCH_BUDGET_S:
                break  # a busy machine
    fastest = min(best, key=best.__getitem__)
    chosen = fastest if best[default] >= PREFETCH_GAIN * best[fastest] else default
    _set_one_row(native, kind, chosen)
    cut = (f" (the best of {turns} of {PREFETCH_TURNS} turns: the machine is busy, the turns took "
           f"{time.perf_counter() - probe_started:.1f} s)" if turns < PREFETCH_TURNS else "")
    log.info("native %s product, one row from memory (us): %s; chose %s%s", kind,
             ", ".join(f"{_one_row_setting(setting)} {seconds * 1e6:.0f}" for setting, seconds in best.items()),
             _one_row_setting(chosen), cut)
    return chosen[0]


def _set_one_row(native: Kernels, kind: str, setting: tuple[int, int, int]) -> None:
    native.prefetch_rows[kind], native.prefetch_ahead[kind], native.streams[kind] = setting


def _one_row_setting(setting: tuple[int, int, int]) -> str:
    rows, ahead, streams = setting
    prefetch = f"prefetched {ahead} bytes ahead" if rows == 1 else "the hardware's prefetch"
    return prefetch + (f", {streams} streams a thread" if streams > 1 else "")


def agrees(what: str, err: float) -> bool:
    """Whether a kernel's check passed (logged where it did not: the kernel is then not used)."""
    if err > 1e-2:
        log.warning("native %s: disagrees with its reference (relative error %.1e); using PyTorch's", what, err)
        return False
    return True


@functools.lru_cache(maxsize=None)
def attention_faster_than_torch() -> bool:
    """Whether the native decode attention agrees with its reference and beats one SDPA call per sequence
    (qwen2.Attention's own way) by MIN_GAIN on this CPU, timed once per process on one thread for 4 sequences of
    128 positions."""
    native = kernels()
    if not attention_agrees():
        return False
    heads, kv_heads, d, n, position = 14, 2, 64, 4, 128
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen).bfloat16()
    slots = [torch.randn(2, 1, kv_heads, position + 1, d, generator=gen).bfloat16() for _ in range(n)]
    out = torch.empty(n, heads * d, dtype=torch.bfloat16)

    def ours() -> None:
        native.decode_attention(qkv, out, range(n), slots, [position] * n, heads, kv_heads, d ** -0.5)

    def theirs() -> None:
        for i, slot in enumerate(slots):
            slot[:, :, :, position] = qkv[i, heads * d:].view(2, 1, kv_heads, d)
            q = qkv[i, :heads * d].view(1, kv_heads, heads // kv_heads, d)
            torch.nn.functional.scaled_dot_product_attention(q, slot[0, :, :, :position + 1],
                                                             slot[1, :, :, :position + 1])

    with one_thread():
        ours_s, theirs_s = race([ours, theirs], 5)
    log.info("native decode attention: %.0f us for %d sequences, PyTorch's SDPA %.0f us: %s", ours_s * 1e6, n,
             theirs_s * 1e6, "native" if theirs_s >= MIN_GAIN * ours_s else "PyTorch's")
    return theirs_s >= MIN_GAIN * ours_s


@functools.lru_cache(maxsize=None)
def faster_than_torch(mode: str) -> bool:
    """Whether the native `mode` ("int4" or "int8") product beats PyTorch's packed kernel on this CPU by MIN_GAIN,
    timed once per process on one thread for one decode row and for 8 rows (a batch) on a 4096 x 1024 weight.
    Where PyTorch has no kernel for the mode, the native one is taken."""
    from . import quant

    native = kernels()
    if native is None:
        return False
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 1024, generator=gen)
    if mode == "int4":
        torch_kernel = quant.int4_kernel_available("cpu")
        if torch_kernel is None:
            return True
        q4 = quant.quantize_int4(w, quant.DEFAULT_GROUP_SIZE)
        try:
            kpacked = torch_kernel.pack(q4.packed)
        except RuntimeError:  # PyTorch's packer refuses what its probe took: nothing to compare with
            return True
        sz = quant._scales_and_zeros(q4.scales, q4.zeros)
        theirs = lambda x: torch_kernel.mm(x, kpacked, q4.group_size, sz)  # noqa: E731
        packed, scales, zeros = tile_int4(q4.packed.clone(), q4.scales, q4.zeros)
        ours = lambda x: native.int4_linear(x, packed, scales, zeros, q4.group_size)  # noqa: E731
    else:
        if not quant.int8_kernel_available("cpu"):
            return True
        q8 = quant.quantize_int8(w)
        qweight = tile_int8(q8.qweight.clone())
        ours = lambda x: native.int8_linear(x, qweight, q8.scale)  # noqa: E731
        theirs = lambda x: quant._int8_kernel(x, q8.qweight, q8.scale)  # noqa: E731
    times = []
    for rows in (1, 8):
        x = torch.randn(rows, 1024, generator=gen).bfloat16()
        with one_thread():
            times.append(race([lambda: ours(x), lambda: theirs(x)], 5))
    gain = min(theirs_s / ours_s for ours_s, theirs_s in times)
    log.info("native %s kernel: %.0f / %.0f us for 1 / 8 rows, PyTorch's %.0f / %.0f us: %s", mode,
             times[0][0] * 1e6, times[1][0] * 1e6, times[0][1] * 1e6, times[1][1] * 1e6,
             "native" if gain >= MIN_GAIN else "PyTorch's")
    return gain >= MIN_GAIN

