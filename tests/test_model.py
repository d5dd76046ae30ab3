"""Our Qwen2 against transformers' on tiny random-weight models, and its pipeline-stage properties."""
from __future__ import annotations

import pytest
import torch

from model_helpers import OurModel, hf_logits, hf_model
from tc.model.config import Qwen2Config
from tc.model.kv_cache import CacheFullError, KVCache
from tc.model.quant import quantize_int4, quantize_int8
from tc.model.qwen2 import Rotary, Span, StepInterrupted, rotate_
from tc.model.weights import WeightIndex, WeightsError, layer_tensor_names
from tiny_model import write_tiny_model

PROMPT = [5, 77, 200, 13, 42, 42, 9, 250, 31, 120, 64, 3]

CONFIGS = {
    "gqa-untied": {},
    "gqa-tied": {"tie_word_embeddings": True},
    "mha": {"num_attention_heads": 4, "num_key_value_heads": 4},
    "mqa-6-heads": {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 1},
    "sharded": {"shards": 3},
}


@pytest.mark.parametrize("name", CONFIGS)
def test_fp32_logits_match_transformers(tmp_path, name):
    overrides = dict(CONFIGS[name])
    shards = overrides.pop("shards", 1)
    model_dir = write_tiny_model(tmp_path, seed=3, shards=shards, **overrides)
    ours = OurModel(model_dir).full_logits(PROMPT)
    ref = hf_logits(hf_model(model_dir), PROMPT)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4


def test_prefill_plus_decode_equals_full_forward(tiny_model_dir):
    model = OurModel(tiny_model_dir)
    full = model.full_logits(PROMPT)
    cached = model.cached_logits(PROMPT, split=5)
    assert torch.allclose(cached, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_prefilled_in_chunks_equals_one_prefill(tiny_model_dir, dtype):
    # chunks after cached positions take the masked attention path, and the cache and rotary at an offset
    model = OurModel(tiny_model_dir, dtype)
    stage, ids = model.stages[0], torch.tensor([PROMPT])
    hidden = model.head.embed(ids).to(dtype)  # [1, 12, hidden]
    whole = stage(hidden, stage.new_cache(len(PROMPT), dtype, "cpu"), 0)
    cache = stage.new_cache(len(PROMPT), dtype, "cpu")
    parts = [stage(hidden[:, a:b], cache, a) for a, b in ((0, 5), (5, 6), (6, 12))]
    assert cache.length == len(PROMPT)
    assert torch.allclose(torch.cat(parts, dim=1).float(), whole.float(), atol=1e-5 if dtype == torch.float32 else 0.05)


@pytest.mark.parametrize("name", ["mha", "mqa-6-heads"])
def test_decode_steps_match_transformers_for_every_head_grouping(tmp_path, name):
    # a decode step's attention groups the query heads by KV head: 1 per group (MHA) and all in one (MQA) too
    model_dir = write_tiny_model(tmp_path, seed=4, **CONFIGS[name])
    cached = OurModel(model_dir).cached_logits(PROMPT, split=3)
    assert (cached - hf_logits(hf_model(model_dir), PROMPT)).abs().max().item() < 1e-4


def test_a_step_asked_to_stop_stops_before_its_next_layer_and_runs_whole_otherwise(tiny_model_dir):
    stage = OurModel(tiny_model_dir).stages[0]
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(3))
    asked = []

    def after_two() -> bool:
        asked.append(len(asked))
        return len(asked) > 2
    with pytest.raises(StepInterrupted, match="after 2 of the stage's 4 layers"):
        stage.forward_batch(x, [Span(stage.new_cache(5, torch.float32, "cpu"), 0, 5)], after_two)
    whole = stage.forward_batch(x, [Span(stage.new_cache(5, torch.float32, "cpu"), 0, 5)], lambda: False)
    assert torch.equal(whole, stage.forward_batch(x, [Span(stage.new_cache(5, torch.float32, "cpu"), 0, 5)]))


def test_fused_layers_hold_the_checkpoint_rows(tiny_model_dir):
    config = Qwen2Config.from_file(tiny_model_dir / "config.json")
    index = WeightIndex.open(tiny_model_dir)
    layer = OurModel(tiny_model_dir).stages[0].layers["1"]
    state = index.load(layer_tensor_names(config, 1, 2))
    rows = lambda names: torch.cat([state[f"model.layers.1.{n}"] for n in names])  # noqa: E731
    attn, mlp = layer.self_attn, layer.mlp
    assert torch.equal(attn.qkv_proj.weight, rows([f"self_attn.{p}_proj.weight" for p in "qkv"]))
    assert torch.equal(attn.qkv_proj.bias, rows([f"self_attn.{p}_proj.bias" for p in "qkv"]))
    assert torch.equal(mlp.gate_up_proj.weight, rows(["mlp.gate_proj.weight", "mlp.up_proj.weight"]))
    assert attn.qkv_proj.weight.shape[0] == config.hidden_size + 2 * config.num_key_value_heads * config.head_dim


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # the checkpoint's own, and a cast
def test_parts_read_into_one_tensor_or_slab_by_slab_are_their_rows_one_after_another(tiny_model_dir, dtype):
    index = WeightIndex.open(tiny_model_dir)
    names = [f"model.layers.2.self_attn.{p}_proj.weight" for p in "qkv"]
    state = index.load(names)
    want = torch.cat([state[n].to(dtype) for n in names])
    assert index.stacked_shape(names) == tuple(want.shape)
    got = index.load_rows(names, dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    row_bytes = want.shape[1] * 4  # the checkpoint is fp32
    slabs = list(index.row_slabs(names, dtype, slab_bytes=3 * row_bytes))
    firsts, at = [], 0
    for n in names:  # a part's last slab may be short, and the next part starts a slab of its own
        firsts += range(at, at + state[n].shape[0], 3)
        at += state[n].shape[0]
    assert [row for row, _ in slabs] == firsts
    assert all(slab.dtype == dtype and slab.shape[0] <= 3 for _, slab in slabs)
    assert torch.equal(torch.cat([slab for _, slab in slabs]), want)


def test_parts_of_other_widths_are_not_stacked(tiny_model_dir):
    index = WeightIndex.open(tiny_model_dir)
    names = ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(WeightsError, match="cannot stack the rows"):
        index.load_rows(names, torch.float32)
    with pytest.raises(WeightsError, match="missing tensor model.layers.0.mlp.w9.weight"):
        list(index.row_slabs(["model.layers.0.mlp.w9.weight"], torch.float32))


@pytest.mark.parametrize("quant", ["fp16", "int8"])
def test_a_stage_refuses_a_tensor_that_does_not_fit_its_layer(tmp_path, quant):
    from safetensors.torch import load_file, save_file

    from tc.model.quant import Quantization
    from tc.model.qwen2 import Stage

    model_dir = write_tiny_model(tmp_path, seed=2)
    state = load_file(model_dir / "model.safetensors")
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(state, model_dir / "model.safetensors")
    config = Qwen2Config.from_file(model_dir / "config.json")
    with pytest.raises(WeightsError, match=r"mlp.gate_up_proj.weight stack to \[260, 64\]; the layer config.json "
                                           r"describes holds \[320, 64\]"):
        Stage.load(config, WeightIndex.open(model_dir), 0, 2, torch.float32, quantization=Quantization(quant))


def test_quantizing_fused_rows_gives_each_part_its_own_codes():
    # why fusing before quantizing changes nothing: int8 scales are per row and int4 groups lie along a row
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, 256, generator=gen) * 0.02 for n in (64, 16, 16)]
    fused8, split8 = quantize_int8(torch.cat(parts)), [quantize_int8(p) for p in parts]
    assert torch.equal(fused8.qweight, torch.cat([p.qweight for p in split8]))
    assert torch.equal(fused8.scale, torch.cat([p.scale for p in split8]))
    fused4, split4 = quantize_int4(torch.cat(parts), 64), [quantize_int4(p, 64) for p in parts]
    for field in ("packed", "scales", "zeros"):
        assert torch.equal(getattr(fused4, field), torch.cat([getattr(p, field) for p in split4])), field


def test_split_stages_equal_unsplit_exactly(tiny_model_dir):
    whole = OurModel(tiny_model_dir).final_hidden(PROMPT)
    for splits in ([1], [2], [1, 3], [1, 2, 3]):
        parts = OurModel(tiny_model_dir, splits=splits).final_hidden(PROMPT)
        assert torch.equal(parts, whole), splits


def test_bf16_follows_fp32(tiny_model_dir):
    fp32 = OurModel(tiny_model_dir).full_logits(PROMPT)
    bf16 = OurModel(tiny_model_dir, dtype=torch.bfloat16).full_logits(PROMPT)
    assert (bf16 - fp32).abs().max().item() < 0.1 * fp32.abs().max().item()


def test_layer_range_reads_only_its_bytes(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m", seed=1)
    config = Qwen2Config.from_file(model_dir / "config.json")
    clean = WeightIndex.open(model_dir).load(layer_tensor_names(config, 1, 3))
    # overwrite every byte outside layers [1, 3) (other layers, head tensors) with garbage
    index = WeightIndex.open(model_dir)
    keep = set(layer_tensor_names(config, 1, 3))
    with open(model_dir / "model.safetensors", "r+b") as f:
        for info in index.tensors.values():
            if info.name not in keep:
                f.seek(info.start)
                f.write(b"\xff" * info.nbytes)  # NaN in every float format
    index = WeightIndex.open(model_dir)
    index.validate(config)  # headers are intact, so the model is still accepted
    loaded = index.load(layer_tensor_names(config, 1, 3))
    assert loaded.keys() == clean.keys()
    assert all(torch.equal(loaded[n], clean[n]) for n in clean)
    with pytest.raises(WeightsError, match="model.layers.0.mlp.up_proj.weight holds NaN"):  # the garbage is read
        index.load(["model.layers.0.mlp.up_proj.weight"])


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = write_tiny_model(tmp_path, seed=2)
    state = load_file(model_dir / "model.safetensors")
    del state["model.layers.2.self_attn.k_proj.bias"]
    save_file(state, model_dir / "model.safetensors")
    config = Qwen2Config.from_file(model_dir / "config.json")
    with pytest.raises(WeightsError, match=r"model\.layers\.2\.self_attn\.k_proj\.bias"):
        WeightIndex.open(model_dir).validate(config)


def test_misshaped_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = write_tiny_model(tmp_path, seed=2)
    state = load_file(model_dir / "model.safetensors")
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 100)
    save_file(state, model_dir / "model.safetensors")
    config = Qwen2Config.from_file(model_dir / "config.json")
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.mlp\.down_proj\.weight has shape \[64, 100\]"):
        WeightIndex.open(model_dir).validate(config)


def test_no_weights_file_is_a_clear_error(tmp_path):
    with pytest.raises(WeightsError, match="no model.safetensors"):
        WeightIndex.open(tmp_path)


def rotate_half_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_gives_the_reference_bits(dtype):
    rotary = Rotary(16, 10000.0, "cpu")
    cos, sin = rotary.tables(3, 5, dtype)  # [5, 1, 16]
    positions = torch.arange(3, 8).float()[:, None] * rotary.inv_freq[None]  # [5, 8]
    emb = torch.cat((positions, positions), dim=-1)  # [5, 16]
    ref_cos, ref_sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
    assert torch.equal(cos, ref_cos)
    qkv = torch.randn(2, 5, 6, 16).to(dtype)  # [B, L, heads, D]
    want = rotate_half_reference(qkv[:, :, :4], ref_cos, ref_sin)
    rotate_(qkv[:, :, :4], cos, sin)  # a strided view, as in the attention
    assert torch.equal(qkv[:, :, :4], want)


def test_rotary_tables_grow_and_keep_one_copy_per_dtype():
    rotary = Rotary(8, 10000.0, "cpu")
    small = rotary.tables(0, 4, torch.bfloat16)[0]
    assert rotary.size == 256
    assert rotary.tables(0, 4, torch.bfloat16)[0].data_ptr() == small.data_ptr()  # cached, not recomputed
    cos, _ = rotary.tables(300, 2, torch.float32)
    assert rotary.size == 512 and cos.shape == (2, 1, 8)
    assert torch.equal(rotary.tables(0, 4, torch.bfloat16)[0], small)


def test_kv_cache_stores_keys_and_values_with_one_write():
    cache = KVCache([4, 5], n_kv_heads=2, head_dim=3, capacity=6, dtype=torch.float32)
    kv = torch.arange(2 * 2 * 2 * 3, dtype=torch.float32).view(2, 1, 2, 2, 3)  # [K/V, B, H_kv, L=2, D]
    keys, values = cache.update(5, 0, kv)
    assert torch.equal(keys, kv[0]) and torch.equal(values, kv[1])
    step = torch.full((2, 1, 2, 1, 3), -1.0)
    keys, values = cache.update(5, 2, step)
    assert keys.shape == (1, 2, 3, 3) and torch.equal(keys[:, :, :2], kv[0]) and torch.equal(values[:, :, 2:], step[1])
    assert torch.equal(cache.keys[1, :, :, :3], keys) and torch.equal(cache.values[1, :, :, :3], values)
    assert cache.nbytes == 2 * 2 * 1 * 2 * 6 * 3 * 4
    with pytest.raises(CacheFullError, match="capacity 6"):
        cache.update(4, 5, kv)


def test_a_caches_storage_is_its_layer_slots_one_after_another():
    from tc.model.kv_cache import CacheFullError, KVCache

    cache = KVCache([3, 4, 5], n_kv_heads=2, head_dim=8, capacity=10, dtype=torch.bfloat16)
    storage, layer_bytes = cache.storage(9)
    assert [storage + i * layer_bytes for i in range(3)] == [cache.layer_slot(k, 9).data_ptr() for k in (3, 4, 5)]
    assert layer_bytes == 2 * 2 * 10 * 8 * 2
    with pytest.raises(CacheFullError, match="position 10 is past"):
        cache.storage(10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_ids_given_as_ints_gives_the_embedding_modules_rows(tiny_model_dir, dtype):
    """The head's per-step path (embed_ids: one id's row copied, or an index from the ints' bytes and one
    index_select) reads the same rows as nn.Embedding over a tensor of the ids, bit for bit, scaled as the family
    asks; an id outside the vocabulary fails as it does there, one id alone too (a negative one does not wrap)."""
    head = OurModel(tiny_model_dir, dtype).head
    for ids in ([7], PROMPT, []):
        want = head.embed(torch.tensor([ids], dtype=torch.int64))
        got = head.embed_ids(ids)
        assert got.dtype == dtype and got.shape == want.shape == (1, len(ids), head.config.hidden_size)
        assert torch.equal(got, want) and not got.requires_grad  # no autograd graph outside inference mode
    head.embedding_scale = 3.5  # as Gemma's sqrt(hidden_size)
    for ids in ([7], PROMPT):
        assert torch.equal(head.embed_ids(ids), head.embed(torch.tensor([ids])))
        assert not torch.equal(head.embed_ids(ids), head.embed(torch.tensor([ids])) / 3.5)
    for ids in ([head.config.vocab_size], [-1], [7, head.config.vocab_size]):
        with pytest.raises(IndexError):
            head.embed_ids(ids)
