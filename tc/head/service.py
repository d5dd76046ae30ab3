"""What the HTTP API asks of the cluster: readiness, and one generation at a time.

The same service runs over a remote pipeline (the head) or a local one (tests, the single-process generator),
so the API never knows where the layers are.

Theory of operation: `open()` waits in a bounded queue for the cluster's turn (a lock), runs the prefill and
returns a `GenerationStream` that holds the turn until it is closed. A whole reply drains the stream; a
streamed reply hands it to the HTTP server, which pulls one step per write and closes it when the reply ends
or the client goes away. Closing between steps is always safe: the generation loop is suspended at that point,
and the next request starts with a prefill that replaces every cache.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from ..generation import Completion, Generator, Step
from ..model.tokenizer import TextTokenizer
from ..sampling import SamplingParams
from .metrics import Hop, Metrics


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


@dataclass(frozen=True)
class GenerationSummary:
    """How one generation went, for its log line and metrics (also for one that was abandoned)."""

    prompt_tokens: int
    completion_tokens: int  # tokens sent to the client
    time_to_first_token_s: float  # prefill and the first token's choice
    decode_s: float  # the steps after the first, at the head (writes to the client not included)
    outcome: str  # "stop", "length", "abandoned" or "error"

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.completion_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


class GenerationStream:
    """One generation holding the cluster's turn. Iterate for its steps; `close()` (always) gives the turn back.

    Created by `GenerationService.open` with the first step (the prefill) already computed, so that the errors
    of starting a generation reach the caller before any reply is sent.
    """

    def __init__(self, service: "GenerationService", steps: Iterator[Step], prompt_tokens: int):
        self._service, self._steps = service, steps
        self.prompt_tokens = prompt_tokens
        self.completion: Completion | None = None
        self.outcome: str | None = None
        self.completion_tokens = 0
        self.first_step_s = 0.0
        self.decode_s = 0.0
        self._step_count = 0
        self._closed = False
        self._first = self._advance()

    def _advance(self) -> Step:
        phase = "prefill" if self._step_count == 0 else "decode"
        started = time.perf_counter()
        try:
            step = next(self._steps)
        except BaseException:
            self.outcome = "error"
            raise
        elapsed = time.perf_counter() - started
        self._step_count += 1
        self._service.observe_step(phase, elapsed)
        if phase == "prefill":
            self.first_step_s = elapsed
        else:
            self.decode_s += elapsed
        self.completion_tokens += len(step.tokens)
        if step.completion is not None:
            self.completion, self.outcome = step.completion, step.completion.finish_reason
        return step

    def __iter__(self) -> Iterator[Step]:
        """The steps, the first one included; the last carries the Completion. Raises the pipeline's errors."""
        step = self._first
        while True:
            yield step
            if step.completion is not None or self._closed:
                return
            step = self._advance()

    def drain(self) -> Completion:
        """Run the generation to its end and return the Completion."""
        for _ in self:
            pass
        assert self.completion is not None
        return self.completion

    def summary(self) -> GenerationSummary:
        return GenerationSummary(self.prompt_tokens, self.completion_tokens, self.first_step_s, self.decode_s,
                                 self.outcome or "abandoned")

    def close(self) -> None:
        """End the generation (if it is still running) and give the cluster's turn back. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._steps.close()
        if self.outcome is None:
            self.outcome = "abandoned"
        self._service.finished(self)

    def __enter__(self) -> "GenerationStream":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class GenerationService:
    """Serialises generations (one at a time: the pipeline has one set of caches) behind a bounded wait queue.

    Up to `max_queue` requests wait while one generates; one more is refused with QueueFull.

    `step_hops`, when given, returns the last pipeline step's hops (RemotePipeline.last_hops) for the metrics.
    The service registers its live gauges (queue, nodes) on `metrics`, so give each service its own Metrics.
    """

    def __init__(self, model_id: str, tokenizer: TextTokenizer, generator: Generator,
                 readiness: Callable[[], Readiness], max_queue: int = 16, *,
                 step_hops: Callable[[], Sequence[Hop]] | None = None, metrics: Metrics | None = None):
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.generator = generator
        self.context_length = generator.context_length
        self.readiness = readiness
        self.max_queue = max_queue
        self.step_hops = step_hops
        self.metrics = metrics if metrics is not None else Metrics()
        self.metrics.watch(lambda: self.queue_depth, lambda: self.running, self._node_states)
        self._turn = threading.Lock()
        self._count_lock = threading.Lock()
        self._admitted = 0  # waiting for the turn or holding it
        self._running = 0

    def _node_states(self) -> tuple[Sequence[str], Sequence[str]]:
        readiness = self.readiness()
        return readiness.ready, readiness.missing

    @property
    def queue_depth(self) -> int:
        """Generations waiting for their turn (the running one not counted)."""
        with self._count_lock:
            return self._admitted - self._running

    @property
    def running(self) -> int:
        return self._running

    def _check_ready(self) -> None:
        readiness = self.readiness()
        if not readiness.is_ready:
            raise ClusterNotReady(readiness)

    def _admit(self) -> None:
        with self._count_lock:
            # max_queue requests may wait while one generates: the one holding the turn is not in the queue
            if self._admitted >= self.max_queue + 1:
                raise QueueFull(self.max_queue)
            self._admitted += 1

    def _leave(self, held_turn: bool) -> None:
        with self._count_lock:
            self._admitted -= 1
            if held_turn:
                self._running -= 1
        if held_turn:
            self._turn.release()

    def open(self, prompt_ids: list[int], params: SamplingParams) -> GenerationStream:
        """Wait for the cluster's turn and start a generation: its prefill has run when this returns.

        Raises ClusterNotReady, QueueFull, WorkerLost, StageFailed, ValueError. The caller must close() the
        stream it gets (a `with` block does), or the cluster stays taken.
        """
        self._check_ready()
        self._admit()
        held = False
        try:
            waiting_since = time.perf_counter()
            self._turn.acquire()
            held = True
            with self._count_lock:
                self._running += 1
            self.metrics.queue_wait.observe(time.perf_counter() - waiting_since)
            self._check_ready()  # a worker may have gone while we waited
            self.metrics.prompt_tokens.inc(len(prompt_ids))
            return GenerationStream(self, self.generator.stream(prompt_ids, params), len(prompt_ids))
        except BaseException:
            self.metrics.generations.labels("error").inc()
            self._leave(held)
            raise

    def complete(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """Run one whole generation. Raises as `open` does, and the pipeline's errors of later steps."""
        with self.open(prompt_ids, params) as stream:
            return stream.drain()

    def observe_step(self, phase: str, elapsed_s: float) -> None:
        if phase == "prefill":
            self.metrics.time_to_first_token.observe(elapsed_s)
        else:
            self.metrics.decode_step.observe(elapsed_s)
        if self.step_hops is not None:
            self.metrics.observe_step(phase, self.step_hops())

    def finished(self, stream: GenerationStream) -> None:
        """A stream was closed: count it and give the turn back."""
        summary = stream.summary()
        self.metrics.generations.labels(summary.outcome).inc()
        self.metrics.completion_tokens.inc(summary.completion_tokens)
        self._leave(held_turn=True)
