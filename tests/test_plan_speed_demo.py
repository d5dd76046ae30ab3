"""Speed-aware plans on the demo model with real unequal workers.

What the plan decides is asserted here; how much faster it decodes, and how close the prediction comes, are timings
that depend on the machine and what else runs on it, so bench/bench_plans.py reports them (ratios in one run).
"""
from __future__ import annotations

import pytest

from plan_runs import run

pytestmark = [pytest.mark.demo, pytest.mark.slow]


def test_the_slow_worker_gets_fewer_layers(demo_model_dir):
    """w2 is held to a quarter of a core (a real CPU quota, which its own benchmark sees): planned from the
    workers' measurements it gets fewer layers than the even split gives it, and both plans serve."""
    even = run(demo_model_dir, 2, "topology", slow=1, duty=0.25)
    aware = run(demo_model_dir, 2, "workers", slow=1, duty=0.25)
    assert even.layers == [12, 12] and even.predicted is None
    assert aware.layers[1] < aware.layers[0] and sum(aware.layers) == 24
    assert even.measured > 0 and aware.measured > 0 and aware.predicted is not None


def test_a_plan_from_the_workers_predicts_a_decode_rate(demo_model_dir):
    result = run(demo_model_dir, 2, "workers")
    assert result.predicted is not None and result.predicted > 0 and result.measured > 0
    assert all(predicted is not None for predicted, _ in result.nodes.values()), result.nodes
