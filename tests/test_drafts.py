"""Drafts (tc/draft.py, head.draft_tokens): a greedy sequence guesses its next tokens from its own text (or from a
predicted output) and checks them in one step of several rows. The guesses change no token, only how many one
step makes: every run here is compared with the run that makes one token a step, in process, beside other
sequences, through real head and worker processes (a worker killed mid-draft included) and on the demo model."""
from __future__ import annotations

import signal
import time

import pytest
import torch
import yaml

from cluster import Cluster, Request, start_cluster, write_topology
from model_helpers import OurModel, assert_same_greedy_text
from tc.draft import FIRST_LIMIT, MAX_LIMIT, MAX_PAUSE, STEP_ROWS, DraftLookup
from tc.generation import Generator, LocalPipeline
from tc.model.tokenizer import TextTokenizer
from tc.sampling import SamplingParams
from tc.topology import TopologyError, parse_topology
from throttle import Throttle
from tiny_model import write_tiny_model

# --- the lookup -------------------------------------------------------------------------------------------------


def test_a_tail_seen_before_guesses_what_followed_its_last_sighting():
    lookup = DraftLookup()
    lookup.extend([5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7])
    assert lookup.draft(3) == [1, 2, 5]  # (5, 6, 7) was last followed by 1 2 5 ..., not by 8
    assert lookup.draft(MAX_LIMIT) == [1, 2, 5, 6]  # FIRST_LIMIT tokens at most until drafts are taken whole
    assert FIRST_LIMIT == 4


def test_a_shorter_tail_is_looked_up_where_the_longer_one_was_never_seen_and_none_gives_no_draft():
    lookup = DraftLookup()
    lookup.extend([1, 2, 3, 9, 2, 3])
    assert lookup.draft(8) == [9, 2, 3]  # (9, 2, 3) is new; (2, 3) was followed by 9
    fresh = DraftLookup()
    fresh.extend([1, 2, 3, 4])
    assert fresh.draft(8) == []
    assert fresh.draft(0) == []


def test_a_reference_is_looked_up_first_and_followed_in_order_where_its_lines_repeat():
    reference = [10, 11, 12, 13, 10, 11, 12, 14]
    lookup = DraftLookup(reference)
    lookup.extend([1, 10, 11, 12, 15, 10, 11, 12])  # its own text would guess 15
    assert lookup.draft(8) == [13, 10, 11, 12]
    lookup.taken(4, 4)  # all four were right: the reply is at reference[7] now
    lookup.extend([13, 10, 11, 12])
    assert lookup.draft(8) == [14]  # the second sighting of (10, 11, 12), not the first again


def test_the_draft_limit_doubles_after_a_draft_taken_whole_and_halves_after_one_refused_at_once():
    lookup = DraftLookup()
    lookup.taken(4, 4)
    assert lookup.limit == 8
    for _ in range(3):
        lookup.taken(8, 8)
    assert lookup.limit == MAX_LIMIT
    lookup.taken(MAX_LIMIT, 3)  # partly right: kept
    assert lookup.limit == MAX_LIMIT
    for _ in range(6):
        lookup.taken(2, 0)
    assert lookup.limit == 1
    lookup.taken(0, 0)  # no draft at all says nothing
    assert lookup.limit == 1


def test_drafts_refused_at_once_one_after_another_pause_drafting_ever_longer_until_one_is_taken():
    lookup = DraftLookup()
    lookup.extend([1, 2, 3, 4, 1, 2, 3])

    def drafts_in(steps: int) -> list[bool]:
        return [bool(lookup.draft(8)) for _ in range(steps)]

    assert drafts_in(1) == [True]
    lookup.taken(4, 0)
    assert drafts_in(2) == [False, True]  # one step without
    lookup.taken(4, 0)
    assert drafts_in(3) == [False, False, True]  # two
    lookup.taken(2, 0)
    assert drafts_in(5) == [False] * 4 + [True]  # four
    lookup.taken(1, 1)  # taken: the next refusal pauses for one step again
    lookup.taken(2, 0)
    assert drafts_in(2) == [False, True]
    for _ in range(10):
        lookup.pause = 0
        lookup.taken(1, 0)
    assert lookup.pause == MAX_PAUSE


# --- in process: the generator over the real layers ---------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("drafts") / "tiny-qwen", seed=11)


@pytest.fixture(scope="module")
def model(model_dir):
    return OurModel(model_dir, splits=[2])


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return TextTokenizer.load(model_dir)


class RecordingPipeline(LocalPipeline):
    """The real stages; records each step's entries as (start, length, source)."""

    def __init__(self, stages: list):
        super().__init__(stages)
        self.steps: list[list[tuple[int, int, int | None]]] = []

    def run(self, entries, hidden):
        self.steps.append([(e.start, e.length, e.source) for e in entries])
        return super().run(entries, hidden)

    @property
    def entries(self) -> list[tuple[int, int, int | None]]:
        return [entry for step in self.steps for entry in step]


PROMPTS = ["the quick brown fox", "def add(a, b):\n    return a + b\n\ndef add(a, b):", "1 2 3 4 5 6 7 8 9",
           "a b c a b c a b c"]


def greedy(max_tokens: int, **more) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **more)


def solo(model, tokenizer, prompt: str, params: SamplingParams):
    """The run that makes one token a step, with the log-probabilities that tell a tie (assert_same_greedy_text)."""
    generator = Generator(model.head, tokenizer, model.pipeline(), torch.float32)
    return generator.generate(tokenizer.encode(prompt), SamplingParams(**{**params.__dict__, "logprobs": 2}))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_greedy_run_with_drafts_makes_the_tokens_of_one_without_in_fewer_steps(model, tokenizer, prompt):
    pipeline = RecordingPipeline(model.stages)
    generator = Generator(model.head, tokenizer, pipeline, torch.float32, draft_tokens=MAX_LIMIT)
    steps = list(generator.stream(tokenizer.encode(prompt), greedy(60)))
    completion = steps[-1].completion
    assert "".join(s.text for s in steps) == completion.text
    assert [t for s in steps for t in s.tokens] == list(completion.tokens)
    assert completion.completion_tokens == 60
    assert_same_greedy_text(completion.text, solo(model, tokenizer, prompt, greedy(60)))
    # this model repeats itself: drafts were taken, and some refused (the next entry then cut the cache back)
    assert generator.accepted > 0 and generator.drafted > generator.accepted
    assert len(steps) < 60 - generator.accepted // 2
    decode = pipeline.entries[1:]
    assert any(length > 1 for _, length, _ in decode)
    assert any(source is not None for _, _, source in decode)
    assert all(start + length <= completion.prompt_tokens + 60 for start, length, _ in decode)  # within capacity


def test_a_predicted_output_s_tokens_past_the_embedding_are_never_drafted(model, tokenizer):
    """A tokenizer may hold special tokens past the model's embedding rows (tokenizer.check_vocab leaves them), and
    a predicted output's text may name one: drafted, it failed the step of every sequence in the batch."""
    ids = tokenizer.encode(PROMPTS[0])
    want = Generator(model.head, tokenizer, model.pipeline(), torch.float32).generate(ids, greedy(20))
    past = model.head.config.vocab_size
    # the reply with ids past the rows where its first draft comes from: after its first two tokens
    reference = [*want.token_ids[:2], past, past, *want.token_ids[2:]]
    generator = Generator(model.head, tokenizer, model.pipeline(), torch.float32, draft_tokens=MAX_LIMIT)
    got = generator.generate(ids, greedy(20, draft_reference=tuple(reference)))
    assert got.token_ids == want.token_ids and generator.drafted > 0


def test_max_tokens_and_stop_strings_end_a_draft_where_they_end_a_run_without_one(model, tokenizer):
    prompt = PROMPTS[3]
    reference = solo(model, tokenizer, prompt, greedy(40))
    generator = Generator(model.head, tokenizer, model.pipeline(), torch.float32, draft_tokens=MAX_LIMIT)
    ids = tokenizer.encode(prompt)
    for count in (1, 2, 7, 13, 33, 40):
        completion = generator.generate(ids, greedy(count))
        assert completion.completion_tokens == count and completion.finish_reason == "length"
        assert_same_greedy_text(completion.text, solo(model, tokenizer, prompt, greedy(count)))
    assert generator.accepted > 0
    stop = reference.text[len(reference.text) // 2:][:3]
    cut = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(stop,))
    completion = generator.generate(ids, cut)
    assert completion.finish_reason == "stop" and stop not in completion.text
    assert completion.text == reference.text[:reference.text.index(stop)]


def test_a_drafting_sequence_beside_sampled_ones_leaves_each_its_text_alone(model, tokenizer):
    generator = Generator(model.head, tokenizer, model.pipeline(), torch.float32, draft_tokens=MAX_LIMIT)
    jobs = [(PROMPTS[1], greedy(50)), (PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.9, seed=3)),
            (PROMPTS[3], greedy(45)), (PROMPTS[2], SamplingParams(max_tokens=20, temperature=0, logprobs=1))]
    sequences = [generator.start(tokenizer.encode(p), params) for p, params in jobs]
    running = list(sequences)
    while running:
        for sequence, step in generator.step(running):
            if step.completion is not None:
                running.remove(sequence)
    assert generator.accepted > 0
    for (prompt, params), sequence in zip(jobs, sequences):
        alone = Generator(model.head, tokenizer, model.pipeline(), torch.float32).generate(tokenizer.encode(prompt),
                                                                                            params)
        if params.temperature == 0 and params.logprobs is None:
            assert_same_greedy_text(sequence.completion.text, solo(model, tokenizer, prompt, params))
        else:  # sampled, or with log-probabilities: no drafts, and the text it gets alone
            assert sequence.completion.text == alone.text


def test_a_batch_s_drafts_share_the_rows_of_one_plan_first_come_first_served(model, tokenizer):
    pipeline = RecordingPipeline(model.stages)
    generator = Generator(model.head, tokenizer, pipeline, torch.float32, draft_tokens=MAX_LIMIT)
    sequences = [generator.start(tokenizer.encode(PROMPTS[i % 4]), greedy(40)) for i in range(6)]
    running = list(sequences)
    while running:
        for sequence, step in generator.step(running):
            if step.completion is not None:
                running.remove(sequence)
    decoding = [step for step in pipeline.steps if all(start > 0 for start, _, _ in step)]
    assert max(sum(length for _, length, _ in step) for step in decoding) == STEP_ROWS  # drafts, up to the cap
    assert all(sum(length for _, length, _ in step) <= max(STEP_ROWS, len(step)) for step in decoding)
    for i, sequence in enumerate(sequences):
        assert_same_greedy_text(sequence.completion.text, solo(model, tokenizer, PROMPTS[i % 4], greedy(40)))


def test_head_draft_tokens_is_a_topology_key_from_0_to_the_most_a_step_takes(model_dir, tmp_path):
    def topology(**head):
        path = write_topology(tmp_path / "t.yaml", model_dir, [{"id": "a"}], head=head)
        return parse_topology(yaml.safe_load(path.read_text()), tmp_path)

    assert topology(draft_tokens=0).head.draft_tokens == 0
    assert topology().head.draft_tokens == MAX_LIMIT
    for bad in (-1, MAX_LIMIT + 1, "many", 2.5):
        with pytest.raises(TopologyError, match="head.draft_tokens"):
            topology(draft_tokens=bad)


# --- through real head and worker processes ---------------------------------------------------------------------

def metric(cluster: Cluster, name: str) -> float:
    import urllib.request
    with urllib.request.urlopen(cluster.url + "/metrics", timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return float(next(line.split()[-1] for line in lines if line.startswith(name + " ")))


def body_for(prompt: str, max_tokens: int) -> dict:
    return {"model": "tiny-qwen", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def test_drafts_through_head_and_two_workers_and_a_worker_killed_mid_draft(tmp_path, model_dir, model, tokenizer):
    with start_cluster(tmp_path, model_dir, resume=True, resume_grace_s=120) as cluster:
        for prompt in PROMPTS:
            status, reply = cluster.post("/v1/completions", body_for(prompt, 40), timeout=120)
            assert status == 200, reply
            assert_same_greedy_text(reply["choices"][0]["text"], solo(model, tokenizer, prompt, greedy(40)))
        accepted = metric(cluster, "tc_draft_tokens_accepted_total")
        assert 0 < accepted < metric(cluster, "tc_draft_tokens_total")
        assert metric(cluster, "tc_decode_step_seconds_count") < 4 * 39 - accepted / 2
        # a long greedy run, drafting, loses a worker: it resumes from the tokens it kept, not those it guessed
        # (the workers held to a fifth of a core, so that the run is still going when the worker goes)
        with Throttle(cluster.workers["a"].proc.pid, 0.2), Throttle(cluster.workers["b"].proc.pid, 0.2):
            request = Request(cluster, body_for(PROMPTS[3], 200))
            deadline = time.monotonic() + 30
            while metric(cluster, "tc_draft_tokens_accepted_total") < accepted + 10:
                assert time.monotonic() < deadline, "the long run never drafted"
                time.sleep(0.005)
            b = cluster.workers.pop("b")
            b.proc.send_signal(signal.SIGKILL)
            b.stop()
        cluster.start_worker("b", name="b-again")
        status, reply = request.wait(180)
        assert status == 200, reply
        assert reply["usage"]["completion_tokens"] == 200
        assert_same_greedy_text(reply["choices"][0]["text"], solo(model, tokenizer, PROMPTS[3], greedy(200)))
        assert "1 sequence(s) resumed on a refilled pipeline" in cluster.head.output()


def test_head_draft_tokens_0_makes_one_token_a_step(tmp_path, model_dir, model, tokenizer):
    with start_cluster(tmp_path, model_dir, draft_tokens=0) as cluster:
        status, reply = cluster.post("/v1/completions", body_for(PROMPTS[3], 30), timeout=120)
        assert status == 200, reply
        assert_same_greedy_text(reply["choices"][0]["text"], solo(model, tokenizer, PROMPTS[3], greedy(30)))
        assert metric(cluster, "tc_draft_tokens_total") == 0
        assert metric(cluster, "tc_decode_step_seconds_count") == 29


# --- the demo model -------------------------------------------------------------------------------------------

EDITED_CODE = "def area(width, height):\n    return width * height\n\n\nprint(area(3, 4))\nprint(area(5, 6))\n"


@pytest.mark.demo
@pytest.mark.slow
def test_a_predicted_output_gives_the_demo_model_s_reply_in_far_fewer_steps(tmp_path, demo_model_dir):
    """A code edit through head + 2 workers, the code sent as OpenAI's `prediction`: the reply of a run that makes
    one token a step, from a fraction of the steps."""
    from tc.local import load_local_generator
    messages = [{"role": "user", "content": "Rename the function area to rect_area everywhere. Reply with the "
                                            f"whole code only, in a Python code block.\n\n```python\n{EDITED_CODE}```"}]
    alone = load_local_generator(demo_model_dir, "fp32")
    ids = alone.tokenizer.encode(alone.tokenizer.apply_chat_template(messages))
    expected = alone.generate(ids, SamplingParams(max_tokens=80, temperature=0, logprobs=2))
    assert "rect_area(3, 4)" in expected.text  # the model does the edit: most of its reply is the code again
    topology = write_topology(tmp_path / "t.yaml", demo_model_dir, [{"id": "w1", "device": "cpu"},
                                                                    {"id": "w2", "device": "cpu"}], dtype="fp32")
    with Cluster(topology, tmp_path) as cluster:
        cluster.start_all(["w1", "w2"])
        status, reply = cluster.post("/v1/chat/completions", {
            "model": "Qwen2.5-Coder-0.5B-Instruct", "messages": messages, "max_tokens": 80, "temperature": 0,
            "prediction": {"type": "content", "content": EDITED_CODE}}, timeout=300)
        assert status == 200, reply
        assert_same_greedy_text(reply["choices"][0]["message"]["content"], expected)
        made = reply["usage"]["completion_tokens"]
        assert made == expected.completion_tokens
        assert metric(cluster, "tc_draft_tokens_accepted_total") >= made / 2
        assert metric(cluster, "tc_decode_step_seconds_count") < made / 2


@pytest.mark.demo
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_draft_s_rows_compute_the_bits_of_one_row_a_step_on_the_demo_model(demo_model_dir, mode):
    """int8 and int4 on x86-64 take the native kernels for a draft's rows as for one row, each row on its own: the
    same hidden states, cache and logits, so greedy text is exactly one token a step's."""
    from tc.local import load_local_generator
    from tc.model import native
    from tc.model.qwen2 import Span
    generator = load_local_generator(demo_model_dir, "bf16", quant=mode)
    if native.kernels() is None:
        pytest.skip("no native kernels on this CPU: PyTorch's products sum several rows in their own order")
    stage = generator.pipeline.stages[0]
    gen = torch.Generator().manual_seed(0)
    prompt = (torch.randn(1, 40, 896, generator=gen) * 0.5).to(torch.bfloat16)
    rows = (torch.randn(1, 6, 896, generator=gen) * 0.5).to(torch.bfloat16)
    one_by_one, drafted = (stage.new_cache(64, torch.bfloat16, "cpu") for _ in range(2))
    for cache in (one_by_one, drafted):
        stage.forward_batch(prompt, [Span(cache, 0, 40)])
    singles = torch.cat([stage.forward_batch(rows[:, i:i + 1], [Span(one_by_one, 40 + i, 1)]) for i in range(6)],
                        dim=1)
    together = stage.forward_batch(rows, [Span(drafted, 40, 6)])
    assert torch.equal(singles, together)
    assert drafted.length == one_by_one.length == 46
    assert torch.equal(drafted.kv[..., :46, :], one_by_one.kv[..., :46, :])
    assert torch.equal(generator.head.logits(singles), generator.head.logits(together))


def test_a_cut_keeps_the_inputs_first_positions_and_the_parts_before_it_as_they_are():
    from tc.head.pipeline import first_positions
    parts = [torch.arange(a, b, dtype=torch.float32).view(1, -1, 1) for a, b in ((0, 5), (5, 8), (8, 12))]
    kept = first_positions(parts, 6)
    assert [p.shape[1] for p in kept] == [5, 1] and kept[0] is parts[0]
    assert torch.cat(kept, dim=1).flatten().tolist() == list(range(6))
    assert [p is q for p, q in zip(first_positions(parts, 8), parts)] == [True, True]
    assert first_positions(parts, 0) == [] and len(first_positions(parts, 12)) == 3


def test_the_next_turn_takes_over_a_drafting_reply_s_cache_and_its_refused_guesses_are_cut_off(tmp_path):
    """A finished reply's cache is kept for the request that continues its text (head.prefix_cache). A reply that
    a stop string ends inside a draft leaves positions past its tokens in the workers' caches (guesses after the
    stop, taken or not), which the next turn's first entry cuts off: a worker refuses an entry that does not start
    where its cache ends."""
    # a vocabulary of exactly the tokenizer's, so that every token generated may be sent back in a prompt
    model_dir = write_tiny_model(tmp_path / "tiny-qwen", seed=11, max_position_embeddings=512, vocab_size=259)
    model, tokenizer = OurModel(model_dir, splits=[2]), TextTokenizer.load(model_dir)
    ids = tokenizer.encode(PROMPTS[3])
    reference = solo(model, tokenizer, PROMPTS[3], greedy(60))
    # a stop string that ends the reply inside a draft, found in process: the cache then holds more than its text
    generator = Generator(model.head, tokenizer, model.pipeline(), torch.float32, draft_tokens=MAX_LIMIT)
    for at in range(len(reference.text) - 2, 0, -1):
        stop = reference.text[at:at + 2]
        params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, stop=(stop,))
        sequence = generator.start(ids, params)
        while sequence.completion is None:
            assert not any(isinstance(step, Exception) for _, step in generator.step([sequence]))
        held = generator.pipeline.caches[sequence.id][0].length
        generator.pipeline.release([sequence.id])
        if held > len(sequence.cache_ids()):
            break
    else:
        pytest.fail("no stop string of the reply ends it inside a draft")
    first = sequence.completion
    with start_cluster(tmp_path, model_dir) as cluster:
        status, reply = cluster.post("/v1/completions", {**body_for(PROMPTS[3], 60), "prompt": ids, "stop": stop},
                                     timeout=120)
        assert status == 200, reply
        assert reply["choices"][0]["text"] == first.text
        # the conversation goes on from the reply's tokens: the positions its cache kept for them are taken over
        turn = ids + list(first.token_ids) + tokenizer.encode(" and then")
        status, reply = cluster.post("/v1/completions", {**body_for(PROMPTS[3], 20), "prompt": turn}, timeout=120)
        assert status == 200, reply
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == len(sequence.cache_ids())
        fresh = Generator(model.head, tokenizer, model.pipeline(), torch.float32).generate(
            turn, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2))
        assert_same_greedy_text(reply["choices"][0]["text"], fresh)
