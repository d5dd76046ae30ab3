"""Where a hop's time goes: each hand-off of a decode step through head + N workers, from tc's own trace marks.

bench/budget_cluster.py gives each hop's time (the round trip less the stages' computes); this splits it. The head
and N workers start on loopback (real processes, tc's own CLI, the demo model) with TC_TRACE_DIR set, so that
every process marks the moments a step passes (tc/trace.py); after a warm-up, one greedy completion of --tokens
tokens runs, and each decode step is laid out from the marks, head and workers on one clock:

    head send -> encoded                   the head builds the step's message and encodes its frame
    head encoded -> sent                   the send's system call
    head encoded -> w1 read                the whole transfer: that call, the socket, waking w1's reader, reading
                                           the frame (timed from the end of encoding, not from the call's return:
                                           on shared cores the reader often has the frame before the sender's call
                                           returns)
    w1 read -> received                    decoding the frame
    w1 received -> computing               the reader hands the step to the compute thread
    w1 computing -> compute                checks and cache bookkeeping before the stage computes
    w1 compute -> computed                 the stage (what the worker reports as its compute)
    w1 computed -> encoded                 building the output's message and encoding its frame
    w1 encoded -> passed                   sending it to w2
    w1 encoded -> w2 read                  ... the whole transfer, and so on to the last worker, which answers
    w2 encoded -> head read                the whole transfer to the head
    head read -> received                  decoding the answer
    head received -> woke                  the head's reader hands the answer to the step's thread
    head woke -> chosen                    the final norm, the lm_head and sampling
    head chosen -> next send               the head between two steps: streaming the token out, bookkeeping,
                                           embedding the next input (from a step to the next one traced)

Prints each segment's median, 10th and 90th percentile in microseconds, and per step the stages' compute, the
hand-offs (every segment above but the stages', the head's lm_head and sampling, and its time between steps:
what the hops cost), and that per hop.

    python bench/trace_hops.py [--quant int4] [--workers 2] [--tokens 64] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from cluster import Cluster, write_topology  # noqa: E402
from tc.trace import SENT, decode_steps, read_events  # noqa: E402


def traced_steps(model_dir: Path, quant: str, workers: int, tokens: int, threads: int) -> list:
    """The decode steps of one completion through head + `workers` on loopback, as tc.trace.decode_steps gives them."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        trace_dir = tmp_path / "trace"
        trace_dir.mkdir()
        nodes = [{"id": f"w{i + 1}", "device": "cpu", "threads": threads} for i in range(workers)]
        # one token a step (no drafts): these figures are decode steps' (bench_drafts.py measures drafts)
        topology = write_topology(tmp_path / "topology.yaml", model_dir, nodes, quant=quant, dtype="bf16",
                                  head={"threads": threads, "draft_tokens": 0})
        with Cluster(topology, tmp_path, env={"TC_TRACE_DIR": str(trace_dir)}) as cluster:
            cluster.start_head()
            cluster.wait_api(timeout=300)
            for node in nodes:
                cluster.start_worker(node["id"], "--no-bench", "--threads", str(threads))
            cluster.wait_ready(timeout=600)
            body = {"model": model_dir.name, "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0}
            cluster.post("/v1/completions", body)  # warm-up
            since = time.perf_counter_ns()  # the same clock as the marks
            status, reply = cluster.post("/v1/completions", {**body, "max_tokens": tokens, "ignore_eos": True})
            if status != 200:
                raise SystemExit(f"the head answered {status}: {reply}")
        return decode_steps(read_events(trace_dir), workers, since)


def segments(steps: list) -> list[tuple[str, list[float]]]:
    """(label, microseconds per step) for each pair of consecutive marks, in the chain's order; but a frame's
    arrival is timed from the start of its send, not from the sender's call returning: on shared cores the reader
    often has the frame first (the woken receiver takes the core from the sender), so the whole transfer is the
    figure that means something, the sender's call beside it."""
    chain = steps[0]
    pairs = [(i - 1 if chain[i][1] in SENT else i, i + 1) for i in range(len(chain) - 1)]
    labels = [f"{chain[a][0]} {chain[a][1]} -> {chain[b][0]} {chain[b][1]}" for a, b in pairs]
    return [(label, [(step[b][2] - step[a][2]) / 1e3 for step in steps]) for label, (a, b) in zip(labels, pairs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quant", default="int4", choices=["fp16", "int8", "int4"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from _demo import demo_model_dir

    steps = traced_steps(demo_model_dir(), args.quant, args.workers, args.tokens, args.threads)
    if not steps:
        raise SystemExit("no step went head -> workers -> head with direct hops; nothing to show")
    print(f"{len(steps)} decode steps, {args.quant}, head + {args.workers} workers on loopback, "
          f"{args.threads} threads each (microseconds)")
    print(f"{'segment':44} {'median':>9} {'p10':>9} {'p90':>9}")
    rows = segments(steps)
    # a step's end to the next traced step's start; where a step between them was left out the gap spans it, so
    # only gaps shorter than a step's own time count
    gaps = [(b[0][2] - a[-1][2]) / 1e3 for a, b in zip(steps, steps[1:])]
    rows.append(("head chosen -> next send", [g for g in gaps if g < (steps[0][-1][2] - steps[0][0][2]) / 1e3]
                 or [float("nan")]))  # nan: no two steps traced one after the other
    for label, values in rows:
        deciles = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
        print(f"{label:44} {statistics.median(values):9.1f} {deciles[0]:9.1f} {deciles[-1]:9.1f}")
    whole = [(step[-2][2] - step[0][2]) / 1e3 for step in steps]  # send -> woke
    compute = [sum(b[2] - a[2] for a, b in zip(step, step[1:]) if a[1] == "compute") / 1e3 for step in steps]
    rest = [w - c for w, c in zip(whole, compute)]
    hops = args.workers + 1
    chosen = statistics.median((step[-1][2] - step[-2][2]) / 1e3 for step in steps)
    between = statistics.median(rows[-1][1])
    print(f"per step: head send -> woke {statistics.median(whole):.0f}, stages' compute "
          f"{statistics.median(compute):.0f}, hand-offs {statistics.median(rest):.0f} "
          f"({statistics.median(rest) / hops:.0f} a hop over {hops} hops); the head's lm_head and sampling "
          f"{chosen:.0f}, between steps {between:.0f}; send to next send "
          f"{statistics.median(whole) + chosen + between:.0f}")


if __name__ == "__main__":
    main()
