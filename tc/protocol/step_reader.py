"""The two messages of every decode step, RUN_BATCH and HIDDEN_STATE, read from a payload in one pass.

messages.py reads any payload through its fields' kinds: a call per field, per struct, per tensor, each checking
one thing. That is the reference, and right for every other message. These two cross every hop of every step, and
each hop's receiver runs right after a stage's weights swept its caches, where every Python function it enters
costs microseconds before it does anything (a no-op call ~5 us cold against 0.1 us hot). Read through the kinds, a
decode step's RUN_BATCH payload took 133-151 us on cold caches (18 us hot); read here, in one function, 68-78 us
(5 us hot), on a 2-core AMD EPYC VM.

Each reader accepts only the common shape of its message (a decode or prefill batch without `copies`, numbers of
the exact type the encoder writes) and gives exactly what the reference gives for it: the same field values,
checked the same. Anything else, valid or not, returns None, and decode_body then reads the payload through the
reference, which builds the rarer forms and words every error. tests/test_step_reader.py holds the two to the same
answers.
"""
from __future__ import annotations

import math
import sys
from typing import Any

from tc.protocol.cbor import CBOR_INT_MAX
from tc.protocol.messages import BatchEntry, HiddenState, RunBatch
from tc.protocol.tensors import _ITEM_SIZES, _MAX_DIM, _TENSOR_KEYS, WireTensor

# The fields these readers know. A message that gains a field no longer matches them, so the reference reads it
# (and the test that compares these with the classes' fields fails until the reader learns it).
RUN_BATCH_FIELDS = frozenset(("entries", "hidden_state", "route", "upstream_seconds", "released"))
BATCH_ENTRY_FIELDS = frozenset(("sequence", "position_start", "length", "cache_capacity", "copies"))
HIDDEN_STATE_FIELDS = frozenset(("hidden_state", "compute_seconds", "upstream_seconds"))

# tensors.WireTensor.from_map refuses to read tensor bytes on a big-endian machine; the reference says so there.
_LITTLE_ENDIAN = sys.byteorder == "little"


def _new(cls: type, **values: Any) -> Any:
    """An instance of a frozen dataclass holding `values`, its fields checked already by the caller."""
    value = cls.__new__(cls)
    value.__dict__.update(values)
    return value


def _hidden(value: Any, rows: int | None) -> WireTensor | None:
    """A [1, rows, width] tensor map's WireTensor (any number of rows for rows=None); its bytes copied once."""
    if type(value) is not dict or value.keys() != _TENSOR_KEYS or not _LITTLE_ENDIAN:
        return None
    dtype, shape, data = value["dtype"], value["shape"], value["data"]
    if type(shape) is not list or len(shape) != 3 or type(data) is not memoryview or type(dtype) is not str:
        return None
    size = _ITEM_SIZES.get(dtype)
    batch, length, width = shape
    if (size is None or type(batch) is not int or batch != 1 or type(length) is not int or type(width) is not int
            or not 0 <= length <= _MAX_DIM or not 0 <= width <= _MAX_DIM
            or (rows is not None and length != rows) or data.nbytes != length * width * size):
        return None
    return _new(WireTensor, dtype=dtype, shape=(1, length, width), data=bytearray(data), source=None)


def _seconds(value: Any) -> tuple[float, ...] | None:
    """A list of durations as the encoder writes them (floats, finite, >= 0), as a tuple."""
    if type(value) is not list:
        return None
    for number in value:
        if type(number) is not float or not 0.0 <= number < math.inf:
            return None
    return tuple(value)


def read_run_batch(payload: Any) -> RunBatch | None:
    """The RUN_BATCH of `payload` when it has the common shape; None for the reference to read."""
    if type(payload) is not dict or payload.keys() != RUN_BATCH_FIELDS:
        return None
    raw_entries, route, released = payload["entries"], payload["route"], payload["released"]
    if type(raw_entries) is not list or not raw_entries or type(route) is not int or not 0 <= route <= CBOR_INT_MAX:
        return None
    entries = []
    sequences = set()
    rows = 0
    for entry in raw_entries:
        if type(entry) is not dict or entry.keys() != BATCH_ENTRY_FIELDS:
            return None
        sequence, start, length = entry["sequence"], entry["position_start"], entry["length"]
        capacity, copies = entry["cache_capacity"], entry["copies"]
        if (type(sequence) is not int or type(start) is not int or type(length) is not int
                or type(capacity) is not int or type(copies) is not list or copies
                or not 0 <= sequence <= CBOR_INT_MAX or start < 0 or length < 1
                or not start + length <= capacity <= CBOR_INT_MAX or sequence in sequences):
            return None
        sequences.add(sequence)
        rows += length
        entries.append(_new(BatchEntry, sequence=sequence, position_start=start, length=length,
                            cache_capacity=capacity, copies=()))
    if type(released) is not list:
        return None
    for sequence in released:
        if type(sequence) is not int or not 0 <= sequence <= CBOR_INT_MAX or sequence in sequences:
            return None
    upstream = _seconds(payload["upstream_seconds"])
    hidden = _hidden(payload["hidden_state"], rows)
    if upstream is None or hidden is None:
        return None
    return _new(RunBatch, entries=tuple(entries), hidden_state=hidden, route=route, upstream_seconds=upstream,
                released=tuple(released))


def read_hidden_state(payload: Any) -> HiddenState | None:
    """The HIDDEN_STATE of `payload` when it has the common shape; None for the reference to read."""
    if type(payload) is not dict or payload.keys() != HIDDEN_STATE_FIELDS:
        return None
    compute = payload["compute_seconds"]
    if type(compute) is not float or not 0.0 <= compute < math.inf:
        return None
    upstream = _seconds(payload["upstream_seconds"])
    hidden = _hidden(payload["hidden_state"], None)
    if upstream is None or hidden is None:
        return None
    return _new(HiddenState, hidden_state=hidden, compute_seconds=compute, upstream_seconds=upstream)


# by wire type: what decode_body tries before the reference
STEP_READERS = {RunBatch.TYPE: read_run_batch, HiddenState.TYPE: read_hidden_state}
