"""The run-time-built native kernels (int4/int8 and bf16 products, decode attention, RMS norm): against their
references, their layouts, their fallbacks."""
from __future__ import annotations

import ctypes
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from tc.model import native, quant
from tc.model.quant import Int4Linear, Int8Linear, quantize_int4, quantize_int8, quantized_nbytes

KERNELS = native.kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no native kernels on this machine (see the log)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen) * 0.02 + 0.001 * torch.arange(cols) / cols  # not centred


def activations(rows: int, cols: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(rows, cols, generator=gen)
    x[:, 3] *= 40  # an outlier channel, as real hidden states have
    if rows > 1:
        x[1, :] = 0  # a row of zeros: its scale is zero
    return x.to(dtype)


def relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 16, 65, 130])  # one pass, remainders, past an activation block
@pytest.mark.parametrize("group", [32, 64, 128, 384])
def test_int4_equals_its_reference(rows, group):
    w = weights(48, 384, rows)
    q = quantize_int4(w, group)
    packed, scales, zeros = native.tile_int4(q.packed.clone(), q.scales, q.zeros)
    for dtype in (torch.float32, torch.bfloat16):
        x = activations(rows, 384, rows, dtype)
        ref = native.quantize_activations(x).double() @ quant.dequantize_int4(q).double().T
        got = KERNELS.int4_linear(x, packed, scales, zeros, group)
        assert got.dtype == dtype and got.shape == (rows, 48)
        # float32: float summation order only; bfloat16: one rounding of the output (2^-9 relative)
        assert relative(got, ref) < (1e-6 if dtype == torch.float32 else 4e-3)
        # against unquantized activations: int8 rounding, coarser in the block of the 40x outlier channel
        exact = x.double() @ quant.dequantize_int4(q).double().T
        assert relative(got, exact) < 2e-2


@needs_kernels
@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_where_a_product_prefetches_changes_no_bit_and_the_probe_settles_it(kind):
    """Where a pass starts prefetching its weights, and how far ahead, is a matter of speed alone: every setting
    gives the same bits, for one row, a few and more than a pass holds, and the probe leaves the library on the
    setting it chose."""
    w = weights(4096, 384, 5)
    if kind == "bf16":
        weight = w.bfloat16()
        product = lambda x: KERNELS.bf16_product(x, weight, None)  # noqa: E731
    elif kind == "int8":
        q8 = quantize_int8(w)
        qweight = native.tile_int8(q8.qweight.clone())
        product = lambda x: KERNELS.int8_product(x, qweight, q8.scale, None)  # noqa: E731
    else:
        q4 = quantize_int4(w, 128)
        packed, scales, zeros = native.tile_int4(q4.packed.clone(), q4.scales, q4.zeros)
        product = lambda x: KERNELS.int4_product(x, packed, scales, zeros, 128, None)  # noqa: E731
    kept, kept_ahead, kept_streams = dict(KERNELS.prefetch_rows), dict(KERNELS.prefetch_ahead), dict(KERNELS.streams)
    try:
        for rows in (1, 2, 9):
            x = activations(rows, 384, rows, torch.bfloat16)
            outputs = []
            for rows_from in (1, 2, 3, 9):
                for ahead in (native.PREFETCH_AHEAD[kind], native.FAR_AHEAD, 64):
                    for streams in native.STREAMS:
                        KERNELS.prefetch_rows[kind], KERNELS.prefetch_ahead[kind] = rows_from, ahead
                        KERNELS.streams[kind] = streams
                        outputs.append(product(x))
            assert all(torch.equal(outputs[0], out) for out in outputs[1:]), rows
    finally:
        KERNELS.prefetch_rows.update(kept)
        KERNELS.prefetch_ahead.update(kept_ahead)
        KERNELS.streams.update(kept_streams)
    chosen = native.one_row_prefetch(kind)
    assert chosen in (1, native.PREFETCH_ROWS[kind]) and KERNELS.prefetch_rows[kind] == chosen
    ahead = KERNELS.prefetch_ahead[kind]
    assert ahead in ((native.PREFETCH_AHEAD[kind], native.FAR_AHEAD) if chosen == 1 else (native.PREFETCH_AHEAD[kind],))
    assert sorted(KERNELS.streams) == ["bf16", "int4", "int8"] and set(KERNELS.streams.values()) <= set(native.STREAMS)


@needs_kernels
def test_the_prefetch_probe_on_a_busy_machine_stops_at_its_budget_and_says_so(monkeypatch, caplog):
    """A budget spent (0 s here, as a machine whose cores are busy spends 2 s) ends the probe's turns after
    PREFETCH_MIN_TURNS, and its choice is one of the settings, logged as made from fewer turns."""
    monkeypatch.setattr(native, "PREFETCH_BUDGET_S", 0.0)
    kept = dict(KERNELS.prefetch_rows), dict(KERNELS.prefetch_ahead), dict(KERNELS.streams)
    try:
        with caplog.at_level(logging.INFO, logger=native.log.name):
            chosen = native.one_row_prefetch.__wrapped__("int4")  # the process's own choice stays cached
    finally:
        for setting, value in zip((KERNELS.prefetch_rows, KERNELS.prefetch_ahead, KERNELS.streams), kept):
            setting.update(value)
    assert chosen in (1, native.PREFETCH_ROWS["int4"])
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("native int4 product, one row")]
    assert len(said) == 1 and f"(the best of {native.PREFETCH_MIN_TURNS} of {native.PREFETCH_TURNS} turns: the " \
        "machine is busy, the turns took" in said[0], said


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("out_rows", [8, 16, 24, 40, 72, 136])  # tiles: too few for streams, with some past them
@pytest.mark.parametrize("cols", [128, 384, 4864])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_quantized_row_in_several_streams_a_thread_gives_the_same_bits(kind, out_rows, cols, threads):
    w = weights(out_rows, cols, out_rows + cols)
    if kind == "int8":
        q = quantize_int8(w)
        qweight = native.tile_int8(q.qweight.clone())
        product = lambda x: KERNELS.int8_linear(x, qweight, q.scale)  # noqa: E731
        dequantized = quant.dequantize_int8(q)
    else:
        q = quantize_int4(w, 128)
        packed, scales, zeros = native.tile_int4(q.packed.clone(), q.scales, q.zeros)
        product = lambda x: KERNELS.int4_linear(x, packed, scales, zeros, 128)  # noqa: E731
        dequantized = quant.dequantize_int4(q)
    kept, kept_threads = dict(KERNELS.streams), torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        outputs = {}
        for streams in native.STREAMS:
            KERNELS.streams[kind] = streams
            outputs[streams] = [product(activations(1, cols, cols, dtype)) for dtype in (torch.float32, torch.bfloat16)]
    finally:
        KERNELS.streams.update(kept)
        torch.set_num_threads(kept_threads)
    for streams in native.STREAMS[1:]:
        assert all(torch.equal(one, many) for one, many in zip(outputs[1], outputs[streams])), streams
    ref = native.quantize_activations(activations(1, cols, cols, torch.float32)).double() @ dequantized.double().T
    assert relative(outputs[8][0], ref) < 1e-6


@needs_kernels
@pytest.mark.parametrize("out_rows", [1, 2, 3, 5, 9, 17, 72, 75])  # shares too small for streams, with rows past them
@pytest.mark.parametrize("cols", [64, 200, 896])  # whole vectors, a tail past them
@pytest.mark.parametrize("threads", [1, 2])
def test_one_bf16_row_in_several_streams_a_thread_gives_the_same_bits(out_rows, cols, threads):
    gen = torch.Generator().manual_seed(out_rows * cols)
    x = torch.randn(1, cols, generator=gen).bfloat16()
    w = (torch.randn(out_rows, cols, generator=gen) * cols ** -0.5).bfloat16()
    b = torch.randn(out_rows, generator=gen).bfloat16()
    kept, kept_threads = dict(KERNELS.streams), torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        outputs = {}
        for streams in native.STREAMS:
            KERNELS.streams["bf16"] = streams
            outputs[streams] = [KERNELS.bf16_linear(x, w, bias) for bias in (None, b)]
    finally:
        KERNELS.streams.update(kept)
        torch.set_num_threads(kept_threads)
    for streams in native.STREAMS[1:]:
        assert all(torch.equal(one, many) for one, many in zip(outputs[1], outputs[streams])), streams
    assert relative(outputs[8][1], native.bf16_linear_reference(x, w, b)) < 4e-3


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 8, 11, 70])
@pytest.mark.parametrize("cols", [384, 160, 896])
def test_int8_equals_its_reference(rows, cols):
    w = weights(40, cols, cols)
    q = quantize_int8(w)
    qweight = native.tile_int8(q.qweight.clone())
    for dtype in (torch.float32, torch.bfloat16):
        x = activations(rows, cols, rows, dtype)
        ref = native.quantize_activations(x).double() @ quant.dequantize_int8(q).double().T
        got = KERNELS.int8_linear(x, qweight, q.scale)
        assert relative(got, ref) < (1e-6 if dtype == torch.float32 else 4e-3)


@needs_kernels
@pytest.mark.parametrize("build", ["native", native.PLAIN_MARCH])  # AVX2 alone: no VNNI, its int4 sums use int16
@pytest.mark.parametrize("rows", [1, 4, 5])  # one row (in streams too), four (a whole pass on AVX2), five
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int4_sums_at_their_largest_stay_exact(build, rows, sign):
    # every code 15 (weight 7 with scale 1, zero 0) against activations that quantize to +-127 in every column:
    # the largest sums an activation block can make, which must not wrap or saturate however they are added up
    kernels = KERNELS if build == "native" else native.load(native._compiler(), build)
    out_rows, cols = 136, 4864
    q = quant.Int4Weight(packed=torch.full((out_rows, cols // 2), 0xFF, dtype=torch.uint8),
                         scales=torch.ones(out_rows, cols // 128, dtype=torch.bfloat16),
                         zeros=torch.zeros(out_rows, cols // 128, dtype=torch.bfloat16), shape=(out_rows, cols),
                         group_size=128)
    assert torch.equal(quant.dequantize_int4(q), torch.full((out_rows, cols), 7.0))
    packed, scales, zeros = native.tile_int4(q.packed.clone(), q.scales, q.zeros)
    x = torch.full((rows, cols), sign, dtype=torch.float32)
    chosen = kernels.streams["int4"]
    try:
        for streams in native.STREAMS if rows == 1 else (1,):
            kernels.streams["int4"] = streams
            got = kernels.int4_linear(x, packed, scales, zeros, 128)
            assert relative(got, torch.full((rows, out_rows), 7.0 * cols * sign)) < 1e-6
    finally:
        kernels.streams["int4"] = chosen


# The builds of CPUs other than this one that it can run: AVX2 and FMA alone (no VNNI nor AVX-512: vpmaddubsw, 4
# rows per pass), and AVX-512 without VNNI or BF16 (Skylake-SP: 8 rows per pass, int16 sums, FMA bf16 products).
# Not haswell's set for the first: a virtual CPU may list AVX2 and FMA without the BMI2 that haswell adds.
OTHER_BUILDS = [(native.PLAIN_MARCH, 4, ()),
                ("skylake-avx512", 8, ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "bmi2"))]


@needs_kernels
@pytest.mark.parametrize("march, rows_per_pass, needs", OTHER_BUILDS, ids=[b[0] for b in OTHER_BUILDS])
def test_the_builds_of_other_cpus_agree_too(march, rows_per_pass, needs):
    missing = [flag for flag in needs if flag not in (native.cpu_flags() or ())]
    if missing:
        pytest.skip(f"this CPU cannot run the {march} build (no {', '.join(missing)})")
    built = native.load(native._compiler(), march)
    assert built.rows_per_pass == rows_per_pass
    assert native.check(built) < 1e-2
    gen = torch.Generator().manual_seed(0)
    assert native._check_attention(built, gen) < 1e-2 and native._check_norm(built, gen) < 1e-2
    assert native.check_bf16_linear(built, gen) < 1e-2  # bf16dot.c's FMA path: no AVX512-BF16 there
    x, w = torch.randn(8, 4864, generator=gen).bfloat16(), torch.randn(20, 4864, generator=gen).bfloat16()
    assert torch.equal(built.bf16_linear(x, w, None, tiled=True), built.bf16_linear(x, w, None, tiled=False))
    row, one_stream = x[:1], built.bf16_linear(x[:1], w, None)
    wq = torch.randn(136, 4864, generator=gen) * 0.02  # 17 tiles: streams of each count, and tiles past them
    q = quantize_int8(wq)
    qweight = native.tile_int8(q.qweight.clone())
    q4 = quantize_int4(wq, 128)
    packed, scales, zeros = native.tile_int4(q4.packed.clone(), q4.scales, q4.zeros)
    one_stream_int8 = built.int8_linear(row, qweight, q.scale)
    one_stream_int4 = built.int4_linear(row, packed, scales, zeros, 128)
    for streams in native.STREAMS[1:]:
        built.streams.update(bf16=streams, int8=streams, int4=streams)
        assert torch.equal(built.bf16_linear(row, w, None), one_stream)
        assert torch.equal(built.int8_linear(row, qweight, q.scale), one_stream_int8)
        assert torch.equal(built.int4_linear(row, packed, scales, zeros, 128), one_stream_int4)
    assert native._check_silu_mul(built, gen) < 1e-2 and native._check_add(built, gen) == 0.0


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17])  # a pass, remainders (5: the eight-row sum), several passes
@pytest.mark.parametrize("cols", [64, 96, 200, 896])  # whole vectors, a tail past them
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_product_rounds_the_float32_product_once(rows, cols, bias):
    gen = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=gen).bfloat16()
    w = (torch.randn(72, cols, generator=gen) * cols ** -0.5).bfloat16()
    b = torch.randn(72, generator=gen).bfloat16() if bias else None
    got = KERNELS.bf16_linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 72)
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    # each output is the exact product rounded once to bf16 (within one bf16 unit, where the float32 sum lies near a
    # tie), up to what any order of float32 additions may lose: cols * 2^-24 of the terms' magnitudes, which only
    # matters where the terms cancel
    ulp = exact.abs().clamp_min(1e-30).log2().floor().exp2() * 2 ** -7
    magnitude = torch.nn.functional.linear(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
    assert bool(((got.double() - exact).abs() <= 1.01 * ulp + cols * 2 ** -24 * magnitude).all())
    assert relative(got, native.bf16_linear_reference(x, w, b)) < 4e-3


@needs_kernels
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 8, 11])  # several rows (one row never tiles), a remainder pass
@pytest.mark.parametrize("out_rows", [72, 70, 3])  # whole tiles, two rows past them, no whole tile
@pytest.mark.parametrize("cols", [64, 200, 4864])  # whole vectors, a tail, activations that outgrow L1
def test_bf16_product_in_tiles_gives_the_same_bits(rows, out_rows, cols):
    gen = torch.Generator().manual_seed(rows * out_rows + cols)
    x = torch.randn(rows, cols, generator=gen).bfloat16()
    w = (torch.randn(out_rows, cols, generator=gen) * cols ** -0.5).bfloat16()
    b = torch.randn(out_rows, generator=gen).bfloat16()
    tiled = KERNELS.bf16_linear(x, w, b, tiled=True)
    assert torch.equal(tiled, KERNELS.bf16_linear(x, w, b, tiled=False))
    assert torch.equal(tiled, KERNELS.bf16_linear(x, w, b))  # whichever the size chooses
    assert relative(tiled, native.bf16_linear_reference(x, w, b)) < 4e-3


@needs_kernels
def test_bf16_product_refuses_a_weight_it_cannot_read():
    x = torch.randn(2, 64).bfloat16()
    for weight, bias in ((torch.randn(64, 40).bfloat16().t(), None),  # column-major
                         (torch.randn(40, 64).bfloat16(), torch.randn(40)),  # a float32 bias
                         (torch.randn(40, 32).bfloat16(), None)):  # another width
        with pytest.raises(ValueError, match="bf16_linear takes"):
            KERNELS.bf16_linear(x, weight, bias)


@needs_kernels
def test_bf16_product_reads_a_strided_input_and_leaves_it_alone():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 256, generator=gen).bfloat16()[:, ::2]  # [3, 128], every other column
    w = torch.randn(40, 128, generator=gen).bfloat16()
    before = x.clone()
    assert torch.equal(KERNELS.bf16_linear(x, w, None), KERNELS.bf16_linear(x.contiguous(), w, None))
    assert torch.equal(x, before)


def test_float32_layers_keep_their_activations_unquantized():
    lin = torch.nn.Linear(256, 64)  # float32: the reference dtype
    assert Int4Linear.from_linear(lin, 64).path != "native" and Int8Linear.from_linear(lin).path != "native"
    assert not quant.native_allowed(torch.float32) and quant.native_allowed(torch.bfloat16)
    assert quant.native_allowed(None)  # a layer told nothing of its activations


def test_shapes_the_kernels_take():
    assert native.shape_ok_int4(64, 256, 128) and native.shape_ok_int4(8, 96, 32)
    assert not native.shape_ok_int4(60, 256, 128)  # rows come in tiles of 8
    assert not native.shape_ok_int4(64, 96, 48)  # groups hold whole activation blocks of 32
    assert native.shape_ok_int8(8, 96) and not native.shape_ok_int8(8, 100) and not native.shape_ok_int8(12, 96)


def test_layouts_keep_every_code_and_take_the_same_bytes():
    w = weights(24, 256, 0)
    q4 = quantize_int4(w, 64)
    packed, scales, zeros = native.tile_int4(q4.packed.clone(), q4.scales, q4.zeros)
    assert packed.numel() == q4.packed.numel() and scales.numel() == q4.scales.numel()
    codes = quant.unpack_int4(q4.packed)  # [24, 256]
    tiled = packed.view(3, 256 // 8, 8, 4)  # (tile, column block, row, byte)
    for row, col in ((0, 0), (5, 4), (9, 130), (23, 255)):
        byte = int(tiled[row // 8, col // 8, row % 8, col % 4])
        assert (byte >> 4 if col % 8 >= 4 else byte & 0x0F) == int(codes[row, col])
    assert torch.equal(scales[1, 2], q4.scales[8:16, 2])
    tiled8 = native.tile_int8(quantize_int8(w).qweight.clone()).view(3, 256 // 4, 8, 4)  # (tile, block, row, byte)
    for row, col in ((0, 0), (5, 4), (9, 130), (23, 255)):
        assert int(tiled8[row // 8, col // 4, row % 8, col % 4]) == int(quantize_int8(w).qweight[row, col])


@needs_kernels
def test_rows_laid_back_out_are_the_reference_weights_bit_for_bit():
    """The dense prefill's weights: int4 rows dequantized exactly as quant.dequantize_int4 then converted to bf16
    (even where (code - 8) * scale + zero lands between two bf16 values), int8 rows their codes."""
    w = weights(48, 256, 3)
    w[5, :64] *= 1000.0  # a group far from the others, whose zero point and scale differ in magnitude
    for group in (32, 64, 128):
        q4 = quantize_int4(w, group)
        ref = quant.dequantize_int4(q4).to(torch.bfloat16)
        packed, scales, zeros = native.tile_int4(q4.packed.clone(), q4.scales, q4.zeros)
        assert torch.equal(KERNELS.int4_rows(packed, scales, zeros, group, 0, 48), ref)
        out = torch.full((16, 256), float("nan"), dtype=torch.bfloat16)
        assert KERNELS.int4_rows(packed, scales, zeros, group, 16, 32, out) is out and torch.equal(out, ref[16:32])
    q8 = quantize_int8(w)
    tiled8 = native.tile_int8(q8.qweight.clone())
    assert torch.equal(KERNELS.int8_rows(tiled8, 0, 48), q8.qweight.to(torch.bfloat16))
    assert torch.equal(KERNELS.int8_rows(tiled8, 40, 48), q8.qweight[40:48].to(torch.bfloat16))
    with pytest.raises(ValueError, match="multiples of 8"):
        KERNELS.int8_rows(tiled8, 0, 20)
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        KERNELS.int8_rows(tiled8, 0, 16, torch.empty(16, 256))
    # rows past the weight's last would be read past its buffers
    with pytest.raises(ValueError, match="past the weight's 48 rows"):
        KERNELS.int8_rows(tiled8, 40, 56)
    with pytest.raises(ValueError, match="past the weight's 48 rows"):
        KERNELS.int4_rows(packed, scales, zeros, 128, 0, 56)
    # a group size the scales were not made for would have the kernel read past them
    with pytest.raises(ValueError, match=r"scales and zeros must be \[6, 8, 8\] for group_size 32"):
        KERNELS.int4_rows(packed, scales, zeros, 32, 0, 48)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activations_as_the_products_see_them_are_the_reference_bit_for_bit(dtype):
    x = activations(40, 256, 5, dtype) * 3
    x[0, 3], x[1, :32] = 0, 0  # a block of zeros has no scale
    x[2, 40] = 500.0  # an outlier coarsens its own block
    assert torch.equal(KERNELS.quantized_activations(x), native.quantize_activations(x).to(torch.bfloat16))


def test_tiling_works_in_place_a_slab_at_a_time(monkeypatch):
    monkeypatch.setattr(native, "_SLAB_BYTES", 128 * 40)  # slabs of 40 rows of 128 bytes, the last one partial
    w = weights(96, 256, 1)
    in_slabs = native.tile_int4(quantize_int4(w, 64).packed.clone(), *(quantize_int4(w, 64).scales,) * 2)[0]
    monkeypatch.setattr(native, "_SLAB_BYTES", 1 << 20)
    given = quantize_int4(w, 64).packed
    at = given.data_ptr()
    at_once = native.tile_int4(given, *(quantize_int4(w, 64).scales,) * 2)[0]
    assert at_once.data_ptr() == at and torch.equal(at_once, in_slabs)


@needs_kernels
def test_layers_take_the_native_path_where_it_wins_and_keep_their_sizes():
    lin = torch.nn.Linear(384, 64, bias=True).bfloat16()
    for mode, layer in (("int4", Int4Linear.from_linear(lin, 128)), ("int8", Int8Linear.from_linear(lin))):
        if not native.faster_than_torch(mode):
            pytest.skip(f"PyTorch's {mode} kernel is as fast here")
        assert layer.path == "native" and not layer.uses_kernel
        held = sum(b.numel() * b.element_size() for name, b in layer.named_buffers() if name != "bias")
        assert held == quantized_nbytes((64, 384), mode, 128)
        x = torch.randn(5, 384).bfloat16()
        w = quant.dequantize_int4(quantize_int4(lin.weight.detach(), 128)) if mode == "int4" else \
            quant.dequantize_int8(quantize_int8(lin.weight.detach()))
        ref = x.float() @ w.T + lin.bias.detach().float()
        assert layer(x).dtype == torch.bfloat16 and relative(layer(x), ref) < 2e-2
        with pytest.raises(quant.QuantizationError, match="quantize it there"):
            layer.to("meta")


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_a_widened_int8_product_is_the_bf16_one_in_float32(rows):
    """The head's logits: the kernel writes the bfloat16 values widened, bit for bit what converting after gives."""
    w = weights(4096, 384, rows)
    q8 = quantize_int8(w)
    qweight = native.tile_int8(q8.qweight.clone())
    x = activations(rows, 384, rows, torch.bfloat16)
    x[0, 5] = 300.0  # products far from 1, where the bfloat16 rounding leaves most of the float32 bits
    widened = KERNELS.int8_product(x, qweight, q8.scale, None, widened=True)
    assert widened.dtype == torch.float32
    assert torch.equal(widened, KERNELS.int8_product(x, qweight, q8.scale, None).float())
    with pytest.raises(ValueError, match="no bias"):
        KERNELS.int8_product(x, qweight, q8.scale, torch.ones(4096, dtype=torch.bfloat16), widened=True)
    for bias in (False, True):  # the layer's: the kernel's float32 where forward takes it, forward's widened else
        layer = Int8Linear.from_linear(torch.nn.Linear(384, 4096, bias=bias).bfloat16())
        for batch in (x, x.unsqueeze(0), x.float()):
            assert torch.equal(layer.widened(batch), layer(batch).float())


def native_int4_layer(lin: torch.nn.Linear, dense_prefill: bool) -> Int4Linear:
    return Int4Linear(quantize_int4(lin.weight.detach(), 64), lin.bias, compute_dtype=torch.bfloat16,
                      dense_prefill=dense_prefill)


@needs_kernels
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_prefill_rows_take_the_path_the_probe_chose(mode, monkeypatch):
    """From NATIVE_DENSE_MIN_ROWS rows, a layer the probe sent dense multiplies its weights laid back out in bf16 by
    the activations as the native product sees them (quantized per 32 columns and back): F.linear's bits against
    both (int8: then the row scales), and the native product's values up to the last bits, so a decode row comes
    out the same beside a prompt's rows as alone; fewer rows, or the other choice, stay native."""
    lin = torch.nn.Linear(256, 64, bias=True).bfloat16()
    bias = lin.bias.detach()
    if mode == "int8":
        dense, natively = (Int8Linear.from_linear(lin, dense_prefill=d) for d in (True, False))
        q8 = quantize_int8(lin.weight.detach())
        product = lambda x: F.linear(x, q8.qweight.to(x.dtype)) * q8.scale.to(x.dtype) + bias  # noqa: E731
    else:
        dense, natively = native_int4_layer(lin, True), native_int4_layer(lin, False)
        w = quant.dequantize_int4(quantize_int4(lin.weight.detach(), 64)).to(torch.bfloat16)
        product = lambda x: F.linear(x, w) + bias  # noqa: E731
    if dense.path != "native":
        pytest.skip(f"PyTorch's {mode} kernel is as fast here")
    assert dense.dense_prefill_dtype == torch.bfloat16 and natively.dense_prefill_dtype is None
    x = torch.randn(quant.NATIVE_DENSE_MIN_ROWS, 256).bfloat16()
    x[:, :4] *= 40  # outlier channels, as hidden states have, which coarsen their activation blocks
    reference = product(native.quantize_activations(x).to(torch.bfloat16))
    assert torch.equal(dense(x), reference) and torch.equal(dense(x[None]), reference[None])
    assert relative(natively(x), reference) < 1e-2 and relative(dense(x)[:1], natively(x[:1])) < 1e-2
    fewer = x[:quant.NATIVE_DENSE_MIN_ROWS - 1]
    assert torch.equal(dense(fewer), natively(fewer))
    monkeypatch.setattr(quant, "_NATIVE_DENSE_SLAB_BYTES", 256 * 2 * 24)  # slabs of 24 rows, the last one partial
    assert relative(dense(x), reference) < 1e-2  # smaller products may sum in another order: near, maybe not it


@needs_kernels
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_layer_the_probe_sends_dense_from_more_rows_keeps_fewer_native(mode, monkeypatch):
    """Where the dense way wins only from a longer prompt's rows (the probe's answer, given here), the rows below
    that stay on the native product, those from it go dense, whatever the layer's shape."""
    monkeypatch.setattr(quant, f"_{mode}_dense_prefill_probe", lambda *args: quant.NATIVE_DENSE_ROWS[1])
    lin = torch.nn.Linear(256, 64, bias=True).bfloat16()
    if mode == "int8":
        probed, dense, natively = (Int8Linear.from_linear(lin, dense_prefill=d) for d in (None, True, False))
    else:
        probed, dense, natively = (native_int4_layer(lin, d) for d in (None, True, False))
    if probed.path != "native":
        pytest.skip(f"PyTorch's {mode} kernel is as fast here")
    assert probed.dense_prefill_dtype == torch.bfloat16 and probed.dense_from_rows == quant.NATIVE_DENSE_ROWS[1]
    assert dense.dense_from_rows == quant.NATIVE_DENSE_MIN_ROWS
    x = torch.randn(quant.NATIVE_DENSE_ROWS[1], 256).bfloat16()
    fewer = x[:-1]
    assert len(fewer) >= quant.NATIVE_DENSE_MIN_ROWS  # rows the dense layer multiplies densely
    assert torch.equal(probed(fewer), natively(fewer)) and not torch.equal(dense(fewer), natively(fewer))
    assert torch.equal(probed(x), dense(x))
    if mode == "int4":
        assert probed.native_calls(fewer, torch.empty(len(fewer), 64, dtype=torch.bfloat16)) is not None
        assert probed.native_calls(x, torch.empty(len(x), 64, dtype=torch.bfloat16)) is None


def test_the_dense_way_is_taken_from_the_first_row_count_where_it_wins_by_the_margin(monkeypatch):
    """Scripted timings (the product's time grows with every row, the dense way's mostly fixed): each row count is
    timed in turn until the dense way wins by DENSE_PREFILL_MIN_GAIN, and none wins where it never does."""
    def rows_timed(product_us_a_row: float, dense_fixed_us: float):
        seen = []

        def race(fns, runs):
            for fn in fns:
                fn()
            rows = seen[-1]
            return [product_us_a_row * rows * 1e-6, (dense_fixed_us + rows) * 1e-6]
        monkeypatch.setattr(quant, "race", race)
        called = lambda x: seen.append(len(x))  # noqa: E731
        return quant._dense_from_rows("test [8, 32]", "native", "dense", quant.NATIVE_DENSE_ROWS, called, called,
                                      lambda count: torch.zeros(count, 32)), seen

    # gain at 128, 256, 512 rows: 10 us a row against 1000 us + 1 a row: 1.13, 2.05, 3.40
    assert rows_timed(10, 1000) == (256, [128, 128, 256, 256])
    assert rows_timed(20, 1000) == (128, [128, 128])  # 2.27 at once
    assert rows_timed(2, 1000) == (None, [128, 128, 256, 256, 512, 512])  # 0.23, 0.41, 0.68


@needs_kernels
def test_an_int4_layer_in_a_prefill_sized_decode_plan_call_keeps_to_the_native_product():
    """A decode plan calls the native product directly (native_calls): it must never be handed the rows the layer
    would have multiplied densely."""
    lin = torch.nn.Linear(256, 64, bias=False).bfloat16()
    dense = native_int4_layer(lin, True)
    if dense.path != "native":
        pytest.skip("PyTorch's int4 kernel is as fast here")
    few, many = torch.randn(8, 256).bfloat16(), torch.randn(quant.NATIVE_DENSE_MIN_ROWS, 256).bfloat16()
    assert dense.native_calls(few, torch.empty(8, 64, dtype=torch.bfloat16)) is not None
    assert dense.native_calls(many, torch.empty(len(many), 64, dtype=torch.bfloat16)) is None


# what this run was told is not the child's: each test says where its kernels are kept and whether they are on
UNTOLD = ("TC_NATIVE_KERNELS", "TC_CACHE_DIR")


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in UNTOLD}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**base, **env})


PROBE = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from tc.model import native, quant
layer = quant.Int4Linear.from_linear(torch.nn.Linear(256, 64).bfloat16(), 64)
finite = bool(layer(torch.randn(2, 256).bfloat16()).isfinite().all())
print("kernels:", native.kernels() is not None, "path:", layer.path, "finite:", finite)
"""


def test_turned_off_the_layers_run_on_pytorchs_kernels():
    done = run_python(PROBE, TC_NATIVE_KERNELS="0")
    assert done.returncode == 0, done.stderr
    assert "off (TC_NATIVE_KERNELS=0)" in done.stdout
    assert "kernels: False" in done.stdout and "path: native" not in done.stdout and "finite: True" in done.stdout


def test_without_a_compiler_the_layers_run_on_pytorchs_kernels(tmp_path):
    # HOME elsewhere: no cached library to find; PATH an empty directory; CC one that does not exist
    (tmp_path / "bin").mkdir()
    done = run_python(PROBE, HOME=str(tmp_path), PATH=str(tmp_path / "bin"), CC="no-such-cc")
    assert done.returncode == 0, done.stderr
    assert "no C compiler found" in done.stdout and "kernels: False" in done.stdout and "finite: True" in done.stdout


@needs_kernels
def test_a_failed_build_says_why_and_falls_back(tmp_path):
    fails = tmp_path / "cc"
    fails.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo broken-cc 1.0 && exit 0\n"
                     "echo 'qdot.c:1: error: broken' >&2\nexit 1\n")
    fails.chmod(0o755)
    done = run_python(PROBE, HOME=str(tmp_path), CC=str(fails))
    assert done.returncode == 0, done.stderr
    assert "unavailable" in done.stdout and "error: broken" in done.stdout and "kernels: False" in done.stdout


@needs_kernels
def test_unreadable_cpu_flags_never_force_an_avx2_build(tmp_path):
    # Where /proc/cpuinfo says nothing (a sandbox, another OS), the native build's #error is the only check that the
    # CPU has AVX2: a build forcing -mavx2 after it fails would run AVX2 code on a CPU that may lack it (SIGILL).
    calls = tmp_path / "calls"
    fails = tmp_path / "cc"
    fails.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && echo broken-cc 1.0 && exit 0\n"
                     f"echo \"$*\" >> {calls}\necho 'qdot.c:1: #error needs AVX2' >&2\nexit 1\n")
    fails.chmod(0o755)
    probe = PROBE.replace("from tc.model import native, quant\n",
                          "from tc.model import native, quant\nnative.cpu_flags = lambda: None\n")
    done = run_python(probe, HOME=str(tmp_path), CC=str(fails))
    assert done.returncode == 0, done.stderr
    assert "unavailable" in done.stdout and "kernels: False" in done.stdout
    assert "-march=native" in calls.read_text() and "-mavx2" not in calls.read_text()


@needs_kernels
def test_a_failed_link_says_what_the_linker_said(tmp_path):
    links_badly = tmp_path / "cc"  # the machine's gcc, linking a library that is not there
    links_badly.write_text("#!/bin/sh\nexec gcc \"$@\" -lno-such-library\n")
    links_badly.chmod(0o755)
    done = run_python(PROBE, HOME=str(tmp_path), CC=str(links_badly))
    assert done.returncode == 0, done.stderr
    assert "unavailable" in done.stdout and "kernels: False" in done.stdout
    assert "cannot find -lno-such-library" in done.stdout  # not only gcc's "collect2: error: ld returned 1"


@pytest.mark.skipif(shutil.which("cc") is None, reason="no cc here")
def test_cc_with_words_of_its_own_is_split_as_make_splits_it(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "cc '-DTC_CC_WORDS=(1 + 1)'")  # as "ccache gcc" or "gcc -m64": all of it is the compiler
    monkeypatch.setenv("TC_CACHE_DIR", str(tmp_path))
    compiler = native._compiler()
    assert compiler == ("cc", "-DTC_CC_WORDS=(1 + 1)")
    source = b'#ifndef TC_CC_WORDS\n#error "CC lost its words"\n#endif\nint words(void) { return TC_CC_WORDS; }\n'
    assert ctypes.CDLL(str(native._build({"words.c": source}, compiler))).words() == 2


# One tiny library built as kernels() builds its own (native._build: the cache, its lock, its build directories).
BUILD_ONE = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from tc.model import native
print("built:", native._build({"one.c": b"int one(void) { return 1; }\\n"}, native._compiler()), flush=True)
"""
# The machine's cc, held at each compile (not at --version) until the test lets it go on, after saying so.
HELD_CC = """#!/bin/sh
case " $* " in *" -o "*) echo compiling >> "$0.log"; while [ ! -e "$0.go" ]; do sleep 0.05; done;; esac
exec cc "$@"
"""
# ... and one that dies mid-compile, taking the process that builds with it, as the OOM killer or a kill -9 would.
KILLING_CC = """#!/bin/sh
case " $* " in *" -o "*) kill -9 $PPID; sleep 5; exit 1;; esac
exec cc "$@"
"""
needs_cc_and_flock = pytest.mark.skipif(shutil.which("cc") is None or os.name != "posix",
                                        reason="needs cc, and flock to share a build")


def start_python(code: str, **env: str) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if k not in UNTOLD}
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**base, **env}, start_new_session=True)


def script(path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def wait_for(predicate, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@needs_cc_and_flock
def test_processes_starting_at_once_build_the_library_once_and_share_it(tmp_path):
    cc = tmp_path / "cc"
    env = dict(CC=script(cc, HELD_CC), TC_CACHE_DIR=str(tmp_path / "cache"))
    compiles = tmp_path / "cc.log"
    first = start_python(BUILD_ONE, **env)
    wait_for(compiles.exists, "the first process to compile")
    second = start_python(BUILD_ONE, **env)
    told = []  # the second's lines, as they come
    reader = threading.Thread(target=lambda: told.extend(second.stdout), daemon=True)
    reader.start()
    # the second either waits for the first (and says so) or compiles the same library itself
    wait_for(lambda: "waiting for it" in "".join(told) or compiles.read_text().count("compiling") > 1,
             "the second process to wait or compile")
    (tmp_path / "cc.go").touch()
    out, _ = first.communicate(timeout=120)
    assert second.wait(timeout=120) == 0 and first.returncode == 0, (out, told)
    reader.join(timeout=30)
    assert compiles.read_text().count("compiling") == 1, "".join(told)
    built = [line for line in out.splitlines() + "".join(told).splitlines() if line.startswith("built:")]
    assert len(built) == 2 and built[0] == built[1], built


@needs_cc_and_flock
def test_a_process_waiting_for_a_builder_that_dies_builds_the_library_itself(tmp_path):
    cache = tmp_path / "cache"
    env = dict(CC=script(tmp_path / "cc", HELD_CC), TC_CACHE_DIR=str(cache))
    compiles = tmp_path / "cc.log"
    first = start_python(BUILD_ONE, **env)
    wait_for(compiles.exists, "the first process to compile")
    second = start_python(BUILD_ONE, **env)
    told = []
    reader = threading.Thread(target=lambda: told.extend(second.stdout), daemon=True)
    reader.start()
    wait_for(lambda: "waiting for it" in "".join(told), "the second process to wait for the first")
    os.killpg(first.pid, signal.SIGKILL)  # mid-build, holding the lock; its compiler with it
    first.communicate(timeout=60)
    (tmp_path / "cc.go").touch()
    assert second.wait(timeout=120) == 0, "".join(told)
    reader.join(timeout=30)
    assert compiles.read_text().count("compiling") == 2 and "built:" in "".join(told)
    assert not [p for p in (cache / "kernels").iterdir() if p.is_dir()]  # the first's build directory too


@needs_cc_and_flock
def test_a_build_killed_midway_leaves_nothing_behind_once_the_next_one_runs(tmp_path):
    cache = tmp_path / "cache"
    killed = run_python(BUILD_ONE, CC=script(tmp_path / "cc", KILLING_CC), TC_CACHE_DIR=str(cache))
    assert killed.returncode == -9  # died mid-build ...
    assert [p for p in (cache / "kernels").iterdir() if p.is_dir()]  # ... with its build directory in the cache
    done = run_python(BUILD_ONE, CC="cc", TC_CACHE_DIR=str(cache))
    assert done.returncode == 0 and "built:" in done.stdout, done.stdout + done.stderr
    assert not [p for p in (cache / "kernels").iterdir() if p.is_dir()]
    assert len(list((cache / "kernels").glob("native-*.so"))) == 1


@needs_kernels
def test_the_library_is_built_once_and_then_found_in_the_cache(tmp_path):
    first = run_python(PROBE, HOME=str(tmp_path))
    built = list((tmp_path / ".cache" / "truecluster" / "kernels").glob("native-*.so"))
    assert first.returncode == 0 and "kernels: True" in first.stdout and len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    second = run_python(PROBE, HOME=str(tmp_path))
    assert second.returncode == 0 and "kernels: True" in second.stdout
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    assert not [p for p in built[0].parent.iterdir() if p.is_dir()]  # no build directory left behind


@needs_kernels
def test_the_library_is_cached_under_tc_cache_dir_where_it_is_set(tmp_path):
    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    done = run_python(PROBE, HOME=str(home), TC_CACHE_DIR=str(cache))
    assert done.returncode == 0 and "kernels: True" in done.stdout, done.stderr
    assert len(list((cache / "kernels").glob("native-*.so"))) == 1
    assert not list(home.iterdir())  # nothing under the home the cache was moved away from


@needs_kernels
def test_where_the_cache_cannot_be_written_the_library_is_built_for_the_process(tmp_path):
    (tmp_path / ".cache").write_text("")  # no directory can be made under it, as under a read-only home
    (tmp_path / "tmp").mkdir()
    done = run_python(PROBE, HOME=str(tmp_path), TMPDIR=str(tmp_path / "tmp"))
    assert done.returncode == 0, done.stderr
    assert "cannot write their cache" in done.stdout and "kernels: True" in done.stdout
    assert not list((tmp_path / "tmp").iterdir())  # the build directory went once the library was loaded


def _can_mount_in_a_namespace() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@needs_kernels
def test_where_the_build_for_this_cpu_fails_the_kernels_are_built_for_avx2_alone(tmp_path):
    # a compiler (or assembler) older than the CPU: -march=native is what it cannot do
    no_native = script(tmp_path / "cc", "#!/bin/sh\ncase \" $* \" in *\" -march=native \"*)\n"
                       "  echo \"cc1: error: bad value 'native' for '-march=' switch\" >&2; exit 1;;\nesac\n"
                       "exec cc \"$@\"\n")
    done = run_python(PROBE, CC=no_native, TC_CACHE_DIR=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr
    assert "kernels: True" in done.stdout and "finite: True" in done.stdout
    said = [line for line in done.stdout.splitlines() if "native kernels: the build for this CPU failed" in line]
    assert len(said) == 1 and "bad value 'native'" in said[0] and "AVX2 and FMA alone" in said[0]


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("cc") is None, reason="x86-64 with a cc only")
@pytest.mark.skipif(not _can_mount_in_a_namespace(), reason="no user and mount namespaces here (unshare -rm)")
def test_a_cpu_without_avx2_keeps_pytorchs_kernels_and_compiles_nothing(tmp_path):
    def without_avx(line: str) -> str:
        kept = [flag for flag in line.split() if flag not in ("avx2", "fma") and not flag.startswith("avx512")]
        return " ".join(kept) if line.startswith("flags") else line

    with open("/proc/cpuinfo", encoding="utf-8") as f:
        (tmp_path / "cpuinfo").write_text("\n".join(without_avx(line) for line in f.read().splitlines()) + "\n")
    counted = script(tmp_path / "cc", '#!/bin/sh\necho "$*" >> "$0.log"\nexec cc "$@"\n')
    base = {k: v for k, v in os.environ.items() if k not in UNTOLD}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount --bind "$0" /proc/cpuinfo && exec "$@"',
                           str(tmp_path / "cpuinfo"), sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**base, "CC": counted, "TC_CACHE_DIR": str(tmp_path / "c")})
    assert done.returncode == 0, done.stderr
    assert "this CPU has no avx2 or fma" in done.stdout and "kernels: False" in done.stdout
    assert "finite: True" in done.stdout
    assert not (tmp_path / "cc.log").exists()  # not even asked its version


@needs_kernels
@pytest.mark.skipif(not _can_mount_in_a_namespace(), reason="no user and mount namespaces here (unshare -rm)")
def test_on_a_full_disk_the_library_is_built_for_the_process(tmp_path):
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir(), tmp.mkdir()
    full = ('mount -t tmpfs -o size=64k tmpfs "$HOME" && mkdir -p "$HOME/.cache/truecluster/kernels" && '
            '{ dd if=/dev/zero of="$HOME/fill" bs=4k 2>/dev/null; true; } && exec "$0" -c "$1"')
    base = {k: v for k, v in os.environ.items() if k not in UNTOLD}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", full, sys.executable, PROBE], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**base, "HOME": str(home), "TMPDIR": str(tmp)})
    assert done.returncode == 0, done.stderr
    assert "No space left on device" in done.stdout and "kernels: True" in done.stdout
    assert not list(tmp.iterdir())


@needs_kernels
def test_a_cached_library_cut_short_is_built_again(tmp_path):
    first = run_python(PROBE, HOME=str(tmp_path))
    built = list((tmp_path / ".cache" / "truecluster" / "kernels").glob("native-*.so"))
    assert first.returncode == 0 and "kernels: True" in first.stdout and len(built) == 1
    size = built[0].stat().st_size
    for kept in (size // 2, 0):  # pages missing past its end (loading it died of SIGBUS); nothing of it at all
        os.truncate(built[0], kept)
        again = run_python(PROBE, HOME=str(tmp_path))
        assert again.returncode == 0, again.stderr
        assert "cut short" in again.stdout and "kernels: True" in again.stdout
        assert built[0].stat().st_size == size


@needs_kernels
@pytest.mark.parametrize("heads, kv_heads, d", [(14, 2, 64), (4, 4, 16), (6, 1, 24), (16, 1, 128), (8, 2, 256)])
def test_decode_attention_equals_its_reference_and_stores_the_new_position(heads, kv_heads, d):
    gen = torch.Generator().manual_seed(heads * d)
    positions = [0, 7, 8, 9, 70]  # a first position, partial and whole blocks of 8 keys, a longer cache
    rows = [4, 0, 2, 5, 1]  # each sequence's row, in any order; row 3 belongs to no decode row
    qkv = torch.randn(6, (heads + 2 * kv_heads) * d, generator=gen).bfloat16()
    qkv[0] *= 30  # large scores: the softmax must subtract their maximum
    slots = [torch.randn(2, 1, kv_heads, p + 3, d, generator=gen).bfloat16() for p in positions]
    before = [slot.clone() for slot in slots]
    out = torch.full((6, heads * d), 7.0, dtype=torch.bfloat16)
    KERNELS.decode_attention(qkv, out, rows, slots, positions, heads, kv_heads, d ** -0.5)
    for row, slot, old, p in zip(rows, slots, before, positions):
        old[:, 0, :, p] = qkv[row, heads * d:].view(2, kv_heads, d)  # the new key and value, and nothing else
        assert torch.equal(slot, old)
        ref = native.decode_attention_reference(qkv[row], old[0, 0, :, :p + 1], old[1, 0, :, :p + 1], heads,
                                                kv_heads, d ** -0.5)
        assert relative(out[row], ref) < 4e-3  # one bf16 rounding of the output
    assert torch.equal(out[3], torch.full((heads * d,), 7.0, dtype=torch.bfloat16))


@needs_kernels
@pytest.mark.parametrize("heads, kv_heads, d", [(14, 2, 64), (6, 1, 24), (8, 2, 256)])  # 24: halves of 12
def test_decode_attention_rotates_as_rotate_does(heads, kv_heads, d):
    # given each row's cos and sin, the kernel's rotation is rotate_'s to the bit: the same attention and the same
    # cached key as rotating first and attending after, and qkv is left as it was
    from tc.model.rope import Rotary, rotate_

    gen = torch.Generator().manual_seed(d)
    positions, rows = [3, 40, 0], [2, 0, 1]
    qkv = torch.randn(3, (heads + 2 * kv_heads) * d, generator=gen).bfloat16() * 4
    cos, sin = Rotary(d, 10000.0, "cpu").span_tables(  # row r at the position of the sequence in row r
        [type("Row", (), {"start": p, "length": 1}) for _, p in sorted(zip(rows, positions))], torch.bfloat16)
    slots = [torch.randn(2, 1, kv_heads, p + 2, d, generator=gen).bfloat16() for p in positions]
    theirs = [slot.clone() for slot in slots]
    ours_out, their_out = (torch.zeros(3, heads * d, dtype=torch.bfloat16) for _ in range(2))
    unrotated = qkv.clone()
    KERNELS.decode_attention(qkv, ours_out, rows, slots, positions, heads, kv_heads, d ** -0.5, (cos, sin))
    assert torch.equal(qkv, unrotated)
    rotated = qkv.clone()
    rotate_(rotated.view(3, heads + 2 * kv_heads, d)[:, :heads + kv_heads], cos, sin)
    assert not torch.equal(rotated, qkv)
    KERNELS.decode_attention(rotated, their_out, rows, theirs, positions, heads, kv_heads, d ** -0.5)
    assert torch.equal(ours_out, their_out)
    assert all(torch.equal(a, b) for a, b in zip(slots, theirs))


@needs_kernels
def test_a_nan_in_one_sequence_spoils_its_own_attention_only():
    # as SDPA does: a NaN (or an overflow) must show in the output, not vanish into the softmax's weights
    qkv = torch.randn(2, 8 * 16).bfloat16()
    qkv[0, 3] = float("nan")  # a query value of sequence 0
    slots = [torch.randn(2, 1, 2, 6, 16).bfloat16() for _ in range(2)]
    out = torch.zeros(2, 4 * 16, dtype=torch.bfloat16)
    KERNELS.decode_attention(qkv, out, [0, 1], slots, [4, 5], 4, 2, 0.25)
    assert out[0, :16].isnan().all() and out[1].isfinite().all()


@needs_kernels
def test_decode_attention_refuses_heads_it_does_not_take():
    assert native.attention_shape_ok(14, 2, 64) and not native.attention_shape_ok(14, 2, 60)
    assert not native.attention_shape_ok(34, 2, 64) and not native.attention_shape_ok(4, 2, 512)
    qkv, out = torch.zeros(1, 8 * 60, dtype=torch.bfloat16), torch.zeros(1, 4 * 60, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no 4 query heads over 2 of size 60"):
        KERNELS.decode_attention(qkv, out, [0], [torch.zeros(2, 1, 2, 4, 60, dtype=torch.bfloat16)], [0], 4, 2, 1.0)


@needs_kernels
def test_a_ragged_batch_takes_the_native_attention_for_its_decode_rows_only(tiny_model_dir, monkeypatch):
    # two decode rows around a prefill chunk: the chunk keeps SDPA, the decode rows go to the kernel in one call,
    # and every row ends where SDPA alone puts it, up to bf16 roundings
    from model_helpers import OurModel
    from tc.model.kv_cache import CacheFullError
    from tc.model.qwen2 import Attention, Span, Stage

    stage = OurModel(tiny_model_dir, torch.bfloat16).stages[0]
    monkeypatch.setattr(Stage, "decode_plans", False)  # the modules' own choice (a plan would take these 8 rows)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randn(1, n, 64, generator=gen).bfloat16() for n in (9, 4, 17)]
    step = torch.randn(1, 1 + 6 + 1, 64, generator=gen).bfloat16()  # rows: decode, chunk of 6, decode
    calls = []
    kernel_call = native.Kernels.decode_attention
    monkeypatch.setattr(native.Kernels, "decode_attention",
                        lambda self, *a: calls.append(a[2]) or kernel_call(self, *a))
    results = {}
    for way in (False, True):
        monkeypatch.setattr(Attention, "native_decode", way)
        caches = [stage.new_cache(24, torch.bfloat16, "cpu") for _ in prompts]
        for prompt, cache in zip(prompts, caches):
            stage(prompt, cache, 0)
        spans = [Span(caches[0], 9, 1), Span(caches[1], 4, 6), Span(caches[2], 17, 1)]
        out = stage.forward_batch(step, spans)
        results[way] = out, [c.kv[..., :n, :].clone() for c, n in zip(caches, (10, 10, 18))]  # positions written
    assert calls == [[0, 7]] * len(stage.layers)  # rows 0 and 7, once per layer
    (native_out, native_kv), (sdpa_out, sdpa_kv) = results[True], results[False]
    assert relative(native_out, sdpa_out) < 1e-2
    for ours, theirs in zip(native_kv, sdpa_kv):
        assert relative(ours, theirs) < 1e-2
    full = stage.new_cache(1, torch.bfloat16, "cpu")
    stage(prompts[0][:, :1], full, 0)
    with pytest.raises(CacheFullError, match="position 1 is past"):
        stage.forward_batch(step[:, :1], [Span(full, 1, 1)])


@needs_kernels
@pytest.mark.parametrize("rows, inner", [(1, 4864), (3, 64), (2, 100), (2, 13), (40, 136)])  # tails; threads
def test_silu_mul_gives_pytorchs_bits_but_for_rare_last_steps(rows, inner):
    gen = torch.Generator().manual_seed(rows * inner)
    gate_up = (torch.randn(rows, 2 * inner, generator=gen) * 6).bfloat16()
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, -88.5, 0.0])  # e^-g past float32's range, and no e^-g at all
    got, ref = KERNELS.silu_mul(gate_up), native.silu_mul_reference(gate_up)
    assert got.shape == (rows, inner) and got.dtype == torch.bfloat16 and got.isfinite().all()
    # the same roundings; only e^x's last float32 bits differ, which can move a value by one bf16 step where it
    # lies near a rounding boundary
    step = ref.float().abs().clamp_min(1e-30).log2().floor().exp2() * 2 ** -7
    assert bool(((got.float() - ref.float()).abs() <= step).all()) and (got != ref).float().mean() < 1e-3
    assert got[0, 0] == 0 and got[0, 1] == ref[0, 1]
    assert torch.equal(KERNELS.silu_mul(gate_up[:1]), got[:1])  # a row's result does not depend on the others


@needs_kernels
def test_a_decode_step_takes_the_native_activation_and_a_prefill_does_not(tiny_model_dir, monkeypatch):
    from model_helpers import OurModel
    from tc.model.qwen2 import MLP, Stage

    stage = OurModel(tiny_model_dir, torch.bfloat16).stages[0]
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randn(1, native.ACT_ROWS + 1, 64, generator=gen).bfloat16()
    step = torch.randn(1, 1, 64, generator=gen).bfloat16()
    calls = []
    kernel_call = native.Kernels.silu_mul
    monkeypatch.setattr(native.Kernels, "silu_mul", lambda self, x: calls.append(x.shape[-2]) or kernel_call(self, x))
    monkeypatch.setattr(Stage, "decode_plans", False)  # the modules' own choice (a plan's: test_decode_plan.py)
    results = {}
    for way in (False, True):
        monkeypatch.setattr(MLP, "native_act", way)
        cache = stage.new_cache(24, torch.bfloat16, "cpu")
        stage(prompt, cache, 0)
        results[way] = stage(step, cache, prompt.shape[1])
    assert calls == [1] * len(stage.layers)  # the decode row, once a layer; never the prompt's block
    assert relative(results[True], results[False]) < 1e-2


@needs_kernels
@pytest.mark.parametrize("rows, n", [(1, 896), (3, 64), (2, 200), (2, 203), (80, 136)])  # tails past vectors; threads
def test_rms_norm_gives_the_reference_bits(rows, n):
    gen = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=gen) * torch.rand(rows, 1, generator=gen) * 20).bfloat16()
    x[:, 1] *= 30  # an outlier channel
    w = torch.randn(n, generator=gen).bfloat16()
    got, ref = KERNELS.rms_norm(x, w, 1e-6), native.rms_norm_reference(x, w, 1e-6)
    # the same roundings; the mean's float32 additions run in another order, which can move a value across a
    # bf16 rounding boundary (measured: 8 of a million values, by one unit in the last place)
    assert relative(got, ref) < 1e-3 and (got != ref).float().mean() < 1e-3
    assert torch.equal(KERNELS.rms_norm(x[:1], w, 1e-6), got[:1])  # a row's result does not depend on the others


@needs_kernels
def test_bf16_norms_take_the_native_norm_and_others_keep_pytorchs(monkeypatch):
    from tc.model.qwen2 import RMSNorm

    calls = []
    kernel_call = native.Kernels.rms_norm
    monkeypatch.setattr(native.Kernels, "rms_norm", lambda self, *a: calls.append(1) or kernel_call(self, *a))
    monkeypatch.setattr(RMSNorm, "native", True)
    norm = RMSNorm(64, 1e-6).bfloat16().requires_grad_(False)  # as loaded layers are
    x = torch.randn(2, 3, 64).bfloat16()
    assert relative(norm(x), native.rms_norm_reference(x, norm.weight, 1e-6)) < 1e-3 and len(calls) == 1
    norm(x.float().bfloat16()[:, :, :64].transpose(0, 1))  # not contiguous: PyTorch's operators
    RMSNorm(64, 1e-6)(x.float())  # float32: PyTorch's
    RMSNorm(64, 1e-6, offset=1.0).bfloat16()(x)  # Gemma's offset scales in float32: PyTorch's
    assert len(calls) == 1


@needs_kernels
@pytest.mark.parametrize("rows, n", [(1, 896), (3, 64), (2, 13), (5, 200)])  # whole vectors, tails
def test_the_native_sum_gives_add_s_bits(rows, n):
    gen = torch.Generator().manual_seed(rows * n)
    # magnitudes from 1e-6 to 1e6 apart, so that some sums round twice (in float32, then to bf16)
    y = (torch.randn(rows, n, generator=gen) * 10.0 ** torch.randint(-6, 7, (rows, n), generator=gen)).bfloat16()
    delta = (torch.randn(rows, n, generator=gen) * 10.0 ** torch.randint(-6, 7, (rows, n), generator=gen)).bfloat16()
    delta[0, :3] = torch.tensor([float("inf"), 3e38, -0.0])  # an infinity, an overflow past bf16's range
    y[0, 1] = 3e38
    bias = torch.randn(n, generator=gen).bfloat16()
    got = KERNELS.add_(y.clone(), delta)
    assert torch.equal(got, y.clone().add_(delta)) and got[0, 0] == float("inf") and got[0, 1] == float("inf")
    assert torch.equal(KERNELS.add_(y.clone(), bias), y.clone().add_(bias))  # one row added to every row
    assert native._check_add(KERNELS, gen) == 0.0


@needs_kernels
def test_the_sum_check_refuses_a_kernel_one_bit_off(monkeypatch):
    def off_by_one(self, y, b):
        y.add_(b)
        y.view(torch.int16)[..., -1] += 1
        return y

    monkeypatch.setattr(native.Kernels, "add_", off_by_one)
    assert native._check_add(KERNELS, torch.Generator().manual_seed(0)) == 1.0


@needs_kernels
def test_an_fp16_int8_layer_taken_densely_scales_its_rows_within_fp16s_range():
    """The dense way multiplies int8 codes by the activations and applies the row scales after: in fp16 that
    product passed 65504 and came out inf where the scaled result is small (an fp16 layer given to
    Int8Linear.from_linear). It is made in float32 there; the result is the reference's in fp16."""
    lin = torch.nn.Linear(256, 64, bias=False).half()
    with torch.no_grad():
        lin.weight.fill_(0.001)  # every code 127, the scale 0.001 / 127
    dense = Int8Linear.from_linear(lin, dense_prefill=True)
    if dense.path != "native":
        pytest.skip("PyTorch's int8 kernel is as fast here")
    x = torch.full((quant.NATIVE_DENSE_MIN_ROWS, 256), 50.0, dtype=torch.float16)  # 256 x 127 x 50 > 65504
    y = dense(x)
    assert y.dtype == torch.float16 and bool(y.isfinite().all())
    assert relative(y.float(), torch.full_like(y, 256 * 0.001 * 50, dtype=torch.float32)) < 1e-2
