"""The pipeline as the head sees it: hidden states go through each worker in plan order and come back.

Direct hops (head.direct_hops, on by default): the head sends a step to the first worker, each worker passes its
output straight to the next (tc.worker.peers) with its compute time added to those the batch carries, and the
last replies with the hidden states and every stage's time: head -> w1 -> w2 -> ... -> head, one network
transfer per stage boundary where relaying took two, and the head wakes once a step. Any stage may still answer
(a failure, or output it could not pass on, which the head then carries to the next stage itself), so the head
waits on every link of the step at once; the step's bound is its stages' bounds added up (and, with
micro-batches, the largest once more for each further group), and past it every worker that still owes an
answer is dropped. A step that fails anywhere is given up on every link (late answers
dropped) before resuming. The head sends each worker a ROUTE (where its output goes, and a fresh key for the
link into it) whenever the pipeline's workers change. A worker that cannot reach the next one, or that listens
for none (`worker --no-direct-hops`), replies to the head instead: relaying, as with head.direct_hops off
(head -> w1 -> head -> w2 -> ... -> head).

Each step is one RUN_BATCH: the rows of every sequence in the step, with each sequence's id, positions and cache
capacity (generation.Entry), so each worker runs them as one ragged batch against a cache per sequence; an entry
that ends a prompt read for several choices names the choices' sequences, and each worker copies the cache for
them. When a sequence ends, every worker is told to drop its cache (RELEASE).

Micro-batches: with `head.micro_batches` > 1 and several stages, a step's sequences are cut into up to that many
groups and run as a pipeline schedule: while stage 2 runs group 1, stage 1 runs group 2, so the stages work at
the same time instead of taking turns (relayed: len(groups) + len(stages) - 1 ticks instead of len(stages) x
len(groups) hops' worth of waiting; with direct hops every group goes to the first stage at once and each stage
passes each on as it finishes it). It pays where the stages do not share cores (separate machines); on one machine whose
cores every worker already uses, the stages only slow each other down (bench/bench_batching.py measures both).

Resuming: with resume on, the pipeline keeps what it fed the first stage for every sequence in flight (the prompt's
embeddings and each decode step's). When a worker is lost mid-step and resume is on, it waits up to the grace period
for the lost node's entry to be filled again (the same worker back, or a spare), then replays every sequence from
position 0 but the idle ones (caches kept for a later request that no request waits on: they are dropped, and read
anew if asked for), in one batch where the workers' frames hold it and over several steps where they do not,
through every stage, each with its own cache capacity. That rebuilds every stage's caches, and the last rows of
each sequence stand for the interrupted step's, so the generations carry on and the clients see them take longer.
The tokens already chosen stay; what follows is what a new request for the prompt and those tokens would give. One
prefill over N positions rounds differently from N decode steps: in fp32 the difference (~1e-6) leaves greedy
output as it was without the loss, while in bf16 or fp16 the continuation may differ from an uninterrupted run
(docs/design.md, tests/test_resume_dtypes.py).
"""
from __future__ import annotations

import itertools
import logging
import os
import time

import torch

from typing import Callable, Sequence

from ..generation import Entry
from ..protocol.connection import is_loopback, unmapped
from ..protocol.messages import BatchEntry, Route, RunBatch
from ..trace import mark
from .service import HeadShuttingDown, StageFailed, WorkerLost
from .workers import Sent, WorkerLink, WorkerRegistry

log = logging.getLogger(__name__)


class RemotePipeline:
    def __init__(self, registry: WorkerRegistry, resume: bool | None = None, resume_grace_s: float | None = None,
                 micro_batches: int | None = None, direct_hops: bool | None = None):
        settings = registry.topology.head
        self.registry = registry
        self.micro_batches = settings.micro_batches if micro_batches is None else micro_batches
        self.direct_hops = settings.direct_hops if direct_hops is None else direct_hops
        self.resume = settings.resume if resume is None else resume
        self.resume_grace_s = settings.resume_grace_s if resume_grace_s is None else resume_grace_s
        self._ids = itertools.count(1)
        self.request_id = ""
        self.seq = 0
        self.last_hops: list[tuple[str, float, float]] = []  # (node, compute s, round trip s) of the last step
        self.resumes = 0  # steps carried over a lost worker, since start
        # per sequence in flight: its cache capacity and every first-stage input so far, [1, L_i, hidden] each
        # (none with resume off)
        self._inputs: dict[int, tuple[int, list[torch.Tensor]]] = {}
        self._links: list[WorkerLink] = []  # the workers of the last step, which hold the sequences' caches
        # Which set of workers each sequence last ran on (a count of the changes to the workers), so that a cache
        # kept for a later request is known gone with a worker replaced while it was not running (`holds`)
        self._worker_changes = 0
        self._ran_on: dict[int, int] = {}
        self._released: list[int] = []  # sequences released since the last step: its RUN_BATCH says so again
        # The sequences no request waits on (caches kept for a later one, GenerationService._idle), which a
        # recovery does not replay: a lost worker would otherwise hold the requests in flight up while the head
        # read every idle conversation again
        self.idle: Callable[[], set[int]] = set
        self._routes = itertools.count(1)
        self._route = 0  # the route the workers of `_routed` were sent (0: none, the head relays)
        self._routed: list[WorkerLink] = []

    @property
    def max_positions(self) -> int:
        """Positions one step may carry (Pipeline.max_positions): what every worker's frames take."""
        return self.registry.step_positions()

    def _relay(self, entries: tuple[BatchEntry, ...], hidden: torch.Tensor, released: tuple[int, ...],
               links: list[WorkerLink]) -> torch.Tensor:
        """The batch (`entries`, their rows `hidden` [1, rows, hidden_size], and the sequences `released` since
        the step before) through every stage: in micro-batches where that is asked for and possible, passed from
        worker to worker where the route allows. Each RUN_BATCH is built once, here: a message checks its fields
        as it is made, on every step's path."""
        route = self._route_for(links)
        groups = split_entries(entries, min(self.micro_batches, len(links)))
        if len(groups) > 1:  # each group's message checks its own entries: the batch's across groups, once here
            RunBatch(entries=entries, hidden_state=hidden, released=released)
        parts, row = [], 0
        for group in groups:
            rows = sum(e.length for e in group)
            rows_of_group = hidden if len(groups) == 1 else hidden[:, row:row + rows]
            parts.append(RunBatch(entries=group, hidden_state=rows_of_group, route=route, released=released))
            row += rows
        try:
            outputs = self._pass_along(parts, links) if route else self._schedule(parts, links)
        except BaseException:
            # whatever ended the step, not only a worker's loss: its replies still to come are dropped as they
            # arrive (each step's seq counts from 0 again, so a late one could pass for the next step's), and
            # with direct hops no group passed on before the failure runs after it
            for link in links:
                link.abandon(self.request_id)
            if route:
                self._retire_route(links)
            raise
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def _route_for(self, links: list[WorkerLink]) -> int:
        """The route the step takes through `links`: sent to every worker (a ROUTE each) when they are not the
        workers last routed. 0 when direct hops are off or no worker after the first listens for the one before.
        Raises WorkerLost."""
        if not self.direct_hops or len(links) < 2:
            return 0
        if len(links) == len(self._routed) and all(a is b for a, b in zip(links, self._routed)):
            return self._route
        self._route, self._routed = 0, []
        addresses = [link.peer_address for link in links]
        if all(address is None for address in addresses[1:]):
            log.info("no worker after the first listens for the stage before it: the head relays every hop")
            self._routed = list(links)
            return 0
        route = next(self._routes)
        keys = [None] + [os.urandom(32) if address is not None else None for address in addresses[1:]]
        for i in reversed(range(len(links))):  # the later stage knows its key before the one before it connects
            following = addresses[i + 1] if i + 1 < len(links) else None
            if following is not None:
                following = reachable_from(links[i], following)
            links[i].send_route(Route(route=route, next_host=following[0] if following else None,
                                      next_port=following[1] if following else None,
                                      next_key=keys[i + 1] if following else None, inbound_key=keys[i]))
        self._route, self._routed = route, list(links)
        path = "head"
        for i, link in enumerate(links):
            path += f" -> {link.name}" if i == 0 or addresses[i] else f" -> head -> {link.name}"
        log.info("route %d: %s -> head", route, path)
        return route

    def _pass_along(self, groups: list[RunBatch], links: list[WorkerLink]) -> list[torch.Tensor]:
        """Every group to the first stage, each stage passing it to the next (the module's docstring); returns each
        group's output.

        Any stage may answer a group: the last with its output, one that could not pass it on with its own (the
        head then sends it to the next stage itself), any with a failure. The stages' compute times come back with
        the output; the time between the head's send and the answer less those is the hops', shared out evenly.
        """
        out_dtype = groups[0].hidden_state.torch_dtype
        request_id = self.request_id
        sents: list[list[Sent]] = []
        group_of: dict[int, int] = {}
        outputs: list[torch.Tensor | None] = [None] * len(groups)
        hops: list[tuple[str, float, float]] = []
        for g, group in enumerate(groups):
            self.seq += 1
            sents.append([link.expect(group, request_id, self.seq, may_pass=i + 1 < len(links))
                          for i, link in enumerate(links)])
            group_of[self.seq] = g
            mark("send")
            links[0].send_expected(sents[g][0])
            mark("sent")
        # one bound for the step, since no stage answers until the last: each stage's bound for its largest
        # group, added up, and the largest again for each group after the first (the groups run as a pipeline)
        per_stage = [max(group[i].bound for group in sents) for i in range(len(links))]
        bound = sum(per_stage) + (len(groups) - 1) * max(per_stage)
        deadline = sents[0][0].at + bound
        sent_to = [0] * len(groups)  # the stage the head last sent each group to, and when
        sent_at = [sents[0][0].at] * len(groups)
        while any(out is None for out in outputs):
            i, item = self._next_reply(links, deadline, request_id, bound)
            mark("woke")
            g = group_of.get(getattr(item, "seq", None), 0)
            reply = links[i].accept(sents[g][i], item)
            now, first = time.monotonic(), sent_to[g]
            computes = [*reply.upstream_seconds, reply.compute_seconds]
            if len(computes) != i - first + 1:
                links[i].refuse(f"HIDDEN_STATE carries {len(computes)} stage time(s) for a batch that passed "
                                f"{i - first + 1} stage(s)")
                raise WorkerLost(links[i].node_id or links[i].entry_id, links[i].close_reason)
            share = max(0.0, now - sent_at[g] - sum(computes)) / len(computes)
            for j, compute in enumerate(computes, start=first):
                links[j].record(sents[g][j], compute + share, compute)
                links[j].passes_to = links[j + 1].node_id if j < i else "head"
                hops.append((links[j].node_id or links[j].entry_id, compute, compute + share))
            if i + 1 == len(links):
                outputs[g] = reply.hidden_state.tensor().to(out_dtype)
            else:  # it could not pass the rows on: the head carries them to the next stage
                links[i + 1].send_expected(sents[g][i + 1], RunBatch(
                    entries=groups[g].entries, hidden_state=reply.hidden_state, route=groups[g].route,
                    released=groups[g].released))
                sent_to[g], sent_at[g] = i + 1, now
        for link in links:
            link.settle(request_id)
        self.last_hops = hops
        return outputs

    def _retire_route(self, links: list[WorkerLink]) -> None:
        """A step given up: every worker still here is sent a newer route that passes nothing on, before anything
        else it is sent (the RELEASE of the step's sequences among it), and the next step routes afresh.

        A group a stage passed on before the step failed may reach the next stage after that stage's RELEASE, by
        another connection; run, it would make caches for sequences the head has released, which nobody releases
        again and which count against the stage's max_batch for good. A worker drops what arrives from the stage
        before under a route older than its newest, and reads a ROUTE the moment it arrives, so whatever reaches
        its compute after the RELEASE is dropped."""
        retired = next(self._routes)
        self._route, self._routed = 0, []
        for link in links:
            if not link.closed.is_set():
                try:
                    link.send_route(Route(route=retired, next_host=None, next_port=None, next_key=None,
                                          inbound_key=None))
                except WorkerLost:
                    pass  # gone, and its caches with it

    def _next_reply(self, links: list[WorkerLink], deadline: float, request_id: str,
                    bound: float) -> tuple[int, object]:
        """The next reply (or lost connection) on any of `links`: (its index, the item for `accept`). Past the
        deadline, drops every worker that still owes the step an answer (none of them says which one hangs) and
        raises WorkerLost."""
        arrived = self.registry.replies_arrived
        while True:
            for i, link in enumerate(links):
                item = link.take_reply()
                if item is not None:
                    return i, item
            left = deadline - time.monotonic()
            if left <= 0:
                break
            arrived.wait(left)
        owing = [link for link in links if link.awaits(request_id)] or links
        reason = (f"no answer to a step passed from worker to worker ({', '.join(l.name for l in owing)}) within "
                  f"the {bound:.3g}s its stages' bounds add up to: one of them is hung or has failed")
        for link in owing:
            link.drop(reason)
        raise WorkerLost(owing[0].node_id or owing[0].entry_id, owing[0].close_reason)

    def _schedule(self, groups: list[RunBatch], links: list[WorkerLink]) -> list[torch.Tensor]:
        """Every group through every stage in order, as a pipeline: at tick t, stage s runs group t - s, so each
        stage works on one group while the next stage works on the one before. Returns each group's output."""
        out_dtype = groups[0].hidden_state.torch_dtype
        current = list(groups)
        hops = []
        for tick in range(len(groups) + len(links) - 1):
            in_flight = []
            for stage, link in enumerate(links):
                group = tick - stage
                if 0 <= group < len(groups):
                    self.seq += 1
                    try:
                        in_flight.append((group, link, link.send_command(current[group], self.request_id, self.seq),
                                          time.perf_counter()))
                    except WorkerLost:
                        self._drain(in_flight)
                        raise
            self._drain(in_flight, current, hops)
        self.last_hops = hops
        return [message.hidden_state.tensor().to(out_dtype) for message in current]

    @staticmethod
    def _drain(in_flight: list, current: list[RunBatch] | None = None, hops: list | None = None) -> None:
        """Wait for every command of a tick (each link's reply must be taken before it gets another command, even
        when another link failed), then raise the first failure; with `current`, store each group's output."""
        failure: Exception | None = None
        for group, link, sent, started in in_flight:
            try:
                reply = link.await_reply(sent)
            except (WorkerLost, StageFailed) as exc:
                failure = failure or exc
                continue
            link.passes_to = "head"
            if current is not None and hops is not None:
                hops.append((link.node_id or link.entry_id, reply.compute_seconds, time.perf_counter() - started))
                current[group] = RunBatch(entries=current[group].entries, hidden_state=reply.hidden_state)
        if failure is not None:
            raise failure

    def _new_step(self) -> None:
        self.request_id, self.seq = f"step-{next(self._ids)}", 0

    def run(self, entries: Sequence[Entry], hidden: torch.Tensor) -> torch.Tensor:
        row = 0
        for e in entries:
            if e.source == e.sequence:  # its cache cut back to e.start positions (a refused draft's): its inputs too
                self._inputs[e.sequence] = (e.capacity, first_positions(self._inputs[e.sequence][1], e.start))
            elif e.source is not None:  # its cache starts as the source's first e.start positions: so do its inputs
                self._inputs[e.sequence] = (e.capacity, first_positions(self._inputs[e.source][1], e.start))
            elif e.start == 0:
                self._inputs[e.sequence] = (e.capacity, [])
            elif e.capacity > self._inputs[e.sequence][0]:  # a cache taken up by a request that continues it
                self._inputs[e.sequence] = (e.capacity, self._inputs[e.sequence][1])
            # kept only for a replay: with resume off a lost worker fails the step, and a long conversation's inputs
            # (hidden_size values a position) would hold memory for nothing. Not a view of the batch, which would
            # hold all of it; a batch of one entry is that entry's alone
            if self.resume:
                self._inputs[e.sequence][1].append(
                    hidden if len(entries) == 1 else hidden[:, row:row + e.length].clone())
            row += e.length
            for copy in e.copies:  # a copy replays as a sequence of its own: the same inputs so far
                self._inputs[copy] = (e.capacity, list(self._inputs[e.sequence][1]))
        self._new_step()
        released, self._released = tuple(self._released), []
        batch = tuple(BatchEntry(sequence=e.sequence, position_start=e.start, length=e.length,
                                 cache_capacity=e.capacity, copies=e.copies, source=e.source) for e in entries)
        try:
            links = self.registry.links_in_order()
            if any(e.start > 0 for e in entries):
                self._check_same_workers(links)
            if not self._same_workers(links):  # new workers (a step of new sequences only, after a replacement)
                self._worker_changes += 1
            self._links = links
            ran_on, changes = self._ran_on, self._worker_changes
            for e in entries:
                ran_on[e.sequence] = changes
                for copy in e.copies:
                    ran_on[copy] = changes
            return self._relay(batch, hidden, released, links)
        except WorkerLost as exc:
            return self._recover(exc, entries)

    def _check_same_workers(self, links: list[WorkerLink]) -> None:
        """A worker replaced between two steps (lost while idle, and back) holds none of the caches the next step
        continues: raises WorkerLost for it, so the sequences resume (or fail) as for a loss during a step."""
        for old, new in zip(self._links, links):
            if old is not new:
                raise WorkerLost(new.node_id or new.entry_id, "its worker was replaced between two steps, so it "
                                 "holds none of the sequences' caches")

    def _same_workers(self, links: list[WorkerLink]) -> bool:
        return len(links) == len(self._links) and all(old is new for old, new in zip(self._links, links))

    def holds(self, sequence: int) -> bool:
        """Whether the workers hold `sequence`'s cache: it ran (or was replayed) on the workers there are now, and
        was not released since. A worker replaced while it was not running holds none of it."""
        if sequence not in self._inputs or self._ran_on.get(sequence) != self._worker_changes:
            return False
        try:
            return self._same_workers(self.registry.links_in_order())
        except WorkerLost:
            return False

    def release(self, sequences: Sequence[int]) -> None:
        for sequence in sequences:
            self._inputs.pop(sequence, None)
            self._ran_on.pop(sequence, None)
        self._released.extend(sequences)
        for link in self.registry.serving_links():  # a lost worker took its caches with it
            link.release(list(sequences))

    def _recover(self, lost: WorkerLost, entries: Sequence[Entry]) -> torch.Tensor:
        """Replay every sequence in flight on a refilled pipeline; returns the rows of `entries`, this step's.

        Raises HeadShuttingDown when the head stops, and WorkerLost when resume is off or the grace period ends
        before the pipeline is whole again.
        """
        if self.registry.stopping.is_set():
            raise HeadShuttingDown() from lost
        if not self.resume:
            raise lost
        deadline = time.monotonic() + self.resume_grace_s
        idle = (self.idle() - {e.sequence for e in entries}) & set(self._inputs)
        for sequence in idle:  # the workers that stayed hold them until they are released
            del self._inputs[sequence]
            self._ran_on.pop(sequence, None)
        replayed = {sequence: torch.cat(inputs, dim=1) for sequence, (_, inputs) in self._inputs.items()}
        positions = sum(h.shape[1] for h in replayed.values())
        log.warning("worker %s was lost (%s); %d sequence(s) in flight wait up to %.0fs for it to be replaced, then "
                    "resume (%d positions in all; %d kept for later requests are not)", lost.node_id, _reason(lost),
                    len(replayed), self.resume_grace_s, positions, len(idle))
        while True:
            if not self.registry.wait_ready(deadline - time.monotonic()):
                if self.registry.stopping.is_set():
                    raise HeadShuttingDown() from lost
                unready = self.registry.unready()
                if unready:  # else whole again since the wait ended: resume
                    raise WorkerLost(lost.node_id, grace_ended(_reason(lost), lost.node_id, unready,
                                                               self.resume_grace_s)) from lost
            started = time.perf_counter()
            try:
                self._links = self.registry.links_in_order()
                outputs = self._replay(replayed, self._links)
                self._worker_changes += 1
                for sequence in replayed:  # every cache rebuilt on the workers there are now
                    self._ran_on[sequence] = self._worker_changes
            except WorkerLost as again:
                log.warning("resuming failed (%s); waiting again", again)
                lost = again
                continue
            self.resumes += 1
            log.info("%d sequence(s) resumed on a refilled pipeline: %d positions replayed in %.2fs", len(replayed),
                     positions, time.perf_counter() - started)
            return torch.cat([outputs[e.sequence][:, -e.length:] for e in entries], dim=1)

    def _replay(self, replayed: dict[int, torch.Tensor], links: list[WorkerLink]) -> dict[int, torch.Tensor]:
        """Every sequence's inputs so far through a refilled pipeline, from position 0, in steps of at most
        max_positions (a step's frames must fit every worker's limit, and the whole history of every sequence
        in flight would not); returns each sequence's outputs. Raises WorkerLost."""
        outputs: dict[int, list[torch.Tensor]] = {sequence: [] for sequence in replayed}
        room = self.max_positions
        steps: list[list[tuple[int, int, int]]] = [[]]  # per step: (sequence, first position, positions)
        for sequence, h in replayed.items():
            start = 0
            while start < h.shape[1]:
                free = room - sum(n for _, _, n in steps[-1])
                if free <= 0:
                    steps.append([])
                    free = room
                take = min(free, h.shape[1] - start)
                steps[-1].append((sequence, start, take))
                start += take
        for step in steps:
            self._new_step()
            entries = tuple(BatchEntry(sequence=sequence, position_start=start, length=n,
                                       cache_capacity=self._inputs[sequence][0]) for sequence, start, n in step)
            hidden = torch.cat([replayed[sequence][:, start:start + n] for sequence, start, n in step], dim=1)
            out, row = self._relay(entries, hidden, (), links), 0
            for sequence, _, n in step:
                outputs[sequence].append(out[:, row:row + n])
                row += n
        return {sequence: torch.cat(parts, dim=1) for sequence, parts in outputs.items()}


def reachable_from(sender: WorkerLink, address: tuple[str, int]) -> tuple[str, int]:
    """`address` (a worker's peer port) as the worker of `sender` reaches it. A loopback address is a worker that
    joined over loopback, so one on the head's machine: a worker on another machine reaches that machine at the
    address it reaches the head at (the head's end of its link), where the worker listens too (worker/main.py)."""
    host, port = address
    if is_loopback(host) and not is_loopback(sender.conn.peer_host) and sender.conn.local_host is not None:
        return unmapped(sender.conn.local_host), port
    return address


def first_positions(parts: list[torch.Tensor], positions: int) -> list[torch.Tensor]:
    """The first `positions` rows of the inputs `parts` ([1, n, hidden] each, in order): the parts before, whole,
    and what the last one holds of them, copied (a step after a refused draft cuts only its last few rows, and a copy
    of a long conversation's inputs at every such step would cost more than the step). The parts are never written
    after they are appended, so a cache copied from another's shares them."""
    kept, held = [], 0
    for part in parts:
        if held + part.shape[1] > positions:
            if positions > held:
                kept.append(part[:, :positions - held].clone())
            break
        kept.append(part)
        held += part.shape[1]
    return kept


def split_entries(entries: Sequence[BatchEntry], groups: int) -> list[tuple[BatchEntry, ...]]:
    """Cut a batch's entries, in order, into at most `groups` runs of about equal rows, none empty."""
    groups = max(1, min(groups, len(entries)))
    total = sum(e.length for e in entries)
    runs: list[list[BatchEntry]] = [[]]
    done = 0
    for i, entry in enumerate(entries):
        left_entries, left_runs = len(entries) - i, groups - len(runs)
        # start a new run when this one has its share of the rows, or when each remaining run needs an entry
        if runs[-1] and left_runs > 0 and (done >= total * len(runs) / groups or left_entries <= left_runs):
            runs.append([])
        runs[-1].append(entry)
        done += entry.length
    return [tuple(run) for run in runs]


def grace_ended(reason: str, lost: str, unready: Sequence[tuple[str, str, str]], grace_s: float) -> str:
    """Why a resume gave up: the loss's `reason`, then what each node not ready (WorkerRegistry.unready) was
    doing when the grace period ended, the one `lost` first. The grace advice only where more time would help."""
    def doing(node: str, state: str, detail: str) -> str:
        whose = "its" if node == lost else f"node {node}'s"
        if state == "loading":
            return f"a worker took {whose} place but was still loading its layers"
        if state == "failed":
            return f"a worker took {whose} place but could not load its layers ({detail.removeprefix('load failed: ')})"
        return f"no worker filled {whose} place"
    ordered = sorted(unready, key=lambda row: row[0] != lost)
    said = "; ".join(doing(*row) for row in ordered)
    advice = (" (head.resume_grace_s: give it more than a worker's start-up and load time)"
              if any(state != "failed" for _, state, _ in ordered) else
              f": fix that and restart {'the worker' if len(ordered) == 1 else 'those workers'}")
    return f"{reason}; {said} at the end of the {grace_s:g}s resume grace period{advice}"


def _reason(lost: WorkerLost) -> str:
    """The reason a WorkerLost was raised with, out of service.py's sentence around it."""
    text = str(lost)
    prefix = f"worker {lost.node_id} was lost during the generation ("
    suffix = "); the request was not completed"
    if text.startswith(prefix) and text.endswith(suffix):
        return text[len(prefix):-len(suffix)]
    return text
