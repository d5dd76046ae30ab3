"""Frames: turning messages into bytes and bytes back into messages, with no I/O.

Theory of operation
-------------------
A TCP stream between head and worker carries a sequence of frames::

    [8-byte unsigned big-endian body length][CBOR body]

and every body is one envelope, a CBOR map with exactly four keys::

    {"type": "RUN_BATCH", "request_id": "req-1" | null, "seq": 7, "payload": {...}}

``type`` names a class in ``messages.MESSAGE_TYPES`` and ``payload`` holds that message's fields, checked
strictly (see messages.py). ``request_id`` ties inference traffic to one generation; ``seq`` is the sender's
counter, which lets a receiver pair a reply with its command and spot a stale one.

This module is pure, in the manner of h11: ``encode()`` turns a message into the bytes of a frame, and a
``FrameDecoder`` is fed whatever bytes arrived, in chunks of any size, and hands back the envelopes completed so
far, keeping the rest buffered. The socket code (connection.py) is a thin layer on top; tests drive the decoder
byte by byte without any socket.

Bodies are CBOR in a strict subset, encoded and decoded by cbor.py (which says why not cbor2 at run time): no
tags, definite lengths, text-keyed maps, bounded nesting; a decode step's RUN_BATCH and HIDDEN_STATE are written and
read in one pass over the same bytes by step_frames.py. Byte strings are never copied on the way out: large
ones (tensor data) stay separate parts of the frame, which ``encode_frame_parts`` returns for a gathering send.
On the way in they are views of the received body, and each message copies what it keeps, so an Envelope never
refers to the buffer it was decoded from.

Errors split the h11 way: whatever the peer got wrong raises ``ProtocolError`` (``FrameTooLarge`` when a header
announces more than ``max_frame_bytes``); what our own code got wrong (encoding something that is not a
message, a negative ``seq``) raises TypeError or ValueError. After a ProtocolError the decoder refuses further
input: the stream has no resynchronisation point, so the connection must be dropped.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from tc.protocol.cbor import CBOR_INT_MAX, BytesLike, decode_cbor, encode_cbor_parts
from tc.protocol.errors import FrameTooLarge, ProtocolError
from tc.protocol.messages import DEFAULT_MAX_FRAME_BYTES, MESSAGE_TYPES, HiddenState, Message, RunBatch
from tc.protocol.step_frames import read_step_body, write_step_frame

_HEADER = struct.Struct(">Q")
HEADER_SIZE = _HEADER.size  # 8

_ENVELOPE_KEYS = ("type", "request_id", "seq", "payload")
_ENVELOPE_KEY_SET = frozenset(_ENVELOPE_KEYS)
_STEP_MESSAGES = (RunBatch, HiddenState)


@dataclass(frozen=True)
class Envelope:
    """One received frame: the message and the envelope fields around it."""

    message: Message
    request_id: str | None
    seq: int


# ---------------------------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------------------------


def frame_header(body_length: int) -> bytes:
    """The 8-byte header announcing a body of ``body_length`` bytes."""
    return _HEADER.pack(body_length)


def encode_frame_parts(message: Message, request_id: str | None = None, seq: int = 0) -> list[BytesLike]:
    """A whole frame as buffers to send in order: header and small fields joined, tensor data by reference.

    The parts refer to the message's tensors, so those must not change until the parts are sent. Raises
    TypeError/ValueError when called with a bad argument.
    """
    if not isinstance(message, Message) or MESSAGE_TYPES.get(message.TYPE) is not type(message):
        raise TypeError(f"expected a message from tc.protocol.messages, got {type(message).__name__}")
    if request_id is not None and type(request_id) is not str:
        raise TypeError(f"request_id must be a str or None, got {type(request_id).__name__}")
    if type(seq) is not int:
        raise TypeError(f"seq must be an int, got {type(seq).__name__}")
    if not 0 <= seq <= CBOR_INT_MAX:
        raise ValueError(f"seq must be in [0, 2**64 - 1], got {seq}")
    if type(message) in _STEP_MESSAGES:  # a decode step's two messages: written in one pass (step_frames.py)
        parts = write_step_frame(message, request_id, seq, HEADER_SIZE)
    else:
        envelope = {"type": message.TYPE, "request_id": request_id, "seq": seq, "payload": message.to_payload()}
        parts = encode_cbor_parts(envelope, reserve=HEADER_SIZE)
    body_length = sum(len(part) for part in parts) - HEADER_SIZE
    _HEADER.pack_into(parts[0], 0, body_length)  # parts[0] is the bytearray that began with the reserved bytes
    return parts


def encode(message: Message, request_id: str | None = None, seq: int = 0) -> bytes:
    """A whole frame (header and body) as one bytes. Raises TypeError/ValueError when called with a bad argument.

    Joining copies any tensor data once; connection.py sends ``encode_frame_parts`` instead.
    """
    return b"".join(encode_frame_parts(message, request_id, seq))


def encode_body(message: Message, request_id: str | None = None, seq: int = 0) -> bytes:
    """A frame's body alone (what decode_body reads). Raises TypeError/ValueError for a bad argument."""
    return encode(message, request_id, seq)[HEADER_SIZE:]


# ---------------------------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------------------------


def decode_body(body: BytesLike) -> Envelope:
    """Parse one frame body into an Envelope. Raises ProtocolError for anything the peer got wrong.

    The Envelope never refers to ``body``: the caller may reuse the buffer as soon as this returns.
    """
    with memoryview(body) as view:
        # a decode step's two messages are read in one pass where they have the form every step sends
        # (step_frames.py); else, and for every other message, through cbor.py and their fields' kinds
        step = read_step_body(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
    return Envelope(*step) if step is not None else decode_envelope(body)


def decode_envelope(body: BytesLike) -> Envelope:
    """decode_body's reference path: any body, through cbor.py and the message's fields' kinds. Raises as
    decode_body does."""
    raw = decode_cbor(body)
    if type(raw) is not dict:
        raise ProtocolError(f"a frame body must be the envelope map, got a CBOR {type(raw).__name__}")
    if raw.keys() != _ENVELOPE_KEY_SET:
        raise ProtocolError(f"the envelope has exactly the keys {list(_ENVELOPE_KEYS)}; got {list(raw.keys())}")
    type_name = raw["type"]
    if type(type_name) is not str:
        raise ProtocolError(f"envelope 'type' must be a string, got {type(type_name).__name__}")
    cls = MESSAGE_TYPES.get(type_name)
    if cls is None:
        raise ProtocolError(
            f"unknown message type {type_name!r}; head and workers must run the same tc release "
            f"(known: {sorted(MESSAGE_TYPES)})"
        )
    request_id = raw["request_id"]
    if request_id is not None and type(request_id) is not str:
        raise ProtocolError(f"{type_name} envelope 'request_id' must be a string or null")
    seq = raw["seq"]
    if type(seq) is not int or seq < 0:
        raise ProtocolError(f"{type_name} envelope 'seq' must be a non-negative int, got {seq!r}")
    return Envelope(cls.from_payload(raw["payload"]), request_id, seq)


class FrameDecoder:
    """Incremental frame decoder: ``feed`` it bytes as they arrive, get back the envelopes they complete.

    Holds at most one partial frame (plus the latest chunk): a header announcing more than ``max_frame_bytes``
    raises FrameTooLarge as soon as its 8 bytes are in, without waiting for the body.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        if type(max_frame_bytes) is not int or max_frame_bytes <= 0:
            raise ValueError(f"max_frame_bytes must be a positive int, got {max_frame_bytes!r}")
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._failure: ProtocolError | None = None

    @property
    def pending_bytes(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buffer)

    def feed(self, data: BytesLike) -> list[Envelope]:
        """Add received bytes; return the envelopes completed, in order (often none, possibly several).

        Raises ProtocolError (or FrameTooLarge) when the peer sent something invalid; envelopes completed earlier
        in the same call are dropped with the stream, and every later call raises too.
        """
        if self._failure is not None:
            raise ProtocolError(
                f"the stream already failed ({self._failure}); close the connection"
            ) from self._failure
        self._buffer += data
        envelopes: list[Envelope] = []
        start = 0
        try:
            while len(self._buffer) - start >= HEADER_SIZE:
                (length,) = _HEADER.unpack_from(self._buffer, start)
                if length > self.max_frame_bytes:
                    raise FrameTooLarge(length, self.max_frame_bytes)
                body_start = start + HEADER_SIZE
                if len(self._buffer) - body_start < length:
                    break
                with memoryview(self._buffer) as view, view[body_start:body_start + length] as body:
                    envelopes.append(decode_body(body))
                start = body_start + length
        except ProtocolError as exc:
            self._failure = exc
            self._buffer = bytearray()
            raise
        if start:
            # A new bytearray rather than `del buffer[:start]`: resizing in place would fail (BufferError) while
            # any view of the old bytes is still alive, and this copies only the partial frame left over.
            self._buffer = self._buffer[start:]
        return envelopes
