"""Tensors on the wire: a CBOR map ``{"dtype": "fp32"|"bf16"|"fp16", "shape": [ints], "data": bytes}``.

``data`` holds the elements in C order (row-major, contiguous), each in little-endian byte order, with no
padding: ``len(data) == prod(shape) * itemsize``. bf16 has no numpy dtype, so bytes are read from the tensor's
own memory (through ctypes, at its data pointer) and restored through torch (``torch.frombuffer``), never through a
numpy float dtype.

Copies, on purpose:
- ``tensor_to_wire`` copies nothing for a contiguous CPU tensor: ``data`` is a read-only view of the tensor's
  own memory, so the tensor must not change until the frame is sent. An accelerator or non-contiguous tensor is
  first copied to contiguous CPU memory, which the view then keeps alive.
- ``tensor_from_wire`` copies once, from the frame's bytes into a private bytearray that the returned tensor
  wraps. The tensor owns that memory, is writable, and never aliases the frame buffer, so it stays valid after
  the connection reuses its receive buffer for the next frame.
"""
from __future__ import annotations

import ctypes
import math
import sys
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


def tensor_to_wire(tensor: torch.Tensor) -> dict[str, Any]:
    """Encode a tensor as the wire map; ``data`` is a read-only memoryview (see the module doc on copies).

    Accepts any device and any strides (the tensor is moved to CPU and made contiguous when it is not already).

    Raises TypeError for a non-tensor, an unsupported dtype or a non-strided (sparse) layout, and ValueError for
    a rank over MAX_TENSOR_RANK.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    # Each of the tensor's attributes read once: this runs on every hop right after a stage's weights went through
    # the caches, where each call into torch costs tens of microseconds (bench/bench_protocol.py's cold columns).
    if tensor.layout is not torch.strided:
        raise TypeError(f"only dense (strided) tensors go on the wire, not {tensor.layout}")
    dtype, shape = tensor.dtype, list(tensor.shape)
    name = wire_dtype_name(dtype)
    if len(shape) > MAX_TENSOR_RANK:
        raise ValueError(f"tensors on the wire have at most {MAX_TENSOR_RANK} dimensions, got shape {tuple(shape)}")
    _require_little_endian()
    if not (tensor.is_cpu and tensor.is_contiguous()):
        tensor = tensor.detach().to("cpu").contiguous()
    # The element bytes straight from the tensor's memory, read through ctypes rather than a uint8 view and numpy
    # (for the same reason). The buffer holds the tensor, and the memoryview the buffer, so the memory stays alive
    # as long as the frame refers to it.
    buffer = (ctypes.c_ubyte * (math.prod(shape) * dtype.itemsize)).from_address(tensor.data_ptr())
    buffer.tensor = tensor
    data = memoryview(buffer).cast("B").toreadonly()  # [numel * itemsize]
    return {"dtype": name, "shape": shape, "data": data}


def tensor_from_wire(obj: Any) -> torch.Tensor:
    """Decode the wire map into a new contiguous CPU tensor that owns writable memory (one copy, no aliasing).

    ``data`` may be any bytes-like object (bytes, bytearray, memoryview). Raises ProtocolError when the map has
    other keys than dtype/shape/data, an unknown dtype name, a shape that is not a list of at most
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
    data = obj["data"]
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"tensor data must be a byte string, got {type(data).__name__}")
    dtype = WIRE_DTYPES[dtype_name]
    expected = math.prod(shape) * dtype.itemsize
    nbytes = data.nbytes if isinstance(data, memoryview) else len(data)
    if nbytes != expected:
        raise ProtocolError(f"tensor data holds {nbytes} bytes, but {dtype_name} of shape {shape} needs {expected}")
    _require_little_endian()
    if not expected:
        return torch.empty(shape, dtype=dtype)  # torch.frombuffer refuses an empty buffer
    # The single copy: the frame's bytes into a private bytearray, which the tensor then wraps (and keeps alive)
    # without copying again. A bytearray is writable, so torch raises no read-only-buffer warning.
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)  # [numel] -> shape
