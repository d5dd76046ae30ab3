"""Static planning: which node runs which transformer layers.

The plan follows from the topology's node list and the model's per-layer weight bytes alone, so the head can
show it before any worker joins. `make_plan` is pure and deterministic; it raises PlanError, naming the node
or the layers and giving the numbers, when no plan fits.

Rules, in order:
1. Every node gets one contiguous, non-empty, half-open range [start, end) of layers; ranges follow node
   order and together cover [0, num_layers) exactly once. So there can be no more nodes than layers.
2. A pinned node (`layers:` in the file) gets exactly its pin. Pins must lie inside the model, must not
   overlap, and must follow node order.
3. The pins cut the model into gaps (before the first pin, between two pins, after the last). Each gap goes
   to the unpinned nodes that sit between those pins in node order, as one run; a gap with no such nodes, or
   with more nodes than layers, has no plan.
4. Within a run whose every node has a speed (measured by its worker, or written in the topology), layers are
   split by time (tc.balance): the slowest stage of the whole plan as fast as the memory limits allow, then
   the least total time. Otherwise they are split on cumulative bytes: the node's share of the run's bytes
   is proportional to its memory when every node of the run declares memory, else equal. Each cut is the
   layer boundary nearest its target that still leaves every node at least one layer; where those cuts give a
   node more bytes than its memory, the cuts nearest the targets that fit every node's memory, if any do.
5. Every stage must fit: its weight bytes may not exceed its node's memory, when that is known. The rest of
   the memory (`headroom_bytes`) is what the node has for its KV cache and activations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from tc.balance import Runner, slowest_stage_bound, split_by_time
from tc.model.quant import WEIGHT_MODES, quantized_nbytes
from tc.speed import LinkSpeed, Speed
from tc.topology import GIB, Topology

MIB = 1 << 20


class PlanError(ValueError):
    """No layer split satisfies the topology for this model; the message names the node or layers."""

    def __init__(self, message: str, node_id: str | None = None) -> None:
        super().__init__(message)
        self.node_id = node_id


@dataclass(frozen=True)
class NodeSpec:
    id: str
    device: str
    dtype: str
    memory_bytes: int | None  # None: unknown, so the node is trusted to fit what it gets
    pin: tuple[int, int] | None  # half-open [start, end)
    speed: Speed | None = None  # None: not known, so its run is split by bytes
    link: LinkSpeed | None = None  # the head's link to it, once measured
    memory_from: str = "max_memory_gb"  # what gave memory_bytes, as an error names it (memory_text)
    # whether memory_bytes sizes the batch too (batch_memory.plan_batch): not a device's own free figure, which
    # places the weights alone (caches fill only as far as sequences go, and a worker short of them is warned of)
    memory_sizes_batch: bool = True


@dataclass(frozen=True)
class Stage:
    node_id: str
    device: str
    dtype: str
    start: int
    end: int  # exclusive
    weight_bytes: int
    memory_bytes: int | None
    speed: Speed | None = None
    link: LinkSpeed | None = None
    pinned: bool = False  # its range is the topology's pin, not the planner's choice
    memory_from: str = "max_memory_gb"  # NodeSpec.memory_from
    memory_sizes_batch: bool = True  # NodeSpec.memory_sizes_batch

    @property
    def decode_s(self) -> float | None:
        """Predicted seconds of compute for one decode step of this stage, when its node's speed is known."""
        return None if self.speed is None else self.speed.decode_s(self.weight_bytes, self.layer_count)

    @property
    def layer_count(self) -> int:
        return self.end - self.start

    @property
    def layers_text(self) -> str:
        """The range as the topology file writes it: inclusive "0-7"."""
        return _span(self.start, self.end)

    @property
    def headroom_bytes(self) -> int | None:
        return None if self.memory_bytes is None else self.memory_bytes - self.weight_bytes


@dataclass(frozen=True)
class Plan:
    num_layers: int
    stages: tuple[Stage, ...]

    def stage_for(self, node_id: str) -> Stage:
        """The stage of this node. Raises KeyError naming the nodes the plan has."""
        for stage in self.stages:
            if stage.node_id == node_id:
                return stage
        raise KeyError(f"no stage for node {node_id!r}; the plan has {', '.join(s.node_id for s in self.stages)}")

    @property
    def total_weight_bytes(self) -> int:
        return sum(stage.weight_bytes for stage in self.stages)

    def table(self) -> str:
        """A fixed-width text table, one row per stage, for logs and the CLI."""
        header = ("node", "device", "dtype", "layers", "count", "weights", "memory", "headroom")
        rows = [header]
        for s in self.stages:
            rows.append((
                s.node_id, s.device, s.dtype, s.layers_text, str(s.layer_count), format_bytes(s.weight_bytes),
                "-" if s.memory_bytes is None else format_bytes(s.memory_bytes),
                "-" if s.headroom_bytes is None else format_bytes(s.headroom_bytes),
            ))
        rows.append(("total", "", "", _span(0, self.num_layers), str(self.num_layers),
                     format_bytes(self.total_weight_bytes), "", ""))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        numeric = {4, 5, 6, 7}  # right-align numbers so their digits line up
        lines = [
            "  ".join(cell.rjust(w) if i in numeric else cell.ljust(w) for i, (cell, w) in
                      enumerate(zip(row, widths))).rstrip()
            for row in rows
        ]
        return "\n".join(lines)


def format_bytes(count: int) -> str:
    """Human size in binary units: 1.90 GiB, 136.5 MiB, 512 B."""
    sign = "-" if count < 0 else ""
    size = abs(count)
    if size >= GIB:
        return f"{sign}{size / GIB:.2f} GiB"
    if size >= MIB:
        return f"{sign}{size / MIB:.1f} MiB"
    if size >= 1024:
        return f"{sign}{size / 1024:.1f} KiB"
    return f"{sign}{size} B"


def make_plan(num_layers: int, layer_bytes: Sequence[int], nodes: Sequence[NodeSpec]) -> Plan:
    """Assign each node a contiguous layer range (rules in the module docstring).

    Raises PlanError when no split fits (too many nodes, a pin outside the model, layers no node can take,
    a stage larger than its node's memory); ValueError when the arguments themselves are inconsistent.
    """
    _check_arguments(num_layers, layer_bytes, nodes)
    if len(nodes) > num_layers:
        raise PlanError(
            f"the topology lists {len(nodes)} nodes but the model has only {num_layers} layers, and every node "
            f"needs at least one; remove {len(nodes) - num_layers} node(s)"
        )
    _check_pins(num_layers, nodes)
    ranges = _assign_ranges(num_layers, list(layer_bytes), nodes)
    stages = tuple(
        Stage(node.id, node.device, node.dtype, start, end, sum(layer_bytes[start:end]), node.memory_bytes,
              node.speed, node.link, node.pin is not None, node.memory_from, node.memory_sizes_batch)
        for node, (start, end) in zip(nodes, ranges)
    )
    assert [s.start for s in stages] == [0] + [s.end for s in stages[:-1]] and stages[-1].end == num_layers
    for stage, node in zip(stages, nodes):
        _check_fits(stage, node)
    return Plan(num_layers, stages)


def _check_arguments(num_layers: int, layer_bytes: Sequence[int], nodes: Sequence[NodeSpec]) -> None:
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if len(layer_bytes) != num_layers:
        raise ValueError(f"layer_bytes has {len(layer_bytes)} entries for {num_layers} layers")
    if any(b < 0 for b in layer_bytes):
        raise ValueError("layer_bytes must not be negative")
    if not nodes:
        raise PlanError("the topology lists no nodes; add at least one under nodes:")
    ids = [node.id for node in nodes]
    if len(set(ids)) != len(ids):
        raise ValueError(f"node ids must be unique, got {ids}")


def _check_pins(num_layers: int, nodes: Sequence[NodeSpec]) -> None:
    last_pinned: NodeSpec | None = None
    for node in nodes:
        if node.pin is None:
            continue
        start, end = node.pin
        if not 0 <= start < end:
            raise PlanError(f"node {node.id}: pin [{start}, {end}) is empty or negative; pin at least one layer",
                            node.id)
        if end > num_layers:
            raise PlanError(
                f"node {node.id}: layers {_span(start, end)} go past the model's last layer {num_layers - 1} "
                f"(it has {num_layers} layers, 0-{num_layers - 1}); pin within that range or drop the pin",
                node.id,
            )
        if last_pinned is not None:
            assert last_pinned.pin is not None
            prev_start, prev_end = last_pinned.pin
            if start < prev_end:
                relation = "overlap" if end > prev_start else "come before"
                raise PlanError(
                    f"node {node.id}: layers {_span(start, end)} {relation} node {last_pinned.id}'s layers "
                    f"{_span(prev_start, prev_end)}; pins must not overlap and must follow node order",
                    node.id,
                )
        last_pinned = node


def _assign_ranges(num_layers: int, layer_bytes: list[int], nodes: Sequence[NodeSpec]) -> list[tuple[int, int]]:
    """One (start, end) per node, in node order: pins as given, each gap split among its run."""
    ranges: list[tuple[int, int] | None] = [node.pin for node in nodes]
    gaps: list[tuple[int, int, list[int]]] = []  # (start, end, indices of the unpinned nodes splitting it)
    run: list[int] = []  # indices of the unpinned nodes since the last pin
    cursor = 0  # where the current gap starts
    previous: NodeSpec | None = None
    for index, node in enumerate([*nodes, None]):
        if node is not None and node.pin is None:
            run.append(index)
            continue
        gap_end = num_layers if node is None else node.pin[0]  # type: ignore[index]
        _check_gap(cursor, gap_end, [nodes[i] for i in run], previous, node, num_layers)
        if run:
            gaps.append((cursor, gap_end, run))
        if node is not None:
            cursor = node.pin[1]  # type: ignore[index]
            previous = node
        run = []
    bound = _slowest_stage_bound(layer_bytes, nodes, gaps)
    for start, end, run in gaps:
        members = [nodes[i] for i in run]
        spans = None
        if bound is not None and all(node.speed is not None for node in members):
            timed = split_by_time(layer_bytes[start:end], _runners(members), bound)
            spans = None if timed is None else [(start + a, start + b) for a, b in timed]
        for i, span in zip(run, spans or _split_run(start, end, layer_bytes, members)):
            ranges[i] = span
    assert all(r is not None for r in ranges)
    return ranges  # type: ignore[return-value]


def _runners(nodes: Sequence[NodeSpec]) -> list[Runner]:
    return [Runner(node.speed, node.memory_bytes) for node in nodes]  # type: ignore[arg-type]


def _slowest_stage_bound(layer_bytes: list[int], nodes: Sequence[NodeSpec], gaps: list[tuple[int, int, list[int]]]
                         ) -> float | None:
    """The least time the plan's slowest stage can have: the largest of the pinned stages' times and each timed
    run's own least maximum. A run may then use slack up to it to speed up its sum. None when nothing is timed
    (no node has a speed) or the timed runs cannot fit their memory (the byte split then reports why)."""
    worst = 0.0
    timed = False
    for node in nodes:
        if node.pin is not None and node.speed is not None:
            start, end = node.pin
            worst = max(worst, node.speed.decode_s(sum(layer_bytes[start:end]), end - start))
    for start, end, run in gaps:
        members = [nodes[i] for i in run]
        if all(node.speed is not None for node in members):
            timed = True
            run_bound = slowest_stage_bound(layer_bytes[start:end], _runners(members))
            if run_bound == float("inf"):
                return None
            worst = max(worst, run_bound)
    return worst if timed else None


def _check_gap(start: int, end: int, run: list[NodeSpec], before: NodeSpec | None, after: NodeSpec | None,
               num_layers: int) -> None:
    where = f"{_bound(before, 'the start of the model')} and {_bound(after, 'the end of the model')}"
    if start < end and not run:
        raise PlanError(
            f"layers {_span(start, end)} belong to no node: no unpinned node sits between {where}; "
            f"extend a pin over them or add an unpinned node there",
            (after or before).id if (after or before) else None,
        )
    if len(run) > end - start:
        names = ", ".join(node.id for node in run)
        raise PlanError(
            f"node(s) {names} sit between {where}, which leave {end - start} layer(s) for {len(run)} node(s); "
            f"move a pin to free layers there or remove {'that node' if len(run) == 1 else 'nodes'}",
            run[0].id,
        )


def _split_run(start: int, end: int, layer_bytes: list[int], run: list[NodeSpec]) -> list[tuple[int, int]]:
    """Split [start, end) into len(run) contiguous non-empty ranges by cumulative bytes (rule 4): each cut nearest
    its share of the bytes (by the nodes' memory where every one says it, else equal shares); where that overfills
    a node's memory, the cuts nearest those shares that fit every node, if any do."""
    count = len(run)
    sizes = layer_bytes[start:end]
    if sum(sizes) == 0:
        sizes = [1] * len(sizes)  # weightless layers: split by count instead
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    total = prefix[-1]
    if all(node.memory_bytes is not None and node.memory_bytes > 0 for node in run):
        weights = [node.memory_bytes for node in run]
    else:
        weights = [1] * count
    weight_total = sum(weights)  # type: ignore[arg-type]
    # Integer arithmetic, so the same inputs give the same plan on every machine: cut i's target is
    # targets[i - 1] / weight_total bytes.
    targets = [total * sum(weights[:i]) for i in range(1, count)]  # type: ignore[arg-type]
    cuts = [0]
    for i in range(1, count):
        low = cuts[-1] + 1
        high = len(sizes) - (count - i)
        best = min(range(low, high + 1), key=lambda j: (abs(prefix[j] * weight_total - targets[i - 1]), j))
        cuts.append(best)
    cuts.append(len(sizes))
    caps = [node.memory_bytes for node in run]
    # (weightless layers, split by count above, fit any memory)
    if any(cap is not None and prefix[b] - prefix[a] > cap for cap, a, b in zip(caps, cuts, cuts[1:])) and \
            sum(layer_bytes[start:end]):
        cuts = _fitting_cuts(prefix, caps, targets, weight_total) or cuts  # none: _check_fits says which overfills
    return [(start + a, start + b) for a, b in zip(cuts, cuts[1:])]


def _fitting_cuts(prefix: list[int], caps: list[int | None], targets: list[int], weight_total: int) -> list[int] | None:
    """The cuts (0 first, the last position last) that give node i no more than caps[i] bytes (None: no cap), each
    as near its target as the others allow (least sum of squared distances, which spreads a shortfall over the
    cuts rather than on one; of equals, the earliest cuts); None if none fit.
    A search over every cut of every node: a run has tens of layers and a few nodes."""
    positions, count = len(prefix) - 1, len(caps)
    # for each place the cuts so far may end: the least distance to their targets, and those cuts
    reach: dict[int, tuple[int, list[int]]] = {0: (0, [0])}
    for i, cap in enumerate(caps):
        last = i == count - 1
        ends = [positions] if last else range(i + 1, positions - (count - i - 1) + 1)
        after: dict[int, tuple[int, list[int]]] = {}
        for j in ends:
            distance = 0 if last else (prefix[j] * weight_total - targets[i]) ** 2
            for begin, (so_far, cuts) in reach.items():
                if begin < j and (cap is None or prefix[j] - prefix[begin] <= cap):
                    candidate = (so_far + distance, cuts + [j])
                    if j not in after or candidate < after[j]:
                        after[j] = candidate
        reach = after
    return reach[positions][1] if positions in reach else None


def _check_fits(stage: Stage, node: NodeSpec) -> None:
    if stage.memory_bytes is None or stage.weight_bytes <= stage.memory_bytes:
        return
    advice = "pin fewer layers there" if node.pin is not None else "give the other nodes more memory"
    raise PlanError(
        f"node {stage.node_id}: layers {stage.layers_text} need {format_bytes(stage.weight_bytes)} of weights "
        f"but {memory_text(stage)}; raise it, {advice}, or add a node",
        stage.node_id,
    )


def memory_text(stage: Stage) -> str:
    """Where the stage's memory figure comes from and what it is, for an error: the topology's max_memory_gb, or
    what its worker offered (a plan made from the workers)."""
    assert stage.memory_bytes is not None
    if stage.memory_from == "max_memory_gb":
        return f"max_memory_gb is {stage.memory_bytes / GIB:.3g} ({format_bytes(stage.memory_bytes)})"
    return f"its worker offers {format_bytes(stage.memory_bytes)} ({stage.memory_from})"


def _bound(node: NodeSpec | None, otherwise: str) -> str:
    if node is None or node.pin is None:
        return otherwise
    return f"node {node.id} (layers {_span(*node.pin)})"


def _span(start: int, end: int) -> str:
    return f"{start}" if end == start + 1 else f"{start}-{end - 1}"


def _is_projection(name: str, shape: Sequence[int]) -> bool:
    return len(shape) == 2 and name.endswith("_proj.weight")


def layer_weight_bytes(
    tensor_shapes_by_layer: Sequence[Sequence[tuple[str, Sequence[int], int]]], quant: str, group_size: int,
    quantized: Callable[[str, Sequence[int]], bool] = _is_projection,
) -> list[int]:
    """Bytes each layer's weights take in memory once loaded in weight mode `quant`.

    Input: per layer, (tensor name, shape, stored bytes per element) as the safetensors headers give them.
    Tensors for which `quantized(name, shape)` holds are what tc quantizes (by default 2-D `*_proj.weight`; the
    model's own rule is model.weights.is_quantized), so they count as `quantized_nbytes`; everything else
    (norms, biases, routers) is kept in 16-bit, two bytes an element, whatever the checkpoint stored. The stored
    width is therefore not used; it is accepted so callers can pass header entries as they are.
    Raises ValueError for an unknown weight mode.
    """
    if quant not in WEIGHT_MODES:
        raise ValueError(f"unknown weight mode {quant!r}; expected one of {WEIGHT_MODES}")
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    totals: list[int] = []
    for tensors in tensor_shapes_by_layer:
        total = 0
        for name, shape, _stored_bytes in tensors:
            if quantized(name, shape):
                total += quantized_nbytes((int(shape[0]), int(shape[1])), quant, group_size)
            else:
                numel = 1
                for dim in shape:
                    numel *= int(dim)
                total += numel * 2
        totals.append(total)
    return totals


def node_specs(topology: Topology) -> list[NodeSpec]:
    """The planner's view of the topology's nodes, in pipeline order (memory from max_memory_gb, in GiB)."""
    return [
        NodeSpec(
            id=entry.id,
            device=entry.device,
            dtype=entry.dtype or topology.dtype,
            memory_bytes=None if entry.max_memory_gb is None else int(round(entry.max_memory_gb * GIB)),
            pin=entry.layers,
            speed=entry.speed,
        )
        for entry in topology.nodes
    ]
