"""Round-trip latency of the wire protocol over loopback TCP.

An echo process plays the worker: it connects to this process (the head), receives RUN_BATCH (one decode row,
or a 512-row prefill) and answers HIDDEN_STATE with the same tensor, so one round trip is two frames, each
encoded, sent, received and decoded. A separate process, as in a real cluster, so the two ends do not share a GIL. Also prints the pure
encode and decode cost of each frame, without sockets, to show what the socket itself adds: in a loop (hot), and
each after reading 200 MiB through the caches (cold: what a worker's codec costs right after its stage's weights
went through the caches, bench/trace_hops.py's figures).

    python bench/bench_protocol.py [--rounds 2000]
"""
from __future__ import annotations

import argparse
import multiprocessing
import platform
import socket
import statistics
import sys
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
    BatchEntry,
    RunBatch,
    connect,
    decode_body,
    encode_body,
    encode_frame_parts,
)


SWEEP_BYTES = 200 * 1024 * 1024  # read before each cold call: larger than any cache a CPU has


def echo_worker(port: int) -> None:
    """Connect to the head and answer every command with its own hidden state, until the head hangs up."""
    torch.set_num_threads(1)
    conn = connect("127.0.0.1", port)
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


def time_codec(message: Message, rounds: int, sweep: torch.Tensor | None = None) -> tuple[float, float, int]:
    """Median µs to encode the frame (as the connection does, without joining) and to decode its body. With
    `sweep`, a large tensor is read through before each encode and each decode, as a stage's weights are before a
    worker sends its output: the code and data the codec runs from are then out of the caches, as in a cluster."""
    encode_ns, decode_ns = [], []
    body = encode_body(message)
    for i in range(rounds):
        if sweep is not None:
            sweep.sum()
        start = time.perf_counter_ns()
        encode_frame_parts(message, request_id="bench", seq=i)
        encode_ns.append(time.perf_counter_ns() - start)
        if sweep is not None:
            sweep.sum()
        start = time.perf_counter_ns()
        decode_body(body)
        decode_ns.append(time.perf_counter_ns() - start)
    return statistics.median(encode_ns) / 1e3, statistics.median(decode_ns) / 1e3, len(body)


def run_batch(position: int, hidden: torch.Tensor) -> RunBatch:
    """One sequence's step: `hidden`'s rows from `position`."""
    entry = BatchEntry(sequence=1, position_start=position, length=hidden.shape[1],
                       cache_capacity=position + hidden.shape[1] + 1024)
    return RunBatch(entries=(entry,), hidden_state=hidden)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000, help="round trips for the decode-sized case")
    parser.add_argument("--prefill-rounds", type=int, default=200, help="round trips for the prefill-sized case")
    parser.add_argument("--cold-rounds", type=int, default=100, help="encodes and decodes timed after a cache sweep")
    args = parser.parse_args()
    torch.set_num_threads(1)

    decode_state = torch.randn(1, 1, 896).to(torch.bfloat16)  # [1, 1, hidden]
    prefill_state = torch.randn(1, 512, 896)  # [1, 512, hidden] fp32
    cases = [
        ("decode  [1,1,896] bf16", lambda i: run_batch(i, decode_state), args.rounds),
        ("prefill [1,512,896] fp32", lambda i: run_batch(0, prefill_state), args.prefill_rounds),
    ]

    with socket.create_server(("127.0.0.1", 0)) as server:
        worker = multiprocessing.get_context("spawn").Process(target=echo_worker, args=(server.getsockname()[1],))
        worker.start()
        server.settimeout(60)
        accepted, _ = server.accept()
    head = Connection(accepted)

    print(f"python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}, "
          f"{multiprocessing.cpu_count()} CPUs, loopback TCP, echo in a second process")
    sweep = torch.ones(SWEEP_BYTES // 4)  # fp32
    print(f"{'case':26} {'frame':>10} {'round trip µs (p10 / median / p90)':>36} {'encode µs':>10} "
          f"{'decode µs':>10} {'cold encode':>12} {'cold decode':>12}")
    for name, make, rounds in cases:
        trips = time_round_trips(head, make, rounds)
        encode_us, decode_us, body_bytes = time_codec(make(0), rounds)
        cold_encode_us, cold_decode_us, _ = time_codec(make(0), min(rounds, args.cold_rounds), sweep)
        p10, median, p90 = percentiles(trips)
        print(f"{name:26} {body_bytes + 8:>9}B {p10:>12.1f} / {median:>8.1f} / {p90:>8.1f} "
              f"{encode_us:>10.1f} {decode_us:>10.1f} {cold_encode_us:>12.1f} {cold_decode_us:>12.1f}")
    print(f"cold: after reading {SWEEP_BYTES >> 20} MiB through the caches before each call, as a stage's weights "
          "are read before its output is sent")
    head.close()
    worker.join(10)

if __name__ == "__main__":
    main()
