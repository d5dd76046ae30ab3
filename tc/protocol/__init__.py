"""The wire protocol between head and workers: typed messages in CBOR frames over TCP.

- messages.py: one frozen dataclass per message type, strict payload parsing (pure)
- tensors.py: tensors as {dtype, shape, data} maps (pure)
- cbor.py: the strict CBOR subset the frames are written in (pure)
- framing.py: frames, envelopes, the incremental FrameDecoder (pure)
- step_frames.py: RUN_BATCH and HIDDEN_STATE, a decode step's frames, written and read in one pass (pure)
- connection.py: the only I/O, a blocking socket that sends and receives whole frames
- errors.py: ProtocolError (the peer misbehaved) and ConnectionClosed
"""
from __future__ import annotations

from tc.protocol.connection import Connection, connect
from tc.protocol.errors import ConnectionClosed, FrameTooLarge, ProtocolError, ProtocolVersionMismatch
from tc.protocol.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    Envelope,
    FrameDecoder,
    decode_body,
    encode,
    encode_body,
    encode_frame_parts,
    frame_header,
)
from tc.protocol.messages import (
    ERROR_HELLO_REFUSED,
    ERROR_NODE_TAKEN,
    ERROR_PROTOCOL,
    ERROR_UNEXPECTED_MESSAGE,
    ERROR_VERSION_MISMATCH,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Assignment,
    ClearCache,
    DeviceInfo,
    Error,
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
    BatchEntry,
    Release,
    RunBatch,
)
from tc.protocol.tensors import WIRE_DTYPES, WireTensor, tensor_from_wire, tensor_to_wire

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "ERROR_HELLO_REFUSED",
    "ERROR_NODE_TAKEN",
    "ERROR_PROTOCOL",
    "ERROR_UNEXPECTED_MESSAGE",
    "ERROR_VERSION_MISMATCH",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "WIRE_DTYPES",
    "WireTensor",
    "Assignment",
    "ClearCache",
    "Connection",
    "ConnectionClosed",
    "DeviceInfo",
    "Envelope",
    "Error",
    "FrameDecoder",
    "FrameTooLarge",
    "Hello",
    "HelloAck",
    "HiddenState",
    "InferenceError",
    "LoadComplete",
    "LoadFailed",
    "LoadProgress",
    "Message",
    "Ping",
    "Pong",
    "ProtocolError",
    "ProtocolVersionMismatch",
    "BatchEntry",
    "Release",
    "RunBatch",
    "connect",
    "decode_body",
    "encode",
    "encode_body",
    "encode_frame_parts",
    "frame_header",
    "tensor_from_wire",
    "tensor_to_wire",
]
