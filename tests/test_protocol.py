"""The pure protocol: messages, tensors and frames, driven with bytes only (no sockets)."""
from __future__ import annotations

import gc
import math
import re
import struct
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import cbor2
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tc.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Assignment,
    ClearCache,
    DeviceInfo,
    Envelope,
    Error,
    FrameDecoder,
    FrameTooLarge,
    Hello,
    HelloAck,
    HiddenState,
    InferenceError,
    LoadComplete,
    LoadFailed,
    LoadProgress,
    Message,
    Ping,
    Pong,
    ProtocolError,
    ProtocolVersionMismatch,
    BatchEntry,
    Release,
    RunBatch,
    decode_body,
    encode,
    encode_body,
    encode_frame_parts,
    frame_header,
    tensor_from_wire,
    tensor_to_wire,
)
from tc.protocol.framing import HEADER_SIZE
from tc.protocol.messages import PeerAck, PeerChallenge, PeerHello, Route, SpeedFigure
from tc.protocol.cbor import BY_REFERENCE_BYTES, MAX_ITEMS, MAX_NESTING, decode_cbor, encode_cbor, encode_cbor_parts
from tc.protocol.tensors import MAX_TENSOR_RANK, WireTensor

GEN = torch.Generator().manual_seed(0)


def hidden(seq: int = 1, width: int = 16, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(1, seq, width, generator=GEN).to(dtype)  # [1, seq, width]


CUDA0 = DeviceInfo(
    id="cuda:0", type="cuda", name="NVIDIA GeForce RTX 4090", total_memory=25757220864, free_memory=23000000000
)
MPS = DeviceInfo(id="mps", type="mps", name="Apple Silicon MPS", total_memory=None, free_memory=None)


def make_hello(**overrides: Any) -> Hello:
    fields: dict[str, Any] = dict(
        protocol_version=PROTOCOL_VERSION,
        tc_version="0.1.0",
        node_id="gpu-box",
        hostname="gpu-box.local",
        platform="linux",
        python_version="3.11.7",
        torch_version="2.13.0",
        devices=(CUDA0, DeviceInfo("cpu", "cpu", "x86_64", 64 * 2**30, 32 * 2**30)),
        selected_device="cuda:0",
        compute_dtypes=("bf16", "fp16", "fp32"),
        max_memory_bytes=20 * 2**30,
        auth=b"\x00\x01secret",
    )
    fields.update(overrides)
    return Hello(**fields)


QWEN_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 896,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "sliding_window": None,
    "nested": {"list": [1, -2, 3.5, "x", None, True, {"deep": []}]},
}

def make_assignment(**overrides: Any) -> Assignment:
    fields: dict[str, Any] = dict(
        model_id="Qwen/Qwen2.5-0.5B-Instruct",
        model_source="hub",
        revision="main",
        device="cuda:0",
        architecture="qwen2",
        quant="int8",
        group_size=0,
        compute_dtype="bf16",
        layer_start=8,
        layer_end_exclusive=16,
        config=QWEN_CONFIG,
        tensor_count=96,
    )
    fields.update(overrides)
    return Assignment(**fields)


def assignment_payload(**changes: Any) -> dict[str, Any]:
    payload = make_assignment().to_payload()
    payload.update(changes)
    return payload


ENTRY = {"sequence": 1, "position_start": 0, "length": 1, "cache_capacity": 4,
         "copies": [], "source": None}  # one BatchEntry on the wire
RELAYED = {"route": 0, "released": [], "upstream_seconds": []}  # a RUN_BATCH's fields beside its entries and rows, for one the head relays


def run_batch(*entries: tuple[int, int, int, int], dtype: torch.dtype = torch.bfloat16) -> RunBatch:
    """A RUN_BATCH of (sequence, position_start, length, cache_capacity) entries with rows to match."""
    made = tuple(BatchEntry(sequence=s, position_start=p, length=n, cache_capacity=c) for s, p, n, c in entries)
    return RunBatch(entries=made, hidden_state=hidden(seq=sum(e.length for e in made), dtype=dtype))


# One (or more) sample per message type; test_samples_cover_every_message_type keeps this honest.
SAMPLES: dict[str, Callable[[], Message]] = {
    "hello": make_hello,
    "hello-minimal": lambda: make_hello(
        node_id=None, devices=(MPS,), selected_device="mps", max_memory_bytes=None, auth=None
    ),
    "hello-ack": lambda: HelloAck(node_id="gpu-box", challenge=b"\xff" * 32),
    "hello-ack-no-challenge": lambda: HelloAck(node_id="macbook"),
    "assignment": lambda: make_assignment(),
    "assignment-local": lambda: make_assignment(model_id="/models/qwen", model_source="local", revision=None),
    "load-progress": lambda: LoadProgress(stage="layers", done=3, total=8),
    "load-complete": lambda: LoadComplete(
        load_seconds=12.5, weight_bytes=10**9, device="cuda:0", compute_dtype="fp16"
    ),
    "load-failed": lambda: LoadFailed(reason="out of memory on cuda:0: é ✓"),
    "ping": lambda: Ping(nonce=2**64 - 1),
    "pong": lambda: Pong(nonce=0),
    "ping-probe": lambda: Ping(nonce=3, payload=bytes(range(256)) * 4096),
    "pong-probe": lambda: Pong(nonce=3, payload=b"\x00" * 100_000),
    "error": lambda: Error(code="hello_refused", message="node id 'x' is not in the topology"),
    "clear-cache": ClearCache,
    "release": lambda: Release(sequences=(3, 2**63)),
    "release-none": lambda: Release(sequences=()),
    "run-batch-prefill": lambda: run_batch((1, 0, 5, 4096)),
    "run-batch-decode": lambda: run_batch((42, 41, 1, 100), dtype=torch.float16),
    "run-batch-ragged": lambda: run_batch((7, 0, 3, 10), (2, 30, 1, 64), (5, 256, 4, 512), dtype=torch.float32),
    "hidden-state": lambda: HiddenState(hidden_state=hidden(seq=3, dtype=torch.float32), compute_seconds=0.0125),
    "inference-error": lambda: InferenceError(message="CUDA error: device-side assert"),
    "run-batch-routed": lambda: RunBatch(entries=(BatchEntry(sequence=9, position_start=4, length=1,
                                                             cache_capacity=16),),
                                         hidden_state=hidden(seq=1, dtype=torch.bfloat16), route=3,
                                         released=(1, 2), upstream_seconds=(0.004, 0.5)),
    "run-batch-copies": lambda: RunBatch(entries=(BatchEntry(sequence=4, position_start=0, length=2, cache_capacity=9,
                                                             copies=(5, 6)),),
                                         hidden_state=hidden(seq=2, dtype=torch.bfloat16)),
    "run-batch-sources": lambda: RunBatch(entries=(BatchEntry(sequence=2, position_start=80, length=1,
                                                              cache_capacity=90),
                                                   BatchEntry(sequence=4, position_start=70, length=2,
                                                              cache_capacity=90, source=2),
                                                   BatchEntry(sequence=3, position_start=65, length=1,
                                                              cache_capacity=70, source=3)),
                                          hidden_state=hidden(seq=4, dtype=torch.bfloat16)),
    "run-batch-prefill-large": lambda: RunBatch(entries=(BatchEntry(sequence=2, position_start=0, length=40,
                                                                    cache_capacity=64),),
                                                hidden_state=hidden(seq=40, width=896), upstream_seconds=(0.5,)),
    "hidden-state-large": lambda: HiddenState(hidden_state=hidden(seq=40, width=896, dtype=torch.float32),
                                              compute_seconds=0.25, upstream_seconds=(0.5,)),
    "hidden-state-passed-on": lambda: HiddenState(hidden_state=hidden(seq=2, dtype=torch.bfloat16),
                                                  compute_seconds=0.01, upstream_seconds=(0.02,)),
    "route": lambda: Route(route=2, next_host="10.0.0.7", next_port=40123, next_key=b"k" * 32,
                           inbound_key=b"i" * 32),
    "route-last": lambda: Route(route=2, next_host=None, next_port=None, next_key=None, inbound_key=b"i" * 32),
    "peer-challenge": lambda: PeerChallenge(nonce=b"n" * 32),
    "peer-hello": lambda: PeerHello(protocol_version=PROTOCOL_VERSION, route=2, proof=b"p" * 32, nonce=b"m" * 32),
    "peer-ack": lambda: PeerAck(route=2, proof=b"q" * 32, max_frame_bytes=1 << 20),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a float tensor, so NaN payloads and -0.0 compare exactly."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return t.contiguous().view(ints[t.dtype])


def assert_same_message(got: Message, want: Message) -> None:
    assert type(got) is type(want)
    for name, _ in want._wire_fields:
        a, b = getattr(got, name), getattr(want, name)
        assert a == b and type(a) is type(b), name  # a WireTensor: the same dtype, shape and bytes


def plain(value: Any) -> Any:
    """memoryviews (how byte strings come back) as bytes, for comparison."""
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def frame_of(obj: Any) -> bytes:
    """A frame around an arbitrary CBOR value written by cbor2, for bodies our encoder would never write."""
    body = cbor2.dumps(plain(obj))
    return frame_header(len(body)) + body


def envelope(type_name: Any, payload: Any, request_id: Any = None, seq: Any = 0) -> dict[str, Any]:
    return {"type": type_name, "request_id": request_id, "seq": seq, "payload": payload}


def test_a_config_with_a_long_key_above_many_values_is_checked_in_its_own_size():
    """Each value's place in a config is made text only for an error: made for every value, a long key was copied
    once per value below it, so a frame under the handshake's 1 MiB (read before any proof of who sent it) asked
    for tens of GB. Here a 25 KB frame would have taken 100 MB."""
    body = encode_cbor(envelope("ASSIGNMENT", assignment_payload(config={"K" * 20_000: [0] * 5_000})))
    tracemalloc.start()
    try:
        assert decode_body(body).message.config == {"K" * 20_000: [0] * 5_000}
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes to check a config of {len(body)} bytes"


def decode_one(frame: bytes, **kwargs: Any) -> Envelope:
    envelopes = FrameDecoder(**kwargs).feed(frame)
    assert len(envelopes) == 1
    return envelopes[0]


# ---------------------------------------------------------------------------------------------------------------
# Round trips and chunking
# ---------------------------------------------------------------------------------------------------------------


def test_samples_cover_every_message_type():
    assert {type(make()).TYPE for make in SAMPLES.values()} == set(MESSAGE_TYPES)


def test_registry_names_match_classes():
    assert PROTOCOL_VERSION == 10
    for name, cls in MESSAGE_TYPES.items():
        assert cls.TYPE == name and name.isupper()


@pytest.mark.parametrize("name", SAMPLES)
def test_every_message_round_trips(name):
    message = SAMPLES[name]()
    got = decode_one(encode(message, request_id="req-1", seq=17))
    assert (got.request_id, got.seq) == ("req-1", 17)
    assert_same_message(got.message, message)


@pytest.mark.parametrize("name", SAMPLES)
@pytest.mark.parametrize("request_id, seq", [(None, 0), ("req-é" * 9, 2**64 - 1)])
def test_a_frame_is_the_cbor_of_its_envelope(name, request_id, seq):
    """RUN_BATCH and HIDDEN_STATE write their frames by hand (step_frames.py); every message's frame is the
    CBOR of its envelope map, part for part (tensor data by reference in the same places), so a receiver cannot
    tell which wrote it."""
    message = SAMPLES[name]()
    envelope = {"type": message.TYPE, "request_id": request_id, "seq": seq, "payload": message.to_payload()}
    reference = encode_cbor_parts(envelope, reserve=HEADER_SIZE)
    parts = encode_frame_parts(message, request_id, seq)
    assert [type(part) for part in parts] == [type(part) for part in reference]
    assert bytes(parts[0])[HEADER_SIZE:] == bytes(reference[0])[HEADER_SIZE:]
    assert [bytes(part) for part in parts[1:]] == [bytes(part) for part in reference[1:]]
    assert all(a is b for a, b in zip(parts[1::2], reference[1::2]))  # tensor data: the very same objects


@pytest.mark.parametrize("name", SAMPLES)
def test_decode_body_matches_frame_decoder(name):
    message = SAMPLES[name]()
    assert_same_message(decode_body(encode_body(message)).message, message)
    assert encode(message) == frame_header(len(encode_body(message))) + encode_body(message)


@pytest.mark.parametrize("request_id, seq", [(None, 0), ("", 1), ("req-é", 2**64 - 1)])
def test_envelope_fields_round_trip(request_id, seq):
    got = decode_one(encode(Ping(1), request_id=request_id, seq=seq))
    assert got == Envelope(Ping(1), request_id, seq)


def test_header_is_big_endian_body_length():
    frame = encode(Ping(5))
    assert struct.unpack(">Q", frame[:8])[0] == len(frame) - 8
    assert cbor2.loads(frame[8:]) == {"type": "PING", "request_id": None, "seq": 0,
                                      "payload": {"nonce": 5, "payload": b""}}


def stream_of_frames() -> tuple[bytes, list[Message]]:
    messages = [
        Ping(1),
        make_hello(),
        ClearCache(),
        RunBatch(entries=(BatchEntry(sequence=1, position_start=3, length=1, cache_capacity=9),),
                 hidden_state=hidden(width=8)),
        Error(code="protocol_error", message="x"),
        HiddenState(hidden_state=hidden(seq=2, width=4, dtype=torch.float32), compute_seconds=1.0),
    ]
    data = b"".join(encode(m, request_id=f"r{i}", seq=i) for i, m in enumerate(messages))
    return data, messages


def assert_stream(envelopes: list[Envelope], messages: list[Message]) -> None:
    assert len(envelopes) == len(messages)
    for i, (env, message) in enumerate(zip(envelopes, messages)):
        assert (env.request_id, env.seq) == (f"r{i}", i)
        assert_same_message(env.message, message)


def test_stream_split_at_every_offset():
    data, messages = stream_of_frames()
    for offset in range(len(data) + 1):
        decoder = FrameDecoder()
        envelopes = decoder.feed(data[:offset])
        envelopes += decoder.feed(data[offset:])
        assert_stream(envelopes, messages)
        assert decoder.pending_bytes == 0


def test_stream_byte_by_byte_and_pending_bytes():
    data, messages = stream_of_frames()
    decoder = FrameDecoder()
    envelopes: list[Envelope] = []
    consumed = 0
    for i in range(len(data)):
        got = decoder.feed(data[i:i + 1])
        for env in got:
            consumed += len(encode(env.message, env.request_id, env.seq))
        envelopes += got
        assert decoder.pending_bytes == i + 1 - consumed
    assert_stream(envelopes, messages)
    assert decoder.pending_bytes == 0


def test_stream_in_one_feed_and_as_memoryview():
    data, messages = stream_of_frames()
    assert_stream(FrameDecoder().feed(data), messages)
    assert_stream(FrameDecoder().feed(memoryview(bytearray(data))), messages)


def test_frame_of_exactly_the_cap_is_accepted():
    frame = encode(Ping(1))
    assert len(decode_one_list := FrameDecoder(max_frame_bytes=len(frame) - 8).feed(frame)) == 1
    assert decode_one_list[0].message == Ping(1)


# ---------------------------------------------------------------------------------------------------------------
# The peer's errors
# ---------------------------------------------------------------------------------------------------------------

GOOD_BODY = encode_body(Ping(7))

BAD_BODIES = {
    "garbage": b"\xff\xfe\xfd\x00garbage",
    "empty body": b"",
    "truncated cbor": GOOD_BODY[:-2],
    "trailing bytes": GOOD_BODY + b"\x00",
    "not a map": cbor2.dumps([1, 2, 3]),
    "envelope missing payload": cbor2.dumps({"type": "PING", "request_id": None, "seq": 0}),
    "envelope extra key": cbor2.dumps(dict(envelope("PING", {"nonce": 1}), extra=1)),
    "type not a string": cbor2.dumps(envelope(5, {"nonce": 1})),
    "unknown type": cbor2.dumps(envelope("LAUNCH", {})),
    "request_id int": cbor2.dumps(envelope("PING", {"nonce": 1}, request_id=5)),
    "seq negative": cbor2.dumps(envelope("PING", {"nonce": 1}, seq=-1)),
    "seq float": cbor2.dumps(envelope("PING", {"nonce": 1}, seq=1.0)),
    "payload not a map": cbor2.dumps(envelope("PING", [1])),
    "indefinite map": b"\xbf" + cbor2.dumps("type")[:1] + b"\xff",
    "undefined": b"\xf7",
    "simple value": b"\xe0",
    "reserved info": b"\x1c",
    "lone break": b"\xff",
    "invalid utf-8": b"\x62\xc3\x28",
    "non-text key": cbor2.dumps({1: 2}),
    "duplicate key": b"\xa2\x61a\x01\x61a\x02",
    "huge array count": b"\x9b\xff\xff\xff\xff\xff\xff\xff\xff",
    "huge byte string": b"\x5b\x00\x00\x00\x01\x00\x00\x00\x00",
    "too deep": b"\x81" * (MAX_NESTING + 1) + b"\x00",
    "too many items": b"\x9a" + struct.pack(">I", MAX_ITEMS) + b"\x00" * MAX_ITEMS,
}


@pytest.mark.parametrize("name", BAD_BODIES)
def test_bad_bodies_raise_protocol_error(name):
    body = BAD_BODIES[name]
    with pytest.raises(ProtocolError):
        FrameDecoder().feed(frame_header(len(body)) + body)
    with pytest.raises(ProtocolError):
        decode_body(body)


# The same subset rules at the CBOR level, each with the words that show which rule caught it.
SUBSET_VIOLATIONS = {
    "indefinite map": (b"\xbf\xff", "indefinite"),
    "undefined": (b"\xf7", "simple value"),
    "simple value": (b"\xf8\x20", "simple value"),
    "tag": (b"\xc1\x00", "tag 1"),
    "reserved info": (b"\x1c", "reserved"),
    "invalid utf-8": (b"\x62\xc3\x28", "UTF-8"),
    "non-text key": (b"\xa1\x01\x02", "keyed by text"),
    "duplicate key": (b"\xa2\x61a\x01\x61a\x02", "repeats the key 'a'"),
    "count beyond the bytes": (b"\x9b\xff\xff\xff\xff\xff\xff\xff\xff", "middle of an item"),
    "too deep": (b"\x81" * (MAX_NESTING + 1) + b"\x00", "nesting"),
    "too many items": (b"\x9a" + struct.pack(">I", MAX_ITEMS + 1) + b"\x00" * (MAX_ITEMS + 1), "more than"),
    "trailing bytes": (b"\x00\x00", "stray"),
    "empty": (b"", "middle of an item"),
}


@pytest.mark.parametrize("name", SUBSET_VIOLATIONS)
def test_cbor_outside_the_subset_is_refused_for_the_right_reason(name):
    data, words = SUBSET_VIOLATIONS[name]
    with pytest.raises(ProtocolError, match=words):
        decode_cbor(data)


def test_header_over_the_cap_raises_before_the_body_arrives():
    decoder = FrameDecoder(max_frame_bytes=1000)
    decoder.feed(frame_header(1001)[:5])  # not a whole header yet
    with pytest.raises(FrameTooLarge) as info:
        decoder.feed(frame_header(1001)[5:])
    assert (info.value.declared_bytes, info.value.max_frame_bytes) == (1001, 1000)
    assert isinstance(info.value, ProtocolError)
    assert decoder.pending_bytes == 0


def test_default_cap_fits_a_long_prefill():
    # 32k tokens x 896 wide x fp32, plus envelope
    assert DEFAULT_MAX_FRAME_BYTES > 32768 * 896 * 4 + 1024
    with pytest.raises(FrameTooLarge):
        FrameDecoder().feed(frame_header(DEFAULT_MAX_FRAME_BYTES + 1))


def test_decoder_refuses_input_after_a_failure():
    decoder = FrameDecoder()
    with pytest.raises(ProtocolError):
        decoder.feed(frame_of(envelope("NOPE", {})))
    with pytest.raises(ProtocolError, match="already failed"):
        decoder.feed(encode(Ping(1)))


def hello_payload(**changes: Any) -> dict[str, Any]:
    payload = make_hello().to_payload()
    payload.update(changes)
    return payload


# (message type, payload, words the error must contain: the type and the field)
BAD_PAYLOADS = {
    "missing field": ("PING", {}, ["PING", "nonce"]),
    "extra field": ("PING", {"nonce": 1, "nonse": 2}, ["PING", "nonse"]),
    "str for int": ("PING", {"nonce": "1", "payload": b""}, ["PING.nonce"]),
    "bool for int": ("PONG", {"nonce": True, "payload": b""}, ["PONG.nonce"]),
    "negative count": ("PING", {"nonce": -1, "payload": b""}, ["PING.nonce"]),
    "str for payload bytes": ("PONG", {"nonce": 1, "payload": "x"}, ["PONG.payload", "byte string"]),
    "float for int": ("LOAD_PROGRESS", {"stage": "x", "done": 1.0, "total": 2}, ["LOAD_PROGRESS.done"]),
    "str for float": (
        "LOAD_COMPLETE",
        {"load_seconds": "1", "weight_bytes": 1, "device": "cpu", "compute_dtype": "fp32"},
        ["LOAD_COMPLETE.load_seconds"],
    ),
    "nan seconds": (
        "HIDDEN_STATE",
        {"hidden_state": tensor_to_wire(hidden()), "compute_seconds": math.nan, "upstream_seconds": []},
        ["HIDDEN_STATE.compute_seconds"],
    ),
    "null for str": ("LOAD_FAILED", {"reason": None}, ["LOAD_FAILED.reason"]),
    "bytes for str": ("ERROR", {"code": b"x", "message": "m"}, ["ERROR.code"]),
    "str for bytes": ("HELLO_ACK", {"node_id": "n", "challenge": "abc", "heartbeat_s": 5}, ["HELLO_ACK.challenge"]),
    "unknown dtype name": (
        "LOAD_COMPLETE",
        {"load_seconds": 1, "weight_bytes": 1, "device": "cpu", "compute_dtype": "int8"},
        ["LOAD_COMPLETE.compute_dtype"],
    ),
    "devices not a list": ("HELLO", hello_payload(devices={}), ["HELLO.devices"]),
    "device unknown type": (
        "HELLO", hello_payload(devices=[dict(CUDA0.to_payload(), type="tpu")]), ["HELLO.devices[0].type"]
    ),
    "device extra key": (
        "HELLO", hello_payload(devices=[dict(CUDA0.to_payload(), vram=1)]), ["HELLO.devices[0]", "vram"]
    ),
    "device negative memory": (
        "HELLO", hello_payload(devices=[dict(CUDA0.to_payload(), free_memory=-5)]), ["HELLO.devices[0].free_memory"]
    ),
    "selected device absent": ("HELLO", hello_payload(selected_device="cuda:7"), ["HELLO", "selected_device"]),
    "compute dtype unknown": ("HELLO", hello_payload(compute_dtypes=["bf16", "fp8"]), ["HELLO.compute_dtypes[1]"]),
    "hello missing auth": ("HELLO", {k: v for k, v in hello_payload().items() if k != "auth"}, ["HELLO", "auth"]),
    "empty layer range": ("ASSIGNMENT", assignment_payload(layer_end_exclusive=8), ["ASSIGNMENT", "layer range"]),
    "config bytes value": ("ASSIGNMENT", assignment_payload(config={"a": [b"x"]}), ["ASSIGNMENT.config.a[0]"]),
    "config bytes value deep down": ("ASSIGNMENT", assignment_payload(config={"a": {"b": [1, {"c": b"x"}]}, "d": 1}),
                                     ["ASSIGNMENT.config.a.b[1].c"]),
    "tensor rank 2": (
        "RUN_BATCH", {**RELAYED, "entries": [ENTRY], "hidden_state": tensor_to_wire(torch.zeros(1, 8))}, ["RUN_BATCH.hidden_state"]
    ),
    "batch rows do not match": (
        "RUN_BATCH", {**RELAYED, "entries": [ENTRY], "hidden_state": tensor_to_wire(torch.zeros(1, 2, 8))}, ["RUN_BATCH", "[1, 1, hidden]"]
    ),
    "entry past capacity": (
        "RUN_BATCH", {**RELAYED, "entries": [dict(ENTRY, position_start=4)], "hidden_state": tensor_to_wire(torch.zeros(1, 1, 8))},
        ["RUN_BATCH.entries[0]", "cache_capacity 4"]
    ),
    "copies not a list": (
        "RUN_BATCH", {**RELAYED, "entries": [dict(ENTRY, copies=2)], "hidden_state": tensor_to_wire(torch.zeros(1, 1, 8))},
        ["RUN_BATCH.entries[0].copies"]
    ),
    "source starts nothing": (
        "RUN_BATCH", {**RELAYED, "entries": [dict(ENTRY, source=2)],
                      "hidden_state": tensor_to_wire(torch.zeros(1, 1, 8))},
        ["RUN_BATCH.entries[0]", "position_start must be more than 0"]
    ),
    "source starts anew": (
        "RUN_BATCH", {**RELAYED, "entries": [dict(ENTRY, position_start=2, cache_capacity=5, source=2),
                                             dict(ENTRY, sequence=2, position_start=0)],
                      "hidden_state": tensor_to_wire(torch.zeros(1, 2, 8))},
        ["RUN_BATCH", "copies the caches of [2]"]
    ),
    "source cut back": (
        "RUN_BATCH", {**RELAYED, "entries": [dict(ENTRY, position_start=2, cache_capacity=5, source=2),
                                             dict(ENTRY, sequence=2, position_start=3, source=2)],
                      "hidden_state": tensor_to_wire(torch.zeros(1, 2, 8))},
        ["RUN_BATCH", "copies the caches of [2]"]
    ),
    "source released": (
        "RUN_BATCH", {**RELAYED, "released": [2],
                      "entries": [dict(ENTRY, position_start=2, cache_capacity=5, source=2)],
                      "hidden_state": tensor_to_wire(torch.zeros(1, 1, 8))},
        ["RUN_BATCH", "copies the caches of [2]"]
    ),
    "release negative": ("RELEASE", {"sequences": [-1]}, ["RELEASE.sequences[0]"]),
    "route negative": (
        "RUN_BATCH", {**RELAYED, "route": -1, "entries": [ENTRY], "hidden_state": tensor_to_wire(torch.zeros(1, 1, 8))},
        ["RUN_BATCH.route"]
    ),
    "released runs": (
        "RUN_BATCH", {**RELAYED, "released": [1], "entries": [ENTRY], "hidden_state": tensor_to_wire(torch.zeros(1, 1, 8))},
        ["RUN_BATCH", "releases [1]"]
    ),
    "route without key": (
        "ROUTE", {"route": 1, "next_host": "h", "next_port": 1, "next_key": None, "inbound_key": None},
        ["ROUTE", "next_key"]
    ),
    "route port out of range": (
        "ROUTE", {"route": 1, "next_host": "h", "next_port": 70000, "next_key": b"k", "inbound_key": None},
        ["ROUTE.next_port", "[1, 65535]"]
    ),
    "hello peer port zero": ("HELLO", hello_payload(peer_port=0), ["HELLO.peer_port", "[1, 65535]"]),
    "route zero": (
        "ROUTE", {"route": 0, "next_host": None, "next_port": None, "next_key": None, "inbound_key": None},
        ["ROUTE.route"]
    ),
    "clear cache with field": ("CLEAR_CACHE", {"all": True}, ["CLEAR_CACHE", "all"]),
}


@pytest.mark.parametrize("name", BAD_PAYLOADS)
def test_bad_payloads_name_the_type_and_field(name):
    type_name, payload, words = BAD_PAYLOADS[name]
    with pytest.raises(ProtocolError) as info:
        FrameDecoder().feed(frame_of(envelope(type_name, payload)))
    for word in words:
        assert word in str(info.value)


def test_hello_with_another_protocol_version_says_so_first():
    # A future HELLO may have other fields; the version is still reported, not the field mismatch.
    payload = {"protocol_version": PROTOCOL_VERSION + 1, "tc_version": "0.9.0", "gpu_list": []}
    with pytest.raises(ProtocolVersionMismatch) as info:
        FrameDecoder().feed(frame_of(envelope("HELLO", payload)))
    assert (info.value.peer_version, info.value.our_version, info.value.peer_tc_version) == (
        PROTOCOL_VERSION + 1, PROTOCOL_VERSION, "0.9.0")
    assert "0.9.0" in str(info.value) and "same tc release" in str(info.value)


def test_older_peers_are_told_apart():
    """A HELLO of versions 1-4 is refused by its version, before anything else is read. Version 2 dropped
    ASSIGNMENT.total_weight_bytes and version 3 added max_sequences: an older ASSIGNMENT is refused by its fields,
    and an old RUN_DECODE by its type, never half-read; version 4's PING and PONG carry a payload, which an older
    one lacks; version 5's RUN_BATCH entries name their copies, which a version 4 entry lacks; version 6's RUN_BATCH
    says its route, the stages' times before it and the sequences released before it, and its HELLO the worker's
    peer port; a version 6 worker would not grow a cache that a version 7 entry continues with more capacity; version
    8's RUN_BATCH entries may name a source, which a version 7 entry lacks; version 9's ASSIGNMENT names the context
    served, which a version 8 one lacks; version 10's HELLO_ACK says how often the head pings, which a version 9 one
    lacks."""
    for old in (1, 2, 3, 4, 5, 6, 7, 8, 9):
        with pytest.raises(ProtocolVersionMismatch) as info:
            FrameDecoder().feed(frame_of(envelope("HELLO", {**make_hello().to_payload(), "protocol_version": old})))
        assert (info.value.peer_version, info.value.our_version) == (old, 10)
    version_5_hello = {k: v for k, v in make_hello().to_payload().items() if k not in ("peer_port", "peer_host")}
    with pytest.raises(ProtocolError, match=r"HELLO lacks field\(s\) \['peer_port', 'peer_host'\]"):
        Hello.from_payload(version_5_hello)
    with pytest.raises(ProtocolError, match=r"RUN_BATCH lacks field\(s\) \['route', 'upstream_seconds', 'released'\]"):
        FrameDecoder().feed(frame_of(envelope("RUN_BATCH", {"entries": [ENTRY], "hidden_state": good_tensor()})))
    version_7_entry = {k: v for k, v in ENTRY.items() if k != "source"}
    with pytest.raises(ProtocolError, match=r"RUN_BATCH.entries\[0\] lacks field\(s\) \['source'\]"):
        FrameDecoder().feed(frame_of(envelope("RUN_BATCH", {**RELAYED, "entries": [version_7_entry],
                                                             "hidden_state": good_tensor()})))
    version_4_entry = {k: v for k, v in ENTRY.items() if k not in ("copies", "source")}
    with pytest.raises(ProtocolError, match=r"RUN_BATCH.entries\[0\] lacks field\(s\) \['copies', 'source'\]"):
        FrameDecoder().feed(frame_of(envelope("RUN_BATCH", {**RELAYED, "entries": [version_4_entry],
                                                             "hidden_state": good_tensor()})))
    with pytest.raises(ProtocolError, match=r"PONG .*payload"):
        FrameDecoder().feed(frame_of(envelope("PONG", {"nonce": 1})))
    version_8 = {k: v for k, v in assignment_payload().items() if k != "context_length"}
    with pytest.raises(ProtocolError, match=r"ASSIGNMENT lacks field\(s\) \['context_length'\]"):
        FrameDecoder().feed(frame_of(envelope("ASSIGNMENT", version_8)))
    with pytest.raises(ProtocolError, match=r"HELLO_ACK lacks field\(s\) \['heartbeat_s'\]"):
        FrameDecoder().feed(frame_of(envelope("HELLO_ACK", {"node_id": "a", "challenge": None})))
    version_1 = {k: v for k, v in assignment_payload(total_weight_bytes=123456789).items()
                 if k not in ("max_sequences", "context_length")}
    with pytest.raises(ProtocolError, match=r"ASSIGNMENT has unknown field\(s\) \['total_weight_bytes'\]"):
        FrameDecoder().feed(frame_of(envelope("ASSIGNMENT", version_1)))
    version_2 = {k: v for k, v in assignment_payload().items() if k not in ("max_sequences", "context_length")}
    with pytest.raises(ProtocolError, match=r"ASSIGNMENT lacks field\(s\) \['max_sequences', 'context_length'\]"):
        FrameDecoder().feed(frame_of(envelope("ASSIGNMENT", version_2)))
    with pytest.raises(ProtocolError, match="unknown message type 'RUN_DECODE'"):
        FrameDecoder().feed(frame_of(envelope("RUN_DECODE", {"position": 0, "hidden_state": good_tensor()})))


def test_an_error_quoting_a_long_string_of_the_peers_is_cut():
    """The message is logged and sent back in an ERROR: a megabyte type name is not quoted whole."""
    with pytest.raises(ProtocolError) as refused:
        FrameDecoder().feed(frame_of(envelope("X" * 1_000_000, {})))
    message = str(refused.value)
    assert message.startswith("unknown message type 'XXX") and message.endswith("more characters)")
    assert len(message) < 1100


SPEED = SpeedFigure(device="cuda:0", dtype="bf16", quant="int8", decode_bytes_per_s=9.5e11,
                    prefill_bytes_per_s=4.0e13, layer_overhead_s=4e-5)


def test_hello_carries_measured_speeds():
    hello = make_hello(speeds=(SPEED,))
    (env,) = FrameDecoder().feed(frame_of(envelope("HELLO", hello.to_payload())))
    assert env.message == hello and env.message.speeds[0].decode_bytes_per_s == 9.5e11
    assert make_hello().speeds == ()  # a worker that did not measure says so with none


def test_protocol_2_hello_without_speeds_is_refused_by_its_version():
    """Version 3 added HELLO.speeds: a version 2 HELLO lacks it, and is told apart by its version first."""
    payload = make_hello().to_payload()
    del payload["speeds"]
    with pytest.raises(ProtocolVersionMismatch):
        FrameDecoder().feed(frame_of(envelope("HELLO", {**payload, "protocol_version": 2})))
    with pytest.raises(ProtocolError, match=r"HELLO lacks field\(s\) \['speeds'\]"):
        FrameDecoder().feed(frame_of(envelope("HELLO", payload)))


@pytest.mark.parametrize("bad", [{"decode_bytes_per_s": 0}, {"prefill_bytes_per_s": -1.0},
                                 {"layer_overhead_s": float("nan")}, {"dtype": "fp8"}])
def test_a_speed_figure_out_of_range_is_the_peers_fault(bad):
    payload = make_hello(speeds=(SPEED,)).to_payload()
    payload["speeds"][0].update(bad)
    with pytest.raises(ProtocolError, match=r"HELLO\.speeds\[0\]|SpeedFigure"):
        FrameDecoder().feed(frame_of(envelope("HELLO", payload)))


def good_tensor(**changes: Any) -> dict[str, Any]:
    wire_tensor = tensor_to_wire(torch.zeros(1, 2, 3))
    wire_tensor.update(changes)
    return wire_tensor


BAD_TENSORS = {
    "not a map": [1, 2],
    "fp64 dtype": good_tensor(dtype="fp64"),
    "torch dtype name": good_tensor(dtype="float32"),
    "dtype not str": good_tensor(dtype=4),
    "shape not list": good_tensor(shape="1,2,3"),
    "negative dim": good_tensor(shape=[1, -2, -3]),
    "bool dim": good_tensor(shape=[True, 2, 3]),
    "float dim": good_tensor(shape=[1.0, 2, 3]),
    "rank 5": good_tensor(shape=[1, 1, 2, 3, 1]),
    "dim beyond int64": good_tensor(shape=[0, 2**63], data=b""),
    "strides beyond int64": good_tensor(shape=[0, 2**62, 2**62], data=b""),
    "data too short": good_tensor(data=bytes(23)),
    "data too long": good_tensor(data=bytes(25)),
    "data as str": good_tensor(data="x" * 24),
    "extra key": good_tensor(strides=[6, 3, 1]),
    "missing key": {"dtype": "fp32", "shape": [1, 2, 3]},
}


@pytest.mark.parametrize("name", BAD_TENSORS)
def test_bad_tensors_raise_protocol_error(name):
    obj = BAD_TENSORS[name]
    with pytest.raises(ProtocolError):
        tensor_from_wire(obj)
    with pytest.raises(ProtocolError, match="RUN_BATCH.hidden_state"):
        FrameDecoder().feed(frame_of(envelope("RUN_BATCH", {**RELAYED, "entries": [ENTRY], "hidden_state": obj})))


# ---------------------------------------------------------------------------------------------------------------
# Tags: never decoded into objects
# ---------------------------------------------------------------------------------------------------------------

TAGGED = {
    "self-describe 55799 around the envelope": cbor2.CBORTag(55799, envelope("PING", {"nonce": 1})),
    "custom tag as a field": envelope("PING", {"nonce": cbor2.CBORTag(1000, 1)}),
    "datetime tag": envelope("LOAD_FAILED", {"reason": cbor2.CBORTag(0, "2024-01-01T00:00:00Z")}),
    "bignum tag": envelope("PING", {"nonce": 2**70}),
    "set tag in config": envelope("ASSIGNMENT", assignment_payload(config={"s": cbor2.CBORTag(258, [1])})),
    "regex tag": envelope("ERROR", {"code": "x", "message": cbor2.CBORTag(35, "(a+)+$")}),
    "shared reference tag": envelope("PING", {"nonce": cbor2.CBORTag(28, 1)}),
}


@pytest.mark.parametrize("name", TAGGED)
def test_tagged_bodies_are_refused(name):
    body = cbor2.dumps(plain(TAGGED[name]))
    with pytest.raises(ProtocolError, match="tag"):
        decode_body(body)


def test_cbor2_itself_would_build_objects_from_tags():
    # Why we decode ourselves: cbor2 turns tags into live Python objects; our decoder refuses them above.
    body = cbor2.dumps({"s": cbor2.CBORTag(258, [1, 2]), "r": cbor2.CBORTag(35, "a+")})
    decoded = cbor2.loads(body)
    assert isinstance(decoded["s"], (set, frozenset)) and not isinstance(decoded["r"], str)
    with pytest.raises(ProtocolError, match="tag"):
        decode_cbor(body)


# ---------------------------------------------------------------------------------------------------------------
# The strict decoder agrees with cbor2 on the subset
# ---------------------------------------------------------------------------------------------------------------

cbor_ints = st.integers(min_value=-(2**64), max_value=2**64 - 1)
scalars = (
    st.none() | st.booleans() | cbor_ints | st.floats(allow_nan=False) | st.text(max_size=20) | st.binary(max_size=40)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=100, deadline=None)
@given(values)
def test_strict_decoder_reads_what_cbor2_writes(value):
    encoded = cbor2.dumps(value)
    assert plain(decode_cbor(encoded)) == value == cbor2.loads(encoded)


@settings(max_examples=100, deadline=None)
@given(values)
def test_cbor2_reads_what_our_encoder_writes(value):
    encoded = encode_cbor(value)
    assert cbor2.loads(encoded) == value == plain(decode_cbor(encoded))


@pytest.mark.parametrize(
    "value",
    [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, -1, -24, -25, -(2**64)]
    + [1.5, -0.0, "", "é✓", b"", [], {}],
)
def test_our_encoding_is_cbor2_canonical_form(value):
    # Shortest heads, and floats as float64 (what cbor2 writes for non-canonical dumps).
    assert encode_cbor(value) == cbor2.dumps(value)


def test_large_byte_strings_are_passed_by_reference():
    big = bytes(BY_REFERENCE_BYTES)
    small = b"s" * 10
    parts = encode_cbor_parts({"a": big, "b": small, "c": [big]}, reserve=8)
    assert [part is big for part in parts] == [False, True, False, True]
    assert bytes(parts[0][:8]) == bytes(8)  # reserved for the caller
    assert cbor2.loads(b"".join(parts)[8:]) == {"a": big, "b": small, "c": [big]}


def test_a_tensor_is_sent_from_its_own_memory():
    tensor = torch.zeros(1, 64, 128)  # 32 KiB: over BY_REFERENCE_BYTES
    parts = encode_frame_parts(HiddenState(tensor, compute_seconds=0.0))
    assert len(parts) == 3
    with memoryview(parts[1]) as view:
        assert len(view) == tensor.numel() * 4
        tensor[0, 0, 0] = 1.0  # the frame sees the change: no copy was made
        assert bytes(view[:4]) == struct.pack("<f", 1.0)
    assert b"".join(parts) == encode(HiddenState(tensor, compute_seconds=0.0))


def nested_lists(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


ENCODER_MISUSE = {
    "int key": ({1: 2}, TypeError),
    "set": ({1, 2}, TypeError),
    "object": (object(), TypeError),
    "int too big": (2**64, ValueError),
    "int too small": (-(2**64) - 1, ValueError),
    "too deep": (nested_lists(MAX_NESTING + 1), ValueError),
}


@pytest.mark.parametrize("name", ENCODER_MISUSE)
def test_encoder_rejects_values_outside_the_subset(name):
    value, error = ENCODER_MISUSE[name]
    with pytest.raises(error):
        encode_cbor(value)


@pytest.mark.parametrize(
    "hex_body, want",
    [
        ("f93c00", 1.0),  # half
        ("fa3f800000", 1.0),  # single
        ("fb3ff8000000000000", 1.5),  # double
        ("f97c00", math.inf),
        ("3bffffffffffffffff", -(2**64)),
        ("1bffffffffffffffff", 2**64 - 1),
        ("1817", 23),  # non-minimal length encoding is still valid CBOR
        ("f4", False),
        ("f5", True),
        ("f6", None),
        ("60", ""),
        ("40", b""),
        ("80", []),
        ("a0", {}),
    ],
)
def test_strict_decoder_scalars(hex_body, want):
    assert plain(decode_cbor(bytes.fromhex(hex_body))) == want


def test_byte_strings_are_views_of_the_frame():
    buffer = bytearray(cbor2.dumps(b"abc"))
    view = decode_cbor(buffer)
    assert isinstance(view, memoryview) and bytes(view) == b"abc"
    buffer[-1:] = b"z"
    assert bytes(view) == b"abz"  # zero-copy: which is why messages copy what they keep


def test_decoded_messages_do_not_alias_the_frame_buffer():
    message = HelloAck(node_id="n", challenge=b"abc")
    buffer = bytearray(encode_body(message))
    got = decode_body(buffer).message
    buffer[:] = bytes(len(buffer))
    assert got == message and type(got.challenge) is bytes


# ---------------------------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------------------------

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = [(), (0,), (1, 0, 896), (3,), (1, 1, 896), (2, 3, 5), (2, 3, 4, 5)]


def random_bits(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Arbitrary bit patterns, NaN payloads, infinities and subnormals included."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    info = torch.iinfo(ints)
    return torch.randint(info.min, info.max, shape, dtype=ints, generator=GEN).view(dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", DTYPES)
def test_tensors_round_trip_bit_exactly(name, shape):
    tensor = random_bits(shape, DTYPES[name])
    wire_tensor = tensor_to_wire(tensor)
    assert wire_tensor["dtype"] == name and wire_tensor["shape"] == list(shape)
    assert len(wire_tensor["data"]) == tensor.numel() * tensor.element_size()
    got = tensor_from_wire(wire_tensor)
    assert got.dtype == tensor.dtype and got.shape == tensor.shape
    assert torch.equal(bits(got), bits(tensor))


NON_CONTIGUOUS = {
    "transposed": lambda t: t.transpose(0, 2),
    "strided slice": lambda t: t[:, ::2, 1:],
    "expanded": lambda t: t[:, :1, :].expand(4, 5, 6),
    "offset view": lambda t: t[1:, 2:4],
}


@pytest.mark.parametrize("view", NON_CONTIGUOUS)
@pytest.mark.parametrize("name", DTYPES)
def test_non_contiguous_tensors_round_trip(name, view):
    tensor = NON_CONTIGUOUS[view](random_bits((4, 5, 6), DTYPES[name]))
    assert not tensor.is_contiguous()
    got = tensor_from_wire(tensor_to_wire(tensor))
    assert got.is_contiguous() and got.shape == tensor.shape
    assert torch.equal(bits(got), bits(tensor))


@pytest.mark.parametrize(
    "tensor, data",
    [
        (torch.tensor([1.0, -2.0], dtype=torch.float32), struct.pack("<ff", 1.0, -2.0)),
        (torch.tensor([1.0, -2.0], dtype=torch.float16), struct.pack("<ee", 1.0, -2.0)),
        (torch.tensor([1.0, -2.0], dtype=torch.bfloat16), b"\x80\x3f\x00\xc0"),  # top halves of the fp32 words
    ],
)
def test_tensor_data_is_little_endian(tensor, data):
    assert bytes(tensor_to_wire(tensor)["data"]) == data


def test_wire_data_keeps_its_tensor_alive():
    """The frame may be sent after the caller dropped the tensor: `data` holds the tensor's memory, not a copy."""
    expected = torch.arange(4096, dtype=torch.float32)
    data = tensor_to_wire(expected.clone())["data"]  # the wire map holds the only reference to the clone
    gc.collect()
    junk = [torch.full((4096,), 7.0) for _ in range(64)]  # would take the clone's memory over, were it freed
    assert bytes(data) == expected.numpy().tobytes()
    assert all(int(j[0]) == 7 for j in junk)


def test_a_tensor_that_requires_grad_goes_on_the_wire_as_its_values():
    tensor = torch.tensor([[1.0, -2.0]], requires_grad=True)
    assert torch.equal(tensor_from_wire(tensor_to_wire(tensor)), tensor.detach())


def test_decoded_tensor_owns_writable_memory():
    source = torch.arange(6, dtype=torch.float32).reshape(1, 2, 3)
    wire_tensor = tensor_to_wire(source)
    buffer = bytearray(wire_tensor["data"])
    got = tensor_from_wire(dict(wire_tensor, data=memoryview(buffer)))
    buffer[:] = bytes(len(buffer))  # the frame buffer is reused for the next frame
    assert torch.equal(got, source)
    got += 1  # writable, no read-only-buffer warning
    assert torch.equal(got, source + 1)


def test_messages_hold_tensors_in_wire_form_and_pass_received_ones_on_unchanged():
    """A message holds its tensor as a WireTensor: one given as a torch tensor views it (and gives it back), one
    received is its own bytes, compared bit for bit, and goes out again as it came (a stage passing rows on)."""
    row = random_bits((1, 2, 8), torch.bfloat16)
    made = HiddenState(hidden_state=row, compute_seconds=0.5)
    assert type(made.hidden_state) is WireTensor and made.hidden_state.tensor() is row
    received = decode_body(encode_body(made)).message.hidden_state
    assert received == made.hidden_state and received.source is None
    assert torch.equal(bits(received.tensor()), bits(row))
    passed_on = decode_body(encode_body(RunBatch(entries=(BatchEntry(sequence=1, position_start=3, length=2,
                                                                     cache_capacity=8),),
                                                 hidden_state=received))).message.hidden_state
    assert passed_on == received
    other = row.clone()
    other.view(torch.int16)[0, 0, 0] ^= 1  # one bit
    assert WireTensor.of(other) != received and WireTensor.of(row.view(1, 16, 1)) != received
    assert WireTensor.of(row.view(torch.int16).view(torch.float16)) != received  # same bytes, other dtype
    with pytest.raises(ValueError, match="must have 3 dimensions"):
        HiddenState(hidden_state=WireTensor.of(row[0]), compute_seconds=0.5)


def test_a_batch_passed_on_is_the_batch_a_stage_would_build_with_its_output_and_time():
    """RunBatch.passed_on checks only what it changes; the message is the one the full constructor makes."""
    received = decode_body(encode_body(RunBatch(
        entries=(BatchEntry(sequence=1, position_start=3, length=2, cache_capacity=8, copies=(4,)),
                 BatchEntry(sequence=2, position_start=0, length=1, cache_capacity=3)),
        hidden_state=random_bits((1, 3, 8), torch.bfloat16), route=5, upstream_seconds=(0.25,), released=(7,)))).message
    output = WireTensor.of(random_bits((1, 3, 8), torch.bfloat16))
    passed = received.passed_on(output, 0.125)
    built = RunBatch(entries=received.entries, hidden_state=output, route=5, upstream_seconds=(0.25, 0.125),
                     released=(7,))
    assert vars(passed) == vars(built) and type(passed) is RunBatch
    assert received.upstream_seconds == (0.25,) and received.hidden_state != output  # the batch received is kept
    assert decode_body(encode_body(passed)).message.upstream_seconds == (0.25, 0.125)
    assert [type(t) for t in passed.upstream_seconds] == [float, float]
    again = passed.passed_on(output, 1).upstream_seconds
    assert again == (0.25, 0.125, 1.0) and type(again[-1]) is float  # a number, normalised as the constructor does
    listed = WireTensor(output.dtype, list(output.shape), output.data)  # a shape given as a list, as the constructor
    assert received.passed_on(listed, 0.5).hidden_state is listed       # takes it
    with pytest.raises(ValueError, match="does not hold the batch's rows"):
        received.passed_on(WireTensor.of(random_bits((1, 2, 8), torch.bfloat16)), 0.1)
    with pytest.raises(ValueError, match="must have 3 dimensions"):
        received.passed_on(WireTensor.of(random_bits((3, 8), torch.bfloat16)), 0.1)
    with pytest.raises(ValueError, match="finite number >= 0"):
        received.passed_on(output, -1.0)
    with pytest.raises(TypeError, match="must be a number"):
        received.passed_on(output, "0.1")


@pytest.mark.parametrize(
    "value, error",
    [
        ("not a tensor", TypeError),
        (torch.zeros(2, dtype=torch.int64), TypeError),
        (torch.zeros(2, dtype=torch.float64), TypeError),
        (torch.zeros(1, 1, 1, 1, 1), ValueError),
        (torch.zeros(2, 2).to_sparse(), TypeError),
    ],
    ids=["str", "int64", "fp64", "rank5", "sparse"],
)
def test_tensor_to_wire_rejects_misuse(value, error):
    with pytest.raises(error):
        tensor_to_wire(value)
    assert MAX_TENSOR_RANK == 4


# ---------------------------------------------------------------------------------------------------------------
# Our own misuse: TypeError / ValueError, never ProtocolError
# ---------------------------------------------------------------------------------------------------------------

MISUSE = {
    "encode a dict": (lambda: encode({"type": "PING"}), TypeError),
    "encode the class": (lambda: encode(Ping), TypeError),
    "request_id int": (lambda: encode(Ping(1), request_id=3), TypeError),
    "seq negative": (lambda: encode(Ping(1), seq=-1), ValueError),
    "seq too big": (lambda: encode(Ping(1), seq=2**64), ValueError),
    "seq bool": (lambda: encode(Ping(1), seq=True), TypeError),
    "nonce str": (lambda: Ping("1"), TypeError),
    "nonce negative": (lambda: Ping(-1), ValueError),
    "nonce too big": (lambda: Ping(2**64), ValueError),
    "seconds negative": (lambda: HiddenState(hidden(), compute_seconds=-1.0), ValueError),
    "hidden int64": (lambda: RunBatch((BatchEntry(1, 0, 1, 1),), torch.zeros(1, 1, 4, dtype=torch.int64)), TypeError),
    "hidden rank 2": (lambda: RunBatch((BatchEntry(1, 0, 1, 1),), torch.zeros(1, 4)), ValueError),
    "batch without entries": (lambda: RunBatch((), torch.zeros(1, 0, 4)), ValueError),
    "batch rows short": (lambda: RunBatch((BatchEntry(1, 0, 3, 8),), torch.zeros(1, 2, 4)), ValueError),
    "batch sequence twice": (lambda: RunBatch((BatchEntry(1, 0, 1, 8), BatchEntry(1, 1, 1, 8)),
                                              torch.zeros(1, 2, 4)), ValueError),
    "entry copied into itself": (lambda: BatchEntry(1, 0, 1, 8, copies=(2, 1)), ValueError),
    "entry copied twice": (lambda: BatchEntry(1, 0, 1, 8, copies=(2, 2)), ValueError),
    "copy onto a batch entry": (lambda: RunBatch((BatchEntry(1, 0, 1, 8, copies=(2,)), BatchEntry(2, 0, 1, 8)),
                                                 torch.zeros(1, 2, 4)), ValueError),
    "copy made by two entries": (lambda: RunBatch((BatchEntry(1, 0, 1, 8, copies=(3,)),
                                                   BatchEntry(2, 0, 1, 8, copies=(3,))), torch.zeros(1, 2, 4)),
                                 ValueError),
    "copy negative": (lambda: BatchEntry(1, 0, 1, 8, copies=(-1,)), ValueError),
    "entry past its capacity": (lambda: BatchEntry(1, 7, 2, 8), ValueError),
    "entry of no rows": (lambda: BatchEntry(1, 0, 0, 8), ValueError),
    "selected device absent": (lambda: make_hello(selected_device="cuda:3"), ValueError),
    "device type": (lambda: DeviceInfo("x", "tpu", "x", None, None), ValueError),
    "devices of dicts": (lambda: make_hello(devices=({"id": "cpu"},)), TypeError),
    "compute dtype": (lambda: make_hello(compute_dtypes=("int4",)), ValueError),
    "config with a set": (lambda: make_assignment(config={"x": {1}}), TypeError),
    "config with a huge int": (lambda: make_assignment(config={"x": 2**70}), ValueError),
    "config with a tuple": (lambda: make_assignment(config={"x": (1, 2)}), TypeError),
    "empty layer range": (lambda: make_assignment(layer_start=4, layer_end_exclusive=4), ValueError),
    "auth str": (lambda: make_hello(auth="secret"), TypeError),
}


@pytest.mark.parametrize("name", MISUSE)
def test_misuse_raises_type_or_value_error(name):
    call, error = MISUSE[name]
    with pytest.raises(error) as info:
        call()
    assert not isinstance(info.value, ProtocolError)


def test_construction_normalises_sequences_and_numbers():
    hello = make_hello(devices=[CUDA0], compute_dtypes=["bf16"])
    assert hello.devices == (CUDA0,) and hello.compute_dtypes == ("bf16",)
    assert hash(hello) == hash(make_hello(devices=(CUDA0,), compute_dtypes=("bf16",)))
    done = LoadComplete(load_seconds=3, weight_bytes=1, device="cpu", compute_dtype="fp32")
    assert type(done.load_seconds) is float


def test_tensor_messages_repr_shows_shape_not_values():
    text = repr(HiddenState(hidden_state=torch.zeros(1, 1, 896, dtype=torch.bfloat16), compute_seconds=0.5))
    assert text == ("HiddenState(hidden_state=<tensor bf16 [1, 1, 896]>, compute_seconds=0.5, "
                    "upstream_seconds=())")


def test_nesting_up_to_the_limit_round_trips():
    value = nested_lists(MAX_NESTING)
    assert decode_cbor(encode_cbor(value)) == value


def test_the_design_doc_names_the_protocol_version_the_code_speaks():
    # operators read the number there when a worker is refused for its version; it went stale once (6 for 8)
    design = (Path(__file__).resolve().parent.parent / "docs" / "design.md").read_text(encoding="utf-8")
    named = re.findall(r"`HELLO` the protocol's \((\d+)\)", design)
    assert named == [str(PROTOCOL_VERSION)]
