"""What the HTTP API asks of the cluster: readiness, and one completion at a time.

The same service runs over a remote pipeline (the head) or a local one (tests, the single-process generator),
so the API never knows where the layers are.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from ..generation import Completion, Generator
from ..model.tokenizer import TextTokenizer
from ..sampling import SamplingParams


@dataclass(frozen=True)
class Readiness:
    required: int  # worker entries in the plan
    ready: tuple[str, ...]  # node ids loaded and serving
    missing: tuple[str, ...]  # node ids not (yet) loaded

    @property
    def is_ready(self) -> bool:
        return not self.missing


class ServiceError(Exception):
    """A request the cluster cannot serve now; the API maps each subclass to a status and type."""


class ClusterNotReady(ServiceError):
    def __init__(self, readiness: Readiness):
        self.readiness = readiness
        super().__init__(
            f"Model is not ready. Required nodes: {readiness.required}, connected ready nodes: "
            f"{len(readiness.ready)}" + (f" (waiting for: {', '.join(readiness.missing)})" if readiness.missing else "")
        )


class QueueFull(ServiceError):
    def __init__(self, limit: int):
        super().__init__(f"the server is busy: {limit} requests are already waiting; retry shortly")


class WorkerLost(ServiceError):
    def __init__(self, node_id: str, reason: str):
        self.node_id = node_id
        super().__init__(f"worker {node_id} was lost during the generation ({reason}); the request was not completed")


class StageFailed(ServiceError):
    def __init__(self, node_id: str, reason: str):
        self.node_id = node_id
        super().__init__(f"worker {node_id} failed to run its layers: {reason}")


class GenerationService:
    """Serialises generations (one at a time, SPEC.md 4.3) behind a bounded wait queue."""

    def __init__(self, model_id: str, tokenizer: TextTokenizer, generator: Generator,
                 readiness: Callable[[], Readiness], max_queue: int = 16):
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.generator = generator
        self.context_length = generator.context_length
        self.readiness = readiness
        self.max_queue = max_queue
        self._turn = threading.Lock()
        self._count_lock = threading.Lock()
        self._waiting = 0

    @contextmanager
    def _queued(self) -> Iterator[None]:
        with self._count_lock:
            if self._waiting >= self.max_queue:
                raise QueueFull(self.max_queue)
            self._waiting += 1
        try:
            yield
        finally:
            with self._count_lock:
                self._waiting -= 1

    @property
    def queue_depth(self) -> int:
        return self._waiting

    def complete(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """Run one generation. Raises ClusterNotReady, QueueFull, WorkerLost, StageFailed, ValueError."""
        readiness = self.readiness()
        if not readiness.is_ready:
            raise ClusterNotReady(readiness)
        with self._queued(), self._turn:
            readiness = self.readiness()  # a worker may have gone while we waited
            if not readiness.is_ready:
                raise ClusterNotReady(readiness)
            return self.generator.generate(prompt_ids, params)
