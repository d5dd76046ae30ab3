"""One worker's share of the model: its layers, and a KV cache for each sequence in flight.

Pure with respect to I/O: it takes protocol messages and returns the stage's output (or the INFERENCE_ERROR to
send); main.py wraps the output in the message it sends on, and owns the connections.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from .. import full_version
from ..model.config import ConfigError, ModelConfig
from ..model.kv_cache import CacheFullError, KVCache
from ..model import quant
from ..model.qwen2 import Span, Stage, half_dtype, resolve_compute_dtype
from ..model.weights import WeightIndex, WeightsError, layer_tensor_names
from ..protocol.messages import Assignment, BatchEntry, InferenceError, RunBatch
from ..protocol.tensors import WireTensor
from ..trace import mark

log = logging.getLogger(__name__)

# A prefill of L positions after `start` cached ones makes attention scores [heads, L, start + L]; without a fused
# kernel (CUDA in fp32, MPS, a CPU build without flash attention) they exist whole, in fp32 inside the softmax:
# 3.6 GB for 8k positions of 14 heads. The worker runs a long prefill in chunks that keep them under this.
DEFAULT_ATTENTION_BUDGET_BYTES = 256 << 20
MIN_PREFILL_CHUNK = 16  # below this, per-chunk overhead would cost more than the memory saved


@dataclass(frozen=True)
class StageOutput:
    """What a RUN_BATCH made: the stage's hidden states [1, rows, hidden] in their wire form, and the seconds it
    computed. The worker wraps it in the one message it sends on (RUN_BATCH to the next stage, or HIDDEN_STATE to
    the head), built once: each message checks its fields as it is made, on a step's path."""

    hidden_state: WireTensor
    compute_seconds: float


def prefill_chunk_positions(heads: int, positions_end: int, budget_bytes: int) -> int:
    """The most query positions one prefill chunk may hold so that its fp32 attention scores [heads, chunk,
    positions_end] fit `budget_bytes` (never fewer than MIN_PREFILL_CHUNK). Chunks give the same result as one
    pass: each sees the cache the chunks before it filled, through the model's own mask for a chunk at
    position_start > 0."""
    return max(MIN_PREFILL_CHUNK, budget_bytes // (heads * positions_end * 4))


@dataclass(frozen=True)
class LoadedStage:
    stage: Stage
    dtype: torch.dtype
    device: str
    weight_bytes: int
    load_seconds: float


def stage_weight_bytes(stage: Stage) -> int:
    """Bytes of every parameter and buffer (quantized weights live in buffers)."""
    tensors = list(stage.parameters()) + list(stage.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def apply_threads(assigned: int | None, command_line: int | None) -> None:
    """Use the topology entry's `threads` (carried by ASSIGNMENT) unless --threads set them on this machine.

    The command line wins: whoever starts the worker knows what else the machine runs. Call it on the thread that
    computes: torch keeps the count per process, but OpenMP applies a change to the calling thread at once.
    """
    if command_line is not None:
        if assigned is not None and assigned != command_line:
            log.info("the topology entry asks for %s; keeping --threads %d", torch_threads(assigned), command_line)
        return
    if not _OWN_THREADS:
        _OWN_THREADS.append(torch.get_num_threads())
    if assigned is None:  # an entry without threads (a head restarted with the key gone): PyTorch's own count again
        if torch.get_num_threads() != _OWN_THREADS[0]:
            torch.set_num_threads(_OWN_THREADS[0])
            log.info("using %s again: the topology entry gives none", torch_threads(_OWN_THREADS[0]))
        return
    torch.set_num_threads(assigned)
    log.info("using %s, from the topology entry", torch_threads(torch.get_num_threads()))
    warn_past_the_cores(assigned, "the topology entry's threads")


_OWN_THREADS: list[int] = []  # the process's torch threads before an assignment first set them (apply_threads)


def torch_threads(count: int) -> str:
    return f"{count} torch thread{'' if count == 1 else 's'}"


def warn_past_the_cores(threads: int, setting: str, cpus: int | None = None) -> bool:
    """Warn where `threads` (from `setting`) are more than the CPUs this process may run on (its affinity: a
    container's or taskset's share, not the host's count): each product's threads then wait on each other at
    every barrier, and a step takes longer than with one per CPU. True if it warned."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cpus is None or threads <= cpus:
        return False
    log.warning("%s: %s, and this process may run on %d CPU%s; threads past the CPUs slow every step (each product "
                "waits for its slowest thread): give %d or fewer", setting, torch_threads(threads), cpus,
                "" if cpus == 1 else "s", cpus)
    return True


def check_layer_tensors(index: WeightIndex, assignment: Assignment) -> None:
    """The checkpoint's tensors for the assigned layers must be exactly the `tensor_count` the head planned.

    validate() has found every tensor tc needs; any more are weights tc would leave out (a bias or norm of a
    Qwen2 variant), which would run without error and compute the wrong thing. Raises WeightsError.
    """
    start, end = assignment.layer_start, assignment.layer_end_exclusive
    found = index.declared_in_layers(start, end)
    if len(found) == assignment.tensor_count:
        return
    index.refuse_unused_in_layers(ModelConfig.from_dict(assignment.config), start, end)
    raise WeightsError(f"the head planned {assignment.tensor_count} tensors for layers {start}-{end - 1} and this "
                       f"worker (tc {full_version()}) finds {len(found)}; run the same tc release on the head and "
                       "every worker")


def load_assignment(assignment: Assignment, model_dir: Path, device: str,
                    progress: Callable[[int, int], None] | None = None) -> LoadedStage:
    """Load (and quantize) the assigned layers from `model_dir` onto `device`.

    Raises ConfigError for an architecture or config.json tc cannot run, WeightsError for a checkpoint that does
    not match the assignment, QuantizationError for a weight mode or group size tc cannot quantize.
    """
    started = time.perf_counter()
    # raises ConfigError for a family this release lacks; serving the head's context, which longrope computes for
    config = replace(ModelConfig.from_dict(assignment.config), context_limit=assignment.context_length)
    if assignment.architecture != config.model_type:
        raise ConfigError(f"the head assigns a model of architecture {assignment.architecture!r}, and this worker "
                          f"(tc {full_version()}) reads its config.json as {config.model_type!r}. Run the same tc "
                          "release on the head and every worker")
    start, end = assignment.layer_start, assignment.layer_end_exclusive
    names = layer_tensor_names(config, start, end)
    index = WeightIndex.open(model_dir, only=names)
    index.validate(config, only=names)
    check_layer_tensors(index, assignment)
    dtype = resolve_compute_dtype(assignment.compute_dtype, device)
    # each weight is quantized as it streams in (nothing to do for fp16), so no 16-bit copy of a layer builds up;
    # int4 scales and the int8 kernel use fp16 where the device has no bf16
    quantization = quant.Quantization(assignment.quant, assignment.group_size, half_dtype(device))
    stage = Stage.load(config, index, start, end, dtype, device, quantization, progress=progress)
    return LoadedStage(stage, dtype, device, stage_weight_bytes(stage), time.perf_counter() - started)


class StageRuntime:
    """Runs RUN_BATCH for one loaded stage, keeping a KV cache per sequence, at most `max_sequences` of them."""

    def __init__(self, loaded: LoadedStage, attention_budget_bytes: int = DEFAULT_ATTENTION_BUDGET_BYTES,
                 max_sequences: int = 1, interrupted: Callable[[], bool] | None = None):
        """interrupted: asked before each layer of a step that runs through the layers one by one (a prompt's, not a
        decode plan's few milliseconds); where it says so the step is given up with StepInterrupted."""
        self.loaded = loaded
        self.interrupted = interrupted
        self.attention_budget_bytes = attention_budget_bytes
        self.max_sequences = max_sequences
        self.hidden_size = loaded.stage.config.hidden_size
        # A head asks for a cache of prompt + max_tokens positions, never more than the model's context: a
        # larger request is refused before it allocates anything.
        self.max_positions = loaded.stage.config.model_context
        self.caches: dict[int, KVCache] = {}
        # a CPU stage computing in bf16 may run a decode step from the received bytes (`_run_bytes`)
        self._steps_bytes = loaded.device == "cpu" and loaded.dtype == torch.bfloat16

    def clear(self) -> None:
        self.caches.clear()

    def release(self, sequences: tuple[int, ...]) -> None:
        for sequence in sequences:
            self.caches.pop(sequence, None)

    def _problem(self, msg: RunBatch) -> str | None:
        """What makes this batch impossible to run, before anything is allocated (None: nothing)."""
        hidden = msg.hidden_state
        if hidden.shape[2] != self.hidden_size:
            return f"hidden state has shape {list(hidden.shape)}; expected [1, rows, {self.hidden_size}]"
        new = [e.sequence for e in msg.entries
               if (e.position_start == 0 or e.source is not None) and e.sequence not in self.caches]
        new += [c for e in msg.entries for c in e.copies if c not in self.caches]
        if len(self.caches) + len(new) > self.max_sequences:
            return (f"the batch would hold {len(self.caches) + len(new)} sequences' caches; this worker was assigned "
                    f"{self.max_sequences} (head.max_batch)")
        for e in msg.entries:
            if e.cache_capacity > self.max_positions:
                return (f"sequence {e.sequence}: cache_capacity {e.cache_capacity} is over the model's context of "
                        f"{self.max_positions} positions")
            if e.source is not None:
                source = self.caches.get(e.source)
                if source is None or source.length < e.position_start:
                    held = "no cache" if source is None else f"a cache of {source.length} positions"
                    return (f"sequence {e.sequence} starts from the first {e.position_start} positions of sequence "
                            f"{e.source}'s cache, but this worker holds {held} for it")
                continue
            cache = self.caches.get(e.sequence)
            if e.position_start != 0 and (cache is None or cache.length != e.position_start):
                held = "no cache" if cache is None else f"a cache of {cache.length} positions"
                return f"sequence {e.sequence} continues at position {e.position_start} but this worker holds {held}"
        return None

    def _pieces(self, entry: BatchEntry) -> list[tuple[int, int]]:
        """(offset, length) pieces of an entry small enough for the attention budget (one piece, mostly)."""
        if entry.length == 1:
            return [(0, 1)]
        step = prefill_chunk_positions(self.loaded.stage.config.num_attention_heads,
                                       entry.position_start + entry.length, self.attention_budget_bytes)
        return [(i, min(step, entry.length - i)) for i in range(0, entry.length, step)]

    def run(self, msg: RunBatch) -> StageOutput | InferenceError:
        problem = self._problem(msg)
        if problem:
            return InferenceError(message=problem)
        mark("compute")
        started = time.perf_counter()
        stage, device, dtype = self.loaded.stage, self.loaded.device, self.loaded.dtype
        for e in msg.entries:
            if e.source == e.sequence:  # taken up by a request whose prompt shares only the start of its text
                self.caches[e.sequence] = self.caches[e.sequence].cut(e.position_start, e.cache_capacity)
            elif e.source is not None:  # a prompt that starts as another sequence's text: its cache, copied
                self.caches[e.sequence] = self.caches[e.source].copy(e.cache_capacity, e.position_start)
            elif e.position_start == 0:  # a new sequence (or one replayed from the start): a fresh cache for it
                self.caches[e.sequence] = stage.new_cache(e.cache_capacity, dtype, device)
            elif e.cache_capacity > self.caches[e.sequence].capacity:  # taken up by a request that continues it
                self.caches[e.sequence] = self.caches[e.sequence].copy(e.cache_capacity)
        pieces = [self._pieces(e) for e in msg.entries]
        try:
            if all(len(p) == 1 for p in pieces):
                spans = [Span(self.caches[e.sequence], e.position_start, e.length) for e in msg.entries]
                out = self._run_bytes(msg.hidden_state, spans)
                if out is None:
                    out = WireTensor.of(stage.forward_batch(self._input(msg.hidden_state), spans, self.interrupted))
            else:
                out = WireTensor.of(self._run_in_passes(self._input(msg.hidden_state), msg.entries, pieces))
        except CacheFullError as exc:
            return InferenceError(message=str(exc))
        for e in msg.entries:  # the other choices of a request whose prompt this entry read
            for copy in e.copies:
                self.caches[copy] = self.caches[e.sequence].copy()
        mark("computed")
        return StageOutput(out, time.perf_counter() - started)

    def _run_bytes(self, hidden: WireTensor, spans: list[Span]) -> WireTensor | None:
        """A decode step from the received bytes to the bytes sent on, where the stage's decode plan takes it (a
        CPU stage computing in the wire's bf16): no tensor is made of the rows on the hop. None: it does not."""
        if not self._steps_bytes or hidden.dtype != "bf16":
            return None
        out = self.loaded.stage.decode_bytes(hidden.data, spans)
        return None if out is None else WireTensor(hidden.dtype, hidden.shape, out)

    def _input(self, hidden: WireTensor) -> torch.Tensor:
        """The received rows as a tensor of the stage's dtype on its device."""
        x = hidden.tensor()
        device, dtype = self.loaded.device, self.loaded.dtype
        if device != "cpu" or x.dtype != dtype:  # (on a CPU stage in its own dtype .to would only cost a call)
            x = x.to(device=device, dtype=dtype)
        return x

    def _run_in_passes(self, x: torch.Tensor, entries: tuple[BatchEntry, ...],
                       pieces: list[list[tuple[int, int]]]) -> torch.Tensor:
        """A batch holding a prompt too long for one pass: pass k runs the k-th piece of every entry that has
        one. Each piece sees the cache its entry's earlier pieces filled, so the result is one pass's."""
        out = torch.empty(x.shape, dtype=x.dtype, device="cpu")
        first_rows = [sum(e.length for e in entries[:i]) for i in range(len(entries))]
        for k in range(max(len(p) for p in pieces)):
            spans, rows = [], []
            for e, p, first in zip(entries, pieces, first_rows):
                if k < len(p):
                    offset, length = p[k]
                    spans.append(Span(self.caches[e.sequence], e.position_start + offset, length))
                    rows.append((first + offset, length))
            part = torch.cat([x[:, r:r + n] for r, n in rows], dim=1)
            done = self.loaded.stage.forward_batch(part, spans, self.interrupted).to("cpu")
            at = 0
            for r, n in rows:
                out[:, r:r + n] = done[:, at:at + n]
                at += n
        return out
