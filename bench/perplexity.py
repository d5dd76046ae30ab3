"""Perplexity of the demo model through the cluster, per weight mode (not a test: it prints figures).

For each weight mode it starts a head in this process and two worker processes on loopback, exactly as
`tc head` / `tc worker` would, then scores a fixed text shipped in the repo (bench/data/perplexity.txt: prose and
Python code, about 4,700 tokens) in windows: each window is one prefill through both workers, and every token
after the first of a window is scored by the head's final norm and lm_head. Lower is better; the ratios are
against the fp16 (unquantized, bf16 compute) run of the same invocation.

    python bench/perplexity.py [--modes fp16 int8 int4] [--window 1024] [--dtype bf16]
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from cluster import Process, write_topology  # noqa: E402
from tc.generation import Entry  # noqa: E402
from tc.head.main import start_head  # noqa: E402
from tc.topology import load_topology  # noqa: E402

TEXT = ROOT / "bench" / "data" / "perplexity.txt"


def negative_log_likelihood(head, ids: list[int], window: int) -> tuple[float, int]:
    """Summed NLL (nats) and the number of scored tokens, window by window through the cluster's pipeline."""
    generator = head.service.generator
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window + 1]
        if len(chunk) < 2:
            break
        with torch.inference_mode():
            window_entry = Entry(sequence=0, start=0, length=len(chunk) - 1, capacity=len(chunk))  # a fresh cache
            hidden = generator.pipeline.run([window_entry], generator.head.embed(torch.tensor([chunk[:-1]])))
            targets = torch.tensor(chunk[1:])
            for a in range(0, hidden.shape[1], 256):  # logits for 256 positions at a time: 150 MB, not 3 GB
                logits = generator.head.logits(hidden[:, a:a + 256].to(generator.dtype))[0]
                logp = torch.log_softmax(logits, dim=-1)
                total -= logp.gather(1, targets[a:a + 256, None]).sum().item()
                count += logp.shape[0]
    return total, count


def run_mode(model_dir: Path, mode: str, dtype: str, window: int, ids: list[int]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        nodes = [{"id": "w1", "device": "cpu"}, {"id": "w2", "device": "cpu"}]
        topology = load_topology(write_topology(tmp_path / "t.yaml", model_dir, nodes, quant=mode, dtype=dtype))
        head = start_head(topology.with_ports(api_port=0, listen_port=0))
        workers = [Process([sys.executable, "-m", "tc", "worker", "--join", f"127.0.0.1:{head.listen_port}",
                            "--node-id", n["id"], "--threads", "2"], tmp_path / f"{n['id']}.log") for n in nodes]
        try:
            if not head.registry.wait_ready(900):
                raise RuntimeError("\n".join(w.output() for w in workers))
            started = time.perf_counter()
            nll, count = negative_log_likelihood(head, ids, window)
            return {"ppl": math.exp(nll / count), "tokens": count, "seconds": time.perf_counter() - started}
        finally:
            for w in workers:
                w.stop()
            head.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["fp16", "int8", "int4"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--window", type=int, default=1024)
    args = parser.parse_args()
    from _demo import demo_model_dir
    from tc.model.tokenizer import TextTokenizer

    torch.set_num_threads(2)
    model_dir = demo_model_dir()
    ids = TextTokenizer.load(model_dir).encode(TEXT.read_text(encoding="utf-8"))
    results = {}
    for mode in args.modes:
        results[mode] = run_mode(model_dir, mode, args.dtype, args.window, ids)
        print(f"  {mode}: perplexity {results[mode]['ppl']:.3f}", file=sys.stderr)
    base = results.get("fp16")
    print(f"\nperplexity of the demo model through head + 2 workers, compute {args.dtype}, "
          f"{len(ids)} tokens of {TEXT.name}, windows of {args.window}\n")
    print(f"{'weights':8s} {'perplexity':>10s} {'vs fp16':>8s} {'scored':>7s} {'seconds':>8s}")
    for mode, r in results.items():
        ratio = f"{r['ppl'] / base['ppl'] - 1:+.2%}" if base else "-"
        print(f"{mode:8s} {r['ppl']:10.3f} {ratio:>8s} {r['tokens']:7d} {r['seconds']:8.1f}")


if __name__ == "__main__":
    main()
