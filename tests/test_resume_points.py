"""A worker killed at a chosen step of a batch resumes every request in it to the uninterrupted run's replies.

The batch: one request decoding, beside it a request of two seeded, sampled choices (log-probabilities, a stop
string) whose prompt is read in chunks of head.prefill_chunk between the first one's tokens, and whose second
choice starts from a copy of the first's cache. A worker is SIGKILLed just before a chosen step (while the
prompt is being read, at the step that copies the cache, once both choices decode) and a new process fills its
entry; every reply must then be the uninterrupted one: the same tokens, text, finish reason, and
log-probabilities but for fp32 rounding (docs/design.md, "Losing a worker mid-request"). The head's replay
inputs must be gone once the requests end.

The head runs in this process, so the test picks the exact step: it runs the real RemotePipeline.run, killing
the worker first. Real worker processes over loopback.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from cluster import write_topology
from model_helpers import OurModel
from tc.generation import Completion, Generator
from tc.head.main import start_head
from tc.model.tokenizer import TextTokenizer
from tc.sampling import SamplingParams
from tc.topology import load_topology
from test_resume_dtypes import KillBeforeStep, start_worker
from tiny_model import write_tiny_model

PROMPT = "one two three four five six seven eight nine ten " * 2
CHUNK = 4  # head.prefill_chunk: the second request's prompt takes many steps


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen", seed=7, shards=2)


def sampled(seed: int, max_tokens: int, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed, ignore_eos=True, logprobs=2, **fields)


def test_a_worker_killed_at_any_step_leaves_every_reply_as_without_the_loss(tmp_path, model_dir):
    nodes = [{"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}]
    path = write_topology(tmp_path / "t.yaml", model_dir, nodes, head={
        "heartbeat_s": 0.5, "heartbeat_timeout_s": 3, "resume": True, "resume_grace_s": 120, "max_batch": 4,
        "prefill_chunk": CHUNK})
    head = start_head(load_topology(path).with_ports(api_port=0, listen_port=0))
    workers = {n: start_worker(head, n, tmp_path / f"{n}.log") for n in ("a", "b")}
    service = head.service
    pipeline = service.generator.pipeline
    ids = service.tokenizer.encode(PROMPT)
    killer = KillBeforeStep(head, workers, tmp_path)
    steps, kill = killer.calls, killer.kill  # per pipeline call its entries; call -> the node killed before it

    def batch() -> list[Completion]:
        """The decoding request, and the two choices that join it once it has its first tokens."""
        steps.clear()
        first = service.open_choices(ids[:5], [sampled(21, 60)])[0]
        choices: list[Completion] = []

        def two_choices() -> None:
            streams = service.open_choices(ids, [sampled(31, 30, stop=("a",)), sampled(32, 30)])
            choices.extend(stream.drain() for stream in streams)
            for stream in streams:
                stream.close()

        joining = threading.Thread(target=two_choices)
        joining.start()
        replies = [first.drain()]
        first.close()
        joining.join(180)
        assert not joining.is_alive() and len(choices) == 2, "the two choices did not finish"
        return replies + choices

    try:
        assert head.registry.wait_ready(300), [w.output() for w in workers.values()]
        expected = batch()
        # the steps that read the two choices' prompt (after its first chunk), and the one that copies its cache
        reading = [i for i, step in enumerate(steps, 1) if any(0 < e.start < len(ids) for e in step[1:])]
        copying = next(i for i, step in enumerate(steps, 1) if any(e.copies for e in step))
        assert len(reading) > 3, steps  # the prompt was read in chunks beside the decoding request
        for at, node in [(reading[1], "b"), (reading[len(reading) // 2], "a"), (copying, "b"), (copying + 3, "a")]:
            kill.clear()
            kill[at] = node
            resumes = pipeline.resumes
            got = batch()
            assert pipeline.resumes == resumes + 1, f"the loss at step {at} was not resumed"
            for reply, want in zip(got, expected):
                assert (reply.token_ids, reply.text, reply.finish_reason) == \
                       (want.token_ids, want.text, want.finish_reason), f"{node} killed before step {at}"
                assert [t.logprob.logprob for t in reply.tokens] == \
                       pytest.approx([t.logprob.logprob for t in want.tokens], abs=1e-4)
            # the scheduler releases the sequences just after their last step, but for the caches it keeps for a
            # request that continues them (head.prefix_cache: the single-choice one)
            deadline = time.monotonic() + 5
            while set(pipeline._inputs) != set(service._kept) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert set(pipeline._inputs) == set(service._kept), "the ended sequences' replay inputs are still held"
    finally:
        killer.restore()
        for worker in workers.values():
            worker.stop()
        head.stop()


def test_with_resume_off_the_head_keeps_no_replay_inputs(tmp_path, model_dir):
    """Replay inputs serve a resume alone: with it off, a conversation continued from its kept caches and a request of
    two choices (one copying the other's cache) hold none, and the replies are those of a single process."""
    nodes = [{"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}]
    path = write_topology(tmp_path / "t.yaml", model_dir, nodes, head={"resume": False, "max_batch": 4,
                                                                      "prefill_chunk": CHUNK})
    head = start_head(load_topology(path).with_ports(api_port=0, listen_port=0))
    workers = {n: start_worker(head, n, tmp_path / f"{n}.log") for n in ("a", "b")}
    service = head.service
    pipeline = service.generator.pipeline
    held: list[int] = []  # per pipeline call, the input tensors the pipeline holds after it
    run = pipeline.run

    def run_counting(entries, hidden):
        out = run(entries, hidden)
        held.append(sum(len(parts) for _, parts in pipeline._inputs.values()))
        return out

    pipeline.run = run_counting
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    model = OurModel(model_dir)
    alone = Generator(model.head, TextTokenizer.load(model_dir), model.pipeline(), torch.float32)
    ids = service.tokenizer.encode(PROMPT)
    try:
        assert head.registry.wait_ready(300), [w.output() for w in workers.values()]
        first = service.complete(ids, greedy)
        follow_up = ids + list(first.token_ids) + service.tokenizer.encode(" eleven twelve")
        second = service.complete(follow_up, greedy)
        assert second.cached_prompt_tokens > 0, "the second turn did not continue the first's kept caches"
        streams = service.open_choices(ids, [greedy, greedy])
        choices = [stream.drain() for stream in streams]
        for stream in streams:
            stream.close()
        assert first.token_ids == alone.generate(ids, greedy).token_ids
        assert second.token_ids == alone.generate(follow_up, greedy).token_ids
        assert [c.token_ids for c in choices] == [first.token_ids] * 2
        assert held and set(held) == {0}, f"input tensors held after each step: {held}"
    finally:
        pipeline.run = run
        for worker in workers.values():
            worker.stop()
        head.stop()
