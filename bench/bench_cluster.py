"""The cluster against the single-process generator on the demo model: speed and every process's memory.

Runs, in one go: the single-process generator, then head + 1, 2 and 3 workers on loopback (real processes,
tc's own CLI), all in the same weight mode and compute dtype, the same prompt, greedy. For each it measures
time to first token (a max_tokens=1 request: prefill + one sample), prefill tokens/s, decode tokens/s (from a
longer request, minus the first token's time) and the peak RSS (VmHWM) of each process.

    python bench/bench_cluster.py [--quants fp16 int8 int4] [--dtype bf16] [--tokens 64] [--workers 1 2 3]
                                  [--head-threads 2] [--worker-threads 2] [--omp-wait-policy passive]
                                  [--no-single]

Ratios: "vs single" against the single-process generator in the same weight mode; "vs fp16" against the
same setup with unquantized weights (when fp16 is among --quants).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from cluster import Cluster, write_topology  # noqa: E402

PROMPT = ("# A small HTTP client\nimport json\nimport urllib.request\n\n\ndef fetch_json(url, timeout=10):\n"
          '    """Fetch a URL and decode its JSON body, raising ValueError on a non-200 status."""\n')
MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct"


def vm_mb(pid: int, field: str = "VmHWM") -> float:
    """A process's peak (VmHWM) or current (VmRSS) resident memory in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def single_process(args, quant: str, model_dir: Path, env: dict) -> dict:
    code = f"""
import json, resource, time, torch
torch.set_num_threads({args.worker_threads})
from tc.local import load_local_generator
from tc.sampling import SamplingParams
g = load_local_generator({str(model_dir)!r}, {args.dtype!r}, quant={quant!r}, group_size=128)
ids = g.tokenizer.encode({PROMPT!r})
g.generate(ids, SamplingParams(max_tokens=4, temperature=0))
first = min(g.generate(ids, SamplingParams(max_tokens=1, temperature=0)).time_to_first_token_s for _ in range(3))
r = g.generate(ids, SamplingParams(max_tokens={args.tokens}, temperature=0))
print(json.dumps({{"prompt_tokens": len(ids), "ttft_s": first, "decode_tps": r.decode_tokens_per_s,
                  "tokens": r.completion_tokens, "rss": {{"single": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}},
                  "text": r.text}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def timed_completion(cluster: Cluster, max_tokens: int) -> tuple[float, dict]:
    started = time.perf_counter()
    status, body = cluster.post("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens,
                                                    "temperature": 0})
    elapsed = time.perf_counter() - started
    if status != 200:
        raise RuntimeError(f"request failed: {status} {body}")
    return elapsed, body


def cluster_run(args, quant: str, model_dir: Path, workers: int, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        nodes = [{"id": f"w{i + 1}", "device": "cpu"} for i in range(workers)]
        # one token a step (no drafts): these figures are decode steps' (bench_drafts.py measures drafts)
        topology = write_topology(tmp_path / "topology.yaml", model_dir, nodes, quant=quant, dtype=args.dtype,
                                  head={"threads": args.head_threads, "draft_tokens": 0})
        with Cluster(topology, tmp_path, env=env) as cluster:
            cluster.start_head()
            cluster.wait_api(timeout=300)
            for node in nodes:
                cluster.start_worker(node["id"], "--threads", str(args.worker_threads))
            cluster.wait_ready(timeout=600)
            timed_completion(cluster, 4)  # warm-up
            first = min(timed_completion(cluster, 1)[0] for _ in range(3))
            total, body = timed_completion(cluster, args.tokens)
            tokens = body["usage"]["completion_tokens"]
            rss = {"head": vm_mb(cluster.head.proc.pid)}
            rss.update({name: vm_mb(w.proc.pid) for name, w in cluster.workers.items()})
            # peak RSS includes loading (a layer in bf16 while it is quantized); current RSS is what serving holds
            current = {name: vm_mb(w.proc.pid, "VmRSS") for name, w in cluster.workers.items()}
            return {"prompt_tokens": body["usage"]["prompt_tokens"], "ttft_s": first,
                    "decode_tps": (tokens - 1) / (total - first), "tokens": tokens, "rss": rss, "current": current,
                    "text": body["choices"][0]["text"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quants", nargs="+", default=["fp16"], choices=["fp16", "int8", "int4"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--no-single", action="store_true", help="skip the single-process runs")
    parser.add_argument("--head-threads", type=int, default=2)
    parser.add_argument("--worker-threads", type=int, default=2)
    parser.add_argument("--omp-wait-policy", choices=["active", "passive"], help="OMP_WAIT_POLICY for every process")
    args = parser.parse_args()
    from _demo import demo_model_dir

    model_dir = demo_model_dir()
    env = dict(os.environ)
    if args.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    results: dict[tuple[str, str], dict] = {}
    for quant in args.quants:
        setups = [] if args.no_single else ["single process"]
        setups += [f"head + {n} worker{'s' if n > 1 else ''}" for n in args.workers]
        for setup, n in zip(setups, ([0] if not args.no_single else []) + args.workers):
            run = single_process(args, quant, model_dir, env) if n == 0 else cluster_run(args, quant, model_dir, n, env)
            results[(quant, setup)] = run
            print(f"  {quant} {setup}: {run['decode_tps']:.1f} tok/s", file=sys.stderr)
    print(f"\ndemo model, compute {args.dtype}, {args.tokens} new tokens, greedy, head threads {args.head_threads}, "
          f"worker threads {args.worker_threads}, OMP_WAIT_POLICY {env.get('OMP_WAIT_POLICY', 'default')}\n")
    print(f"{'weights':7s} {'setup':18s} {'TTFT ms':>8s} {'prefill tok/s':>13s} {'decode tok/s':>12s} "
          f"{'vs single':>9s} {'vs fp16':>7s}  peak RSS MB (workers' current RSS)")
    for (quant, setup), r in results.items():
        single = results.get((quant, "single process"))
        fp16 = results.get(("fp16", setup))
        vs_single = f"{r['decode_tps'] / single['decode_tps']:.2f}x" if single else "-"
        vs_fp16 = f"{r['decode_tps'] / fp16['decode_tps']:.2f}x" if fp16 else "-"
        rss = ", ".join(f"{k} {v:.0f}" for k, v in r["rss"].items())
        if r.get("current"):
            rss += " (" + ", ".join(f"{k} {v:.0f}" for k, v in r["current"].items()) + ")"
        print(f"{quant:7s} {setup:18s} {r['ttft_s'] * 1000:8.0f} {r['prompt_tokens'] / r['ttft_s']:13.1f} "
              f"{r['decode_tps']:12.1f} {vs_single:>9s} {vs_fp16:>7s}  {rss}")
    for quant in args.quants:
        texts = {r["text"] for (q, _), r in results.items() if q == quant}
        print(f"{quant}: all setups wrote the same text: {len(texts) == 1}")


if __name__ == "__main__":
    main()
