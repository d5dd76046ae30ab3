"""Chaos run: clients keep asking while workers are killed, frozen, terminated and cut off at random.

Starts a head and its workers (real processes, tc's own CLI) on a tiny random model, or on the demo model with
--demo, then for --minutes runs client threads that send greedy completions and a chaos thread that every few
seconds does one of:

    kill   SIGKILL a worker, restart it a moment later
    stop   SIGSTOP a worker for up to a few seconds (past the heartbeat limit or not), then SIGCONT
    term   SIGTERM a worker (it leaves cleanly), restart it
    cut    (--netns, as root) take a worker's link down for a few seconds, then up again

Every request ends in one of four buckets, printed at the end:

    succeeded  a 200 whose text is the single-process greedy text for that prompt
    failed     an OpenAI-shaped error of a known type (worker_lost, cluster_not_ready, ...): a clear answer
    wrong      a 200 with other text (the target is zero)
    lost       no HTTP answer, a timeout, a 500, or a body that is not an OpenAI error (the target is zero)

    python bench/chaos.py [--minutes 10] [--demo] [--workers 2] [--spare] [--netns] [--clients 2] [--seed 1]
                          [--no-resume] [--grace 20] [--interval 4]

Exit status 0 when nothing was lost or wrong, 1 otherwise.
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from cluster import Cluster, Process, write_topology  # noqa: E402

CLEAR_ERRORS = {"worker_lost", "cluster_not_ready", "rate_limit_exceeded", "service_unavailable", "worker_error"}
PROMPTS = ["the quick brown fox", "def fibonacci(n):", "Once upon a time", "import json\n", "1, 2, 3, 4,",
           "The capital of France is"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--demo", action="store_true", help="the real demo model instead of a tiny random one")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--spare", action="store_true", help="also run a spare worker standing by")
    parser.add_argument("--netns", action="store_true", help="put every process in its own network namespace "
                        "and cut links too (root; 2 workers)")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-resume", action="store_true", help="fail requests on a lost worker instead")
    parser.add_argument("--grace", type=float, default=20.0, help="head.resume_grace_s")
    parser.add_argument("--interval", type=float, default=4.0, help="mean seconds between chaos events")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--workdir", type=Path, help="keep logs here (default: a temporary directory)")
    return parser.parse_args(argv)


class References:
    """The single-process greedy text of each prompt, computed lazily and kept."""

    def __init__(self, model_dir: Path, max_tokens: int):
        import torch

        from model_helpers import OurModel
        from tc.generation import Generator
        from tc.model.tokenizer import TextTokenizer

        torch.set_num_threads(1)
        model = OurModel(model_dir, torch.float32)
        self.tokenizer = TextTokenizer.load(model_dir)
        self.generator = Generator(model.head, self.tokenizer, model.pipeline(), torch.float32)
        self.max_tokens = max_tokens
        self.texts: dict[str, str] = {}
        self.lock = threading.Lock()

    def text(self, prompt: str) -> str:
        from tc.sampling import SamplingParams

        with self.lock:
            if prompt not in self.texts:
                ids = self.tokenizer.encode(prompt)
                params = SamplingParams(max_tokens=self.max_tokens, temperature=0)
                self.texts[prompt] = self.generator.generate(ids, params).text
            return self.texts[prompt]


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.errors: Counter = Counter()
        self.lost_examples: list[str] = []
        self.events: Counter = Counter()

    def add(self, bucket: str, detail: str = "") -> None:
        with self.lock:
            self.counts[bucket] += 1
            if bucket == "failed":
                self.errors[detail] += 1
            elif bucket in ("lost", "wrong") and len(self.lost_examples) < 10:
                self.lost_examples.append(f"{bucket}: {detail}")


def classify(status: object, data: bytes, expected: str) -> tuple[str, str]:
    if status == 200:
        try:
            text = json.loads(data)["choices"][0]["text"]
        except (ValueError, KeyError, IndexError, TypeError):
            return "lost", f"200 with a body that is not a completion: {data[:200]!r}"
        return ("succeeded", "") if text == expected else ("wrong", f"{text!r} != {expected!r}")
    try:
        error = json.loads(data)["error"]
        kind = error["type"]
    except (ValueError, KeyError, TypeError):
        return "lost", f"{status} without an OpenAI error body: {data[:200]!r}"
    if kind in CLEAR_ERRORS:
        return "failed", f"{status} {kind}"
    return "lost", f"{status} {kind}: {error.get('message')}"


def client_loop(cluster: Cluster, refs: References, tally: Tally, stop: threading.Event, rng: random.Random,
                timeout: float) -> None:
    while not stop.is_set():
        prompt = rng.choice(PROMPTS)
        expected = refs.text(prompt)
        body = json.dumps({"model": "chaos", "prompt": prompt, "max_tokens": refs.max_tokens, "temperature": 0})
        connection = http.client.HTTPConnection(cluster.api_host, cluster.api_port, timeout=timeout)
        try:
            connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            bucket, detail = classify(response.status, response.read(), expected)
        except (OSError, http.client.HTTPException) as exc:
            bucket, detail = "lost", f"{type(exc).__name__}: {exc}"
        finally:
            connection.close()
        tally.add(bucket, detail)
        if bucket == "failed":
            stop.wait(0.5)  # as a client honouring Retry-After would


class Chaos:
    """The cluster under test, and the faults done to it."""

    def __init__(self, args: argparse.Namespace, workdir: Path, model_dir: Path):
        self.args, self.workdir = args, workdir
        self.nodes = [f"w{i + 1}" for i in range(args.workers)]
        self.lab = None
        head: dict = {"heartbeat_s": 0.5, "heartbeat_timeout_s": 2, "resume": not args.no_resume,
                      "resume_grace_s": args.grace}
        entries = [{"id": n, "device": "cpu"} for n in self.nodes]
        if args.spare:
            entries.append({"id": "spare", "device": "cpu", "spare": True})
        kwargs = {}
        if args.netns:
            from test_netns import SKIP_REASON, build_lab

            if SKIP_REASON:
                raise SystemExit(f"--netns: {SKIP_REASON}")
            if args.workers != 2 or args.spare:
                raise SystemExit("--netns runs exactly 2 workers and no spare")
            self.lab = build_lab()
            head.update(api="0.0.0.0:8000", listen="0.0.0.0:7001")
            kwargs = {"api_host": self.lab.api_host, "head_prefix": self.lab.ns_exec(self.lab.head_ns)}
        topo = write_topology(workdir / "topology.yaml", model_dir, entries, head=head, name="chaos",
                              dtype="fp32", quant="fp16")
        self.cluster = Cluster(topo, workdir, **kwargs)
        self.restarts = Counter()

    def start_worker(self, node: str) -> Process:
        old = self.cluster.workers.pop(f"{node}-{self.restarts[node]}", None)
        if old is not None:  # the harness watches only the live process of each node
            old.stop()
        self.restarts[node] += 1
        name = f"{node}-{self.restarts[node]}"
        extra: dict = {}
        if self.lab is not None:
            i = self.nodes.index(node) + 1
            extra = {"prefix": self.lab.ns_exec(self.lab.worker_ns(i)), "join_host": self.lab.head_addr(i)}
        proc = self.cluster.start_worker(node, "--retry-max-s", "1", name=name, env={"TC_HEAD_TIMEOUT_S": "4"},
                                         **extra)
        return proc

    def live(self, node: str) -> Process:
        return self.cluster.workers[f"{node}-{self.restarts[node]}"]

    def start(self) -> None:
        self.cluster.start_head()
        self.cluster.wait_api(300)
        for node in self.nodes + (["spare"] if self.args.spare else []):
            self.start_worker(node)
        self.cluster.wait_ready(600)

    def event(self, rng: random.Random, tally: Tally) -> None:
        actions = ["kill", "stop", "term"] + (["cut"] if self.lab is not None else [])
        action = rng.choice(actions)
        node = rng.choice(self.nodes + (["spare"] if self.args.spare else []))
        proc = self.live(node)
        if proc.proc.poll() is not None:  # it exited (a refused spare-covered node, say): bring it back
            self.start_worker(node)
            tally.events["restart-exited"] += 1
            return
        tally.events[action] += 1
        print(f"{time.strftime('%H:%M:%S')} chaos: {action} {node}", flush=True)
        if action == "kill":
            proc.proc.kill()
            proc.stop()
            time.sleep(rng.uniform(0, 3))
            self.start_worker(node)
        elif action == "stop":
            proc.proc.send_signal(signal.SIGSTOP)
            time.sleep(rng.uniform(0.5, 4))
            proc.proc.send_signal(signal.SIGCONT)
        elif action == "term":
            proc.proc.send_signal(signal.SIGTERM)
            try:
                proc.proc.wait(20)
            except Exception:  # noqa: BLE001 - a worker that does not leave is killed, and counted
                tally.events["term-ignored"] += 1
            proc.stop()
            time.sleep(rng.uniform(0, 2))
            self.start_worker(node)
        elif action == "cut":
            assert self.lab is not None
            i = self.nodes.index(node) + 1
            self.lab.set_link(i, False)
            time.sleep(rng.uniform(1, 5))
            self.lab.set_link(i, True)

    def settle(self) -> None:
        """After the chaos: every node running again, the cluster ready."""
        for node in self.nodes:
            if self.live(node).proc.poll() is not None:
                self.start_worker(node)
            else:
                self.live(node).proc.send_signal(signal.SIGCONT)
        if self.lab is not None:
            for i in (1, 2):
                self.lab.set_link(i, True)
        deadline = time.monotonic() + 300
        while True:
            for name, proc in list(self.cluster.workers.items()):
                # a node the spare took over refuses its own worker back: that is by design, not a failure
                if proc.proc.poll() == 2 and "served by the spare" in proc.output():
                    self.cluster.workers.pop(name).stop()
            try:
                if self.cluster.get("/health/ready", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not become ready again; logs in {self.workdir}")
            time.sleep(0.5)

    def close(self) -> None:
        self.cluster.stop()
        if self.lab is not None:
            from test_netns import remove_lab

            remove_lab(self.lab)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tc-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.demo:
        from _demo import demo_model_dir

        model_dir = demo_model_dir()
    else:
        from tiny_model import write_tiny_model

        model_dir = write_tiny_model(workdir / "tiny-qwen", seed=args.seed, shards=2)
    print(f"model {model_dir}; logs in {workdir}", flush=True)
    refs = References(model_dir, args.max_tokens)
    for prompt in PROMPTS:
        refs.text(prompt)
    chaos = Chaos(args, workdir, model_dir)
    tally = Tally()
    stop = threading.Event()
    try:
        chaos.start()
        timeout = args.grace + 120.0
        clients = [threading.Thread(target=client_loop, args=(chaos.cluster, refs, tally, stop,
                                                              random.Random(args.seed * 100 + i), timeout),
                                    daemon=True) for i in range(args.clients)]
        for c in clients:
            c.start()
        deadline = time.monotonic() + args.minutes * 60
        while time.monotonic() < deadline and not stop.is_set():
            stop.wait(rng.expovariate(1 / args.interval))
            if time.monotonic() < deadline:
                chaos.event(rng, tally)
        print("chaos over; letting the cluster settle", flush=True)
        chaos.settle()
        time.sleep(5)  # a few requests on the settled cluster
        stop.set()
        for c in clients:
            c.join(timeout + 30)
        hanging = sum(c.is_alive() for c in clients)
        head_alive = chaos.cluster.head is not None and chaos.cluster.head.proc.poll() is None
    finally:
        stop.set()
        chaos.close()
    counts = tally.counts
    sent = sum(counts.values())
    print(f"\n{args.minutes:g} min, {args.clients} clients, model {'demo' if args.demo else 'tiny'}, "
          f"{'resume' if not args.no_resume else 'no resume'}{', spare' if args.spare else ''}"
          f"{', netns' if args.netns else ''}")
    print(f"chaos events: {dict(tally.events)}")
    print(f"requests sent:      {sent}")
    print(f"succeeded:          {counts['succeeded']}")
    print(f"failed, clear error: {counts['failed']}  {dict(tally.errors)}")
    print(f"wrong text:         {counts['wrong']}")
    print(f"lost:               {counts['lost']}  (+{hanging} clients still waiting at the end)")
    print(f"head still up:      {head_alive}")
    for example in tally.lost_examples:
        print(f"  {example}")
    return 0 if counts["lost"] == 0 and counts["wrong"] == 0 and hanging == 0 and head_alive else 1


if __name__ == "__main__":
    raise SystemExit(main())
