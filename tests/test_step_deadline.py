"""The bound on one inference step (tc.head.step_deadline): pure, so every rule is a table row."""
from __future__ import annotations

import pytest

from tc.head.step_deadline import StepBudget, StepClock

FLOOR, FACTOR = 2.0, 5.0

# (row id, steps recorded as (kind, positions, seconds), asked (kind, positions), expected bound)
ROWS = [
    ("first prefill: factor x floor", [], ("prefill", 100), FACTOR * FLOOR),
    ("first decode: factor x floor", [], ("decode", 1), FACTOR * FLOOR),
    ("prefill scales per position", [("prefill", 10, 1.0)], ("prefill", 40), FLOOR + FACTOR * 0.1 * 40),
    ("a shorter prefill gets less", [("prefill", 10, 1.0)], ("prefill", 2), FLOOR + FACTOR * 0.1 * 2),
    ("decode takes the slowest recent step", [("decode", 1, 0.1), ("decode", 1, 0.5), ("decode", 1, 0.2)],
     ("decode", 1), FLOOR + FACTOR * 0.5),
    ("prefill takes the slowest per position", [("prefill", 100, 1.0), ("prefill", 2, 0.1)], ("prefill", 10),
     FLOOR + FACTOR * 0.05 * 10),
    ("kinds are measured apart: decode known, prefill not", [("decode", 1, 0.3)], ("prefill", 5), FACTOR * FLOOR),
    ("kinds are measured apart: prefill known, decode not", [("prefill", 5, 0.3)], ("decode", 1), FACTOR * FLOOR),
]


@pytest.mark.parametrize(("steps", "asked", "expected"), [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_bound(steps, asked, expected):
    clock = StepClock(StepBudget(FLOOR, FACTOR))
    for kind, positions, seconds in steps:
        clock.record(kind, positions, seconds)
    assert clock.bound(*asked) == pytest.approx(expected)


def test_a_slow_spell_is_forgotten_after_enough_steps():
    clock = StepClock(StepBudget(FLOOR, FACTOR), recent=3)
    for seconds in (4.0, 0.1, 0.1, 0.1):
        clock.record("decode", 1, seconds)
    assert clock.bound("decode", 1) == pytest.approx(FLOOR + FACTOR * 0.1)


def test_the_explanation_names_the_topology_keys_and_the_measurement():
    clock = StepClock(StepBudget(FLOOR, FACTOR))
    assert clock.explain("decode", 1) == "5 x head.step_timeout_s 2s, as no decode step of this worker is measured yet"
    clock.record("decode", 1, 0.25)
    assert clock.explain("decode", 1) == "head.step_timeout_s 2s + 5 x its slowest recent decode step, 0.25s"
    clock.record("prefill", 100, 0.5)
    assert clock.explain("prefill", 30) == ("head.step_timeout_s 2s + 5 x its slowest recent prefill, 5 ms a position, "
                                            "x 30 positions")


def test_a_first_prefill_waits_as_long_as_the_plan_forecasts_it():
    """A long prompt on a slow stage (or a replay of every history to a worker that took over) outlasted the flat
    factor x floor of a first step and was dropped as hung; the forecast (compute and hop) stretches it."""
    clock = StepClock(StepBudget(FLOOR, FACTOR))
    clock.prefill_forecast = lambda positions: 0.01 * positions  # 10 ms a position
    assert clock.bound("prefill", 100) == FACTOR * FLOOR  # forecast 1 s: the flat bound is longer
    assert clock.bound("prefill", 10_000) == pytest.approx(FLOOR + FACTOR * 100.0)
    assert clock.bound("decode", 1) == FACTOR * FLOOR  # decode steps are short: no forecast for them
    assert clock.explain("prefill", 10_000) == ("head.step_timeout_s 2s + 5 x the plan's forecast for 10000 "
                                                "positions, 100s, as no prefill step of this worker is measured yet")
    clock.record("prefill", 10, 0.05)  # measured: the worker's own steps decide, as before
    assert clock.bound("prefill", 10_000) == pytest.approx(FLOOR + FACTOR * 0.005 * 10_000)
