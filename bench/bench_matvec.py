"""What bounds decode on this CPU: the bf16 matrix-vector product's memory bandwidth, per Qwen2.5-0.5B shape.

A decode step reads every layer weight once (about 0.72 GB in bf16 for 24 layers) plus the lm_head (0.27 GB);
at the bandwidth printed here that sets the fastest a plain-PyTorch bf16 decode can go, whatever the code around
the products does. int8 packed weights read half the bytes.

    python bench/bench_matvec.py [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {"q/o_proj": (896, 896), "k/v_proj": (128, 896), "gate/up_proj": (4864, 896), "down_proj": (896, 4864),
          "lm_head": (151936, 896)}
PER_LAYER = {"q/o_proj": 2, "k/v_proj": 2, "gate/up_proj": 2, "down_proj": 1}


def best_ms(fn, n: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    times.sort()
    return times[len(times) // 2] * 1e3  # the median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads; median of 30 calls, x of shape [1, in]\n")
    print(f"{'matrix':13s} {'shape':>12s} {'bf16 ms':>8s} {'GB/s':>6s} {'int8 ms':>8s} {'GB/s':>6s}")
    step_bf16 = step_int8 = 0.0
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f).bfloat16()
        x = torch.randn(1, in_f).bfloat16()
        q = torch.randint(-127, 127, (out_f, in_f), dtype=torch.int8)
        s = torch.rand(out_f).bfloat16()
        bf16 = best_ms(lambda: F.linear(x, w))
        int8 = best_ms(lambda: torch.ops.aten._weight_int8pack_mm(x, q, s))
        count = PER_LAYER.get(name, 0) * 24 or 1
        step_bf16 += count * bf16
        step_int8 += count * int8
        print(f"{name:13s} {out_f:>5d}x{in_f:<6d} {bf16:8.3f} {w.numel() * 2 / bf16 / 1e6:6.1f} {int8:8.3f} "
              f"{q.numel() / int8 / 1e6:6.1f}")
    print(f"\nproducts alone for one decode step (24 layers + lm_head): bf16 {step_bf16:.1f} ms "
          f"(at most {1000 / step_bf16:.1f} tokens/s), int8 {step_int8:.1f} ms (at most {1000 / step_int8:.1f} tokens/s)")


if __name__ == "__main__":
    main()
