"""A blocking socket that sends and receives whole frames: the protocol's only I/O.

Framing and parsing live in framing.py; this layer only moves bytes. It is built for plain threads:

- ``send`` may be called from any number of threads at once; a lock keeps each frame whole on the wire. The
  frame goes out with a gathering ``sendmsg`` of its parts (framing.encode_frame_parts), so a tensor is sent
  from its own memory, never joined into a body first.
- ``recv`` is meant for one reader thread (a lock makes a second reader wait rather than interleave). It reads
  with ``recv_into`` into one buffer that is reused for every frame and grows to the largest frame seen (never
  beyond ``max_frame_bytes`` and its header), each read taking as much as the socket holds: a decode step's frame
  comes header and body in one system call, and bytes of the next frame wait in the buffer for the next recv.
  Reusing the buffer matters: a fresh 0.9 MB buffer per frame cost about 2.8 ms per loopback round trip against
  0.45 ms for a reused one, the difference being page faults. So does the one read: on a hop the reader runs on
  caches cold from a stage's weights, where a second system call for the body cost 75-130 us. Decoded envelopes
  never point into that buffer (see framing.decode_body), so they outlive the next recv.

Timeouts come in two kinds:

- ``recv(timeout=...)`` waits at most that long for a frame to *start*. If none does, it raises TimeoutError
  and the connection stays usable, since no byte was consumed. The wait polls the socket rather than changing
  the socket's own timeout, which sends on other threads share.
- ``settimeout(seconds)`` sets the socket's own timeout, which bounds every blocking read and write. Expiring
  before a frame starts raises TimeoutError and leaves the connection usable; expiring in the middle of a frame
  leaves the stream at an unknown position, so the connection is closed and ConnectionClosed raised.

Any failure of the byte stream (EOF, reset, a write to a dead peer) closes the connection and raises
ConnectionClosed. A ProtocolError from a well-framed but invalid body leaves the connection open and in step (the
body was read whole), so the caller may answer with an ERROR before closing; FrameTooLarge closes it, since the
oversized body is never read.
"""
from __future__ import annotations

import collections
import ipaddress
import math
import select
import socket
import threading
import time
from typing import Callable, Mapping, TypeVar

from tc.protocol.cbor import BytesLike
from tc.protocol.errors import ConnectionClosed, FrameTooLarge
from tc.protocol.framing import DEFAULT_MAX_FRAME_BYTES, HEADER_SIZE, Envelope, decode_body, encode_frame_parts
from tc.protocol.messages import ERROR_PROTOCOL, Error, Message
from tc.trace import mark

# sendmsg takes at most IOV_MAX (1024 on Linux and macOS) buffers per call; a frame has a handful.
_MAX_PARTS_PER_CALL = 64

# What one read may take: a decode step's frame (~2 KB) and whatever follows it, header and body at once.
RECEIVE_BUFFER_BYTES = 64 * 1024


def _send_all_parts(sock: socket.socket, parts: list[BytesLike], drained: Callable[[], None]) -> None:
    """Send the buffers in order, as sendall would their concatenation, without concatenating them, calling
    `drained` each time the peer is seen to read: a round that takes bytes after one that found the buffers full.
    (A round the kernel takes whole proves nothing: a stopped peer's socket takes a few small frames so.)

    One gathering sendmsg per round; the kernel may take only some of the bytes, so the rest are resent. On a
    blocking socket each round takes what fits (MSG_DONTWAIT) and waits for room, as a blocking send would, but
    in rounds: a blocking sendmsg of a large frame returned only once all of it was taken.
    """
    if not hasattr(sock, "sendmsg"):  # Windows: no gathering send
        for part in parts:
            sock.sendall(part)
        return
    blocking = sock.gettimeout() is None  # a socket with a timeout sends in rounds already
    flags = socket.MSG_DONTWAIT if blocking else 0
    pending = [memoryview(part).cast("B") for part in parts if len(part)]
    full = False  # the last round found the buffers full, so this one's bytes went once the peer read
    while pending:
        offered = pending[:_MAX_PARTS_PER_CALL]
        try:
            sent = sock.sendmsg(offered, (), flags)
        except BlockingIOError:
            _wait_writable(sock)
            full = True
            continue
        if full and sent:
            drained()
        full = sent < sum(len(part) for part in offered)
        while pending and sent >= len(pending[0]):
            sent -= len(pending.pop(0))
        if sent:
            pending[0] = pending[0][sent:]


def _wait_writable(sock: socket.socket) -> None:
    """Wait, without a timeout, until a blocking socket has room to send (or is closed or broken: the send that
    follows then raises)."""
    poller = select.poll()
    try:
        poller.register(sock, select.POLLOUT)
    except ValueError as exc:  # closed by another thread since the send began (its descriptor is -1)
        raise OSError(f"the socket was closed ({exc})") from exc
    poller.poll()


K = TypeVar("K")


def oldest_of_busiest_host(waiting: Mapping[K, str], newcomer: str) -> K | None:
    """Of the connections still in their handshake (`waiting`, oldest first: each one's "host:port"), the one to
    close for a `newcomer` when every place is taken: the oldest of the host that holds most of them, the newcomer
    counted with its host. Connections flooding a port from one host thus close each other, not a handshake from
    another host. None where `waiting` is empty."""
    def host(peer: str) -> str:
        return peer.rpartition(":")[0]

    for busiest, _ in collections.Counter(host(peer) for peer in [*waiting.values(), newcomer]).most_common():
        oldest = next((key for key, peer in waiting.items() if host(peer) == busiest), None)
        if oldest is not None:
            return oldest
    return None


def _describe_peer(sock: socket.socket) -> str:
    try:
        address = sock.getpeername()
    except OSError:
        return "unconnected socket"
    if isinstance(address, tuple):
        host, port = address[0], address[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"unix:{address}" if address else "unix socket"


def _host(address_of) -> str | None:
    try:
        address = address_of()
    except OSError:
        return None
    return address[0] if isinstance(address, tuple) else None


def unmapped(host: str) -> str:
    """An IPv4-mapped IPv6 address (a dual-stack socket's view of an IPv4 peer) as the IPv4 address it maps: a
    machine reaches that with or without IPv6. Any other host as it is."""
    try:
        mapped = getattr(ipaddress.ip_address(host), "ipv4_mapped", None)
    except ValueError:
        return host
    return str(mapped) if mapped is not None else host


def is_loopback(host: str | None) -> bool:
    """Whether `host` is an address of this machine's loopback (127.0.0.0/8, ::1, an IPv4-mapped 127.x)."""
    try:
        return ipaddress.ip_address(unmapped(host or "")).is_loopback
    except ValueError:
        return False


class Connection:
    """Frames over one connected stream socket (TCP, or a Unix socketpair in tests)."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        if sock.type != socket.SOCK_STREAM:
            raise ValueError(f"a Connection needs a stream socket, got {sock.type!r}")
        if type(max_frame_bytes) is not int or max_frame_bytes <= 0:
            raise ValueError(f"max_frame_bytes must be a positive int, got {max_frame_bytes!r}")
        self._sock = sock
        self.max_frame_bytes = max_frame_bytes
        # which limit max_frame_bytes is and what to do about it, for the FrameTooLarge a larger frame raises (set
        # by the owner, with the limit: a handshake's fixed cap, a worker's --max-frame-mb); None: a generic word
        self.frame_limit_advice: str | None = None
        self.peer = _describe_peer(sock)  # taken now: getpeername fails once the socket is closed
        # the hosts of both ends (TCP only): where the peer is, and the address we reach it from
        self.peer_host, self.local_host = _host(sock.getpeername), _host(sock.getsockname)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # Decode steps are small request/reply messages; Nagle's algorithm would hold each one back.
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                # macOS answers EINVAL for a socket whose peer reset it before it was accepted: the connection is
                # gone, and its first read or write says so as ConnectionClosed, where the caller expects it. An
                # OSError from here would end the loop that accepted it (the peer listener's), for good.
                pass
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closed = False
        # Why a send or read here broke the connection and closed it, for the other threads that use it: the
        # reader woken by a send that timed out must say so, not that the connection was closed
        self._failure: str | None = None
        # Received bytes not yet returned as frames are buffer[_start:_end]; the buffer is reused for every frame
        # and grows to the largest one seen
        self._buffer = bytearray(RECEIVE_BUFFER_BYTES)
        self._start = self._end = 0
        self._poller = None  # a select.poll object, made by the first recv with a timeout
        # When the peer was last seen at work (time.monotonic()): bytes of a frame arrived, or it read bytes of
        # one we send. A peer in the middle of a large frame on a slow link is alive though no whole frame has
        # come or gone for a while.
        self.last_progress = time.monotonic()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Connection({self.peer}{', closed' if self._closed else ''})"

    def settimeout(self, seconds: float | None) -> None:
        """Bound every blocking socket read and write; a timeout mid-frame closes the connection (module doc)."""
        self._sock.settimeout(seconds)

    def send(self, message: Message, request_id: str | None = None, seq: int = 0) -> None:
        """Send one frame. Safe to call from several threads at once: frames never interleave.

        The message's tensors go out from their own memory, so they must not change until this returns.
        Raises TypeError/ValueError for a bad argument or a body over max_frame_bytes (nothing is sent then), and
        ConnectionClosed when the connection is closed or breaks while sending (it is closed then).
        """
        parts = encode_frame_parts(message, request_id, seq)
        mark("encoded")
        body_length = sum(len(part) for part in parts) - HEADER_SIZE
        if body_length > self.max_frame_bytes:
            raise ValueError(
                f"{message.TYPE} encodes to {body_length} bytes, over max_frame_bytes={self.max_frame_bytes}; "
                "raise max_frame_bytes on both ends or send less (a shorter prompt per prefill)"
            )
        with self._send_lock:
            if self._closed:
                raise ConnectionClosed(f"cannot send {message.TYPE}: {self._closed_why()}")
            try:
                _send_all_parts(self._sock, parts, self._progressed)
            except OSError as exc:  # includes timeouts: some unknown part of the frame went out
                waited = self._sock.gettimeout()  # None: the TimeoutError is TCP's own (ETIMEDOUT), not ours
                if isinstance(exc, TimeoutError) and waited is not None:
                    why = (f"sending {message.TYPE} to {self.peer} timed out: it took no bytes for {waited:g}s (it "
                           "stopped reading, or its machine is gone)")
                else:
                    why = f"sending {message.TYPE} to {self.peer} failed ({exc})"
                self._fail(why)
                raise ConnectionClosed(f"{why}; the connection is closed") from exc

    def recv(self, timeout: float | None = None) -> Envelope:
        """Block until one whole frame has arrived and return its envelope.

        ``timeout`` bounds the wait for a frame to start (seconds; None waits for ever). Raises TimeoutError when
        it expires (the connection stays usable), ConnectionClosed on EOF (including EOF mid-frame) or a broken
        stream, FrameTooLarge for a header over max_frame_bytes (the peer is sent an ERROR when that can be done
        without blocking, and the connection is closed), and ProtocolError for
        an invalid body (the connection stays open and in step).
        """
        with self._recv_lock:
            if self._closed:
                raise ConnectionClosed(f"cannot receive: {self._closed_why()}")
            if self._start == self._end:  # nothing of the next frame has arrived yet
                if timeout is not None and not self._wait_readable(timeout):
                    raise TimeoutError(f"no frame from {self.peer} within {timeout} s")
                self._start = self._end = 0
            self._fill(HEADER_SIZE)
            length = int.from_bytes(self._buffer[self._start:self._start + HEADER_SIZE], "big")
            if length > self.max_frame_bytes:
                error = FrameTooLarge(length, self.max_frame_bytes, self.frame_limit_advice)
                self._tell_peer(error)
                self.close()
                raise error
            self._fill(HEADER_SIZE + length)
            body_start = self._start + HEADER_SIZE
            self._start = body_start + length  # the frame is consumed whether or not its body decodes
            with memoryview(self._buffer) as whole, whole[body_start:self._start] as body:
                mark("read")
                return decode_body(body)

    def close(self) -> None:
        """Close the connection; idempotent, and wakes a thread blocked in recv (it gets ConnectionClosed)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            # shutdown, unlike close, wakes threads blocked on this socket in other threads.
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the peer is already gone (ENOTCONN): there is nothing left to shut down, closing suffices
        self._sock.close()

    def _fail(self, why: str) -> None:
        """Close the connection for a send or read that broke it; `why` is what other threads then hear."""
        if self._failure is None:
            self._failure = why
        self.close()

    def _closed_why(self) -> str:
        return self._failure or f"the connection to {self.peer} was closed"

    def _tell_peer(self, error: Exception) -> None:
        """Best effort: an ERROR frame saying why the connection is about to close, never blocking.

        Sent only when no other thread is mid-frame and the whole frame fits the socket buffer at once; a
        partial write does not matter, since the connection is closed right after.
        """
        if not hasattr(socket, "MSG_DONTWAIT") or not self._send_lock.acquire(blocking=False):
            return
        try:
            frame = b"".join(encode_frame_parts(Error(code=ERROR_PROTOCOL, message=str(error))))
            self._sock.send(frame, socket.MSG_DONTWAIT)
        except OSError:
            pass
        finally:
            self._send_lock.release()

    def _progressed(self) -> None:
        self.last_progress = time.monotonic()

    def _wait_readable(self, timeout: float) -> bool:
        # poll, not select: no FD_SETSIZE limit and no file descriptor of its own to close.
        if self._poller is None:
            poller = select.poll()
            try:
                poller.register(self._sock, select.POLLIN)
            except ValueError as exc:  # closed by another thread since recv() looked (its descriptor is -1)
                raise ConnectionClosed(f"the connection to {self.peer} was closed") from exc
            self._poller = poller
        # Closing or a hang-up also reports as an event; the read that follows then raises ConnectionClosed.
        return bool(self._poller.poll(max(0, math.ceil(timeout * 1000))))

    def _fill(self, count: int) -> None:
        """Have at least `count` bytes of the current frame buffered from `_start`, reading as many as the socket
        holds (a small frame comes whole in one read, often with the start of the next)."""
        if self._end - self._start >= count:
            return
        if self._start + count > len(self._buffer):
            pending = self._buffer[self._start:self._end]
            if count > len(self._buffer):
                # Replaced, never resized in place: views of the old buffer may still be alive (a traceback), and
                # resizing a bytearray with live views raises BufferError.
                self._buffer = bytearray(max(count, RECEIVE_BUFFER_BYTES))
            self._buffer[:len(pending)] = pending
            self._start, self._end = 0, len(pending)
        with memoryview(self._buffer) as whole:
            while self._end - self._start < count:
                self._end += self._read_some(whole[self._end:])

    def _read_some(self, view: memoryview) -> int:
        """Read what the socket has into `view` (at least one byte); a frame has started when bytes of it are
        buffered already."""
        frame_started = self._end > self._start
        try:
            count = self._sock.recv_into(view)
        except TimeoutError as exc:  # socket.timeout is TimeoutError since Python 3.10
            if not frame_started:
                raise TimeoutError(f"no frame from {self.peer} within the socket timeout") from exc
            self._fail(f"timed out in the middle of a frame from {self.peer}")
            raise ConnectionClosed(
                f"timed out in the middle of a frame from {self.peer}; the connection is closed"
            ) from exc
        except OSError as exc:
            if self._closed:  # closed here, by another thread: it says why, if a send failed
                raise ConnectionClosed(self._closed_why()) from exc
            self._fail(f"receiving from {self.peer} failed ({exc})")
            raise ConnectionClosed(f"receiving from {self.peer} failed ({exc}); the connection is closed") from exc
        if count == 0:
            if self._closed:
                raise ConnectionClosed(self._closed_why())
            if not frame_started:
                self._fail(f"{self.peer} closed the connection")
                raise ConnectionClosed(f"{self.peer} closed the connection")
            self._fail(f"{self.peer} closed the connection in the middle of a frame")
            raise ConnectionClosed(f"{self.peer} closed the connection in the middle of a frame; the frame is lost")
        self.last_progress = time.monotonic()
        return count


def connect(
    host: str, port: int, timeout: float | None = 10.0, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> Connection:
    """Open a TCP connection to ``host:port``. ``timeout`` bounds connecting only; the socket then blocks.

    Raises OSError (ConnectionRefusedError, TimeoutError, socket.gaierror...) when the peer cannot be reached.
    """
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.settimeout(None)
    return Connection(sock, max_frame_bytes=max_frame_bytes)
