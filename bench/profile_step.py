"""Where one decode step's time goes: a per-token budget of a pipeline stage, and of the head, on the demo model.

For each weight mode it loads layers [start, end) as a worker does (quantized while loading), prefills a context,
and then times decode steps at one fixed position (the cache slot is rewritten, so every step does the same work):

- step: the median wall time of a whole stage step, what a worker spends per token;
- prefill: the median time of a new request's prefill of the whole context;
- products: the stage's linear modules alone, each called on the input it got in a step, in the step's order;
- the rest of the step, split by torch.profiler into attention (SDPA), cache writes, norms and everything else
  (rotary, activation, residuals, views), with the number of operators each part dispatches per step. Profiled
  times include the profiler's own cost per operator, so they add up to more than the unprofiled step. Products
  and split are of a step through the modules, one by one; `plan` says whether the timed step ran as a decode
  plan instead (tc/model/decode_plan.py: the same calls, without the modules around them), and `modules` is
  the step through the modules, timed as `step` is;
- floor: the stage's weight bytes at the machine's streaming rate (the best of a large fp32 sum and a large fp32
  torch.mv, both measured here), what no implementation that reads every weight once can beat;
- head: the final norm, the lm_head (as the head process holds it: in the mode's head weight mode, a bf16 one on
  the product dense.fastest_product chose) and sampling, each timed alone; and, for a bf16 lm_head on another
  product, the same matrix in oneDNN's blocked layout (dense.PackedLinear).

A second table lists each product shape of the stage with its time per call, its rate in GB/s of weight bytes and
how far that is from the streaming rate.

With --against REV, the model code (tc/model) of git revision REV is loaded too, and its steps are interleaved
with this tree's in one process (A, B, A, B, ...): the only fair comparison on a machine others also load.

    python bench/profile_step.py [--modes fp16 int8 int4] [--layers 0 12] [--threads 2] [--context 128]
                                 [--steps 40] [--dtype bf16] [--against REV [--base-first]] [--clock wall|cpu]
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

PRODUCTS, ATTENTION, CACHE, NORMS, OTHER = "products", "attention", "cache writes", "norms", "rest"
CATEGORIES = (PRODUCTS, ATTENTION, CACHE, NORMS, OTHER)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def median_ms(fn, n: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        started = clock()
        fn()
        times.append(clock() - started)
    return statistics.median(times) * 1e3


def streaming_rate() -> tuple[float, float]:
    """GB/s read by a 256 MiB fp32 sum and by a 256 MiB fp32 torch.mv: the machine's weight-streaming rate."""
    buf = torch.rand(64 << 20)  # 256 MiB, far over any cache
    x = torch.rand(1024)
    mat = buf.view(-1, 1024)
    sum_ms = median_ms(lambda: buf.sum(), 9)
    mv_ms = median_ms(lambda: torch.mv(mat, x), 9)
    return buf.nbytes / sum_ms / 1e6, buf.nbytes / mv_ms / 1e6


def model_code(against: str | None) -> dict[str, ModuleType]:
    """This tree's tc.model, and with `against` that revision's tc.model as a package of its own."""
    from tc.model import config, quant, qwen2, weights

    from tc.model import dense

    trees = {"this tree": {"config": config, "quant": quant, "qwen2": qwen2, "weights": weights, "dense": dense}}
    if against:
        tmp = Path(tempfile.mkdtemp(prefix="tc_model_"))
        name = "tc_model_base"
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", against, "tc/model"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        (tmp / "tc" / "model").rename(tmp / name)
        sys.path.insert(0, str(tmp))
        trees[against] = {m: importlib.import_module(f"{name}.{m}") for m in ("config", "quant", "qwen2", "weights")}
        if (tmp / name / "dense.py").exists():
            trees[against]["dense"] = importlib.import_module(f"{name}.dense")
    return trees


class Setup:
    """One tree's stage and head in one weight mode, with a prefilled cache, ready to step."""

    def __init__(self, code: dict[str, ModuleType], model_dir: Path, mode: str, start: int, end: int,
                 dtype: torch.dtype, context: int, group_size: int):
        qwen2, quant, weights = code["qwen2"], code["quant"], code["weights"]
        self.qwen2 = qwen2
        self.config = code["config"].Qwen2Config.from_file(model_dir / "config.json")
        index = weights.WeightIndex.open(model_dir)
        if "quantization" in inspect.signature(qwen2.Stage.load).parameters:  # weights quantized as they stream in
            self.stage = qwen2.Stage.load(self.config, index, start, end, dtype, "cpu",
                                          quant.Quantization(mode, group_size))
        else:  # a revision from before: each layer quantized after it loaded
            prepare = None if mode == "fp16" else (lambda layer: quant.quantize_linears(layer, mode, group_size))
            self.stage = qwen2.Stage.load(self.config, index, start, end, dtype, "cpu", prepare=prepare)
        # as the head process loads it: a bf16 lm_head on the fastest product here, a quantized one unpacked (a
        # revision from before HeadModel.load took `pack` loaded it plain)
        pack = {"pack": None if mode == "fp16" else False} \
            if "pack" in inspect.signature(qwen2.HeadModel.load).parameters else {}
        self.head = qwen2.HeadModel.load(self.config, index, dtype, **pack)
        self.dense = code.get("dense")
        if mode != "fp16":
            quant.quantize_linears(self.head, quant.head_weight_mode(mode), group_size)
        self.cache = self.stage.new_cache(context + 1, dtype, "cpu")
        self.context = context
        ids = torch.arange(context + 1).remainder(self.config.vocab_size - 1000).add(1000)[None]  # [1, context + 1]
        self.prompt = self.head.embed(ids[:, :context]).to(dtype)  # [1, context, hidden]
        self.stage(self.prompt, self.cache, 0)
        self.x = self.head.embed(ids[:, context:]).to(dtype)  # [1, 1, hidden]
        self.dtype = dtype

    def step(self) -> torch.Tensor:
        return self.stage(self.x, self.cache, self.context)

    def planned(self) -> bool:
        """Whether this tree's steps run as a decode plan (a revision from before plans: no)."""
        return any(p is not None for p in getattr(self.stage, "_plans", {}).values())

    @contextlib.contextmanager
    def through_modules(self):
        """Steps through the modules one by one, as a tree from before decode plans takes them."""
        stage_class = self.qwen2.Stage
        before = getattr(stage_class, "decode_plans", None)
        if before is not None:
            stage_class.decode_plans = False
        try:
            yield
        finally:
            if before is not None:
                stage_class.decode_plans = before

    def prefill(self) -> torch.Tensor:
        """The whole context again, as a new request's prefill (a fresh cache)."""
        return self.stage(self.prompt, self.stage.new_cache(self.context + 1, self.dtype, "cpu"), 0)

    def weight_bytes(self) -> int:
        return sum(module_bytes(m) for m in linear_modules(self.stage))


def is_linear(module: torch.nn.Module) -> bool:
    return "Linear" in type(module).__name__


def linear_modules(root: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in root.modules() if is_linear(m)]


def module_bytes(module: torch.nn.Module) -> int:
    tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return sum(t.numel() * t.element_size() for t in tensors)


def recorded_products(setup: Setup) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """(module, input) of every linear call in one step, in order."""
    calls: list[tuple[torch.nn.Module, torch.Tensor]] = []
    hooks = [m.register_forward_pre_hook(lambda m, args: calls.append((m, args[0].clone())))
             for m in linear_modules(setup.stage)]
    try:
        setup.step()
    finally:
        for h in hooks:
            h.remove()
    return calls


def products_ms(calls, n: int) -> float:
    def run():
        with torch.inference_mode():
            for module, x in calls:
                module(x)
    return median_ms(run, n)


def shape_table(calls, n: int) -> dict[tuple[str, int, int], tuple[int, float, int]]:
    """(class, out, in) -> (calls per step, ms per call, weight bytes) for each product shape of a step."""
    by_shape: dict[tuple[str, int, int], list] = defaultdict(list)
    for module, x in calls:
        by_shape[(type(module).__name__, module.out_features, module.in_features)].append((module, x))
    table = {}
    for key, group in by_shape.items():
        ms = products_ms(group, n) / len(group)
        table[key] = (len(group), ms, module_bytes(group[0][0]))
    return table


class _Label:
    """Forward hooks that wrap a module's call in a profiler label."""

    def __init__(self, label: str):
        self.label, self.stack = label, []

    def pre(self, module, args):
        rf = torch.profiler.record_function(self.label)
        rf.__enter__()
        self.stack.append(rf)

    def post(self, module, args, out):
        self.stack.pop().__exit__(None, None, None)


def profiled_split(setup: Setup, steps: int) -> tuple[dict[str, float], dict[str, int], float]:
    """ms and operator count per category for one step, and the profiled step's wall ms."""
    hooks, labels = [], {"products": _Label(PRODUCTS), "norms": _Label(NORMS)}
    for m in setup.stage.modules():
        label = labels["products"] if is_linear(m) else labels["norms"] if "Norm" in type(m).__name__ else None
        if label is not None:
            hooks += [m.register_forward_pre_hook(label.pre), m.register_forward_hook(label.post)]
    cache = setup.cache
    original = {name: getattr(cache, name) for name in ("update", "write") if hasattr(cache, name)}
    for name, fn in original.items():
        def wrapped(*args, _fn=fn, **kwargs):
            with torch.profiler.record_function(CACHE):
                return _fn(*args, **kwargs)
        setattr(cache, name, wrapped)
    try:
        setup.step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            started = clock()
            for _ in range(steps):
                setup.step()
            wall_ms = (clock() - started) * 1e3 / steps
    finally:
        for h in hooks:
            h.remove()
        for name in original:
            delattr(cache, name)
    ms: dict[str, float] = defaultdict(float)
    ops: dict[str, int] = defaultdict(int)
    for event in prof.events():
        parent = event.cpu_parent
        if event.name in CATEGORIES:  # a label: its whole span belongs to it
            if parent is None or parent.name not in CATEGORIES:
                ms[event.name] += event.cpu_time_total / 1e3
            continue
        if parent is not None and parent.name not in CATEGORIES:
            continue  # an operator called by another operator: counted in its caller
        if parent is not None:
            ops[parent.name] += 1
            continue
        category = ATTENTION if "scaled_dot_product_attention" in event.name else OTHER
        ms[category] += event.cpu_time_total / 1e3
        ops[category] += 1
    return ({c: ms[c] / steps for c in CATEGORIES}, {c: ops[c] // steps for c in CATEGORIES}, wall_ms)


def swept_median_ms(fns, n: int) -> list[float]:
    """Each of `fns`' median time (ms) over n turns, each call after a sweep of the caches (probe.cache_sweeper), as
    a decode step finds them after its weights: taken in turn, A, B, A, B, ..."""
    from tc.model.probe import cache_sweeper

    sweep, times = cache_sweeper(), [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(n):
        for fn, taken in zip(fns, times):
            sweep()
            started = time.perf_counter()
            fn()
            taken.append(time.perf_counter() - started)
    return [statistics.median(taken) * 1e3 for taken in times]


def head_budget(setup: Setup, n: int) -> dict[str, float]:
    from tc.sampling import SamplingParams, choose, new_rng

    head = setup.head
    with torch.inference_mode():
        h = setup.step()  # [1, 1, hidden]
        normed = head.norm(h)
        logits = head.lm_head(normed).float()[0, -1]  # [vocab]
        rng = new_rng(0)
        greedy, top_p = SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.9)
        times = {"norm": median_ms(lambda: head.norm(h), n),
                 "lm_head": median_ms(lambda: head.lm_head(normed).float(), n),
                 "greedy": median_ms(lambda: choose(logits, greedy, None, rng), n),
                 "top-p": median_ms(lambda: choose(logits, top_p, None, rng), n)}
        if hasattr(head, "greedy_tokens"):  # a greedy step as the generator takes it, on caches a step has swept
            times["swept full"], times["swept quick"] = swept_median_ms(
                [lambda: choose(head.logits(h)[0, -1], greedy, None, rng), lambda: head.greedy_tokens(h)], n)
        lm = head.lm_head
        can_pack = getattr(setup.dense, "can_pack", lambda: True)  # a revision from before it: it assumed so
        if setup.dense is not None and isinstance(lm, torch.nn.Linear) and lm.weight.dtype == torch.bfloat16 \
                and hasattr(setup.dense, "PackedLinear") and can_pack():  # an AVX2-only CPU has no blocked bf16
            blocked = setup.dense.PackedLinear.from_linear(lm)  # what HeadModel.load(pack=True) would hold
            times["blocked"] = median_ms(lambda: blocked(normed).float(), n)
            del blocked
        return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["fp16", "int8", "int4"], choices=["fp16", "int8", "int4"])
    parser.add_argument("--layers", nargs=2, type=int, default=[0, 12], metavar=("START", "END"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=128, help="positions in the cache before the step")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="A/B rounds with --against")
    parser.add_argument("--prefills", type=int, default=3, help="timed prefills of the context per measurement")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--against", metavar="REV", help="also run tc/model of this git revision, interleaved")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiler split and shape table")
    parser.add_argument("--base-first", action="store_true",
                        help="load REV's stage before this tree's: where two stages' weights land in memory moves "
                             "DRAM-bound steps by a few percent, against the one loaded first here; run both ways")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="cpu: this process's CPU time, which time spent waiting for a core shared with other "
                             "processes does not inflate (with one thread; with more it counts threads' waits)")
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    from _demo import demo_model_dir

    model_dir = demo_model_dir()
    trees = model_code(args.against)
    read_gbs, mv_gbs = streaming_rate()
    stream = max(read_gbs, mv_gbs)
    start, end = args.layers
    print(f"demo model layers [{start}, {end}), compute {args.dtype}, {args.threads} threads, {args.context} "
          f"cached positions, {args.clock} clock; streaming rate {stream:.1f} GB/s (fp32 sum {read_gbs:.1f}, "
          f"fp32 mv {mv_gbs:.1f})\n")
    rows, shapes, heads = [], {}, {}
    for mode in args.modes:
        order = list(trees.items())[::-1] if args.base_first else list(trees.items())
        setups = {name: Setup(code, model_dir, mode, start, end, DTYPES[args.dtype], args.context, args.group_size)
                  for name, code in order}
        with torch.inference_mode():
            for s in setups.values():
                s.step()
            walls: dict[str, list[float]] = defaultdict(list)
            prefills: dict[str, list[float]] = defaultdict(list)
            for _ in range(args.rounds if args.against else 1):  # interleaved: A, B, A, B, ...
                for name, s in setups.items():
                    walls[name].append(median_ms(s.step, args.steps))
                    prefills[name].append(median_ms(s.prefill, args.prefills, warmup=1))
        for name, s in setups.items():
            row = {"mode": mode, "tree": name, "step": statistics.median(walls[name]),
                   "prefill": statistics.median(prefills[name]),
                   "floor": s.weight_bytes() / stream / 1e6, "mb": s.weight_bytes() / 1e6}
            row["plan"] = s.planned()
            with torch.inference_mode(), s.through_modules():
                row["modules"] = median_ms(s.step, args.steps)
            if not args.no_profile:
                with s.through_modules():
                    calls = recorded_products(s)
                    row["products"] = products_ms(calls, args.steps)
                    row["split"], row["ops"], row["profiled"] = profiled_split(s, args.steps)
                shapes[(mode, name)] = shape_table(calls, args.steps)
                heads[(mode, name)] = head_budget(s, args.steps)
            rows.append(row)
            print(f"  {mode} {name}: step {row['step']:.2f} ms", file=sys.stderr)
        del setups

    print(f"{'mode':5s} {'tree':10s} {'MB':>6s} {'floor':>6s} {'step':>6s} {'vs floor':>8s} {'plan':>4s} "
          f"{'modules':>7s} {'prefill':>8s} {'tok/s':>6s}" +
          ("" if args.no_profile else f" {'products':>8s} {'GB/s':>5s} | profiled: " +
           " ".join(f"{c:>12s}" for c in CATEGORIES) + f" {'step':>6s}"))
    for r in rows:
        line = (f"{r['mode']:5s} {r['tree'][:10]:10s} {r['mb']:6.0f} {r['floor']:6.2f} {r['step']:6.2f} "
                f"{r['step'] / r['floor']:7.2f}x {'yes' if r['plan'] else 'no':>4s} {r['modules']:7.2f} "
                f"{r['prefill']:8.1f} {args.context / r['prefill'] * 1e3:6.0f}")
        if not args.no_profile:
            line += f" {r['products']:8.2f} {r['mb'] / r['products']:5.1f} | {'':9s} " + " ".join(
                f"{r['split'][c]:6.2f} ({r['ops'][c]:3d})" for c in CATEGORIES) + f" {r['profiled']:6.2f}"
        print(line)
    if args.against:
        for mode in args.modes:
            a, b = (next(r for r in rows if r["mode"] == mode and r["tree"] == t) for t in trees)  # this tree, REV
            print(f"{mode}: this tree's decode step takes {a['step'] / b['step']:.2f}x the time of {args.against}'s, "
                  f"its prefill {a['prefill'] / b['prefill']:.2f}x")
    if args.no_profile:
        return
    print("\nms per step; (n) operators dispatched per step; floor = weight bytes at the streaming rate")
    print(f"\n{'mode':5s} {'tree':10s} {'product':12s} {'shape':>12s} {'calls':>5s} {'ms/call':>8s} {'GB/s':>5s} "
          f"{'of stream':>9s}")
    for (mode, name), table in shapes.items():
        for (cls, out_f, in_f), (count, ms, nbytes) in sorted(table.items(), key=lambda kv: -kv[1][1] * kv[1][0]):
            gbs = nbytes / ms / 1e6
            print(f"{mode:5s} {name[:10]:10s} {cls:12s} {out_f:>5d}x{in_f:<6d} {count:5d} {ms:8.3f} {gbs:5.1f} "
                  f"{gbs / stream:8.0%}")
    parts = ("norm", "lm_head", "greedy", "top-p", "blocked", "swept full", "swept quick")
    print(f"\n{'mode':5s} {'tree':10s} head ms: " + " ".join(f"{k:>11s}" for k in parts))
    for (mode, name), h in heads.items():
        print(f"{mode:5s} {name[:10]:10s} {'':9s}" + " ".join(f"{h[k]:11.2f}" if k in h else f"{'-':>11s}"
                                                            for k in parts))
    print("head: lm_head as the head process holds it; blocked: the same matrix in oneDNN's blocked layout; "
          "swept: a greedy step after a sweep of the caches, through the logits and sampling (full) and as the "
          "generator takes it (quick: HeadModel.greedy_tokens, the bf16 lm_head's screen or the int8 one's plan)")


if __name__ == "__main__":
    main()
