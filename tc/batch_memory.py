"""How many sequences the batch may hold: each one costs a KV cache on every stage.

A sequence's cache on a stage holds keys and values for its layers, for every position up to its capacity (prompt
+ max_tokens, at most the context: the model's, or the topology's context_length where that is less). The plan
counts the worst case, a sequence as long as the context:

    bytes per slot on a stage = 2 (K and V) x its layers x kv_heads x head_dim x context x bytes per element

where an element takes the stage's compute dtype (bf16 and fp16 two bytes, fp32 four; fp16 on a CPU computes in
fp32). A node that declares max_memory_gb must hold its weights plus max_batch such slots. `head.max_batch`, when
the topology sets it, must fit, or the head refuses to start with the numbers; left out, it is DEFAULT_MAX_BATCH
or as many as the tightest node fits (at least one: caches are filled only as far as sequences really go, so a
node may well serve more than the worst case says).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .model.config import ModelConfig
from .planner import Plan, PlanError, Stage, format_bytes, memory_text

DEFAULT_MAX_BATCH = 8


def element_bytes(dtype: str, device: str) -> int:
    """Bytes of one cached element for a stage computing in `dtype` on `device`."""
    if dtype == "bf16" or (dtype == "fp16" and device != "cpu"):
        return 2
    return 4


def kv_bytes_per_slot(config: ModelConfig, stage: Stage) -> int:
    """Worst-case KV cache bytes of one sequence on `stage` (the module's docstring)."""
    return (2 * stage.layer_count * config.num_key_value_heads * config.head_dim * config.context_length
            * element_bytes(stage.dtype, stage.device))


def sequences_fit(config: ModelConfig, stage: Stage, memory_bytes: int) -> int:
    """How many worst-case KV caches `memory_bytes` holds beside `stage`'s weights (0 when not even those fit)."""
    return max(memory_bytes - stage.weight_bytes, 0) // kv_bytes_per_slot(config, stage)


@dataclass(frozen=True)
class StageNeed:
    """The memory the plan counts for a stage: its weights and the KV caches of `sequences` full-context
    sequences, `slot_bytes` each."""

    weight_bytes: int
    sequences: int
    slot_bytes: int

    @property
    def kv_bytes(self) -> int:
        return self.sequences * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def describe(self) -> str:
        return (f"{format_bytes(self.total_bytes)}: {format_bytes(self.weight_bytes)} of weights + "
                f"{format_bytes(self.kv_bytes)} of KV cache for {self.sequences} sequence(s) of "
                f"{format_bytes(self.slot_bytes)} each at full context")


@dataclass(frozen=True)
class BatchPlan:
    max_batch: int
    slot_bytes: dict[str, int]  # node id -> worst-case KV bytes per sequence

    def describe(self) -> str:
        per_node = ", ".join(f"{node} {format_bytes(n)}" for node, n in self.slot_bytes.items())
        return f"up to {self.max_batch} sequences at once; KV cache per sequence at full context: {per_node}"


def plan_batch(plan: Plan, config: ModelConfig, asked: int | None) -> BatchPlan:
    """The batch size the nodes' memory allows: `asked` (head.max_batch) if set, else the default as far as it
    fits. Raises PlanError naming the node and the numbers when `asked` does not fit."""
    slot_bytes = {stage.node_id: kv_bytes_per_slot(config, stage) for stage in plan.stages}
    fits = DEFAULT_MAX_BATCH if asked is None else asked
    for stage in plan.stages:
        if stage.memory_bytes is None or not stage.memory_sizes_batch:
            continue
        room = sequences_fit(config, stage, stage.memory_bytes)
        if asked is not None and room < asked:
            raise PlanError(
                f"node {stage.node_id}: head.max_batch {asked} needs {format_bytes(asked * slot_bytes[stage.node_id])}"
                f" of KV cache ({format_bytes(slot_bytes[stage.node_id])} per sequence for layers "
                f"{stage.layers_text} at the {config.context_length}-position context) beside "
                f"{format_bytes(stage.weight_bytes)} of weights, but {memory_text(stage)}; {_holds(room)}raise "
                f"{'it' if stage.memory_from == 'max_memory_gb' else 'the memory it offers'}, give the node fewer "
                "layers, or set a shorter context_length", stage.node_id)
        fits = min(fits, room)
    return BatchPlan(max(fits, 1), slot_bytes)


def _holds(room: int) -> str:
    """What a node whose memory holds `room` full-context caches allows head.max_batch (at least 1)."""
    if room == 0:
        return "its memory holds not one sequence at full context beside the weights: "
    return f"its memory holds {room} sequence(s): lower head.max_batch to that, "


def stage_need(config: ModelConfig, stage: Stage, max_batch: int, device: str | None = None) -> StageNeed:
    """What the plan counts for `stage` serving `max_batch` sequences: its weights and a worst-case KV cache for
    each, or for as many as the node's own memory in the plan holds where that is fewer (a batch left to the
    memory is one sequence even where none fits: see the module's docstring). `device`: the device the stage
    will run on, where known (a joining worker's, a spare's), as an element's size follows it."""
    sequences = max_batch
    if stage.memory_bytes is not None and stage.memory_sizes_batch:
        sequences = min(sequences, sequences_fit(config, stage, stage.memory_bytes))
    on = stage if device is None else replace(stage, device=device)
    return StageNeed(stage.weight_bytes, sequences, kv_bytes_per_slot(config, on))
