"""The pipeline as the head sees it: hidden states go to each worker in plan order and come back.

The head relays every hop (head -> w1 -> head -> w2 -> ... -> head) rather than workers passing hidden states
to each other: a decode-sized hop costs well under a millisecond on a LAN, and a single hub means one place
that knows where a request is when a worker disappears.
"""
from __future__ import annotations

import itertools
import time

import torch

from ..protocol.messages import RunDecode, RunPrefill
from .workers import WorkerLink, WorkerRegistry


class RemotePipeline:
    def __init__(self, registry: WorkerRegistry):
        self.registry = registry
        self._ids = itertools.count(1)
        self.request_id = ""
        self.seq = 0
        self.last_hops: list[tuple[str, float, float]] = []  # (node, compute s, round trip s) of the last step

    def _relay(self, make_message, hidden: torch.Tensor, links: list[WorkerLink]) -> torch.Tensor:
        out_dtype = hidden.dtype
        hops = []
        for link in links:
            self.seq += 1
            sent = time.perf_counter()
            reply = link.request(make_message(hidden), self.request_id, self.seq)
            hops.append((link.node_id, reply.compute_seconds, time.perf_counter() - sent))
            hidden = reply.hidden_state
        self.last_hops = hops
        return hidden.to(out_dtype)

    def prefill(self, hidden: torch.Tensor, capacity: int) -> torch.Tensor:
        self.request_id, self.seq = f"req-{next(self._ids)}", 0
        links = self.registry.links_in_order()
        return self._relay(lambda h: RunPrefill(position_start=0, cache_capacity=capacity, hidden_state=h),
                           hidden, links)

    def decode(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        links = self.registry.links_in_order()
        return self._relay(lambda h: RunDecode(position=position, hidden_state=h), hidden, links)
