"""Single-process generation speed and memory: our generator against transformers' generate().

Each configuration runs in its own process (so peak RSS is its own), on the demo model, with the same prompt
and the same number of torch threads. Prints one table with ratios against transformers at the same dtype.

    python bench/bench_generate.py [--threads 2] [--tokens 64] [--dtypes bf16 fp32]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

PROMPT = ("# A small HTTP client\nimport json\nimport urllib.request\n\n\ndef fetch_json(url, timeout=10):\n"
          '    """Fetch a URL and decode its JSON body, raising ValueError on a non-200 status."""\n')


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run_ours(model_dir: Path, dtype: str, tokens: int) -> dict:
    from tc.local import load_local_generator
    from tc.sampling import SamplingParams

    generator = load_local_generator(model_dir, dtype)
    ids = generator.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=tokens, temperature=0)
    generator.generate(ids, SamplingParams(max_tokens=4, temperature=0))  # warm-up
    result = generator.generate(ids, params)
    return {"prompt_tokens": len(ids), "tokens": result.completion_tokens,
            "prefill_tps": len(ids) / result.time_to_first_token_s,
            "decode_tps": result.decode_tokens_per_s, "text": result.text}


def run_transformers(model_dir: Path, dtype: str, tokens: int) -> dict:
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    model = Qwen2ForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch_dtype).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = torch.tensor([tok.encode(PROMPT)])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
        started = time.perf_counter()
        model(ids)
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        total_s = time.perf_counter() - started
    generated = out.shape[1] - ids.shape[1]
    # generate() = one prefill + (generated - 1) decode steps
    decode_s = max(total_s - prefill_s, 1e-9)
    return {"prompt_tokens": ids.shape[1], "tokens": generated, "prefill_tps": ids.shape[1] / prefill_s,
            "decode_tps": (generated - 1) / decode_s, "text": tok.decode(out[0, ids.shape[1]:])}


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from _demo import demo_model_dir

    runner = run_ours if args.impl == "ours" else run_transformers
    result = runner(demo_model_dir(), args.dtype, args.tokens)
    result["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    parser.add_argument("--impls", nargs="+", default=["transformers", "ours"])
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.impl, args.dtype = args.child
        return child(args)
    results = {}
    for dtype in args.dtypes:
        for impl in args.impls:
            cmd = [sys.executable, __file__, "--child", impl, dtype, "--threads", str(args.threads),
                   "--tokens", str(args.tokens)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            results[(impl, dtype)] = json.loads(out)
            r = results[(impl, dtype)]
            print(f"  {impl:12s} {dtype}: decode {r['decode_tps']:.1f} tok/s", file=sys.stderr)
    print(f"\ndemo model, {args.threads} threads, {args.tokens} new tokens, greedy\n")
    print(f"{'impl':12s} {'dtype':5s} {'prefill tok/s':>13s} {'decode tok/s':>12s} {'peak RSS MB':>11s} "
          f"{'decode vs HF':>12s}")
    for (impl, dtype), r in results.items():
        ref = results.get(("transformers", dtype))
        ratio = f"{r['decode_tps'] / ref['decode_tps']:.2f}x" if ref else "-"
        print(f"{impl:12s} {dtype:5s} {r['prefill_tps']:13.1f} {r['decode_tps']:12.1f} {r['peak_rss_mb']:11.0f} "
              f"{ratio:>12s}")
    for (impl, dtype), r in results.items():
        print(f"\n{impl} {dtype} wrote: {r['text'][:120]!r}")


if __name__ == "__main__":
    main()
