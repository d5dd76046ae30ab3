"""What a resumed request gives, in fp32 and in bf16, exactly as docs/design.md states it.

The head replays the request so far as one prefill when a lost worker's entry is filled again. The guarantee:
the tokens sent before the loss stay, and the rest is what a new greedy request for the prompt followed by those
tokens gives. Only in fp32 is that also the uninterrupted reply; in bf16 one prefill over N positions rounds
differently from N decode steps, so the text after the resume point may differ from it.

The head runs in this process, so the test picks the exact step at which a worker dies: between two decode
steps, with the generation suspended, it kills worker b, starts a new worker for b's entry, and lets the
generation go on. Real worker processes over loopback.
"""
from __future__ import annotations

import sys
import time

import pytest

from cluster import Process, write_topology
from tc.head.main import Head, start_head
from tc.sampling import SamplingParams
from tc.topology import load_topology
from tiny_model import write_tiny_model

PROMPT = "the quick brown fox"
MAX_TOKENS = 24
LOST_AFTER = 8  # tokens generated before worker b dies


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen", seed=7, shards=2)


def start_worker(head: Head, node_id: str, log_path) -> Process:
    # cwd is the repository root (Process's default), so the workers run this checkout's tc
    return Process([sys.executable, "-m", "tc", "worker", "--join", f"127.0.0.1:{head.listen_port}", "--node-id",
                    node_id, "--device", "cpu", "--threads", "1", "--retry-max-s", "1"], log_path)


class KillBeforeStep:
    """The head's pipeline.run, wrapped: every call's entries noted in `calls`, and before the call numbered in
    `kill` (from 1), that node's worker SIGKILLed and a new process started for its entry. `restore()` unwraps."""

    def __init__(self, head: Head, workers: dict[str, Process], log_dir):
        self.head, self.workers, self.log_dir = head, workers, log_dir
        self.pipeline = head.service.generator.pipeline
        self.calls: list[list] = []
        self.kill: dict[int, str] = {}
        self._run, self.pipeline.run = self.pipeline.run, self._run_killing

    def _run_killing(self, entries, hidden):
        self.calls.append(list(entries))
        node = self.kill.get(len(self.calls))
        if node is not None:
            lost = self.workers.pop(node)
            lost.proc.kill()
            lost.stop()
            self.workers[node] = start_worker(self.head, node, self.log_dir / f"{node}-{len(self.calls)}.log")
        return self._run(entries, hidden)

    def restore(self) -> None:
        self.pipeline.run = self._run


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_resumed_reply_keeps_what_was_sent_and_continues_as_a_new_request_would(tmp_path, model_dir, dtype):
    nodes = [{"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}]
    path = write_topology(tmp_path / "t.yaml", model_dir, nodes, dtype=dtype,
                          head={"heartbeat_s": 0.5, "heartbeat_timeout_s": 3, "resume": True, "resume_grace_s": 120})
    head = start_head(load_topology(path).with_ports(api_port=0, listen_port=0))
    workers = {n: start_worker(head, n, tmp_path / f"{n}.log") for n in ("a", "b")}
    try:
        assert head.registry.wait_ready(300), [w.output() for w in workers.values()]
        service = head.service
        ids = service.tokenizer.encode(PROMPT)
        uninterrupted = service.complete(ids, greedy(MAX_TOKENS)).token_ids
        assert len(uninterrupted) > LOST_AFTER + 1  # no EOS that early: the loss lands mid-reply

        with service.open(ids, greedy(MAX_TOKENS)) as stream:
            steps = iter(stream)
            for _ in range(LOST_AFTER):  # each step has chosen one more token; the next one decodes it
                next(steps)
            workers["b"].proc.kill()
            workers["b"].stop()
            deadline = time.monotonic() + 30
            while "b" not in head.registry.readiness().missing:
                assert time.monotonic() < deadline, "the head never noticed that worker b died"
                time.sleep(0.05)
            # the new worker needs seconds to start and load; the next step is already waiting for it by then
            workers["b-again"] = start_worker(head, "b", tmp_path / "b-again.log")
            for _ in steps:
                pass
            resumed = stream.completion
        assert resumed is not None and head.service.generator.pipeline.resumes == 1

        sent = list(resumed.token_ids[:LOST_AFTER])
        assert sent == list(uninterrupted[:LOST_AFTER])  # what was sent before the loss stays
        continuation = service.complete(ids + sent, greedy(MAX_TOKENS - LOST_AFTER)).token_ids
        assert resumed.token_ids[LOST_AFTER:] == continuation  # and the rest is a new request's for those tokens
        if dtype == "fp32":
            assert resumed.token_ids == uninterrupted  # in fp32, also the reply without the loss
        else:
            differs = next((i for i, (x, y) in enumerate(zip(resumed.token_ids, uninterrupted)) if x != y), None)
            print(f"\n{dtype}: the resumed reply " + ("matches the uninterrupted one" if differs is None else
                                                    f"departs from the uninterrupted one at token {differs}"))
    finally:
        for worker in workers.values():
            worker.stop()
        head.stop()
