"""Kept caches (head.prefix_cache): a request whose prompt continues a finished request's prompt and completion
reads only what is new, from that request's caches; everything else reads its prompt as before, and the workers
never hold more caches than the batch has places."""
from __future__ import annotations

import dataclasses
import json
import urllib.request

import pytest
import torch

from cluster import Cluster, write_topology
from model_helpers import OurModel, assert_same_greedy_text
from tc.generation import Completion, Generator
from tc.head.service import MIN_SHARED_TOKENS, GenerationService, Readiness
from tc.model.tokenizer import TextTokenizer
from tc.sampling import SamplingParams
from tiny_model import write_tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, 250, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # a vocabulary of exactly the tokenizer's, so that every token generated may be sent back in a prompt
    return write_tiny_model(tmp_path_factory.mktemp("prefix"), seed=4, max_position_embeddings=512, vocab_size=259)


def new_generator(model_dir) -> Generator:
    model = OurModel(model_dir)
    return Generator(model.head, TextTokenizer.load(model_dir), model.pipeline(), torch.float32)


def new_service(model_dir, **settings) -> GenerationService:
    generator = new_generator(model_dir)
    return GenerationService("tiny", generator.tokenizer, generator, readiness=lambda: Readiness(1, ("w1",), ()),
                             **{"prefix_cache": True, **settings})


def alone(model_dir, prompt_ids: list[int], params: SamplingParams) -> Completion:
    """The completion a pipeline that never kept a cache gives, with the log-probabilities that tell a tie."""
    return new_generator(model_dir).generate(prompt_ids, dataclasses.replace(params, logprobs=2))


def cached_total(service: GenerationService) -> float:
    return service.metrics.cached_prompt_tokens._value.get()


def test_the_next_turn_reads_only_what_is_new_and_writes_what_a_fresh_read_gives(model_dir):
    service = new_service(model_dir)
    first_prompt = prompt(1, 40)
    first = service.complete(first_prompt, GREEDY)
    assert first.cached_prompt_tokens == 0
    # the conversation goes on: the first prompt, its completion, a new message; more tokens asked for than the
    # first request's cache has room for, so the cache grows on every stage
    second_prompt = first_prompt + list(first.token_ids) + prompt(2, 12)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    second = service.complete(second_prompt, params)
    # the first request's last token was chosen, never run: its cache holds all but that
    assert second.cached_prompt_tokens == len(first_prompt) + len(first.token_ids) - 1
    assert cached_total(service) == second.cached_prompt_tokens
    assert second.prompt_tokens == len(second_prompt)
    assert_same_greedy_text(second.text, alone(model_dir, second_prompt, params))
    # a third turn continues the second's cache in turn
    third_prompt = second_prompt + list(second.token_ids) + prompt(3, 5)
    third = service.complete(third_prompt, GREEDY)
    assert third.cached_prompt_tokens == len(second_prompt) + len(second.token_ids) - 1
    assert_same_greedy_text(third.text, alone(model_dir, third_prompt, GREEDY))


def test_a_prompt_that_does_not_continue_a_kept_one_reads_all_of_itself(model_dir):
    service = new_service(model_dir)
    first_prompt = prompt(1, 40)
    first = service.complete(first_prompt, GREEDY)
    assert service.complete(first_prompt, GREEDY).cached_prompt_tokens == 0  # the same prompt again: no more
    changed = first_prompt + list(first.token_ids) + [7]
    changed[5] += 1
    assert service.complete(changed, GREEDY).cached_prompt_tokens == 0
    scored = SamplingParams(max_tokens=2, temperature=0, logprobs=1, prompt_logprobs=True)
    again = service.complete(first_prompt, GREEDY)
    echoed = service.complete(first_prompt + list(again.token_ids) + [9], scored)
    assert echoed.cached_prompt_tokens == 0 and len(echoed.prompt) == len(first_prompt) + len(again.token_ids) + 1
    assert cached_total(service) == 0


def test_kept_caches_never_take_more_places_than_the_batch_has(model_dir):
    service = new_service(model_dir, max_batch=2)
    pipeline = service.generator.pipeline
    prompts = [prompt(10 + i, 20) for i in range(3)]
    completions = [service.complete(p, GREEDY) for p in prompts]
    assert len(service._kept) == 2  # the oldest went when the third request was admitted
    assert set(pipeline.caches) == set(service._kept)
    # the newest still serves its continuation; the oldest's is read whole
    newest = prompts[2] + list(completions[2].token_ids) + [5]
    assert service.complete(newest, GREEDY).cached_prompt_tokens == len(newest) - 2
    oldest = prompts[0] + list(completions[0].token_ids) + [5]
    assert service.complete(oldest, GREEDY).cached_prompt_tokens == 0
    assert len(pipeline.caches) <= 2


def common_start(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_prompt_that_shares_the_start_of_a_kept_one_copies_that_part(model_dir):
    """The same long system prompt before another question: the second request copies the part it shares from the
    first's kept cache, which stays kept and still serves the first conversation's next turn whole."""
    service = new_service(model_dir)
    pipeline = service.generator.pipeline
    system = prompt(40, MIN_SHARED_TOKENS + 6)
    first_prompt, second_prompt = system + prompt(41, 10), system + prompt(42, 9)
    first = service.complete(first_prompt, GREEDY)
    second = service.complete(second_prompt, GREEDY)
    shared = common_start(first_prompt, second_prompt)
    assert shared >= len(system) and second.cached_prompt_tokens == shared
    assert_same_greedy_text(second.text, alone(model_dir, second_prompt, GREEDY))
    assert len(service._kept) == 2 and set(pipeline.caches) == set(service._kept)
    # the copy is the second's own: the first's cache still holds all of its text
    next_turn = first_prompt + list(first.token_ids) + [9, 8]
    third = service.complete(next_turn, GREEDY)
    assert third.cached_prompt_tokens == len(first_prompt) + len(first.token_ids) - 1
    assert_same_greedy_text(third.text, alone(model_dir, next_turn, GREEDY))
    # the same prompt again (a reply regenerated) copies all of it but its last position, which must run
    again = service.complete(second_prompt, GREEDY)
    assert again.cached_prompt_tokens == len(second_prompt) - 1
    assert_same_greedy_text(again.text, alone(model_dir, second_prompt, GREEDY))
    assert cached_total(service) == shared + third.cached_prompt_tokens + again.cached_prompt_tokens
    # fewer shared tokens than that are read whole, and so is a prompt that asks for it (cache_prompt false)
    short = system[:MIN_SHARED_TOKENS - 1] + prompt(43, 10)
    assert service.complete(short, GREEDY).cached_prompt_tokens == 0
    assert service.complete(second_prompt, dataclasses.replace(GREEDY, cache_prompt=False)).cached_prompt_tokens == 0
    assert service.complete(next_turn + [7], dataclasses.replace(GREEDY, cache_prompt=False)).cached_prompt_tokens == 0


def test_a_kept_cache_whose_place_is_needed_is_cut_back_for_the_request_that_shares_it(model_dir):
    """With one place, the kept cache cannot stay beside a copy of it: the request that shares its start takes it
    over, cut back to the shared part, and the workers never hold two caches."""
    service = new_service(model_dir, max_batch=1)
    pipeline = service.generator.pipeline
    system = prompt(50, MIN_SHARED_TOKENS + 10)
    first_prompt, second_prompt = system + prompt(51, 12), system + prompt(52, 5)
    first = service.complete(first_prompt, GREEDY)
    (kept,) = service._kept
    second = service.complete(second_prompt, GREEDY)
    assert second.cached_prompt_tokens == common_start(first_prompt, second_prompt)
    assert_same_greedy_text(second.text, alone(model_dir, second_prompt, GREEDY))
    assert list(service._kept) == [kept] and list(pipeline.caches) == [kept]  # the same cache, now the second's
    assert service._kept[kept] == second_prompt + list(second.token_ids)[:-1]
    # the first conversation's next turn finds only the shared part now
    next_turn = first_prompt + list(first.token_ids) + [9]
    assert service.complete(next_turn, GREEDY).cached_prompt_tokens == common_start(first_prompt, second_prompt)


def test_kept_caches_the_workers_lost_give_way_to_one_they_hold(model_dir):
    """Kept caches that a replaced worker took with it are all forgotten at the next admission: only the one a
    prompt shared most with was, and that prompt read itself whole though another kept cache held part of it."""
    service = new_service(model_dir, max_batch=3)
    pipeline = service.generator.pipeline
    system = prompt(40, MIN_SHARED_TOKENS + 4)
    lost_prompt, held_prompt = system + prompt(41, 10), system + prompt(42, 10)
    for prompt_ids in (lost_prompt, held_prompt):
        service.complete(prompt_ids, GREEDY)
    lost, held = list(service._kept)
    pipeline.caches.pop(lost)  # what the workers there are now hold: a replaced stage's caches went with it
    follow_up = lost_prompt + prompt(43, 3)
    reply = service.complete(follow_up, GREEDY)
    assert reply.cached_prompt_tokens == common_start(follow_up, held_prompt) >= len(system)
    assert lost not in service._kept
    assert_same_greedy_text(reply.text, alone(model_dir, follow_up, GREEDY))


def test_nothing_is_kept_when_it_is_off(model_dir):
    service = new_service(model_dir, prefix_cache=False)
    first_prompt = prompt(1, 40)
    first = service.complete(first_prompt, GREEDY)
    assert service.generator.pipeline.caches == {}
    follow = first_prompt + list(first.token_ids) + [7]
    assert service.complete(follow, GREEDY).cached_prompt_tokens == 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir):
    workdir = tmp_path_factory.mktemp("prefix-cluster")
    nodes = [{"id": "w1", "device": "cpu"}, {"id": "w2", "device": "cpu"}]
    topology = write_topology(workdir / "topology.yaml", model_dir, nodes, head={"max_batch": 2})
    with Cluster(topology, workdir) as running:
        running.start_all(["w1", "w2"])
        running.model = model_dir.name
        yield running


def complete(cluster: Cluster, prompt_ids: list[int], max_tokens: int) -> dict:
    status, body = cluster.post("/v1/completions", {"model": cluster.model, "prompt": prompt_ids,
                                                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    return body


def stream(cluster: Cluster, prompt_ids: list[int], max_tokens: int) -> dict:
    """A streamed completion with its usage chunk, as one body: its choice's text, and the usage."""
    request = urllib.request.Request(cluster.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": cluster.model, "prompt": prompt_ids,
                                                      "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                                                      "stream": True,
                                                      "stream_options": {"include_usage": True}}).encode())
    text, usage = "", None
    with urllib.request.urlopen(request, timeout=300) as reply:
        for line in reply:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                text += "".join(choice["text"] for choice in chunk["choices"])
                usage = chunk["usage"] or usage
    return {"choices": [{"text": text}], "usage": usage}


def cached_tokens(body: dict) -> int:
    return body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def metric(cluster: Cluster, name: str) -> float:
    with urllib.request.urlopen(cluster.url + "/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def test_workers_grow_and_continue_a_kept_cache_across_direct_hops(cluster, model_dir):
    """Through a head and two worker processes: the second turn's usage says what it did not read again, the
    workers grow the kept cache to its capacity, and the text is a fresh read's."""
    first_prompt = prompt(21, 30)
    first = complete(cluster, first_prompt, 6)
    assert cached_tokens(first) == 0
    expected_first = alone(model_dir, first_prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    if first["choices"][0]["text"] != expected_first.text:  # a genuine tie, which either way is right
        assert_same_greedy_text(first["choices"][0]["text"], expected_first)
        pytest.skip("the first reply parted from the in-process one at a tie: its tokens are not known here")
    generated = list(expected_first.token_ids)
    second_prompt = first_prompt + generated + prompt(22, 7)
    second = stream(cluster, second_prompt, 24)  # streamed: its usage chunk says what it did not read again
    assert cached_tokens(second) == len(first_prompt) + len(generated) - 1
    assert second["usage"]["prompt_tokens"] == len(second_prompt)
    assert metric(cluster, "tc_prompt_tokens_cached_total") == cached_tokens(second)
    assert cluster.get("/v1/cluster")[1]["batch"]["kept"] == 1  # the second's, for a turn after it
    expected = alone(model_dir, second_prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert_same_greedy_text(second["choices"][0]["text"], expected)
    # the same prompt again continues nothing (the kept cache is the second request's now): a fresh read
    again = complete(cluster, second_prompt, 24)
    assert cached_tokens(again) == 0
    assert_same_greedy_text(again["choices"][0]["text"], expected)


def test_workers_copy_and_cut_back_the_part_of_a_kept_cache_a_prompt_shares(cluster, model_dir):
    """Through a head and two worker processes: a request sharing a long start with a kept one copies it on both
    workers (and the kept one stays), and where the batch's two places are taken, the request that shares a kept
    cache's start takes it over, cut back; every text is a fresh read's."""
    system = prompt(60, MIN_SHARED_TOKENS + 4)
    prompts = [system + prompt(61 + i, 6) for i in range(3)]
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    copied = complete(cluster, prompts[0], 5)
    before = metric(cluster, "tc_prompt_tokens_cached_total")
    second = stream(cluster, prompts[1], 5)
    assert cached_tokens(second) == common_start(prompts[0], prompts[1]) >= len(system)
    assert metric(cluster, "tc_prompt_tokens_cached_total") == before + cached_tokens(second)
    assert cluster.get("/v1/cluster")[1]["batch"]["kept"] == 2
    for prompt_ids, body in ((prompts[0], copied), (prompts[1], second)):
        assert_same_greedy_text(body["choices"][0]["text"], alone(model_dir, prompt_ids, greedy))
    # both places hold kept caches: the third copies the one it shares most with, and the oldest other goes
    third = complete(cluster, prompts[2], 5)
    assert cached_tokens(third) == max(common_start(prompts[2], p) for p in prompts[:2])
    assert_same_greedy_text(third["choices"][0]["text"], alone(model_dir, prompts[2], greedy))
    assert cluster.get("/v1/cluster")[1]["batch"]["kept"] == 2
    # the same prompt as the third, twice at once: the batch's two places leave no room for a copy beside its
    # kept cache, so the first admitted takes it over cut back (the other reads whole or copies the second's)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:
        twice = list(pool.map(lambda _: complete(cluster, prompts[2], 5), range(2)))
    for body in twice:
        assert_same_greedy_text(body["choices"][0]["text"], alone(model_dir, prompts[2], greedy))
    assert max(cached_tokens(body) for body in twice) == len(prompts[2]) - 1
    # two new prompts with one system prompt at once: the later copies from the earlier while it runs (its
    # source in the same batch on both workers)
    together = [prompt(64, MIN_SHARED_TOKENS + 3) + prompt(65 + i, 5) for i in range(2)]
    with ThreadPoolExecutor(2) as pool:
        bodies = list(pool.map(lambda p: complete(cluster, p, 5), together))
    assert sorted(cached_tokens(body) for body in bodies) == [0, common_start(*together)]
    for body, prompt_ids in zip(bodies, together):
        assert_same_greedy_text(body["choices"][0]["text"], alone(model_dir, prompt_ids, greedy))
    # a request may ask to read its prompt whole (llama.cpp's cache_prompt); a value not a boolean is a 400
    ask = {"model": cluster.model, "prompt": prompts[2], "max_tokens": 2, "temperature": 0}
    status, body = cluster.post("/v1/completions", {**ask, "cache_prompt": False})
    assert status == 200 and cached_tokens(body) == 0
    status, body = cluster.post("/v1/completions", {**ask, "cache_prompt": "no"})
    assert status == 400 and body["error"]["param"] == "cache_prompt", body
    for worker in cluster.workers.values():
        assert "holds" not in worker.output() and "Traceback" not in worker.output()


def test_a_worker_replaced_between_turns_takes_the_kept_caches_with_it(cluster, model_dir):
    """The kept caches go with a worker that leaves: the next turns read their prompts whole, with the right
    text, whether or not another request ran on the new worker first; none fails for a cache it lacks."""
    import time

    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    follow_ups = []
    for seed in (31, 32):  # two conversations, both kept (the batch has two places)
        first_prompt = prompt(seed, 25)
        first = complete(cluster, first_prompt, 5)
        expected = alone(model_dir, first_prompt, greedy)
        if first["choices"][0]["text"] != expected.text:
            assert_same_greedy_text(first["choices"][0]["text"], expected)
            pytest.skip("a first reply parted from the in-process one at a tie: its tokens are not known here")
        follow_ups.append(first_prompt + list(expected.token_ids) + prompt(seed + 10, 4))
    cluster.workers.pop("w2").stop()
    deadline = time.monotonic() + 30
    while cluster.get("/health/ready")[0] != 503:  # the head has seen it go
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cluster.start_worker("w2", name="w2-again")
    cluster.wait_ready()
    # the first continues a cache the new worker never had; its step (of new sequences only) tells the head the
    # second's went too
    for follow_up in follow_ups:
        body = complete(cluster, follow_up, 5)
        assert cached_tokens(body) == 0
        assert_same_greedy_text(body["choices"][0]["text"], alone(model_dir, follow_up, greedy))
    assert "holds no cache" not in cluster.workers["w2-again"].output()


def test_the_topology_turns_it_off_by_name():
    from cluster import ROOT
    from tc.topology import TopologyError, parse_topology
    base = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "quant": "fp16", "dtype": "bf16",
            "head": {"api": "127.0.0.1:8000", "listen": "127.0.0.1:7001"}, "nodes": [{"id": "a", "device": "cpu"}]}
    assert parse_topology(base, ROOT).head.prefix_cache is True
    off = parse_topology({**base, "head": {**base["head"], "prefix_cache": False}}, ROOT)
    assert off.head.prefix_cache is False and parse_topology(off.to_dict(), ROOT) == off
    with pytest.raises(TopologyError) as caught:
        parse_topology({**base, "head": {**base["head"], "prefix_cache": "yes"}}, ROOT)
    assert caught.value.key_path == "head.prefix_cache"


def test_a_worker_lost_while_a_copy_runs_resumes_it_as_without_the_loss(tmp_path, model_dir):
    """A worker SIGKILLed just before the step that copies a kept cache's start, or a few decode steps after it:
    the head replays the copy's inputs (the kept sequence's for the shared part, then its own) on the new worker,
    and the reply is the uninterrupted one. The head runs in this process, so the test picks the exact step."""
    from tc.head.main import start_head
    from tc.topology import load_topology
    from test_resume_dtypes import KillBeforeStep, start_worker

    nodes = [{"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}]
    path = write_topology(tmp_path / "t.yaml", model_dir, nodes, head={
        "heartbeat_s": 0.5, "heartbeat_timeout_s": 3, "resume": True, "resume_grace_s": 120, "max_batch": 2})
    head = start_head(load_topology(path).with_ports(api_port=0, listen_port=0))
    workers = {n: start_worker(head, n, tmp_path / f"{n}.log") for n in ("a", "b")}
    service, pipeline = head.service, head.service.generator.pipeline
    system = prompt(70, MIN_SHARED_TOKENS + 8)
    first_prompt, second_prompt = system + prompt(71, 7), system + prompt(72, 5)
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True, logprobs=2)
    killer = KillBeforeStep(head, workers, tmp_path)
    calls, kill = killer.calls, killer.kill  # per pipeline call its entries; call -> the node killed before it

    def second_turn() -> Completion:
        """The first request, kept; then the second, copying its start."""
        service._release_kept(len(service._kept))  # the loop is idle: nothing of an earlier run stays kept
        calls.clear()
        service.complete(first_prompt, params)
        return service.complete(second_prompt, params)

    try:
        assert head.registry.wait_ready(300), [w.output() for w in workers.values()]
        expected = second_turn()
        assert expected.cached_prompt_tokens == common_start(first_prompt, second_prompt)
        copying = next(i for i, entries in enumerate(calls, 1) if entries[0].source is not None)
        for at, node in [(copying, "b"), (copying + 3, "a")]:
            kill.clear()
            kill[at] = node
            resumes = pipeline.resumes
            got = second_turn()
            assert pipeline.resumes == resumes + 1, f"the loss at step {at} was not resumed"
            # the first request's kept cache, which no request waited on by then, was not replayed but forgotten
            # (and released where it stayed): the next turn of its conversation reads its prompt whole
            first_sequence = calls[0][0].sequence
            assert first_sequence not in service._kept and first_sequence not in pipeline._inputs
            assert (got.token_ids, got.text, got.cached_prompt_tokens) == \
                   (expected.token_ids, expected.text, expected.cached_prompt_tokens), f"{node} killed before {at}"
            assert [t.logprob.logprob for t in got.tokens] == \
                   pytest.approx([t.logprob.logprob for t in expected.tokens], abs=1e-4)
    finally:
        killer.restore()
        for worker in workers.values():
            worker.stop()
        head.stop()


class GatedPipeline:
    """The service's pipeline, each step let through by the test (`allow`), with every step's entries noted."""

    def __init__(self, service: GenerationService):
        self.pipeline, self.steps = service.generator.pipeline, []
        self.permits = __import__("threading").Semaphore(0)
        self._run, self.pipeline.run = self.pipeline.run, self.run

    def run(self, entries, hidden):
        self.permits.acquire()
        self.steps.append(list(entries))
        return self._run(entries, hidden)

    def allow(self, steps: int = 1) -> None:
        for _ in range(steps):
            self.permits.release()

    def open_all(self) -> None:
        self.allow(10_000)


def wait_for(condition, what: str) -> None:
    import time
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def in_threads(*calls):
    """Start each call on a thread of its own; returns the threads and a dict of their results (or errors)."""
    import threading
    results = {}

    def run(i, call):
        try:
            results[i] = call()
        except BaseException as exc:  # the test reads it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, call), daemon=True) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    return threads, results


def test_requests_that_arrive_together_with_one_system_prompt_read_it_once(model_dir):
    """Two requests with the same long system prompt admitted together, beside a decoding one (so prompts are read
    in chunks): the second waits until the first has read the part they share, then copies it, and reads only
    the rest; both texts are what each gets alone."""
    service = new_service(model_dir, prefill_chunk=8)
    gate = GatedPipeline(service)
    system = prompt(80, MIN_SHARED_TOKENS + 10)
    first_prompt, second_prompt = system + prompt(81, 6), system + prompt(82, 9)
    long_params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    gate.allow()
    decoding = service.open(prompt(83, 5), long_params)  # decodes beside them, one position a step
    threads, results = in_threads(lambda: service.complete(first_prompt, GREEDY),
                                  lambda: service.complete(second_prompt, GREEDY))
    wait_for(lambda: service.queue_depth == 2, "the two requests queue while the step is held")
    gate.open_all()
    for thread in threads:
        thread.join(120)
    decoding.close()
    first, second = results[0], results[1]
    shared = common_start(first_prompt, second_prompt)
    assert first.cached_prompt_tokens == 0 and second.cached_prompt_tokens == shared
    for completion, prompt_ids in ((first, first_prompt), (second, second_prompt)):
        assert_same_greedy_text(completion.text, alone(model_dir, prompt_ids, GREEDY))
    # the second's first entry copied the first's cache in a step after the first had read the shared part
    first_id = next(e.sequence for step in gate.steps for e in step if e.start == 0 and e.length == 8
                    and e.capacity == len(first_prompt) + GREEDY.max_tokens)
    copy_at = next(i for i, step in enumerate(gate.steps) if any(e.source == first_id for e in step))
    read_before = sum(e.length for step in gate.steps[:copy_at] for e in step if e.sequence == first_id)
    (copy,) = [e for e in gate.steps[copy_at] if e.source == first_id]
    assert copy.start == shared <= read_before
    assert cached_total(service) == shared


def test_a_request_that_leaves_before_reading_the_shared_part_leaves_the_other_to_read_its_own(model_dir):
    """The request another waits to copy from goes (its client gone) before it has read what they share: the
    waiting one reads its whole prompt, with the right text, rather than wait for ever."""
    import threading

    service = new_service(model_dir, prefill_chunk=8)
    gate = GatedPipeline(service)
    system = prompt(90, MIN_SHARED_TOKENS + 10)
    first_prompt, second_prompt = system + prompt(91, 6), system + prompt(92, 9)
    gate.allow()
    decoding = service.open(prompt(93, 5), SamplingParams(max_tokens=80, temperature=0, ignore_eos=True))
    leave = threading.Event()
    threads, results = in_threads(
        lambda: service.open_choices(first_prompt, [GREEDY], gone=leave.is_set),
        lambda: service.complete(second_prompt, GREEDY))
    wait_for(lambda: service.queue_depth == 2, "the two requests queue while the step is held")
    gate.allow(2)  # the step that admits them (the first reads 8 positions), and one more
    wait_for(lambda: len(gate.steps) == 3, "two more steps")
    leave.set()
    threads[0].join(60)
    assert type(results[0]).__name__ == "ClientGone"
    gate.open_all()
    threads[1].join(120)
    decoding.close()
    second = results[1]
    assert second.cached_prompt_tokens == 0
    assert_same_greedy_text(second.text, alone(model_dir, second_prompt, GREEDY))
