"""How long the demo model takes to start, per weight mode (not a test: it prints figures).

Two figures a mode, each the mean and spread of --repeat runs taking turns across the modes:
- load: `load_local_generator` in a fresh process, the whole model in one process as `python -m tc generate`
  loads it (its kernel probes, reads, quantization, packing);
- cluster: from starting `tc head` and two `tc worker` processes on this machine (at once, as scripts/demo.sh
  does) until the head's /health/ready answers 200.

On one machine the three processes of the cluster share its cores, so the cluster's figure is the sum of their
work more than the longest of them; on several machines each loads beside the others.

    python bench/start_time.py [--modes fp16 int8 int4] [--repeat 3] [--no-cluster]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from cluster import Cluster, write_topology  # noqa: E402

LOAD = """
import sys, time
started = time.perf_counter()
import torch
from pathlib import Path
from tc.local import load_local_generator
torch.set_num_threads(2)
load_local_generator(Path(sys.argv[1]), quant=sys.argv[2])
print(time.perf_counter() - started)
"""


def load_seconds(model_dir: Path, mode: str) -> float:
    """A fresh process's seconds from its start (imports included) to the whole model loaded in `mode`."""
    done = subprocess.run([sys.executable, "-c", LOAD, str(model_dir), mode], capture_output=True, text=True,
                          cwd=ROOT, check=True)
    return float(done.stdout.split()[-1])


def cluster_seconds(model_dir: Path, mode: str) -> float:
    """Seconds from starting a head and two workers on this machine to the head's /health/ready answering 200."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        nodes = [{"id": "w1", "device": "cpu"}, {"id": "w2", "device": "cpu"}]
        topology = write_topology(work / "t.yaml", model_dir, nodes, quant=mode, dtype="bf16", head={"threads": 2})
        with Cluster(topology, work) as cluster:
            started = time.monotonic()
            cluster.start_head()
            for node in ("w1", "w2"):
                cluster.start_worker(node, "--threads", "2")
            cluster.wait_ready(600)
            return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["fp16", "int8", "int4"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-cluster", action="store_true", help="time the one-process load only")
    args = parser.parse_args()
    from _demo import demo_model_dir

    model_dir = demo_model_dir()
    figures: dict[tuple[str, str], list[float]] = {}
    for turn in range(args.repeat):
        for mode in args.modes:  # taking turns: what else the machine does meanwhile hits every mode alike
            figures.setdefault((mode, "load"), []).append(load_seconds(model_dir, mode))
            if not args.no_cluster:
                figures.setdefault((mode, "cluster"), []).append(cluster_seconds(model_dir, mode))
            print(f"  turn {turn + 1}, {mode}: " + ", ".join(f"{what} {runs[-1]:.1f}s" for (m, what), runs
                                                          in figures.items() if m == mode), file=sys.stderr)
    print(f"\nstart of the demo model ({model_dir.name}), seconds, mean ± sd of {args.repeat}\n")
    print(f"{'weights':8s} {'one process':>14s} {'head + 2 workers':>17s}")
    for mode in args.modes:
        cells = []
        for what in ("load", "cluster"):
            runs = figures.get((mode, what))
            cells.append("-" if not runs else f"{statistics.mean(runs):.1f} ± "
                         f"{statistics.stdev(runs) if len(runs) > 1 else 0:.1f}")
        print(f"{mode:8s} {cells[0]:>14s} {cells[1]:>17s}")


if __name__ == "__main__":
    main()
