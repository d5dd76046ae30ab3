"""One cluster run for the plan benchmarks and tests: real head and CPU workers, one of them held to a CPU quota."""
from __future__ import annotations

import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cluster import Cluster, write_topology
from throttle import Throttle

PROMPT = ("# A small HTTP client\nimport json\nimport urllib.request\n\n\ndef fetch_json(url, timeout=10):\n"
          '    """Fetch a URL and decode its JSON body, raising ValueError on a non-200 status."""\n')
PREDICTED = re.compile(r"predicted: decode ([0-9.]+) tokens/s")


@dataclass(frozen=True)
class RunResult:
    measured: float  # decode tokens/s
    predicted: float | None  # what the head's plan predicted (its log), when it could
    layers: list[int]  # per node, in pipeline order
    nodes: dict[str, tuple[float | None, float | None]]  # node -> (predicted, measured) decode compute ms


def decode_tokens_per_s(cluster: Cluster, model: str, tokens: int) -> float:
    """Decode tokens/s of a greedy completion: its time less the first token's (a max_tokens=1 request)."""
    def timed(max_tokens: int) -> tuple[float, dict]:
        started = time.perf_counter()
        status, body = cluster.post("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                                        "temperature": 0})
        if status != 200:
            raise RuntimeError(f"request failed: {status} {body}")
        return time.perf_counter() - started, body

    timed(2)  # warm-up
    first = min(timed(1)[0] for _ in range(2))
    total, body = timed(tokens)
    return (body["usage"]["completion_tokens"] - 1) / (total - first)


def wait_joined(cluster: Cluster, node_id: str, timeout: float = 300) -> None:
    """Until the head has a worker for `node_id` (any state but waiting)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, view = cluster.get("/v1/cluster")
        if any(n["id"] == node_id and n["state"] != "waiting" for n in view["nodes"]):
            return
        time.sleep(0.2)
    raise AssertionError(f"{node_id} did not join in {timeout}s:\n{cluster.workers[node_id].output()[-3000:]}")


def run(model_dir: Path, workers: int, plan_from: str, slow: int | None = None, duty: float = 0.25,
        tokens: int = 32, quant: str = "fp16", dtype: str = "bf16", head_threads: int = 1,
        worker_threads: int = 1) -> RunResult:
    """`workers` CPU workers (worker index `slow` held to `duty` of a core from its start, so its own benchmark
    sees it too), each measuring itself afresh; the head plans as `plan_from` says."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        nodes = [{"id": f"w{i + 1}", "device": "cpu"} for i in range(workers)]
        topology = write_topology(tmp_path / "topology.yaml", model_dir, nodes, quant=quant, dtype=dtype,
                                  head={"threads": head_threads, "plan_from": plan_from})
        throttles = []
        with Cluster(topology, tmp_path) as cluster:
            cluster.start_head()
            cluster.wait_api(timeout=300)
            for i, node in enumerate(nodes):
                proc = cluster.start_worker(node["id"], "--threads", str(worker_threads), "--bench-dir",
                                            str(tmp_path / f"bench-{node['id']}"))
                if i == slow:
                    throttles.append(Throttle(proc.proc.pid, duty).start())
                # one at a time: each measures itself before joining, and machines of a real cluster do not
                # share cores, so neither should their measurements here. The held worker measures at `duty` of
                # a core (its figures for every dtype and mode take ~45 s on a whole core of a 2-core VM, some
                # 200 s held to a quarter and more under load), so it is given that much longer to join
                wait_joined(cluster, node["id"], timeout=300 / (duty if i == slow else 1))
            try:
                cluster.wait_ready(timeout=900)
                measured = decode_tokens_per_s(cluster, model_dir.name, tokens)
                _, view = cluster.get("/v1/cluster")
            finally:
                for throttle in throttles:
                    throttle.stop()
            log = cluster.head.output()
    predicted = PREDICTED.findall(log)
    return RunResult(measured=measured, predicted=float(predicted[-1]) if predicted else None,
                     layers=[s["layers"][1] - s["layers"][0] for s in view["plan"]["stages"]],
                     nodes={n["id"]: (n["predicted_decode_ms"], n["measured_decode_ms"]) for n in view["nodes"]})
