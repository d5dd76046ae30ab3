"""Which topology entry a joining worker fills, or why it is refused (docs/design.md, "Joining"). Pure."""
from __future__ import annotations

from dataclasses import replace
from typing import AbstractSet, Mapping

from ..batch_memory import StageNeed, sequences_fit, stage_need
from ..model.config import ModelConfig
from ..planner import GIB, Plan, Stage, format_bytes
from ..protocol.messages import PROTOCOL_VERSION, DeviceInfo, Hello, SpeedFigure
from ..topology import NodeEntry, Topology


class Refusal(Exception):
    """A HELLO that does not fit the topology; the message is sent to the worker, which prints it."""


class NodeTaken(Refusal):
    """A HELLO for an entry that a connected worker holds (or, without a node id, with every entry held): the
    holder may be the same worker's last connection, dead where the head has not yet seen it end."""


def device_can_serve(entry_device: str, devices: tuple[DeviceInfo, ...]) -> bool:
    """Whether a machine with `devices` can run an entry asking for `entry_device`."""
    if entry_device == "auto":
        return True
    if entry_device == "cuda":
        return any(d.type == "cuda" for d in devices)
    return any(d.id == entry_device for d in devices)


def device_for(entry_device: str, hello: Hello) -> str:
    """The device id the worker should run the entry on."""
    if entry_device == "auto":
        return hello.selected_device
    if entry_device == "cuda":
        if hello.selected_device.startswith("cuda"):
            return hello.selected_device
        return next(d.id for d in hello.devices if d.type == "cuda")
    return entry_device


def worker_memory(hello: Hello, device: str) -> int | None:
    """Memory the worker offers for weights: its own cap if set, else what the device reports free."""
    if hello.max_memory_bytes is not None:
        return hello.max_memory_bytes
    for d in hello.devices:
        if d.id == device:
            return d.free_memory if d.free_memory is not None else d.total_memory
    return None


def dtype_fallback(dtype: str, device: str, hello: Hello) -> str | None:
    """What happens when `device` cannot compute in `dtype` natively (the worker computes in another), or None.

    HELLO's compute_dtypes describe its selected device only; for any other device there is nothing to go on.
    """
    if device != hello.selected_device or dtype in hello.compute_dtypes:
        return None
    return (f"{device} on {hello.hostname} has no native {dtype} (it computes in {', '.join(hello.compute_dtypes)}), "
            f"so it will compute in another dtype than planned; set a dtype it lists for this entry in "
            "topology.yaml (nodes[].dtype)")


def speed_for(hello: Hello, device: str, dtype: str, quant: str) -> SpeedFigure | None:
    """The worker's own figure for computing in `dtype` with weights in `quant` on `device`, if it measured one."""
    for figure in hello.speeds:
        if (figure.device, figure.dtype, figure.quant) == (device, dtype, quant):
            return figure
    return None


def over_memory_cap(entry: NodeEntry, need: StageNeed) -> bool:
    """Whether a stage's `need` (weights and KV cache) passes `entry`'s max_memory_gb: the bound on a spare's
    takeover (the plan keeps a node's own layers and batch within it)."""
    return entry.max_memory_gb is not None and need.total_bytes > entry.max_memory_gb * GIB


def sequences_to_hold(asked: int | None, max_batch: int) -> int:
    """The full-context KV caches a joining worker must have room for beside its layers' weights: the whole batch
    where topology.yaml asks for one (head.max_batch: a promise, as the plan keeps it); where the batch is left to
    the head, one, the floor the plan itself keeps there (batch_memory: caches fill only as far as sequences
    really go), and a worker with room for fewer than the batch is admitted with a warning
    (caches_short_of_the_batch) rather than refused for a worst case a long-context model's batch seldom meets."""
    return max_batch if asked is not None else 1


def stage_fit_problem(entry: NodeEntry, hello: Hello, stage: Stage, config: ModelConfig,
                      sequences: int) -> str | None:
    """Why a worker joined as `entry` cannot hold `stage`'s layers (its own, or a lost node's for a spare) and the
    KV caches of `sequences` sequences (sequences_to_hold): what the plan counts for the stage
    (batch_memory.stage_need)."""
    device = device_for(entry.device, hello)
    need = stage_need(config, stage, sequences, device)
    what = f"entry {stage.node_id} (layers {stage.layers_text}) needs {need.describe()} on {device}"
    fewer = f"set head.max_batch under {need.sequences}, " if need.sequences > 1 else ""
    advice = f"{fewer}or pin fewer layers on {stage.node_id} in topology.yaml"
    if entry.spare:
        advice += ", or declare a spare with more memory"
    if over_memory_cap(entry, need):
        limit = entry.max_memory_gb
        return (f"{what}, but {entry.id}'s max_memory_gb is {limit:g} ({format_bytes(int(limit * GIB))}) in "
                f"topology.yaml; raise it there, {advice}")
    memory = worker_memory(hello, device)
    if memory is not None and need.total_bytes > memory:
        if hello.max_memory_bytes is None and _reported_free(hello, device):
            # the device's own figure: --max-memory-gb past it would only run the load out of memory
            return (f"{what}, but {device} on {hello.hostname} has {format_bytes(memory)} free; free memory there "
                    f"(what else runs on it holds the rest), {advice}")
        return (f"{what}, but this worker offers {format_bytes(memory)}; give it more memory (--max-memory-gb, in "
                f"GiB), {advice}")
    return None


def _reported_free(hello: Hello, device: str) -> bool:
    return any(d.id == device and d.free_memory is not None for d in hello.devices)


def caches_short_of_the_batch(entry: NodeEntry, hello: Hello, stage: Stage, config: ModelConfig,
                              max_batch: int) -> str | None:
    """What the log says where a worker joined as `entry` for `stage` has room for fewer than `max_batch`
    full-context KV caches beside the weights (admitted all the same: sequences_to_hold); None where it has."""
    device = device_for(entry.device, hello)
    need = stage_need(config, stage, max_batch, device)
    limits = [worker_memory(hello, device), None if entry.max_memory_gb is None else int(entry.max_memory_gb * GIB)]
    room = min((limit for limit in limits if limit is not None), default=None)
    if room is None or need.total_bytes <= room:
        return None
    held = sequences_fit(config, replace(stage, device=device), room)
    return (f"{entry.id} holds layers {stage.layers_text} with room for the KV caches of {held} of the batch's "
            f"{need.sequences} sequences at full context ({format_bytes(need.slot_bytes)} each, beside "
            f"{format_bytes(need.weight_bytes)} of weights, in {format_bytes(room)}); it serves, as caches fill only "
            f"as far as sequences go, but more than {held} sequences near the full context at once would run it "
            f"out of memory: set head.max_batch to {max(held, 1)} in topology.yaml to rule that out")


def _fit_problem(entry: NodeEntry, hello: Hello, plan: Plan | None, config: ModelConfig,
                 sequences: int) -> str | None:
    if not device_can_serve(entry.device, hello.devices):
        have = ", ".join(d.id for d in hello.devices)
        return (f"entry {entry.id} needs device {entry.device}, and this worker offers only {have} (what its --device "
                f"names, or all this machine has)")
    if entry.spare or plan is None:  # which layers it gets is not known yet: a spare's when a node is lost,
        return None                  # anyone's when the head plans once its planned set has joined
    return stage_fit_problem(entry, hello, plan.stage_for(entry.id), config, sequences)


def _held_before(hello: Hello, topology: Topology, taken: AbstractSet[str],
                 holders: Mapping[str, str]) -> NodeEntry | None:
    """The free pipeline entry a worker without a node id held on its last connection, if any. Raises NodeTaken
    where a worker of the same host holds it: most likely this worker's own last connection, dead where the head
    has not yet seen it end (a link that blipped), which the worker waits out as one with a node id does; given the
    first free entry instead, workers whose links blipped together swapped entries and reloaded."""
    if hello.held_node_id is None:
        return None
    try:
        entry = topology.node(hello.held_node_id)
    except KeyError:  # a head restarted with another topology
        return None
    if entry.spare:
        return None
    if entry.id in taken:
        if holders.get(entry.id) == hello.hostname:
            raise NodeTaken(f"entry {entry.id}, which this worker held, is held by a connection from "
                            f"{_quoted(hello.hostname)}, most likely this worker's last one: the head drops it once "
                            "its heartbeat timeout passes")
        return None
    return entry


def _quoted(text: str, most: int = 80) -> str:
    """A worker's own string for a refusal (logged, and sent back): quoted, and cut short, as it may be anything
    up to a frame's size."""
    return repr(text) if len(text) <= most else f"{text[:most]!r}... ({len(text)} characters)"


def build_mismatch(hello: Hello, ours: str) -> str | None:
    """What to tell the operator of a worker whose tc is another build than the head's (`ours`, tc.full_version())
    though it speaks the same protocol, else None: it may join, but two builds can differ in what they do."""
    if hello.tc_version == ours:
        return None
    return (f"this worker runs tc {_quoted(hello.tc_version)} and the head tc {ours}: they speak the same protocol, so "
            "it serves, but two builds may behave differently; copy one tc.pyz to every machine")


def choose_entry(hello: Hello, topology: Topology, plan: Plan | None, taken: AbstractSet[str], config: ModelConfig,
                 max_batch: int, holders: Mapping[str, str] | None = None) -> NodeEntry:
    """The entry this worker fills (`plan` None: not made yet, so no memory check; else its weights and the KV
    caches sequences_to_hold says for a batch of `max_batch`); `holders`, the host name of the worker holding each
    entry taken, where known. Raises Refusal with a reason the operator can act on."""
    sequences = sequences_to_hold(topology.head.max_batch, max_batch)
    if hello.protocol_version != PROTOCOL_VERSION:
        raise Refusal(f"this worker speaks protocol {hello.protocol_version} (tc {_quoted(hello.tc_version)}) and "
                      f"the head speaks {PROTOCOL_VERSION}; run the same tc.pyz on every machine")
    if hello.node_id is not None:
        try:
            entry = topology.node(hello.node_id)
        except KeyError:
            raise Refusal(f"unknown node id {_quoted(hello.node_id)}; topology.yaml lists "
                          f"{', '.join(topology.node_ids)}") from None
        if entry.id in taken:
            raise NodeTaken(f"node id {entry.id!r} is already taken by a connected worker; give another --node-id "
                            "or stop the other worker")
        problem = _fit_problem(entry, hello, plan, config, sequences)
        if problem:
            raise Refusal(problem)
        return entry
    again = _held_before(hello, topology, taken, holders or {})
    if again is not None and _fit_problem(again, hello, plan, config, sequences) is None:
        return again  # where its loaded layers most likely serve: workers that rejoin at once swapped entries
    problems = []
    held = []  # taken entries, which may be this worker's own from a connection the head has not yet seen end
    for entry in topology.pipeline_nodes + topology.spare_nodes:  # spares only once the pipeline is full
        if entry.id in taken:
            held.append(entry)
            continue
        problem = _fit_problem(entry, hello, plan, config, sequences)
        if problem is None:
            return entry
        problems.append(problem)
    if not problems:
        raise NodeTaken(f"every entry in topology.yaml is already filled ({', '.join(topology.node_ids)}); "
                        "add an entry for this machine")
    refused = "no free entry fits this worker: " + "; ".join(problems)
    would_fit = [e.id for e in held if _fit_problem(e, hello, plan, config, sequences) is None]
    if would_fit:
        raise NodeTaken(f"{refused}; it would fit {', '.join(would_fit)}, held by a connected worker")
    raise Refusal(refused)
