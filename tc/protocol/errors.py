"""Errors of the wire protocol, in one place.

Two families, kept apart on purpose (as h11 does):

- ``ProtocolError`` and its subclasses: the *peer* misbehaved (garbage bytes, an unknown message type, a
  payload with a missing or mistyped field, a malformed tensor, a frame over the size cap). Catch these at the
  connection's edge, answer with an ERROR message if the stream is still usable, and drop the peer.
- ``TypeError`` / ``ValueError``: *our own* code misused the API (encoding something that is not a message,
  building a message with a field of the wrong type). These are bugs and are never caught by the protocol code.

``ConnectionClosed`` is neither: the byte stream ended or broke (EOF, reset, a timeout inside a frame). It
subclasses ``ConnectionError`` so that code handling socket failures handles it too.
"""
from __future__ import annotations


# A message quoting what the peer sent (an unknown type's name, a bad value) is cut to this many characters: it is
# logged and sent back in an ERROR, and a peer's string may be as long as its frame.
MAX_MESSAGE_CHARS = 1000


class ProtocolError(Exception):
    """The peer sent bytes that break the protocol; the message says what and where."""

    def __init__(self, message: str = "", *args: object) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = f"{message[:MAX_MESSAGE_CHARS]}... ({len(message) - MAX_MESSAGE_CHARS} more characters)"
        super().__init__(message, *args)


class FrameTooLarge(ProtocolError):
    """A frame header announced a body longer than the receiver's cap.

    The stream cannot be resynchronised after this (the body was never read), so the connection must be closed.
    """

    def __init__(self, declared_bytes: int, max_frame_bytes: int, advice: str | None = None) -> None:
        """`advice`: which limit this is and what to do about it, where the receiver knows (a worker's
        --max-frame-mb, a handshake's fixed cap)."""
        super().__init__(
            f"frame header announces a {declared_bytes}-byte body, over the {max_frame_bytes}-byte cap; "
            + (advice or "if the peer is ours, raise max_frame_bytes on both ends or send a shorter prompt")
        )
        self.declared_bytes = declared_bytes
        self.max_frame_bytes = max_frame_bytes


class ProtocolVersionMismatch(ProtocolError):
    """A HELLO carried a protocol version other than ours.

    Raised before the rest of the HELLO is checked, so the head can answer with a precise reason even though the
    other fields may follow a different layout.
    """

    def __init__(self, peer_version: int, our_version: int, peer_tc_version: str | None) -> None:
        peer = f"tc {peer_tc_version}" if peer_tc_version else "the peer"
        super().__init__(
            f"{peer} speaks protocol version {peer_version}, this side speaks {our_version}; "
            "run the same tc release (the same tc.pyz) on the head and every worker"
        )
        self.peer_version = peer_version
        self.our_version = our_version
        self.peer_tc_version = peer_tc_version


class ConnectionClosed(ConnectionError):
    """The connection ended: the peer closed it (possibly mid-frame), it broke, or it was closed here."""
