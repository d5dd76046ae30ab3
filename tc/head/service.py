"""What the HTTP API asks of the cluster: readiness, and generations, many at once.

The same service runs over a remote pipeline (the head) or a local one (tests, the single-process generator),
so the API never knows where the layers are.

Theory of operation: a scheduler. `queue_choices()` validates a request and puts it in the bounded wait queue; its
`GenerationGroup` waits for its first step (`open()` does both); the reply (whole or streamed) then pulls the rest
from its `GenerationStream`. One loop thread, running while there is work, owns the batch and steps it:

    admit     move waiting requests into the batch while it has fewer than `max_batch` sequences (a request
              admitted while a worker is missing fails with ClusterNotReady, or while the head stops with
              ShuttingDown)
    drop      sequences whose client went away leave, and their caches are released
    step      one pipeline call for the whole batch (Generator.step): every decoding sequence runs one position,
              and sequences still reading their prompt share `prefill_chunk` prompt positions, so a long prompt
              arriving never stalls the running streams for more than one chunk
    deliver   each sequence that chose a token gets its Step on its own queue; a finished one leaves the batch
              and its caches are released at once, or, with `prefix_cache`, kept (below)

Kept caches (`prefix_cache`, head.prefix_cache): a chat client sends the whole conversation every turn, so the
next request's prompt is the last one's prompt and completion and a new message. A single-choice request that
ends (finished, or its client gone) keeps its caches on the workers, with the tokens they hold; an admitted
single-choice request whose prompt starts with all of a kept sequence's tokens, and has more, takes those caches
over (SequenceState.take_cache): it reads only the rest of its prompt, and its usage reports the tokens it did
not read as cached. A request whose prompt shares only the start of a kept sequence's tokens, at least
MIN_SHARED_TOKENS of them (the same long system prompt, a reply regenerated, a conversation's last turn edited),
starts from a copy of that part (SequenceState.copy_cache; the kept cache stays for others, and is released last).
So does one that shares as much with a request admitted before it and still in the batch (requests with one
system prompt arriving together): it waits until that one has read the shared part, then copies it. Kept caches
hold places the batch does not use: the oldest is released whenever an admitted request needs its place, so the
workers never hold more than `max_batch` caches; one a request waits to copy from is handed to it instead, cut
back to the part they share. A cache released while requests wait to copy it (and one that left before it read
what they share) leaves them to read their whole prompt. A pipeline error releases them all, and a resume forgets
those the pipeline did not replay (`_idle`). The continued sequence computes its cached positions as its
predecessor did (a prompt read in one pass, a completion one position a step), not as one pass over the new
prompt: in fp32 that moves logits by ~1e-6, in bf16 by as much as resuming does (tc/head/pipeline.py).

A pipeline error (a worker lost past resume, a stage that failed) ends every sequence of that step with the error;
an error in one sequence's own part of a step (its grammar's mask, its prompt's reading, its token's choosing)
ends that request alone (generation.Generator.step). The loop carries on with whatever arrives next. A request's
text depends only on itself: its sampling state is its own (generation.SequenceState), and the batch only shares
the weight reads.

States of a request: waiting (in the queue) -> running (in the batch) -> done (finished, failed or abandoned).
"""
from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

from ..generation import Completion, Generator, SequenceState, Step
from ..model.tokenizer import TextTokenizer
from ..sampling import SamplingParams
from ..topology import DEFAULT_PREFILL_CHUNK
from .metrics import Hop, Metrics

log = logging.getLogger(__name__)
DEFAULT_MAX_BATCH = 8
GONE_CHECK_S = 0.25  # how often a request waiting for its first step looks whether its client has gone
RATE_WINDOW_S = 10.0  # aggregate tokens/s is measured over this much recent time
# The fewest prompt tokens a request copies from a kept cache whose text it shares only in part: fewer cost little
# to read, and a copy computes the rest of the prompt apart from its start (the module's docstring)
MIN_SHARED_TOKENS = 64


def shared_start(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens `a` and `b` start with in common (slices compared at C speed: a 30k-token prompt against a
    kept cache takes microseconds, not a Python loop's milliseconds)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    same, differs = 0, n  # a[:same] == b[:same] and a[:differs] != b[:differs]
    while differs - same > 1:
        middle = (same + differs) // 2
        if a[same:middle] == b[same:middle]:
            same = middle
        else:
            differs = middle
    return same


@dataclass(frozen=True)
class Readiness:
    required: int  # worker entries in the plan
    ready: tuple[str, ...]  # node ids loaded and serving
    missing: tuple[str, ...]  # node ids not (yet) loaded
    stopping: bool = False  # the head is shutting down: no node serves any more, and none is awaited

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


class ClientGone(Exception):
    """The client closed its connection before its reply was ready: nobody will read it."""


class ShuttingDown(ServiceError):
    """The head is stopping: a request that arrives, or still waits for a place, is refused with this, as the HTTP
    server refuses those it has not handed on yet (503 shutting_down, Retry-After). One that was generating ends
    with HeadShuttingDown instead."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down and takes no new requests; retry once it is back")


class HeadShuttingDown(ServiceError):
    """The head is stopping: requests in flight end with this (503 service_unavailable); one not started yet is
    refused with ShuttingDown."""

    def __init__(self) -> None:
        super().__init__("the head is shutting down; the request was not completed. Retry once it is back")


def not_ready_error(readiness: Readiness) -> ServiceError:
    """Why a request cannot start now: the head is stopping, or nodes are missing."""
    return ShuttingDown() if readiness.stopping else ClusterNotReady(readiness)


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
    time_to_first_token_s: float  # from entering the batch to the first token's choice
    decode_s: float  # from the first token to the last
    outcome: str  # "stop", "length", "abandoned" or "error"
    queue_wait_s: float = 0.0  # waiting for a place in the batch

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.completion_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


class _Request:
    """One request between open() and its end: its sequence, and the queue its steps (or its error) arrive on."""

    def __init__(self, sequence: SequenceState):
        self.sequence = sequence
        # SimpleQueue, as the workers' frames take (tc.worker.main): the scheduler puts each token here in C
        self.outbox: queue.SimpleQueue[Step | BaseException] = queue.SimpleQueue()
        self.queued_at = time.perf_counter()
        self.admitted_at: float | None = None
        self.abandoned = False  # the client went away: the loop drops it at the next step boundary
        self.failed = False  # the loop ended it with an error, which its outbox holds
        self.joins_with = 1  # the first choice of a request of n: n, as the choices join the batch together
        self.follows = False  # a later choice of a request: it waits, and joins, with the first

    @property
    def queue_wait_s(self) -> float:
        return (self.admitted_at or time.perf_counter()) - self.queued_at

    def next(self, gone: Callable[[], bool] | None = None, idle_s: float | None = None) -> Step | None:
        """The next step, waited for; with `gone` (the client's connection closed?) looked at every GONE_CHECK_S
        while waiting, so that a request whose client left while it queued gives its place up (ClientGone); with
        `idle_s`, None once that long has passed without one."""
        deadline = None if idle_s is None else time.monotonic() + idle_s
        while True:
            timeout = GONE_CHECK_S if gone is not None else idle_s
            if deadline is not None:
                timeout = max(0.0, min(timeout, deadline - time.monotonic()))
            try:
                item = self.outbox.get(timeout=timeout)
                break
            except queue.Empty:
                if gone is not None and gone():
                    raise ClientGone("the client closed the connection while its request waited") from None
                if deadline is not None and time.monotonic() >= deadline:
                    return None
        if isinstance(item, BaseException):
            raise item
        return item


class GenerationStream:
    """One generation. Iterate for its steps; `close()` (always) ends it, giving its place in the batch back.

    Created by `GenerationGroup.wait` with the first step already computed, so that the errors of starting a
    generation reach the caller before any reply is sent.
    """

    def __init__(self, service: "GenerationService", request: _Request, first: Step):
        self._service, self._request = service, request
        self.prompt_tokens = len(request.sequence.prompt_ids)
        self.completion: Completion | None = None
        self.outcome: str | None = None
        self.completion_tokens = 0
        self._closed = False
        self._first = self._take(first)

    def _take(self, step: Step) -> Step:
        self.completion_tokens += len(step.tokens)
        if step.completion is not None:
            self.completion, self.outcome = step.completion, step.completion.finish_reason
        return step

    def __iter__(self) -> Iterator[Step]:
        """The steps, the first one included; the last carries the Completion. Raises the pipeline's errors."""
        return (step for step in self.steps() if step is not None)

    def steps(self, idle_s: float | None = None) -> Iterator[Step | None]:
        """The steps as iterating gives them, and with `idle_s`, None each time that long passes without one (a
        step may wait long: a lost worker's resume grace period, say), for a stream to show it is alive."""
        step: Step | None = self._first
        while True:
            yield step
            if step is not None and step.completion is not None or self._closed:
                return
            try:
                step = self._request.next(idle_s=idle_s)
            except BaseException:
                self.outcome = "error"
                raise
            if step is not None:
                self._take(step)

    def drain(self) -> Completion:
        """Run the generation to its end and return the Completion."""
        for _ in self:
            pass
        assert self.completion is not None
        return self.completion

    def summary(self) -> GenerationSummary:
        sequence = self._request.sequence
        started = sequence.started or 0.0
        first = sequence.first_token_at or started
        last = sequence.last_token_at or first
        return GenerationSummary(self.prompt_tokens, self.completion_tokens, first - started, last - first,
                                 self.outcome or "abandoned", self._request.queue_wait_s)

    def close(self) -> None:
        """End the generation (if it is still running) and give its place back. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.outcome is None:
            # closed before it read its end: an error already sent it (the other choices of a request whose first
            # choice raised it), or its client went away
            self.outcome = "error" if self._request.failed else "abandoned"
        self._service.finished(self, self._request)

    def __enter__(self) -> "GenerationStream":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class GenerationGroup:
    """The choices of one request (its `n`), from their places in the queue to their end: a generation each, side
    by side in the batch, logged as one. Made by GenerationService.queue_choices; `wait()` gives their streams once
    each has its first step; `close()` (always: a `with` block does) gives their places back, in the queue or in
    the batch."""

    def __init__(self, service: "GenerationService", requests: list[_Request], gone: Callable[[], bool] | None):
        self._service, self._requests, self._gone = service, requests, gone
        self.streams: list[GenerationStream] = []
        self._withdrawn: str | None = None  # how the choices that never started ended

    @property
    def started(self) -> bool:
        """Whether every choice has its first step (and its stream)."""
        return len(self.streams) == len(self._requests)

    def wait(self, idle_s: float | None = None) -> list[GenerationStream] | None:
        """The choices' streams, once each has its first step (its prompt read, its first token chosen); with
        `idle_s`, None when that long passes first (call again). Raises ClientGone (the client left while its
        request waited) and the errors of starting (ClusterNotReady, ShuttingDown, WorkerLost, StageFailed, ...),
        which end every choice."""
        if self.started:
            return self.streams
        try:
            while not self.started:
                request = self._requests[len(self.streams)]
                first = request.next(self._gone, idle_s)
                if first is None:
                    return None
                self.streams.append(GenerationStream(self._service, request, first))
        except BaseException as exc:
            self._end("abandoned" if isinstance(exc, ClientGone) else "error")
            raise
        for stream in self.streams:
            self._service.metrics.time_to_first_token.observe(stream.summary().time_to_first_token_s)
        return self.streams

    def _end(self, outcome: str) -> None:
        unstarted = self._requests[len(self.streams):]
        if unstarted and self._withdrawn is None:
            self._withdrawn = outcome
            self._service.withdraw(unstarted, outcome)
        for stream in self.streams:
            stream.close()

    def summary(self) -> GenerationSummary:
        parts = [s.summary() for s in self.streams]
        parts += [GenerationSummary(len(r.sequence.prompt_ids), 0, 0.0, 0.0, self._withdrawn or "abandoned",
                                    r.queue_wait_s) for r in self._requests[len(self.streams):]]
        outcomes = {p.outcome for p in parts}
        outcome = parts[0].outcome if len(outcomes) == 1 else ",".join(p.outcome for p in parts)
        return GenerationSummary(parts[0].prompt_tokens, sum(p.completion_tokens for p in parts),
                                 max(p.time_to_first_token_s for p in parts), max(p.decode_s for p in parts),
                                 outcome, max(p.queue_wait_s for p in parts))

    def close(self) -> None:
        """End every choice, started or not. Idempotent."""
        self._end("abandoned")

    def __enter__(self) -> "GenerationGroup":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class GenerationService:
    """Runs up to `max_batch` generations together (the module's docstring), with `max_queue` more waiting.

    `step_hops`, when given, returns the last pipeline step's hops (RemotePipeline.last_hops) for the metrics.
    The service's live gauges (queue, batch, nodes) are what `metrics` reports from then on (Metrics.watch).
    """

    def __init__(self, model_id: str, tokenizer: TextTokenizer, generator: Generator,
                 readiness: Callable[[], Readiness], max_queue: int = 16, *, max_batch: int = DEFAULT_MAX_BATCH,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, step_hops: Callable[[], Sequence[Hop]] | None = None,
                 metrics: Metrics | None = None, prefix_cache: bool = False,
                 sampling_defaults: Mapping[str, float] | None = None):
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError(f"max_batch ({max_batch}) and prefill_chunk ({prefill_chunk}) must be at least 1")
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.generator = generator
        self.context_length = generator.context_length
        self.readiness = readiness
        self.max_queue, self.max_batch, self.prefill_chunk = max_queue, max_batch, prefill_chunk
        self.step_hops = step_hops
        # the model's own values for the sampling fields a request leaves out (head/sampling_defaults.py)
        self.sampling_defaults: Mapping[str, float] = dict(sampling_defaults or {})
        self.metrics = metrics if metrics is not None else Metrics()
        self.metrics.watch(lambda: self.queue_depth, lambda: self.running, self.readiness,
                           slots=lambda: self.max_batch, tokens_per_s=self.tokens_per_s)
        self._lock = threading.Lock()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._batch: list[_Request] = []
        self._loop: threading.Thread | None = None
        self._recent_tokens: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) per step
        self.prefix_cache = prefix_cache
        # finished sequences whose caches the workers keep (the module's docstring): id -> the tokens they hold,
        # oldest first; the loop's thread alone reads and changes it
        self._kept: collections.OrderedDict[int, list[int]] = collections.OrderedDict()
        # a pipeline that replays its sequences after a lost worker asks which of them no request waits on
        if hasattr(generator.pipeline, "idle"):
            generator.pipeline.idle = self._idle
        self._resumes = getattr(generator.pipeline, "resumes", 0)  # the pipeline's count when the loop last looked

    def _idle(self) -> set[int]:
        """The sequences whose caches are kept for a later request and that none in the batch waits to copy: a
        pipeline that lost a worker replays all but these (RemotePipeline), and their kept caches then hold
        nothing there (`holds`). Asked on the loop's thread, from inside its step."""
        return set(self._kept) - set(self._copying())

    # --- views -------------------------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        """Generations waiting for a place in the batch."""
        with self._lock:
            return len(self._waiting)

    @property
    def running(self) -> int:
        """Generations in the batch."""
        with self._lock:
            return len(self._batch)

    @property
    def kept(self) -> int:
        """Finished sequences whose caches the workers keep (the module's docstring)."""
        return len(self._kept)

    def sequences(self) -> list[dict]:
        """The batch's sequences, for /v1/cluster."""
        with self._lock:
            batch = list(self._batch)
        return [{"sequence": r.sequence.id, "prompt_tokens": len(r.sequence.prompt_ids),
                 "completion_tokens": len(r.sequence.text.tokens),
                 "phase": "decode" if r.sequence.decoding else "prefill"} for r in batch]

    def _forget_old_steps(self, now: float) -> None:
        """Drop the steps older than RATE_WINDOW_S. Call with the lock held."""
        while self._recent_tokens and self._recent_tokens[0][0] < now - RATE_WINDOW_S:
            self._recent_tokens.popleft()

    def tokens_per_s(self) -> float:
        """Tokens chosen per second, all sequences together, over the last RATE_WINDOW_S."""
        now = time.perf_counter()
        with self._lock:
            self._forget_old_steps(now)
            if not self._recent_tokens:
                return 0.0
            total = sum(n for _, n in self._recent_tokens)
            span = now - self._recent_tokens[0][0]
        return total / max(span, 1.0)

    # --- requests ----------------------------------------------------------------------------------------------
    def _check_ready(self) -> None:
        readiness = self.readiness()
        if not readiness.is_ready:
            raise not_ready_error(readiness)

    def open(self, prompt_ids: list[int], params: SamplingParams) -> GenerationStream:
        """Start a generation: its first step (its prompt read, its first token chosen) has run when this returns.

        Raises ClusterNotReady, ShuttingDown, QueueFull, WorkerLost, StageFailed, ValueError. The caller must
        close() the stream it gets (a `with` block does), or its place in the batch stays taken.
        """
        return self.open_choices(prompt_ids, [params])[0]

    def open_choices(self, prompt_ids: list[int], choices: Sequence[SamplingParams],
                     gone: Callable[[], bool] | None = None) -> list[GenerationStream]:
        """Start one generation per entry of `choices` for the same prompt, all at once (they join the batch in
        the same step), as `open` does; if one cannot start, none is left running. `gone` says whether the
        client has closed its connection: if it does while the request waits for its first step, ClientGone."""
        streams = self.queue_choices(prompt_ids, choices, gone).wait()
        assert streams is not None  # waited for without a bound
        return streams

    def queue_choices(self, prompt_ids: list[int], choices: Sequence[SamplingParams],
                      gone: Callable[[], bool] | None = None) -> GenerationGroup:
        """Queue one generation per entry of `choices` for the same prompt (open_choices without the wait for the
        first steps, which the group's `wait` does: a stream shows it is alive meanwhile). Raises ClusterNotReady,
        ShuttingDown, QueueFull and ValueError at once; the caller must close() the group it gets."""
        self._check_ready()
        # ValueError; the choices read the prompt once, and each of the others starts from a copy of its cache
        requests = [_Request(sequence) for sequence in self.generator.start_choices(prompt_ids, choices)]
        requests[0].joins_with = len(requests)  # together, so that the prompt is read once for all of them
        for request in requests[1:]:
            request.follows = True
        with self._lock:
            if self._would_wait(len(requests)) > self.max_queue:
                # not a generation: it never queued (its 429 counts in tc_http_requests_total, as a 503 of
                # _check_ready's does)
                raise QueueFull(self.max_queue)
            self._waiting.extend(requests)
            if self._loop is None:
                loop = threading.Thread(target=self._run, name="scheduler", daemon=True)
                try:
                    loop.start()  # RuntimeError at a thread or memory limit
                except BaseException:
                    # nothing runs these requests: left queued, with `loop` taken for the running loop, they and
                    # every request after them would wait for ever
                    for request in requests:
                        self._waiting.remove(request)
                    raise
                self._loop = loop  # still under the lock, which the loop's first turn waits for
        return GenerationGroup(self, requests, gone)

    def withdraw(self, requests: Sequence[_Request], outcome: str) -> None:
        """Requests given up before their first step (their client gone, an error of starting, a stream closed
        before it started): counted as `outcome`, and their places freed (those with a stream count as it closes)."""
        self.metrics.generations.labels(outcome).inc(len(requests))
        with self._lock:
            for request in requests:
                request.abandoned = True  # in the batch: the loop drops it at its next step boundary
                if request in self._waiting:  # still queued: its place in the queue is free at once
                    self._waiting.remove(request)

    def _would_wait(self, choices: int) -> int:
        """Requests that would wait, one of `choices` choices added to the queue, past those the batch takes at its
        next step boundary. The queue's bound counts requests, whatever their n: each holds one of the API's
        threads, and docs/api.md promises max_queue of them a place. Call with the lock held."""
        # the abandoned (their clients gone) leave at that boundary, before the batch takes anyone
        free, waiting = self.max_batch - sum(1 for r in self._batch if not r.abandoned), 0
        for size in [r.joins_with for r in self._waiting if not r.follows] + [choices]:
            size = min(size, self.max_batch)  # as _admit_and_drop admits them, in order
            if waiting == 0 and size <= free:
                free -= size
            else:
                waiting += 1  # it waits, and so does every request behind it
        return waiting

    def complete(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """Run one whole generation. Raises as `open` does, and the pipeline's errors of later steps."""
        with self.open(prompt_ids, params) as stream:
            return stream.drain()

    def finished(self, stream: GenerationStream, request: _Request) -> None:
        """A stream was closed: count it; if it still runs, the loop drops it at the next step boundary."""
        request.abandoned = True
        summary = stream.summary()
        self.metrics.generations.labels(summary.outcome).inc()
        self.metrics.completion_tokens.inc(summary.completion_tokens)

    # --- the loop ----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        """The scheduler loop: admit, drop, step, deliver, while there is work (the module's docstring)."""
        try:
            while self._cycle():
                pass
        except BaseException as exc:  # a bug in the loop itself: no request may wait for ever on it
            # nor may the workers hold their caches for good (they would refuse every new sequence past max_batch):
            # released first, while this thread is still the loop and no other can start and use the pipeline
            with self._lock:
                batch = list(self._batch)
            try:
                self._release(batch)
                self._release_kept(len(self._kept), hand_over=False)  # those waiting to copy one are to fail too
            except Exception:
                log.exception("releasing the caches of the requests the scheduler failed")
            self._fail(self._take_everyone(), exc)
            raise

    def _cycle(self) -> bool:
        """One turn of the loop; False when there is no work left (the thread then ends)."""
        admitted, refused, dropped = self._admit_and_drop()
        for request, exc in refused:
            self._fail([request], exc)
        self._end(dropped)
        for request in admitted:
            self.metrics.queue_wait.observe(request.queue_wait_s)
            self._start_from_shared(request)
        with self._lock:
            running = len(self._batch)
        self._release_kept(max(0, running + len(self._kept) - self.max_batch))
        with self._lock:
            batch = list(self._batch)
            if not batch and not self._waiting:
                self._loop = None
                return False
        if not batch:
            return True
        self._step(batch)
        return True

    def _admit_and_drop(self) -> tuple[list[_Request], list[tuple[_Request, BaseException]], list[_Request]]:
        readiness = self.readiness()
        admitted, refused = [], []
        with self._lock:
            dropped = [r for r in self._batch if r.abandoned]
            self._batch = [r for r in self._batch if not r.abandoned]
            # a request's choices join together (they wait in the queue one after another), so that one reading of
            # the prompt serves them all (the API refuses more choices than the batch holds; more would split)
            while self._waiting and len(self._batch) + min(self._waiting[0].joins_with, self.max_batch) \
                    <= self.max_batch:
                request = self._waiting.popleft()
                request.admitted_at = time.perf_counter()
                if request.abandoned:
                    continue
                if not readiness.is_ready:  # a worker went while it waited, or the head is stopping
                    refused.append((request, not_ready_error(readiness)))
                    continue
                self._batch.append(request)
                admitted.append(request)
        return admitted, refused, dropped

    def _step(self, batch: list[_Request]) -> None:
        reading = any(not r.sequence.decoding for r in batch)
        first_steps = [r.sequence for r in batch if r.sequence.started is None]
        started, read_before = time.perf_counter(), self.generator.prompt_positions
        drafted_before, accepted_before = self.generator.drafted, self.generator.accepted
        made_before = {r.sequence.id: len(r.sequence.text.tokens) for r in batch}
        try:
            results = self.generator.step([r.sequence for r in batch], self.prefill_chunk)
        except Exception as exc:  # the pipeline's errors end this step's sequences, not the service
            with self._lock:
                self._batch = [r for r in self._batch if r not in batch]
            self._fail(batch, exc)
            self._release(batch)
            self._release_kept(len(self._kept))  # a worker may have gone with them
            return
        elapsed = time.perf_counter() - started
        self._forget_kept_not_replayed()
        self.metrics.prompt_tokens.inc(self.generator.prompt_positions - read_before)  # a failed step's are not
        # the positions a sequence's first entry did not read, found in another's cache (none for one that waits)
        self.metrics.cached_prompt_tokens.inc(sum(s.cached for s in first_steps if s.started is not None))
        self.metrics.draft_tokens.inc(self.generator.drafted - drafted_before)
        self.metrics.draft_tokens_accepted.inc(self.generator.accepted - accepted_before)
        # tokens chosen: those its text gained, at least one (a step that ended at EOS chose it)
        made = sum(max(1, len(s.text.tokens) - made_before[s.id]) for s, step in results
                   if not isinstance(step, Exception))
        self._observe_step("prefill" if reading else "decode", elapsed, len(batch), made)
        by_sequence = {r.sequence.id: r for r in batch}
        ended, failed = [], []
        for sequence, step in results:
            request = by_sequence[sequence.id]
            if isinstance(step, Exception):  # its own part of the step failed: it ends alone, with its error
                self._fail([request], step)
                failed.append(request)
                continue
            request.outbox.put(step)
            if step.completion is not None:
                ended.append(request)
        if ended or failed:
            with self._lock:
                self._batch = [r for r in self._batch if r not in ended and r not in failed]
            self._end(ended)
            self._release(failed)

    def _observe_step(self, phase: str, elapsed_s: float, batch_size: int, tokens: int) -> None:
        if phase == "decode":
            self.metrics.decode_step.observe(elapsed_s)
        self.metrics.batch_size.observe(batch_size)
        now = time.perf_counter()
        with self._lock:
            # trimmed here too, not only when read: a head nobody scrapes would keep every step it ever ran
            self._forget_old_steps(now)
            self._recent_tokens.append((now, tokens))
        if self.step_hops is not None:
            self.metrics.observe_step(phase, self.step_hops())

    def _release(self, requests: list[_Request]) -> None:
        # a worker that cannot be told is gone, and its caches with it (RemotePipeline.release)
        self._release_sequences([r.sequence.id for r in requests])

    @staticmethod
    def _single(request: _Request) -> bool:
        """A request of one choice (the choices of one request share a prompt reading and copies of its cache)."""
        return request.joins_with == 1 and not request.follows

    def _end(self, requests: list[_Request]) -> None:
        """Requests that left the batch, finished or abandoned: their caches kept (the module's docstring) where
        that is on and they hold anything, else released."""
        released = []
        copying = self._copying() if requests else {}
        for request in requests:
            sequence = request.sequence
            # one that never ran its first entry from another's cache holds no cache of its own text
            if self.prefix_cache and self._single(request) and sequence.prefilled and \
                    sequence.pending_source is None:
                self._kept[sequence.id] = sequence.cache_ids()
                for copier in copying.get(sequence.id, ()):  # left before it read what they wait for
                    if not sequence.holds_prompt(copier.cached):
                        copier.read_whole()
            else:
                released.append(request)
        self._release(released)

    def _start_from_shared(self, request: _Request) -> None:
        """An admitted request starts from the cache that holds the longest start of its prompt, if any: a kept
        one it takes over where the prompt has all of its text, else a copy of the part they share where that is
        at least MIN_SHARED_TOKENS, of a kept cache or of one a request in the batch is reading (the module's
        docstring)."""
        sequence = request.sequence
        params = sequence.params
        if not self.prefix_cache or not self._single(request) or params.prompt_logprobs or not params.cache_prompt:
            return
        self._forget_kept_not_held()  # a worker replaced since they ran took them (they would hide the others)
        prompt = sequence.prompt_ids
        best: tuple[int, int, int | SequenceState] | None = None  # (positions shared, rank, the cache's holder)
        for kept, tokens in self._kept.items():
            shared = min(shared_start(prompt, tokens), len(prompt) - 1)  # its last position must run
            # the longest; of two as long, one taken whole (nothing copied), then a kept one (nothing to wait for)
            candidate = (shared, 2 if shared == len(tokens) else 1, kept)
            if (candidate[1] == 2 or shared >= MIN_SHARED_TOKENS) and (best is None or candidate[:2] > best[:2]):
                best = candidate
        with self._lock:  # those admitted before it (in the batch's order), so that no two wait for each other
            before = list(itertools.takewhile(lambda r: r is not request, self._batch))
        for other in filter(self._single, before):
            shared = min(shared_start(prompt, other.sequence.prompt_ids), len(prompt) - 1)
            if shared >= MIN_SHARED_TOKENS and (best is None or (shared, 0) > best[:2]):
                best = (shared, 0, other.sequence)
        if best is None:
            return
        held, rank, holder = best
        if isinstance(holder, SequenceState):
            sequence.copy_cache(holder, held)  # once that one has read them
        elif rank == 2:
            del self._kept[holder]
            sequence.take_cache(holder, held, cut=True)  # past its tokens, a refused draft's positions may follow
        else:
            self._kept.move_to_end(holder)  # the last to be released (_release_kept)
            sequence.copy_cache(holder, held)

    def _copying(self) -> dict[int, list[SequenceState]]:
        """The requests in the batch that wait to copy another sequence's cache (their first entry not yet run),
        by that sequence."""
        with self._lock:
            batch = list(self._batch)
        copying: dict[int, list[SequenceState]] = {}
        for request in batch:
            source = request.sequence.pending_source
            if source is not None and source != request.sequence.id:
                copying.setdefault(source, []).append(request.sequence)
        return copying

    def _release_sequences(self, sequences: list[int]) -> None:
        """Release these sequences' caches on the workers; a request waiting to copy one of them reads its prompt
        whole instead."""
        if not sequences:  # every turn of the loop ends and evicts nothing, mostly: no look at the batch then
            return
        copying = self._copying()
        for sequence in sequences:
            for copier in copying.get(sequence, ()):
                copier.read_whole()
        self.generator.pipeline.release(sequences)

    def _forget_kept_not_replayed(self) -> None:
        """After the pipeline resumed a step on a refilled set of workers, the kept caches it did not replay (`_idle`)
        hold nothing there: forgotten here, and released on the workers that stayed."""
        resumes = getattr(self.generator.pipeline, "resumes", 0)
        if resumes == self._resumes:
            return
        self._resumes = resumes
        self._forget_kept_not_held()

    def _forget_kept_not_held(self) -> None:
        """Forget the kept caches the workers there are now do not hold (a worker replaced since they ran went with
        them), and release them on those that stayed."""
        gone = [kept for kept in self._kept if not self.generator.pipeline.holds(kept)]
        for kept in gone:
            del self._kept[kept]
        self._release_sequences(gone)

    def _release_kept(self, count: int, hand_over: bool = True) -> None:
        """Release the `count` oldest kept caches. With `hand_over`, one that a request waits to copy from is handed
        to the first such request instead, cut back to the part they share: the same place is freed, and that
        request still starts from it (any other waiting for it reads its prompt whole)."""
        oldest = list(itertools.islice(self._kept, count))
        copying = self._copying() if oldest else {}
        released = []
        for kept in oldest:
            del self._kept[kept]
            copiers = copying.get(kept, []) if hand_over else []
            if copiers:
                copiers[0].take_cache(kept, copiers[0].cached, cut=True)
                for copier in copiers[1:]:
                    copier.read_whole()
            else:
                released.append(kept)
        self._release_sequences(released)

    def _fail(self, requests: list[_Request], exc: BaseException) -> None:
        for request in requests:  # all marked before any hears, so that a choice closed on a sibling's error
            request.failed = True  # counts as the error it is
        for request in requests:
            request.outbox.put(exc)

    def _take_everyone(self) -> list[_Request]:
        with self._lock:
            everyone = self._batch + list(self._waiting)
            self._batch, self._loop = [], None
            self._waiting.clear()
        return everyone
