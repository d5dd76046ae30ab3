"""Time one linear layer per weight mode and path, on Qwen2.5-0.5B's projection shapes.

For each shape [out, in] and each input x of [1, 1, in] (decode), [1, 8, in] (batch8: a decode step of eight
sequences, --modes decode,batch8) and [1, 128, in] (prefill), prints microseconds
per call for bf16 nn.Linear, bf16 in oneDNN's blocked layout (dense.PackedLinear), fp32 nn.Linear, Int8Linear
and Int4Linear on their portable and PyTorch packed-kernel paths and on tc's native products (tc/model/native.py;
n/a where they do not build or lose their probe), and Int8Linear as it chooses between PyTorch's kernel and a
dense product for prefill (quant.int8_dense_prefill_from_rows), activations in bf16 for the quantized modules,
and each one's speed-up over bf16 nn.Linear (>1 is faster).
By default each variant rotates through enough copies of its layer that the weights come from memory, as they
do when a whole model decodes; --hot calls a single copy instead.
Each figure is the 10th percentile of single-call times, taken round-robin across the variants, as the machine
may be shared (see time_interleaved).

    python bench/bench_quant_kernels.py [--threads 2] [--shapes 896x896,4864x896] [--modes decode,batch8,prefill]
"""
from __future__ import annotations

import argparse
import copy
import functools
import gc
import itertools
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tc.model.dense import PackedLinear  # noqa: E402
from tc.model.quant import Int4Linear, Int8Linear, int4_kernel_available, int8_kernel_available  # noqa: E402

SHAPES = {  # name -> (out_features, in_features), Qwen2.5-0.5B; the model runs the fused ones
    "q/o 896x896": (896, 896),
    "k/v 128x896": (128, 896),
    "qkv fused 1152x896": (1152, 896),
    "gate/up 4864x896": (4864, 896),
    "gate_up fused 9728x896": (9728, 896),
    "down 896x4864": (896, 4864),
    "lm_head 151936x896": (151936, 896),
}
COLD_WORKING_SET = 256 << 20  # bytes of bf16 weights to rotate through: several times any L3 cache
INPUTS = {"decode": 1, "batch8": 8, "prefill": 128}  # positions per call; batch8: 8 sequences decoding at once
VARIANTS = ("bf16", "bf16 blocked", "fp32", "int8 portable", "int8 packed", "int8 chosen", "int8 native",
            "int4 portable", "int4 packed", "int4 native")


def time_interleaved(calls: dict[str, Callable[[], object]], budget_s: float, rounds: int = 7
                     ) -> dict[str, float]:
    """Microseconds per call for each entry: the 10th percentile of single-call times.

    Calls are timed one by one, round-robin across the entries, so that load from elsewhere on the machine hits
    every variant alike; and a low percentile rather than a mean, because a call whose thread was preempted
    waits out a whole scheduler slice at the thread pool's barrier, which says nothing about the kernel.
    """
    reps: dict[str, int] = {}
    for name, fn in calls.items():
        fn()  # warm-up: first-call allocations, kernel probes
        start = time.perf_counter()
        fn()
        reps[name] = max(1, int(budget_s / rounds / max(time.perf_counter() - start, 1e-7)))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            for _ in range(reps[name]):
                start = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - start)
    # with fewer than 10 samples (calls of seconds each) the best one is the estimate
    return {name: (statistics.quantiles(s, n=10)[0] if len(s) >= 10 else min(s)) * 1e6
            for name, s in samples.items()}


def build(variant: str, linear32: nn.Linear) -> tuple[nn.Module, torch.dtype] | None:
    """The module for `variant` and the dtype of its input; None when this machine has no such path."""
    if variant == "bf16":
        return _cast(linear32, torch.bfloat16), torch.bfloat16
    if variant == "bf16 blocked":
        try:
            return PackedLinear.from_linear(_cast(linear32, torch.bfloat16)), torch.bfloat16
        except (RuntimeError, NotImplementedError):
            return None
    if variant == "fp32":
        return linear32, torch.float32
    mode, path = variant.split()
    kernel = path != "portable"
    lin16 = _cast(linear32, torch.bfloat16)
    if path == "native":  # the default path, where the native product builds and wins its probe
        module = Int8Linear.from_linear(lin16) if mode == "int8" else Int4Linear.from_linear(lin16, 128)
        return (module, torch.bfloat16) if module.path == "native" else None
    if mode == "int8":
        if kernel and not int8_kernel_available("cpu"):
            return None
        return Int8Linear.from_linear(lin16, use_kernel=kernel, dense_prefill=None if path == "chosen" else False), \
            torch.bfloat16
    if kernel and int4_kernel_available("cpu") is None:
        return None
    return Int4Linear.from_linear(lin16, 128, use_kernel=kernel), torch.bfloat16


def _rotation(module: nn.Module, copies: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A callable that runs `copies` copies of `module` in turn, so weights come from memory, not cache."""
    if isinstance(module, PackedLinear):  # an opaque oneDNN tensor does not deep-copy; pack copies instead
        weight = module.dense_weight()
        cycle = itertools.cycle([module] + [PackedLinear(weight) for _ in range(copies - 1)])
        return lambda x: next(cycle)(x)
    cycle = itertools.cycle([module] + [copy.deepcopy(module) for _ in range(copies - 1)])
    return lambda x: next(cycle)(x)


def _cast(linear: nn.Linear, dtype: torch.dtype) -> nn.Linear:
    out = nn.Linear(linear.in_features, linear.out_features, bias=False, dtype=dtype)
    out.weight.data.copy_(linear.weight.data)
    return out.requires_grad_(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", default=",".join(f"{o}x{i}" for o, i in SHAPES.values()),
                        help="comma-separated OUTxIN")
    parser.add_argument("--modes", default="decode,prefill")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds per measurement")
    parser.add_argument("--hot", action="store_true",
                        help="call one copy of each layer (weights stay in cache) instead of rotating through "
                             f"{COLD_WORKING_SET >> 20} MiB of copies as a whole model's decode does")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    wanted = {tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")}
    modes = args.modes.split(",")
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, weights {'in cache' if args.hot else 'from memory'}; "
          "microseconds per call (speed-up vs bf16 nn.Linear)")
    header = f"{'shape':>20} {'x':>13} " + " ".join(f"{v:>20}" for v in VARIANTS)
    print(header)
    torch.manual_seed(0)
    with torch.inference_mode():
        for name, shape in SHAPES.items():
            if shape not in wanted:
                continue
            out_f, in_f = shape
            linear32 = nn.Linear(in_f, out_f, bias=False).requires_grad_(False)
            nn.init.normal_(linear32.weight, std=0.02)
            modules = {v: build(v, linear32) for v in VARIANTS}
            copies = 1 if args.hot else -(-COLD_WORKING_SET // (out_f * in_f * 2))
            rotations = {v: _rotation(built[0], copies) for v, built in modules.items() if built is not None}
            for mode in modes:
                positions = INPUTS[mode]
                xs = {dtype: torch.randn(1, positions, in_f).to(dtype) for dtype in (torch.bfloat16, torch.float32)}
                calls = {v: functools.partial(rotations[v], xs[built[1]]) for v, built in modules.items()
                         if built is not None}
                budget = args.budget * (3 if out_f > 100_000 else 1)
                us = time_interleaved(calls, budget, rounds=3 if positions * out_f > 1_000_000 else 7)
                base = us["bf16"]
                cells = [f"{us[v]:>12.0f} ({base / us[v]:.2f}x)" if v in us else f"{'n/a':>20}" for v in VARIANTS]
                print(f"{name:>20} {f'[1,{positions},{in_f}]':>13} " + " ".join(cells), flush=True)
            del modules, rotations
            gc.collect()

if __name__ == "__main__":
    main()
