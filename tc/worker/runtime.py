"""One worker's share of the model: its layers, and the KV cache of the request in flight.

Pure with respect to I/O: it takes protocol messages and returns replies; the connection lives in main.py.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .. import __version__
from ..model.config import ConfigError, ModelConfig
from ..model.kv_cache import CacheFullError, KVCache
from ..model import quant
from ..model.qwen2 import Stage, half_dtype, resolve_compute_dtype
from ..model.weights import WeightIndex, WeightsError, layer_tensor_names
from ..protocol.messages import Assignment, HiddenState, InferenceError, RunDecode, RunPrefill

log = logging.getLogger(__name__)

# A prefill of L positions after `start` cached ones makes attention scores [heads, L, start + L]; without a fused
# kernel (CUDA in fp32, MPS, a CPU build without flash attention) they exist whole, in fp32 inside the softmax:
# 3.6 GB for 8k positions of 14 heads. The worker runs a long prefill in chunks that keep them under this.
DEFAULT_ATTENTION_BUDGET_BYTES = 256 << 20
MIN_PREFILL_CHUNK = 16  # below this, per-chunk overhead would cost more than the memory saved


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
            log.info("the topology entry asks for %d torch threads; keeping --threads %d", assigned, command_line)
        return
    if assigned is None:
        return
    torch.set_num_threads(assigned)
    log.info("using %d torch threads, from the topology entry", torch.get_num_threads())


def check_layer_tensors(index: WeightIndex, assignment: Assignment) -> None:
    """The checkpoint's tensors for the assigned layers must be exactly the `tensor_count` the head planned.

    validate() has found every tensor tc needs; any more are weights tc would leave out (a bias or norm of a
    Qwen2 variant), which would run without error and compute the wrong thing. Raises WeightsError.
    """
    start, end = assignment.layer_start, assignment.layer_end_exclusive
    found = index.declared_in_layers(start, end)
    if len(found) == assignment.tensor_count:
        return
    unknown = sorted(set(found) - set(layer_tensor_names(ModelConfig.from_dict(assignment.config), start, end)))
    if unknown:
        shown = ", ".join(unknown[:4]) + (f" and {len(unknown) - 4} more" if len(unknown) > 4 else "")
        raise WeightsError(f"layers {start}-{end - 1} of this checkpoint hold tensors tc's {assignment.architecture} "
                           f"does not use ({shown}); it is not a plain {assignment.architecture} checkpoint, and "
                           "running it without them would compute the wrong thing")
    raise WeightsError(f"the head planned {assignment.tensor_count} tensors for layers {start}-{end - 1} and this "
                       f"worker (tc {__version__}) finds {len(found)}; run the same tc release on the head and "
                       "every worker")


def load_assignment(assignment: Assignment, model_dir: Path, device: str,
                    progress: Callable[[int, int], None] | None = None) -> LoadedStage:
    """Load (and quantize) the assigned layers from `model_dir` onto `device`.

    Raises ConfigError for an architecture or config.json tc cannot run, WeightsError for a checkpoint that does
    not match the assignment.
    """
    started = time.perf_counter()
    config = ModelConfig.from_dict(assignment.config)  # raises ConfigError for a family this release lacks
    if assignment.architecture != config.model_type:
        raise ConfigError(f"the head assigns a model of architecture {assignment.architecture!r}, and this worker "
                          f"(tc {__version__}) reads its config.json as {config.model_type!r}. Run the same tc "
                          "release on the head and every worker")
    start, end = assignment.layer_start, assignment.layer_end_exclusive
    names = layer_tensor_names(config, start, end)
    index = WeightIndex.open(model_dir, only=names)
    index.validate(config, only=names)
    check_layer_tensors(index, assignment)
    dtype = resolve_compute_dtype(assignment.compute_dtype, device)
    # each layer is quantized right after it loads (a no-op for fp16), so no 16-bit copy of the stage builds up;
    # int4 scales and the int8 kernel use fp16 where the device has no bf16
    prepare = functools.partial(quant.quantize_linears, mode=assignment.quant, group_size=assignment.group_size,
                                half_dtype=half_dtype(device))
    stage = Stage.load(config, index, start, end, dtype, device, prepare=prepare, progress=progress)
    return LoadedStage(stage, dtype, device, stage_weight_bytes(stage), time.perf_counter() - started)


class StageRuntime:
    """Runs RUN_PREFILL / RUN_DECODE for one loaded stage, keeping one request's cache."""

    def __init__(self, loaded: LoadedStage, attention_budget_bytes: int = DEFAULT_ATTENTION_BUDGET_BYTES):
        self.loaded = loaded
        self.attention_budget_bytes = attention_budget_bytes
        self.hidden_size = loaded.stage.config.hidden_size
        # A head asks for a cache of prompt + max_tokens positions, never more than the model's context: a
        # larger request is refused before it allocates anything.
        self.max_positions = loaded.stage.config.max_position_embeddings
        self.cache: KVCache | None = None

    def clear(self) -> None:
        self.cache = None

    def _check_hidden(self, hidden: torch.Tensor, length: int | None) -> str | None:
        if hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.shape[2] != self.hidden_size:
            return f"hidden state has shape {list(hidden.shape)}; expected [1, L, {self.hidden_size}]"
        if length is not None and hidden.shape[1] != length:
            return f"a decode step carries one position, not {hidden.shape[1]}"
        if hidden.shape[1] == 0:
            return "hidden state has no positions"
        return None

    def _run(self, hidden: torch.Tensor, position: int) -> HiddenState:
        assert self.cache is not None
        started = time.perf_counter()
        x = hidden.to(device=self.loaded.device, dtype=self.loaded.dtype)  # [1, L, hidden]
        length = x.shape[1]
        step = length if length == 1 else prefill_chunk_positions(
            self.loaded.stage.config.num_attention_heads, position + length, self.attention_budget_bytes)
        # the copies back also synchronise the device
        stage = self.loaded.stage
        parts = [stage(x[:, i:i + step], self.cache, position + i).to("cpu") for i in range(0, length, step)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [1, L, hidden]
        return HiddenState(hidden_state=out, compute_seconds=time.perf_counter() - started)

    def prefill(self, msg: RunPrefill) -> HiddenState | InferenceError:
        problem = self._check_hidden(msg.hidden_state, None)
        length = msg.hidden_state.shape[1] if problem is None else 0
        if problem is None and msg.cache_capacity > self.max_positions:
            problem = (f"cache_capacity {msg.cache_capacity} is over the model's context of {self.max_positions} "
                       "positions")
        if problem is None and msg.position_start + length > msg.cache_capacity:
            problem = f"{msg.position_start + length} positions do not fit cache_capacity {msg.cache_capacity}"
        if problem is None and msg.position_start != 0 and (self.cache is None or
                                                            self.cache.length != msg.position_start):
            problem = f"a prefill at position {msg.position_start} needs a cache holding exactly that many positions"
        if problem:
            return InferenceError(message=problem)
        if msg.position_start == 0:  # a new request: a fresh cache sized for it
            self.cache = self.loaded.stage.new_cache(msg.cache_capacity, self.loaded.dtype, self.loaded.device)
        return self._run(msg.hidden_state, msg.position_start)

    def decode(self, msg: RunDecode) -> HiddenState | InferenceError:
        problem = self._check_hidden(msg.hidden_state, 1)
        if problem is None and self.cache is None:
            problem = "RUN_DECODE before any RUN_PREFILL: there is no request in flight"
        if problem is None and msg.position != self.cache.length:
            problem = f"RUN_DECODE for position {msg.position}, but the cache holds {self.cache.length} positions"
        if problem:
            return InferenceError(message=problem)
        try:
            return self._run(msg.hidden_state, msg.position)
        except CacheFullError as exc:
            return InferenceError(message=str(exc))
