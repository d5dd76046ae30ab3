"""Speed-aware plans against the even split, and the plan's predicted tokens/s against the measured.

Runs, in one go, on the demo model (real processes on loopback, tc's own CLI):

1. Two CPU workers made unequal by a real cause: the slow one is held to --duty of a core (SIGSTOP/SIGCONT,
   as cpulimit does; tests/throttle.py) from its start, so its own benchmark sees it too. First with the even
   split (head.plan_from: topology, no speeds), then with head.plan_from: workers, where the head plans from
   the speeds the workers measured on themselves. Decode tokens/s of both, and their ratio.
2. Head + 1, 2 and 3 equal workers planned from their measurements: the decode tokens/s the head's plan
   predicts (its log) against the measured.

    python bench/bench_plans.py [--duty 0.25] [--tokens 32] [--quant fp16] [--dtype bf16] [--workers 1 2 3]
                                [--skip-unequal] [--skip-predict]

Every worker measures itself afresh (its own --bench-dir), so no figure from another setting is reused. The
machine may be shared: the load average is printed with the figures, and ratios from one run are what to
compare.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from plan_runs import run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a local model directory (default: the demo model)")
    parser.add_argument("--quant", default="fp16", choices=["fp16", "int8", "int4"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--duty", type=float, default=0.25, help="share of a core the slow worker gets")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--head-threads", type=int, default=1)
    parser.add_argument("--worker-threads", type=int, default=1)
    parser.add_argument("--skip-unequal", action="store_true")
    parser.add_argument("--skip-predict", action="store_true")
    args = parser.parse_args()
    if args.model is None:
        from _demo import demo_model_dir

        args.model = demo_model_dir()
    load_before = os.getloadavg()
    rows = []
    common = dict(tokens=args.tokens, quant=args.quant, dtype=args.dtype, head_threads=args.head_threads,
                  worker_threads=args.worker_threads)
    if not args.skip_unequal:
        rows.append(("unequal, even split", run(args.model, 2, "topology", slow=1, duty=args.duty, **common)))
        rows.append(("unequal, speed-aware", run(args.model, 2, "workers", slow=1, duty=args.duty, **common)))
    if not args.skip_predict:
        for n in args.workers:
            rows.append((f"head + {n} planned", run(args.model, n, "workers", **common)))
    load_after = os.getloadavg()
    print(f"\n{args.model.name}, weights {args.quant}, compute {args.dtype}, {args.tokens} new tokens, greedy; head "
          f"{args.head_threads} thread(s), workers {args.worker_threads}; slow worker held to {args.duty:g} of a "
          f"core; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after (2 = both cores busy)\n")
    print(f"{'setup':22s} {'layers':>10s} {'decode tok/s':>12s} {'predicted':>9s} {'pred/meas':>9s}  "
          "per node ms: predicted/measured compute")
    for name, r in rows:
        ratio = f"{r.predicted / r.measured:.2f}" if r.predicted else "-"
        predicted = f"{r.predicted:.1f}" if r.predicted else "-"
        per_node = ", ".join(f"{k} {'-' if p is None else f'{p:.0f}'}/{'-' if m is None else f'{m:.0f}'}"
                             for k, (p, m) in r.nodes.items())
        print(f"{name:22s} {'/'.join(map(str, r.layers)):>10s} {r.measured:12.2f} {predicted:>9s} "
              f"{ratio:>9s}  {per_node}")
    if not args.skip_unequal:
        print(f"\nspeed-aware vs even split on the unequal pair: {rows[1][1].measured / rows[0][1].measured:.2f}x")


if __name__ == "__main__":
    main()
