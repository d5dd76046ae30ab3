"""Connection over real sockets: a socketpair and a loopback TCP listener."""
from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from tc.protocol import (
    ClearCache,
    Connection,
    ConnectionClosed,
    FrameTooLarge,
    HiddenState,
    Ping,
    Pong,
    ProtocolError,
    BatchEntry,
    RunBatch,
    connect,
    encode,
    frame_header,
)

WAIT = 10.0  # seconds any single wait may take before the test is failed rather than hung


@pytest.fixture
def pair() -> Iterator[tuple[Connection, Connection]]:
    a, b = socket.socketpair()
    left, right = Connection(a), Connection(b)
    yield left, right
    left.close()
    right.close()


@pytest.fixture
def raw_pair() -> Iterator[tuple[Connection, socket.socket]]:
    """A Connection and the raw socket at the other end, to write bytes our encoder never would."""
    a, b = socket.socketpair()
    b.settimeout(WAIT)
    conn = Connection(a, max_frame_bytes=1 << 20)
    yield conn, b
    conn.close()
    b.close()


@pytest.fixture
def tcp_pair() -> Iterator[tuple[Connection, Connection]]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        client = connect("127.0.0.1", port, timeout=WAIT)
        server.settimeout(WAIT)
        accepted, _ = server.accept()
    served = Connection(accepted)
    yield client, served
    client.close()
    served.close()


def prefill_tensor(thread: int, seq: int) -> torch.Tensor:
    # [1, 293, 896] fp32 = 1.05 MB, with contents unique to (thread, seq) so a mixed-up frame shows
    values = torch.arange(293 * 896, dtype=torch.float32).reshape(1, 293, 896)
    return values + (thread * 1_000_000 + seq)


def test_messages_arrive_in_order_over_a_socketpair(pair):
    left, right = pair
    sent = [Ping(i) for i in range(50)] + [ClearCache(), Pong(7)]
    for seq, message in enumerate(sent):
        left.send(message, request_id="r", seq=seq)
    for seq, message in enumerate(sent):
        env = right.recv(timeout=WAIT)
        assert (env.message, env.request_id, env.seq) == (message, "r", seq)


def test_two_sender_threads_never_interleave_frames(tcp_pair):
    client, served = tcp_pair
    per_thread = 12
    errors: list[BaseException] = []

    def sender(thread: int) -> None:
        try:
            for seq in range(per_thread):
                if seq % 3 == 0:
                    tensor = prefill_tensor(thread, seq)
                    entry = BatchEntry(sequence=thread, position_start=seq, length=tensor.shape[1], cache_capacity=512)
                    message = RunBatch(entries=(entry,), hidden_state=tensor)
                else:
                    message = Ping(nonce=thread * 1000 + seq)
                client.send(message, request_id=f"t{thread}", seq=seq)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=sender, args=(t,)) for t in (1, 2)]
    for thread in threads:
        thread.start()
    next_seq = {"t1": 0, "t2": 0}
    for _ in range(2 * per_thread):
        env = served.recv(timeout=WAIT)
        thread = int(env.request_id[1:])
        assert env.seq == next_seq[env.request_id]  # each sender's frames stay in its order
        next_seq[env.request_id] += 1
        if env.seq % 3 == 0:
            assert isinstance(env.message, RunBatch) and env.message.entries[0].position_start == env.seq
            assert torch.equal(env.message.hidden_state.tensor(), prefill_tensor(thread, env.seq))
        else:
            assert env.message == Ping(nonce=thread * 1000 + env.seq)
    for thread in threads:
        thread.join(WAIT)
    assert not errors
    assert next_seq == {"t1": per_thread, "t2": per_thread}


def send_in_background(conn: Connection, *messages: object) -> threading.Thread:
    """Send from another thread: a frame larger than the socket buffers blocks until the reader drains it."""
    thread = threading.Thread(target=lambda: [conn.send(m) for m in messages], daemon=True)
    thread.start()
    return thread


def test_received_tensors_survive_the_buffer_being_reused(pair):
    left, right = pair
    first, second = prefill_tensor(1, 0), prefill_tensor(2, 0)
    replies = HiddenState(first, compute_seconds=0.5), HiddenState(second, compute_seconds=0.0)
    sender = send_in_background(left, *replies)
    got_first = right.recv(timeout=WAIT).message.hidden_state.tensor()
    buffer = right._buffer
    got_second = right.recv(timeout=WAIT).message.hidden_state.tensor()
    sender.join(WAIT)
    assert right._buffer is buffer  # same size: reused, not reallocated
    assert torch.equal(got_first, first) and torch.equal(got_second, second)


@pytest.mark.parametrize("chunks", [[1], [7, 3000], [1 << 30]], ids=["byte-by-byte", "ragged", "all-at-once"])
def test_frames_come_out_whole_however_their_bytes_arrive(raw_pair, chunks):
    """A read takes what the socket holds: part of a header, a frame and the start of the next, a body larger than
    the buffer so far. Each recv still returns one whole frame, in order, and nothing is lost between them."""
    conn, raw = raw_pair
    big = HiddenState(torch.arange(1 * 70 * 896, dtype=torch.float32).reshape(1, 70, 896), compute_seconds=0.25)
    stream = encode(Ping(1)) + encode(big) + encode(Ping(2)) + encode(Ping(3))

    def write() -> None:
        at, sizes = 0, itertools.cycle(chunks)
        while at < len(stream):
            size = next(sizes)
            raw.sendall(stream[at:at + size])
            at += size
            if size < 100 and at < 200:  # slow through the first frame's header and body
                time.sleep(0.001)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    assert conn.recv(timeout=WAIT).message == Ping(1)
    got = conn.recv(timeout=WAIT).message
    assert got.hidden_state == big.hidden_state and got.compute_seconds == 0.25
    assert [conn.recv(timeout=WAIT).message for _ in range(2)] == [Ping(2), Ping(3)]
    writer.join(WAIT)
    with pytest.raises(TimeoutError):
        conn.recv(timeout=0.05)  # every byte was a frame's: nothing left over
    assert not conn.closed


def test_tcp_peer_name_and_nodelay(tcp_pair):
    client, served = tcp_pair
    assert client.peer == f"127.0.0.1:{served._sock.getsockname()[1]}"
    assert served.peer.startswith("127.0.0.1:")
    assert client._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    decode_step = RunBatch(entries=(BatchEntry(sequence=2, position_start=3, length=1, cache_capacity=8),),
                           hidden_state=torch.ones(1, 1, 896, dtype=torch.bfloat16))
    client.send(decode_step, request_id="q", seq=9)
    env = served.recv(timeout=WAIT)
    assert (env.request_id, env.seq, env.message.entries[0].position_start) == ("q", 9, 3)


@pytest.mark.parametrize(
    "sent_bytes", [0, 3, 8, 8 + 5], ids=["at-boundary", "mid-header", "after-header", "mid-body"]
)
def test_eof_raises_connection_closed(raw_pair, sent_bytes):
    conn, raw = raw_pair
    raw.sendall(encode(Ping(1)) + encode(Ping(2))[:sent_bytes])
    raw.close()
    assert conn.recv(timeout=WAIT).message == Ping(1)
    with pytest.raises(ConnectionClosed, match="middle of a frame" if sent_bytes else "closed the connection"):
        conn.recv(timeout=WAIT)
    assert conn.closed
    with pytest.raises(ConnectionClosed):
        conn.recv()


def test_oversized_header_raises_frame_too_large_and_closes(raw_pair):
    conn, raw = raw_pair
    raw.sendall(frame_header(conn.max_frame_bytes + 1))
    with pytest.raises(FrameTooLarge):
        conn.recv(timeout=WAIT)
    assert conn.closed


def test_invalid_body_raises_but_keeps_the_stream_in_step(raw_pair):
    conn, raw = raw_pair
    garbage = b"\xff\x00\x01"
    raw.sendall(frame_header(len(garbage)) + garbage + encode(Pong(3)))
    with pytest.raises(ProtocolError):
        conn.recv(timeout=WAIT)
    assert not conn.closed
    assert conn.recv(timeout=WAIT).message == Pong(3)


def test_recv_timeout_before_a_frame_leaves_the_connection_usable(pair):
    left, right = pair
    with pytest.raises(TimeoutError):
        right.recv(timeout=0.05)
    left.send(Ping(4))
    assert right.recv(timeout=WAIT).message == Ping(4)


def test_a_timed_recv_on_a_socket_closed_under_it_says_the_connection_is_closed(raw_pair):
    """Another thread may close the connection between recv's look at it and its first wait for a frame (a worker's
    handshake read, while its signal's farewell closes the connection): the wait found a socket whose descriptor
    is -1 and raised ValueError, which no caller takes for a closed connection."""
    conn, _ = raw_pair
    conn._sock.close()  # where close() has got to when the race strikes: the socket gone, the flag not yet read
    with pytest.raises(ConnectionClosed, match="was closed"):
        conn.recv(timeout=1)


def test_socket_timeout_at_a_boundary_is_retryable(pair):
    left, right = pair
    right.settimeout(0.05)
    with pytest.raises(TimeoutError):
        right.recv()
    assert not right.closed
    left.send(Ping(5))
    assert right.recv().message == Ping(5)


def test_socket_timeout_mid_frame_closes(raw_pair):
    conn, raw = raw_pair
    raw.sendall(encode(Ping(1))[:10])
    conn.settimeout(0.1)
    with pytest.raises(ConnectionClosed, match="timed out in the middle of a frame"):
        conn.recv()
    assert conn.closed


def test_close_is_idempotent_and_wakes_a_blocked_reader(pair):
    left, right = pair
    outcome: list[BaseException] = []

    def reader() -> None:
        try:
            right.recv()
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    thread.join(0.1)
    right.close()
    right.close()
    thread.join(WAIT)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], ConnectionClosed)
    with pytest.raises(ConnectionClosed):
        right.send(Ping(1))


def test_send_to_a_closed_peer_raises_connection_closed(pair):
    left, right = pair
    right.close()
    with pytest.raises(ConnectionClosed, match="failed"):
        for _ in range(100):  # the first writes may still land in the kernel's buffer on some systems
            left.send(HiddenState(prefill_tensor(0, 0), compute_seconds=0.0))
    assert left.closed


def test_a_reader_woken_by_a_send_that_timed_out_hears_why(pair):
    """A send that times out (the other end stopped reading) closes the connection; the thread reading from it
    must hear that, not that the connection was closed, or its owner words the loss as the other end's doing."""
    left, right = pair  # right never reads
    left.settimeout(0.2)
    heard: list[BaseException] = []

    def reader() -> None:
        while True:
            try:
                left.recv()
            except TimeoutError:
                continue  # the socket's timeout bounds reads too: nothing came, and the reader waits on
            except BaseException as exc:
                heard.append(exc)
                return

    thread = threading.Thread(target=reader)
    thread.start()
    with pytest.raises(ConnectionClosed, match="timed out") as sent:
        for _ in range(1000):  # until the socket buffers are full
            left.send(Ping(1, payload=bytes(1 << 16)))
    thread.join(WAIT)
    assert not thread.is_alive()
    why = f"sending PING to {left.peer} timed out: it took no bytes for 0.2s"
    assert str(sent.value).startswith(why)
    assert len(heard) == 1 and isinstance(heard[0], ConnectionClosed) and why in str(heard[0]), heard
    with pytest.raises(ConnectionClosed, match=f"cannot send PING: {why}"):
        left.send(Ping(2))


def test_send_over_the_cap_is_refused_before_anything_is_sent():
    a, b = socket.socketpair()
    with Connection(a, max_frame_bytes=1000) as small, Connection(b) as other:
        with pytest.raises(ValueError, match="max_frame_bytes"):
            small.send(HiddenState(torch.zeros(1, 1, 896), compute_seconds=0.0))
        small.send(Ping(1))
        assert other.recv(timeout=WAIT).message == Ping(1)


def test_send_misuse_raises_type_error(pair):
    left, _ = pair
    with pytest.raises(TypeError):
        left.send("PING")
    assert not left.closed


def test_connect_to_nothing_raises_os_error():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
    with pytest.raises(OSError):
        connect("127.0.0.1", port, timeout=WAIT)


def test_a_send_marks_progress_only_while_the_peer_reads():
    """last_progress, what the head's heartbeat watch counts besides whole frames: a large frame sent to a peer
    that reads slowly keeps moving it; small frames the kernel takes whole into a stopped peer's buffers, and a
    large one once those are full, do not (a stopped worker must still be found silent)."""
    a, b = socket.socketpair()
    for sock in (a, b):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
    sender = Connection(a)
    try:
        before = sender.last_progress
        for _ in range(3):
            sender.send(Ping(nonce=1))  # taken whole into buffers nobody reads
        assert sender.last_progress == before
        done = threading.Event()
        threading.Thread(target=lambda: (sender.send(Pong(nonce=2, payload=b"p" * 400_000)), done.set()),
                         daemon=True).start()
        time.sleep(0.3)
        stalled = sender.last_progress  # the buffers are full, and nobody reads
        time.sleep(0.3)
        assert sender.last_progress == stalled and not done.is_set()
        marks = []
        while not done.is_set():  # a slow reader: ~4 KB every 10 ms
            b.recv(4096)
            marks.append(sender.last_progress)
            time.sleep(0.01)
        assert len(set(marks)) > 10 and marks[-1] > stalled
    finally:
        sender.close()
        b.close()


def test_close_wakes_a_sender_waiting_for_room(pair):
    """A large frame to a peer that reads nothing waits for room between its rounds; closing the connection (as
    the head's watch does to a silent worker) ends that wait with ConnectionClosed."""
    left, _right = pair
    failure: list[BaseException] = []

    def send() -> None:
        try:
            left.send(Pong(nonce=1, payload=b"p" * 4_000_000))
        except BaseException as exc:  # noqa: BLE001 - the test reads what it was
            failure.append(exc)
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    time.sleep(0.3)
    assert sender.is_alive()  # waiting: nobody reads
    left.close()
    sender.join(WAIT)
    assert not sender.is_alive() and len(failure) == 1 and isinstance(failure[0], ConnectionClosed), failure


def test_the_handshake_closed_for_a_newcomer_is_the_oldest_of_the_busiest_host():
    from tc.protocol.connection import oldest_of_busiest_host

    waiting = {"w": "10.0.0.2:5000", "f1": "10.0.0.9:1", "f2": "10.0.0.9:2", "v6": "[fe80::1]:7"}
    assert oldest_of_busiest_host(waiting, "10.0.0.9:3") == "f1"  # the flooding host's own oldest
    assert oldest_of_busiest_host(waiting, "10.0.0.2:5001") == "w"  # 10.0.0.2 ties it, and is older
    assert oldest_of_busiest_host({"w": "10.0.0.2:5000", "v6": "[fe80::1]:7"}, "[fe80::1]:8") == "v6"
    assert oldest_of_busiest_host({"w": "10.0.0.2:5000"}, "10.0.0.3:1") == "w"  # the newcomer's host holds none
    assert oldest_of_busiest_host({}, "10.0.0.3:1") is None
