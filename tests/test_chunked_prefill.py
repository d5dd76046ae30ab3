"""A long prefill runs through a worker's stage in chunks that bound attention's memory, and computes what one
pass computes: the hidden states, and the cache the decode steps after it read."""
from __future__ import annotations

import pytest
import torch

from tc.model.config import Qwen2Config
from tc.model.weights import layer_tensor_names
from tc.protocol.messages import Assignment, HiddenState, RunDecode, RunPrefill
from tc.worker.runtime import (MIN_PREFILL_CHUNK, StageRuntime, load_assignment, prefill_chunk_positions)


@pytest.mark.parametrize("heads, end, budget, chunk", [
    (14, 8192, 256 << 20, 585),  # the demo model at 8k positions: 585 * 8192 * 14 * 4 bytes <= 256 MiB
    (14, 500, 256 << 20, 9586),  # a usual prompt: one pass
    (14, 32768, 256 << 20, 146),
    (64, 131072, 256 << 20, MIN_PREFILL_CHUNK),  # never below the floor
    (4, 50, 4 * 50 * 4 * 20, 20),
])
def test_chunk_size_from_the_memory_budget(heads, end, budget, chunk):
    assert prefill_chunk_positions(heads, end, budget) == chunk
    if chunk > MIN_PREFILL_CHUNK:
        assert chunk * end * heads * 4 <= budget < (chunk + 1) * end * heads * 4


def load(model_dir, start: int, end: int, budget: int) -> StageRuntime:
    config = Qwen2Config.from_file(model_dir / "config.json")
    msg = Assignment(model_id=str(model_dir), model_source="local", revision=None, device="cpu",
                     architecture="qwen2", quant="fp16", group_size=128, compute_dtype="fp32", layer_start=start,
                     layer_end_exclusive=end, config=config.to_dict(),
                     tensor_count=len(layer_tensor_names(config, start, end)))
    return StageRuntime(load_assignment(msg, model_dir, "cpu"), attention_budget_bytes=budget)


def prefill_then_decode(runtime: StageRuntime, hidden: torch.Tensor, split: int) -> torch.Tensor:
    """Hidden states out of a prefill of positions [0, split) (a cached prefix), a prefill of [split, L - 1) after
    it, and a decode step at L - 1: [1, L, hidden]."""
    length = hidden.shape[1]
    outs = []
    for start, end in ((0, split), (split, length - 1)):
        reply = runtime.prefill(RunPrefill(position_start=start, cache_capacity=length,
                                           hidden_state=hidden[:, start:end].contiguous()))
        assert isinstance(reply, HiddenState), reply
        outs.append(reply.hidden_state)
    reply = runtime.decode(RunDecode(position=length - 1, hidden_state=hidden[:, -1:].contiguous()))
    assert isinstance(reply, HiddenState), reply
    return torch.cat([*outs, reply.hidden_state], dim=1)


def check_chunked_equals_one_pass(model_dir, start: int, end: int, length: int, hidden_size: int, heads: int):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, length, hidden_size, generator=g)
    one_pass = load(model_dir, start, end, budget=1 << 40)
    # a budget that makes chunks of MIN_PREFILL_CHUNK + 1 positions: several per prefill, one that ends short
    chunked = load(model_dir, start, end, budget=(MIN_PREFILL_CHUNK + 1) * heads * length * 4)
    assert prefill_chunk_positions(heads, length - 1, chunked.attention_budget_bytes) < length // 2
    want = prefill_then_decode(one_pass, hidden, split=length // 3)
    got = prefill_then_decode(chunked, hidden, split=length // 3)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_equals_one_pass_on_a_tiny_model(tiny_model_dir):
    config = Qwen2Config.from_file(tiny_model_dir / "config.json")
    check_chunked_equals_one_pass(tiny_model_dir, 1, 4, 120, config.hidden_size, config.num_attention_heads)


@pytest.mark.demo
def test_chunked_prefill_equals_one_pass_on_the_demo_model(demo_model_dir):
    config = Qwen2Config.from_file(demo_model_dir / "config.json")
    check_chunked_equals_one_pass(demo_model_dir, 0, 6, 200, config.hidden_size, config.num_attention_heads)
