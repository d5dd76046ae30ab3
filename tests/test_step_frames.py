"""A decode step's frames written and read in one pass (tc/protocol/step_frames.py) against the reference path of
framing.py (the envelope map through cbor.py, the payload through the fields' kinds): the same bytes written, the
same envelope read for every body the reader accepts, and nothing for any body the reference refuses."""
from __future__ import annotations

import math
import struct
import tracemalloc
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tc.protocol import BatchEntry, HiddenState, ProtocolError, RunBatch, decode_body, encode_body
from tc.protocol.cbor import MAX_ITEMS, decode_cbor, encode_cbor
from tc.protocol.framing import Envelope, decode_envelope
from tc.protocol.step_frames import (
    BATCH_ENTRY_FIELDS,
    HIDDEN_STATE_FIELDS,
    RUN_BATCH_FIELDS,
    TENSOR_FIELDS,
    read_step_body,
)
from tc.protocol.tensors import WireTensor

GEN = torch.Generator().manual_seed(0)


def hidden(rows: int, width: int = 8, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(1, rows, width, generator=GEN).to(dtype)


def entry(sequence: int, start: int = 0, length: int = 1, capacity: int = 64, copies: tuple = (),
          source: int | None = None) -> BatchEntry:
    return BatchEntry(sequence=sequence, position_start=start, length=length, cache_capacity=capacity, copies=copies,
                      source=source)


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
    "a long prefill": RunBatch(entries=(entry(300, 0, 40, 4096),), hidden_state=hidden(40, width=896),
                               upstream_seconds=(0.5,)),
    "many sequences": RunBatch(entries=tuple(entry(s, 1000 + s, 1, 70000) for s in range(30)),
                               hidden_state=hidden(30), released=tuple(range(100, 130))),
    "answer": HiddenState(hidden_state=hidden(1), compute_seconds=0.0125),
    "answer passed on": HiddenState(hidden_state=hidden(3, dtype=torch.float16), compute_seconds=0.0,
                                    upstream_seconds=(0.25, 1e-9)),
    "empty answer": HiddenState(hidden_state=hidden(0, dtype=torch.float32), compute_seconds=2.5),
    "a long answer": HiddenState(hidden_state=hidden(40, width=896, dtype=torch.float32), compute_seconds=0.5),
}

# The envelopes around them: no request id, a long one, one beyond ASCII; seqs of each integer width.
ENVELOPES = [(None, 0), ("req-1", 9), ("chatcmpl-" + "9f" * 20, 70000), ("réq-✓", 2**32), ("", 2**64 - 1)]

# Valid, but rarer than the reader takes: the reference reads them.
RARER = {
    "a prompt read once for several choices": RunBatch(entries=(entry(1, 0, 4, 8, copies=(2, 3)),),
                                                        hidden_state=hidden(4)),
    "prompts that start from kept caches": RunBatch(entries=(entry(4, 30, 3, 40, source=2),
                                                             entry(5, 12, 2, 20, source=5)), hidden_state=hidden(5)),
    "an answer of several batch rows": HiddenState(hidden_state=torch.zeros(2, 1, 4), compute_seconds=0.5),
}


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types all the way down (a float's sign and NaN bits included)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (Envelope, RunBatch, HiddenState, BatchEntry)):
        return vars(a).keys() == vars(b).keys() and all(same(vars(a)[name], vars(b)[name]) for name in vars(a))
    if isinstance(a, WireTensor):
        return (a.dtype == b.dtype and same(a.shape, b.shape) and type(a.data) is type(b.data)
                and bytes(a.data) == bytes(b.data) and a.source is None and b.source is None)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return math.copysign(1.0, a) == math.copysign(1.0, b) and (a == b or (math.isnan(a) and math.isnan(b)))
    return a == b


def reference(body: bytes) -> Envelope | ProtocolError:
    try:
        return decode_envelope(body)
    except ProtocolError as exc:
        return exc


def read(body: bytes) -> Envelope | None:
    step = read_step_body(memoryview(body))
    return None if step is None else Envelope(*step)


def body_of(envelope_map: dict) -> bytes:
    return encode_cbor(envelope_map)


def envelope_map(message: RunBatch | HiddenState, request_id: str | None = "req-1", seq: int = 9) -> dict:
    """The envelope as the reference decodes it from the frame: byte strings as views of the body."""
    return decode_cbor(encode_body(message, request_id, seq))


def test_the_frames_know_every_field_of_their_messages_in_order():
    # a field added to a message and not here would send every such frame to the reference; a field moved would
    # make the writer's bytes differ from the general path's (tests/test_protocol.py checks those too)
    assert RUN_BATCH_FIELDS == tuple(name for name, _ in RunBatch._wire_fields)
    assert BATCH_ENTRY_FIELDS == tuple(name for name, _ in BatchEntry._wire_fields)
    assert HIDDEN_STATE_FIELDS == tuple(name for name, _ in HiddenState._wire_fields)
    assert TENSOR_FIELDS == tuple(WireTensor.of(hidden(1)).to_map())


@pytest.mark.parametrize("request_id, seq", ENVELOPES)
@pytest.mark.parametrize("name", COMMON)
def test_a_common_frame_is_read_in_one_pass_to_what_the_reference_reads(name, request_id, seq):
    message = COMMON[name]
    body = encode_body(message, request_id, seq)
    got = read(body)
    assert got is not None, "the one-pass reader declined a form every step sends"
    assert same(got, reference(body))
    assert (got.request_id, got.seq) == (request_id, seq)
    assert got.message.hidden_state.tensor().equal(message.hidden_state.tensor())
    assert same(decode_body(body), got)  # decode_body tries the reader first
    assert same(decode_body(memoryview(bytearray(body))), got)  # ... on a view of a buffer, as a connection has it


@pytest.mark.parametrize("name", ["decode step", "answer"])
def test_what_the_reader_builds_owns_its_bytes(name):
    body = bytearray(encode_body(COMMON[name]))
    message = decode_body(memoryview(body)).message
    before = bytes(message.hidden_state.data)
    body[:] = bytes(len(body))  # the connection reuses its buffer for the next frame
    assert bytes(message.hidden_state.data) == before


@pytest.mark.parametrize("name", RARER)
def test_a_rarer_frame_goes_to_the_reference(name):
    body = encode_body(RARER[name], "req-1", 9)
    assert read(body) is None
    assert same(decode_body(body), reference(body))


def test_other_frames_go_to_the_reference():
    from tc.protocol import Ping
    body = encode_body(Ping(7))
    assert read(body) is None and decode_body(body).message == Ping(7)


def test_a_body_in_another_valid_form_is_read_as_the_reference_reads_it_or_left_to_it():
    """CBOR that the writer would not write but the reference reads: the same answer, or None."""
    base = envelope_map(COMMON["answer"])
    forms = [
        dict(base, payload=dict(base["payload"], compute_seconds=2)),  # an int for a time
        # ints as wide as a float: read as floats, the reader must not take their 8 bytes for a float's
        dict(base, payload=dict(base["payload"], compute_seconds=2**40)),
        dict(base, payload=dict(base["payload"], upstream_seconds=[0.5, 2**40])),
        {key: base[key] for key in ("seq", "type", "request_id", "payload")},  # the keys in another order
    ]
    bodies = [body_of(form) for form in forms]
    halves = body_of(dict(base, payload=dict(base["payload"], compute_seconds=0.5)))
    bodies.append(halves.replace(b"\xfb" + struct.pack(">d", 0.5), b"\xf9" + struct.pack(">e", 0.5)))  # 2 bytes
    canonical = encode_body(COMMON["answer"], "req-1", 9)
    bodies.append(canonical.replace(b"\x63seq\x09", b"\x63seq\x1b" + (9).to_bytes(8, "big")))  # seq in 8 bytes
    assert len(set(bodies)) == len(bodies) == 6 and canonical not in bodies
    for body in bodies:
        expected = reference(body)
        assert not isinstance(expected, ProtocolError)
        got = read(body)
        assert got is None or same(got, expected)
        assert same(decode_body(body), expected)


def _changed(name: str, *changes: tuple[tuple, Any]) -> bytes:
    envelope = _deep_copy(envelope_map(COMMON[name]))
    for path, value in changes:
        parent = envelope["payload"]
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = value
    return body_of(envelope)


# One place of a common payload changed so that it breaks a rule across fields, or a number's range
REFUSED = {
    "a sequence twice": ("batch of decode rows", (("entries", 2, "sequence"), 0)),
    "a running sequence released": ("passed on", (("released", 1), 2**64 - 1)),
    "positions past the cache": ("prefill beside decode", (("entries", 1, "cache_capacity"), 4)),
    "a cache past CBOR's integers": ("decode step", (("entries", 0, "cache_capacity"), -1)),
    "a negative route": ("decode step", (("route",), -1)),
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
    "no entries": ("decode step", (("entries",), []), (("hidden_state", "shape", 1), 0),
                   (("hidden_state", "data"), memoryview(b""))),
    "a dimension torch cannot hold": ("empty answer", (("hidden_state", "shape", 2), 2**63)),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_frame_the_reference_refuses_is_left_to_it(case):
    name, *changes = REFUSED[case]
    body = _changed(name, *changes)
    assert isinstance(reference(body), ProtocolError)
    assert read(body) is None


@pytest.mark.parametrize("name", ["decode step", "passed on", "answer passed on"])
def test_a_cut_or_lengthened_frame_is_left_to_the_reference(name):
    body = encode_body(COMMON[name], "req-1", 9)
    for cut in range(len(body)):
        assert read(body[:cut]) is None, f"read a body cut to {cut} of {len(body)} bytes"
    assert read(body + b"\x00") is None and isinstance(reference(body + b"\x00"), ProtocolError)


def _at_the_item_limit(part: str, over: int) -> RunBatch | HiddenState:
    """A frame of cbor.MAX_ITEMS + `over` items as the reference counts them, the most of them in `part`."""
    if part == "entries":  # 27 + 13 a sequence: as near the limit as whole entries go, the rest released
        count = (MAX_ITEMS - 27) // 13
        return RunBatch(entries=tuple(entry(s) for s in range(count)), hidden_state=hidden(count, width=1),
                        released=tuple(range(count, count + MAX_ITEMS - 27 - 13 * count + over)))
    if part == "released":
        return RunBatch(entries=(entry(0),), hidden_state=hidden(1), released=tuple(range(1, MAX_ITEMS - 39 + over)))
    if part == "times":
        return RunBatch(entries=(entry(0),), hidden_state=hidden(1), upstream_seconds=(0.5,) * (MAX_ITEMS - 40 + over))
    return HiddenState(hidden_state=hidden(1), compute_seconds=0.5, upstream_seconds=(0.5,) * (MAX_ITEMS - 23 + over))


@pytest.mark.parametrize("part", ["entries", "released", "times", "answer's times"])
def test_a_frame_of_more_items_than_the_reference_reads_is_left_to_it(part):
    """The reader counts a frame's items as the reference does (cbor.MAX_ITEMS): it reads a frame at the limit as
    the reference does, and leaves one item more to the reference, which refuses it, before building anything."""
    body = encode_body(_at_the_item_limit(part, 0), "req-1", 9)
    assert same(read(body), reference(body))
    over = encode_body(_at_the_item_limit(part, 1), "req-1", 9)
    assert isinstance(reference(over), ProtocolError) and "items" in str(reference(over))
    assert read(over) is None
    with pytest.raises(ProtocolError, match="items"):  # as a connection reads it: refused, the link closed
        decode_body(memoryview(bytearray(over)))


def test_a_huge_count_is_left_to_the_reference_before_anything_is_built():
    """A million times or released sequences, far under the frame limit: declined at the count, before a value is
    read (a frame of 130 million one-byte sequences took 80 s and 1.7 GiB to build when only its bytes bounded
    them). Reading them would allocate tens of MB; the reader allocates next to nothing."""
    many = 1_000_000
    for part, body in (("released", encode_body(RunBatch(entries=(entry(0),), hidden_state=hidden(1)), "r", 1)),
                       ("times", encode_body(HiddenState(hidden_state=hidden(1), compute_seconds=0.5), "r", 1))):
        assert body.endswith(b"\x80")  # the empty array the frame ends with: released, or the answer's times
        element = b"\x01" if part == "released" else b"\xfb" + bytes(8)
        huge = body[:-1] + b"\x9a" + many.to_bytes(4, "big") + element * many
        assert isinstance(reference(huge), ProtocolError)
        tracemalloc.start()
        try:
            assert read(huge) is None
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, f"{peak} bytes allocated to read {many} {part} before counting them"


def test_bad_text_is_left_to_the_reference():
    body = encode_body(COMMON["decode step"], "req-1", 9).replace(b"req-1", b"req-\xff")
    assert read(body) is None and isinstance(reference(body), ProtocolError)


def _paths(value: Any, path: tuple = ()) -> list[tuple]:
    """Every place in a decoded envelope: the path of keys and indices to it (the root is the empty path)."""
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
    return value  # scalars, and byte strings (views the reader never changes)


WIRE_VALUES = st.recursive(
    st.one_of(
        st.none(), st.booleans(),
        st.integers(min_value=-(2**64), max_value=2**64 - 1),
        st.sampled_from([0, 1, 2, 3, 5, 7, 8, 16, 17, 23, 24, 255, 256, 64, 2**63 - 1, 2**63, 2**64 - 1, -1]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([0.0, -0.0, 1.0, 0.5, math.inf, -math.inf, math.nan]),
        st.text(max_size=6), st.sampled_from(["bf16", "fp16", "fp32", "int8", "dtype", "shape", "data", "RUN_BATCH",
                                              "HIDDEN_STATE"]),
        st.binary(max_size=40).map(memoryview),
    ),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(COMMON)), st.data())
def test_a_changed_envelope_is_read_as_the_reference_reads_it_or_left_to_it(name, data):
    """Replace any one place of a common envelope with any wire value, drop a key or add one: whatever the reader
    accepts, the reference accepts as the same envelope; whatever the reference refuses, the reader leaves to it."""
    envelope = _deep_copy(envelope_map(COMMON[name]))
    path = data.draw(st.sampled_from(_paths(envelope)), label="path")
    change = data.draw(st.sampled_from(["replace", "drop", "add"]), label="change")
    parent = envelope
    for key in path[:-1]:
        parent = parent[key]
    if not path:
        envelope = data.draw(WIRE_VALUES, label="envelope")
    elif change == "replace":
        parent[path[-1]] = data.draw(WIRE_VALUES, label="value")
    elif change == "drop":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[data.draw(st.text(max_size=15), label="key")] = data.draw(WIRE_VALUES, label="value")
    else:
        parent.append(data.draw(WIRE_VALUES, label="value"))
    body = body_of(envelope)
    got, expected = read(body), reference(body)
    if isinstance(expected, ProtocolError):
        assert got is None, f"the reader accepted what the reference refuses ({expected})"
    elif got is not None:
        assert same(got, expected)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(COMMON)), st.sampled_from(ENVELOPES), st.data())
def test_a_frame_with_bytes_changed_is_read_as_the_reference_reads_it_or_left_to_it(name, envelope, data):
    """Overwrite, insert or delete a few bytes anywhere in a common body: the same rule at the level of bytes."""
    body = bytearray(encode_body(COMMON[name], *envelope))
    for _ in range(data.draw(st.integers(1, 3), label="changes")):
        at = data.draw(st.integers(0, len(body)), label="at")
        change = data.draw(st.sampled_from(["overwrite", "insert", "delete"]), label="change")
        byte = data.draw(st.integers(0, 255), label="byte")
        if change == "insert":
            body[at:at] = bytes([byte])
        elif at < len(body):
            body[at:at + 1] = b"" if change == "delete" else bytes([byte])
    got, expected = read(bytes(body)), reference(bytes(body))
    if isinstance(expected, ProtocolError):
        assert got is None, f"the reader accepted what the reference refuses ({expected})"
    elif got is not None:
        assert same(got, expected)
