"""A long prefill runs through a worker's stage in chunks that bound attention's memory, and computes what one
pass computes: the hidden states, and the cache the decode steps after it read. The same holds inside a batch of
several sequences, where a long prompt runs in passes beside the other sequences' rows."""
from __future__ import annotations

import pytest
import torch

from tc.model.config import Qwen2Config
from tc.model.weights import layer_tensor_names
from tc.protocol.messages import Assignment, BatchEntry, RunBatch
from tc.worker.runtime import (MIN_PREFILL_CHUNK, StageOutput, StageRuntime, load_assignment, prefill_chunk_positions)


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
    return StageRuntime(load_assignment(msg, model_dir, "cpu"), attention_budget_bytes=budget, max_sequences=4)


def run(runtime: StageRuntime, parts: list[tuple[int, int, int, torch.Tensor]]) -> list[torch.Tensor]:
    """One RUN_BATCH of (sequence, position_start, cache_capacity, rows [1, L, hidden]) parts; each part's output."""
    entries = tuple(BatchEntry(sequence=s, position_start=p, length=h.shape[1], cache_capacity=c)
                    for s, p, c, h in parts)
    reply = runtime.run(RunBatch(entries=entries, hidden_state=torch.cat([h for *_, h in parts], dim=1)))
    assert isinstance(reply, StageOutput), reply
    return list(reply.hidden_state.tensor().split([e.length for e in entries], dim=1))


def prefill_then_decode(runtime: StageRuntime, hidden: torch.Tensor, split: int) -> torch.Tensor:
    """Hidden states out of a prefill of positions [0, split) (a cached prefix), a prefill of [split, L - 1) after
    it, and a decode step at L - 1: [1, L, hidden]."""
    length = hidden.shape[1]
    outs = []
    for start, end in ((0, split), (split, length - 1), (length - 1, length)):
        outs += run(runtime, [(1, start, length, hidden[:, start:end])])
    return torch.cat(outs, dim=1)


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


def test_a_long_prompt_in_a_batch_runs_in_passes_and_equals_each_sequence_alone(tiny_model_dir):
    """A batch of a long prompt (several passes), a short one and a decode step of a third sequence: each output
    is what that sequence gets alone in one pass, and each cache carries on as its own."""
    config = Qwen2Config.from_file(tiny_model_dir / "config.json")
    heads, width = config.num_attention_heads, config.hidden_size
    g = torch.Generator().manual_seed(1)
    long, short, third = (torch.randn(1, n, width, generator=g) for n in (120, 7, 10))
    alone = load(tiny_model_dir, 0, 3, budget=1 << 40)
    want = [*run(alone, [(1, 0, 121, long)]), *run(alone, [(2, 0, 8, short)]),
            torch.cat(run(alone, [(3, 0, 11, third[:, :9])]) + run(alone, [(3, 9, 11, third[:, 9:])]), dim=1)]
    batched = load(tiny_model_dir, 0, 3, budget=(MIN_PREFILL_CHUNK + 1) * heads * 120 * 4)
    assert prefill_chunk_positions(heads, 120, batched.attention_budget_bytes) < 60  # the long prompt takes passes
    first_third = run(batched, [(3, 0, 11, third[:, :9])])
    got = run(batched, [(1, 0, 121, long), (2, 0, 8, short), (3, 9, 11, third[:, 9:])])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(first_third + [got[2]], dim=1), want[2], rtol=1e-5, atol=1e-5)
    step = torch.randn(1, 2, width, generator=g)  # one decode step each for sequences 1 and 2, as a batch
    got = run(batched, [(1, 120, 121, step[:, :1]), (2, 7, 8, step[:, 1:])])
    want = run(alone, [(1, 120, 121, step[:, :1])]) + run(alone, [(2, 7, 8, step[:, 1:])])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_worker_refuses_more_sequences_than_assigned_and_forgets_released_ones(tiny_model_dir):
    runtime = load(tiny_model_dir, 0, 2, budget=1 << 40)  # max_sequences 4
    width = Qwen2Config.from_file(tiny_model_dir / "config.json").hidden_size
    for sequence in range(4):
        run(runtime, [(sequence, 0, 4, torch.randn(1, 2, width))])
    too_many = RunBatch(entries=(BatchEntry(sequence=9, position_start=0, length=1, cache_capacity=4),),
                        hidden_state=torch.randn(1, 1, width))
    assert "would hold 5 sequences' caches; this worker was assigned 4" in runtime.run(too_many).message
    runtime.release((0, 1))
    assert sorted(runtime.caches) == [2, 3]
    assert isinstance(runtime.run(too_many), StageOutput)
    unknown = RunBatch(entries=(BatchEntry(sequence=0, position_start=2, length=1, cache_capacity=4),),
                       hidden_state=torch.randn(1, 1, width))
    assert "sequence 0 continues at position 2 but this worker holds no cache" in runtime.run(unknown).message


def test_chunked_prefill_equals_one_pass_on_a_tiny_model(tiny_model_dir):
    config = Qwen2Config.from_file(tiny_model_dir / "config.json")
    check_chunked_equals_one_pass(tiny_model_dir, 1, 4, 120, config.hidden_size, config.num_attention_heads)


@pytest.mark.demo
def test_chunked_prefill_equals_one_pass_on_the_demo_model(demo_model_dir):
    config = Qwen2Config.from_file(demo_model_dir / "config.json")
    check_chunked_equals_one_pass(demo_model_dir, 0, 6, 200, config.hidden_size, config.num_attention_heads)


def test_a_worker_starts_a_cache_from_the_start_of_another_copied_or_its_own_cut_back(tiny_model_dir):
    """An entry with a source starts from that sequence's first positions: copied into a new cache (the source
    keeps all of its own) or, naming itself, cut back; either continues as a sequence that read those positions
    itself would. A source missing, or holding too few positions, is refused before anything is allocated."""
    runtime = load(tiny_model_dir, 0, 3, budget=1 << 40)  # max_sequences 4
    width = Qwen2Config.from_file(tiny_model_dir / "config.json").hidden_size
    g = torch.Generator().manual_seed(3)
    text, other, step = (torch.randn(1, n, width, generator=g) for n in (20, 5, 1))
    alone = load(tiny_model_dir, 0, 3, budget=1 << 40)
    run(alone, [(0, 0, 12, text[:, :12])])
    (want_other,) = run(alone, [(0, 12, 30, other)])  # what a sequence that read the first 12 itself gets
    run(runtime, [(1, 0, 21, text)])

    def with_source(sequence: int, start: int, capacity: int, rows: torch.Tensor, source: int):
        entry = BatchEntry(sequence=sequence, position_start=start, length=rows.shape[1], cache_capacity=capacity,
                           source=source)
        return runtime.run(RunBatch(entries=(entry,), hidden_state=rows))

    copied = with_source(2, 12, 30, other, source=1)  # a larger capacity than the source's
    torch.testing.assert_close(copied.hidden_state.tensor(), want_other, rtol=1e-5, atol=1e-5)
    assert (runtime.caches[1].length, runtime.caches[2].length, runtime.caches[2].capacity) == (20, 17, 30)
    # the source still holds all of its text: its next step is the one it would have had without the copy
    run(alone, [(5, 0, 21, text)])
    (want_step,) = run(alone, [(5, 20, 21, step)])
    torch.testing.assert_close(run(runtime, [(1, 20, 21, step)])[0], want_step, rtol=1e-5, atol=1e-5)
    cut = with_source(1, 12, 21, other, source=1)  # its own, cut back: the room it has is enough
    torch.testing.assert_close(cut.hidden_state.tensor(), want_other, rtol=1e-5, atol=1e-5)
    assert (runtime.caches[1].length, runtime.caches[1].capacity) == (17, 21)
    assert "starts from the first 18 positions of sequence 1's cache, but this worker holds a cache of 17 " \
           "positions for it" in with_source(3, 18, 30, other, source=1).message
    assert "holds no cache for it" in with_source(3, 4, 30, other, source=9).message
    # a copy beside a step of its source in the same batch: made before the source's new position is written
    entries = (BatchEntry(sequence=1, position_start=17, length=1, cache_capacity=21),
               BatchEntry(sequence=3, position_start=12, length=5, cache_capacity=30, source=1))
    both = runtime.run(RunBatch(entries=entries, hidden_state=torch.cat([step, other], dim=1)))
    torch.testing.assert_close(both.hidden_state.tensor()[:, 1:], want_other, rtol=1e-5, atol=1e-5)
    assert (runtime.caches[1].length, runtime.caches[3].length) == (18, 17)
    runtime.release((3,))
    run(runtime, [(3, 0, 4, text[:, :2]), (4, 0, 4, text[:, :2])])  # four caches held: a copy would be a fifth
    assert "would hold 5 sequences' caches" in with_source(6, 4, 30, other, source=1).message
    assert sorted(runtime.caches) == [1, 2, 3, 4]
