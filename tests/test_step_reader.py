"""The one-pass readers of a decode step's messages (tc/protocol/step_reader.py) against the reference reading of
messages.py: the same message for every payload they accept, and nothing for any payload the reference refuses."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tc.protocol import BatchEntry, HiddenState, ProtocolError, RunBatch, decode_body, encode_body
from tc.protocol.cbor import decode_cbor
from tc.protocol.step_reader import (
    BATCH_ENTRY_FIELDS,
    HIDDEN_STATE_FIELDS,
    RUN_BATCH_FIELDS,
    STEP_READERS,
    read_hidden_state,
    read_run_batch,
)
from tc.protocol.tensors import WireTensor

GEN = torch.Generator().manual_seed(0)


def hidden(rows: int, width: int = 8, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(1, rows, width, generator=GEN).to(dtype)


def entry(sequence: int, start: int = 0, length: int = 1, capacity: int = 64, copies: tuple = ()) -> BatchEntry:
    return BatchEntry(sequence=sequence, position_start=start, length=length, cache_capacity=capacity, copies=copies)


# The forms a running cluster sends: decode steps of one or many sequences, prefill chunks, a mixed batch, passed
# on under a route with the stages' times, with sequences released, in each wire dtype.
COMMON = {
    "decode step": RunBatch(entries=(entry(3, 17),), hidden_state=hidden(1)),
    "prefill chunk": RunBatch(entries=(entry(0, 0, 7, 32),), hidden_state=hidden(7, dtype=torch.float32)),
    "batch of decode rows": RunBatch(entries=tuple(entry(s, 5 + s) for s in range(4)), hidden_state=hidden(4)),
    "prefill beside decode": RunBatch(entries=(entry(1, 9), entry(2, 0, 5, 5)), hidden_state=hidden(6)),
    "passed on": RunBatch(entries=(entry(2**64 - 1, 2**64 - 3, 2, 2**64 - 1),), hidden_state=hidden(2),
                          route=2**64 - 1, upstream_seconds=(0.004, 0.0, 1e300), released=(0, 7)),
    "fp16 rows": RunBatch(entries=(entry(8, 1),), hidden_state=hidden(1, dtype=torch.float16), released=(9,)),
    "no width": RunBatch(entries=(entry(8, 1),), hidden_state=hidden(1, width=0)),
    "answer": HiddenState(hidden_state=hidden(1), compute_seconds=0.0125),
    "answer passed on": HiddenState(hidden_state=hidden(3, dtype=torch.float16), compute_seconds=0.0,
                                    upstream_seconds=(0.25, 1e-9)),
    "empty answer": HiddenState(hidden_state=hidden(0, dtype=torch.float32), compute_seconds=2.5),
}

# Valid, but rarer than the readers take: the reference reads them.
RARER = {
    "a prompt read once for several choices": RunBatch(entries=(entry(1, 0, 4, 8, copies=(2, 3)),),
                                                        hidden_state=hidden(4)),
    "an answer of several batch rows": HiddenState(hidden_state=torch.zeros(2, 1, 4), compute_seconds=0.5),
}


def payload_of(message: RunBatch | HiddenState) -> Any:
    """The payload as decode_body meets it: decoded from the frame, byte strings as views of the body."""
    return decode_cbor(encode_body(message))["payload"]


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types all the way down (a float's sign and NaN bits included)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (RunBatch, HiddenState, BatchEntry)):
        return vars(a).keys() == vars(b).keys() and all(same(vars(a)[name], vars(b)[name]) for name in vars(a))
    if isinstance(a, WireTensor):
        return (a.dtype == b.dtype and same(a.shape, b.shape) and type(a.data) is type(b.data)
                and bytes(a.data) == bytes(b.data) and a.source is None and b.source is None)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return math.copysign(1.0, a) == math.copysign(1.0, b) and (a == b or (math.isnan(a) and math.isnan(b)))
    return a == b


def reference(payload: Any, cls: type) -> RunBatch | HiddenState | ProtocolError:
    try:
        return cls.from_payload(payload)
    except ProtocolError as exc:
        return exc


def test_the_readers_know_every_field_of_their_messages():
    # a field added to a message and not to its reader would send every such payload to the reference
    assert RUN_BATCH_FIELDS == RunBatch._wire_names
    assert BATCH_ENTRY_FIELDS == BatchEntry._wire_names
    assert HIDDEN_STATE_FIELDS == HiddenState._wire_names
    assert STEP_READERS == {"RUN_BATCH": read_run_batch, "HIDDEN_STATE": read_hidden_state}


@pytest.mark.parametrize("name", COMMON)
def test_a_common_payload_is_read_in_one_pass_to_what_the_reference_reads(name):
    message = COMMON[name]
    payload = payload_of(message)
    read = STEP_READERS[message.TYPE](payload)
    assert read is not None, "the one-pass reader declined a form every step sends"
    assert same(read, type(message).from_payload(payload_of(message)))
    assert read.hidden_state.tensor().equal(message.hidden_state.tensor())
    # and decode_body, which tries the reader first, gives the same
    envelope = decode_body(encode_body(message, "req-1", 9))
    assert same(envelope.message, read) and (envelope.request_id, envelope.seq) == ("req-1", 9)


@pytest.mark.parametrize("name", ["decode step", "answer"])
def test_what_the_reader_builds_owns_its_bytes(name):
    body = bytearray(encode_body(COMMON[name]))
    message = decode_body(memoryview(body)).message
    before = bytes(message.hidden_state.data)
    body[:] = bytes(len(body))  # the connection reuses its buffer for the next frame
    assert bytes(message.hidden_state.data) == before


@pytest.mark.parametrize("name", RARER)
def test_a_rarer_payload_goes_to_the_reference(name):
    message = RARER[name]
    payload = payload_of(message)
    assert STEP_READERS[message.TYPE](payload) is None
    assert same(decode_body(encode_body(message)).message, type(message).from_payload(payload_of(message)))


def test_numbers_of_another_type_than_the_encoders_go_to_the_reference():
    payload = payload_of(COMMON["answer"])
    payload["compute_seconds"] = 2  # an int: the reference takes it as 2.0
    assert read_hidden_state(payload) is None
    assert same(HiddenState.from_payload(payload).compute_seconds, 2.0)


def _changed(name: str, *changes: tuple[tuple, Any]) -> Any:
    payload = _deep_copy(payload_of(COMMON[name]))
    for path, value in changes:
        parent = payload
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = value
    return payload


# One place of a common payload changed so that it breaks a rule across fields, or a number's range
REFUSED = {
    "a sequence twice": ("batch of decode rows", (("entries", 2, "sequence"), 0)),
    "a running sequence released": ("passed on", (("released", 1), 2**64 - 1)),
    "positions past the cache": ("prefill beside decode", (("entries", 1, "cache_capacity"), 4)),
    "a cache past CBOR's integers": ("decode step", (("entries", 0, "cache_capacity"), 2**64)),
    "a route past CBOR's integers": ("decode step", (("route",), 2**64)),
    "rows the entries do not have": ("batch of decode rows", (("hidden_state", "shape", 1), 3)),
    "a batch of two": ("decode step", (("hidden_state", "shape", 0), 2)),
    "a negative time": ("passed on", (("upstream_seconds", 1), -1.0)),
    "an endless time": ("passed on", (("upstream_seconds", 2), math.inf)),
    "a NaN time": ("answer passed on", (("upstream_seconds", 0), math.nan)),
    "a NaN compute time": ("answer", (("compute_seconds",), math.nan)),
    "a flag for a dimension": ("decode step", (("hidden_state", "shape", 0), True)),
    "a float for a length": ("decode step", (("entries", 0, "length"), 1.0)),
    "an entry shorter than its rows": ("prefill chunk", (("entries", 0, "length"), 0)),
    "too few bytes": ("decode step", (("hidden_state", "data"), memoryview(bytes(15)))),
    "an unknown dtype": ("answer", (("hidden_state", "dtype"), "int8")),
    "an entry of no rows": ("no width", (("entries", 0, "length"), 0), (("hidden_state", "shape", 1), 0)),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_payload_the_reference_refuses_is_left_to_it(case):
    name, *changes = REFUSED[case]
    payload = _changed(name, *changes)
    cls = type(COMMON[name])
    assert isinstance(reference(payload, cls), ProtocolError)
    assert STEP_READERS[cls.TYPE](payload) is None


def _paths(value: Any, path: tuple = ()) -> list[tuple]:
    """Every place in a decoded payload: the path of keys and indices to it (the root is the empty path)."""
    found = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, path + (index,))
    return found


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _deep_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_deep_copy(item) for item in value]
    return value  # scalars, and byte strings (views the readers never change)


WIRE_VALUES = st.recursive(
    st.one_of(
        st.none(), st.booleans(),
        st.integers(min_value=-(2**64), max_value=2**64 - 1),
        st.sampled_from([0, 1, 2, 3, 5, 7, 8, 16, 17, 64, 2**63 - 1, 2**63, 2**64 - 1, -1]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([0.0, -0.0, 1.0, 0.5, math.inf, -math.inf, math.nan]),
        st.text(max_size=6), st.sampled_from(["bf16", "fp16", "fp32", "int8", "dtype", "shape", "data"]),
        st.binary(max_size=40).map(memoryview),
    ),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(COMMON)), st.data())
def test_a_changed_payload_is_read_as_the_reference_reads_it_or_left_to_it(name, data):
    """Replace any one place of a common payload with any wire value, drop a key or add one: whatever the readers
    accept, the reference accepts as the same message; whatever the reference refuses, they leave to it."""
    message = COMMON[name]
    cls = type(message)
    payload = _deep_copy(payload_of(message))
    path = data.draw(st.sampled_from(_paths(payload)), label="path")
    change = data.draw(st.sampled_from(["replace", "drop", "add"]), label="change")
    parent = payload
    for key in path[:-1]:
        parent = parent[key]
    if not path:
        payload = data.draw(WIRE_VALUES, label="payload")
    elif change == "replace":
        parent[path[-1]] = data.draw(WIRE_VALUES, label="value")
    elif change == "drop":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[data.draw(st.text(max_size=15), label="key")] = data.draw(WIRE_VALUES, label="value")
    else:
        parent.append(data.draw(WIRE_VALUES, label="value"))
    read = STEP_READERS[cls.TYPE](payload)
    expected = reference(payload, cls)
    if isinstance(expected, ProtocolError):
        assert read is None, f"the reader accepted what the reference refuses ({expected})"
    elif read is not None:
        assert same(read, expected)
