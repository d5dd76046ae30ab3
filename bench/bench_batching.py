"""Many streams at once: tc's continuous batching through head + 2 workers, beside llama.cpp's server.

    python bench/bench_batching.py [--modes fp16 int4] [--streams 1 2 4 8] [--tokens 48] [--only tc|llamacpp]
                                   [--micro-batches 1 2]

For each weight mode and each count N of concurrent streams, N clients each stream a greedy completion of --tokens
tokens (``ignore_eos``, so every stream makes exactly that many) from a short prompt of its own, all at once:

- aggregate decode tokens/s: every stream's tokens after its first, over the time from the first of those tokens
  to the last (the prefills are left out, as in a decode rate); and the same rate over only the time when all N
  streams stream (from the last stream's first token to the first stream's last), without the steps in which
  some have not started yet (their prompts being read) or have already ended;
- inter-token latency: the median gap between two tokens of one stream, over every stream;
- ratios against N = 1 in the same run;
- TTFT under load: with N - 1 streams running, the time to first token of one more request, against its idle
  TTFT (same prompt) plus the idle TTFT of a prompt one prefill chunk long (the head's ``prefill_chunk``
  positions), for N = max(--streams): the target is a ratio of at most 1.

tc runs as head + 2 workers on loopback (real processes, 2 threads each; bf16 compute, tc fp16 weights beside GGUF
bf16, tc int4 beside Q4_0, as bench/vs_llamacpp.py pairs them). llama.cpp runs as one ``llama-server`` process
with ``-np N`` slots and continuous batching (``-cb``), 2 threads, the same prompts through its OpenAI-compatible
``/v1/completions``. The llama.cpp build and GGUF files are bench/vs_llamacpp.py's (built on its first use).
Memory: the planned worst case per sequence on each node (its KV cache at the model's full context, from the head's
/v1/cluster), and what the workers' RSS grew by while max(--streams) streams ran (sampled every 50 ms, against the
RSS just before), beside what their caches hold for those streams' positions. Nothing is asserted; the figures depend on
the machine and on what else runs on it: read ratios measured in one run.
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from _demo import demo_model_dir  # noqa: E402
from cluster import Cluster, Process, free_port, write_topology  # noqa: E402
import vs_llamacpp  # noqa: E402
from tc.model.tokenizer import TextTokenizer  # noqa: E402
from tc.topology import DEFAULT_PREFILL_CHUNK  # noqa: E402

THREADS = vs_llamacpp.THREADS
PROMPTS = ["def fibonacci(n):", "import json\n\ndef load(path):", "class Stack:", "# sort a list of numbers\n",
           "SELECT name FROM", "for i in range(10):", "def parse_args():", "const express = require("]


def stream_once(host: str, port: int, body: dict) -> list[float]:
    """POST a streamed completion; the arrival time of each token-carrying event."""
    conn = http.client.HTTPConnection(host, port, timeout=600)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
    times = []
    for line in response:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("choices") and event["choices"][0].get("text"):
            times.append(time.perf_counter())
    conn.close()
    return times


def concurrent(host: str, port: int, model: str, streams: int, tokens: int) -> dict:
    """`streams` streamed completions at once; aggregate decode tokens/s and the median inter-token gap."""
    results: list[list[float]] = [[] for _ in range(streams)]
    start = threading.Barrier(streams)

    def one(i: int) -> None:
        start.wait(60)
        body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}
        results[i] = stream_once(host, port, body)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    firsts = [r[0] for r in results if r]
    lasts = [r[-1] for r in results if r]
    decoded = sum(len(r) - 1 for r in results)
    gaps = [b - a for r in results for a, b in zip(r, r[1:])]
    # while every stream streams: from the last stream's first token to the first stream's last one
    both_from, both_to = max(firsts), min(lasts)
    inside = sum(1 for r in results for t in r[1:] if both_from < t <= both_to)
    return {"tokens_per_s": decoded / max(max(lasts) - min(firsts), 1e-9),
            "all_streaming_per_s": inside / (both_to - both_from) if both_to > both_from else 0.0,
            "itl_ms": 1000 * statistics.median(gaps) if gaps else 0.0, "events": sum(len(r) for r in results)}


def chunk_prompt(positions: int) -> list[int]:
    """Token ids of a prompt exactly `positions` long: what one prefill chunk of the head reads."""
    ids = TextTokenizer.load(demo_model_dir()).encode("\n".join(PROMPTS) * 64)
    return list(ids[:positions])


def ttft_under_load(host: str, port: int, model: str, others: int, tokens: int, chunk: int) -> dict:
    """TTFT of one short request idle and while `others` streams run, and of a one-chunk prompt idle (seconds).

    The target: the loaded TTFT at most the idle one plus what one prefill chunk takes (the chunk prompt's TTFT)."""
    body = {"model": model, "prompt": PROMPTS[-1] * 8, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    chunk_body = {**body, "prompt": chunk_prompt(chunk)}  # tokenized here, before any clock starts
    sent = time.perf_counter()
    idle = stream_once(host, port, body)[0] - sent
    sent = time.perf_counter()
    one_chunk = stream_once(host, port, chunk_body)[0] - sent
    running = [threading.Thread(target=stream_once, args=(host, port, {
        "model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens * 3, "temperature": 0,
        "ignore_eos": True})) for i in range(others)]
    for thread in running:
        thread.start()
    time.sleep(2.0)  # every other stream is decoding
    sent = time.perf_counter()
    loaded = stream_once(host, port, body)[0] - sent
    for thread in running:
        thread.join()
    return {"idle": idle, "loaded": loaded, "chunk": chunk, "one_chunk": one_chunk}


def measure(host: str, port: int, model: str, args: argparse.Namespace, chunk: int) -> dict:
    concurrent(host, port, model, 1, 4)  # warm-up
    rows = {n: concurrent(host, port, model, n, args.tokens) for n in args.streams}
    rows["ttft"] = ttft_under_load(host, port, model, max(args.streams) - 1, args.tokens, chunk)
    return rows


class RssPeak:
    """The highest RSS of some processes while it runs, sampled every 50 ms (a context manager)."""

    def __init__(self, pids: list[int]):
        import psutil
        self.processes = [psutil.Process(pid) for pid in pids]
        self.before = [p.memory_info().rss for p in self.processes]
        self.peak = list(self.before)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = [max(a, p.memory_info().rss) for a, p in zip(self.peak, self.processes)]

    def __enter__(self) -> "RssPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


NODES = ("w1", "w2")


@contextlib.contextmanager
def demo_cluster(mode: str, workdir: Path, name: str, **head) -> Iterator[Cluster]:
    """Head + 2 workers serving the demo model in `mode` (bf16 compute, THREADS each), ready; `head` settings
    beside the head's threads; `name` tells its topology file from others in `workdir`."""
    nodes = [{"id": node, "device": "cpu"} for node in NODES]
    # one token a step (no drafts): these figures are decode steps' (bench_drafts.py measures drafts)
    topology = write_topology(workdir / f"topology-{name}.yaml", demo_model_dir(), nodes, quant=mode, dtype="bf16",
                              head={"threads": THREADS, "draft_tokens": 0, **head})
    with Cluster(topology, workdir) as cluster:
        cluster.start_head()
        cluster.wait_api(timeout=300)
        for node in NODES:
            cluster.start_worker(node, "--threads", str(THREADS))
        cluster.wait_ready(timeout=900)
        yield cluster


def tc_rows(mode: str, args: argparse.Namespace, workdir: Path, micro_batches: int) -> dict:
    model_dir = demo_model_dir()
    with demo_cluster(mode, workdir, mode, max_batch=max(args.streams), micro_batches=micro_batches) as cluster:
        state = cluster.get("/v1/cluster")[1]
        rows = measure("127.0.0.1", cluster.api_port, model_dir.name, args, state["batch"]["prefill_chunk"])
        plan = state["plan"]
        rows["kv"] = {s["node_id"]: s["kv_bytes_per_sequence"] for s in plan["stages"]}
        streams = max(args.streams)
        with RssPeak([cluster.workers[node].proc.pid for node in NODES]) as rss:
            concurrent("127.0.0.1", cluster.api_port, model_dir.name, streams, args.tokens)
        # what the caches of those streams hold: their positions (prompt + tokens) at the planned bytes per position
        context = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
        positions = 16 + args.tokens  # a short prompt and the tokens asked for: the capacity each cache is made with
        rows["rss"] = {node: (peak - before, streams * rows["kv"][node] * positions / context)
                       for node, before, peak in zip(NODES, rss.before, rss.peak)}
    return rows


@contextlib.contextmanager
def llama_server(mode: str, slots: int, context: int, workdir: Path) -> Iterator[int]:
    """llama.cpp's server on the demo model's GGUF for `mode` (bench/vs_llamacpp.py builds both on first use),
    `slots` sequences at once with continuous batching, 2 threads; yields its port once it answers."""
    cache = vs_llamacpp.llamacpp_cache()
    src = vs_llamacpp.fetch_source(cache)  # each step reuses what an earlier run left in the cache
    bin_dir = vs_llamacpp.build_llamacpp(src, cache, vs_llamacpp.this_machines_cpu_options(), skip_build=False)
    gguf = vs_llamacpp.convert_models(src, bin_dir, cache, [mode], skip_build=False)[mode]
    port = free_port()
    server = Process([str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                      "-t", str(THREADS), "-tb", str(THREADS), "-np", str(slots), "-cb",
                      "-c", str(context), "--no-webui"], workdir / f"llama-server-{mode}.log")
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or server.proc.poll() is not None:
                raise RuntimeError(f"llama-server did not start:\n{server.output()[-3000:]}")
            time.sleep(0.5)
        yield port
    finally:
        server.stop()


def llamacpp_rows(mode: str, args: argparse.Namespace, workdir: Path) -> dict:
    slots = max(args.streams)
    with llama_server(mode, slots, slots * 1024, workdir) as port:
        return measure("127.0.0.1", port, "model", args, DEFAULT_PREFILL_CHUNK)  # tc's chunk, for a like figure


def table(results: dict[tuple[str, str], dict], args: argparse.Namespace) -> str:
    lines = ["| mode | setup | streams | aggregate decode tok/s | x 1 stream | while all stream tok/s | x 1 stream | "
             "inter-token ms | x 1 stream |", "|---|---|---|---|---|---|---|---|---|"]
    for (mode, setup), rows in results.items():
        one = rows[args.streams[0]]
        for n in args.streams:
            row = rows[n]
            lines.append(f"| {mode} | {setup} | {n} | {row['tokens_per_s']:.1f} | "
                         f"{row['tokens_per_s'] / one['tokens_per_s']:.2f} | {row['all_streaming_per_s']:.1f} | "
                         f"{row['all_streaming_per_s'] / max(one['all_streaming_per_s'], 1e-9):.2f} | "
                         f"{row['itl_ms']:.1f} | {row['itl_ms'] / one['itl_ms']:.2f} |")
    lines += ["", "| mode | setup | idle TTFT s | one chunk's TTFT s | TTFT with others streaming s | "
              "x (idle + one chunk) | KV per sequence at full context | "
              "worker RSS growth with the most streams (their caches' size) |", "|---|---|---|---|---|---|---|---|"]
    for (mode, setup), rows in results.items():
        ttft = rows["ttft"]
        idle, loaded, one_chunk = ttft["idle"], ttft["loaded"], ttft["one_chunk"]
        kv = ", ".join(f"{node} {n / 2**20:.0f} MiB" for node, n in rows.get("kv", {}).items()) or "-"
        rss = ", ".join(f"{node} +{grown / 2**20:.1f} MiB ({caches / 2**20:.1f} MiB)"
                        for node, (grown, caches) in rows.get("rss", {}).items()) or "-"
        lines.append(f"| {mode} | {setup} | {idle:.3f} | {one_chunk:.3f} ({ttft['chunk']} positions) | {loaded:.3f} | "
                     f"{loaded / (idle + one_chunk):.2f} | {kv} | {rss} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["fp16", "int4"], choices=["fp16", "int8", "int4"])
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--only", choices=["tc", "llamacpp"])
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[1],
                        help="tc's head.micro_batches settings to run (e.g. 1 2)")
    args = parser.parse_args()
    args.streams = sorted(args.streams)
    results: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="tc-bench-batching-") as tmp:
        for mode in args.modes:
            for micro_batches in args.micro_batches if args.only != "llamacpp" else []:
                setup = "tc head+2" + (f" ({micro_batches} micro-batches)" if micro_batches > 1 else "")
                results[(mode, setup)] = tc_rows(mode, args, Path(tmp), micro_batches)
                print(table(results, args), flush=True)
            if args.only != "tc":
                results[(mode, "llama-server")] = llamacpp_rows(mode, args, Path(tmp))
                print(table(results, args), flush=True)
    print(table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
