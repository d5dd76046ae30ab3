"""Weight-only quantization: formats, error bounds, module paths against the dequantize reference, memory."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tc.model import quant
from tc.model.quant import (
    DEFAULT_GROUP_SIZE,
    INT4_PACKING,
    Int4Linear,
    Int4Weight,
    Int8Linear,
    Int8Weight,
    KernelUnavailableError,
    QuantizationError,
    dequantize_int4,
    dequantize_int8,
    int4_kernel_available,
    int8_kernel_available,
    quantize_int4,
    quantize_int4_slabs,
    quantize_int8,
    quantize_int8_slabs,
    quantize_linears,
    quantized_nbytes,
    unpack_int4,
)

HAS_INT8_KERNEL = int8_kernel_available("cpu")
HAS_INT4_KERNEL = int4_kernel_available("cpu") is not None


@pytest.fixture
def without_native(monkeypatch):
    """Layers built inside choose between PyTorch's kernels and the portable path only (no native kernels), as
    on a machine without a C compiler."""
    monkeypatch.setattr(quant.native, "faster_than_torch", lambda mode: False)


def weight(kind: str, shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """Synthetic weights covering what real checkpoints and corner cases look like."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen)
    if kind == "normal":
        return w * 0.02
    if kind == "skewed":  # all of one sign, far from zero: the zero point matters
        return 3.0 + w.abs() * 0.01
    if kind == "outliers":
        w = w * 0.02
        w[:, ::17] *= 50
        return w
    if kind == "tiny":
        return w * 1e-20
    if kind == "large":
        return w * 1e4 + 5e4
    if kind == "constant":
        return torch.full(shape, -0.3711)
    if kind == "zero":
        return torch.zeros(shape)
    raise AssertionError(kind)


KINDS = ("normal", "skewed", "outliers", "tiny", "large", "constant", "zero")
SHAPES = ((1, 1), (7, 13), (3, 1000), (64, 256))


# ----------------------------------------------------------------------------------------------- int8 format


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_round_trip_within_half_a_step(kind, shape):
    w = weight(kind, shape)
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and tuple(q.qweight.shape) == shape and q.shape == shape
    assert q.scale.dtype == torch.float32 and tuple(q.scale.shape) == (shape[0],)
    assert int(q.qweight.abs().max()) <= 127
    deq = dequantize_int8(q)
    assert deq.shape == w.shape and deq.dtype == torch.float32
    bound = q.scale[:, None] / 2 * (1 + 1e-6) + 1e-7 * w.abs()
    assert bool(((w - deq).abs() <= bound).all()), float(((w - deq).abs() - bound).max())


def test_int8_is_spec_10_2_exactly():
    w = weight("outliers", (32, 96))
    q = quantize_int8(w)
    scale = w.abs().amax(dim=1) / 127
    assert torch.equal(q.scale, scale)
    assert torch.equal(q.qweight, torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
    assert torch.equal(dequantize_int8(q), q.qweight.float() * scale[:, None])


def test_int8_all_zero_rows_quantize_to_zero():
    w = weight("normal", (5, 40))
    w[1] = 0
    w[4] = 0
    q = quantize_int8(w)
    assert q.scale[1] == 0 and q.scale[4] == 0
    assert not bool(q.qweight[[1, 4]].any())
    deq = dequantize_int8(q)
    assert bool(torch.isfinite(deq).all()) and not bool(deq[[1, 4]].any())


def test_int8_accepts_bf16_weights():
    w = weight("normal", (16, 48)).to(torch.bfloat16)
    q = quantize_int8(w)
    assert bool(((w.float() - dequantize_int8(q)).abs() <= q.scale[:, None] / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("bad", [torch.zeros(3), torch.zeros(0, 4), torch.zeros(2, 3, dtype=torch.int32)])
def test_quantize_rejects_what_is_not_a_float_matrix(bad):
    with pytest.raises(QuantizationError):
        quantize_int8(bad)
    with pytest.raises(QuantizationError):
        quantize_int4(bad, 32)


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("col", [0, 3, 63])
def test_quantize_names_the_rows_holding_nan_or_inf(bad_value, col):
    bad = weight("normal", (8, 64))
    bad[5, col] = bad_value
    said = "the weight has NaN or infinite values in rows 0..7"
    with pytest.raises(QuantizationError, match=said):
        quantize_int8(bad)
    for param_dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(QuantizationError, match=said):
            quantize_int4(bad, 32, param_dtype)
    # a weight read a slab at a time: the rows are the whole weight's
    with pytest.raises(QuantizationError, match="rows 8..15"):
        quantize_int8_slabs([(0, weight("normal", (8, 64))), (8, bad)], (16, 64), "cpu")
    with pytest.raises(QuantizationError, match="rows 8..15"):
        quantize_int4_slabs([(0, weight("normal", (8, 64))), (8, bad)], (16, 64), "cpu", 32)


# ----------------------------------------------------------------------------------------------- int4 format


def int4_step(q: Int4Weight) -> torch.Tensor:
    """The quantization step of every element's group, [out, in]."""
    return q.scales.float().repeat_interleave(q.group_size, dim=1)[:, :q.shape[1]]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group_size", [32, 128, 6])
def test_int4_round_trip_within_half_a_step(kind, shape, group_size):
    w = weight(kind, shape, seed=1)
    q = quantize_int4(w, group_size)
    groups = -(-shape[1] // group_size)
    assert q.shape == shape and q.group_size == group_size and q.packing == INT4_PACKING
    assert q.packed.dtype == torch.uint8 and tuple(q.packed.shape) == (shape[0], groups * group_size // 2)
    assert tuple(q.scales.shape) == tuple(q.zeros.shape) == (shape[0], groups)
    deq = dequantize_int4(q)
    assert deq.shape == w.shape and deq.dtype == torch.float32
    bound = int4_step(q) / 2 * (1 + 1e-5) + 1e-6 * w.abs()
    assert bool(((w - deq).abs() <= bound).all()), float(((w - deq).abs() - bound).max())


def test_int4_step_is_close_to_the_range_over_15():
    w = weight("normal", (16, 256))
    q = quantize_int4(w, 64)
    g = w.view(16, 4, 64)
    ideal = (g.amax(-1) - g.amin(-1)) / 15
    ratio = q.scales.float() / ideal
    assert bool((ratio >= 1).all()) and bool((ratio < 1.02).all())  # widened only by bf16 rounding


@pytest.mark.parametrize("group_size", [32, 128])
def test_quantizing_in_slabs_changes_nothing(monkeypatch, group_size):
    w = weight("outliers", (300, 200))
    whole8, whole4 = quantize_int8(w), quantize_int4(w, group_size)
    monkeypatch.setattr(quant, "_CHUNK_ELEMENTS", 7 * 200)  # slabs of 7 rows (5 for int4's padded width)
    slab8, slab4 = quantize_int8(w), quantize_int4(w, group_size)
    assert torch.equal(whole8.qweight, slab8.qweight) and torch.equal(whole8.scale, slab8.scale)
    for name in ("packed", "scales", "zeros"):
        assert torch.equal(getattr(whole4, name), getattr(slab4, name))


@pytest.mark.parametrize("cut", [[0, 300], [0, 1, 2, 300], [0, 7, 8, 150, 299, 300], [0, 0, 5, 5, 300]])
def test_a_weight_streamed_in_slabs_of_any_rows_quantizes_as_the_whole(cut):
    w = weight("outliers", (300, 200)).bfloat16()
    slabs = [(a, w[a:b]) for a, b in zip(cut, cut[1:])]
    whole8, slab8 = quantize_int8(w), quant.quantize_int8_slabs(slabs, (300, 200), "cpu")
    assert torch.equal(whole8.qweight, slab8.qweight) and torch.equal(whole8.scale, slab8.scale)
    whole4, slab4 = quantize_int4(w, 64), quant.quantize_int4_slabs(iter(slabs), (300, 200), "cpu", 64)
    for name in ("packed", "scales", "zeros"):
        assert torch.equal(getattr(whole4, name), getattr(slab4, name))


@pytest.mark.parametrize("slabs, match", [
    ([(0, torch.zeros(4, 8))], "first 4 rows of a weight of 6"),  # rows missing at the end
    ([(0, torch.zeros(4, 8)), (3, torch.zeros(3, 8))], "at row 3"),  # overlapping
    ([(0, torch.zeros(2, 8)), (4, torch.zeros(4, 8))], "at row 4"),  # a gap
    ([(0, torch.zeros(6, 7))], "shape"),  # other columns
    ([(0, torch.zeros(4, 8)), (4, torch.zeros(4, 8))], "at row 4"),  # past the last row
    ([(0, torch.zeros(6, 8, dtype=torch.int32))], "floating-point"),
])
def test_slabs_that_do_not_tile_the_weight_are_refused(slabs, match):
    with pytest.raises(QuantizationError, match=match):
        quant.quantize_int8_slabs(slabs, (6, 8), "cpu")
    with pytest.raises(QuantizationError, match=match):
        quant.quantize_int4_slabs(slabs, (6, 8), "cpu", 8)


def test_nan_in_a_later_slab_is_named_by_its_row_in_the_whole_weight():
    w = weight("normal", (40, 64))
    w[33, 5] = float("nan")
    with pytest.raises(QuantizationError, match="rows 30..39"):
        quant.quantize_int8_slabs([(0, w[:30]), (30, w[30:])], (40, 64), "cpu")


def test_quantization_refuses_what_quantize_linears_refuses():
    with pytest.raises(QuantizationError, match="unknown weight mode"):
        quant.Quantization("int3")
    with pytest.raises(QuantizationError, match="group_size"):
        quant.Quantization("int4", 5)
    assert quant.Quantization("int8", 5).quantizes and not quant.Quantization("fp16").quantizes


@pytest.mark.skipif(not HAS_INT4_KERNEL, reason="no int4 packed kernel in this torch build")
def test_packing_in_place_writes_the_kernel_layout_over_the_codes(monkeypatch):
    monkeypatch.setattr(quant, "_CHUNK_ELEMENTS", 64 * 256)  # slabs of 64 rows, the last one partial
    w = weight("normal", (64 * 5 + 16, 256))
    beside = Int4Linear(quantize_int4(w, 64), use_kernel=True)
    given = quantize_int4(w, 64)
    codes = given.packed.data_ptr()
    over = Int4Linear(given, use_kernel=True, pack_in_place=True)
    assert over.packed.data_ptr() == codes  # one matrix of codes, not two
    assert torch.equal(over.packed, beside.packed)
    x = torch.randn(3, 256)
    assert torch.equal(over(x), beside(x))


@pytest.mark.skipif(not HAS_INT4_KERNEL, reason="no int4 packed kernel in this torch build")
def test_a_packer_refusal_after_packing_in_place_is_an_error_not_a_fallback(monkeypatch, without_native):
    monkeypatch.setattr(quant, "_CHUNK_ELEMENTS", 64 * 256)
    kernel = int4_kernel_available("cpu")
    slabs = []
    real = type(kernel)._pack_slab

    def refuse_the_second(self, packed):
        slabs.append(packed.shape[0])
        if len(slabs) == 2:
            raise RuntimeError("refused")
        return real(self, packed)

    monkeypatch.setattr(type(kernel), "_pack_slab", refuse_the_second)
    with pytest.raises(KernelUnavailableError, match="rows 64..127 .* after packing the rows before them"):
        Int4Linear(quantize_int4(weight("normal", (256, 256)), 64), pack_in_place=True)
    slabs.clear()
    fallback = Int4Linear(quantize_int4(weight("normal", (256, 256)), 64))  # beside the codes: they are still there
    assert not fallback.uses_kernel


@pytest.mark.skipif(not HAS_INT4_KERNEL, reason="no int4 packed kernel in this torch build")
def test_kernel_packing_in_slabs_matches_packing_whole(monkeypatch):
    lin = make_linear(64 * 5 + 16, 256, False, torch.float32)  # the last slab is a partial block
    whole = Int4Linear.from_linear(lin, 64, use_kernel=True)
    monkeypatch.setattr(quant, "_CHUNK_ELEMENTS", 64 * 256)  # slabs of 64 rows
    slabs = Int4Linear.from_linear(lin, 64, use_kernel=True)
    assert torch.equal(whole.packed, slabs.packed)
    x = torch.randn(2, 256)
    assert torch.equal(whole(x), slabs(x))


def test_int4_packing_order_is_low_nibble_even_column():
    ramp = torch.arange(16, dtype=torch.float32)[None, :]  # codes 0..15 exactly: step 1, zero 8
    q = quantize_int4(ramp, 16)
    assert q.scales.float().item() == 1.0 and q.zeros.float().item() == 8.0
    assert q.packed.tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]]
    assert unpack_int4(torch.tensor([[0x21, 0xF0]], dtype=torch.uint8)).tolist() == [[1, 2, 0, 15]]
    assert torch.equal(dequantize_int4(q), ramp)


def test_int4_pads_in_features_with_the_last_column():
    w = weight("normal", (4, 100))
    q = quantize_int4(w, 64)  # 100 -> 2 groups, 128 columns stored
    assert q.padded_in_features == 128 and q.groups == 2
    codes = unpack_int4(q.packed)
    # the padding repeats the last real column, so the last group's range (and step) is the real columns' only
    assert bool((codes[:, 100:] == codes[:, 99:100]).all())
    tail = w[:, 64:]
    ideal = (tail.amax(1) - tail.amin(1)) / 15
    assert bool((q.scales[:, 1].float() < ideal * 1.02).all())


@pytest.mark.parametrize("group_size", [0, -32, 3, 33, 2.0])
def test_int4_rejects_bad_group_sizes(group_size):
    with pytest.raises(QuantizationError, match="group_size"):
        quantize_int4(weight("normal", (4, 64)), group_size)
    with pytest.raises(QuantizationError, match="group_size"):
        quantized_nbytes((4, 64), "int4", group_size)


def test_int4_weight_validates_its_metadata():
    q = quantize_int4(weight("normal", (8, 64)), 32)
    with pytest.raises(QuantizationError, match="packing"):
        Int4Weight(q.packed, q.scales, q.zeros, q.shape, q.group_size, packing="high nibble = even column")
    with pytest.raises(QuantizationError, match="packed"):
        Int4Weight(q.packed, q.scales, q.zeros, (8, 128), q.group_size)
    with pytest.raises(QuantizationError, match="scales"):
        Int4Weight(q.packed, q.scales.float(), q.zeros, q.shape, q.group_size)
    with pytest.raises(QuantizationError, match="scale"):
        Int8Weight(torch.zeros(2, 3, dtype=torch.int8), torch.zeros(3), (2, 3))


def test_quantized_nbytes_table():
    assert quantized_nbytes((896, 896), "fp16") == 896 * 896 * 2
    assert quantized_nbytes((896, 896), "int8") == 896 * 896 + 896 * 4
    assert quantized_nbytes((896, 896), "int4") == 896 * 448 + 896 * 7 * 4
    assert quantized_nbytes((896, 896), "int4", 64) == 896 * 448 + 896 * 14 * 4
    assert quantized_nbytes((10, 100), "int4", 64) == 10 * 64 + 10 * 2 * 4  # padded to 128 columns
    with pytest.raises(QuantizationError, match="int2"):
        quantized_nbytes((4, 4), "int2")


# ----------------------------------------------------------------------------------------------- modules

PATHS = [
    pytest.param(False, id="portable"),
    pytest.param(True, id="kernel", marks=pytest.mark.skipif(not (HAS_INT8_KERNEL and HAS_INT4_KERNEL),
                                                             reason="no packed kernels in this torch build")),
]
INPUT_SHAPES = [pytest.param((1, 1), id="decode[1,1,in]"), pytest.param((1, 9), id="prefill[1,9,in]"),
                pytest.param((5,), id="2d[5,in]"), pytest.param((), id="1d[in]")]
# (out, in, group size): a plain case, and one whose in_features needs padding to whole groups
LAYER_SHAPES = [pytest.param((64, 256, 64), id="64x256"), pytest.param((48, 208, 32), id="48x208-padded")]


def make_linear(out_f: int, in_f: int, bias: bool, dtype: torch.dtype, seed: int = 0) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(in_f, out_f, bias=bias).requires_grad_(False)
    lin.weight.copy_(torch.randn(out_f, in_f, generator=gen) * 0.05)
    if bias:
        lin.bias.copy_(torch.randn(out_f, generator=gen))
    return lin.to(dtype)


def reference(x: torch.Tensor, deq: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ deq.T
    return y if bias is None else y + bias.float()


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.detach().float() - ref.detach()).norm() / ref.detach().norm())


# fp32 activations on the portable path compute what the reference computes, up to float32 rounding; anything
# that rounds activations or weights to bfloat16 (bf16 inputs, or the packed kernels, which run in bf16) is
# held to bfloat16's precision over a dot product.
def tolerance(dtype: torch.dtype, kernel: bool) -> float:
    return 1e-5 if dtype == torch.float32 and not kernel else 1e-2


@pytest.mark.parametrize("kernel", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lead", INPUT_SHAPES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("layer", LAYER_SHAPES)
def test_int8_linear_matches_the_reference(kernel, dtype, lead, bias, layer):
    out_f, in_f, _ = layer
    lin = make_linear(out_f, in_f, bias, dtype)
    m = Int8Linear.from_linear(lin, use_kernel=kernel)
    assert m.uses_kernel is kernel and (m.in_features, m.out_features) == (in_f, out_f)
    x = torch.randn(*lead, in_f).to(dtype)
    y = m(x)
    assert y.shape == (*lead, out_f) and y.dtype == dtype
    ref = reference(x, dequantize_int8(quantize_int8(lin.weight)), lin.bias)
    assert rel_err(y, ref) < tolerance(dtype, kernel)


@pytest.mark.parametrize("kernel", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lead", INPUT_SHAPES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("layer", LAYER_SHAPES)
def test_int4_linear_matches_the_reference(kernel, dtype, lead, bias, layer):
    out_f, in_f, group_size = layer
    lin = make_linear(out_f, in_f, bias, dtype)
    m = Int4Linear.from_linear(lin, group_size, use_kernel=kernel)
    assert m.uses_kernel is kernel and (m.in_features, m.out_features) == (in_f, out_f)
    x = torch.randn(*lead, in_f).to(dtype)
    y = m(x)
    assert y.shape == (*lead, out_f) and y.dtype == dtype
    ref = reference(x, dequantize_int4(quantize_int4(lin.weight, group_size)), lin.bias)
    assert rel_err(y, ref) < tolerance(dtype, kernel)


def test_quantized_linears_are_close_to_the_float_layer():
    lin = make_linear(128, 512, True, torch.float32)
    x = torch.randn(4, 512)
    exact = lin(x)
    assert rel_err(Int8Linear.from_linear(lin)(x), exact) < 0.01
    assert rel_err(Int4Linear.from_linear(lin, 128)(x), exact) < 0.15


def test_the_paths_read_a_non_contiguous_misaligned_input():
    lin = make_linear(64, 256, False, torch.bfloat16)
    base = torch.randn(3, 257).to(torch.bfloat16)
    x = base[:, 1:]  # every row starts 2 bytes past an aligned address; rows are not contiguous
    ref = reference(x, lin.weight.float(), None)
    for m in (Int8Linear.from_linear(lin), Int4Linear.from_linear(lin, 64)):
        assert rel_err(m(x), ref) < 0.15


def test_kernel_demanded_where_there_is_none_is_a_clear_error():
    with pytest.raises(KernelUnavailableError, match="multiple of 16"):
        Int8Linear.from_linear(make_linear(8, 100, False, torch.float32), use_kernel=True)
    with pytest.raises(KernelUnavailableError, match="group size"):
        Int4Linear.from_linear(make_linear(24, 96, False, torch.float32), 32, use_kernel=True)  # out % 16
    with pytest.raises(KernelUnavailableError, match="group size"):
        Int4Linear.from_linear(make_linear(32, 96, False, torch.float32), 48, use_kernel=True)
    # and the default quietly takes the portable path for the same layers
    assert not Int8Linear.from_linear(make_linear(8, 100, False, torch.float32)).uses_kernel
    assert not Int4Linear.from_linear(make_linear(32, 96, False, torch.float32), 48).uses_kernel


@pytest.mark.skipif(not (HAS_INT8_KERNEL and HAS_INT4_KERNEL), reason="no packed kernels in this torch build")
def test_default_path_on_cpu_is_the_kernel_for_model_shapes():
    lin = make_linear(128, 896, True, torch.bfloat16)
    for mode, layer in (("int8", Int8Linear.from_linear(lin)), ("int4", Int4Linear.from_linear(lin))):
        assert layer.path == ("native" if quant.native.faster_than_torch(mode) else "kernel")
        assert layer.uses_kernel is (layer.path == "kernel")


def test_without_native_kernels_the_default_path_is_pytorchs_kernel(without_native):
    lin = make_linear(128, 896, True, torch.bfloat16)
    assert Int8Linear.from_linear(lin).path == ("kernel" if HAS_INT8_KERNEL else "portable")
    assert Int4Linear.from_linear(lin).path == ("kernel" if HAS_INT4_KERNEL else "portable")


def aten_has(name: str) -> bool:
    try:
        getattr(torch.ops.aten, name)
    except AttributeError:
        return False
    return True


def test_probes_find_the_cpu_kernels_this_torch_has():
    # a probe that says no while the op exists means our packing disagrees with the kernel: every kernel test
    # above would then be skipped, so this one must fail instead
    if aten_has("_weight_int8pack_mm"):
        assert HAS_INT8_KERNEL
    if aten_has("_convert_weight_to_int4pack_for_cpu") and aten_has("_weight_int4pack_mm_for_cpu"):
        assert HAS_INT4_KERNEL


def test_probes_say_no_for_a_device_that_cannot_run_kernels():
    assert int8_kernel_available("meta") is False
    assert int4_kernel_available("meta") is None


# ----------------------------------------------------------------------------------------------- memory


def quant_bytes(m: nn.Module) -> int:
    return sum(b.numel() * b.element_size() for name, b in m.named_buffers() if name != "bias") + \
        sum(p.numel() * p.element_size() for p in m.parameters())


@pytest.mark.parametrize("kernel", PATHS)
@pytest.mark.parametrize("layer", LAYER_SHAPES + [pytest.param((896, 896, DEFAULT_GROUP_SIZE), id="896x896")])
def test_modules_hold_exactly_quantized_nbytes_and_no_float_weight(kernel, layer):
    out_f, in_f, group_size = layer
    lin = make_linear(out_f, in_f, True, torch.bfloat16)
    for mode, m in (("int8", Int8Linear.from_linear(lin, use_kernel=kernel)),
                    ("int4", Int4Linear.from_linear(lin, group_size, use_kernel=kernel))):
        assert quant_bytes(m) == quantized_nbytes((out_f, in_f), mode, group_size), (mode, dict(
            (n, (tuple(b.shape), b.dtype)) for n, b in m.named_buffers()))
        assert list(m.parameters()) == []
        for name, b in m.named_buffers():
            assert not (b.is_floating_point() and b.numel() >= out_f * in_f // 8), f"{mode} keeps float {name}"
        assert torch.equal(m.bias, lin.bias)


def test_casting_a_quantized_model_keeps_the_scales_dtype():
    model = nn.Sequential(make_linear(64, 256, True, torch.float32), make_linear(32, 64, False, torch.float32))
    quantize_linears(model, "int4", 64)
    before = quant_bytes(model[0]) + quant_bytes(model[1])
    model.to(torch.bfloat16)
    assert quant_bytes(model[0]) + quant_bytes(model[1]) == before
    assert model[0].bias.dtype == torch.bfloat16  # the bias follows the model, like nn.Linear's
    y = model(torch.randn(2, 256).to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and bool(torch.isfinite(y).all())


@pytest.mark.skipif(not HAS_INT8_KERNEL, reason="no int8 packed kernel in this torch build")
def test_a_moved_int8_layer_takes_the_path_its_new_device_offers(without_native):
    m = Int8Linear.from_linear(make_linear(64, 256, False, torch.float32))
    assert m.uses_kernel
    m.to("meta")  # a device type without the kernel
    assert not m.uses_kernel and m.qweight.device.type == "meta"
    m.to_empty(device="cpu")  # (meta tensors hold no data to copy back)
    assert m.uses_kernel
    forced = Int8Linear.from_linear(make_linear(64, 256, False, torch.float32), use_kernel=True)
    with pytest.raises(KernelUnavailableError):
        forced.to("meta")


@pytest.mark.skipif(not HAS_INT4_KERNEL, reason="no int4 packed kernel in this torch build")
def test_a_kernel_layout_refuses_to_move_to_another_device_type():
    m = Int4Linear.from_linear(make_linear(64, 256, False, torch.float32), 64, use_kernel=True)
    with pytest.raises(QuantizationError, match="quantize it there"):
        m.to("meta")
    Int4Linear.from_linear(make_linear(64, 256, False, torch.float32), 64, use_kernel=False).to("meta")


# ----------------------------------------------------------------------------------------------- quantize_linears


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = make_linear(64, 64, True, torch.float32, seed=1)
        self.mlp = nn.ModuleDict({"up_proj": make_linear(128, 64, False, torch.float32, seed=2),
                                  "down_proj": make_linear(64, 128, False, torch.float32, seed=3)})
        self.norm = nn.LayerNorm(64)

    def forward(self, x):
        h = x + self.q_proj(self.norm(x))
        return h + self.mlp["down_proj"](torch.relu(self.mlp["up_proj"](h)))


def nested() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), nn.ModuleList([Block()])[0], make_linear(16, 64, True, torch.float32, seed=4))


@pytest.mark.parametrize("mode,cls,tol", [("int8", Int8Linear, 0.01), ("int4", Int4Linear, 0.1)])
def test_quantize_linears_replaces_every_linear_and_stays_close(mode, cls, tol):
    model = nested()
    x = torch.randn(1, 5, 64)
    exact = model(x)
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    quantize_linears(model, mode, 32)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, cls) for m in model.modules()) == n_linear == 7
    assert rel_err(model(x), exact.float()) < tol


def test_quantize_linears_fp16_leaves_the_model_alone():
    model = nested()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    quantize_linears(model, "fp16", 128)
    assert [m for m in model.modules() if isinstance(m, nn.Linear)] == linears


def test_quantize_linears_keeps_a_shared_linear_shared():
    shared = make_linear(32, 32, False, torch.float32)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    quantize_linears(model, "int8", 32)
    assert isinstance(model[0], Int8Linear) and model[0] is model[2]


def test_quantize_linears_refuses_bad_requests():
    with pytest.raises(QuantizationError, match="int3"):
        quantize_linears(nested(), "int3", 128)
    with pytest.raises(QuantizationError, match="group_size"):
        quantize_linears(nested(), "int4", 5)
    with pytest.raises(QuantizationError, match="wrap"):
        quantize_linears(make_linear(4, 4, False, torch.float32), "int8", 128)


# ----------------------------------------------------------------------------------------------- int8 prefill


@pytest.mark.skipif(not HAS_INT8_KERNEL, reason="no int8 packed kernel in this torch build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lead", [(1, quant.PREFILL_MIN_ROWS), (quant.PREFILL_MIN_ROWS + 3,)], ids=["3d", "2d"])
def test_int8_prefill_through_converted_codes_matches_the_reference(dtype, lead):
    lin = make_linear(64, 256, True, dtype)
    dense = Int8Linear.from_linear(lin, use_kernel=True, dense_prefill=True)
    kernel = Int8Linear.from_linear(lin, use_kernel=True, dense_prefill=False)
    assert dense.uses_kernel and dense.dense_prefill_dtype == dtype and kernel.dense_prefill_dtype is None
    x = torch.randn(*lead, 256).to(dtype)
    ref = reference(x, dequantize_int8(quantize_int8(lin.weight)), lin.bias)
    y = dense(x)
    assert y.shape == (*lead, 64) and y.dtype == dtype
    assert rel_err(y, ref) < tolerance(dtype, kernel=False)  # the portable path's accuracy
    assert rel_err(kernel(x), ref) < tolerance(dtype, kernel=True)
    short = x.reshape(-1, 256)[:quant.PREFILL_MIN_ROWS - 1]  # fewer rows stay on the kernel
    assert torch.equal(dense(short), kernel(short))
    assert not torch.equal(y, kernel(x))  # the long input really took the other path


def test_int8_portable_product_in_slabs_changes_nothing(monkeypatch):
    lin = make_linear(64, 256, False, torch.bfloat16)
    m = Int8Linear.from_linear(lin, use_kernel=False)
    x = torch.randn(3, 256).bfloat16()
    whole = m(x)
    monkeypatch.setattr(quant, "_INT8_DENSE_SLAB_ROWS", 24)  # slabs of 24, 24 and 16 rows
    assert torch.equal(m(x), whole)


def test_int8_dense_prefill_is_never_chosen_without_a_kernel_or_a_dtype():
    lin = make_linear(64, 256, False, torch.float32)
    assert Int8Linear.from_linear(lin, use_kernel=False, dense_prefill=True).dense_prefill_dtype is None
    assert Int8Linear(quantize_int8(lin.weight), use_kernel=None).dense_prefill_dtype is None
