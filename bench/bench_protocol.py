"""Round-trip latency of the wire protocol over loopback TCP.

An echo thread plays the worker: it receives RUN_DECODE / RUN_PREFILL and answers HIDDEN_STATE with the same
tensor, so one round trip is two frames, each encoded, sent, received and decoded. Also prints the pure
encode + decode cost of each frame, without sockets, to show what the socket itself adds.

    python bench/bench_protocol.py [--rounds 2000]
"""
from __future__ import annotations

import argparse
import platform
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tc.protocol import (  # noqa: E402
    Connection,
    ConnectionClosed,
    HiddenState,
    Message,
    RunDecode,
    RunPrefill,
    connect,
    decode_body,
    encode_body,
)


def echo_worker(conn: Connection) -> None:
    """Answer every command with its own hidden state, until the client hangs up."""
    try:
        while True:
            env = conn.recv()
            reply = HiddenState(hidden_state=env.message.hidden_state, compute_seconds=0.0)
            conn.send(reply, request_id=env.request_id, seq=env.seq)
    except ConnectionClosed:
        conn.close()


def percentiles(samples_ns: list[int]) -> tuple[float, float, float]:
    """(p10, median, p90) in microseconds."""
    deciles = statistics.quantiles(samples_ns, n=10)
    return deciles[0] / 1e3, statistics.median(samples_ns) / 1e3, deciles[-1] / 1e3


def time_round_trips(client: Connection, make: Callable[[int], Message], rounds: int) -> list[int]:
    for i in range(min(50, rounds)):  # warm-up: grows the receive buffers, warms caches
        client.send(make(i), request_id="warm", seq=i)
        client.recv()
    samples = []
    for i in range(rounds):
        message = make(i)
        start = time.perf_counter_ns()
        client.send(message, request_id="bench", seq=i)
        env = client.recv()
        samples.append(time.perf_counter_ns() - start)
        assert env.seq == i
    return samples


def time_codec(message: Message, rounds: int) -> tuple[list[int], int]:
    samples = []
    for i in range(rounds):
        start = time.perf_counter_ns()
        body = encode_body(message, request_id="bench", seq=i)
        decode_body(body)
        samples.append(time.perf_counter_ns() - start)
    return samples, len(body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000, help="round trips for the decode-sized case")
    parser.add_argument("--prefill-rounds", type=int, default=200, help="round trips for the prefill-sized case")
    args = parser.parse_args()
    torch.set_num_threads(1)

    decode_state = torch.randn(1, 1, 896).to(torch.bfloat16)  # [1, 1, hidden]
    prefill_state = torch.randn(1, 512, 896)  # [1, 512, hidden] fp32
    cases = [
        ("decode  [1,1,896] bf16", lambda i: RunDecode(position=i, hidden_state=decode_state), args.rounds),
        ("prefill [1,512,896] fp32", lambda i: RunPrefill(position_start=0, cache_capacity=1024, hidden_state=prefill_state), args.prefill_rounds),
    ]

    with socket.create_server(("127.0.0.1", 0)) as server:
        client = connect("127.0.0.1", server.getsockname()[1])
        accepted, _ = server.accept()
    worker = threading.Thread(target=echo_worker, args=(Connection(accepted),), daemon=True)
    worker.start()

    print(f"python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}, loopback TCP")
    print(f"{'case':26} {'frame':>10} {'round trip µs (p10 / median / p90)':>38} {'encode+decode µs':>18}")
    for name, make, rounds in cases:
        trips = time_round_trips(client, make, rounds)
        codec, body_bytes = time_codec(make(0), rounds)
        p10, median, p90 = percentiles(trips)
        print(f"{name:26} {body_bytes + 8:>9}B {p10:>14.1f} / {median:>8.1f} / {p90:>8.1f} {statistics.median(codec) / 1e3:>18.1f}")
    client.close()
    worker.join(5)


if __name__ == "__main__":
    main()
