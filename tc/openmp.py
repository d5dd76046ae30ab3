"""OpenMP threads that give the cores back: to processes sharing them, and to each process's compute thread.

PyTorch's CPU kernels run on OpenMP. On Linux that is libgomp, whose threads keep spinning after a parallel region
for GOMP_SPINCOUNT iterations (300,000 by default: milliseconds on current CPUs) so that the next region starts
at once. Within one stage's decode step that is right: hundreds of small regions follow each other microseconds
apart. After the step it is not, wherever the head and workers share cores (the demo's head and local workers on
one machine, or a head beside a worker): the finished process's threads spin on while the next stage computes,
and take the cores it needs. Measured on the demo model, head + 2 workers of 2 threads on one 2-core machine
(`python bench/budget_cluster.py --env GOMP_SPINCOUNT=300000 - OMP_WAIT_POLICY=PASSIVE`): int4 decode 20.4 tok/s
with libgomp's default spin, 29.0 with this one, 22.4 with no spin at all (every region then wakes its threads);
fp16 13.7, 18.1 and 15.6. Each stage then runs as fast as it does alone (10 ms for 12 int4 layers).

The setting must be in the environment before libgomp loads, that is before torch is imported, so
tc/__main__.py applies it first. An operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins; other OpenMP
runtimes (LLVM's libomp on macOS) ignore the variable.
"""
from __future__ import annotations

import threading
from typing import Callable, MutableMapping, TypeVar

T = TypeVar("T")

# Iterations a finished region's threads spin before sleeping: well under a millisecond, still far longer than
# the gap between two regions of one step.
SPIN_COUNT = 10_000


def settle_openmp(environ: MutableMapping[str, str]) -> None:
    """Set tc's OpenMP spin in `environ` unless the operator chose a wait policy or spin count there."""
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)


def on_own_thread(fn: Callable[[], T], name: str) -> T:
    """Run `fn` on a thread of its own that ends with it; return what it returns, or raise what it raised.

    libgomp gives every thread that runs a parallel region a pool of threads of its own, kept until that thread
    ends, and once a process holds more pooled threads than it has cores it stops spinning altogether: every
    region must then wake its threads. One-off work (loading the head's tensors, a worker's speed probe) done on
    the main thread would leave such a pool beside the compute thread's for the life of the process. Measured on
    a worker of 2 threads on 2 cores: 64 demo tokens through head + 2 took 2.80 s after a speed probe on the main
    thread, 2.28 s without one; a 12-layer int4 stage stepped in 15 ms instead of 9.
    """
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # handed to the caller, who sees it as if it had called fn itself
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
