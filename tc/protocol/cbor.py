"""The protocol's CBOR: a strict subset of RFC 8949, encoded and decoded here.

The subset is what JSON can say plus byte strings: definite-length maps (keyed by text, no key twice), arrays,
byte strings, text strings, integers in [-2**64, 2**64 - 1], floats, true, false and null, nested at most
MAX_NESTING deep with at most MAX_ITEMS items. No tags, no undefined, no other simple values, no
indefinite lengths. Everything we write is ordinary CBOR that any decoder reads (the tests check ours against
cbor2 in both directions); everything outside the subset is refused when read, with a ProtocolError.

Why not cbor2 at run time, though it is the obvious choice:

- Safety: ``cbor2.loads`` turns semantic tags into live objects (datetimes, Decimals, regexes, MIME messages,
  sets, shared references), and no switch common to its versions turns that off. Here a peer's bytes only ever
  become plain data.
- Copies: the decoder hands byte strings over as zero-copy views of the frame, so a received tensor is copied
  exactly once, into its own memory; the encoder passes large byte strings (tensor data) by reference, as
  separate parts for a gathering send, so a sent tensor is not copied at all. Measured on the development box,
  cbor2 6.3 spent 7.4 ms encoding a 1.8 MB prefill hidden state and ~3 memcpys' worth of time decoding one.
- The pure-Python zipapp then needs no native CBOR package.

The price is speed on tiny frames: the decoder is Python, about 20 µs for a decode-step frame of ~20 items (the
two messages of a decode step are written and read by step_frames.py instead, which keeps these bytes).
"""
from __future__ import annotations

import struct
from typing import Any, Union

from tc.protocol.errors import ProtocolError

BytesLike = Union[bytes, bytearray, memoryview]

# CBOR's native integers; anything wider would need a bignum tag, which the subset does not have.
CBOR_INT_MIN = -(2**64)
CBOR_INT_MAX = 2**64 - 1

# Envelope -> payload -> config -> nested config values is a few levels; 32 is generous and bounds recursion.
MAX_NESTING = 32
# An envelope is a few dozen items (with a model config, a few hundred); the cap bounds what a body can cost.
MAX_ITEMS = 65_536

# Byte strings at least this long are passed by reference as their own part rather than copied into the stream.
BY_REFERENCE_BYTES = 16 * 1024

_FLOAT64 = struct.Struct(">d")
_FLOAT_READERS = {25: struct.Struct(">e"), 26: struct.Struct(">f"), 27: _FLOAT64}
_SIMPLE = {20: False, 21: True, 22: None}
# Additional information 24..27: the argument follows in 1, 2, 4 or 8 bytes (for major type 7: a float).
_ARGUMENT_SIZE = {24: 1, 25: 2, 26: 4, 27: 8}

_TRUNCATED = "CBOR body ends in the middle of an item: the frame is truncated or its length header is wrong"


# ---------------------------------------------------------------------------------------------------------------
# Encoding: raises TypeError / ValueError, since only our own code hands values to it
# ---------------------------------------------------------------------------------------------------------------


def _head(out: bytearray, major: int, argument: int) -> None:
    """An item head with its argument in the shortest form (RFC 8949 preferred serialisation)."""
    if argument < 24:
        out.append(major << 5 | argument)
    elif argument < 1 << 8:
        out += bytes((major << 5 | 24, argument))
    elif argument < 1 << 16:
        out.append(major << 5 | 25)
        out += argument.to_bytes(2, "big")
    elif argument < 1 << 32:
        out.append(major << 5 | 26)
        out += argument.to_bytes(4, "big")
    else:
        out.append(major << 5 | 27)
        out += argument.to_bytes(8, "big")


class _Encoder:
    def __init__(self, reserve: int) -> None:
        self.parts: list[BytesLike] = []
        self.out = bytearray(reserve)

    def finish(self) -> list[BytesLike]:
        if self.out:
            self.parts.append(self.out)
        return self.parts

    def item(self, value: Any, depth: int) -> None:
        # self.out changes when a large byte string starts a new part; each call reads it afresh, and containers
        # write their own head before any child can change it.
        out = self.out
        kind = type(value)
        if kind is str:
            data = value.encode("utf-8")
            _head(out, 3, len(data))
            out += data
        elif kind is int:
            if not CBOR_INT_MIN <= value <= CBOR_INT_MAX:
                raise ValueError(f"{value} does not fit a CBOR integer (64 bits and a sign)")
            if value >= 0:
                _head(out, 0, value)
            else:
                _head(out, 1, -1 - value)
        elif value is None:
            out.append(0xF6)
        elif kind is bool:
            out.append(0xF5 if value else 0xF4)
        elif kind is float:
            out.append(0xFB)
            out += _FLOAT64.pack(value)
        elif kind is dict:
            self._nest(depth)
            _head(out, 5, len(value))
            for key, child in value.items():
                if type(key) is not str:
                    raise TypeError(f"map keys must be str, got {type(key).__name__} {key!r}")
                self.item(key, depth + 1)
                self.item(child, depth + 1)
        elif kind is list or kind is tuple:
            self._nest(depth)
            _head(out, 4, len(value))
            for child in value:
                self.item(child, depth + 1)
        elif kind is bytes or kind is bytearray or kind is memoryview:
            self._bytes(value)
        else:
            raise TypeError(f"cannot encode a {kind.__name__} in the protocol's CBOR")

    def _nest(self, depth: int) -> None:
        if depth >= MAX_NESTING:
            raise ValueError(f"value nested deeper than {MAX_NESTING} levels; the peer would refuse it")

    def _bytes(self, value: BytesLike) -> None:
        if type(value) is memoryview and (value.format != "B" or value.ndim != 1):
            value = value.cast("B")
        _head(self.out, 2, len(value))
        if len(value) < BY_REFERENCE_BYTES:
            self.out += value
        else:
            # End the current part, send the byte string as its own part, and continue in a fresh one.
            self.parts += (self.out, value)
            self.out = bytearray()


def encode_cbor_parts(value: Any, reserve: int = 0) -> list[BytesLike]:
    """Encode ``value`` as buffers whose concatenation is its CBOR, large byte strings passed by reference.

    The first part starts with ``reserve`` zero bytes for the caller to fill in (a frame header). Byte strings
    of BY_REFERENCE_BYTES or more appear as the very objects given, so they must not change until the parts have
    been sent. Raises TypeError for a value outside the subset, ValueError for an out-of-range int or nesting
    deeper than MAX_NESTING.
    """
    encoder = _Encoder(reserve)
    encoder.item(value, 0)
    return encoder.finish()


def encode_cbor(value: Any) -> bytes:
    """Encode ``value`` as one CBOR byte string. Raises as encode_cbor_parts does."""
    return b"".join(encode_cbor_parts(value))


# ---------------------------------------------------------------------------------------------------------------
# Decoding: raises ProtocolError, since the bytes come from the peer
# ---------------------------------------------------------------------------------------------------------------


class _Decoder:
    """One pass over one body. Positions are passed and returned rather than stored: this is the hot loop of
    every received frame, and an attribute write per item would cost more than the decoding itself."""

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
            fmt = _FLOAT_READERS.get(info)
            if fmt is None:
                raise ProtocolError(
                    f"CBOR simple value or break (initial byte 0x{initial:02x}) is not part of the protocol"
                )
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
            raise ProtocolError(
                f"malformed CBOR: reserved additional information {info} (initial byte 0x{initial:02x})"
            )

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
                raise ProtocolError(
                    f"CBOR map key of type {type(key).__name__}; the protocol's maps are keyed by text"
                )
            if key in result:
                raise ProtocolError(f"CBOR map repeats the key {key!r}")
            result[key], pos = self.item(pos, depth)
        return result, pos


def decode_cbor(data: BytesLike) -> Any:
    """Decode one CBOR item in the subset, spanning all of ``data``.

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
