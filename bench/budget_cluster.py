"""Where a decode token's time goes through head + N workers: the head's own work, each stage, each hop.

Starts the head and N workers on loopback (real processes, tc's own CLI, the demo model), warms up, then runs one
greedy completion of --tokens tokens and reads the head's /metrics before and after it. Per decode step:

- step: the head's whole decode step (tc_decode_step_seconds: pipeline and sampling);
- node X: the stage's compute as its worker reports it (tc_stage_compute_seconds);
- hop X: the round trip to that worker less its compute (tc_hop_network_seconds): framing, the socket, and the
  threads that hand a frame on at both ends: what the network would cost beside the software;
- head: the step less every stage and hop (embedding, final norm, lm_head, sampling, the relay's own work);
- wall: the request's decode time per token as the client sees it (total less the first token's time).

With --streams N, N such completions run at once (the same prompt, each its own sequence), so every decode step
carries N rows: the figures are then per batched step, and tok/s counts all N streams.

Each --env setting (default: the environment as it is, then OpenMP told to sleep at once when idle, then to spin
briefly) runs in turn in the same invocation, so their figures compare: processes that share cores take each
other's time when idle OpenMP threads spin. Each --hops setting likewise: `direct` (workers pass hidden states to
each other, head.direct_hops) or `relayed` (every hop through the head); repeat them (direct relayed direct
relayed) to interleave an A/B comparison on a machine whose speed drifts. With direct hops a node's hop is the
time from the stage before's answer to its own, less its compute. --link-delay-ms D has each worker join through
a user-space proxy that delays every byte by D ms each way (tests/latency_proxy.py): a network's latency on the
links between head and workers (a link between two workers stays direct). Within a stage, bench/profile_step.py
splits the compute further.

    python bench/budget_cluster.py [--quants int4 fp16] [--workers 2] [--tokens 64] [--threads 2] [--streams 1]
                                   [--env - OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000] [--hops direct relayed]
                                   [--link-delay-ms 0]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from cluster import Cluster, write_topology  # noqa: E402
from latency_proxy import LatencyProxy  # noqa: E402
from plan_runs import PROMPT  # noqa: E402  (the prompt the other cluster benches use)


def scrape(cluster: Cluster) -> dict[tuple[str, str], float]:
    """(series, node) -> value for the decode step's sum and count and each node's compute and hop sums and
    counts in the decode phase."""
    with urllib.request.urlopen(cluster.url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    wanted = {"tc_decode_step_seconds", "tc_stage_compute_seconds", "tc_hop_network_seconds"}
    values: dict[tuple[str, str], float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        if family.name not in wanted:
            continue
        for sample in family.samples:
            if not sample.name.endswith(("_sum", "_count")) or sample.labels.get("phase", "decode") != "decode":
                continue
            values[(sample.name, sample.labels.get("node", ""))] += sample.value
    return values


def timed_completion(cluster: Cluster, model: str, max_tokens: int) -> float:
    started = time.perf_counter()
    status, body = cluster.post("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                                    "temperature": 0, "ignore_eos": True})
    if status != 200:
        raise RuntimeError(f"request failed: {status} {body}")
    return time.perf_counter() - started


def concurrent_completions(cluster: Cluster, model: str, max_tokens: int, streams: int) -> float:
    """The wall time of `streams` completions started at once, until the last one ends."""
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(lambda _: timed_completion(cluster, model, max_tokens), range(streams)))
    return time.perf_counter() - started


def budget(model_dir: Path, quant: str, workers: int, tokens: int, threads: int, setting: str,
           streams: int = 1, hops: str = "direct", link_delay_s: float = 0.0) -> dict:
    env = dict([setting.split("=", 1)]) if "=" in setting else {}  # "-": as this environment has it
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        nodes = [{"id": f"w{i + 1}", "device": "cpu", "threads": threads} for i in range(workers)]
        # one token a step (no drafts): these figures are decode steps' (bench_drafts.py measures drafts)
        topology = write_topology(tmp_path / "topology.yaml", model_dir, nodes, quant=quant, dtype="bf16",
                                  head={"threads": threads, "direct_hops": hops == "direct", "draft_tokens": 0})
        with Cluster(topology, tmp_path, env=env) as cluster:
            cluster.start_head()
            cluster.wait_api(timeout=300)
            proxies = [LatencyProxy(("127.0.0.1", cluster.listen_port), link_delay_s)
                       for _ in nodes] if link_delay_s else []
            for i, node in enumerate(nodes):
                join = ("--join", f"127.0.0.1:{proxies[i].port}") if proxies else ()
                cluster.start_worker(node["id"], "--no-bench", "--threads", str(threads), *join)  # last flags win
            cluster.wait_ready(timeout=600)
            timed_completion(cluster, model_dir.name, 8)  # warm-up
            first = min(concurrent_completions(cluster, model_dir.name, 1, streams) for _ in range(2))
            before = scrape(cluster)
            total = concurrent_completions(cluster, model_dir.name, tokens, streams)
            after = scrape(cluster)
            for proxy in proxies:
                proxy.close()
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    steps = delta[("tc_decode_step_seconds_count", "")]
    per_step = {"step": delta[("tc_decode_step_seconds_sum", "")] / steps}
    node_ids = [n["id"] for n in nodes]
    for node in node_ids:
        per_step[f"node {node}"] = delta[("tc_stage_compute_seconds_sum", node)] / steps
        per_step[f"hop {node}"] = delta[("tc_hop_network_seconds_sum", node)] / steps
    per_step["head"] = per_step["step"] - sum(v for k, v in per_step.items() if k.startswith(("node", "hop")))
    per_step["wall"] = (total - first) / (tokens - 1)
    return per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quants", nargs="+", default=["int4", "fp16"], choices=["fp16", "int8", "int4"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="threads of the head and of each worker")
    parser.add_argument("--streams", type=int, default=1, help="completions at once: rows of every decode step")
    parser.add_argument("--env", nargs="+", default=["-", "OMP_WAIT_POLICY=PASSIVE", "GOMP_SPINCOUNT=10000"],
                        help="VAR=VALUE for every process of one run (- for none); one run each")
    parser.add_argument("--hops", nargs="+", default=["direct"], choices=["direct", "relayed"],
                        help="how hidden states travel between workers; one run each, in the order given")
    parser.add_argument("--link-delay-ms", type=float, default=0.0,
                        help="delay every byte between head and each worker by this much each way (default 0)")
    args = parser.parse_args()
    from _demo import demo_model_dir

    model_dir = demo_model_dir()
    load_before = os.getloadavg()[0]
    rows = []
    for quant in args.quants:
        for setting in args.env:
            for hops in args.hops:
                figures = budget(model_dir, quant, args.workers, args.tokens, args.threads, setting, args.streams,
                                 hops, args.link_delay_ms / 1000)
                label = setting if len(args.hops) == 1 else f"{setting} {hops}"
                rows.append((quant, label, figures))
                print(f"  {quant} {label}: {args.streams / figures['wall']:.1f} tok/s", file=sys.stderr)
    delay = f", head links delayed {args.link_delay_ms:g} ms each way" if args.link_delay_ms else ""
    print(f"\ndemo model, head + {args.workers} workers on loopback{delay}, bf16 compute, {args.threads} threads each, "
          f"{args.streams} stream(s) of {args.tokens} new tokens greedy; load average {load_before:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after\n")
    columns = list(rows[0][2])
    width = max(len(setting) for _, setting, _ in rows)
    print(f"{'weights':7s} {'env':{width}s} {'tok/s':>6s}  " + "  ".join(f"{c:>9s}" for c in columns) + "  (ms)")
    for quant, setting, figures in rows:
        print(f"{quant:7s} {setting:{width}s} {args.streams / figures['wall']:6.1f}  "
              + "  ".join(f"{figures[c] * 1000:9.2f}" for c in columns))


if __name__ == "__main__":
    main()
