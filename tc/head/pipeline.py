"""The pipeline as the head sees it: hidden states go to each worker in plan order and come back.

The head relays every hop (head -> w1 -> head -> w2 -> ... -> head) rather than workers passing hidden states
to each other: a decode-sized hop costs well under a millisecond on a LAN, and a single hub means one place
that knows where a request is when a worker disappears.

Resuming: the pipeline keeps what it fed the first stage for the request in flight (the prompt's embeddings
and each decode step's). When a worker is lost mid-request and resume is on, it waits up to the grace period
for the lost node's entry to be filled again (the same worker back, or a spare), then replays all of those
inputs as one prefill from position 0, through every stage, with the request's cache capacity. That rebuilds
every stage's KV cache, and the last position's output stands for the interrupted step's, so the generation
carries on and the client sees it take longer. The tokens already chosen stay; what follows is what a new
request for the prompt and those tokens would give. One prefill over N positions rounds differently from N
decode steps: in fp32 the difference (~1e-6) leaves greedy output as it was without the loss, while in bf16 or
fp16 the continuation may differ from an uninterrupted run (docs/design.md, tests/test_resume_dtypes.py).
"""
from __future__ import annotations

import itertools
import logging
import time

import torch

from ..protocol.messages import RunDecode, RunPrefill
from .service import WorkerLost
from .workers import HeadShuttingDown, WorkerLink, WorkerRegistry

log = logging.getLogger(__name__)


class RemotePipeline:
    def __init__(self, registry: WorkerRegistry, resume: bool | None = None, resume_grace_s: float | None = None):
        settings = registry.topology.head
        self.registry = registry
        self.resume = settings.resume if resume is None else resume
        self.resume_grace_s = settings.resume_grace_s if resume_grace_s is None else resume_grace_s
        self._ids = itertools.count(1)
        self.request_id = ""
        self.seq = 0
        self.last_hops: list[tuple[str, float, float]] = []  # (node, compute s, round trip s) of the last step
        self.resumes = 0  # requests carried over a lost worker, since start
        self._inputs: list[torch.Tensor] = []  # first-stage inputs of the request in flight, [1, L_i, hidden]
        self._capacity = 0

    def _relay(self, make_message, hidden: torch.Tensor, links: list[WorkerLink]) -> torch.Tensor:
        out_dtype = hidden.dtype
        hops = []
        for link in links:
            self.seq += 1
            sent = time.perf_counter()
            reply = link.request(make_message(hidden), self.request_id, self.seq)
            hops.append((link.node_id or link.entry_id, reply.compute_seconds, time.perf_counter() - sent))
            hidden = reply.hidden_state
        self.last_hops = hops
        return hidden.to(out_dtype)

    def _prefill_all(self, hidden: torch.Tensor) -> torch.Tensor:
        links = self.registry.links_in_order()
        capacity = self._capacity
        return self._relay(lambda h: RunPrefill(position_start=0, cache_capacity=capacity, hidden_state=h),
                           hidden, links)

    def _new_request(self) -> None:
        self.request_id, self.seq = f"req-{next(self._ids)}", 0

    def prefill(self, hidden: torch.Tensor, capacity: int) -> torch.Tensor:
        self._new_request()
        self._inputs, self._capacity = [hidden], capacity
        try:
            return self._prefill_all(hidden)
        except WorkerLost as exc:
            return self._recover(exc)

    def decode(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        self._inputs.append(hidden)
        try:
            links = self.registry.links_in_order()
            return self._relay(lambda h: RunDecode(position=position, hidden_state=h), hidden, links)
        except WorkerLost as exc:
            return self._recover(exc)[:, -1:]  # [1, 1, hidden]: the step's own position

    def _recover(self, lost: WorkerLost) -> torch.Tensor:
        """Replay the request so far on a refilled pipeline; returns the output for every position replayed.

        Raises HeadShuttingDown when the head stops, and WorkerLost when resume is off or the grace period ends
        before the pipeline is whole again.
        """
        if self.registry.stopping.is_set():
            raise HeadShuttingDown() from lost
        if not self.resume:
            raise lost
        deadline = time.monotonic() + self.resume_grace_s
        replay = torch.cat(self._inputs, dim=1)  # [1, positions so far, hidden]
        log.warning("worker %s was lost (%s); request %s waits up to %.0fs for it to be replaced, then resumes "
                    "from position %d", lost.node_id, _reason(lost), self.request_id, self.resume_grace_s,
                    replay.shape[1])
        while True:
            if not self.registry.wait_ready(deadline - time.monotonic()):
                if self.registry.stopping.is_set():
                    raise HeadShuttingDown() from lost
                raise WorkerLost(lost.node_id, f"{_reason(lost)}; no worker filled its place within the "
                                 f"{self.resume_grace_s:g}s resume grace period") from lost
            self._new_request()
            started = time.perf_counter()
            try:
                out = self._prefill_all(replay)
            except WorkerLost as again:
                log.warning("resuming failed (%s); waiting again", again)
                lost = again
                continue
            self.resumes += 1
            log.info("request resumed on a refilled pipeline: %d positions replayed in %.2fs", replay.shape[1],
                     time.perf_counter() - started)
            return out


def _reason(lost: WorkerLost) -> str:
    """The reason a WorkerLost was raised with, out of service.py's sentence around it."""
    text = str(lost)
    prefix = f"worker {lost.node_id} was lost during the generation ("
    suffix = "); the request was not completed"
    if text.startswith(prefix) and text.endswith(suffix):
        return text[len(prefix):-len(suffix)]
    return text
