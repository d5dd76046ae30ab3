"""What a plan predicts: time per stage and per hop, tokens per second, the bottleneck and what would help. Pure.

One decode step is the head's own work (embedding, final norm, lm_head, sampling), then each stage in turn: the
hidden states' way to its worker, and its layers; then the way back from the last. Where the head relays every
hop (head.direct_hops off) each stage's hop is its link's round trip. With direct hops each worker passes its
output to the next, so a stage's way in is one transfer, counted as half its link's round trip (the links the
head measures are head <-> worker; a link between two workers is taken to cost what the later one's link to the
head costs one way; a worker started with --no-direct-hops, which the plan cannot know of, makes it optimistic),
and the last stage adds the other half for the way back. A token therefore costs the sum of
all of these, and that sum is what decode tokens per second predicts. A prefill of P positions costs the same
terms with each stage's prefill time and hops carrying P positions of hidden states.

Terms not known (a node without a speed, a link not measured) are shown as such; the prediction then needs
every stage's speed, and counts unmeasured links as free (on a LAN a decode hop is well under a millisecond).
The head measures each link as its worker joins (tc.head.workers: empty PINGs for the round trip, PINGs carrying a
prefill's hidden states for the bandwidth), before a plan made from the workers' figures.
"""
from __future__ import annotations

from dataclasses import dataclass

from tc.planner import Plan, format_bytes
from tc.speed import Speed

DEFAULT_PREFILL_POSITIONS = 512
SMALLER_MODES = {"fp16": "quant: int8 or int4", "int8": "quant: int4"}  # what quantizing further can still pick


@dataclass(frozen=True)
class HeadCost:
    """The head's share of a token: its weight bytes read per token (lm_head and norm) at its own speed."""

    weight_bytes: int
    speed: Speed

    @property
    def decode_s(self) -> float:
        return self.speed.decode_s(self.weight_bytes, 1)


@dataclass(frozen=True)
class StageForecast:
    node_id: str
    decode_s: float | None  # compute of one decode step
    prefill_s: float | None  # compute of a prefill of the forecast's prefill_positions
    hop_decode_s: float | None  # the stage's hops with one position (module doc); None: the link was not measured
    hop_prefill_s: float | None
    pinned: bool = False  # the topology pins its layers


@dataclass(frozen=True)
class Forecast:
    stages: tuple[StageForecast, ...]
    head_decode_s: float | None
    prefill_positions: int
    quant: str = "fp16"  # the topology's weight mode: advice never suggests the mode already in use
    plan_from: str = "topology"  # head.plan_from: whether the workers' own speeds will make the plan

    @property
    def complete(self) -> bool:
        """Whether every stage's speed and the head's are known, so the token time can be predicted."""
        return self.head_decode_s is not None and all(s.decode_s is not None for s in self.stages)

    @property
    def decode_token_s(self) -> float | None:
        if not self.complete:
            return None
        return self.head_decode_s + sum(s.decode_s + (s.hop_decode_s or 0.0) for s in self.stages)  # type: ignore

    @property
    def decode_tokens_per_s(self) -> float | None:
        token_s = self.decode_token_s
        return None if token_s is None else 1.0 / token_s

    @property
    def prefill_tokens_per_s(self) -> float | None:
        if not self.complete:
            return None
        total = self.head_decode_s + sum(s.prefill_s + (s.hop_prefill_s or 0.0) for s in self.stages)  # type: ignore
        return self.prefill_positions / total

    def terms(self) -> list[tuple[str, float]]:
        """Each known part of a decode step, named: "node X", "link to X", "head"."""
        parts = [] if self.head_decode_s is None else [("head", self.head_decode_s)]
        for s in self.stages:
            if s.decode_s is not None:
                parts.append((f"node {s.node_id}", s.decode_s))
            if s.hop_decode_s is not None:
                parts.append((f"link to {s.node_id}", s.hop_decode_s))
        return parts

    def bottleneck(self) -> tuple[str, float] | None:
        """The part that takes the largest share of a decode step, and that share (0-1); None if unknown."""
        token_s = self.decode_token_s
        if not token_s:
            return None
        name, seconds = max(self.terms(), key=lambda part: part[1])
        return name, seconds / token_s

    def advice(self) -> str:
        """What would most improve decode, in one sentence an operator can act on."""
        missing = [s.node_id for s in self.stages if s.decode_s is None]
        if missing:
            measured = ("start their workers (they measure themselves)" if self.plan_from == "workers" else
                        "set head.plan_from: workers (each worker measures itself as it joins)")
            return (f"no speed known for {', '.join(missing)}: {measured}, or copy `tc.pyz worker --bench` figures "
                    "into nodes[].speed, to have the split follow speed")
        if self.head_decode_s is None:
            return "the head's speed is not known, so tokens per second cannot be predicted"
        found = self.bottleneck()
        assert found is not None
        name, share = found
        pct = f"{share * 100:.0f}%"
        smaller = SMALLER_MODES.get(self.quant)
        quantize = f"quantize ({smaller}), " if smaller else ""
        if name == "head":  # lm_head stays int8 under int4: only an fp16 head has a smaller mode to go to
            return (f"the head holds {pct} of the time (embedding, lm_head, sampling): run the head on a faster "
                    "machine" + (", or quantize (quant: int8 or int4 also shrinks lm_head)" if self.quant == "fp16"
                                 else ""))
        if name.startswith("link"):
            return (f"the {name} holds {pct} of the time: put that machine on a faster or nearer network, or "
                    "drop it from the pipeline")
        stage = next(s for s in self.stages if f"node {s.node_id}" == name)
        if stage.pinned:
            return f"{name} holds {pct} of the time: pin fewer layers on it, {quantize}or give it a faster device"
        # unpinned and timed: the split already gave it no more than its speed allows
        return (f"{name} holds {pct} of the time, with no more layers than its speed allows: {quantize}give it a "
                "faster device, or add a node beside it")


def hop_bytes_per_position(hidden_size: int, dtype: str) -> int:
    """One position of hidden states as the head sends it: hidden_size values in the compute dtype."""
    return hidden_size * (4 if dtype == "fp32" else 2)


def forecast(plan: Plan, hop_bytes_per_position: int, head: HeadCost | None,
             prefill_positions: int = DEFAULT_PREFILL_POSITIONS, direct_hops: bool = False, quant: str = "fp16",
             plan_from: str = "topology") -> Forecast:
    """The plan's predictions. `hop_bytes_per_position`: one position of hidden states as sent (hidden size x
    the element size); `direct_hops`: workers pass hidden states to each other (the module's docstring); `quant`
    and `plan_from`: the topology's, for the advice. Raises ValueError for a non-positive prefill length."""
    if prefill_positions < 1:
        raise ValueError(f"prefill_positions must be >= 1, got {prefill_positions}")
    stages = []
    for i, stage in enumerate(plan.stages):
        speed, link = stage.speed, stage.link
        # the share of the link's round trip this stage's hops take: all of it relayed, or one way in (and, for
        # the last, one way back) with direct hops
        share = 1.0 if not direct_hops or i + 1 == len(plan.stages) else 0.5
        stages.append(StageForecast(
            node_id=stage.node_id,
            decode_s=stage.decode_s,
            prefill_s=None if speed is None else speed.prefill_s(stage.weight_bytes, stage.layer_count,
                                                                   prefill_positions),
            hop_decode_s=None if link is None else share * link.hop_s(hop_bytes_per_position),
            hop_prefill_s=None if link is None else share * link.hop_s(hop_bytes_per_position * prefill_positions),
            pinned=stage.pinned,
        ))
    return Forecast(tuple(stages), None if head is None else head.decode_s, prefill_positions, quant, plan_from)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.2f}"


def explain(plan: Plan, prediction: Forecast) -> str:
    """The plan as a table with each stage's headroom and predicted time, each hop, the totals and advice."""
    header = ("node", "device", "dtype", "layers", "count", "weights", "headroom", "decode ms", "share",
              "hop ms", f"prefill{prediction.prefill_positions} ms")
    token_s = prediction.decode_token_s
    rows = [header]
    if prediction.head_decode_s is not None or token_s is not None:
        rows.append(("head", "", "", "", "", "", "", _ms(prediction.head_decode_s),
                     _share(prediction.head_decode_s, token_s), "", ""))
    for stage, f in zip(plan.stages, prediction.stages):
        rows.append((stage.node_id, stage.device, stage.dtype, stage.layers_text, str(stage.layer_count),
                     format_bytes(stage.weight_bytes),
                     "-" if stage.headroom_bytes is None else format_bytes(stage.headroom_bytes),
                     _ms(f.decode_s), _share(f.decode_s, token_s), _ms(f.hop_decode_s), _ms(f.prefill_s)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    numeric = set(range(4, len(header)))
    lines = ["  ".join(cell.rjust(w) if i in numeric else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows]
    decode, prefill = prediction.decode_tokens_per_s, prediction.prefill_tokens_per_s
    if decode is not None and prefill is not None:
        lines.append(f"predicted: decode {decode:.1f} tokens/s ({token_s * 1000:.1f} ms a token), prefill "
                     f"{prefill:.0f} tokens/s (a {prediction.prefill_positions}-token prompt)")
        unmeasured = [s.node_id for s in prediction.stages if s.hop_decode_s is None]
        if unmeasured:
            lines.append(f"links to {', '.join(unmeasured)} not measured (counted as free until workers join)")
    else:
        lines.append("predicted: - (needs every node's speed)")
    lines.append(f"to improve: {prediction.advice()}")
    return "\n".join(lines)


def _share(seconds: float | None, total: float | None) -> str:
    return "-" if seconds is None or not total else f"{seconds / total * 100:.0f}%"
