"""Every model family against transformers' own implementation, on tiny random-weight models (fixed seed).

Each family: fp32 logits equal to transformers' (< 1e-4) from one prefill and from a prefill plus cached decode
steps, greedy continuations identical, in one process and through a real head and two real worker processes;
partial loading reads only the assigned layers' bytes; quantized weights load (experts included) and follow fp32.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from cluster import ROOT, Cluster, write_topology
from model_helpers import OurModel, hf_logits
from tc.generation import Generator
from tc.model.config import ConfigError, ModelConfig
from tc.model.quant import Int4Linear, Int8Linear
from tc.model import native
from tc.model.decode_plan import DecodePlan
from tc.model.qwen2 import MLP, Attention, HeadModel, RMSNorm, Span, Stage
from tc.model.tokenizer import TextTokenizer
from tc.model.weights import WeightIndex, WeightsError, layer_tensor_names
from tc.sampling import SamplingParams
from tiny_families import (FAMILIES, LONG_FACTORS, MINISTRAL3_ROPE, SHAPES, SHORT_FACTORS, hf_family_model,
                           write_family_model)

PROMPT = [5, 77, 200, 13, 42, 42, 9, 250, 31, 120, 64, 3]  # longer than every tiny sliding window
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """One model directory per family, written on first use."""
    made: dict = {}

    def get(name: str):
        if name not in made:
            made[name] = write_family_model(tmp_path_factory.mktemp(name), name, seed=1)
        return made[name]
    return get


def hf_greedy(model_dir, ids: list[int], new_tokens: int) -> list[int]:
    model = hf_family_model(model_dir)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def our_greedy(model: OurModel, model_dir, ids: list[int], new_tokens: int):
    generator = Generator(model.head, TextTokenizer.load(model_dir), model.pipeline(), torch.float32)
    return generator.generate(ids, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))


@pytest.mark.parametrize("name", FAMILIES)
def test_fp32_logits_and_greedy_tokens_match_transformers(family_dirs, name):
    model_dir = family_dirs(name)
    config = ModelConfig.from_file(model_dir / "config.json")
    assert config.num_hidden_layers == 4 and config.num_key_value_heads < config.num_attention_heads
    ref = hf_logits(hf_family_model(model_dir), PROMPT)
    ours = OurModel(model_dir, splits=[2])  # two stages, as two workers hold them
    assert (ours.full_logits(PROMPT) - ref).abs().max().item() < 1e-4
    assert (ours.cached_logits(PROMPT, split=4) - ref).abs().max().item() < 1e-4  # decode past the window
    result = our_greedy(ours, model_dir, PROMPT, NEW_TOKENS)
    assert list(result.token_ids) == hf_greedy(model_dir, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_batches_sequences_as_each_runs_alone(family_dirs, name):
    """Three sequences of different lengths side by side (a ragged batch, as the head's scheduler sends): a long
    prompt past the sliding windows, a short one, and decode steps; each sequence's rows equal its solo run's."""
    from tc.generation import Entry, LocalPipeline
    model = OurModel(family_dirs(name))
    prompts = [PROMPT * 2, PROMPT[:3], PROMPT[4:]]
    embed = [model.head.embed(torch.tensor([p])) for p in prompts]
    alone = []
    for ids, x in zip(prompts, embed):
        solo = LocalPipeline(model.stages)
        first = solo.run([Entry(1, 0, len(ids) - 1, len(ids))], x[:, :-1])
        alone.append(torch.cat([first, solo.run([Entry(1, len(ids) - 1, 1, len(ids))], x[:, -1:])], dim=1))
    batch = LocalPipeline(model.stages)
    entries = [Entry(i, 0, len(ids) - 1, len(ids)) for i, ids in enumerate(prompts)]
    first = batch.run(entries, torch.cat([x[:, :-1] for x in embed], dim=1))
    steps = batch.run([Entry(i, len(ids) - 1, 1, len(ids)) for i, ids in enumerate(prompts)],
                      torch.cat([x[:, -1:] for x in embed], dim=1))
    rows = 0
    for i, ids in enumerate(prompts):
        got = torch.cat([first[:, rows:rows + len(ids) - 1], steps[:, i:i + 1]], dim=1)
        rows += len(ids) - 1
        torch.testing.assert_close(got, alone[i], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_follows_fp32(family_dirs, name):
    """bf16 rounds at other points than fp32 (Gemma's norms scale in fp32, soft-capping and masks meet bf16 scores):
    it must stay close, from one prefill and through cached decode steps (measured: under 3% of the largest
    logit)."""
    model_dir = family_dirs(name)
    fp32 = OurModel(model_dir).full_logits(PROMPT)
    bf16 = OurModel(model_dir, torch.bfloat16, splits=[2])
    scale = fp32.abs().max().item()
    assert (bf16.full_logits(PROMPT) - fp32).abs().max().item() < 0.05 * scale
    assert (bf16.cached_logits(PROMPT, split=4) - fp32).abs().max().item() < 0.05 * scale


@pytest.mark.skipif(native.kernels() is None, reason="no native kernels on this machine (see the log)")
@pytest.mark.parametrize("planned", [True, False], ids=["decode plan", "modules"])
def test_nope_layers_decode_unrotated_through_the_native_attention(family_dirs, monkeypatch, planned):
    """The native attention rotates a decode row's q and k itself, where a layer rotates them (it is given cos and
    sin): SmolLM3's NoPE layers (1 and 3, one in each stage) must be given none, through a decode plan and through
    the modules alike. A bf16 decode step of each stage, its change to the residual stream against fp32's: measured
    within 3% of the largest, as through PyTorch's attention; 17-20% with the NoPE layers rotated."""
    model_dir = family_dirs("smollm3")
    assert ModelConfig.from_file(model_dir / "config.json").rope_layers == (True, False, True, False)
    monkeypatch.setattr(Stage, "decode_plans", planned)
    monkeypatch.setattr(Attention, "native_decode", True)
    monkeypatch.setattr(RMSNorm, "native", True)
    monkeypatch.setattr(MLP, "native_act", True)

    def decode_step(stage: Stage, dtype: torch.dtype) -> torch.Tensor:
        g = torch.Generator().manual_seed(3)
        cache = stage.new_cache(16, dtype, "cpu")
        stage(torch.randn(1, 11, stage.config.hidden_size, generator=g).to(dtype), cache, 0)
        x = torch.randn(1, 1, stage.config.hidden_size, generator=g).to(dtype)
        return (stage.forward_batch(x, [Span(cache, 11, 1)]) - x).float()

    bf16, fp32 = OurModel(model_dir, torch.bfloat16, splits=[2]), OurModel(model_dir, splits=[2])
    for ours, ref in zip(bf16.stages, fp32.stages):
        got, want = decode_step(ours, torch.bfloat16), decode_step(ref, torch.float32)
        assert any(isinstance(p, DecodePlan) for p in ours._plans.values()) == planned
        assert (got - want).abs().max().item() < 0.08 * want.abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_head_and_two_workers_generate_what_transformers_does(tmp_path, family_dirs, name):
    model_dir = family_dirs(name)
    tokenizer = TextTokenizer.load(model_dir)
    prompt = "the quick brown fox"
    ids = tokenizer.encode(prompt)
    # the text a generation streams holds back a trailing partial UTF-8 character, so the expected text is what
    # tc's own generator makes of transformers' tokens: the tokens are checked equal, then the cluster's text
    local = our_greedy(OurModel(model_dir), model_dir, ids, NEW_TOKENS)
    assert list(local.token_ids) == hf_greedy(model_dir, ids, NEW_TOKENS)
    expected = local.text
    topo = write_topology(tmp_path / "t.yaml", model_dir, [{"id": "a", "device": "cpu"},
                                                           {"id": "b", "device": "cpu"}])
    with Cluster(topo, tmp_path) as cluster:
        cluster.start_all(["a", "b"])
        status, body = cluster.post("/v1/completions", {"model": model_dir.name, "prompt": prompt,
                                                        "max_tokens": NEW_TOKENS, "temperature": 0,
                                                        "ignore_eos": True})
        assert status == 200, body
        assert body["choices"][0]["text"] == expected
        head_log = cluster.head.output()
        assert "assigned layers 0-1" in head_log and "assigned layers 2-3" in head_log


def served(model_dir, context: int | None) -> OurModel:
    """OurModel of `model_dir` serving `context` positions a sequence (None: the model's own), as a topology's
    context_length makes the head and (through ASSIGNMENT) every worker serve."""
    model = OurModel.__new__(OurModel)
    model.config = replace(ModelConfig.from_file(model_dir / "config.json"), context_limit=context)
    model.index, model.dtype = WeightIndex.open(model_dir), torch.float32
    model.head = HeadModel.load(model.config, model.index, torch.float32)
    model.stages = [Stage.load(model.config, model.index, 0, 2, torch.float32),
                    Stage.load(model.config, model.index, 2, 4, torch.float32)]
    return model


@pytest.mark.parametrize("name", ["phi3", "gemma3"])
def test_a_window_no_shorter_than_the_context_served_is_no_window(tmp_path, name):
    """Phi-3.5-mini and Phi-4-mini give a sliding window of 262144 for 131072 positions, which hides no key from
    any position; masked by it, every layer lost the native decode attention and the decode plan. A window no
    shorter than the context served is dropped (the topology's context_length counts), the sliding layers keeping
    their own rotary tables (Gemma 3's), and the logits stay transformers'."""
    def windows(model: OurModel) -> list[tuple[int | None, bool]]:
        return [(layer.self_attn.window, layer.self_attn.sliding) for stage in model.stages
                for layer in stage.layers.values()]

    wide = write_family_model(tmp_path / "wide", name, seed=1, sliding_window=SHAPES["max_position_embeddings"])
    ours = OurModel(wide, splits=[2])
    assert all(window is None for window, _ in windows(ours)) and any(sliding for _, sliding in windows(ours))
    ref = hf_logits(hf_family_model(wide), PROMPT)
    assert (ours.full_logits(PROMPT) - ref).abs().max().item() < 1e-4
    assert (ours.cached_logits(PROMPT, split=4) - ref).abs().max().item() < 1e-4
    narrow = write_family_model(tmp_path / "narrow", name, seed=1, sliding_window=2 * len(PROMPT))
    assert (2 * len(PROMPT), True) in windows(served(narrow, None))  # the model's own context: the window bites
    assert all(window is None for window, _ in windows(served(narrow, 2 * len(PROMPT))))
    ref = hf_logits(hf_family_model(narrow), PROMPT)
    assert (served(narrow, 2 * len(PROMPT)).full_logits(PROMPT) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["mistral-window", "gemma3", "cohere2"])
def test_a_sliding_layers_decode_rows_slice_the_window_rather_than_mask_it(family_dirs, name, monkeypatch):
    """A decode row of a sliding-window layer sees the last `window` cached positions: sliced off, they leave it
    the unmasked path of every other decode row (the masked one took 4.5x as long at 2048 positions behind a window
    of 512, bench/bench_sliding_decode.py), with transformers' logits past the window."""
    masked = Attention._attend_masked

    def prompt_rows_only(self, q, keys, values, position_start):
        assert q.shape[2] > 1, "a decode row took the masked path"
        return masked(self, q, keys, values, position_start)

    monkeypatch.setattr(Attention, "_attend_masked", prompt_rows_only)
    model_dir = family_dirs(name)
    ours = OurModel(model_dir, splits=[2])
    assert any(layer.self_attn.window for stage in ours.stages for layer in stage.layers.values())
    ref = hf_logits(hf_family_model(model_dir), PROMPT)
    assert (ours.cached_logits(PROMPT, split=4) - ref).abs().max().item() < 1e-4  # decode rows past the window


def long_context_model(path, family: str):
    """Phi-3.5-mini's kind of longrope (or Phi-4-mini's, rotating part of each head): a pre-training context (64)
    below the model's (256), and no `factor`, which transformers then derives from the two (and the attention
    factor from that)."""
    rope = {k: v for k, v in FAMILIES[family][2]["rope_parameters"].items() if k != "factor"}
    return write_family_model(path, family, seed=1, original_max_position_embeddings=64, rope_parameters=rope)


@pytest.fixture(scope="module")
def longrope_dir(tmp_path_factory):
    return long_context_model(tmp_path_factory.mktemp("longrope"), "phi3-longrope")


@pytest.mark.parametrize("family", ["phi3-longrope", "phi4-mini"])
def test_longrope_takes_the_long_list_where_the_context_served_passes_the_pretraining_one(tmp_path, family):
    """transformers rotates a sequence longer than the pre-training context with the long list, and tc every
    sequence of a context longer than that; a context within it takes the short list, as transformers does for
    a sequence within it. The two lists give different logits, so each side is told apart."""
    longrope_dir = long_context_model(tmp_path, family)
    ids = [(7 * i + 3) % 250 for i in range(80)]  # past the pre-training context of 64
    long_context = served(longrope_dir, None)  # 256 positions
    assert long_context.config.context_length == 256
    reference = hf_family_model(longrope_dir)
    assert (long_context.full_logits(ids) - hf_logits(reference, ids)).abs().max().item() < 1e-4
    assert (long_context.cached_logits(ids, split=70) - hf_logits(reference, ids)).abs().max().item() < 1e-4
    short_context = served(longrope_dir, 64)
    within = ids[:40]
    assert (short_context.full_logits(within) - hf_logits(reference, within)).abs().max().item() < 1e-4
    assert (long_context.full_logits(within) - hf_logits(reference, within)).abs().max().item() > 1e-2


def token_logprobs(model: OurModel, ids: list[int], tokens: list[int]) -> list[float]:
    """The log-probability `model` gives each of `tokens` following `ids` (greedy tokens, temperature 0)."""
    logits = model.full_logits(ids + tokens)[len(ids) - 1:-1]
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@pytest.mark.slow
def test_a_topology_context_within_the_pretraining_one_gives_every_worker_the_short_list(tmp_path, longrope_dir):
    """The head's context_length reaches the workers in ASSIGNMENT: with `context_length: 64` the head and two
    workers generate transformers' tokens for a short prompt with the short list's log-probabilities, which the
    model's own context of 256 (the long list) does not give."""
    tokenizer = TextTokenizer.load(longrope_dir)
    prompt = "the quick brown fox"
    ids = tokenizer.encode(prompt)
    short = served(longrope_dir, 64)
    tokens = list(our_greedy(short, longrope_dir, ids, NEW_TOKENS).token_ids)
    assert tokens == hf_greedy(longrope_dir, ids, NEW_TOKENS)
    want = token_logprobs(short, ids, tokens)
    long = token_logprobs(served(longrope_dir, None), ids, tokens)
    assert max(abs(a - b) for a, b in zip(want, long)) > 1e-2
    topo = write_topology(tmp_path / "t.yaml", longrope_dir, [{"id": "a", "device": "cpu"},
                                                              {"id": "b", "device": "cpu"}], context_length=64)
    with Cluster(topo, tmp_path) as cluster:
        cluster.start_all(["a", "b"])
        status, body = cluster.post("/v1/completions", {"model": longrope_dir.name, "prompt": prompt,
                                                        "max_tokens": NEW_TOKENS, "temperature": 0,
                                                        "ignore_eos": True, "logprobs": 0})
        assert status == 200, body
        got = body["choices"][0]["logprobs"]["token_logprobs"]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (got, want, long)


def test_phi3_files_that_name_longrope_su_are_read_as_longrope():
    """The 128k Phi-3-mini's first files called longrope "su" (and Phi3Config reads "yarn" beside the two lists as
    longrope too): the same model as "longrope", and the same config on the wire."""
    data = {"architectures": ["Phi3ForCausalLM"], **{k: v for k, v in SHAPES.items() if v is not None},
            "rms_norm_eps": 1e-5, "original_max_position_embeddings": 64}
    lists = {"short_factor": SHORT_FACTORS, "long_factor": LONG_FACTORS}
    named = ModelConfig.from_dict({**data, "rope_scaling": {"type": "longrope", **lists}})
    assert named.rope.type == "longrope" and named.rope.param("factor") == 4.0
    for old in ("su", "yarn"):
        config = ModelConfig.from_dict({**data, "rope_scaling": {"type": old, **lists}})
        assert config.rope == named.rope
        assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ConfigError, match=r"rope_scaling\.long_factor = \[1\.0\]; longrope needs a list of 8 "):
        ModelConfig.from_dict({**data, "rope_scaling": {"type": "longrope", **lists, "long_factor": [1.0]}})
    # the pre-training context where Phi3Config takes it: the top-level one, 4096 where config.json has none
    alone = {k: v for k, v in data.items() if k != "original_max_position_embeddings"}
    assert ModelConfig.from_dict({**alone, "rope_scaling": {"type": "longrope", **lists}}).rope.param(
        "original_max_position_embeddings") == 4096
    for inner, top in ((64, None), (32, 64)):
        with pytest.raises(ConfigError, match=rf"rope_scaling\.original_max_position_embeddings = {inner} and "
                                              rf"original_max_position_embeddings = {top}; Phi3ForCausalLM reads"):
            ModelConfig.from_dict({**alone, **({} if top is None else {"original_max_position_embeddings": top}),
                                   "rope_scaling": {"type": "longrope", **lists,
                                                    "original_max_position_embeddings": inner}})
    assert ModelConfig.from_dict({**data, "rope_scaling": {"type": "longrope", **lists,
                                                           "original_max_position_embeddings": 64}}) == named
    with pytest.raises(ConfigError, match="tc computes longrope for Phi3ForCausalLM only"):
        ModelConfig.from_dict({**data, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                               "rope_scaling": {"type": "longrope", **lists}})


PHI_35_MINI = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
               "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 32, "vocab_size": 32064, "max_position_embeddings": 131072,
               "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
               "sliding_window": 262144, "tie_word_embeddings": False, "hidden_act": "silu",
               "rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 48 for i in range(48)],
                                "long_factor": [1.0 + i for i in range(48)]}}
PHI_4_MINI = {**PHI_35_MINI, "num_attention_heads": 24, "num_key_value_heads": 8, "vocab_size": 200064,
              "partial_rotary_factor": 0.75, "tie_word_embeddings": True}


@pytest.mark.parametrize(("data", "rotated"), [(PHI_35_MINI, None), (PHI_4_MINI, 96)])
def test_phi_35_mini_and_phi_4_mini_configs_are_read(data, rotated):
    """Their config.json files' shapes (the factors' values made up): longrope from the two contexts, with the
    attention factor transformers derives (sqrt(1 + ln 32 / ln 4096)); Phi-4-mini rotating 96 of 128 dimensions,
    its 48 factors one per rotated pair."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = ModelConfig.from_dict(json.loads(json.dumps(data)))
    assert config.rope.type == "longrope" and config.rotary_dim == rotated and config.context_length == 131072
    reference = Phi3Config.from_dict(json.loads(json.dumps(data)))
    for served in (4096, 131072):
        freq, factor = ROPE_INIT_FUNCTIONS["longrope"](reference, "cpu", seq_len=served)
        rotary = Stage(replace(config, num_hidden_layers=1, context_limit=served), 0, 1).rotary
        assert torch.equal(rotary.inv_freq, freq)
        assert rotary.attention_scaling == factor == pytest.approx(1.1902, abs=1e-4)
    if rotated:
        order = config.rotary_rows()
        assert sorted(order) == list(range((24 + 2 * 8) * 128))
        # a head's rotated pairs (j, j + 48) on (j, j + 64), the 32 passing dimensions on the pairs between
        assert order[:128] == [*range(48), *range(96, 112), *range(48, 96), *range(112, 128)]
        assert order[128:256] == [128 + i for i in order[:128]] and order[-1] == (24 + 2 * 8) * 128 - 1


# GLM-4-9B-Chat's (GlmForCausalLM, as transformers converted it) and GLM-4-32B-0414's config.json shapes
GLM_4_9B = {"architectures": ["GlmForCausalLM"], "model_type": "glm", "attention_bias": True, "head_dim": 128,
            "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 13696, "max_position_embeddings": 131072,
            "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 2, "partial_rotary_factor": 0.5,
            "rms_norm_eps": 1.5625e-07, "rope_theta": 10000.0, "tie_word_embeddings": False, "vocab_size": 151552,
            "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329}
GLM_4_32B_0414 = {**GLM_4_9B, "architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "hidden_size": 6144,
                  "intermediate_size": 23040, "num_attention_heads": 48, "num_hidden_layers": 61,
                  "max_position_embeddings": 32768, "rms_norm_eps": 1e-05}


@pytest.mark.parametrize("data", [GLM_4_9B, GLM_4_32B_0414], ids=["glm-4-9b", "glm-4-32b-0414"])
def test_glm_configs_are_read_as_transformers_reads_them(data):
    """Half of each 128-wide head rotates, in interleaved pairs: a query or key head's rows are reordered so that
    the checkpoint's pair (2j, 2j + 1) lands on tc's (j, j + 64), the 64 passing dimensions on the pairs between.
    The same config without the keys GlmConfig and Glm4Config fill in is the same config."""
    import transformers

    config = ModelConfig.from_dict(json.loads(json.dumps(data)))
    reference = getattr(transformers, data["architectures"][0].replace("ForCausalLM", "Config")).from_dict(data)
    assert config.rotary_dim == 64 == int(reference.head_dim * reference.rope_parameters["partial_rotary_factor"])
    assert config.rotary_interleaved and config.qkv_bias and not config.o_bias and config.fused_gate_up
    assert (config.head_dim, config.num_key_value_heads) == (reference.head_dim, reference.num_key_value_heads)
    assert config.sandwich_norms == (data["model_type"] == "glm4")
    heads = reference.num_attention_heads + 2 * 2
    order = config.rotary_rows()
    assert sorted(order) == list(range(heads * 128))
    assert order[:128] == [*range(0, 64, 2), *range(64, 96), *range(1, 64, 2), *range(96, 128)]
    assert order[128:256] == [128 + i for i in order[:128]] and order[-128:] == list(range((heads - 1) * 128,
                                                                                           heads * 128))
    defaults = ("num_key_value_heads", "head_dim", "partial_rotary_factor", "attention_bias", "rms_norm_eps")
    left_out = {k: v for k, v in data.items() if k not in defaults}
    assert replace(ModelConfig.from_dict(left_out), rms_norm_eps=config.rms_norm_eps) == config
    assert ModelConfig.from_dict(left_out).rms_norm_eps == transformers.GlmConfig().rms_norm_eps
    whole = ModelConfig.from_dict({**left_out, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                  "partial_rotary_factor": 1.0}})
    assert whole.rotary_dim is None and whole.rotary_rows()[:4] == [0, 2, 4, 6]


@pytest.mark.parametrize("name", ["ernie4.5", "cohere", "cohere2", "olmo2", "glm", "glm4", "helium", "llama",
                                  "phi4-mini"])
def test_bf16_queries_and_keys_rotate_to_the_bits_of_the_familys_reference(family_dirs, name):
    """transformers' rotation of bf16 q and k, in the reference's own roundings: ERNIE 4.5's, Cohere's and OLMo's in
    fp32, rounded once (by fp32 tables, or Cohere's rounded to bf16); the others' in bf16 by bf16 tables. tc's q/k
    rows are the checkpoint's reordered (rotary_rows), so its rotation of them, put back in the checkpoint's order,
    is compared bit for bit; and where it rotates in fp32, before the native attention, whose decode rows then
    cache the keys SDPA's would."""
    import importlib

    model_dir = family_dirs(name)
    config = ModelConfig.from_file(model_dir / "config.json")
    hf = hf_family_model(model_dir)
    reference = importlib.import_module(type(hf).__module__)
    rows, heads, d = 9, config.num_attention_heads, config.head_dim
    q = (torch.randn(1, heads, rows, d, generator=torch.Generator().manual_seed(4)) * 3).bfloat16()
    positions = torch.arange(40, 40 + rows)[None]
    cos, sin = hf.model.rotary_emb(q, positions)
    expected, _ = reference.apply_rotary_pos_emb(q, q, cos, sin)
    order = (config.rotary_rows() or list(range(d)))[:d]  # within one head
    ours = q.transpose(1, 2)[..., order].contiguous()  # [1, rows, heads, D] in tc's order
    stage = Stage(config, 0, 1)
    stage.layers["0"].self_attn.rotate(ours, *stage.rotary.tables(40, rows, torch.bfloat16))
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours[..., torch.tensor(order).argsort()], expected.transpose(1, 2))
    if config.rotate_in_fp32:  # the native attention would rotate in bf16: such a layer rotates before it
        stage = stage.bfloat16()
        x = torch.randn(1, 6, config.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16()
        cached = []
        for native_decode in (True, False):  # a decode row through the native attention, or through SDPA
            stage.layers["0"].self_attn.native_decode = native_decode
            cache = stage.new_cache(8, torch.bfloat16, "cpu")
            stage(x[:, :5], cache, 0)
            stage(x[:, 5:], cache, 5)
            cached.append(cache.kv[..., :6, :].clone())  # [layers, K/V, B, H_kv, T, D]: the 6 positions written
        assert torch.equal(*cached)


@pytest.mark.parametrize("name, where", [("ministral3", None), ("mistral3-ministral3", None),
                                         ("mistral3-ministral3", "text_config")])
def test_a_checkpoint_another_tool_quantized_is_refused_by_name(family_dirs, name, where):
    """Ministral 3's instruct checkpoints are published in FP8 (`weight` in float8 beside `weight_scale_inv`): read
    as plain weights they would load and write nonsense. Such a config.json is refused, naming what to use."""
    data = json.loads((family_dirs(name) / "config.json").read_text())
    fp8 = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None}
    if where is None:
        data["quantization_config"] = fp8
    else:
        data[where] = {**data[where], "quantization_config": fp8}
    with pytest.raises(ConfigError, match="quant_method 'fp8'.*use the model's BF16 / FP16 release"):
        ModelConfig.from_dict(data)


@pytest.mark.parametrize("architecture", ["Ministral3ForCausalLM", "Mistral3ForConditionalGeneration"])
def test_a_ministral3_config_as_transformers_saves_it_is_read(architecture):
    """Ministral3Config writes the model's context into its rotary dict beside the scaling's beta (keys transformers'
    yarn leaves alone): its saved config.json reads as the config transformers builds, and so does one that gives
    the rotary dict under both names, or no original context (transformers then takes the model's)."""
    import transformers

    text = transformers.Ministral3Config()
    saved = transformers.Mistral3Config(text_config=text.to_dict()) if architecture.startswith("Mistral3") else text
    data = {**json.loads(saved.to_json_string(use_diff=True)), "architectures": [architecture]}
    config = ModelConfig.from_dict(data)
    rope = text.rope_parameters
    assert (config.model_type, config.rope.type, config.rope.theta, config.rope.param("factor"),
            config.query_scaling) == ("ministral3", "yarn", rope["rope_theta"], rope["factor"],
                                      (rope["llama_4_scaling_beta"], rope["original_max_position_embeddings"]))
    flat = {**text.to_dict(), "architectures": ["Ministral3ForCausalLM"]}
    assert ModelConfig.from_dict({**flat, "rope_scaling": dict(rope)}) == ModelConfig.from_dict(flat)
    short = {**flat, "max_position_embeddings": 512,
             "rope_parameters": {k: v for k, v in rope.items() if k != "original_max_position_embeddings"}}
    theirs = transformers.Ministral3Config(**{k: v for k, v in short.items() if k != "architectures"})
    original = theirs.rope_parameters["original_max_position_embeddings"]
    assert original == 512 and ModelConfig.from_dict(short).query_scaling == (0.1, original)


def test_ministral3_queries_scale_by_position_to_the_bits_of_transformers(family_dirs):
    """Ministral 3 multiplies each rotated bf16 query by 1 + beta * log(1 + floor(position / original context)),
    rounded to bf16 (get_llama_4_attn_scale): rows of one span before, across and past the original context (4
    positions in the tiny model), and of two spans at once, against transformers' own functions, bit for bit."""
    import importlib

    model_dir = family_dirs("ministral3")
    config = ModelConfig.from_file(model_dir / "config.json")
    assert config.query_scaling == (0.5, 4)
    hf = hf_family_model(model_dir)
    reference = importlib.import_module(type(hf).__module__)
    heads, d = config.num_attention_heads, config.head_dim
    q = (torch.randn(1, heads, 13, d, generator=torch.Generator().manual_seed(4)) * 3).bfloat16()
    positions = torch.cat((torch.arange(1, 10), torch.arange(20, 24)))[None]  # spans [1, 10) and [20, 24)
    cos, sin = hf.model.rotary_emb(q, positions)
    rotated, _ = reference.apply_rotary_pos_emb(q, q, cos, sin)
    expected = rotated * reference.get_llama_4_attn_scale(positions, 0.5, 4).to(torch.bfloat16)
    stage = Stage(config, 0, 1)
    attn = stage.layers["0"].self_attn
    spans = [Span(None, 1, 9), Span(None, 20, 4)]
    ours = q.transpose(1, 2).contiguous()  # [1, rows, heads, D]
    attn.rotate(ours, *stage.rotary.span_tables(spans, torch.bfloat16))
    attn._scale_queries(ours, spans)
    assert torch.equal(ours, expected.transpose(1, 2))
    assert not torch.equal(rotated, expected)  # the scaling changed some rows: the test can fail


@pytest.mark.skipif(native.kernels() is None, reason="no native kernels on this machine (see the log)")
@pytest.mark.parametrize("planned", [True, False], ids=["decode plans on", "modules"])
def test_ministral3_decodes_past_its_original_context_through_the_native_attention(family_dirs, monkeypatch,
                                                                                  planned):
    """The native attention (and a decode plan's) rotates a decode row's query itself, unscaled: past the original
    context a Ministral 3 layer rotates and scales it first, and no plan takes the step. A bf16 decode step of
    each stage through it, its change to the residual stream against fp32's through PyTorch's attention: within
    8% of the largest (as test_nope_layers_...); with a steep scaling (beta 4, a factor of 5.4 at position 11)
    that an unscaled query would miss by far."""
    monkeypatch.setattr(Stage, "decode_plans", planned)
    monkeypatch.setattr(Attention, "native_decode", True)
    monkeypatch.setattr(RMSNorm, "native", True)
    monkeypatch.setattr(MLP, "native_act", True)

    def decode_step(stage: Stage, dtype: torch.dtype, start: int) -> torch.Tensor:
        for layer in stage.layers.values():
            layer.self_attn.query_scaling = (4.0, 4)
        g = torch.Generator().manual_seed(3)
        cache = stage.new_cache(16, dtype, "cpu")
        stage(torch.randn(1, start, stage.config.hidden_size, generator=g).to(dtype), cache, 0)
        x = torch.randn(1, 1, stage.config.hidden_size, generator=g).to(dtype)
        return (stage.forward_batch(x, [Span(cache, start, 1)]) - x).float()

    model_dir = family_dirs("ministral3")
    bf16, fp32 = OurModel(model_dir, torch.bfloat16, splits=[2]), OurModel(model_dir, splits=[2])
    for ours, ref in zip(bf16.stages, fp32.stages):
        got, want = decode_step(ours, torch.bfloat16, 11), decode_step(ref, torch.float32, 11)
        assert not any(isinstance(p, DecodePlan) for p in ours._plans.values())
        assert (got - want).abs().max().item() < 0.08 * want.abs().max().item()
        decode_step(ours, torch.bfloat16, 2)  # inside the original context a plan takes the step, where plans run
        assert any(isinstance(p, DecodePlan) for p in ours._plans.values()) == planned


@pytest.mark.parametrize("name", ["llama", "phi3", "gemma3", "glm4", "mixtral", "qwen2-moe"])
def test_a_layer_range_reads_only_its_bytes(family_dirs, tmp_path, name):
    """Layers [1, 3) load and compute the same with every other byte of the checkpoint turned to NaN."""
    import shutil

    model_dir = shutil.copytree(family_dirs(name), tmp_path / name)
    config = ModelConfig.from_file(model_dir / "config.json")
    keep = set(layer_tensor_names(config, 1, 3))
    hidden = torch.randn(1, len(PROMPT), config.hidden_size, generator=torch.Generator().manual_seed(0))

    def run_stage():
        stage = Stage.load(config, WeightIndex.open(model_dir), 1, 3, torch.float32)
        return stage(hidden, stage.new_cache(len(PROMPT), torch.float32, "cpu"), 0)

    clean = run_stage()
    index = WeightIndex.open(model_dir)
    assert keep <= set(index.tensors) and len(keep) < len(index.tensors)
    for info in index.tensors.values():
        if info.name not in keep:
            with open(info.file, "r+b") as f:
                f.seek(info.start)
                f.write(b"\xff" * info.nbytes)  # NaN in every float format
    assert torch.equal(run_stage(), clean)
    norm = "model.layers.0.input_layernorm.weight"
    with pytest.raises(WeightsError, match=f"{norm} holds NaN"):  # the bytes left out really are garbage
        index.load([norm])


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("name", FAMILIES)
def test_quantized_weights_and_experts_follow_fp32(family_dirs, name, quant):
    from tc.local import load_local_generator

    model_dir = family_dirs(name)
    generator = load_local_generator(model_dir, dtype="fp32", quant=quant, group_size=32)
    stage = generator.pipeline.stages[0]
    kind = Int8Linear if quant == "int8" else Int4Linear
    assert not any(isinstance(m, torch.nn.Linear) for m in stage.modules())  # every linear layer quantized
    config = ModelConfig.from_file(model_dir / "config.json")
    if config.experts is not None:
        experts = [m for n, m in stage.named_modules() if ".experts." in n and isinstance(m, kind)]
        assert len(experts) >= config.experts.count * 2  # gate_up and down of every expert of a sparse layer
        assert not any(isinstance(m, kind) for n, m in stage.named_modules() if n.endswith("mlp.gate"))  # router
    ours = generator.head.logits(generator.pipeline.prefill(generator.head.embed(torch.tensor([PROMPT])),
                                                            len(PROMPT)))[0]
    ref = OurModel(model_dir).full_logits(PROMPT)
    # OLMo 2's, OLMo 3's and EXAONE 4's norms after each sublayer (and none before) bring every sublayer's output,
    # and its weights' rounding, to the residual stream's size, where a pre-norm layer adds a little to it:
    # transformers' own tiny OLMo 2, its layers' weights quantized to int4 and back, moves by 0.39 of the largest
    # logit, as tc's does (its int4 Llama's, by 0.07; EXAONE 4's, by 0.24-0.31)
    tolerance = 0.05 if quant == "int8" else 0.3 if config.pre_norms else 0.5
    assert (ours - ref).abs().max().item() < tolerance * ref.abs().max().item()


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("name", FAMILIES)
def test_weights_quantized_as_they_stream_in_hold_the_bits_of_the_loaded_layers_quantized(family_dirs, name, quant,
                                                                                          monkeypatch):
    """A stage whose weights are quantized slab by slab while they load (slabs of a few rows here, crossing the
    boundaries between q, k and v and between gate and up) equals the stage loaded in 16 bits and then quantized,
    bit for bit: experts, fused and unfused checkpoints, biases, routers, norms and all."""
    from tc.model import weights
    from tc.model.quant import Quantization, quantize_linears

    model_dir = family_dirs(name)
    config = ModelConfig.from_file(model_dir / "config.json")
    index = WeightIndex.open(model_dir)
    for dtype in (torch.float32, torch.bfloat16):
        loaded = Stage.load(config, index, 1, 3, dtype, pack=False)
        quantize_linears(loaded, quant, 32)
        monkeypatch.setattr(weights, "SLAB_BYTES", 5 * config.hidden_size * 4)  # 5 rows of fp32, 10 of bf16
        streamed = Stage.load(config, index, 1, 3, dtype, pack=False, quantization=Quantization(quant, 32))
        monkeypatch.undo()
        assert [(n, type(m)) for n, m in streamed.named_modules()] == [(n, type(m)) for n, m in loaded.named_modules()]
        want = dict([*loaded.named_parameters(), *loaded.named_buffers()])
        got = dict([*streamed.named_parameters(), *streamed.named_buffers()])
        assert got.keys() == want.keys()
        for key, tensor in want.items():
            assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), (dtype, key)


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe"])
def test_planned_bytes_count_experts_as_quantized(family_dirs, tmp_path, name):
    """The plan's layer bytes in int8 are what the loaded layers hold, experts and router included; the router and
    a shared expert's gate (one row, quantized before) stay in the compute dtype."""
    from tc.head.main import build_plan
    from tc.topology import load_topology
    from tc.worker.runtime import stage_weight_bytes

    model_dir = family_dirs(name)
    config = ModelConfig.from_file(model_dir / "config.json")
    topo = load_topology(write_topology(tmp_path / "t.yaml", model_dir, [{"id": "a", "device": "cpu"}],
                                        quant="int8", dtype="bf16"))
    planned = build_plan(topo, config).stages[0].weight_bytes
    from tc.local import load_local_generator

    stage = load_local_generator(model_dir, dtype="bf16", quant="int8").pipeline.stages[0]
    loaded = stage_weight_bytes(stage)
    assert abs(planned - loaded) <= 0.02 * loaded, (planned, loaded)
    sparse = [layer.mlp for layer in stage.layers.values() if hasattr(layer.mlp, "experts")]
    kept = [mlp.gate for mlp in sparse] + [mlp.shared_expert_gate for mlp in sparse
                                           if getattr(mlp, "shared_expert", None) is not None]
    assert len(kept) > len(sparse) if name == "qwen2-moe" else len(kept) == len(sparse) > 0
    assert all(module.weight.dtype == torch.bfloat16 for module in kept)


def test_an_unknown_architecture_is_refused_by_plan_naming_the_supported(family_dirs, tmp_path):
    model_dir = tmp_path / "neox"
    import shutil

    shutil.copytree(family_dirs("llama"), model_dir)
    data = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**data, "architectures": ["GPTNeoXForCausalLM"],
                                                       "model_type": "gpt_neox"}))
    topo = write_topology(tmp_path / "t.yaml", model_dir, [{"id": "a", "device": "cpu"}])
    for command in (["plan", str(topo)], ["head", str(topo)]):
        done = subprocess.run([sys.executable, "-m", "tc", *command], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode != 0
        assert "architectures=['GPTNeoXForCausalLM']" in done.stderr, done.stderr
        assert "LlamaForCausalLM" in done.stderr and "MixtralForCausalLM" in done.stderr
        assert "Traceback" not in done.stderr


def test_the_wire_copy_of_every_family_config_gives_the_same_config(family_dirs):
    for name in FAMILIES:
        config = ModelConfig.from_file(family_dirs(name) / "config.json")
        assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_a_family_setting_tc_would_ignore_is_refused():
    with pytest.raises(ConfigError, match="rope_scaling.type = 'longrope_v2'; tc computes rope types"):
        ModelConfig.from_dict({"architectures": ["Phi3ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 320,
                               "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
                               "rope_scaling": {"type": "longrope_v2", "long_factor": [1.0], "short_factor": [1.0]}})


@pytest.mark.parametrize("rope_scaling", [{"type": "linear", "factor": 2.0}, {"type": "dynamic", "factor": 2.0},
                                          {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}])
def test_a_phi3_rope_scaling_transformers_refuses_is_refused(rope_scaling):
    """Phi3Config takes longrope alone, and reads yarn as longrope: tc computing linear, dynamic or yarn RoPE for a
    Phi-3 would be running a model transformers does not."""
    import transformers

    data = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 320, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_scaling": rope_scaling}
    with pytest.raises(Exception):
        transformers.Phi3Config.from_dict(json.loads(json.dumps(data)))  # a copy: it rewrites yarn in place
    with pytest.raises(ConfigError, match="Phi-3 scales its rotary embedding with longrope only"):
        ModelConfig.from_dict({"architectures": ["Phi3ForCausalLM"], **data})


@pytest.mark.parametrize("architecture", ["GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_a_gemma_with_bidirectional_attention_is_refused(family_dirs, architecture):
    """transformers' Gemma attention stops being causal where config.json sets use_bidirectional_attention."""
    model_dir = family_dirs({"GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2"}.get(architecture, "gemma3"))
    data = json.loads((model_dir / "config.json").read_text())
    assert ModelConfig.from_dict({**data, "use_bidirectional_attention": False}) == ModelConfig.from_dict(data)
    with pytest.raises(ConfigError, match="use_bidirectional_attention = true; tc runs Gemma as a causal"):
        ModelConfig.from_dict({**data, "use_bidirectional_attention": True})


def test_a_gemma_whose_two_activation_keys_disagree_is_refused(family_dirs):
    """Gemma 1's MLP read hidden_activation before transformers 4.48 and hidden_act since: where they name
    different functions, the model computes differently by version."""
    data = json.loads((family_dirs("gemma") / "config.json").read_text())
    agreeing = {**data, "hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"}  # Gemma 1.0 as now fixed
    assert ModelConfig.from_dict(agreeing).hidden_act == "gelu_pytorch_tanh"
    with pytest.raises(ConfigError, match="hidden_activation = 'silu' and hidden_act = 'gelu'; transformers"):
        ModelConfig.from_dict({**data, "hidden_act": "gelu", "hidden_activation": "silu"})


def test_gemma_1_shapes_config_json_leaves_out_are_gemma_configs():
    """GemmaConfig takes heads of 256 and 16 KV heads (not one per query head) where config.json names none, and
    ties the lm_head to the embedding."""
    import transformers

    data = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 16,
            "vocab_size": 320, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}
    ours = ModelConfig.from_dict({"architectures": ["GemmaForCausalLM"], **data})
    theirs = transformers.GemmaConfig(**data)
    assert (ours.head_dim, ours.num_key_value_heads, ours.tie_word_embeddings, ours.hidden_act) == \
        (theirs.head_dim, theirs.num_key_value_heads, theirs.tie_word_embeddings, theirs.hidden_act) == \
        (256, 16, True, "gelu_pytorch_tanh")


@pytest.mark.parametrize("key", ["embedding_multiplier", "attention_multiplier", "residual_multiplier",
                                 "logits_scaling"])
@pytest.mark.parametrize("value", [None, 0, -0.5, "12", float("inf")])
def test_a_granite_multiplier_that_is_not_a_positive_number_is_refused(family_dirs, key, value):
    data = json.loads((family_dirs("granite") / "config.json").read_text())
    with pytest.raises(ConfigError, match=f"{key} = .*; expected a positive number"):
        ModelConfig.from_dict({**data, key: value})


@pytest.mark.parametrize("name, reference", [
    ("olmo2", "olmo2.modeling_olmo2.Olmo2RMSNorm"), ("helium", "helium.modeling_helium.HeliumRMSNorm"),
    ("glm4", "glm4.modeling_glm4.Glm4RMSNorm"), ("cohere", "cohere.modeling_cohere.CohereLayerNorm")])
def test_bf16_norms_round_as_the_familys_reference(family_dirs, name, reference):
    """Olmo2RMSNorm and HeliumRMSNorm multiply by their weight in fp32 and round once, where Llama's (GLM's) rounds
    and then multiplies: in bf16 about a quarter of the outputs differ by an ulp between the two ways (up to fp32's
    last bits, which may round a few apart on another CPU). Cohere's layer norm subtracts the mean, all in fp32."""
    import importlib

    from tc.model.qwen2 import norm

    module, _, cls = reference.rpartition(".")
    theirs_cls = getattr(importlib.import_module(f"transformers.models.{module}"), cls)
    config = ModelConfig.from_file(family_dirs(name) / "config.json")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(16, config.hidden_size, generator=g) * 3 + 0.5).bfloat16()
    weight = (1 + 0.3 * torch.randn(config.hidden_size, generator=g)).bfloat16()
    ours, theirs = norm(config).bfloat16(), theirs_cls(config.hidden_size, eps=config.rms_norm_eps).bfloat16()
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
        assert (ours(x) != theirs(x)).float().mean().item() < 0.01


def test_gemma_files_without_layer_types_slide_as_transformers_4_did():
    """Published Gemma 2 and 3 config.json files (written by transformers 4.x) list no layer_types."""
    shapes = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 12, "num_attention_heads": 4,
              "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 320, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 16, "sliding_window": 512}
    gemma2 = ModelConfig.from_dict({"architectures": ["Gemma2ForCausalLM"], **shapes, "rope_theta": 10000.0})
    assert gemma2.sliding_windows == (512, None) * 6
    gemma3 = ModelConfig.from_dict({"architectures": ["Gemma3ForCausalLM"], **shapes, "sliding_window_pattern": 6,
                                    "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
                                    "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert gemma3.sliding_windows == (512, 512, 512, 512, 512, None) * 2
    assert (gemma3.rope.theta, gemma3.rope.type, gemma3.local_rope.theta, gemma3.local_rope.type) == \
        (1e6, "linear", 10000.0, "default")
    assert gemma3.layer_rope(0) == gemma3.local_rope and gemma3.layer_rope(5) == gemma3.rope


@pytest.mark.parametrize("name, changes, message", [
    ("smollm3", {"no_rope_layers": [1, 0, 1]}, r"no_rope_layers = \[1, 0, 1\]; expected a 1 \(RoPE\) or 0"),
    ("smollm3", {"no_rope_layers": [1, 2, 1, 1]}, r"no_rope_layers = \[1, 2, 1, 1\]; expected"),
    ("smollm3", {"no_rope_layers": None, "no_rope_layer_interval": 0}, "no_rope_layer_interval = 0; expected"),
    ("smollm3", {"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 5},
     "layer_types holds sliding_attention with use_sliding_window = False and sliding_window = 5"),
    ("smollm3-window", {"layer_types": ["chunked_attention"] * 4}, "layer_types holds 'chunked_attention'"),
    ("olmo3", {"rope_parameters": None, "rope_theta": 10000.0}, "rope_theta = 10000.0 without rope_parameters by "
     "layer type; transformers 4.x turns the sliding layers at that base, 5.x at 500000"),
    ("olmo3", {"sliding_window": None}, "sliding_window = null while layer_types holds sliding_attention"),
    ("olmo3", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling = .* beside rope_parameters"),
    ("exaone4-hybrid", {"sliding_window": None}, "sliding_window = null while layer_types holds sliding_attention"),
    # Exaone4Config's rule divides by the pattern: transformers fails on a file that names a string and no types
    ("exaone4-hybrid", {"layer_types": None, "sliding_window_pattern": "LLLG"},
     "names no layer_types, with sliding_window = 5 and sliding_window_pattern = 'LLLG'; give layer_types"),
    ("cohere", {"use_qk_norm": True}, "use_qk_norm = true"),
    ("cohere", {"logit_scale": 0}, "logit_scale = 0; expected a positive number"),
    ("cohere", {"logit_scale": None}, "logit_scale = null; expected a positive number"),
    ("cohere", {"layer_norm_eps": "1e-5"}, 'layer_norm_eps = "1e-5"; expected a positive number such as 1e-05'),
    ("cohere2", {"sliding_window": None}, "sliding_window = null while layer_types holds sliding_attention"),
    # Ministral 3's query scaling needs both numbers: transformers fails without either
    ("ministral3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}},
     "llama_4_scaling_beta = None and rope_parameters.original_max_position_embeddings = 4; Ministral 3 scales"),
    ("ministral3", {"rope_parameters": {**MINISTRAL3_ROPE, "original_max_position_embeddings": 4.5}},
     "original_max_position_embeddings = 4.5; Ministral 3 scales its queries by both"),
    ("ministral3", {"rope_parameters": {**MINISTRAL3_ROPE, "llama_4_scaling_beta": -1}},
     "llama_4_scaling_beta = -1 and"),
])
def test_a_layer_kind_or_setting_tc_does_not_compute_is_refused(family_dirs, name, changes, message):
    data = json.loads((family_dirs(name) / "config.json").read_text())
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**data, **changes})


# Keys a config.json may leave out (written by hand, or by a tool that writes only what differs from the defaults),
# whose transformers default is the family's own rather than what most families take: Gemma 2's soft caps, query
# scale and activation, Gemma 3's two rotary bases (with linear scaling on the global layers only, and the 4.x
# sliding_window_pattern), Mixtral's rotary base; Gemma 1's activation, which its 1.0 files give as "gelu", the name
# of another function, and GemmaConfig reads as the tanh approximation; Granite's multipliers, its attention scale
# among them, which is then 1 rather than head_dim ** -0.5.
GEMMA3_4X = {"sliding_window_pattern": 2, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
LEFT_OUT = {  # case: (family, keys dropped, keys added)
    "gemma": ("gemma", {"hidden_act"}, {}),
    "gemma-1.0-gelu": ("gemma", {"hidden_act"}, {"hidden_act": "gelu"}),
    "gemma2": ("gemma2", {"attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                          "hidden_activation", "rope_parameters"}, {}),
    "gemma3": ("gemma3", {"rope_parameters", "layer_types", "_sliding_window_pattern"}, GEMMA3_4X),
    "gemma3-no-local-base": ("gemma3", {"rope_parameters", "layer_types", "_sliding_window_pattern"},
                             {**GEMMA3_4X, "rope_theta": 1e6}),
    "mixtral": ("mixtral", {"rope_parameters"}, {}),
    "granite": ("granite", {"embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"},
                {}),
    # SmolLM3's NoPE layers by no_rope_layer_interval, its rotary base (2e6), and its window on the NoPE layers
    "smollm3": ("smollm3", {"no_rope_layers", "layer_types", "rope_parameters"}, {"no_rope_layer_interval": 2}),
    "smollm3-window": ("smollm3-window", {"layer_types", "rope_parameters"}, {}),
    # OLMo 3 as 4.x wrote it: one rope_scaling (for the global layers) and three sliding layers to a global one
    "olmo3": ("olmo3", {"layer_types", "rope_parameters"},
              {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # EXAONE 4's layer types by sliding_window_pattern, every third layer full (and NoPE), 4.x's rotary layout
    "exaone4": ("exaone4-hybrid", {"layer_types", "rope_parameters"},
                {"sliding_window_pattern": 3, "rope_theta": 10000.0}),
    # GLM's half of each head rotating and biases on q/k/v where left out, 4.x's rotary layout
    "glm": ("glm", {"rope_parameters", "attention_bias"},
            {"rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64}}),
    "glm4": ("glm4", {"rope_parameters", "attention_bias"}, {"rope_theta": 10000.0}),
    # ERNIE 4.5's 2 KV heads, tied embeddings and rotary base 5e5; Helium's base 1e5 and eps 1e-8; Seed-OSS's biases
    "ernie4.5": ("ernie4.5", {"num_key_value_heads", "tie_word_embeddings", "rope_parameters", "rms_norm_eps"}, {}),
    "helium": ("helium", {"rope_parameters", "rms_norm_eps"}, {}),
    "seed-oss": ("seed-oss", {"attention_bias", "attention_out_bias", "rope_parameters"}, {}),
    # Cohere's logit scale, epsilon, tied embeddings, biases and rotary base (5e5, where Cohere 2 takes 1e4); Cohere
    # 2's layers by sliding_window_pattern
    "cohere": ("cohere", {"logit_scale", "layer_norm_eps", "tie_word_embeddings", "attention_bias", "rope_parameters"},
               {}),
    "cohere2": ("cohere2", {"layer_types", "head_dim"}, {"sliding_window_pattern": 2}),
    # Ministral 3's yarn and query scaling (past 16384 positions, beyond these prompts)
    "ministral3": ("ministral3", {"rope_parameters"}, {}),
}


@pytest.mark.parametrize("case", LEFT_OUT)
def test_keys_config_json_leaves_out_take_the_family_defaults_transformers_takes(family_dirs, tmp_path, case):
    import shutil

    name, dropped, added = LEFT_OUT[case]
    model_dir = shutil.copytree(family_dirs(name), tmp_path / name)
    data = json.loads((model_dir / "config.json").read_text())
    assert dropped <= set(data)
    data = {**{k: v for k, v in data.items() if k not in dropped}, **added}
    (model_dir / "config.json").write_text(json.dumps(data))
    ref = hf_logits(hf_family_model(model_dir), PROMPT)
    ours = OurModel(model_dir, splits=[2])
    assert (ours.full_logits(PROMPT) - ref).abs().max().item() < 1e-4
    assert (ours.cached_logits(PROMPT, split=4) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("architecture, config_class", [
    ("MistralForCausalLM", "MistralConfig"), ("Gemma2ForCausalLM", "Gemma2Config"),
    ("Gemma3ForCausalLM", "Gemma3TextConfig"), ("MixtralForCausalLM", "MixtralConfig")])
def test_a_sliding_window_config_json_leaves_out_is_the_one_transformers_takes(architecture, config_class):
    """Mistral 7B v0.1's window, 4096, is MistralConfig's default (v0.3 turns it off with null); Gemma's too.
    Too wide to show in a tiny model's logits, so the windows are compared with transformers' config; and the head
    size, which Gemma's config takes as 256 rather than hidden_size / num_attention_heads."""
    import transformers

    data = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-6, "num_local_experts": 4, "num_experts_per_tok": 2}
    ours = ModelConfig.from_dict({"architectures": [architecture], **data})
    theirs = getattr(transformers, config_class)(**data)
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or 64 // 4)  # Mixtral's None: derived
    types = getattr(theirs, "layer_types", None) or ["sliding_attention"] * 6
    windows = tuple(theirs.sliding_window if t == "sliding_attention" else None for t in types)
    assert ours.sliding_windows == (windows if any(windows) else ())  # (): no layer slides (Mixtral's default)
    off = ModelConfig.from_dict({"architectures": [architecture], **data, "sliding_window": None})
    assert off.sliding_windows == ()


@pytest.mark.parametrize("architecture, config_class, heads", [
    ("MistralForCausalLM", "MistralConfig", 64), ("Exaone4ForCausalLM", "Exaone4Config", 64),
    ("GlmForCausalLM", "GlmConfig", 64), ("Glm4ForCausalLM", "Glm4Config", 64),
    ("Ernie4_5ForCausalLM", "Ernie4_5Config", 64), ("SeedOssForCausalLM", "SeedOssConfig", 64),
    ("HeliumForCausalLM", "HeliumConfig", 40)])
def test_kv_heads_config_json_leaves_out_are_the_ones_transformers_takes(architecture, config_class, heads):
    """MistralConfig's 8, Exaone4Config's 32, GLM's and ERNIE 4.5's 2, Seed-OSS's 8 and Helium's 20, not one per
    query head; and the head size where it differs from hidden_size / num_attention_heads."""
    import transformers

    data = {"hidden_size": 256, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": heads,
            "vocab_size": 320, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}
    theirs = getattr(transformers, config_class)(**data)
    ours = ModelConfig.from_dict({"architectures": [architecture], **data})
    assert ours.num_key_value_heads == theirs.num_key_value_heads < heads
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or 256 // heads)


def test_a_qwen3_config_json_without_head_dim_has_the_heads_of_128_transformers_gives_it(tmp_path):
    """Qwen3Config's head_dim defaults to 128, not hidden_size / num_attention_heads (16 here)."""
    model_dir = write_family_model(tmp_path / "qwen3", "qwen3", seed=1, head_dim=128)
    data = json.loads((model_dir / "config.json").read_text())
    del data["head_dim"]
    (model_dir / "config.json").write_text(json.dumps(data))
    ref = hf_logits(hf_family_model(model_dir), PROMPT)
    assert ModelConfig.from_file(model_dir / "config.json").head_dim == 128
    assert (OurModel(model_dir).full_logits(PROMPT) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("name, rope_scaling", [
    ("qwen2-linear-rope", {"type": "yarn", "factor": 4.0}),
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
])
def test_rope_scaling_without_its_original_context_scales_from_the_models_as_transformers_does(
        family_dirs, tmp_path, name, rope_scaling):
    """transformers takes max_position_embeddings where rope_scaling names no original_max_position_embeddings."""
    import shutil

    model_dir = shutil.copytree(family_dirs(name), tmp_path / name)
    data = json.loads((model_dir / "config.json").read_text())
    data.pop("rope_parameters", None)
    (model_dir / "config.json").write_text(json.dumps({**data, "rope_theta": 1e4, "rope_scaling": rope_scaling}))
    ref = hf_logits(hf_family_model(model_dir), PROMPT)
    assert (OurModel(model_dir).full_logits(PROMPT) - ref).abs().max().item() < 1e-4


def test_a_llama_saved_with_its_rotary_frequencies_loads_and_runs_as_without(family_dirs, tmp_path):
    """transformers before 4.31 saved each layer's rotary_emb.inv_freq (huggyllama/llama-7b, early Llama 2
    fine-tunes): tc refused such a checkpoint as holding weights it would leave out, where transformers leaves these
    unread, config.json giving them. A worker's check of its layers' tensors passes, and the logits are the same."""
    from tc.protocol.messages import Assignment
    from tc.worker.runtime import check_layer_tensors
    from tiny_families import edited_copy

    model_dir = family_dirs("llama")
    config = ModelConfig.from_file(model_dir / "config.json")
    half = config.head_dim // 2
    saved = edited_copy(model_dir, tmp_path / "saved", tensors=lambda tensors: {**tensors, **{
        f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.arange(half, dtype=torch.float32)
        for i in range(config.num_hidden_layers)}})
    index = WeightIndex.open(saved)
    index.refuse_unused_in_layers(config, 0, config.num_hidden_layers)
    planned = len(layer_tensor_names(config, 0, 2))
    assignment = Assignment(model_id=str(saved), model_source="local", revision=None, device="cpu",
                            architecture=config.model_type, quant="fp16", group_size=128, compute_dtype="fp32",
                            layer_start=0, layer_end_exclusive=2, config=config.to_dict(), tensor_count=planned)
    check_layer_tensors(index, assignment)
    assert torch.equal(OurModel(saved, splits=[2]).full_logits(PROMPT), OurModel(model_dir, splits=[2]).full_logits(
        PROMPT))
