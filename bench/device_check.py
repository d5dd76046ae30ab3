"""The accelerator checks in one go, with one short report to paste: run by bench/device_check.sh.

For every CUDA GPU and the MPS device of this machine (or the devices given with --device):
  1. what the device is: name, memory, native dtypes, the 16-bit type quantization uses, the attention path;
  2. parity: all layers of the demo model on the device in fp16, bf16 (where native), int8 and int4, against our
     fp32 model on the CPU, for a 1-token and a long prompt and then teacher-forced decode steps (top-1
     agreement, max logit error), with the kernel path each quantized layer took;
  3. speed: prefill and decode with everything that belongs on the device there (embedding, layers, norm,
     lm_head, argmax; only the token id comes back);
  4. a cluster: a head, a worker on the device and one on the CPU, and a streamed chat through the HTTP API.
On a machine with neither CUDA nor MPS it says so and skips 2-4; --device cpu runs them on the CPU instead (a
check of this script, not of a device).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
import urllib.request
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tc.model import quant as quantization  # noqa: E402
from tc.model.config import Qwen2Config  # noqa: E402
from tc.model.qwen2 import (HeadModel, Stage, expand_kv_heads_on, half_dtype, resolve_compute_dtype,  # noqa: E402
                            sdpa_has_enable_gqa)
from tc.model.tokenizer import TextTokenizer  # noqa: E402
from tc.model.weights import WeightIndex  # noqa: E402
from tc.worker.device import compute_dtypes, detect_devices  # noqa: E402

TEXT = (ROOT / "README.md").read_text(encoding="utf-8")  # plenty of ordinary text for a long prompt
GIB = 1 << 30


def accelerators() -> list[str]:
    found = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        found.append("mps")
    return found


def synchronize(device: str) -> None:
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


def modes_for(device: str) -> list[tuple[str, str]]:
    """(weight mode, compute dtype) pairs to check: fp16 and bf16 weights as they are, int8 and int4 in bf16
    where the device has it natively, else fp16."""
    native = compute_dtypes(device)
    compute16 = "bf16" if "bf16" in native else "fp16"
    pairs = [("fp16", "fp16")] + ([("fp16", "bf16")] if "bf16" in native else [])
    return pairs + [("int8", compute16), ("int4", compute16)]


def load_stage(config: Qwen2Config, index: WeightIndex, device: str, quant: str, dtype: torch.dtype) -> Stage:
    return Stage.load(config, index, 0, config.num_hidden_layers, dtype, device,
                      quantization.Quantization(quant, quantization.DEFAULT_GROUP_SIZE, half_dtype(device)))


def kernel_paths(module: torch.nn.Module) -> str:
    """How many quantized layers took each path, by layer name: 'int8 packed kernel: qkv_proj x24, ...'."""
    paths: Counter = Counter()
    for name, m in module.named_modules():
        if isinstance(m, (quantization.Int8Linear, quantization.Int4Linear)):
            kind = "int8" if isinstance(m, quantization.Int8Linear) else "int4"
            path = "packed kernel" if m.uses_kernel else "portable"
            paths[(kind, path, name.rsplit(".", 1)[-1])] += 1
    if not paths:
        return "no quantized layers"
    return ", ".join(f"{k} {p} {n} x{c}" for (k, p, n), c in sorted(paths.items()))


def teacher_forced_logits(head: HeadModel, stage: Stage, ids: list[int], prompt: int, device: str,
                          dtype: torch.dtype) -> torch.Tensor:
    """fp32 logits [L, vocab] on the CPU: a prefill of ids[:prompt] on `device`, then one decode step per
    remaining id; the head stays on the CPU in fp32, as on a cluster."""
    cache = stage.new_cache(len(ids), dtype, device)
    hidden = head.embed(torch.tensor([ids[:prompt]])).to(device, dtype)
    rows = [head.logits(stage(hidden, cache, 0).to("cpu", torch.float32))[0]]
    for pos in range(prompt, len(ids)):
        hidden = head.embed(torch.tensor([[ids[pos]]])).to(device, dtype)
        rows.append(head.logits(stage(hidden, cache, pos).to("cpu", torch.float32))[0])
    return torch.cat(rows)


def greedy_continuation(reference_head: HeadModel, reference: Stage, prompt_ids: list[int], steps: int) -> list[int]:
    cache = reference.new_cache(len(prompt_ids) + steps, torch.float32, "cpu")
    hidden = reference(reference_head.embed(torch.tensor([prompt_ids])), cache, 0)
    ids = list(prompt_ids)
    for _ in range(steps):
        ids.append(int(reference_head.logits(hidden[:, -1:])[0, -1].argmax()))
        hidden = reference(reference_head.embed(torch.tensor([[ids[-1]]])), cache, len(ids) - 1)
    return ids


def timed_generation(config: Qwen2Config, index: WeightIndex, stage: Stage, device: str, dtype: torch.dtype,
                     quant: str, prompt_ids: list[int], steps: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s) with embedding, layers, norm, lm_head and argmax on the device."""
    head = HeadModel.load(config, index, dtype, device)
    quantization.quantize_linears(head, quantization.head_weight_mode(quant), half_dtype=half_dtype(device))
    ids = torch.tensor([prompt_ids], device=device)

    def run() -> tuple[float, float]:
        cache = stage.new_cache(len(prompt_ids) + steps + 1, dtype, device)
        synchronize(device)
        started = time.perf_counter()
        token = head.logits(stage(head.embed(ids), cache, 0)[:, -1:]).argmax(-1)  # [1, 1], on the device
        synchronize(device)
        prefilled = time.perf_counter()
        for pos in range(len(prompt_ids), len(prompt_ids) + steps):
            token = head.logits(stage(head.embed(token), cache, pos)).argmax(-1)
        int(token)  # the one copy back, which also waits for the device
        return prefilled - started, steps / (time.perf_counter() - prefilled)

    run()  # warm-up: kernels compiled, caches allocated
    return run()


def check_device(device: str, model_dir: Path, long_prompt: int, steps: int, report: list[str]) -> None:
    config = Qwen2Config.from_file(model_dir / "config.json")
    index = WeightIndex.open(model_dir)
    tokenizer = TextTokenizer.load(model_dir)
    all_ids = tokenizer.encode(TEXT)
    reference_head = HeadModel.load(config, index, torch.float32)
    reference = Stage.load(config, index, 0, config.num_hidden_layers, torch.float32, "cpu")
    cases = []
    for prompt in (1, long_prompt):
        ids = greedy_continuation(reference_head, reference, all_ids[:prompt], steps)
        want = reference_head.logits(reference(reference_head.embed(torch.tensor([ids])),
                                               reference.new_cache(len(ids), torch.float32, "cpu"), 0))[0]
        cases.append((prompt, ids, want))
    report.append(f"attention on {device}: " + ("KV heads repeated" if expand_kv_heads_on(torch.device(device).type)
                                                 else "SDPA enable_gqa"))
    for quant, dtype_name in modes_for(device):
        label = f"{device} {quant} weights, {dtype_name} compute"
        try:
            dtype = resolve_compute_dtype(dtype_name, device)
            stage = load_stage(config, index, device, quant, dtype)
            report.append(f"{label}: layers {kernel_paths(stage)}")
            for prompt, ids, want in cases:
                got = teacher_forced_logits(reference_head, stage, ids, prompt, device, dtype)
                agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
                tail = (got[prompt - 1:].argmax(-1) == want[prompt - 1:].argmax(-1)).float().mean().item()
                report.append(f"  prompt {prompt:4d} + {steps} steps: top-1 agreement {agree:.3f} (decode {tail:.3f}),"
                              f" max logit error {(got - want).abs().max().item():.3f}")
            prefill_s, decode_tps = timed_generation(config, index, stage, device, dtype, quant,
                                                     all_ids[:long_prompt], steps)
            report.append(f"  speed: prefill {long_prompt} tokens {prefill_s * 1000:.0f} ms, "
                          f"decode {decode_tps:.1f} tok/s")
            del stage
        except Exception as exc:  # one mode failing must not hide the others; the report says what and where
            report.append(f"{label}: FAILED {type(exc).__name__}: {exc}")
            traceback.print_exc()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()


def check_cluster(device: str, model_dir: Path, report: list[str]) -> None:
    from cluster import Cluster, write_topology

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        dtype = "bf16" if "bf16" in compute_dtypes(device) else "fp16"
        nodes = [{"id": "dev", "device": device, "dtype": dtype}, {"id": "cpu", "device": "cpu", "dtype": "bf16"}]
        topology = write_topology(work / "topology.yaml", model_dir, nodes, dtype="fp32", quant="fp16")
        with Cluster(topology, work) as cluster:
            try:
                cluster.start_head()
                cluster.wait_api()
                cluster.start_worker("dev", "--device", device)  # after start_worker's own --device cpu: wins
                cluster.start_worker("cpu")
                cluster.wait_ready(600)
                model = cluster.get("/v1/models")[1]["data"][0]["id"]
                body = {"model": model, "stream": True, "max_tokens": 48, "temperature": 0,
                        "messages": [{"role": "user", "content": "Write a Python function that reverses a list."}]}
                req = urllib.request.Request(cluster.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
                started, first, pieces = time.perf_counter(), None, []
                with urllib.request.urlopen(req, timeout=300) as reply:
                    for line in reply:
                        line = line.strip()
                        if not line.startswith(b"data: ") or line == b"data: [DONE]":
                            continue
                        delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content")
                        if delta:
                            first = first or time.perf_counter() - started
                            pieces.append(delta)
                text = "".join(pieces)
                report.append(f"cluster head + {device} ({dtype}) + cpu (bf16): streamed {len(pieces)} pieces, "
                              f"first after {(first or 0) * 1000:.0f} ms, {time.perf_counter() - started:.1f}s in all: "
                              f"{text[:80]!r}")
            except Exception as exc:  # the logs say why; the report says that it failed
                report.append(f"cluster with {device}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                for name, proc in [("head", cluster.head), *cluster.workers.items()]:
                    if proc is not None:
                        print(f"--- {name} log (tail)\n{proc.output()[-2000:]}", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", action="append", help="a device to check (repeatable); default: every CUDA "
                                                          "GPU and MPS here")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="the long prompt's length (default 512)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps (default 64)")
    parser.add_argument("--no-cluster", action="store_true", help="skip the head + workers check")
    args = parser.parse_args()
    report = [f"torch {torch.__version__}, CUDA {torch.version.cuda}, SDPA enable_gqa: {sdpa_has_enable_gqa()}"]
    for d in detect_devices(selected=(args.device or accelerators() or ["cpu"])[0]):
        memory = f"{d.total_memory / GIB:.1f} GiB" if d.total_memory else "memory unknown"
        free = f", {d.free_memory / GIB:.1f} GiB free" if d.free_memory is not None else ""
        report.append(f"device {d.id}: {d.name}, {memory}{free}, native {'/'.join(compute_dtypes(d.id))}, "
                      f"quantization scales in {half_dtype(d.id)}")
    devices = args.device or accelerators()
    if not devices:
        report.append("no CUDA or MPS device on this machine: parity, speed and cluster checks skipped "
                      "(--device cpu runs them on the CPU)")
    else:
        from _demo import demo_model_dir

        model_dir = demo_model_dir()
        for device in devices:
            check_device(device, model_dir, args.prompt_tokens, args.steps, report)
            if not args.no_cluster:
                check_cluster(device, model_dir, report)
    print("\n==== device check report ====")
    print("\n".join(report))
    print("==== end of report ====")
    return 1 if any("FAILED" in line for line in report) else 0


if __name__ == "__main__":
    sys.exit(main())
