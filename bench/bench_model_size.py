"""Models ten times the demo's size: a random-weight checkpoint with the exact config and shard layout of
Qwen2.5-7B-Instruct (or a Qwen3-30B-A3B-shaped mixture of experts) served by head + 2 workers on this machine.

Random weights write nonsense; the figures are real. For each weight mode it reports the load time of each
worker, the bytes each worker read (the safetensors spans of its layers, and what /proc/PID/io counted), the
peak RSS of every process against its share of the weights, prefill and decode tokens/s, and the decode rate
the demo model's (measured the same way) predicts from the bytes a token reads.

    python bench/bench_model_size.py [--shape qwen2.5-7b|qwen3-30b-a3b] [--experts N] [--quants int8 int4]
                                     [--tokens 16] [--worker-threads 1] [--demo]

The checkpoint is written once into <cache>/models/<name>-random/ (about 15 GB in bf16 for the 7B shape: four
shards and an index, layers in order, the embedding first, the norm and lm_head last) and reused.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from cluster import Cluster, write_topology  # noqa: E402
from tc.head.main import build_plan  # noqa: E402
from tc.model.config import ModelConfig  # noqa: E402
from tc.model.weights import expected_shapes, head_tensor_names, layer_tensor_names  # noqa: E402
from tc.topology import load_topology  # noqa: E402

# config.json of Qwen/Qwen2.5-7B-Instruct, as published
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
}
# config.json of Qwen/Qwen3-30B-A3B, as published (128 experts; --experts reduces them to fit a machine)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
SHAPES = {"qwen2.5-7b": ("Qwen2.5-7B-Instruct", QWEN25_7B), "qwen3-30b-a3b": ("Qwen3-30B-A3B", QWEN3_30B_A3B)}
SHARDS = 4
PROMPT = ("# A small HTTP client\nimport json\nimport urllib.request\n\n\ndef fetch_json(url, timeout=10):\n"
          '    """Fetch a URL and decode its JSON body, raising ValueError on a non-200 status."""\n')
POOL = 1 << 24  # random bf16 values every tensor is cut from (a fresh draw per tensor would take minutes)


def write_checkpoint(out: Path, config_json: dict, tokenizer_dir: Path) -> Path:
    """Write a random bf16 checkpoint for `config_json` into `out` (4 shards + index), once; return `out`."""
    if (out / ".complete").is_file():
        return out
    config = ModelConfig.from_dict(config_json)
    shapes = expected_shapes(config)
    layers = config.num_hidden_layers
    # layers in order over the shards, split by bytes; the embedding in the first, the norm and lm_head in the last
    order = ["model.embed_tokens.weight"] + layer_tensor_names(config, 0, layers) + \
        [n for n in head_tensor_names(config) if n != "model.embed_tokens.weight"]
    sizes = {n: 2 * math.prod(shapes[n]) for n in order}
    total = sum(sizes.values())
    shard_of: dict[str, int] = {}
    done = 0
    for name in order:
        shard_of[name] = min(SHARDS - 1, done * SHARDS // total)
        done += sizes[name]
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    gen = torch.Generator().manual_seed(0)
    pool = (torch.randn(POOL, generator=gen) * 0.02).to(torch.bfloat16)
    weight_map = {}
    for shard in range(SHARDS):
        file = f"model-{shard + 1:05d}-of-{SHARDS:05d}.safetensors"
        names = [n for n in order if shard_of[n] == shard]
        header, offset = {}, 0
        for n in names:
            header[n] = {"dtype": "BF16", "shape": list(shapes[n]), "data_offsets": [offset, offset + sizes[n]]}
            offset += sizes[n]
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(tmp / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for i, n in enumerate(names):
                count = sizes[n] // 2
                if len(shapes[n]) == 1:  # norms: ones, as a trained model's are near 1
                    f.write(torch.ones(count, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes())
                    continue
                start = (i * 7919) % POOL
                while count:
                    take = min(count, POOL - start)
                    f.write(pool[start:start + take].view(torch.int16).numpy().tobytes())
                    count -= take
                    start = 0
        weight_map.update({n: file for n in names})
        print(f"wrote {file} ({offset / 1e9:.2f} GB)", file=sys.stderr)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (tmp / "config.json").write_text(json.dumps(config_json, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_dir / name, tmp / name)
    (tmp / ".complete").write_text("1")
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


def proc_field(pid: int, path: str, field: str) -> int:
    with open(f"/proc/{pid}/{path}") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def measure(model_dir: Path, quant: str, args) -> dict:
    """Serve `model_dir` by head + 2 workers in weight mode `quant`; return the figures."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        nodes = [{"id": "w1", "device": "cpu"}, {"id": "w2", "device": "cpu"}]
        # one token a step (no drafts): these figures are decode steps' (bench_drafts.py measures drafts)
        topo_path = write_topology(tmp_path / "t.yaml", model_dir, nodes, quant=quant, dtype="bf16",
                                   head={"threads": args.head_threads, "draft_tokens": 0})
        topology = load_topology(topo_path)
        config = ModelConfig.from_file(model_dir / "config.json")
        plan = build_plan(topology, config)
        from tc.model.weights import WeightIndex

        index = WeightIndex.open(model_dir)
        with Cluster(topo_path, tmp_path) as cluster:
            cluster.start_head()
            cluster.wait_api(timeout=900)
            started = time.perf_counter()
            for node in nodes:
                cluster.start_worker(node["id"], "--threads", str(args.worker_threads))
            cluster.wait_ready(timeout=3600)
            ready_s = time.perf_counter() - started
            name = model_dir.name

            def complete(max_tokens: int) -> tuple[float, dict]:
                t0 = time.perf_counter()
                status, body = cluster.post("/v1/completions", {"model": name, "prompt": PROMPT,
                                                                "max_tokens": max_tokens, "temperature": 0,
                                                                "ignore_eos": True}, timeout=3600)
                if status != 200:
                    raise RuntimeError(f"{status} {body}")
                return time.perf_counter() - t0, body

            complete(2)  # warm-up
            first, body = complete(1)
            total, body = complete(args.tokens)
            prompt_tokens = body["usage"]["prompt_tokens"]
            workers = {}
            for stage, (wname, proc) in zip(plan.stages, cluster.workers.items()):
                pid = proc.proc.pid
                log = proc.output()
                load = [line for line in log.splitlines() if "ready:" in line and "loaded in" in line]
                span = index.nbytes(layer_tensor_names(config, stage.start, stage.end))
                workers[wname] = {
                    "layers": stage.layers_text, "share_mb": stage.weight_bytes / 1e6, "span_mb": span / 1e6,
                    "peak_rss_mb": proc_field(pid, "status", "VmHWM") / 1024,
                    "rss_mb": proc_field(pid, "status", "VmRSS") / 1024,
                    "read_bytes_mb": proc_field(pid, "io", "read_bytes") / 1e6,
                    "rchar_mb": proc_field(pid, "io", "rchar") / 1e6,
                    "load": load[-1].split("ready:")[-1].strip() if load else "?"}
            head_pid = cluster.head.proc.pid
            bytes_per_token = _active_bytes(config, plan.total_weight_bytes, quant) + _head_lm_bytes(config, quant)
            return {"quant": quant, "ready_s": ready_s, "prompt_tokens": prompt_tokens, "ttft_s": first,
                    "prefill_tps": prompt_tokens / first, "decode_tps": (args.tokens - 1) / (total - first),
                    "workers": workers, "head_peak_rss_mb": proc_field(head_pid, "status", "VmHWM") / 1024,
                    "bytes_per_token": bytes_per_token}


def _active_bytes(config: ModelConfig, total: int, quant: str) -> int:
    """The layer weight bytes one decode step reads: all of them, less the experts the router leaves out (a token
    runs top_k of each layer's experts)."""
    if config.experts is None:
        return total
    from tc.model.quant import quantized_nbytes
    from tc.model.weights import layer_shapes

    experts = sum(quantized_nbytes(shape, quant, 128) for i in range(config.num_hidden_layers)
                  for name, shape in layer_shapes(config, i).items() if ".experts." in name)
    return total - round(experts * (1 - config.experts.top_k / config.experts.count))


def _head_lm_bytes(config: ModelConfig, quant: str) -> int:
    from tc.model.quant import head_weight_mode, quantized_nbytes

    return quantized_nbytes((config.vocab_size, config.hidden_size), head_weight_mode(quant), 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    parser.add_argument("--experts", type=int, help="experts per layer for the MoE shape (default: as published)")
    parser.add_argument("--quants", nargs="+", default=["int8", "int4"], choices=["fp16", "int8", "int4"])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--head-threads", type=int, default=1)
    parser.add_argument("--worker-threads", type=int, default=1)
    parser.add_argument("--demo", action="store_true", help="measure the demo model the same way, for the ratio")
    args = parser.parse_args()
    from _demo import builder, demo_model_dir

    demo = demo_model_dir()
    label, config_json = SHAPES[args.shape]
    config_json = dict(config_json)
    if args.experts:
        config_json["num_experts"] = args.experts
        label += f"-{args.experts}-experts"
    out = builder().default_cache_dir() / "models" / f"{label}-random"
    started = time.perf_counter()
    model_dir = write_checkpoint(out, config_json, demo)
    print(f"checkpoint {model_dir} ready in {time.perf_counter() - started:.0f}s", file=sys.stderr)
    results = []
    for quant in args.quants:
        if args.demo:
            results.append(("demo", measure(demo, quant, args)))
            print(json.dumps(results[-1][1]), file=sys.stderr)
        results.append((label, measure(model_dir, quant, args)))
        print(json.dumps(results[-1][1]), file=sys.stderr)
    print(f"\nhead + 2 workers, compute bf16, {args.tokens} new tokens, greedy, worker threads {args.worker_threads}\n")
    for model, r in results:
        print(f"{model} {r['quant']}: ready in {r['ready_s']:.0f}s; prefill {r['prefill_tps']:.1f} tok/s "
              f"({r['prompt_tokens']} tokens), decode {r['decode_tps']:.2f} tok/s; "
              f"{r['bytes_per_token'] / 1e9:.2f} GB of weights per token; head peak RSS {r['head_peak_rss_mb']:.0f} MB")
        for name, w in r["workers"].items():
            print(f"  {name} layers {w['layers']}: share {w['share_mb']:.0f} MB, peak RSS {w['peak_rss_mb']:.0f} MB "
                  f"(now {w['rss_mb']:.0f}; +{w['rss_mb'] - w['share_mb']:.0f} over its share), its spans "
                  f"{w['span_mb']:.0f} MB on disk, read {w['rchar_mb']:.0f} MB (disk {w['read_bytes_mb']:.0f} MB); "
                  f"{w['load']}")
    by_quant = {(m, r["quant"]): r for m, r in results}
    for quant in args.quants:
        demo_r, big = by_quant.get(("demo", quant)), by_quant.get((label, quant))
        if demo_r and big:
            predicted = demo_r["decode_tps"] * demo_r["bytes_per_token"] / big["bytes_per_token"]
            print(f"{quant}: decode {big['decode_tps']:.2f} tok/s; the demo model's {demo_r['decode_tps']:.2f} tok/s "
                  f"predicts {predicted:.2f} from bytes per token ({big['decode_tps'] / predicted:.0%} of it)")


if __name__ == "__main__":
    main()
