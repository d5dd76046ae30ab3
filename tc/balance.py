"""Splitting a run of layers over nodes of known speed, so that the slowest stage is as fast as it can be. Pure.

A pipeline's stages take turns on every token, and once requests overlap the slowest stage sets the pace, so
the first aim is the smallest possible slowest stage (its predicted decode time per token, tc.speed). Many
splits usually share that smallest maximum, and a token's own latency is the sum of its stages, so the second
aim, among those, is the smallest sum: slack is spent giving the faster nodes more layers.

Both are exact dynamic programs over contiguous splits (nodes x layers x layers, a few milliseconds for a
hundred layers and a dozen nodes): the first finds the least achievable maximum, the second the least sum
with every stage within it. A stage must hold at least one layer and its weight bytes must fit its node's
memory, when that is known. Ties go to the earlier cut, so the same inputs give the same plan everywhere.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from tc.speed import Speed

_SLACK = 1e-9  # relative: a stage within the bound by rounding alone still counts as within it


@dataclass(frozen=True)
class Runner:
    """A node as the balancer sees it: its speed and the weight bytes it may hold (None: no limit known)."""

    speed: Speed
    memory_bytes: int | None


def slowest_stage_bound(layer_bytes: Sequence[int], runners: Sequence[Runner]) -> float:
    """The least achievable time of the slowest stage when `runners` split `layer_bytes` in order; inf if no
    split fits their memory. Raises ValueError when there are more runners than layers."""
    return _solve(layer_bytes, runners, bound=None)[0]


def split_by_time(layer_bytes: Sequence[int], runners: Sequence[Runner], bound: float | None = None
                  ) -> list[tuple[int, int]] | None:
    """Half-open (start, end) per runner, offsets into `layer_bytes`: no stage over `bound` (default: the least
    achievable), and the least total time among those splits. None when no split fits the memory limits."""
    if bound is None:
        bound = slowest_stage_bound(layer_bytes, runners)
    if math.isinf(bound):
        return None
    total, cuts = _solve(layer_bytes, runners, bound=bound * (1 + _SLACK))
    return None if math.isinf(total) else cuts


def _solve(layer_bytes: Sequence[int], runners: Sequence[Runner], bound: float | None
           ) -> tuple[float, list[tuple[int, int]]]:
    """Without a bound: least maximum stage time. With one: least sum with every stage <= bound.
    Returns (that value, the split achieving it)."""
    count, layers = len(runners), len(layer_bytes)
    if count > layers:
        raise ValueError(f"{count} nodes cannot each hold a layer of {layers}")
    prefix = [0]
    for size in layer_bytes:
        prefix.append(prefix[-1] + size)

    def cost(i: int, a: int, b: int) -> float:  # runner i holding layers [a, b)
        nbytes = prefix[b] - prefix[a]
        memory = runners[i].memory_bytes
        if memory is not None and nbytes > memory:
            return math.inf
        return runners[i].speed.decode_s(nbytes, b - a)

    inf = math.inf
    # best[i][j]: the objective for runners 0..i-1 holding layers [0, j); cut[i][j]: where runner i-1 starts
    best = [[inf] * (layers + 1) for _ in range(count + 1)]
    cut = [[0] * (layers + 1) for _ in range(count + 1)]
    best[0][0] = 0.0
    for i in range(1, count + 1):
        # runner i-1 ends at j; leave at least one layer for each runner after it
        for j in range(i, layers - (count - i) + 1):
            for a in range(i - 1, j):
                before = best[i - 1][a]
                if before == inf:
                    continue
                c = cost(i - 1, a, j)
                if bound is None:
                    value = max(before, c)
                elif c > bound:
                    continue
                else:
                    value = before + c
                if value < best[i][j]:  # strict: the earliest cut wins a tie
                    best[i][j], cut[i][j] = value, a
    if best[count][layers] == inf:
        return inf, []
    spans = []
    end = layers
    for i in range(count, 0, -1):
        start = cut[i][end]
        spans.append((start, end))
        end = start
    return best[count][layers], spans[::-1]
