"""The two frames of every decode step, RUN_BATCH and HIDDEN_STATE, written and read in one pass over their bytes.

The general path turns a message into a payload map through its fields' kinds, the map into CBOR with a walk that
calls a function per item (cbor.py), and back the same way: a call per item, per field, per struct, per tensor.
That is the reference, and right for every other message. These two cross every hop of every step, and each hop's
sender and receiver run right after a stage's weights swept the caches, where every Python function entered costs
microseconds before it does anything (a no-op call ~5 us cold against 0.1 us hot). Here each direction is one
function that writes or reads the bytes in the order the frame holds them.

`write_step_frame` writes exactly the parts the general path writes (the same bytes, tensor data by reference the
same way), so a receiver cannot tell which wrote a frame. `read_step_body` accepts only the form that writer
writes for a step (fields in the writer's order, 8-byte floats, a [1, rows, width] tensor, no `copies`, no
`source`) and gives
exactly the Envelope the reference gives for it, checked the same; anything else, valid or not, returns None and
framing.decode_body reads the body through the reference, which reads the rarer forms and words every error.
tests/test_step_frames.py holds the two to the same bytes and the same answers.
"""
from __future__ import annotations

import math
import struct
import sys
from typing import Any

from tc.protocol.cbor import _ARGUMENT_SIZE, _FLOAT64, MAX_ITEMS, BytesLike, _Encoder, _head
from tc.protocol.messages import BatchEntry, HiddenState, RunBatch
from tc.protocol.tensors import _ITEM_SIZES, _MAX_DIM, WireTensor

# The fields these functions know, in the order the general path writes them (the order the classes declare
# them). A message that gains a field no longer matches, and the test comparing these with the classes fails.
RUN_BATCH_FIELDS = ("entries", "hidden_state", "route", "upstream_seconds", "released")
BATCH_ENTRY_FIELDS = ("sequence", "position_start", "length", "cache_capacity", "copies", "source")
HIDDEN_STATE_FIELDS = ("hidden_state", "compute_seconds", "upstream_seconds")
TENSOR_FIELDS = ("dtype", "shape", "data")

_FLOAT = struct.Struct(">Bd")  # a float as the general path writes it: 0xfb and 8 bytes
# tensors.WireTensor.from_map refuses to read tensor bytes on a big-endian machine; the reference says so there.
_LITTLE_ENDIAN = sys.byteorder == "little"


def _text(value: str) -> bytes:
    """A text string's CBOR (a map key, a type's name)."""
    data = value.encode("utf-8")
    head = bytearray()
    _head(head, 3, len(data))
    return bytes(head) + data


def _envelope_start(type_name: str) -> bytes:
    """The envelope's bytes up to the request id: its map head, "type" and the type's name, "request_id"."""
    return b"\xa4" + _text("type") + _text(type_name) + _text("request_id")


_RUN_BATCH_START = _envelope_start(RunBatch.TYPE)
_HIDDEN_STATE_START = _envelope_start(HiddenState.TYPE)
_SEQ = _text("seq")
_RUN_BATCH_PAYLOAD = _text("payload") + b"\xa5" + _text("entries")
_HIDDEN_STATE_PAYLOAD = _text("payload") + b"\xa3"
_ENTRY_SEQUENCE = b"\xa6" + _text("sequence")
_POSITION_START, _LENGTH, _CACHE_CAPACITY = _text("position_start"), _text("length"), _text("cache_capacity")
_COPIES = _text("copies")
_NO_COPIES = _COPIES + b"\x80"
_SOURCE = _text("source")
_NO_SOURCE = _SOURCE + b"\xf6"
_TENSOR_DTYPE = _text("hidden_state") + b"\xa3" + _text("dtype")
_SHAPE = _text("shape")
_RANK_3 = _SHAPE + b"\x83"
_DATA = _text("data")
_ROUTE, _UPSTREAM, _RELEASED = _text("route"), _text("upstream_seconds"), _text("released")
_COMPUTE = _text("compute_seconds")
_DTYPE_TEXT = {name: _text(name) for name in _ITEM_SIZES}  # each wire dtype's name, written once here

# The items of a frame as the reference counts them against cbor.MAX_ITEMS (every container's children: a map's
# keys and values, an array's elements), so that the reader refuses no less than it does and never builds
# millions of objects from one frame: the envelope's 4 pairs, the payload's pairs, the hidden state's 3 pairs and
# its shape of 3; then each entry (its place in the array and its 6 pairs), each time and each released sequence.
_FIXED_ITEMS = 2 * 4 + 2 * len(TENSOR_FIELDS) + 3
RUN_BATCH_ITEMS = _FIXED_ITEMS + 2 * len(RUN_BATCH_FIELDS)
HIDDEN_STATE_ITEMS = _FIXED_ITEMS + 2 * len(HIDDEN_STATE_FIELDS)
ENTRY_ITEMS = 1 + 2 * len(BATCH_ENTRY_FIELDS)


# ---------------------------------------------------------------------------------------------------------------
# Writing: the general path's bytes, field by field
# ---------------------------------------------------------------------------------------------------------------


def write_step_frame(message: RunBatch | HiddenState, request_id: str | None, seq: int,
                     reserve: int) -> list[BytesLike]:
    """The frame of `message` as framing.encode_frame_parts writes it: the parts of the envelope's CBOR, `reserve`
    bytes left at the start for the header, tensor data of cbor.BY_REFERENCE_BYTES or more by reference.

    The arguments are checked already: the message's fields by its class, `request_id` and `seq` by the caller.
    """
    encoder = _Encoder(reserve)
    out = encoder.out
    run_batch = type(message) is RunBatch
    out += _RUN_BATCH_START if run_batch else _HIDDEN_STATE_START
    if request_id is None:
        out.append(0xF6)
    else:
        data = request_id.encode("utf-8")
        _head(out, 3, len(data))
        out += data
    out += _SEQ
    _head(out, 0, seq)
    if run_batch:
        out += _RUN_BATCH_PAYLOAD
        _head(out, 4, len(message.entries))
        for entry in message.entries:
            out += _ENTRY_SEQUENCE
            _head(out, 0, entry.sequence)
            out += _POSITION_START
            _head(out, 0, entry.position_start)
            out += _LENGTH
            _head(out, 0, entry.length)
            out += _CACHE_CAPACITY
            _head(out, 0, entry.cache_capacity)
            if entry.copies:
                out += _COPIES
                _head(out, 4, len(entry.copies))
                for copy in entry.copies:
                    _head(out, 0, copy)
            else:
                out += _NO_COPIES
            if entry.source is None:
                out += _NO_SOURCE
            else:
                out += _SOURCE
                _head(out, 0, entry.source)
    else:
        out += _HIDDEN_STATE_PAYLOAD
    tensor = message.hidden_state
    out += _TENSOR_DTYPE
    out += _DTYPE_TEXT[tensor.dtype]
    out += _SHAPE
    _head(out, 4, len(tensor.shape))
    for size in tensor.shape:
        _head(out, 0, size)
    out += _DATA
    encoder._bytes(tensor.data)  # inline when small; else its own part, and the rest goes in a fresh one
    out = encoder.out
    if run_batch:
        out += _ROUTE
        _head(out, 0, message.route)
    else:
        out += _COMPUTE
        out += _FLOAT.pack(0xFB, message.compute_seconds)
    out += _UPSTREAM
    _head(out, 4, len(message.upstream_seconds))
    for seconds in message.upstream_seconds:
        out += _FLOAT.pack(0xFB, seconds)
    if run_batch:
        out += _RELEASED
        _head(out, 4, len(message.released))
        for sequence in message.released:
            _head(out, 0, sequence)
    return encoder.finish()


# ---------------------------------------------------------------------------------------------------------------
# Reading: the writer's form, or None for the reference
# ---------------------------------------------------------------------------------------------------------------


class _Declined(Exception):
    """Not the writer's form (or not valid at all): the reference reads it."""


def _read_head(view: memoryview, pos: int, major: int) -> tuple[int, int]:
    """The argument of the item head of `major` type at `pos` (an integer's value, a string's or an array's
    length), and the position after the head."""
    initial = view[pos] - (major << 5)
    if 0 <= initial < 24:
        return initial, pos + 1
    size = _ARGUMENT_SIZE.get(initial)
    end = pos + 1 + (size or 0)
    if size is None or end > len(view):
        raise _Declined
    return int.from_bytes(view[pos + 1:end], "big"), end


def _expect(view: memoryview, pos: int, literal: bytes) -> int:
    end = pos + len(literal)
    if view[pos:end] != literal:
        raise _Declined
    return end


def _read_seconds(view: memoryview, pos: int, items: int) -> tuple[tuple[float, ...], int, int]:
    """An array of durations as the writer writes them (8-byte floats, finite, >= 0), the position after it and
    the frame's items so far (`items` before it)."""
    count, pos = _read_head(view, pos, 4)
    items += count
    end = pos + 9 * count
    if end > len(view) or items > MAX_ITEMS:
        raise _Declined
    values = struct.unpack_from(">" + "Bd" * count, view, pos)
    seconds = values[1::2]
    if any(marker != 0xFB for marker in values[::2]) or not all(0.0 <= s < math.inf for s in seconds):
        raise _Declined
    return seconds, end, items


def read_step_body(body: memoryview) -> tuple[RunBatch | HiddenState, str | None, int] | None:
    """The message, request id and seq of a step frame's body (a byte view) in the writer's form; None for the
    reference to read.

    Everything it builds owns its bytes: the caller may reuse `body` as soon as this returns.
    """
    try:
        return _read(body)
    except (_Declined, IndexError, struct.error, UnicodeDecodeError):  # cut short, or not text: the reference says
        return None


def _new(cls: type, **values: Any) -> Any:
    """An instance of a frozen dataclass holding `values`, its fields checked already by the caller."""
    value = cls.__new__(cls)
    value.__dict__.update(values)
    return value


def _read(view: memoryview) -> tuple[RunBatch | HiddenState, str | None, int]:
    if view[:len(_RUN_BATCH_START)] == _RUN_BATCH_START:
        run_batch, pos = True, len(_RUN_BATCH_START)
    elif view[:len(_HIDDEN_STATE_START)] == _HIDDEN_STATE_START:
        run_batch, pos = False, len(_HIDDEN_STATE_START)
    else:
        raise _Declined
    if view[pos] == 0xF6:
        request_id, pos = None, pos + 1
    else:
        length, pos = _read_head(view, pos, 3)
        request_id, pos = str(view[pos:pos + length], "utf-8"), pos + length
    pos = _expect(view, pos, _SEQ)
    seq, pos = _read_head(view, pos, 0)

    rows = 0
    if run_batch:
        pos = _expect(view, pos, _RUN_BATCH_PAYLOAD)
        count, pos = _read_head(view, pos, 4)
        if not count:
            raise _Declined
        items = RUN_BATCH_ITEMS + ENTRY_ITEMS * count
        if items > MAX_ITEMS:  # past what the reference reads: its to refuse, before anything is built
            raise _Declined
        entries = []
        sequences = set()
        for _ in range(count):
            pos = _expect(view, pos, _ENTRY_SEQUENCE)
            sequence, pos = _read_head(view, pos, 0)
            pos = _expect(view, pos, _POSITION_START)
            start, pos = _read_head(view, pos, 0)
            pos = _expect(view, pos, _LENGTH)
            length, pos = _read_head(view, pos, 0)
            pos = _expect(view, pos, _CACHE_CAPACITY)
            capacity, pos = _read_head(view, pos, 0)
            pos = _expect(view, pos, _NO_COPIES)
            pos = _expect(view, pos, _NO_SOURCE)
            if length < 1 or start + length > capacity or sequence in sequences:
                raise _Declined
            sequences.add(sequence)
            rows += length
            entries.append(_new(BatchEntry, sequence=sequence, position_start=start, length=length,
                                cache_capacity=capacity, copies=(), source=None))
    else:
        pos = _expect(view, pos, _HIDDEN_STATE_PAYLOAD)
        items = HIDDEN_STATE_ITEMS

    # the hidden state: [1, rows, width]
    pos = _expect(view, pos, _TENSOR_DTYPE)
    length, pos = _read_head(view, pos, 3)
    dtype, pos = str(view[pos:pos + length], "utf-8"), pos + length
    size = _ITEM_SIZES.get(dtype)
    pos = _expect(view, pos, _RANK_3)
    batch, pos = _read_head(view, pos, 0)
    length, pos = _read_head(view, pos, 0)
    width, pos = _read_head(view, pos, 0)
    pos = _expect(view, pos, _DATA)
    if size is None or batch != 1 or length > _MAX_DIM or width > _MAX_DIM or (run_batch and length != rows):
        raise _Declined
    nbytes, pos = _read_head(view, pos, 2)
    stop = pos + nbytes
    if nbytes != length * width * size or stop > len(view) or not _LITTLE_ENDIAN:
        raise _Declined
    hidden = _new(WireTensor, dtype=dtype, shape=(1, length, width), data=bytearray(view[pos:stop]), source=None)
    pos = stop

    if run_batch:
        pos = _expect(view, pos, _ROUTE)
        route, pos = _read_head(view, pos, 0)
        pos = _expect(view, pos, _UPSTREAM)
        upstream, pos, items = _read_seconds(view, pos, items)
        pos = _expect(view, pos, _RELEASED)
        count, pos = _read_head(view, pos, 4)
        if items + count > MAX_ITEMS:
            raise _Declined
        released = []
        for _ in range(count):
            sequence, pos = _read_head(view, pos, 0)
            if sequence in sequences:
                raise _Declined
            released.append(sequence)
        message = _new(RunBatch, entries=tuple(entries), hidden_state=hidden, route=route,
                       upstream_seconds=upstream, released=tuple(released))
    else:
        pos = _expect(view, pos, _COMPUTE)
        if view[pos] != 0xFB:
            raise _Declined
        compute = _FLOAT64.unpack_from(view, pos + 1)[0]
        if not 0.0 <= compute < math.inf:
            raise _Declined
        pos = _expect(view, pos + 9, _UPSTREAM)
        upstream, pos, _ = _read_seconds(view, pos, items)
        message = _new(HiddenState, hidden_state=hidden, compute_seconds=compute, upstream_seconds=upstream)
    if pos != len(view):
        raise _Declined
    return message, request_id, seq
