"""Dense linear layers: the blocked oneDNN and the native products against F.linear, the probe that chooses between
them, packing a model, quantizing a packed layer."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model_helpers import OurModel
from tc.model import dense, native
from tc.model.dense import PRODUCTS, Linear, NativeLinear, PackedLinear, fastest_product, pack_linears
from tc.model.quant import Int4Linear, Int8Linear, quantize_linears
from tiny_model import write_tiny_model


needs_pack = pytest.mark.skipif(not dense.can_pack(), reason="no oneDNN blocked bf16 linear on this CPU")
needs_native = pytest.mark.skipif(dense._native_bf16() is None, reason="no native bf16 product on this machine")


def make_linear(out_f: int, in_f: int, bias: bool, dtype: torch.dtype, seed: int = 0) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    lin = Linear(in_f, out_f, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5)
        if bias:
            lin.bias.copy_(torch.randn(out_f, generator=gen))
    return lin.requires_grad_(False)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@needs_pack
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(1,), (1, 1), (3, 5), (2, 7)])
def test_packed_product_equals_the_reference(bias, lead):
    dtype = torch.bfloat16
    lin = make_linear(96, 64, bias, dtype)
    packed = PackedLinear.from_linear(lin)
    x = torch.randn(*lead, 64).to(dtype)
    ref = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    y = packed(x)
    assert y.shape == (*lead, 96) and y.dtype == dtype
    assert rel_err(y, ref) < 1e-2
    assert rel_err(y, ref) <= 1.01 * rel_err(lin(x), ref) + 1e-6  # no worse than F.linear in the same dtype


@needs_pack
def test_packed_product_reads_a_strided_input():
    lin = make_linear(96, 64, True, torch.bfloat16)
    x = torch.randn(3, 5, 128).bfloat16()[..., ::2]  # [3, 5, 64], every other column
    assert not x.is_contiguous()
    y = PackedLinear.from_linear(lin)(x)
    assert torch.equal(y, PackedLinear.from_linear(lin)(x.contiguous()))
    assert rel_err(y, F.linear(x.float(), lin.weight.float(), lin.bias.float())) < 1e-2


@needs_pack
def test_a_packed_layer_gives_its_weight_back_and_holds_only_its_bytes():
    lin = make_linear(96, 64, True, torch.bfloat16)
    packed = PackedLinear.from_linear(lin)
    assert torch.equal(packed.dense_weight(), lin.weight)
    assert list(packed.parameters()) == []
    held = sum(b.numel() * b.element_size() for name, b in packed.named_buffers() if name != "bias")
    assert held == lin.weight.numel() * lin.weight.element_size()


@needs_pack
def test_a_packed_layer_refuses_to_change_dtype_or_device():
    packed = PackedLinear.from_linear(make_linear(32, 32, False, torch.bfloat16))
    for move in (lambda m: m.float(), lambda m: m.to("meta")):
        with pytest.raises(ValueError, match="before packing"):
            move(packed)
    packed.to("cpu")  # where it already is: nothing to do


def test_packed_linear_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="2-D CPU weight"):
        PackedLinear(torch.ones(4, 4))  # fp32 stays on F.linear
    with pytest.raises(ValueError, match="2-D CPU weight"):
        PackedLinear(torch.ones(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="2-D CPU weight"):
        PackedLinear(torch.ones(4, dtype=torch.bfloat16))


def test_fp32_is_never_packed():
    assert fastest_product(896, 896, torch.float32) == "plain"
    model = nn.Sequential(make_linear(64, 64, True, torch.float32))
    assert pack_linears(model, force=True) == 0 and isinstance(model[0], Linear)


@needs_pack
def test_pack_linears_packs_only_cpu_bf16_and_keeps_sharing():
    shared = make_linear(32, 32, False, torch.bfloat16)
    model = nn.Sequential(shared, nn.ReLU(), shared, make_linear(16, 32, True, torch.float32))
    assert pack_linears(model, force=True) == 1
    assert isinstance(model[0], PackedLinear) and model[0] is model[2]
    assert isinstance(model[3], Linear)
    untouched = nn.Sequential(make_linear(32, 32, False, torch.bfloat16))
    assert pack_linears(untouched, force=False) == 0 and isinstance(untouched[0], Linear)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("layer", [pytest.param("packed", marks=needs_pack),
                                   pytest.param("native", marks=needs_native)])
def test_quantizing_a_packed_or_native_layer_gives_the_same_codes(mode, layer):
    lin = make_linear(64, 256, True, torch.bfloat16)
    fast = (PackedLinear if layer == "packed" else NativeLinear).from_linear(lin)
    plain, fast = nn.Sequential(lin), nn.Sequential(fast)
    quantize_linears(plain, mode, 64)
    quantize_linears(fast, mode, 64)
    cls = Int8Linear if mode == "int8" else Int4Linear
    assert isinstance(fast[0], cls)
    a, b = dict(plain[0].named_buffers()), dict(fast[0].named_buffers())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_can_pack_says_whether_a_packed_layer_can_be_made():
    try:
        PackedLinear(torch.ones(16, 16, dtype=torch.bfloat16))
        made = True
    except RuntimeError:  # an AVX2-only CPU: oneDNN has no bf16 path for the blocked layout
        made = False
    assert dense.can_pack() == made


def test_forced_packing_where_this_cpu_cannot_pack_leaves_the_layers_plain(monkeypatch):
    monkeypatch.setattr(dense, "can_pack", lambda dtype=torch.bfloat16: False)
    model = nn.Sequential(make_linear(32, 64, True, torch.bfloat16), make_linear(64, 32, False, torch.bfloat16))
    assert pack_linears(model, force=True) == 0
    assert all(type(m) is Linear for m in model)


@needs_pack
def test_a_packed_model_follows_the_plain_one(tiny_model_dir):
    ids = [5, 77, 200, 13, 42, 42, 9, 250, 31, 120]
    plain = OurModel(tiny_model_dir, torch.bfloat16, pack=False)
    packed = OurModel(tiny_model_dir, torch.bfloat16, pack=True)
    assert sum(isinstance(m, PackedLinear) for m in packed.stages[0].modules()) == 4 * 4  # 4 products x 4 layers
    assert isinstance(packed.head.lm_head, PackedLinear)
    assert not any(isinstance(m, PackedLinear) for m in plain.stages[0].modules())
    full, split = packed.full_logits(ids), packed.cached_logits(ids, split=4)
    reference = plain.full_logits(ids)
    assert rel_err(full, reference) < 1e-2
    assert rel_err(split, full) < 1e-2


@pytest.mark.parametrize("pack", [True, None])
def test_an_lm_head_tied_to_the_embedding_stays_one_matrix(tmp_path, pack):
    model_dir = write_tiny_model(tmp_path, seed=3, tie_word_embeddings=True)
    head = OurModel(model_dir, torch.bfloat16, pack=pack).head
    assert type(head.lm_head) in (Linear, NativeLinear) and not isinstance(head.lm_head, PackedLinear)
    assert head.lm_head.weight.data_ptr() == head.embed_tokens.weight.data_ptr()


@needs_native
def test_an_lm_head_tied_to_the_embedding_may_take_the_native_product(tmp_path, monkeypatch):
    model_dir = write_tiny_model(tmp_path, seed=3, tie_word_embeddings=True)
    asked = []
    monkeypatch.setattr(dense, "fastest_product", lambda out_f, in_f, dtype, allowed: asked.append(allowed) or "native")
    head = OurModel(model_dir, torch.bfloat16, pack=None).head
    assert type(head.lm_head) is NativeLinear and "packed" not in asked[0]  # the head loads first
    assert head.lm_head.weight.data_ptr() == head.embed_tokens.weight.data_ptr()
    x = torch.randn(1, 1, head.config.hidden_size).bfloat16()
    ref = F.linear(x.float(), head.embed_tokens.weight.float())
    assert rel_err(head.lm_head(x), ref) < 1e-2


@needs_pack
def test_the_head_packs_its_lm_head_only_when_asked(tiny_model_dir):
    from tc.model.config import Qwen2Config
    from tc.model.qwen2 import HeadModel
    from tc.model.weights import WeightIndex

    config = Qwen2Config.from_file(tiny_model_dir / "config.json")
    index = WeightIndex.open(tiny_model_dir)
    # by default not: the head process quantizes its lm_head after loading in int8 and int4
    assert isinstance(HeadModel.load(config, index, torch.bfloat16).lm_head, Linear)
    assert isinstance(HeadModel.load(config, index, torch.bfloat16, pack=True).lm_head, PackedLinear)


@pytest.mark.parametrize("quant, kind", [("fp16", None), ("int8", Int8Linear), ("int4", Int8Linear)])
def test_the_head_process_packs_an_lm_head_that_stays_in_bf16_where_that_is_faster(tmp_path, tiny_model_dir, quant,
                                                                                   kind):
    """As the single-process generator does: a bf16 lm_head takes the product this CPU's probe finds fastest (of
    the plain and the native one where a greedy screen can take it, since the blocked layout would leave the
    screen no plain rows to read); a quantized one (int8 under int4 too) is quantized instead."""
    from cluster import write_topology
    from tc.head.main import start_head
    from tc.topology import load_topology

    path = write_topology(tmp_path / "t.yaml", tiny_model_dir, [{"id": "a", "device": "cpu"}], quant=quant,
                          dtype="bf16")
    head = start_head(load_topology(path).with_ports(api_port=0, listen_port=0))
    try:
        lm_head = head.service.generator.head.lm_head
        if kind is None:
            screenable = native.kernels() is not None and native.shape_ok_int8(lm_head.out_features,
                                                                              lm_head.in_features)
            product = fastest_product(lm_head.out_features, lm_head.in_features, torch.bfloat16,
                                      ("plain", "native") if screenable else PRODUCTS)
            kind = {"plain": Linear, "packed": PackedLinear, "native": NativeLinear}[product]
        assert type(lm_head) is kind
    finally:
        head.stop()



@needs_native
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(1,), (1, 1), (1, 8), (3, 2), (1, 9), (2, 40)])  # decode rows, then F.linear's
def test_native_layer_equals_the_reference_and_hands_larger_inputs_to_f_linear(bias, lead, monkeypatch):
    lin = make_linear(96, 64, bias, torch.bfloat16)
    layer = NativeLinear.from_linear(lin)
    assert layer.weight.data_ptr() == lin.weight.data_ptr()  # the same plain weight, not a copy
    calls = []
    kernels = layer._kernels
    monkeypatch.setattr(layer, "_kernels", type("Counting", (), {
        "bf16_rows_per_pass": kernels.bf16_rows_per_pass,
        "bf16_product": lambda self, *args: calls.append(args) or kernels.bf16_product(*args)})())
    x = torch.randn(*lead, 64).bfloat16()
    ref = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    y = layer(x)
    assert y.shape == (*lead, 96) and y.dtype == torch.bfloat16
    assert rel_err(y, ref) < 1e-2
    rows = x.numel() // 64
    assert len(calls) == (1 if rows <= kernels.bf16_rows_per_pass else 0)
    if not calls:
        assert torch.equal(y, lin(x))  # F.linear's own result


@needs_native
def test_native_layer_whose_weight_or_input_changed_shape_takes_f_linear():
    lin = make_linear(32, 64, True, torch.bfloat16)
    layer = NativeLinear.from_linear(lin)
    layer.weight = nn.Parameter(lin.weight.detach().t().contiguous().t(), requires_grad=False)  # column-major
    x = torch.randn(1, 64).bfloat16()
    assert not layer.weight.is_contiguous() and torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    layer.bias = nn.Parameter(lin.bias.detach().float(), requires_grad=False)
    with pytest.raises(RuntimeError):  # F.linear's own refusal of a float32 bias, not a wrong answer
        layer(x)
    with pytest.raises(RuntimeError):
        NativeLinear.from_linear(lin)(torch.randn(1, 32).bfloat16())  # an input of another width


def _probed(monkeypatch, one, few, block):
    """fastest_product's choice for probe times given as {product: us} for 1 / 8 / 64 rows."""
    monkeypatch.setattr(dense, "_probe", lambda out_f, in_f, dtype: (one, few, block))


@pytest.mark.parametrize("one, few, block, allowed, expected", [
    # native fastest on one row, within the slacks: native
    ({"plain": 100, "packed": 80, "native": 50}, {"plain": 400, "packed": 300, "native": 330},
     {"plain": 2000, "packed": 1900, "native": 2000}, dense.PRODUCTS, "native"),
    # native loses the batch step to F.linear by more than FEW_SLACK: the blocked product
    ({"plain": 100, "packed": 80, "native": 50}, {"plain": 400, "packed": 300, "native": 900},
     {"plain": 2000, "packed": 1900, "native": 2000}, dense.PRODUCTS, "packed"),
    # native is judged against F.linear, whose prefill it leaves to it: a blocked product far faster on the batch
    # step and the prefill (which rules F.linear out) does not rule out the native product's one-row lead
    ({"plain": 100, "packed": 80, "native": 50}, {"plain": 400, "packed": 150, "native": 330},
     {"plain": 2000, "packed": 900, "native": 2000}, dense.PRODUCTS, "native"),
    ({"plain": 100, "packed": 80}, {"plain": 400, "packed": 150}, {"plain": 2000, "packed": 900}, dense.PRODUCTS,
     "packed"),
    # ... unless the blocked product may not be taken (a tied lm_head): it is not measured against it
    ({"plain": 100, "packed": 80, "native": 50}, {"plain": 400, "packed": 300, "native": 390},
     {"plain": 2000, "packed": 1900, "native": 2000}, ("plain", "native"), "native"),
    # a near tie on one row goes to the native product where it is in it (a plan calls it directly), though the
    # blocked product is faster on the batch step
    ({"plain": 100, "packed": 50, "native": 53}, {"plain": 400, "packed": 150, "native": 330},
     {"plain": 2000, "packed": 1900, "native": 2000}, dense.PRODUCTS, "native"),
    # a near tie on one row goes to the faster batch step, a full tie to F.linear
    ({"plain": 100, "packed": 99}, {"plain": 400, "packed": 350}, {"plain": 2000, "packed": 2000}, dense.PRODUCTS,
     "packed"),
    ({"plain": 100, "packed": 99}, {"plain": 400, "packed": 400}, {"plain": 2000, "packed": 2900}, dense.PRODUCTS,
     "plain"),
    # a blocked prefill several times slower (a CPU without bf16 arithmetic) disqualifies it
    ({"plain": 100, "packed": 50}, {"plain": 400, "packed": 300}, {"plain": 2000, "packed": 9000}, dense.PRODUCTS,
     "plain"),
])
def test_the_probe_rule(monkeypatch, one, few, block, allowed, expected):
    _probed(monkeypatch, one, few, block)
    assert fastest_product(4096, 896, torch.bfloat16, allowed) == expected


@needs_native
def test_native_layer_in_fp32_or_moved_takes_f_linear():
    lin = make_linear(32, 64, True, torch.bfloat16)
    layer = NativeLinear.from_linear(lin).float()
    x = torch.randn(1, 64)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_the_probe_names_a_product_and_pack_linears_gives_it(caplog):
    product = fastest_product(256, 128, torch.bfloat16)
    assert product in PRODUCTS
    if product == "native":
        assert dense._native_bf16() is not None
    model = nn.Sequential(make_linear(256, 128, True, torch.bfloat16))
    replaced = pack_linears(model)
    kind = {"plain": Linear, "packed": PackedLinear, "native": NativeLinear}[product]
    assert type(model[0]) is kind and replaced == (product != "plain")
    x = torch.randn(1, 1, 128).bfloat16()
    assert rel_err(model[0](x), F.linear(x.float(), model[0].weight.float() if kind is not PackedLinear
                                         else model[0].dense_weight().float(), model[0].bias.float())) < 1e-2


@needs_native
def test_a_native_model_follows_the_plain_one(tiny_model_dir, monkeypatch):
    """The tiny model with every bf16 product native where it can be: its cached decode (one row a step, the native
    kernel) follows the plain model's full pass, and each of its products was native."""
    monkeypatch.setattr(dense, "fastest_product", lambda out_f, in_f, dtype, allowed: "native")
    ids = [5, 77, 200, 13, 42, 42, 9, 250, 31, 120]
    plain = OurModel(tiny_model_dir, torch.bfloat16, pack=False)
    fast = OurModel(tiny_model_dir, torch.bfloat16, pack=None)
    assert sum(isinstance(m, NativeLinear) for m in fast.stages[0].modules()) == 4 * 4  # 4 products x 4 layers
    assert isinstance(fast.head.lm_head, NativeLinear)
    reference = plain.full_logits(ids)
    assert rel_err(fast.full_logits(ids), reference) < 1e-2
    assert rel_err(fast.cached_logits(ids, split=1), reference) < 2e-2


def test_pack_linears_logs_each_shapes_product_once_a_process(monkeypatch, caplog):
    import logging

    monkeypatch.setattr(dense, "_logged_choices", {})
    monkeypatch.setattr(dense, "fastest_product", lambda out_f, in_f, dtype, allowed: "plain")

    def layer() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(16, 8, dtype=torch.bfloat16),
                                   torch.nn.Linear(8, 16, dtype=torch.bfloat16))

    with caplog.at_level(logging.INFO, logger="tc.model.dense"):
        for _ in range(3):  # a stage's layers, one after another
            pack_linears(layer())
        dense._logged_choices[8, 16] = "native"  # as if another stage had logged another choice for a shape
        pack_linears(layer())
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("bf16 products")]
    assert said == ["bf16 products: [8, 16] plain, [16, 8] plain", "bf16 products: [8, 16] plain"]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows_per_slab", [5, 23, 1000])  # several slabs with a short last one, exactly one, one
def test_float_linear_is_the_fp32_product_rounded_to_bf16_slab_by_slab(monkeypatch, bias, rows_per_slab):
    lin = make_linear(23, 40, bias, torch.bfloat16, seed=3)
    monkeypatch.setattr(dense, "UPCAST_SLAB_BYTES", 4 * 40 * rows_per_slab)
    x = torch.randn(2, 9, 40, generator=torch.Generator().manual_seed(4)).bfloat16()
    ran = []  # on a thread of its own, whose buffer no earlier call grew
    thread = threading.Thread(target=lambda: ran.append((dense.float_linear(x, lin.weight, lin.bias),
                                                         dense._upcast.buffer.numel())))
    thread.start()
    thread.join()
    got, kept = ran[0]
    want = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float()).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == (2, 9, 23)
    # each slab's fp32 sums may be ordered otherwise than the whole product's: at most one bf16 rounding apart
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-5)
    assert kept == 40 * min(23, rows_per_slab)  # a slab's worth is kept, no more


def test_float_linear_keeps_its_buffer_per_thread_and_leaves_the_weight_alone():
    lin = make_linear(64, 48, False, torch.bfloat16, seed=5)
    before = lin.weight.clone()
    x = torch.randn(8, 48, generator=torch.Generator().manual_seed(6)).bfloat16()
    first = dense.float_linear(x, lin.weight, None)
    kept = dense._upcast.buffer.data_ptr()
    assert torch.equal(dense.float_linear(x, lin.weight, None), first)
    assert dense._upcast.buffer.data_ptr() == kept  # the same buffer again, not a fresh copy each call
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append((dense.float_linear(x, lin.weight, None),
                                                               dense._upcast.buffer.data_ptr())))
    thread.start()
    thread.join()
    assert torch.equal(elsewhere[0][0], first) and elsewhere[0][1] != kept  # another thread, its own buffer
    assert torch.equal(lin.weight, before)


def test_linear_takes_the_fp32_product_for_many_bf16_rows_where_bf16_matmul_is_slow(monkeypatch):
    lin = make_linear(24, 32, True, torch.bfloat16, seed=7)
    monkeypatch.setattr(dense, "cpu_bf16_matmul_is_slow", lambda: True)
    many = torch.randn(1, dense.UPCAST_MIN_TOKENS, 32, generator=torch.Generator().manual_seed(8)).bfloat16()
    assert torch.equal(lin(many), dense.float_linear(many, lin.weight, lin.bias))
    few = many[:, :dense.UPCAST_MIN_TOKENS - 1]  # a decode step's rows stay in bf16: memory-bound, fewer bytes
    assert torch.equal(lin(few), F.linear(few, lin.weight, lin.bias))


def test_float_linear_serves_calls_in_and_out_of_inference_mode_on_one_thread():
    # a worker's first prefill runs under inference_mode, a layer's speed probe later under no_grad: the buffer
    # made by the first must take the second's weight (an inference tensor could not be written outside it)
    lin = make_linear(32, 40, True, torch.bfloat16, seed=9).requires_grad_(True)
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(10)).bfloat16()
    ran = []

    def calls() -> None:
        with torch.inference_mode():
            ran.append(dense.float_linear(x, lin.weight, lin.bias))
        with torch.no_grad():
            ran.append(dense.float_linear(x, lin.weight, lin.bias))
        ran.append(dense.float_linear(x, lin.weight, lin.bias))
        ran.append(dense._upcast.buffer)

    thread = threading.Thread(target=calls)
    thread.start()
    thread.join()
    assert len(ran) == 4, "a call raised on the thread"
    assert torch.equal(ran[0], ran[1]) and torch.equal(ran[1], ran[2])
    assert not ran[3].is_inference() and not ran[3].requires_grad and ran[3].grad_fn is None
