"""Tensors on the wire: a CBOR map ``{"dtype": "fp32"|"bf16"|"fp16", "shape": [ints], "data": bytes}``.

``data`` holds the elements in C order (row-major, contiguous), each in little-endian byte order, with no
padding: ``len(data) == prod(shape) * itemsize``. bf16 has no numpy dtype, so bytes are read from the tensor's
own memory (through ctypes, at its data pointer) and restored through torch (``torch.frombuffer``), never through a
numpy float dtype.

Messages carry a tensor as a ``WireTensor``: that map's three fields as Python values, with no torch tensor made
on the way in. A decode step's hidden state then goes from the received frame into a stage's own buffer and back
out as bytes (see qwen2.Stage.decode_wire): on a hop, right after a stage's weights swept the caches, each call
into torch costs tens of microseconds: making a tensor of a received row, checking the output, reading it back
for the next frame and the stage's copies in and out took 150-200 us of each hop on a 2-core Sapphire Rapids VM
(bench/trace_hops.py, 0.93-1.01 ms a hop before, 0.73-0.86 after). Code that computes with one asks for
``WireTensor.tensor()``.

Copies, on purpose:
- ``WireTensor.of`` (and ``tensor_to_wire``) copies nothing for a contiguous CPU tensor: ``data`` is a read-only
  view of the tensor's own memory, so the tensor must not change until the frame is sent. An accelerator or
  non-contiguous tensor is first copied to contiguous CPU memory, which the view then keeps alive.
- ``WireTensor.from_map`` copies once, from the frame's bytes into a private bytearray, which ``tensor()`` then
  wraps without copying again. That memory is the WireTensor's own, writable, and never aliases the frame
  buffer, so it stays valid after the connection reuses its receive buffer for the next frame.
"""
from __future__ import annotations

import ctypes
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch

from tc.protocol.errors import ProtocolError

# Wire names are the same words the topology file uses for compute dtypes.
WIRE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
_NAME_OF_DTYPE: dict[torch.dtype, str] = {dtype: name for name, dtype in WIRE_DTYPES.items()}
_ITEM_SIZES: dict[str, int] = {name: dtype.itemsize for name, dtype in WIRE_DTYPES.items()}

# Hidden states are [batch, seq, hidden]; one spare dimension leaves room without inviting abuse.
MAX_TENSOR_RANK = 4

_TENSOR_KEYS = frozenset(("dtype", "shape", "data"))

# torch sizes are int64; a zero-size tensor could otherwise name a dimension torch cannot even represent.
_MAX_DIM = 2**63 - 1


def _require_little_endian() -> None:
    # The wire is little-endian and we copy raw element bytes; every platform tc targets (x86-64, arm64) is
    # little-endian, so a big-endian host is refused rather than silently byte-swapped.
    if sys.byteorder != "little":
        raise RuntimeError("tc's wire protocol needs a little-endian host; this one is big-endian")


def wire_dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype. Raises TypeError for dtypes the protocol does not carry."""
    try:
        return _NAME_OF_DTYPE[dtype]
    except KeyError:
        raise TypeError(
            f"tensors on the wire must be float32, bfloat16 or float16, not {dtype}; cast with .to(...) first"
        ) from None


@dataclass(frozen=True, eq=False)
class WireTensor:
    """A tensor in the wire's form: its dtype's wire name, its shape, and its element bytes (module doc)."""

    dtype: str  # a key of WIRE_DTYPES
    shape: tuple[int, ...]
    data: bytearray | memoryview  # [prod(shape) * itemsize]: a received tensor's own bytes, or a view of a tensor
    source: torch.Tensor | None = None  # the tensor `data` views, for one made by `of`

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "WireTensor":
        """A tensor's wire form, viewing its memory (see the module doc on copies).

        Accepts any device and any strides (the tensor is moved to CPU and made contiguous when it is not
        already). Raises TypeError for a non-tensor, an unsupported dtype or a non-strided (sparse) layout, and
        ValueError for a rank over MAX_TENSOR_RANK.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        # Each of the tensor's attributes read once: this runs on the head's every step (module doc).
        if tensor.layout is not torch.strided:
            raise TypeError(f"only dense (strided) tensors go on the wire, not {tensor.layout}")
        dtype, shape = tensor.dtype, tuple(tensor.shape)
        name = wire_dtype_name(dtype)
        if len(shape) > MAX_TENSOR_RANK:
            raise ValueError(f"tensors on the wire have at most {MAX_TENSOR_RANK} dimensions, got shape {shape}")
        _require_little_endian()
        if not (tensor.is_cpu and tensor.is_contiguous()):
            tensor = tensor.detach().to("cpu").contiguous()
        return cls(name, shape, memory_view(tensor.data_ptr(), math.prod(shape) * dtype.itemsize, tensor), tensor)

    @classmethod
    def from_map(cls, obj: Any) -> "WireTensor":
        """The wire map's tensor, its bytes copied once into memory of its own (no aliasing of ``obj``).

        ``data`` may be any bytes-like object (bytes, bytearray, memoryview). Raises ProtocolError when the map
        has other keys than dtype/shape/data, an unknown dtype name, a shape that is not a list of at most
        MAX_TENSOR_RANK non-negative ints, or a data length other than numel * itemsize.
        """
        if not isinstance(obj, dict):
            raise ProtocolError(f"a tensor must be a map with keys dtype, shape, data; got {type(obj).__name__}")
        if obj.keys() != _TENSOR_KEYS:
            got = sorted(map(str, obj.keys()))
            raise ProtocolError(f"a tensor map has exactly the keys ['data', 'dtype', 'shape']; got {got}")
        dtype_name = obj["dtype"]
        if not isinstance(dtype_name, str) or dtype_name not in WIRE_DTYPES:
            raise ProtocolError(f"tensor dtype must be one of {sorted(WIRE_DTYPES)}, got {dtype_name!r}")
        shape = obj["shape"]
        if not isinstance(shape, list) or not all(type(dim) is int and 0 <= dim <= _MAX_DIM for dim in shape):
            raise ProtocolError(f"tensor shape must be a list of non-negative ints, got {shape!r}")
        if len(shape) > MAX_TENSOR_RANK:
            raise ProtocolError(f"tensor rank {len(shape)} is over the limit of {MAX_TENSOR_RANK} (shape {shape})")
        # torch's strides are products of the later dimensions (an empty one counted as 1), in int64: an empty
        # tensor's bytes match any other dimensions, so only this keeps such a shape from failing in .tensor()
        if math.prod(max(dim, 1) for dim in shape) > _MAX_DIM:
            raise ProtocolError(f"tensor shape {shape} is past what torch can lay out (its strides overflow 64 bits)")
        data = obj["data"]
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ProtocolError(f"tensor data must be a byte string, got {type(data).__name__}")
        expected = math.prod(shape) * _ITEM_SIZES[dtype_name]
        nbytes = data.nbytes if isinstance(data, memoryview) else len(data)
        if nbytes != expected:
            raise ProtocolError(f"tensor data holds {nbytes} bytes, but {dtype_name} of shape {shape} needs "
                                f"{expected}")
        _require_little_endian()
        return cls(dtype_name, tuple(shape), bytearray(data))  # the single copy

    @property
    def torch_dtype(self) -> torch.dtype:
        return WIRE_DTYPES[self.dtype]

    def to_map(self) -> dict[str, Any]:
        """The CBOR-ready wire map; ``data`` by reference, so the bytes must not change until it is sent."""
        return {"dtype": self.dtype, "shape": list(self.shape), "data": self.data}

    def tensor(self) -> torch.Tensor:
        """A CPU tensor of these bytes: the tensor it was made of, else one wrapping the WireTensor's own memory
        (no copy: writing to it writes to `data`)."""
        if self.source is not None:
            return self.source
        if not len(self.data):
            return torch.empty(self.shape, dtype=self.torch_dtype)  # torch.frombuffer refuses an empty buffer
        # a bytearray is writable, so torch raises no read-only-buffer warning
        return torch.frombuffer(self.data, dtype=self.torch_dtype).reshape(self.shape)

    def __eq__(self, other: object) -> bool:
        """The same dtype, shape and bytes (bit for bit: a NaN equals its own bits)."""
        if not isinstance(other, WireTensor):
            return NotImplemented
        return self.dtype == other.dtype and self.shape == other.shape and self.data == other.data

    __hash__ = None  # type: ignore[assignment]  (mutable bytes)

    def __repr__(self) -> str:  # logs want the shape, not hundreds of numbers
        return f"<tensor {self.dtype} {list(self.shape)}>"


def memory_view(address: int, nbytes: int, owner: object) -> memoryview:
    """A read-only byte view of `nbytes` of memory at `address`, keeping `owner` (what holds that memory) alive
    as long as the view is. Read through ctypes, not a uint8 tensor and numpy: bf16 has no numpy dtype, and each
    torch call counts on a hop."""
    buffer = (ctypes.c_ubyte * nbytes).from_address(address)
    buffer.owner = owner
    return memoryview(buffer).cast("B").toreadonly()


def tensor_to_wire(tensor: torch.Tensor) -> dict[str, Any]:
    """Encode a tensor as the wire map (``WireTensor.of``'s: ``data`` is a read-only view of its memory). Raises
    as ``WireTensor.of`` does."""
    return WireTensor.of(tensor).to_map()


def tensor_from_wire(obj: Any) -> torch.Tensor:
    """Decode the wire map into a new contiguous CPU tensor that owns writable memory (one copy, no aliasing).
    Raises ProtocolError as ``WireTensor.from_map`` does."""
    return WireTensor.from_map(obj).tensor()
