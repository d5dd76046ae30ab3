"""A decode step as one list of native calls (tc/model/decode_plan.py): the modules' bits, in every weight mode and
for batches, on the tiny model and the demo model; when a plan is made, kept, made again or not made at all."""
from __future__ import annotations

import copy

import pytest
import torch

from model_helpers import OurModel
from tiny_families import FAMILIES, write_family_model
from tc.model import dense, native, quant
from tc.model.decode_plan import DecodePlan
from tc.model.kv_cache import CacheFullError, KVCache
from tc.model.qwen2 import MLP, Attention, RMSNorm, Span, Stage

needs_kernels = pytest.mark.skipif(native.kernels() is None, reason="no native kernels on this machine (see the log)")
pytestmark = needs_kernels
MODES = ["bf16", "int8", "int4"]


@pytest.fixture
def native_parts(monkeypatch):
    """Every part that can be native is: products (bf16, int8 and int4), norms, attention, activation; the
    modules' own path then makes exactly the plan's calls, whatever this machine's probes would choose."""
    monkeypatch.setattr(dense, "fastest_product", lambda out_f, in_f, dtype, allowed: "native")
    monkeypatch.setattr(native, "faster_than_torch", lambda mode: True)
    for cls, flag in ((RMSNorm, "native"), (Attention, "native_decode"), (MLP, "native_act")):
        monkeypatch.setattr(cls, flag, True)


def tiny_stage(model_dir, mode: str) -> Stage:
    stage = OurModel(model_dir, torch.bfloat16).stages[0]
    if mode != "bf16":
        quant.quantize_linears(stage, mode, 32)
    return stage


def prefilled(stage: Stage, lengths: list[int], capacity: int, seed: int):
    """A cache per sequence, prefilled with `lengths[i]` random rows through the modules."""
    gen = torch.Generator().manual_seed(seed)
    caches = []
    for n in lengths:
        cache = stage.new_cache(capacity, torch.bfloat16, "cpu")
        stage(torch.randn(1, n, stage.config.hidden_size, generator=gen).bfloat16(), cache, 0)
        caches.append(cache)
    return caches


def steps(stage: Stage, caches, rows: torch.Tensor, count: int, planned: bool, monkeypatch) -> list[torch.Tensor]:
    """`count` decode steps of every cache at once (one row each), through a plan or the modules."""
    monkeypatch.setattr(Stage, "decode_plans", planned)
    outs, hidden = [], rows
    for _ in range(count):
        spans = [Span(c, c.length, 1) for c in caches]
        hidden = stage.forward_batch(hidden, spans)
        outs.append(hidden)
    return outs


def plans(stage: Stage) -> list:
    return list(stage._plans.values())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lengths", [[5], [3, 9, 1]], ids=["one sequence", "a batch of three"])
def test_a_plan_gives_the_modules_bits_and_caches(tiny_model_dir, native_parts, monkeypatch, mode, lengths):
    stage = tiny_stage(tiny_model_dir, mode)
    rows = torch.randn(1, len(lengths), 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    by_modules = prefilled(stage, lengths, 16, seed=1)
    by_plan = prefilled(stage, lengths, 16, seed=1)
    expected = steps(stage, by_modules, rows, 3, False, monkeypatch)
    calls = []
    kernel_norm = native.Kernels.rms_norm
    monkeypatch.setattr(native.Kernels, "rms_norm", lambda self, *a: calls.append(1) or kernel_norm(self, *a))
    got = steps(stage, by_plan, rows, 3, True, monkeypatch)
    assert calls == []  # the modules were not called
    assert [p.rows for p in plans(stage) if p is not None and p.rows == len(lengths)] == [len(lengths)]
    for ours, theirs in zip(got, expected):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(by_plan, by_modules):
        assert ours.length == theirs.length == lengths[by_plan.index(ours)] + 3
        assert torch.equal(ours.kv[..., :ours.length, :], theirs.kv[..., :theirs.length, :])


def test_a_plan_step_past_the_cache_raises_as_the_modules_do(tiny_model_dir, native_parts, monkeypatch):
    stage = tiny_stage(tiny_model_dir, "int8")
    (cache,) = prefilled(stage, [4], 5, seed=2)
    row = torch.randn(1, 1, 64).bfloat16()
    stage.forward_batch(row, [Span(cache, 4, 1)])  # the last position: fine
    assert isinstance(plans(stage)[0], DecodePlan)
    kept = cache.kv.clone()
    with pytest.raises(CacheFullError, match="position 5 is past"):
        stage.forward_batch(row, [Span(cache, 5, 1)])
    assert cache.length == 5 and torch.equal(cache.kv, kept)  # nothing written


def test_a_plan_steps_past_the_rotary_tables_first_size_and_refuses_a_cache_of_other_layers(tiny_model_dir,
                                                                                             native_parts,
                                                                                             monkeypatch):
    stage = tiny_stage(tiny_model_dir, "int4")
    row = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    ways = []
    for planned in (True, False):
        (cache,) = prefilled(stage, [255], 260, seed=5)  # the steps at 255-257 cross the tables' first 256
        ways.append(steps(stage, [cache], row, 3, planned, monkeypatch))
    assert all(a.equal(b) for a, b in zip(*ways)) and stage.rotary.size > 256
    assert isinstance(plans(stage)[0], DecodePlan)
    monkeypatch.setattr(Stage, "decode_plans", True)
    other = KVCache([5, 6], stage.config.num_key_value_heads, stage.config.head_dim, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="a cache of layers"):
        stage.forward_batch(row, [Span(other, 0, 1)])


def test_a_plan_follows_its_modules_and_a_copy_starts_afresh(tiny_model_dir, native_parts, monkeypatch):
    """A plan holds addresses: replacing a module or moving a weight makes a new one, with the new bits."""
    stage = tiny_stage(tiny_model_dir, "bf16")
    row = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(3)).bfloat16()

    def step(planned: bool) -> torch.Tensor:
        (cache,) = prefilled(stage, [6], 8, seed=3)
        return steps(stage, [cache], row, 1, planned, monkeypatch)[0]

    first = step(True)
    made = plans(stage)[0]
    assert step(True).equal(first) and plans(stage)[0] is made  # kept while current
    quant.quantize_linears(stage.layers["2"], "int8")  # one layer's modules replaced
    assert step(True).equal(step(False)) and not step(True).equal(first)
    remade = plans(stage)[0]
    assert remade is not made
    mlp = stage.layers["1"].mlp
    mlp.down_proj.weight.data = mlp.down_proj.weight.data * 2  # the same parameter, its data elsewhere
    assert step(True).equal(step(False)) and plans(stage)[0] is not remade
    stage.layers["0"] = copy.deepcopy(stage.layers["0"])  # a whole layer replaced
    again = plans(stage)[0]
    assert step(True).equal(step(False)) and plans(stage)[0] is not again
    twin = copy.deepcopy(stage)
    assert plans(twin) == []
    (cache,) = prefilled(twin, [6], 8, seed=3)
    assert steps(twin, [cache], row, 1, True, monkeypatch)[0].equal(step(True))


@pytest.mark.parametrize("kind", ["plain", pytest.param("packed", marks=pytest.mark.skipif(
    not dense.can_pack(), reason="no oneDNN blocked bf16 linear on this CPU"))])
def test_a_product_without_a_native_call_runs_as_its_module_in_the_plan(tiny_model_dir, native_parts, monkeypatch,
                                                                          kind):
    """Where a probe chose PyTorch's product for a shape, the plan calls that module: still the modules' bits."""
    monkeypatch.setattr(dense, "fastest_product", lambda out_f, in_f, dtype, allowed: "native" if out_f != 64 else kind)
    stage = tiny_stage(tiny_model_dir, "bf16")
    assert type(stage.layers["0"].self_attn.o_proj) is {"plain": dense.Linear, "packed": dense.PackedLinear}[kind]
    assert type(stage.layers["0"].self_attn.qkv_proj) is dense.NativeLinear
    rows = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(8)).bfloat16()
    expected = steps(stage, prefilled(stage, [4, 6], 12, seed=4), rows, 2, False, monkeypatch)
    got = steps(stage, prefilled(stage, [4, 6], 12, seed=4), rows, 2, True, monkeypatch)
    assert any(isinstance(p, DecodePlan) and p.rows == 2 for p in plans(stage))
    for ours, theirs in zip(got, expected):
        assert torch.equal(ours, theirs)


# families whose every layer a plan takes (the rest have a sliding window, normalised query and key heads, norms
# after a sublayer or scaling in fp32 (Gemma's, OLMo's, Helium's), Gemma's activation, rotation in fp32 (ERNIE's,
# Cohere's), a parallel block, or experts)
PLANNED_FAMILIES = {"qwen2-own-head-dim", "qwen2-linear-rope", "qwen2-yarn", "llama", "llama-dynamic-rope",
                    "llama3-rope-tied", "llama-biases", "granite", "smollm3", "phi3-longrope", "phi4-mini",
                    "qwen2.5-vl", "glm", "seed-oss"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_steps_to_the_modules_bits_and_only_plain_layers_make_plans(tmp_path, native_parts, monkeypatch,
                                                                                family):
    stage = OurModel(write_family_model(tmp_path, family, seed=2), torch.bfloat16).stages[0]
    rows = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(9)).bfloat16()
    expected = steps(stage, prefilled(stage, [7, 3], 12, seed=5), rows, 2, False, monkeypatch)
    got = steps(stage, prefilled(stage, [7, 3], 12, seed=5), rows, 2, True, monkeypatch)
    made = any(isinstance(p, DecodePlan) and p.rows == 2 for p in plans(stage))
    assert made == (family in PLANNED_FAMILIES)
    for ours, theirs in zip(got, expected):
        assert torch.equal(ours, theirs)


def test_a_plan_takes_the_small_kernels_where_their_probes_preferred_pytorch(tiny_model_dir, monkeypatch):
    """With every speed probe for the norm, attention and activation preferring PyTorch's operators, the modules
    use those, and a plan still takes the kernels (they agree with their references; there the alternative is the
    whole step through the modules): the same step up to the kernels' own roundings."""
    monkeypatch.setattr(native, "faster_than_torch", lambda mode: True)
    for probe in ("norm_faster_than_torch", "attention_faster_than_torch", "silu_mul_faster_than_torch"):
        monkeypatch.setattr(native, probe, lambda: False)
    stage = tiny_stage(tiny_model_dir, "int8")
    rows = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(10)).bfloat16()
    by_modules, by_plan = prefilled(stage, [5, 8], 12, seed=7), prefilled(stage, [5, 8], 12, seed=7)
    expected = steps(stage, by_modules, rows, 3, False, monkeypatch)
    got = steps(stage, by_plan, rows, 3, True, monkeypatch)
    assert any(isinstance(p, DecodePlan) and p.rows == 2 for p in plans(stage))
    for ours, theirs in zip(got, expected):
        assert float((ours.float() - theirs.float()).norm() / theirs.float().norm()) < 2e-2
    for ours, theirs in zip(by_plan, by_modules):
        assert ours.length == theirs.length
        written = ours.kv[..., :ours.length, :].float(), theirs.kv[..., :theirs.length, :].float()
        assert float((written[0] - written[1]).norm() / written[1].norm()) < 2e-2


@pytest.mark.parametrize("why", ["an fp32 stage", "norms told to keep PyTorch's",
                                 "more rows than the activation takes"])
def test_no_plan_where_a_part_would_not_be_native(tiny_model_dir, native_parts, monkeypatch, why):
    dtype = torch.float32 if why == "an fp32 stage" else torch.bfloat16
    stage = OurModel(tiny_model_dir, dtype).stages[0]
    lengths = [2] * (native.ACT_ROWS + 1 if why.startswith("more rows") else 1)
    if why.startswith("norms"):
        monkeypatch.setattr(RMSNorm, "native", False)
    caches = [stage.new_cache(4, dtype, "cpu") for _ in lengths]
    for cache in caches:
        stage(torch.randn(1, 2, 64).to(dtype), cache, 0)
    out = stage.forward_batch(torch.randn(1, len(lengths), 64).to(dtype), [Span(c, 2, 1) for c in caches])
    assert out.isfinite().all() and all(c.length == 3 for c in caches)
    assert all(p is None for p in plans(stage))  # asked and declined, or never asked (fp32)


@pytest.mark.demo
@pytest.mark.parametrize("mode", ["int4", "fp16"])
def test_demo_layers_step_through_a_plan_to_the_modules_bits(demo_model_dir, native_parts, monkeypatch, mode):
    """Four layers of the real model, loaded as a worker loads them: two sequences' steps through a plan are the
    modules' bits."""
    from tc.model.config import ModelConfig
    from tc.model.weights import WeightIndex

    config = ModelConfig.from_file(demo_model_dir / "config.json")
    quantization = None if mode == "fp16" else quant.Quantization(mode)
    stage = Stage.load(config, WeightIndex.open(demo_model_dir), 0, 4, torch.bfloat16, "cpu", quantization)
    rows = torch.randn(1, 2, config.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16()
    runs = {}
    for planned in (False, True):
        caches = prefilled(stage, [40, 7], 64, seed=6)
        runs[planned] = steps(stage, caches, rows, 4, planned, monkeypatch)
    assert [type(p) for p in plans(stage)] == [DecodePlan]
    for ours, theirs in zip(runs[True], runs[False]):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("mode", MODES)
def test_a_step_from_bytes_gives_the_tensor_steps_bits(tiny_model_dir, native_parts, monkeypatch, mode):
    """Stage.decode_bytes (a worker's hop: the wire's bytes in and out) is the plan's tensor step, bit for bit,
    cache included; its output is its own, not the plan's buffer that the next step overwrites."""
    stage = tiny_stage(tiny_model_dir, mode)
    rows = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(9)).bfloat16()
    by_tensor = prefilled(stage, [3, 9, 1], 16, seed=4)
    by_bytes = prefilled(stage, [3, 9, 1], 16, seed=4)
    expected = steps(stage, by_tensor, rows, 2, True, monkeypatch)
    first = stage.decode_bytes(rows.view(torch.int16).numpy().tobytes(), [Span(c, c.length, 1) for c in by_bytes])
    kept = bytes(first)
    second = stage.decode_bytes(first, [Span(c, c.length, 1) for c in by_bytes])
    assert bytes(first) == kept  # not overwritten by the next step
    for ours, theirs in zip((first, second), expected):
        assert bytes(ours) == theirs.view(torch.int16).numpy().tobytes()
    for ours, theirs in zip(by_bytes, by_tensor):
        assert ours.length == theirs.length
        assert torch.equal(ours.kv[..., :ours.length, :], theirs.kv[..., :theirs.length, :])
    with pytest.raises(ValueError, match="bytes of hidden state for a plan of"):
        stage.decode_bytes(kept[:-2], [Span(c, c.length, 1) for c in by_bytes])
    monkeypatch.setattr(Stage, "decode_plans", False)
    assert stage.decode_bytes(kept, [Span(c, c.length, 1) for c in by_bytes]) is None  # no plan: forward_batch


@pytest.mark.parametrize("compute", ["bf16", "fp32"])
def test_a_worker_steps_decode_rows_from_their_bytes(tiny_model_dir, native_parts, monkeypatch, compute):
    """A bf16 CPU worker runs a decode RUN_BATCH from the received bytes to the bytes it sends, making no tensor
    of the rows; an fp32 one (no plan) makes one and computes as before. Either way the output is the stage's."""
    from tc.model.config import ModelConfig
    from tc.model.weights import layer_tensor_names
    from tc.protocol.messages import Assignment, BatchEntry, RunBatch
    from tc.protocol.tensors import WireTensor
    from tc.worker.runtime import StageOutput, StageRuntime, load_assignment

    config = ModelConfig.from_file(tiny_model_dir / "config.json")
    assignment = Assignment(model_id=str(tiny_model_dir), model_source="local", revision=None, device="cpu",
                            architecture="qwen2", quant="fp16", group_size=128, compute_dtype=compute,
                            layer_start=0, layer_end_exclusive=2, config=config.to_dict(),
                            tensor_count=len(layer_tensor_names(config, 0, 2)))
    runtime = StageRuntime(load_assignment(assignment, tiny_model_dir, "cpu"), max_sequences=2)
    stage, dtype = runtime.loaded.stage, runtime.loaded.dtype
    gen = torch.Generator().manual_seed(3)
    prompt, row = torch.randn(1, 4, 64, generator=gen).to(dtype), torch.randn(1, 1, 64, generator=gen).to(dtype)
    reference = stage.new_cache(8, dtype, "cpu")
    stage(prompt, reference, 0)
    expected = stage(row, reference, 4)
    assert isinstance(runtime.run(RunBatch(entries=(BatchEntry(sequence=1, position_start=0, length=4,
                                                               cache_capacity=8),), hidden_state=prompt)),
                      StageOutput)
    received = WireTensor.from_map(WireTensor.of(row).to_map())  # as a frame brings it: bytes, no tensor
    made = []
    tensor = WireTensor.tensor
    monkeypatch.setattr(WireTensor, "tensor", lambda self: made.append(self) or tensor(self))
    out = runtime.run(RunBatch(entries=(BatchEntry(sequence=1, position_start=4, length=1, cache_capacity=8),),
                               hidden_state=received))
    assert isinstance(out, StageOutput) and out.hidden_state == WireTensor.of(expected)
    assert made == ([] if compute == "bf16" else [received])
