"""Many requests at once: each sequence of a batch gets what it gets alone, streams keep flowing while prompts
arrive, a cancelled one frees its place, and a lost worker's sequences all resume (in process and through real
head and worker processes)."""
from __future__ import annotations

import json
import signal
import threading
import time

import pytest
import torch

from cluster import Cluster, Request, start_cluster, write_topology
from model_helpers import OurModel, assert_same_greedy_text
from tc.batch_memory import kv_bytes_per_slot, plan_batch
from tc.generation import Generator, LocalPipeline
from tc.head import service as service_module
from tc.head.service import GenerationService, Readiness
from tc.model.config import Qwen2Config
from tc.model.tokenizer import TextTokenizer
from tc.planner import GIB, NodeSpec, PlanError, make_plan
from tc.sampling import SamplingParams
from tiny_model import write_tiny_model

PROMPTS = ["the quick brown fox", "def add(a, b):", "Once upon a time there", "1 2 3 4 5 6 7 8 9 10 11 12",
           "import numpy as np", "Hello", "SELECT * FROM users WHERE", "a b c d e f g h i j k l m n o p q r s"]
LENGTHS = [5, 17, 9, 30, 12, 3, 21, 8]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen", seed=11, shards=2)


@pytest.fixture(scope="module")
def model(model_dir):
    return OurModel(model_dir, splits=[2])  # two stages, as head + 2 workers split it


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return TextTokenizer.load(model_dir)


class RecordingPipeline(LocalPipeline):
    """The real stages; records each step's entries (sequence, start, length) and the caches it copied."""

    def __init__(self, stages: list, pause_s: float = 0.0):
        super().__init__(stages)
        self.pause_s = pause_s
        self.steps: list[list[tuple[int, int, int]]] = []
        self.copies: dict[int, tuple[int, ...]] = {}  # sequence -> the sequences given copies of its cache

    def run(self, entries, hidden):
        self.steps.append([(e.sequence, e.start, e.length) for e in entries])
        self.copies.update({e.sequence: e.copies for e in entries if e.copies})
        time.sleep(self.pause_s)
        return super().run(entries, hidden)


def wait_until(condition, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s:g}s for {what}"
        time.sleep(0.01)


def ready() -> Readiness:
    return Readiness(1, ("w1",), ())


def service_over(model, tokenizer, pipeline, **options) -> GenerationService:
    return GenerationService("tiny", tokenizer, Generator(model.head, tokenizer, pipeline, torch.float32), ready,
                             **options)


def solo(model, tokenizer, prompt: str, params: SamplingParams):
    return Generator(model.head, tokenizer, model.pipeline(), torch.float32).generate(tokenizer.encode(prompt), params)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)


def run_together(service: GenerationService, tokenizer, jobs: list[tuple[str, SamplingParams]], stream: bool):
    """Every job at once from its own thread; returns their completions (streamed ones rebuilt from their steps)."""
    results: dict[int, object] = {}
    start = threading.Barrier(len(jobs))

    def one(i: int, prompt: str, params: SamplingParams) -> None:
        try:
            start.wait(10)
            with service.open(tokenizer.encode(prompt), params) as generation:
                if stream:
                    steps = list(generation)
                    completion = steps[-1].completion
                    assert "".join(s.text for s in steps) == completion.text
                    assert [t for s in steps for t in s.tokens] == list(completion.tokens)
                    results[i] = completion
                else:
                    results[i] = generation.drain()
        except BaseException as exc:  # re-raised in the test's thread
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i, p, s)) for i, (p, s) in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for value in results.values():
        if isinstance(value, BaseException):
            raise value
    return [results[i] for i in range(len(jobs))]


# --- in process: the scheduler over the real layers -----------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_eight_requests_at_once_equal_their_solo_runs_token_for_token(model, tokenizer, stream):
    pipeline = RecordingPipeline(model.stages)
    service = service_over(model, tokenizer, pipeline, max_batch=8, prefill_chunk=8)
    jobs = [(p, greedy(n)) for p, n in zip(PROMPTS, LENGTHS)]
    got = run_together(service, tokenizer, jobs, stream)
    for (prompt, params), completion in zip(jobs, got):
        alone = solo(model, tokenizer, prompt, params)
        assert_same_greedy_text(completion.text, alone)
        for ours, theirs in zip(completion.tokens, alone.tokens):
            if ours.id != theirs.id:
                break  # a tie went the other way (assert_same_greedy_text): what follows is another text
            assert ours.logprob.logprob == pytest.approx(theirs.logprob.logprob, abs=1e-4)
    assert max(len(step) for step in pipeline.steps) >= 4, "the requests never shared a step"
    assert not pipeline.caches, "every finished sequence's caches were released"
    assert (service.running, service.queue_depth) == (0, 0)


def test_a_seeded_sampled_request_writes_the_same_text_whatever_runs_beside_it(model, tokenizer):
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True,
                            frequency_penalty=0.5, stop=("zzz",))
    alone = solo(model, tokenizer, "Hello there", seeded)
    service = service_over(model, tokenizer, LocalPipeline(model.stages), max_batch=4)
    others = [(p, SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True)) for p, n in zip(PROMPTS, LENGTHS)]
    got = run_together(service, tokenizer, [("Hello there", seeded)] + others[:3], stream=True)
    assert got[0].text == alone.text and got[0].token_ids == alone.token_ids


def test_a_long_prompt_arriving_mid_stream_is_read_in_chunks_between_its_tokens(model, tokenizer):
    pipeline = RecordingPipeline(model.stages, pause_s=0.01)
    service = service_over(model, tokenizer, pipeline, max_batch=4, prefill_chunk=16)
    running = service.open(tokenizer.encode("Hello"), greedy(60))
    running_id = pipeline.steps[0][0][0]
    long_prompt = " ".join(str(i) for i in range(80))  # well over 100 tokens: several chunks of 16
    long_ids = tokenizer.encode(long_prompt)
    assert len(long_ids) > 5 * 16
    arrived = threading.Event()

    def later() -> None:
        arrived.set()
        service.complete(long_ids, greedy(3))

    thread = threading.Thread(target=later)
    with running:
        steps = iter(running)
        next(steps)
        thread.start()
        arrived.wait(10)
        text = "".join(step.text for step in steps)
    thread.join(60)
    chunk_steps = [step for step in pipeline.steps if any(s != running_id and n > 1 for s, _, n in step)]
    assert len(chunk_steps) >= 5  # the long prompt was read in chunks, not in one step
    for step in chunk_steps:
        assert sum(n for s, _, n in step if s != running_id) <= 16  # no chunk over prefill_chunk
        assert any(s == running_id and n == 1 for s, _, n in step), \
            "the running stream got no token in a step that read the prompt"
    assert text  # and the running stream went on to its end
    assert_same_greedy_text(running.completion.text, solo(model, tokenizer, "Hello", greedy(60)))


def test_long_prompts_arriving_together_are_read_first_come_first_served(model, tokenizer):
    """Nothing decodes when three long prompts are admitted together: the first in line is read whole in one step,
    alone, and the others in prefill_chunk chunks beside its decoding, so each gets its first token in turn rather
    than all at the end of one long step; every text is its solo run's."""
    from test_prefix_cache import GatedPipeline, in_threads, wait_for

    service = service_over(model, tokenizer, model.pipeline(), max_batch=4, prefill_chunk=8)
    gate = GatedPipeline(service)
    prompts = [" ".join(f"{word}{i}" for i in range(12)) for word in ("alpha", "beta", "gamma")]
    assert all(len(tokenizer.encode(p)) > 2 * 8 for p in prompts)
    # a request that ends on its first token holds the loop in its one step while the three queue behind it
    blocker, _ = in_threads(lambda: service.complete(tokenizer.encode("Hello"), greedy(1)))
    wait_for(lambda: service.running == 1, "the first request in the batch")
    threads, results = in_threads(*[lambda p=p: service.complete(tokenizer.encode(p), greedy(4)) for p in prompts])
    wait_for(lambda: service.queue_depth == 3, "the three prompts queued")
    gate.open_all()
    for thread in blocker + threads:
        thread.join(120)
    (whole,) = gate.steps[1]  # the step after the first request's: the first prompt in line, alone and whole
    assert whole.start == 0 and whole.length == whole.capacity - 4
    for step in gate.steps[2:]:
        reading = [e for e in step if e.start < e.capacity - 4]
        if len(reading) < len(step):  # beside decoding sequences: prompts in chunks of prefill_chunk at most
            assert sum(e.length for e in reading) <= 8
        else:  # nothing decodes: the first in line alone, the rest of it whole
            assert len(step) == 1 and step[0].start + step[0].length == step[0].capacity - 4
    # the step in which each prompt's reading ends (its first token's): one after another
    read_by = {e.sequence: i for i, step in enumerate(gate.steps) for e in step if e.start + e.length == e.capacity - 4}
    admitted = list(dict.fromkeys(e.sequence for step in gate.steps for e in step if e.sequence in read_by))
    in_line = [read_by[sequence] for sequence in admitted]  # a step's entries are in the batch's order
    assert in_line == sorted(in_line) and len(set(in_line)) == 3
    for prompt, completion in zip(prompts, (results[i] for i in range(3))):
        assert_same_greedy_text(completion.text, solo(model, tokenizer, prompt, greedy(4)))


@pytest.mark.parametrize("needs, budget, whole, shares", [
    ([100, 3], 16, None, [13, 3]),  # the short one whole, the first in line the rest
    ([3, 100], 16, None, [3, 13]),
    ([50, 50, 50], 16, None, [16, 0, 0]),  # one length: first come first served
    ([100, 90, 5, 5], 16, None, [4, 2, 5, 5]),  # the first in line its share (16 // 4), the shortest the rest
    ([100, 40, 2], 8, 0, [8, 0, 0]),  # nothing decodes: the first whole as far as the budget goes
    ([20, 40, 2], 30, 0, [20, 8, 2]),
    ([7, 7], 1, None, [1, 0]),
    ([100, 2, 2], 2, None, [1, 1, 0]),  # a budget under the prompts' count: the first in line still reads one
    ([100, 2], 0, None, [0, 0]),
])
def test_prompt_shares(needs, budget, whole, shares):
    from types import SimpleNamespace
    from tc.generation import prompt_shares

    readers = [SimpleNamespace(id=i, prompt_ids=[0] * (need + 1), prefilled=1) for i, need in enumerate(needs)]
    got = prompt_shares(readers, budget, None if whole is None else readers[whole])
    assert [got[r.id] for r in readers] == shares and sum(shares) <= budget


def test_a_short_prompt_beside_a_long_one_is_read_at_once_not_after_it(model, tokenizer):
    """Prompts beside decoding sequences were read first come first served: a chat's short prompt admitted while a
    long one was being read waited for all of the long one's chunks (a 30,000-token prompt: ~120 steps) before
    its first token. The first in line now reads its share and the shortest the rest: the short prompt is read
    whole in its first step, while the long one goes on; every text is its solo run's."""
    from test_prefix_cache import GatedPipeline, in_threads, wait_for

    service = service_over(model, tokenizer, model.pipeline(), max_batch=4, prefill_chunk=16)
    gate = GatedPipeline(service)
    long_prompt, short_prompt = " ".join(str(i) for i in range(40)), "Hi!"
    long_ids, short_ids = tokenizer.encode(long_prompt), tokenizer.encode(short_prompt)
    assert len(long_ids) > 4 * 16 and len(short_ids) <= 16 // 2
    running, _ = in_threads(lambda: service.complete(tokenizer.encode("Hello"), greedy(30)))
    wait_for(lambda: service.running == 1, "the first request in the batch")
    gate.allow()  # its prompt: from here on it decodes, and prompts beside it are read in chunks
    threads, results = in_threads(lambda: service.complete(long_ids, greedy(3)))
    wait_for(lambda: service.running == 2, "the long prompt in the batch")
    gate.allow(2)  # two of its chunks
    wait_for(lambda: len(gate.steps) == 3, "two chunks of the long prompt read")
    more, short = in_threads(lambda: service.complete(short_ids, greedy(4)))
    deadline = time.monotonic() + 60
    while not (service.running == 3 and service.queue_depth == 0):  # admitted at a step's boundary: let one by
        assert time.monotonic() < deadline, "the short prompt never joined the batch"
        gate.allow()
        time.sleep(0.05)
    gate.open_all()
    for thread in running + threads + more:
        thread.join(120)
    step = next(step for step in gate.steps[3:] if len(step) == 3)  # the first step with the short prompt
    entries = {e.capacity: e for e in step}  # each request's capacity: its prompt and max_tokens
    short_entry, long_entry = entries[len(short_ids) + 4], entries[len(long_ids) + 3]
    assert (short_entry.start, short_entry.length) == (0, len(short_ids)), "the short prompt was not read at once"
    assert long_entry.length == 16 - len(short_ids) and long_entry.start + long_entry.length < len(long_ids)
    assert_same_greedy_text(short[0].text, solo(model, tokenizer, short_prompt, greedy(4)))
    assert_same_greedy_text(results[0].text, solo(model, tokenizer, long_prompt, greedy(3)))


def test_cancelling_one_stream_frees_its_place_and_leaves_the_others_unchanged(model, tokenizer):
    pipeline = RecordingPipeline(model.stages, pause_s=0.005)
    service = service_over(model, tokenizer, pipeline, max_batch=3)
    keep = [("def add(a, b):", greedy(40)), ("import numpy as np", greedy(25))]
    results: list = []
    cancelled = service.open(tokenizer.encode("Hello"), greedy(200))
    cancelled_id = pipeline.steps[-1][0][0]
    thread = threading.Thread(target=lambda: results.extend(run_together(service, tokenizer, keep, stream=True)))
    thread.start()
    deadline = time.monotonic() + 30
    while service.running < 3:
        assert time.monotonic() < deadline, "the other requests never joined the batch"
        time.sleep(0.005)
    for _ in zip(range(3), cancelled):
        pass
    cancelled.close()
    closed_at = len(pipeline.steps)
    deadline = time.monotonic() + 30
    while cancelled_id in pipeline.caches:
        assert time.monotonic() < deadline, "the cancelled sequence's caches were never released"
        time.sleep(0.005)
    assert sum(any(s == cancelled_id for s, _, _ in step) for step in pipeline.steps[closed_at:]) <= 1
    thread.join(60)
    for (prompt, params), completion in zip(keep, results):
        assert_same_greedy_text(completion.text, solo(model, tokenizer, prompt, params))
    assert cancelled.outcome == "abandoned" and service.running == 0


def test_a_failure_of_the_scheduler_itself_answers_its_requests_and_frees_every_cache(model, tokenizer, monkeypatch):
    """A bug in the loop (not a step's failure, which ends its own sequences) fails every request it holds, and
    releases their caches and the kept ones: left on the workers, they counted against max_batch for good, and
    every later request was refused there."""
    pipeline = model.pipeline()
    service = service_over(model, tokenizer, pipeline, prefix_cache=True)
    prompt = tokenizer.encode(PROMPTS[0])
    want = service.complete(prompt, greedy(4))
    assert pipeline.caches  # its cache kept for a next turn

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the scheduler")
    monkeypatch.setattr(service, "_observe_step", broken)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the loop's thread ends by raising it
    with pytest.raises(RuntimeError, match="a bug in the scheduler"):
        service.complete(tokenizer.encode(PROMPTS[1]), greedy(4))
    assert pipeline.caches == {}  # released before the requests hear: a retry's loop finds nothing held
    monkeypatch.undo()
    assert service.complete(prompt, greedy(4)).text == want.text  # and the service goes on


def test_a_failed_scheduler_releases_a_kept_cache_that_a_request_it_fails_was_to_copy(model, tokenizer,
                                                                                        monkeypatch):
    """The failure's release of the kept caches handed one that an admitted request waits to copy to that request,
    as eviction does, though the request was about to fail: the cache was then neither kept nor released, and
    held a place on the workers for good."""
    pipeline = model.pipeline()
    service = service_over(model, tokenizer, pipeline, prefix_cache=True)
    system = torch.randint(3, 250, (service_module.MIN_SHARED_TOKENS + 8,),
                           generator=torch.Generator().manual_seed(5)).tolist()
    service.complete(system + tokenizer.encode(PROMPTS[0]), greedy(4))
    assert len(pipeline.caches) == 1  # kept for a next turn

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the scheduler")
    monkeypatch.setattr(service, "_step", broken)  # after the admitted request chose the kept cache to copy
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    with pytest.raises(RuntimeError, match="a bug in the scheduler"):
        service.complete(system + tokenizer.encode(PROMPTS[1]), greedy(4))
    assert pipeline.caches == {} and not service._kept


@pytest.mark.parametrize("part", ["read_prompt", "advance"])
def test_a_failure_in_one_sequences_own_part_of_a_step_ends_that_request_alone(model, tokenizer, monkeypatch, part):
    """One request's own part of a shared step fails (reading its prompt, or choosing its third token: as a grammar
    engine's or a sampler's error would): that request hears its error and its cache is released, while the
    requests stepping beside it write their solo texts, and the service goes on. Before, the error ended every
    request of the step."""
    from tc.generation import SequenceState

    original = getattr(SequenceState, part)

    def failing(self, *args, **kwargs):
        if self.params.max_tokens == 7 and len(self.text.tokens) >= (0 if part == "read_prompt" else 2):
            raise RuntimeError(f"a fault in {part}")
        return original(self, *args, **kwargs)
    monkeypatch.setattr(SequenceState, part, failing)
    gate = threading.Event()

    class GatedPipeline(RecordingPipeline):  # the first step waits for the gate: the three queue up meanwhile
        def run(self, entries, hidden):
            if not self.steps:
                self.steps.append([])
                gate.wait(30)
            return super().run(entries, hidden)
    pipeline = GatedPipeline(model.stages)
    service = service_over(model, tokenizer, pipeline, max_batch=4, prefill_chunk=64)
    jobs = [(PROMPTS[0], greedy(6)), (PROMPTS[1], greedy(7)), (PROMPTS[2], greedy(8))]
    results: dict[int, object] = {}

    def one(i: int, prompt: str, params: SamplingParams) -> None:
        try:
            results[i] = service.complete(tokenizer.encode(prompt), params)
        except RuntimeError as exc:
            results[i] = exc
    blocker = threading.Thread(target=one, args=(3, PROMPTS[3], greedy(3)))
    blocker.start()
    wait_until(lambda: pipeline.steps, "the first step")
    threads = [threading.Thread(target=one, args=(i, *job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    wait_until(lambda: service.queue_depth == 3, "the three requests queued")
    gate.set()
    for thread in [blocker, *threads]:
        thread.join(120)
    assert isinstance(results[1], RuntimeError) and str(results[1]) == f"a fault in {part}"
    # the three read their prompts in one step, beside the first request's decoding
    assert any(sum(start == 0 for _, start, _ in step) == 3 for step in pipeline.steps), pipeline.steps
    monkeypatch.undo()
    for i in (0, 2):
        assert_same_greedy_text(results[i].text, solo(model, tokenizer, *jobs[i]))
    assert_same_greedy_text(results[3].text, solo(model, tokenizer, PROMPTS[3], greedy(3)))
    assert not pipeline.caches, "the failed request's cache was released with the others'"
    assert (service.running, service.queue_depth) == (0, 0)
    assert service.complete(tokenizer.encode(PROMPTS[1]), greedy(7)).text == \
        solo(model, tokenizer, PROMPTS[1], greedy(7)).text


def test_choices_whose_leader_fails_reading_the_prompt_fail_with_it(model, tokenizer, monkeypatch):
    """The choices that follow a leader choose from its reading of the prompt: where that reading fails, they end
    with its error in the same step (none is left waiting on a reading that will not come), and a sequence
    beside them goes on."""
    from tc.generation import SequenceState

    generator = Generator(model.head, tokenizer, model.pipeline(), torch.float32)
    choices = generator.start_choices(tokenizer.encode(PROMPTS[0]), [greedy(5)] * 3)
    other = generator.start(tokenizer.encode(PROMPTS[1]), greedy(5))
    original = SequenceState.read_prompt

    def failing(self, *args, **kwargs):
        if self is choices[0]:
            raise RuntimeError("a fault reading the prompt")
        return original(self, *args, **kwargs)
    monkeypatch.setattr(SequenceState, "read_prompt", failing)
    results = dict((s.id, step) for s, step in generator.step([*choices, other]))
    assert all(isinstance(results[c.id], RuntimeError) for c in choices)
    assert not isinstance(results[other.id], Exception) and results[other.id].tokens


def test_a_head_nobody_scrapes_keeps_only_the_steps_its_rate_window_covers(model, tokenizer, monkeypatch):
    # the tokens/s gauge's steps were trimmed only when /metrics or /v1/cluster read it: unread, they grew by one
    # entry per step for as long as the head ran (with a zero window, every step outlives it at once)
    monkeypatch.setattr(service_module, "RATE_WINDOW_S", 0.0)
    service = service_over(model, tokenizer, model.pipeline())
    completion = service.complete(tokenizer.encode("the quick brown fox"), greedy(20))
    assert len(completion.tokens) == 20
    assert len(service._recent_tokens) <= 1
    assert service.tokens_per_s() >= 0.0

# --- the batch's memory -------------------------------------------------------------------------------------

def test_kv_bytes_per_slot_and_max_batch_from_memory(model_dir):
    config = Qwen2Config.from_file(model_dir / "config.json")
    layer = 1 << 20
    nodes = [NodeSpec("a", "cpu", "fp32", None, None), NodeSpec("b", "cpu", "bf16", 8 * layer + 3 * (1 << 20), None)]
    plan = make_plan(config.num_hidden_layers, [layer] * config.num_hidden_layers, nodes)
    per_slot = 2 * 2 * config.num_key_value_heads * config.head_dim * config.max_position_embeddings  # 2 layers
    assert kv_bytes_per_slot(config, plan.stages[0]) == per_slot * 4  # fp32
    assert kv_bytes_per_slot(config, plan.stages[1]) == per_slot * 2  # bf16
    fits = (8 * layer + 3 * (1 << 20) - plan.stages[1].weight_bytes) // (per_slot * 2)
    assert plan_batch(plan, config, None).max_batch == min(8, fits)
    assert plan_batch(plan, config, fits).max_batch == fits
    with pytest.raises(PlanError, match=f"node b: head.max_batch {fits + 1} needs .* its memory holds {fits} "
                                        "sequence"):
        plan_batch(plan, config, fits + 1)
    tight = make_plan(config.num_hidden_layers, [layer] * config.num_hidden_layers,
                      [NodeSpec("a", "cpu", "fp32", int(0.5 * GIB), None)])
    assert plan_batch(tight, config, None).max_batch >= 1
    # memory for the weights alone: no batch to lower head.max_batch to (its least is 1)
    full = make_plan(config.num_hidden_layers, [layer] * config.num_hidden_layers,
                     [NodeSpec("a", "cpu", "fp32", config.num_hidden_layers * layer, None)])
    with pytest.raises(PlanError, match="its memory holds not one sequence at full context beside the weights: "
                                        "raise it, give the node fewer layers") as refused:
        plan_batch(full, config, 1)
    assert "lower head.max_batch" not in str(refused.value)


def test_a_topology_whose_batch_cannot_fit_is_refused_with_the_numbers(tmp_path, model_dir):
    from tc.head.main import run_plan
    import argparse
    config = Qwen2Config.from_file(model_dir / "config.json")
    topo = write_topology(tmp_path / "t.yaml", model_dir, [{"id": "a", "device": "cpu", "max_memory_gb": 0.002}],
                          head={"max_batch": 64})
    with pytest.raises(PlanError, match="node a: head.max_batch 64 needs .* lower head.max_batch to that"):
        run_plan(argparse.Namespace(topology=topo, explain=False))
    assert config.max_position_embeddings > 0


# --- real processes: head + 2 workers ----------------------------------------------------------------------

def stream_text(cluster: Cluster, body: dict) -> str:
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", cluster.api_port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    text = ""
    for line in response:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            event = json.loads(line[6:])
            assert "error" not in event, event
            text += event["choices"][0]["text"] if event["choices"] else ""
    conn.close()
    return text


def in_threads(work, count: int) -> None:
    """work(0) .. work(count - 1), each in a thread of its own, all at once; waits for them (2 minutes at most)."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)


def scrape(cluster: Cluster) -> str:
    """The head's /metrics text."""
    import urllib.request
    with urllib.request.urlopen(cluster.url + "/metrics", timeout=10) as reply:
        return reply.read().decode()


def body_for(prompt: str, max_tokens: int) -> dict:
    return {"model": "tiny-qwen", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def test_eight_requests_through_head_and_two_workers_equal_their_solo_runs(tmp_path, model_dir, model, tokenizer):
    with start_cluster(tmp_path, model_dir, max_batch=8, prefill_chunk=8) as cluster:
        texts: dict[int, str] = {}

        def one(i: int) -> None:
            body = body_for(PROMPTS[i], LENGTHS[i])
            if i % 2:
                texts[i] = stream_text(cluster, body)
            else:
                status, reply = cluster.post("/v1/completions", body, timeout=120)
                texts[i] = reply["choices"][0]["text"] if status == 200 else f"HTTP {status}: {reply}"

        in_threads(one, 8)
        for i in range(8):
            assert_same_greedy_text(texts[i], solo(model, tokenizer, PROMPTS[i], greedy(LENGTHS[i])))
        status, info = cluster.get("/v1/cluster")
        assert info["batch"]["slots"] == 8 and info["batch"]["in_use"] == 0 and info["plan"]["max_batch"] == 8
        assert all(stage["kv_bytes_per_sequence"] > 0 for stage in info["plan"]["stages"])
        metrics = scrape(cluster)
        assert "tc_batch_size_bucket" in metrics and "tc_batch_slots 8.0" in metrics
        sizes = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("tc_batch_size_sum")]
        counts = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("tc_batch_size_count")]
        assert sizes[0] / counts[0] > 1.5  # steps carried several sequences on average


def test_a_killed_worker_with_several_sequences_in_flight_resumes_them_all(tmp_path, model_dir, model, tokenizer):
    with start_cluster(tmp_path, model_dir, max_batch=4, resume=True, resume_grace_s=120) as cluster:
        lengths = [150, 120, 100]
        # the first asks for two choices: its prompt read once, the second choice's caches copies on each worker
        requests = [Request(cluster, {**body_for(PROMPTS[i], lengths[i]), "n": 2 if i == 0 else 1}) for i in range(3)]
        deadline = time.monotonic() + 30
        while cluster.get("/v1/cluster")[1]["batch"]["in_use"] < 4:
            assert time.monotonic() < deadline, "the requests never shared the batch"
            time.sleep(0.02)
        b = cluster.workers.pop("b")
        b.proc.send_signal(signal.SIGKILL)
        b.stop()
        cluster.start_worker("b", name="b-again")
        for i, request in enumerate(requests):
            status, body = request.wait(180)
            assert status == 200, body
            assert len(body["choices"]) == (2 if i == 0 else 1)
            for choice in body["choices"]:
                assert_same_greedy_text(choice["text"], solo(model, tokenizer, PROMPTS[i], greedy(lengths[i])))
        prompt_read = sum(len(tokenizer.encode(p)) for p in PROMPTS[:3])
        assert f"tc_prompt_tokens_total {float(prompt_read)}" in scrape(cluster)  # the n=2 prompt counts once
        log = cluster.head.output()
        # counted in sequences, as the batch holds them: the n=2 request is two
        assert "4 sequence(s) resumed on a refilled pipeline" in log, log[-2000:]
        assert "4 sequence(s) in flight wait up to 120s" in log, log[-2000:]


# --- n choices: sequences of one prompt, side by side ------------------------------------------------------

def test_n_choices_whole_and_streamed_are_each_seeded_choice_alone(model, tokenizer):
    from falcon import testing
    from tc.head.api import create_app
    pipeline = RecordingPipeline(model.stages)
    client = testing.TestClient(create_app(service_over(model, tokenizer, pipeline, max_batch=4)))
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 10, "temperature": 1.0, "seed": 5,
            "ignore_eos": True}
    whole = client.simulate_post("/v1/completions", json={**body, "n": 3}).json
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    for i, choice in enumerate(whole["choices"]):  # choice i is the request with seed 5 + i, alone
        alone = client.simulate_post("/v1/completions", json={**body, "seed": 5 + i}).json
        assert choice["text"] == alone["choices"][0]["text"]
    assert len({c["text"] for c in whole["choices"]}) == 3
    assert whole["usage"]["completion_tokens"] == 30 and whole["usage"]["prompt_tokens"] == \
        len(tokenizer.encode("Once upon a time"))
    assert any(len(step) == 3 for step in pipeline.steps), "the three choices never shared a step"
    prompt_reads = [(s, n) for step in pipeline.steps for s, start, n in step if start == 0]
    assert len(prompt_reads) == 1 + 3  # the three choices' prompt once, and each seeded request alone
    assert len(pipeline.copies[prompt_reads[0][0]]) == 2  # the other two choices started from copies of its cache
    streamed = client.simulate_post("/v1/completions", json={**body, "n": 3, "stream": True,
                                                             "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    texts = ["", "", ""]
    finished = set()
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
            if choice["finish_reason"]:
                finished.add(choice["index"])
    assert texts == [c["text"] for c in whole["choices"]] and finished == {0, 1, 2}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    assert streamed.text.endswith("data: [DONE]\n\n")


def test_n_choices_of_a_prompt_read_in_chunks_mid_stream_start_from_one_reading(model, tokenizer):
    """A request of three choices arrives while a stream runs: its prompt is read once, chunk by chunk between the
    stream's tokens; the choices wait for it and start from copies of its cache, with the prompt's log-probabilities
    and each its own seeded text, as each gets alone."""
    pipeline = RecordingPipeline(model.stages)
    service = service_over(model, tokenizer, pipeline, max_batch=4, prefill_chunk=8)
    prompt = tokenizer.encode(" ".join(str(i) for i in range(30)))
    assert len(prompt) > 3 * 8
    choices = [SamplingParams(max_tokens=12, temperature=0.8, seed=40 + i, ignore_eos=True, logprobs=1,
                              prompt_logprobs=True) for i in range(3)]
    with service.open(tokenizer.encode("Hello"), greedy(200)) as running:  # runs well past the choices
        steps = iter(running)
        next(steps)
        streams = service.open_choices(prompt, choices)
        completions = [stream.drain() for stream in streams]
        for stream in streams:
            stream.close()
        running_text = "".join(step.text for step in steps)
    assert running_text
    leader = streams[0]._request.sequence.id
    chunks = [n for step in pipeline.steps for s, start, n in step if s == leader and start < len(prompt)]
    assert sum(chunks) == len(prompt) and max(chunks) <= 8 and len(chunks) >= 4  # one reading, in chunks of 8
    assert all(start > 0 for step in pipeline.steps for s, start, _ in step
               if s in [stream._request.sequence.id for stream in streams[1:]])
    assert pipeline.copies == {leader: tuple(s._request.sequence.id for s in streams[1:])}
    for params, completion in zip(choices, completions):
        alone = Generator(model.head, tokenizer, model.pipeline(), torch.float32).generate(prompt, params)
        assert completion.token_ids == alone.token_ids
        assert [t.logprob.logprob for t in completion.prompt[1:]] == \
            pytest.approx([t.logprob.logprob for t in alone.prompt[1:]], abs=1e-5)
    assert len({c.text for c in completions}) == 3


def test_the_choices_of_a_request_wait_to_join_the_batch_together(model, tokenizer):
    """With one slot of three taken, a request of three choices waits for the whole batch rather than splitting, so
    its prompt is still read once; the stream that held the slot is unaffected."""
    pipeline = RecordingPipeline(model.stages)
    service = service_over(model, tokenizer, pipeline, max_batch=3)
    ids = tokenizer.encode("Once upon a time")
    choices = [SamplingParams(max_tokens=6, temperature=0.9, seed=70 + i, ignore_eos=True) for i in range(3)]
    with service.open(tokenizer.encode("Hello"), greedy(30)) as running:
        streams = service.open_choices(ids, choices)  # returns once the choices have their first tokens
        assert running.drain().completion_tokens == 30  # the choices could only start once it had ended
        completions = [stream.drain() for stream in streams]
        for stream in streams:
            stream.close()
    assert_same_greedy_text(running.completion.text, solo(model, tokenizer, "Hello", greedy(30)))
    group = [stream._request.sequence.id for stream in streams]
    assert [s for step in pipeline.steps for s, start, _ in step if start == 0 and s in group] == group[:1]
    for params, completion in zip(choices, completions):
        assert completion.token_ids == Generator(model.head, tokenizer, model.pipeline(),
                                                 torch.float32).generate(ids, params).token_ids


def test_choices_that_end_on_their_first_token_need_no_copies(model, tokenizer):
    pipeline = RecordingPipeline(model.stages)
    generator = Generator(model.head, tokenizer, pipeline, torch.float32)
    ids = tokenizer.encode("def add(a, b):")
    choices = generator.start_choices(ids, [SamplingParams(max_tokens=1, temperature=1.0, seed=s) for s in (1, 2)])
    results = generator.step(choices)
    assert len(pipeline.steps) == 1 and not pipeline.copies and [s for s, _ in results] == choices
    for seed, sequence in zip((1, 2), choices):
        alone = Generator(model.head, tokenizer, model.pipeline(), torch.float32).generate(
            ids, SamplingParams(max_tokens=1, temperature=1.0, seed=seed))
        assert sequence.completion.token_ids == alone.token_ids


def test_when_the_first_choice_leaves_before_its_prompt_is_read_the_next_reads_it_for_the_rest(model, tokenizer):
    """Choices follow the first; if the first is gone before its prompt ran (its client left), the others read the
    prompt themselves, and the one that now leads hands copies to the rest."""
    pipeline = RecordingPipeline(model.stages)
    generator = Generator(model.head, tokenizer, pipeline, torch.float32)
    ids = tokenizer.encode("def add(a, b):")
    params = [greedy(6), greedy(6), greedy(6), greedy(9)]
    first, second, third, longer = generator.start_choices(ids, params)
    assert second.leader is first and third.leader is first
    assert longer.leader is None  # a cache of another size: it reads its own prompt
    results = generator.step([second, third, longer])  # the first left before its first step
    assert [(s, start) for s, start, _ in pipeline.steps[0]] == [(second.id, 0), (longer.id, 0)]
    assert pipeline.copies == {second.id: (third.id,)} and len(results) == 3
    while not all(s.completion for s in (second, third, longer)):
        assert not any(isinstance(step, Exception)
                       for _, step in generator.step([s for s in (second, third, longer) if s.completion is None]))
    alone = solo(model, tokenizer, "def add(a, b):", greedy(6))
    assert second.completion.token_ids == third.completion.token_ids == alone.token_ids
    assert longer.completion.token_ids[:6] == alone.token_ids


def test_n_choices_with_the_openai_client(model, tokenizer, model_dir):
    import openai
    from tc.head.api import create_app
    from tc.head.http_server import start_http_server
    chat_model = OurModel(model_dir, splits=[2])
    service = service_over(chat_model, tokenizer, LocalPipeline(chat_model.stages), max_batch=4)
    server = start_http_server(create_app(service), "127.0.0.1", 0, threads=4)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.completions.create(model="tiny", prompt="def f(x):", n=4, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert [c.index for c in reply.choices] == [0, 1, 2, 3]
        assert len({c.text for c in reply.choices}) == 1  # greedy: every choice is the same text
        with pytest.raises(openai.BadRequestError, match="at most 4 sequences"):
            client.completions.create(model="tiny", prompt="x", n=5, max_tokens=2)
    finally:
        server.stop()


# --- micro-batches: stages at work at the same time -------------------------------------------------------

def test_split_entries_cuts_a_batch_into_runs_of_about_equal_rows():
    from tc.head.pipeline import split_entries
    from tc.protocol.messages import BatchEntry

    def lengths(rows: list[int], groups: int) -> list[list[int]]:
        entries = [BatchEntry(sequence=i, position_start=0, length=n, cache_capacity=n) for i, n in enumerate(rows)]
        runs = split_entries(entries, groups)
        assert [e for run in runs for e in run] == entries  # in order, every entry once
        return [[e.length for e in run] for run in runs]

    assert lengths([1] * 8, 2) == [[1] * 4, [1] * 4]
    assert lengths([1] * 8, 3) == [[1] * 3, [1] * 3, [1] * 2]
    assert lengths([100, 1, 1], 2) == [[100], [1, 1]]
    assert lengths([1, 1, 100], 2) == [[1, 1], [100]]
    assert lengths([5], 2) == [[5]] and lengths([1, 1], 4) == [[1], [1]]


def test_micro_batches_through_two_workers_give_each_request_its_solo_text(tmp_path, model_dir, model, tokenizer):
    with start_cluster(tmp_path, model_dir, max_batch=8, micro_batches=2) as cluster:
        texts: dict[int, str] = {}

        def one(i: int) -> None:
            texts[i] = stream_text(cluster, body_for(PROMPTS[i], LENGTHS[i]))

        in_threads(one, 6)
        for i in range(6):
            assert_same_greedy_text(texts[i], solo(model, tokenizer, PROMPTS[i], greedy(LENGTHS[i])))
        metrics = scrape(cluster)
        # a step of several sequences went to each worker as two groups: more hops than steps
        hops = sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("tc_stage_compute_seconds_count") and 'node="a"' in line)
        steps = sum(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("tc_batch_size_count"))
        assert hops > steps, (hops, steps)
