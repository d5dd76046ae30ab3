"""How long the head waits for one worker's reply to one inference step. Pure: it takes times, returns times.

A worker answers PING from its reader thread, so a worker whose compute thread has hung (or died without a
word) still passes the heartbeat; what catches it is a bound on each step:

    bound = head.step_timeout_s + head.step_timeout_factor x (the slowest of its recent steps of that kind)

measured per worker connection and per kind, prefill in seconds per position times the positions asked for. A
decode step that checks a greedy sequence's draft (a few positions continuing its cache, draft.py) is of the decode
kind (RunBatch.is_decode): timed per position, its few rows would count as a slow prefill and stretch the next
long prompt's bound many times over.
Why this shape:

- The measurement is the round trip the head sees (send to reply), which is what it waits for: transfer of a
  long prefill's hidden states included.
- The floor absorbs what a measurement cannot predict: a GC pause, a busy head, a slower link for a moment.
- The slowest recent step, not the mean, and a generous factor: dropping a healthy worker costs a whole request
  (or a replay), a late drop only seconds. A prefill's cost per position grows with its length (attention), by
  2-3x from 1k to 32k positions on the models tc serves, which the factor covers; a short prefill's fixed costs
  make its per-position figure high, so estimates err long.
- A kind with nothing measured yet (a worker's first prefill, its first decode step) waits factor x floor: a
  first step pays one-off costs (allocations, a GPU's kernel compilation, first touch of the weights) and there
  is nothing to scale. A first prefill waits longer where the plan forecasts it longer (floor + factor x the
  forecast of its stage's compute and hop for its positions): a long prompt on a slow CPU stage, or every
  sequence's history replayed to a worker that took over, outlasted a flat 300 s and was dropped as hung.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

RECENT_STEPS = 32  # per kind: enough to remember a slow spell, few enough to forget one that ended


@dataclass(frozen=True)
class StepBudget:
    """The topology's head.step_timeout_s (floor) and head.step_timeout_factor."""

    floor_s: float
    factor: float


class StepClock:
    """One worker connection's recent step times, and the bound they give the next step."""

    def __init__(self, budget: StepBudget, recent: int = RECENT_STEPS):
        self.budget = budget
        # seconds per position for prefill, seconds per step for decode
        self._recent = {"prefill": deque(maxlen=recent), "decode": deque(maxlen=recent)}
        # the plan's forecast of a prefill's round trip over so many positions, once the worker has its stage
        self.prefill_forecast: Callable[[int], float] | None = None

    def record(self, kind: str, positions: int, seconds: float) -> None:
        """A step of `kind` ("prefill" or "decode") over `positions` positions took `seconds` (round trip)."""
        self._recent[kind].append(seconds / positions if kind == "prefill" else seconds)

    def slowest(self, kind: str) -> float | None:
        """The slowest recent step of `kind` (per position for prefill), or None when none is measured yet."""
        recent = self._recent[kind]
        return max(recent) if recent else None

    def bound(self, kind: str, positions: int) -> float:
        """Seconds the next step of `kind` over `positions` positions may take before the worker counts as lost."""
        slowest = self.slowest(kind)
        if slowest is None:
            return max(self.budget.factor * self.budget.floor_s, self._forecast_bound(kind, positions))
        scale = positions if kind == "prefill" else 1
        return self.budget.floor_s + self.budget.factor * slowest * scale

    def _forecast_bound(self, kind: str, positions: int) -> float:
        if kind != "prefill" or self.prefill_forecast is None:
            return 0.0
        return self.budget.floor_s + self.budget.factor * self.prefill_forecast(positions)

    def explain(self, kind: str, positions: int) -> str:
        """How `bound` came about, in the topology's terms, for the error a request gets."""
        floor, factor = self.budget.floor_s, self.budget.factor
        slowest = self.slowest(kind)
        if slowest is None and self._forecast_bound(kind, positions) > factor * floor:
            assert self.prefill_forecast is not None
            return (f"head.step_timeout_s {floor:g}s + {factor:g} x the plan's forecast for {positions} positions, "
                    f"{self.prefill_forecast(positions):.0f}s, as no prefill step of this worker is measured yet")
        if slowest is None:
            return (f"{factor:g} x head.step_timeout_s {floor:g}s, as no {kind} step of this worker is measured "
                    "yet")
        if kind == "prefill":
            return (f"head.step_timeout_s {floor:g}s + {factor:g} x its slowest recent prefill, "
                    f"{slowest * 1e3:.3g} ms a position, x {positions} positions")
        return f"head.step_timeout_s {floor:g}s + {factor:g} x its slowest recent decode step, {slowest:.3g}s"
