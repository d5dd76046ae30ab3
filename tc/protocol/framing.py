"""Frames: turning messages into bytes and bytes back into messages, with no I/O.

Theory of operation
-------------------
A TCP stream between head and worker carries a sequence of frames::

    [8-byte unsigned big-endian body length][CBOR body]

and every body is one envelope, a CBOR map with exactly four keys::

    {"type": "RUN_DECODE", "request_id": "req-1" | null, "seq": 7, "payload": {...}}

``type`` names a class in ``messages.MESSAGE_TYPES`` and ``payload`` holds that message's fields, checked
strictly (see messages.py). ``request_id`` ties inference traffic to one generation; ``seq`` is the sender's
counter, which lets a receiver pair a reply with its command and spot a stale one.

This module is pure, in the manner of h11: ``encode()`` turns a message into the bytes of a frame, and a
``FrameDecoder`` is fed whatever bytes arrived, in chunks of any size, and hands back the envelopes completed so
far, keeping the rest buffered. The socket code (connection.py) is a thin layer on top; tests drive the decoder
byte by byte without any socket.

The body is standard CBOR (RFC 8949) written by cbor2, but only a strict subset of it is *accepted*:
definite-length maps, arrays, byte and text strings, integers, floats, true/false/null; maps keyed by text,
without duplicate keys; at most MAX_NESTING levels and MAX_ITEMS items. Tags are refused outright. We decode that
subset ourselves rather than with ``cbor2.loads`` for two reasons. First, cbor2 turns semantic tags into Python
objects (datetimes, Decimals, regexes, MIME messages, sets, shared references) and no switch common to its
versions turns that off; refusing every tag means a peer's bytes only ever become plain data. Second, byte
strings come out as zero-copy views of the frame, so a tensor is copied once, straight into its own memory
(``cbor2.loads`` spent about three memcpys' worth of time on a 117 MB byte string).

Errors split the h11 way: whatever the peer got wrong raises ``ProtocolError`` (``FrameTooLarge`` when a header
announces more than ``max_frame_bytes``); what our own code got wrong (encoding something that is not a
message, a negative ``seq``) raises TypeError or ValueError. After a ProtocolError the decoder refuses further
input: the stream has no resynchronisation point, so the connection must be dropped.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Union

import cbor2

from tc.protocol.errors import FrameTooLarge, ProtocolError
from tc.protocol.messages import CBOR_INT_MAX, MESSAGE_TYPES, Message

_HEADER = struct.Struct(">Q")
HEADER_SIZE = _HEADER.size  # 8

# A 32k-token prefill of a 896-wide model in fp32 is 117 MB; 256 MiB leaves room for that and its envelope.
DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024

# Envelope -> payload -> config -> nested config values: a few levels; 32 is generous and bounds recursion.
MAX_NESTING = 32
# An envelope is a few dozen items (a model config, a few hundred); the cap bounds the work a body can ask for.
MAX_ITEMS = 65_536

_ENVELOPE_KEYS = ("type", "request_id", "seq", "payload")
_ENVELOPE_KEY_SET = frozenset(_ENVELOPE_KEYS)

BytesLike = Union[bytes, bytearray, memoryview]


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


def encode_body(message: Message, request_id: str | None = None, seq: int = 0) -> bytes:
    """The CBOR body of a frame (no header). Raises TypeError/ValueError when called with a bad argument."""
    if not isinstance(message, Message) or MESSAGE_TYPES.get(message.TYPE) is not type(message):
        raise TypeError(f"expected a message from tc.protocol.messages, got {type(message).__name__}")
    if request_id is not None and type(request_id) is not str:
        raise TypeError(f"request_id must be a str or None, got {type(request_id).__name__}")
    if type(seq) is not int:
        raise TypeError(f"seq must be an int, got {type(seq).__name__}")
    if not 0 <= seq <= CBOR_INT_MAX:
        raise ValueError(f"seq must be in [0, 2**64 - 1], got {seq}")
    envelope = {"type": message.TYPE, "request_id": request_id, "seq": seq, "payload": message.to_payload()}
    return cbor2.dumps(envelope)


def encode(message: Message, request_id: str | None = None, seq: int = 0) -> bytes:
    """A whole frame (header and body). Raises TypeError/ValueError when called with a bad argument.

    For large bodies prefer ``frame_header(len(body))`` and ``encode_body`` sent separately: joining them here
    copies the body once more.
    """
    body = encode_body(message, request_id, seq)
    return frame_header(len(body)) + body


# ---------------------------------------------------------------------------------------------------------------
# Strict CBOR subset decoder
# ---------------------------------------------------------------------------------------------------------------

# Additional information 24..27: the argument follows in 1, 2, 4 or 8 bytes; for major type 7, 25..27 are floats.
_ARGUMENT_SIZE = {24: 1, 25: 2, 26: 4, 27: 8}
_FLOAT = {25: struct.Struct(">e"), 26: struct.Struct(">f"), 27: struct.Struct(">d")}
_SIMPLE = {20: False, 21: True, 22: None}

_TRUNCATED = "CBOR body ends in the middle of an item: the frame is truncated or its length header is wrong"


class _Decoder:
    """One pass over one body. Positions are passed and returned rather than stored: it is the hot loop of every
    received frame, and attribute writes per item cost more than the decoding itself."""

    __slots__ = ("view", "end", "items_left")

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.end = len(view)
        self.items_left = MAX_ITEMS

    def item(self, pos: int, depth: int) -> tuple[Any, int]:
        """Decode the item starting at ``pos``; return it and the position after it."""
        view, end = self.view, self.end
        if pos >= end:
            raise ProtocolError(_TRUNCATED)
        initial = view[pos]
        pos += 1
        major, info = initial >> 5, initial & 0x1F

        if major == 7:
            if info in _SIMPLE:
                return _SIMPLE[info], pos
            fmt = _FLOAT.get(info)
            if fmt is None:
                raise ProtocolError(f"CBOR simple value or break (initial byte 0x{initial:02x}) is not part of the protocol")
            if pos + fmt.size > end:
                raise ProtocolError(_TRUNCATED)
            return fmt.unpack_from(view, pos)[0], pos + fmt.size

        if info < 24:
            argument = info
        elif info <= 27:
            size = _ARGUMENT_SIZE[info]
            if pos + size > end:
                raise ProtocolError(_TRUNCATED)
            argument = int.from_bytes(view[pos:pos + size], "big")
            pos += size
        elif info == 31:
            raise ProtocolError("indefinite-length CBOR items are not part of the protocol")
        else:
            raise ProtocolError(f"malformed CBOR: reserved additional information {info} (initial byte 0x{initial:02x})")

        if major == 0:
            return argument, pos
        if major == 1:
            return -1 - argument, pos
        if major == 2 or major == 3:
            stop = pos + argument
            if stop > end:
                raise ProtocolError(_TRUNCATED)
            if major == 2:
                return view[pos:stop], stop  # a view of the frame; messages copy what they keep
            try:
                return str(view[pos:stop], "utf-8"), stop
            except UnicodeDecodeError as exc:
                raise ProtocolError("CBOR text string is not valid UTF-8") from exc
        if major == 6:
            raise ProtocolError(f"CBOR tag {argument} found; the protocol uses no tags, so tagged data is refused")

        # Arrays (4) and maps (5).
        if depth >= MAX_NESTING:
            raise ProtocolError(f"CBOR nesting deeper than {MAX_NESTING} levels")
        # Every item takes at least one byte, so a count beyond the remaining bytes is refused before looping.
        children = argument if major == 4 else 2 * argument
        if children > end - pos:
            raise ProtocolError(_TRUNCATED)
        # Every item but the outermost is some container's child: counting children here bounds them all.
        self.items_left -= children
        if self.items_left < 0:
            raise ProtocolError(f"CBOR body holds more than {MAX_ITEMS} items; no protocol message is that large")
        depth += 1
        if major == 4:
            items = []
            for _ in range(argument):
                value, pos = self.item(pos, depth)
                items.append(value)
            return items, pos
        result: dict[str, Any] = {}
        for _ in range(argument):
            key, pos = self.item(pos, depth)
            if type(key) is not str:
                raise ProtocolError(f"CBOR map key of type {type(key).__name__}; the protocol's maps are keyed by text")
            if key in result:
                raise ProtocolError(f"CBOR map repeats the key {key!r}")
            result[key], pos = self.item(pos, depth)
        return result, pos


def decode_cbor(data: BytesLike) -> Any:
    """Decode one CBOR item in the protocol's strict subset, spanning all of ``data``.

    Byte strings come back as memoryviews into ``data`` (copy them to keep them past the buffer's reuse);
    everything else as dict, list, str, int, float, bool or None. Raises ProtocolError for anything outside the
    subset, truncated input, or trailing bytes.
    """
    with memoryview(data) as whole:
        view = whole.cast("B") if whole.format != "B" or whole.ndim != 1 else whole
        value, pos = _Decoder(view).item(0, 0)
        if pos != len(view):
            raise ProtocolError(f"{len(view) - pos} stray bytes after the CBOR item; the length header is wrong")
        return value


# ---------------------------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------------------------


def decode_body(body: BytesLike) -> Envelope:
    """Parse one frame body into an Envelope. Raises ProtocolError for anything the peer got wrong.

    The Envelope never refers to ``body``: the caller may reuse the buffer as soon as this returns.
    """
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
            raise ProtocolError(f"the stream already failed ({self._failure}); close the connection") from self._failure
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
