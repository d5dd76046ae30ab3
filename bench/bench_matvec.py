"""What bounds decode on this CPU: each one-row product's rate in GB/s of weight bytes, per Qwen2.5-0.5B shape.

A decode step reads every layer weight once (about 0.72 GB in bf16 for 24 layers) plus the lm_head (0.27 GB);
at the rates printed here that sets the fastest a plain-PyTorch decode can go, whatever the code around the
products does. Columns: bf16 F.linear on the checkpoint's layout, bf16 in oneDNN's blocked layout (what
tc.model.dense packs where its probe finds it faster), and the int8 packed kernel (half the bytes). The shapes are
those the model runs (q/k/v and gate/up fused). Each call reads a different copy of the weight, so weights come
from memory as in a real step; the machine's own streaming rate (a large fp32 sum) is printed for scale.

    python bench/bench_matvec.py [--threads 2]
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tc.model.dense import PackedLinear  # noqa: E402

SHAPES = {"qkv_proj": (1152, 896), "o_proj": (896, 896), "gate_up_proj": (9728, 896), "down_proj": (896, 4864),
          "lm_head": (151936, 896)}
PER_LAYER = {"qkv_proj": 1, "o_proj": 1, "gate_up_proj": 1, "down_proj": 1}
WORKING_SET = 256 << 20  # bytes of bf16 copies each column rotates through: far over any cache


def median_ms(fn, n: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    times.sort()
    return times[len(times) // 2] * 1e3


def shape_ms(out_f: int, in_f: int) -> dict[str, float]:
    """Median ms of each product of one [out_f, in_f] weight, cycling through enough copies that each call reads its
    weight from memory (the copies are freed on return, before the next shape's)."""
    copies = max(1, -(-WORKING_SET // (out_f * in_f * 2)))
    ws = [torch.randn(out_f, in_f).bfloat16() for _ in range(copies)]
    blocked = itertools.cycle([PackedLinear(w) for w in ws])
    qs = itertools.cycle([torch.randint(-127, 127, (out_f, in_f), dtype=torch.int8) for _ in range(copies)])
    plain = itertools.cycle(ws)
    x = torch.randn(1, in_f).bfloat16()
    s = torch.rand(out_f).bfloat16()
    return {"bf16": median_ms(lambda: F.linear(x, next(plain))),
            "blocked": median_ms(lambda: next(blocked)(x)),
            "int8": median_ms(lambda: torch.ops.aten._weight_int8pack_mm(x, next(qs), s))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    buf = torch.rand(64 << 20)
    stream = buf.nbytes / median_ms(buf.sum, 9) / 1e6
    print(f"{args.threads} threads; median of 30 calls, x of shape [1, in]; streaming rate {stream:.1f} GB/s\n")
    print(f"{'matrix':13s} {'shape':>12s} {'bf16 ms':>8s} {'GB/s':>6s} {'blocked':>8s} {'GB/s':>6s} {'int8 ms':>8s} "
          f"{'GB/s':>6s}")
    step = {"bf16": 0.0, "blocked": 0.0, "int8": 0.0}
    with torch.inference_mode():
        for name, (out_f, in_f) in SHAPES.items():
            ms = shape_ms(out_f, in_f)
            count = PER_LAYER.get(name, 0) * 24 or 1
            for k in step:
                step[k] += count * ms[k]
            nbytes = {"bf16": out_f * in_f * 2, "blocked": out_f * in_f * 2, "int8": out_f * in_f}
            print(f"{name:13s} {out_f:>5d}x{in_f:<6d} " + " ".join(f"{ms[k]:8.3f} {nbytes[k] / ms[k] / 1e6:6.1f}"
                                                                   for k in step))
    print("\nproducts alone for one decode step (24 layers + lm_head): " + ", ".join(
        f"{k} {v:.1f} ms (at most {1000 / v:.1f} tokens/s)" for k, v in step.items()))


if __name__ == "__main__":
    main()
