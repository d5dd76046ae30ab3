"""Timestamps of a step's hand-offs: where a hop's time goes (bench/trace_hops.py reads them).

A hop's time in /metrics (tc_hop_network_seconds) is everything between two stages' computes: building and
encoding the frame, the socket, waking the reader thread, decoding, handing the batch to the compute thread. To
split it, every process marks those moments when TC_TRACE_DIR names a directory: each appends lines
``<ns> <pid> <event>`` to ``<dir>/<pid>.trace``, the time from time.perf_counter_ns (one monotonic clock for every
process on a machine, so head and workers on one box can be laid side by side). The events, in a decode step's
order through head + 2 workers with direct hops:

    head:    send          the step is about to be built, encoded and sent to the first worker
             encoded       ... its frame is encoded (marked in the connection, for every frame it sends)
             sent          ... and has been sent
    worker:  read          its connection read a frame whole (for every frame); decoding it comes next
             received      its reader decoded a RUN_BATCH from the head (or `peer received`: from the stage before)
             computing     the compute thread took it from the reader
             compute       the stage's own computing begins (the part the worker reports as its compute)
             computed      ... ends
             encoded       the output's frame is built and encoded
             passed        the output went to the next stage (or `answered`: to the head)
    head:    read          the last stage's answer is read whole
             received      ... and decoded by the head's reader
             woke          the step's thread has it
             chosen        ... and has chosen the step's tokens (final norm, lm_head, sampling); from here to the
                           next step's `send` the head streams them out, keeps its books and embeds the next input

`encoded` and `read` split a hand-off into the software's parts and the socket's: from `computed` to `encoded`
the output is built into a message and encoded; from `encoded` to the next process's `read`, the send's system
call, the socket, waking the reader and reading the frame; from `read` to `received`, decoding it. Being marked
in the connection they come with every frame, pings and their answers too, so a ping at the wrong moment can
stand in for a step's frame (rare: one every few seconds; bench/trace_hops.py shows medians).

Off (the default), a mark is one test of a module global. Lines are written as they happen, with no buffering
beyond the line: a trace is for a short diagnostic run, not for serving.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

_DIRECTORY = os.environ.get("TC_TRACE_DIR") or None
_file = None


def mark(event: str) -> None:
    """Record that `event` happens now in this process (nothing unless TC_TRACE_DIR is set)."""
    if _DIRECTORY is None:
        return
    global _file
    if _file is None:
        _file = open(Path(_DIRECTORY) / f"{os.getpid()}.trace", "a", buffering=1, encoding="utf-8")
    _file.write(f"{time.perf_counter_ns()} {os.getpid()} {event}\n")


# ------------------------------------------------------------------------------------------------ reading

CHAIN_HEAD = ("send", "encoded", "sent")
CHAIN_FIRST_WORKER = ("read", "received", "computing", "compute", "computed", "encoded")
CHAIN_NEXT_WORKER = ("read", "peer received", "computing", "compute", "computed", "encoded")
CHAIN_END = ("read", "received", "woke", "chosen")
SENT = ("sent", "passed", "answered")  # marks made when a send returns


def read_events(directory: Path) -> list[tuple[int, int, str]]:
    """Every (ns, pid, event) marked under `directory`, in time order."""
    events = []
    for path in Path(directory).glob("*.trace"):
        for line in path.read_text(encoding="utf-8").splitlines():
            ns, pid, event = line.split(" ", 2)
            events.append((int(ns), int(pid), event))
    return sorted(events)


def decode_steps(events: list[tuple[int, int, str]], workers: int, since_ns: int = 0
                 ) -> list[list[tuple[str, str, int]]]:
    """Each step sent after `since_ns` that went head -> worker 1 -> ... -> worker `workers` -> head with direct
    hops, as its chain of (node, event, ns): node "head" or "w1", "w2", ... in pipeline order. A worker is known by
    what it does: the first to take the step from the head is w1, the one the stage before passes it to is the
    next. Steps that did not follow that chain (relayed, a failure, a trace cut short) are left out."""
    head = next((pid for _, pid, event in events if event == "send"), None)
    starts = [i for i, (ns, pid, event) in enumerate(events) if pid == head and event == "send" and ns >= since_ns]
    # the chain every step must follow: (node, its pid where known from the start, event)
    wanted: list[tuple[str, int | None, str]] = [("head", head, e) for e in CHAIN_HEAD]
    for w in range(workers):
        events_of_worker = CHAIN_FIRST_WORKER if w == 0 else CHAIN_NEXT_WORKER
        wanted += [(f"w{w + 1}", None, e) for e in events_of_worker]
        wanted.append((f"w{w + 1}", None, "passed" if w + 1 < workers else "answered"))
    wanted += [("head", head, e) for e in CHAIN_END]
    steps = []
    bounds = [*starts[1:], len(events), len(events)]
    for a, b, c in zip(starts, bounds, bounds[1:]):
        # the step's marks lie between its send and the next step's, but for a send's return (SENT): on shared
        # cores the last worker's call may return only once the head has chosen the token and sent the next step
        window, limit = events[a:c], b - a
        chain: list[tuple[str, str, int]] = []
        ok = True
        pids: dict[str, int] = {}
        after: list[int] = []  # index in `window` just past each event of the chain found so far
        for k, (node, pid, event) in enumerate(wanted):
            pid = pid if pid is not None else pids.get(node)
            # a frame may be read before its sender's call returns: what follows a send is looked for from the
            # moment the send began, not from its end
            at = after[-2] if chain and chain[-1][1] in SENT else (after[-1] if after else 0)
            if pid is not None:
                end = len(window) if event in SENT else limit
                found = next((i for i in range(at, end) if window[i][2] == event and window[i][1] == pid), None)
            else:  # a worker not met yet: the one whose next marks are the chain's up to taking the step to compute
                # (a ping read meanwhile is answered instead)
                following = [e for _, _, e in wanted[k + 1:k + 1 + _marks_to_computing(wanted, k)]]
                found = next((i for i in range(at, limit) if window[i][2] == event
                              and window[i][1] not in (head, *pids.values())
                              and _next_of(window, i, len(following)) == following), None)
            if found is None:
                ok = False
                break
            pids.setdefault(node, window[found][1])
            chain.append((node, event, window[found][0]))
            after.append(found + 1)
        if ok:
            steps.append(chain)
    return steps


def _marks_to_computing(wanted: list[tuple[str, int | None, str]], k: int) -> int:
    """How many of the chain's marks after the k-th lead up to, and include, its node's next `computing`."""
    return next(j - k for j in range(k + 1, len(wanted)) if wanted[j][2] == "computing")


def _next_of(window: list[tuple[int, int, str]], i: int, count: int) -> list[str]:
    """The next `count` events the process of window[i] marks (fewer where the window ends first)."""
    pid = window[i][1]
    return [event for _, p, event in window[i + 1:] if p == pid][:count]
