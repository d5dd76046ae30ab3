"""A sliding-window layer's decode attention: the keys past the window sliced off (what Attention._attend does for a
decode row) against the same keys masked (its path for rows of a prompt, and every row's before), per cached
length, for Gemma 3 1B's shapes (4 query heads, 1 KV head, head_dim 256, window 512) on one thread.

    python bench/bench_sliding_decode.py [--window 512] [--lengths 512 2048 8192]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tc.model.qwen2 import expand_kv_heads_on, grouped_attention, visible_keys  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 4, 1, 256


def per_call_s(fn, repeat: int = 100) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - started) / repeat)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(f"{'dtype':9} {'cached':>7} {'masked us':>10} {'sliced us':>10} {'ratio':>6} {'max diff':>9}")
    for dtype in (torch.bfloat16, torch.float32):
        for length in args.lengths:
            keys, values = (torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
            q = torch.randn(1, HEADS, 1, HEAD_DIM, generator=gen).to(dtype)
            position = length - 1
            expand = expand_kv_heads_on("cpu")

            def masked() -> torch.Tensor:
                mask = visible_keys(position, 1, args.window, q.device)
                return grouped_attention(q, keys, values, mask, False, expand, None).reshape(-1)

            def sliced() -> torch.Tensor:
                first = max(0, position + 1 - args.window)
                block = q[:, :, 0].unflatten(1, (KV_HEADS, HEADS // KV_HEADS))
                return F.scaled_dot_product_attention(block, keys[:, :, first:], values[:, :, first:]).reshape(-1)

            diff = (masked().float() - sliced().float()).abs().max().item()
            masked_s, sliced_s = per_call_s(masked), per_call_s(sliced)
            print(f"{str(dtype).split('.')[1]:9} {length:7d} {masked_s * 1e6:10.0f} {sliced_s * 1e6:10.0f} "
                  f"{masked_s / sliced_s:6.1f} {diff:9.1e}")


if __name__ == "__main__":
    main()
