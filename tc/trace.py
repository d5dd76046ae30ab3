"""Timestamps of a step's hand-offs: where a hop's time goes (bench/trace_hops.py reads them).

A hop's time in /metrics (tc_hop_network_seconds) is everything between two stages' computes: building and
encoding the frame, the socket, waking the reader thread, decoding, handing the batch to the compute thread. To
split it, every process marks those moments when TC_TRACE_DIR names a directory: each appends lines
``<ns> <pid> <event>`` to ``<dir>/<pid>.trace``, the time from time.perf_counter_ns (one monotonic clock for every
process on a machine, so head and workers on one box can be laid side by side). The events, in a decode step's
order through head + 2 workers with direct hops:

    head:    send          the step is about to be encoded and sent to the first worker
             sent          ... and has been
    worker:  received      its reader decoded a RUN_BATCH from the head (or `peer received`: from the stage before)
             computing     the compute thread took it from the reader
             compute       the stage's own computing begins (the part the worker reports as its compute)
             computed      ... ends
             passed        the output went to the next stage (or `answered`: to the head)
    head:    received      the head's reader decoded the last stage's answer
             woke          the step's thread has it

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

CHAIN_HEAD = ("send", "sent")
CHAIN_FIRST_WORKER = ("received", "computing", "compute", "computed")
CHAIN_NEXT_WORKER = ("peer received", "computing", "compute", "computed")
CHAIN_END = ("received", "woke")
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
    for a, b in zip(starts, [*starts[1:], len(events)]):
        window = events[a:b]
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
                found = next((i for i in range(at, len(window)) if window[i][2] == event and window[i][1] == pid),
                             None)
            else:  # a worker not met yet: the one whose next mark is the chain's next (a ping read meanwhile is not)
                found = next((i for i in range(at, len(window)) if window[i][2] == event
                              and window[i][1] not in (head, *pids.values())
                              and _next_of(window, i) == wanted[k + 1][2]), None)
            if found is None:
                ok = False
                break
            pids.setdefault(node, window[found][1])
            chain.append((node, event, window[found][0]))
            after.append(found + 1)
        if ok:
            steps.append(chain)
    return steps


def _next_of(window: list[tuple[int, int, str]], i: int) -> str | None:
    """The event the process of window[i] marks next, if any."""
    pid = window[i][1]
    return next((event for _, p, event in window[i + 1:] if p == pid), None)
