"""What a node's layers and a link's hops cost in time: the figures the planner balances with. Pure.

A worker measures itself (tc.worker.bench) for each compute dtype and weight mode it could be given, and says
so in HELLO; an operator may instead copy a worker's `--bench` figures into the topology (`nodes[].speed`).
The cost model is the one the measurement fits, per layer of a stage:

    decode step   = layer_overhead_s + weight_bytes / decode_bytes_per_s
    prefill of P  = layer_overhead_s + weight_bytes * P / prefill_bytes_per_s

Decode streams every weight once per token, so its rate is a weight-streaming rate; a prefill multiplies each
weight by P positions, so its rate is a matrix-multiply rate counted in weight bytes times positions. Counting
both in the weight mode's stored bytes (what the planner already knows per layer) keeps the model free of any
one family's shapes: an int4 layer is half the bytes of an int8 one, and its measured rate says what that costs.
`layer_overhead_s` is what a layer costs beyond its weights: norms, attention over a short cache, kernel
launches, the interpreter.

A hop is the head sending a stage its hidden states and getting them back: round trip plus bytes over bandwidth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SPEED_KEYS = ("decode_gbps", "prefill_gbps", "layer_ms")  # how the topology and `--bench` write a Speed
GB = 1e9  # rates are in decimal GB/s, as bandwidths are quoted


@dataclass(frozen=True)
class Speed:
    """One node's measured cost of a layer, for one device, compute dtype and weight mode."""

    decode_bytes_per_s: float
    prefill_bytes_per_s: float
    layer_overhead_s: float

    def __post_init__(self) -> None:
        for name in ("decode_bytes_per_s", "prefill_bytes_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"Speed.{name} must be a finite number > 0, got {value!r}")
        if not (math.isfinite(self.layer_overhead_s) and self.layer_overhead_s >= 0):
            raise ValueError(f"Speed.layer_overhead_s must be a finite number >= 0, got {self.layer_overhead_s!r}")

    def decode_s(self, weight_bytes: int, layers: int) -> float:
        """Seconds one decode step of `layers` layers holding `weight_bytes` in all takes here."""
        return layers * self.layer_overhead_s + weight_bytes / self.decode_bytes_per_s

    def prefill_s(self, weight_bytes: int, layers: int, positions: int) -> float:
        """Seconds a prefill of `positions` positions through those layers takes here."""
        return layers * self.layer_overhead_s + weight_bytes * positions / self.prefill_bytes_per_s

    def as_topology(self, rounded: bool = True) -> dict[str, float]:
        """The `speed:` mapping a topology file takes, in GB/s and ms; `rounded` to three significant figures,
        what a measurement on a shared machine can tell (a topology written back keeps every digit)."""
        shown = _round3 if rounded else float
        return {"decode_gbps": shown(self.decode_bytes_per_s / GB),
                "prefill_gbps": shown(self.prefill_bytes_per_s / GB),
                "layer_ms": shown(self.layer_overhead_s * 1000)}

    @classmethod
    def from_topology(cls, decode_gbps: float, prefill_gbps: float, layer_ms: float) -> Speed:
        return cls(decode_gbps * GB, prefill_gbps * GB, layer_ms / 1000)


@dataclass(frozen=True)
class LinkSpeed:
    """The head's link to one worker: round trip of a small frame, and bytes per second of a large one."""

    round_trip_s: float
    bytes_per_s: float | None  # None: not measured; a hop then costs its round trip alone

    def hop_s(self, payload_bytes: int) -> float:
        """Seconds to send `payload_bytes` of hidden states to the worker and the same back, beyond compute."""
        if self.bytes_per_s is None:
            return self.round_trip_s
        return self.round_trip_s + 2 * payload_bytes / self.bytes_per_s

    @classmethod
    def from_probes(cls, small_s: list[float], large_s: list[float], payload_bytes: int) -> LinkSpeed | None:
        """The link from timed echoes: `small_s` round trips of empty PINGs, `large_s` of PINGs whose payload
        of `payload_bytes` the PONG echoes (so 2 x payload_bytes crossed the link). The least time of each
        (the link's own cost, without the scheduling noise others add). None without a small one; bandwidth
        None without a large one, or when the large ones were no slower (the link outruns what we can time)."""
        if not small_s:
            return None
        round_trip = min(small_s)
        extra = min(large_s) - round_trip if large_s else 0.0
        return cls(round_trip, 2 * payload_bytes / extra if extra > 0 and payload_bytes > 0 else None)

    def describe(self) -> str:
        rate = "bandwidth not measured" if self.bytes_per_s is None else f"{self.bytes_per_s / GB:.2f} GB/s"
        return f"round trip {self.round_trip_s * 1000:.2f} ms, {rate}"


def fit_line(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """(intercept, slope) of the line through two (x, y) points; the slope is floored so a rate stays finite.

    The bench times one probe layer with few weight bytes and one with many: the slope is seconds per byte, the
    intercept the layer's fixed cost. Noise can make the intercept negative; a fixed cost is never below zero.
    """
    (x0, y0), (x1, y1) = small, large
    if x1 <= x0:
        raise ValueError(f"the large probe ({x1}) must hold more than the small one ({x0})")
    slope = max((y1 - y0) / (x1 - x0), 1e-15)
    return max(y0 - slope * x0, 0.0), slope


def _round3(value: float) -> float:
    """Three significant figures: a benchmark on a shared machine tells no more."""
    if value == 0:
        return 0.0
    return float(f"{value:.3g}")
