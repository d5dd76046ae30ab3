"""A decode step through a stage's layers as one list of native calls on buffers kept from step to step.

Through the modules, one layer of a decode step runs about ten native kernels (norm.c, qdot.c or bf16dot.c,
attention.c, act.c) among some sixty Python and PyTorch operations around them: module calls, the checks that
choose each kernel, a fresh tensor for every output, views. With a stage's weights sweeping the caches every
step, that glue costs far more than its hot-loop time. Measured on a 2-core Sapphire Rapids VM, 12 demo layers
at 128 cached positions, the same kernels called by a plan and by the modules in turn, in one process: int4
7.7-8.0 ms a step against 9.7-12.4, int8 13.5-14.1 against 18.0-18.1, bf16 25.0-25.7 against 27.6-30.2, with
the same bits out (`python bench/profile_step.py` prints both as `step` and `modules`).

So where the small parts of every layer can take their native kernels for a step's rows (the kernels agree with
their references here: within a plan their alternative is the whole step through the modules, not one PyTorch
operator), the stage asks each module once for the calls it would make (`native_call(s)`, which share forward's
own test of what its kernel takes; a product without one, such as oneDNN's where a probe found it faster, is
called as a module), on buffers of the plan's own, and keeps them (`DecodePlan`). A step then copies the hidden
state and each row's rotary cos and sin in, points each layer's attention at every sequence's cache (rotary rows and
cache slots by address, since each tensor op costs tens of microseconds after the weights swept the caches), runs
the list and copies the result out (from and to a worker's received and sent bytes, `run_bytes`, no tensor op
at all): the bits of the modules taking the same kernels. Where a module's speed probe preferred
PyTorch's operator for its part, the plan's kernel differs from it as the kernel's own tests allow (the norm's
float32 sums in another order, the attention's softmax kept in float32 where SDPA rounds it to bf16). Where a part
cannot (an fp32 stage, a family's own norm or activation, a sliding window, more rows than the activation kernel
takes, a switch that sends a part to PyTorch), there is no plan and the modules run as before.

A plan holds raw addresses of the weights it was made for, so it is only used while the stage's layers, modules
and tensors are those it was made from, where they were (`DecodePlan.current`, ~75 µs a step for 12 layers):
replacing a layer, a module (quantizing one, packing one) or a weight, or moving one, after a plan was made makes
a new one (and drops the stage's other plans); a copied stage starts with no plans (`Plans`). Layers that
declined a kind of step are not asked again for it. A plan's buffers are its own, so a stage steps on one thread
at a time, as a worker's compute thread and the local pipeline step it.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from . import native

Index = int  # a layer's number in the checkpoint, the key of its cache slot


def _product_calls(linear: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[native.Call] | None:
    """The calls that write linear(x) into y: its native kernel's where it takes x, else the module itself (a plain
    Linear, oneDNN's PackedLinear, PyTorch's packed int kernels: what a probe found faster here); None where the
    module's widths are not the buffers'."""
    if getattr(linear, "in_features", None) != x.shape[-1] or getattr(linear, "out_features", None) != y.shape[-1]:
        return None
    make = getattr(linear, "native_calls", None)
    calls = None if make is None else make(x, y)
    return calls if calls is not None else [(_module_into, (linear, x, y), None)]


def _module_into(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    y.copy_(module(x))


def _sum_call(x: torch.Tensor, delta: torch.Tensor) -> native.Call:
    """x += delta, the residual stream's sum: the native kernel's call where it gives add_'s bits here (one call
    where add_ is a dispatch of tens of microseconds after the weights swept the caches), else add_ itself."""
    return native.sum_call(x, delta) or (torch.Tensor.add_, (x, delta), None)


def _address(tensor: torch.Tensor | None) -> int | None:
    """Where a tensor's data is: what a plan's calls took from it. (Its shape and dtype too would triple the cost
    of checking a plan before each step, ~75 µs for 12 demo layers; a tensor's data moves with them.)"""
    return None if tensor is None else tensor.data_ptr()


class Plans(dict):
    """A stage's plans by what their calls were chosen by. A copy of the stage (or a pickled one) starts empty:
    the plans' addresses are the original's tensors'."""

    def __deepcopy__(self, memo: dict) -> "Plans":
        return Plans()

    def __reduce__(self) -> tuple:
        return Plans, ()


class _Buffers:
    """What a step of `rows` decode rows writes, one tensor per role, reused by every layer in turn."""

    def __init__(self, rows: int, hidden: int, qkv: int, attended: int, inner: int, head_dim: int):
        def empty(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=torch.bfloat16)

        self.x = empty(rows, hidden)  # the residual stream, in and out of every layer
        self.normed = empty(rows, hidden)
        self.qkv = empty(rows, qkv)
        self.attended = empty(rows, attended)
        self.delta = empty(rows, hidden)  # o_proj's output, then down_proj's, each added to x
        self.gate_up = empty(rows, 2 * inner)
        self.act = empty(rows, inner)
        self.cos, self.sin = empty(rows, 1, head_dim), empty(rows, 1, head_dim)


class DecodePlan:
    """Native calls for steps of `rows` decode rows through `layers`: one position of a sequence each, where
    consecutive rows may be consecutive positions of one sequence (a draft: the attention stores every row's key
    and value before any row attends)."""

    def __init__(self, rows: int, buffers: _Buffers, calls: list[native.Call],
                 slots: list[tuple[Index, ctypes.Array]], positions: ctypes.Array, capacities: ctypes.Array,
                 parts: list[tuple[dict, str, object, int | None]]):
        self.rows = rows
        self._buffers = buffers
        self._calls = calls
        self._slots = slots  # each layer's cache addresses, one per row, filled for each step
        self._layer_ids = [index for index, _ in slots]  # a cache's layers, in its storage's order
        # what a step copies in and out by address or through one view: each tensor op of a step costs tens of
        # microseconds where the weights have just swept the caches
        self._x = buffers.x.view(1, rows, -1)
        x_bytes = (ctypes.c_ubyte * (buffers.x.numel() * 2)).from_address(buffers.x.data_ptr())  # self keeps x
        self._x_bytes = memoryview(x_bytes).cast("B")  # ... and run_bytes writes into it
        self._rotary_rows = buffers.cos.data_ptr(), buffers.sin.data_ptr()
        self._rotary_row_bytes = buffers.cos.shape[-1] * buffers.cos.element_size()
        self._positions, self._capacities = positions, capacities
        self._parts = parts  # (container, name, object, its data's address) of what the calls were made from

    @classmethod
    def make(cls, layers: torch.nn.ModuleDict, rows: int) -> "DecodePlan | None":
        """A plan for a stage's `layers` (qwen2.DecoderLayer by their numbers) and `rows` rows, or None where a
        layer is of another kind or its norms, attention or activation cannot take their native kernels for
        them."""
        from .qwen2 import MLP, DecoderLayer  # the layers this plan walks; qwen2 makes the plans

        if not len(layers) or native.kernels() is None:
            return None
        first = next(iter(layers.values()))
        if not isinstance(first, DecoderLayer):
            return None
        attn, mlp = first.self_attn, first.mlp
        if type(mlp) is not MLP:
            return None
        h, h_kv, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
        buffers = _Buffers(rows, attn.o_proj.out_features, (h + 2 * h_kv) * d, h * d,
                           mlp.down_proj.in_features, d)
        positions, capacities = (ctypes.c_int32 * rows)(), (ctypes.c_int32 * rows)()
        row_numbers = (ctypes.c_int32 * rows)(*range(rows))
        calls: list[native.Call] = []
        slots: list[tuple[Index, ctypes.Array]] = []
        parts: list[tuple[dict, str, object, int | None]] = [(layers._modules, key, layer, None)
                                                               for key, layer in layers.items()]
        b = buffers
        for key, layer in layers.items():
            index = int(key)
            layer_slots = (ctypes.c_int64 * rows)()
            made = cls._layer_calls(layer, b, layer_slots, positions, capacities, row_numbers, parts)
            if made is None:
                return None
            calls += made
            slots.append((index, layer_slots))
        return cls(rows, buffers, calls, slots, positions, capacities, parts)

    @staticmethod
    def _layer_calls(layer: torch.nn.Module, b: _Buffers, slots: ctypes.Array, positions: ctypes.Array,
                     capacities: ctypes.Array, row_numbers: ctypes.Array,
                     parts: list[tuple[dict, str, object, int | None]]) -> list[native.Call] | None:
        """One layer's calls: x + o_proj(attention(qkv_proj(norm(x)))), then + down_proj(act(gate_up(norm(x)))),
        each sum added into x in place (a + b and b + a round alike); None where a part declines."""
        from .qwen2 import MLP, DecoderLayer

        if type(layer) is not DecoderLayer or layer.sandwich or layer.parallel or type(layer.mlp) is not MLP:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        h, h_kv, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
        if attn.q_norm is not None or attn.rotates_wide or (h + 2 * h_kv) * d != b.qkv.shape[1] \
                or h * d != b.attended.shape[1] \
                or d != b.cos.shape[-1] or mlp.down_proj.in_features != b.act.shape[1]:
            return None
        kernels = attn._decode_kernels(b.qkv, planned=True)
        act_kernels = mlp._act_kernels(b.gate_up, planned=True)
        if kernels is None or act_kernels is None:
            return None
        pieces = [
            [layer.input_layernorm.native_call(b.x, b.normed)],
            _product_calls(attn.qkv_proj, b.normed, b.qkv),
            [kernels.decode_attention_call(b.qkv, b.attended, slots, positions, capacities, row_numbers,
                                           attn.n_heads, attn.n_kv_heads, attn.score_scale,
                                           (b.cos, b.sin) if attn.rotates else None)],
            _product_calls(attn.o_proj, b.attended, b.delta),
            [_sum_call(b.x, b.delta)],
            [layer.post_attention_layernorm.native_call(b.x, b.normed)],
            _product_calls(mlp.gate_up_proj, b.normed, b.gate_up),
            [act_kernels.silu_mul_call(b.gate_up, b.act)],
            _product_calls(mlp.down_proj, b.act, b.delta),
            [_sum_call(b.x, b.delta)],
        ]
        if any(p is None or None in p for p in pieces):
            return None
        for owner, names in ((layer, ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")),
                             (attn, ("qkv_proj", "o_proj")), (mlp, ("gate_up_proj", "down_proj"))):
            parts += [(owner._modules, name, owner._modules[name], None) for name in names]
        for module in (layer.input_layernorm, layer.post_attention_layernorm, attn.qkv_proj, attn.o_proj,
                       mlp.gate_up_proj, mlp.down_proj):
            if getattr(module, "native_calls", None) is None and getattr(module, "native_call", None) is None:
                continue  # called as a module: it reads its own tensors
            for tensors in (module._parameters, module._buffers):
                parts += [(tensors, name, t, _address(t)) for name, t in tensors.items()]
        return [call for p in pieces for call in p]

    def current(self) -> bool:
        """Whether every module and tensor the calls were made from is still in its place."""
        return all(owner.get(name) is thing and (address is None or thing.data_ptr() == address)
                   for owner, name, thing, address in self._parts)

    def run(self, hidden: torch.Tensor, caches: Sequence, positions: Sequence[int], rotary) -> torch.Tensor:
        """One step: hidden [1, rows, hidden] bf16, row i at positions[i] of caches[i] (bf16 KVCache of this
        stage's layers), rotated by `rotary` (rope.Rotary: its bf16 tables' rows) -> a new [1, rows, hidden].
        Raises CacheFullError where a position is past its cache, before anything is written there."""
        self._point(caches, positions, rotary)
        self._x.copy_(hidden)
        self._step()
        return self._x.clone()

    def run_bytes(self, hidden: bytes | bytearray | memoryview, caches: Sequence, positions: Sequence[int],
                  rotary) -> bytearray:
        """`run` on the rows' bf16 bytes (C order, as the wire carries them) -> the output rows' bytes: a hop's
        hidden state goes in and out without a tensor op (module doc). Raises CacheFullError as `run` does, and
        ValueError for bytes that are not the plan's rows."""
        if len(hidden) != len(self._x_bytes):
            raise ValueError(f"{len(hidden)} bytes of hidden state for a plan of {len(self._x_bytes)}")
        self._point(caches, positions, rotary)
        self._x_bytes[:] = hidden
        self._step()
        return bytearray(self._x_bytes)

    def _point(self, caches: Sequence, positions: Sequence[int], rotary) -> None:
        """Point the calls at each row's cache slots and copy in its rotary rows; raises CacheFullError (from
        KVCache.storage) before anything is written."""
        row = self._rotary_row_bytes
        cos_table, sin_table = rotary.table_addresses(max(positions) + 1, torch.bfloat16)
        cos_rows, sin_rows = self._rotary_rows
        for i, (cache, position) in enumerate(zip(caches, positions)):
            if cache.layer_ids != self._layer_ids:
                raise ValueError(f"a cache of layers {cache.layer_ids} for a plan of layers {self._layer_ids}")
            storage, layer_bytes = cache.storage(position)
            self._positions[i] = position
            self._capacities[i] = cache.capacity
            for ordinal, (_, slots) in enumerate(self._slots):
                slots[i] = storage + ordinal * layer_bytes
            ctypes.memmove(cos_rows + i * row, cos_table + position * row, row)
            ctypes.memmove(sin_rows + i * row, sin_table + position * row, row)

    def _step(self) -> None:
        native.run_calls(self._calls)
