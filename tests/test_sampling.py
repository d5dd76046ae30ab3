"""Sampling and log-probabilities, pure, checked against transformers' logits processors where they exist, and the
generation loop's penalties against a step-by-step reference on our single-process model."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from model_helpers import OurModel
from tc.generation import Generator
from tc.model.tokenizer import TextTokenizer
from tc.sampling import (SamplingParams, TokenHistory, apply_presence_frequency, apply_repetition_penalty, choose,
                         draw, filter_min_p, filter_top_k, filter_top_p, new_rng, penalise, prompt_logprobs, sample,
                         token_logprob)

VOCAB = 50


def random_logits(seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_takes_the_argmax_whatever_the_rng():
    logits = random_logits(0)
    assert sample(logits, 0.0, 0.5, None) == int(torch.argmax(logits))
    assert sample(logits, 0.0, 1.0, new_rng(1), top_k=3) == int(torch.argmax(logits))
    assert sample(logits, 0.0, 0.5, new_rng(1), min_p=0.9) == int(torch.argmax(logits))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(seed, penalty):
    logits = random_logits(seed)
    seen_ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(100 + seed))[:12]
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[seen_ids] = True
    expected = RepetitionPenaltyLogitsProcessor(penalty)(seen_ids[None], logits[None].clone())[0]
    assert torch.allclose(apply_repetition_penalty(logits, seen, penalty), expected)


@pytest.mark.parametrize("penalty", [1e-40, 1e-46, 1e-300, 1e30, 1e300])
def test_an_extreme_repetition_penalty_keeps_every_logit_finite_and_in_order(penalty):
    """Dividing by a penalty near 0 took a seen logit to inf, and the sampler's inf - inf made NaN: it then drew
    a token the logits had nothing to do with. Seen tokens keep their order, beyond the unseen ones as far as
    the penalty asks, and a token masked to -inf stays masked."""
    logits = random_logits(0) * 10
    seen_ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))[:12]
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[seen_ids] = True
    logits[seen_ids[0]] = float("-inf")
    logits[seen_ids[1]] = 0.0
    got = apply_repetition_penalty(logits, seen, penalty)
    assert got[seen_ids[0]] == float("-inf") and torch.isfinite(got[seen_ids[1:]]).all()
    assert torch.equal(got[~seen], logits[~seen])
    kept = seen_ids[1:]
    positive, negative = kept[logits[kept] > 0], kept[logits[kept] < 0]
    assert len(positive) > 1 and len(negative) > 1

    def same_order(ids: torch.Tensor) -> bool:
        return torch.equal(torch.argsort(got[ids]), torch.argsort(logits[ids]))

    if penalty < 1:  # seen positive logits beyond every unseen one, in order; sampling takes the largest of them
        assert same_order(kept) and got[positive].min() > logits[~seen].max()
        best = int(positive[torch.argmax(logits[positive])])
        assert sample(got, 0.7, 1.0, new_rng(1)) == best and sample(got, 0.0, 1.0, None) == best
    else:  # seen negative logits below every unseen one, in order; seen positive ones at about 0
        assert same_order(negative) and got[negative].max() < logits[~seen].min()
        assert (got[positive] >= 0).all() and got[positive].max() < 1e-20


@pytest.mark.parametrize("counts, presence, frequency, expected", [
    ([0, 1, 3], 0.0, 0.0, [1.0, 1.0, 1.0]),
    ([0, 1, 3], 0.5, 0.0, [1.0, 0.5, 0.5]),
    ([0, 1, 3], 0.0, 0.25, [1.0, 0.75, 0.25]),
    ([0, 1, 3], 1.0, 1.0, [1.0, -1.0, -3.0]),
    ([2, 0, 0], -1.0, -0.5, [3.0, 1.0, 1.0]),  # negative values encourage repetition
])
def test_presence_and_frequency_penalties_follow_openai(counts, presence, frequency, expected):
    logits = torch.ones(3)
    got = apply_presence_frequency(logits, torch.tensor(counts, dtype=torch.float32), presence, frequency)
    assert got.tolist() == pytest.approx(expected)


def test_token_history_counts_generated_tokens_and_sees_the_prompt():
    history = TokenHistory(6, [1, 1, 4])
    for token in (2, 2, 4):
        history.add(token)
    assert history.counts.tolist() == [0, 0, 2, 0, 1, 0]  # generated tokens only
    assert history.seen.tolist() == [False, True, True, False, True, False]  # prompt and generated
    params = SamplingParams(presence_penalty=1.0, repetition_penalty=2.0)
    got = penalise(torch.full((6,), 4.0), history, params)
    assert got.tolist() == [4.0, 2.0, 1.0, 4.0, 1.0, 4.0]  # seen: 4/2; generated: then -1 presence
    assert penalise(torch.ones(6), None, params).tolist() == [1.0] * 6


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("k", [1, 5, 20, VOCAB, 0])
def test_top_k_matches_transformers(seed, k):
    logits = random_logits(seed)
    ours = filter_top_k(logits, k)
    if k in (0, VOCAB):
        assert torch.equal(ours, logits)
        return
    theirs = TopKLogitsWarper(k)(None, logits[None].clone())[0]
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs)) and int((~torch.isinf(ours)).sum()) == k


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
def test_top_p_keeps_the_same_tokens_as_transformers(seed, top_p):
    logits = random_logits(seed)
    kept = filter_top_p(torch.softmax(logits, -1), top_p) > 0
    theirs = ~torch.isinf(TopPLogitsWarper(top_p)(None, logits[None].clone())[0])
    assert torch.equal(kept, theirs)
    assert filter_top_p(torch.softmax(logits, -1), top_p).sum() <= 1.0 + 1e-6


def test_min_p_drops_tokens_below_its_share_of_the_most_likely_one():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = {min_p: (filter_min_p(probs, min_p) > 0).nonzero().flatten().tolist() for min_p in (0, 0.2, 0.5, 1)}
    # thresholds 0, 0.1, 0.25 and 0.5: the most likely token always stays
    assert kept == {0: [0, 1, 2, 3], 0.2: [0, 1, 2], 0.5: [0, 1], 1: [0]}
    assert torch.equal(filter_min_p(probs, 0.2), torch.tensor([0.5, 0.3, 0.15, 0.0]))  # the kept ones as they were


def clear_of_min_p(probs: torch.Tensor, min_p: float) -> bool:
    """Whether every token but the most likely one is at least 0.01% away from min_p's threshold, so that no
    rounding of ours or transformers' can put it on the other side."""
    threshold = probs.max() * min_p
    others = probs[torch.arange(probs.shape[-1]) != torch.argmax(probs)]
    return bool(((others - threshold).abs() > 1e-4 * threshold).all())


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_keeps_the_same_tokens_as_transformers(seed, min_p):
    logits = random_logits(seed)
    probs = torch.softmax(logits, -1)
    assert clear_of_min_p(probs, min_p)
    kept = filter_min_p(probs, min_p) > 0
    theirs = ~torch.isinf(MinPLogitsWarper(min_p)(None, logits[None].clone())[0])
    assert torch.equal(kept, theirs) and 1 <= int(kept.sum()) < VOCAB


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [(2.0, 0, 1.0, 0.05), (1.5, 30, 0.95, 0.1),
                                                              (3.0, 0, 0.9, 0.2), (1.2, 0, 0.99, 0.02)])
def test_sampled_tokens_are_those_transformers_keeps_with_min_p_after_temperature_top_k_and_top_p(
        seed, temperature, top_k, top_p, min_p):
    logits = random_logits(seed)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k or VOCAB),
                                   TopPLogitsWarper(top_p), MinPLogitsWarper(min_p)])  # transformers' order
    theirs = set((~torch.isinf(warpers(None, logits[None].clone())[0])).nonzero().flatten().tolist())
    probs = torch.softmax(filter_top_k(logits, top_k) / temperature, -1)
    assert clear_of_min_p(probs, min_p)
    nucleus = filter_top_p(probs, top_p)
    kept = filter_min_p(nucleus, min_p) > 0
    assert set(kept.nonzero().flatten().tolist()) == theirs
    assert len(theirs) < int((nucleus > 0).sum())  # min_p took some of the nucleus's tokens away
    rng = new_rng(seed)
    assert {sample(logits, temperature, top_p, rng, top_k=top_k, min_p=min_p) for _ in range(300)} <= theirs


@pytest.mark.parametrize("top_p", [1.0, 0.999])
def test_a_token_under_min_p_after_temperature_is_never_drawn(top_p):
    """Probabilities 0.5, 0.3, 0.15, 0.05: at temperature 1 and min_p 0.4 the threshold is 0.2, which only the first
    two pass. Temperature 2 flattens them to shares 1, 0.77, 0.55, 0.32 of the first: the third passes too."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    rng = new_rng(11)
    assert {sample(logits, 1.0, top_p, rng, min_p=0.4) for _ in range(300)} == {0, 1}
    assert {sample(logits, 2.0, top_p, rng, min_p=0.4) for _ in range(300)} == {0, 1, 2}
    assert {sample(logits, 2.0, top_p, rng, min_p=1.0) for _ in range(50)} == {0}


def test_min_p_filters_the_nucleus_as_transformers_orders_them():
    """top_p 0.83 keeps 0.5, 0.3 and 0.15 (0.8 comes before the third); min_p 0.2 then drops 0.05 only. vLLM's
    order, min-p first, would renormalise to 0.53, 0.32, 0.16, and top-p would then drop the third as well."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    warpers = LogitsProcessorList([TopPLogitsWarper(0.83), MinPLogitsWarper(0.2)])
    assert (~torch.isinf(warpers(None, logits[None].clone())[0])).nonzero().flatten().tolist() == [0, 1, 2]
    rng = new_rng(3)
    assert {sample(logits, 1.0, 0.83, rng, min_p=0.2) for _ in range(300)} == {0, 1, 2}


@pytest.mark.parametrize("temperature, top_p", [(1e-300, 1.0), (5e-324, 0.5), (1.0, 1e-300), (1.0, 5e-324),
                                                (1e-30, 1e-45)])
def test_extreme_but_valid_values_sample_the_best_token(temperature, top_p):
    logits = random_logits(6)
    rng = new_rng(0)
    assert {sample(logits, temperature, top_p, rng) for _ in range(10)} == {int(torch.argmax(logits))}
    masked = filter_top_k(logits, 2)  # -inf entries survive a tiny temperature too
    assert sample(masked, 1e-300, 1.0, rng) == int(torch.argmax(logits))


def test_narrow_sampling_is_greedy():
    logits = random_logits(3)
    best = int(torch.argmax(logits))
    rng = new_rng(0)
    assert {sample(logits, 1.0, 1.0, rng, top_k=1) for _ in range(20)} == {best}
    assert {sample(logits, 1.0, 1e-6, rng) for _ in range(20)} == {best}


def test_seeded_draws_repeat_and_seeds_differ():
    logits = random_logits(4) / 3

    def draws(seed: int) -> list[int]:
        rng = new_rng(seed)
        return [sample(logits, 1.0, 0.95, rng, top_k=30) for _ in range(30)]

    assert draws(7) == draws(7)
    assert draws(-7) == draws(-7)  # OpenAI seeds are signed 64-bit integers
    assert draws(7) != draws(8)
    assert draws(2**63 - 1) == draws(2**63 - 1)


def test_every_bit_of_a_seed_counts():
    """torch's CPU generator keeps only a seed's low 32 bits: seeds that differ only above them (-1 and 2**32 - 1,
    5 and 5 + 2**32, 0 and -2**63) drew the same numbers. A seed within 32 bits draws what it always drew."""
    weights = torch.ones(1000)

    def draws(rng) -> list[int]:
        return [draw(weights, rng) for _ in range(8)]

    for a, b in [(-1, 2**32 - 1), (5, 5 + 2**32), (0, -(2**63)), (2**63 - 1, 2**32 - 1), (7, 7 - 2**32)]:
        assert draws(new_rng(a)) != draws(new_rng(b)), (a, b)
    for seed in (0, 5, 2**32 - 1):
        assert draws(new_rng(seed)) == draws(torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed", [123, 123 + (7 << 32), -123])
def test_draws_follow_the_tempered_distribution(seed):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    temperature = 0.7
    rng = new_rng(seed)
    n = 20000
    counts = torch.bincount(torch.tensor([sample(logits, temperature, 1.0, rng) for _ in range(n)]), minlength=4)
    expected = torch.softmax(logits / temperature, -1)
    assert torch.allclose(counts / n, expected, atol=0.015)


def test_a_logit_bias_of_minus_100_bans_the_greedy_token_and_100_forces_the_least_likely_one():
    for seed in range(5):
        logits = random_logits(seed)
        best, worst = int(torch.argmax(logits)), int(torch.argmin(logits))
        runner_up = int(torch.argmax(logits.index_fill(0, torch.tensor([best]), float("-inf"))))
        banned = SamplingParams(temperature=0, logit_bias=((best, -100.0),))
        assert choose(logits, banned, None, new_rng(0)) == runner_up
        for temperature in (0.0, 1.0, 2.0):
            forced = SamplingParams(temperature=temperature, logit_bias=((best, -100.0), (worst, 100.0)))
            assert choose(logits, forced, None, new_rng(seed)) == worst


def test_a_logit_bias_is_added_to_the_logits_and_leaves_them_as_they_were():
    """A bias that lifts a token just past the best wins it; one a little short does not. The logits a choice reads
    may be a row that another choice of the same prompt reads next: they are not changed."""
    logits = random_logits(7)
    best, token = int(torch.argmax(logits)), int(torch.argmin(logits))
    gap = float(logits[best] - logits[token])
    before = logits.clone()
    assert choose(logits, SamplingParams(temperature=0, logit_bias=((token, gap + 0.01),)), None, new_rng(0)) == token
    assert choose(logits, SamplingParams(temperature=0, logit_bias=((token, gap - 0.01),)), None, new_rng(0)) == best
    assert torch.equal(logits, before)


def test_the_bias_comes_after_the_masks_and_before_the_penalties_as_in_vllm():
    logits = torch.full((VOCAB,), -10.0)
    logits[3], logits[4] = 2.0, -3.5
    history = TokenHistory(VOCAB, [3])
    params = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias=((3, -4.0),))
    # vLLM's order: (2 - 4) * 2 = -4 for token 3, below token 4's -3.5; penalty first it would be 2 / 2 - 4 = -3
    assert choose(logits, params, history, new_rng(0)) == 4
    # +100 brings back no token a grammar or min_tokens (the banned EOS) ruled out
    allowed = torch.ones(VOCAB, dtype=torch.bool)
    allowed[7] = False
    forcing = SamplingParams(temperature=0, logit_bias=((7, 100.0), (8, 100.0)))
    assert choose(logits, forcing, None, new_rng(0), allowed=allowed) == 8
    assert choose(logits, forcing, None, new_rng(0), banned=[8], allowed=allowed) == 3


def test_token_logprob_is_log_softmax_with_the_top_tokens():
    logits = random_logits(5)
    reference = torch.log_softmax(logits, -1)
    report = token_logprob(logits, 7, 4)
    assert report.logprob == pytest.approx(float(reference[7]))
    values, ids = torch.topk(reference, 4)
    assert [i for i, _ in report.top] == ids.tolist()
    assert [lp for _, lp in report.top] == pytest.approx(values.tolist())
    assert token_logprob(logits, 7, 0).top == ()


def test_prompt_logprobs_score_each_next_token():
    logits = torch.stack([random_logits(s) for s in range(3)])  # [3, V]
    reports = prompt_logprobs(logits, [4, 9, 1], 2)
    reference = torch.log_softmax(logits, -1)
    assert [r.logprob for r in reports] == pytest.approx([float(reference[0, 4]), float(reference[1, 9]),
                                                          float(reference[2, 1])])
    assert all(len(r.top) == 2 for r in reports)


# --- in the generation loop ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tiny_model_dir) -> OurModel:
    return OurModel(tiny_model_dir)


@pytest.fixture(scope="module")
def generator(model, tiny_model_dir) -> Generator:
    return Generator(model.head, TextTokenizer.load(tiny_model_dir), model.pipeline(), torch.float32)


def reference_greedy(model: OurModel, eos: frozenset[int], prompt: list[int], steps: int, presence: float,
                     frequency: float, repetition: float) -> list[int]:
    """Greedy decoding recomputed from scratch each step, with the penalties written out independently."""
    ids, out = list(prompt), []
    for _ in range(steps):
        logits = model.full_logits(ids)[-1].clone()  # out of inference mode, to edit in place
        if repetition != 1.0:
            seen = torch.tensor(sorted(set(ids)))
            logits = RepetitionPenaltyLogitsProcessor(repetition)(seen[None], logits[None].clone())[0]
        for token in set(out):
            logits[token] -= presence + frequency * out.count(token)
        token = int(torch.argmax(logits))
        if token in eos:
            break
        ids.append(token)
        out.append(token)
    return out


@pytest.mark.parametrize("presence, frequency, repetition", [
    (0.0, 0.0, 1.0), (1.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.8), (0.5, 0.5, 1.2), (-1.0, 0.0, 0.8),
])
def test_penalised_greedy_generation_matches_the_reference(model, generator, presence, frequency, repetition):
    prompt = generator.tokenizer.encode("Hello there")
    params = SamplingParams(max_tokens=16, temperature=0, presence_penalty=presence, frequency_penalty=frequency,
                            repetition_penalty=repetition)
    got = generator.generate(prompt, params).token_ids
    assert list(got) == reference_greedy(model, generator.tokenizer.eos_token_ids, prompt, 16, presence, frequency,
                                         repetition)


def test_a_biased_greedy_generation_matches_the_reference_and_never_makes_the_banned_token(model, generator):
    prompt = generator.tokenizer.encode("Hello there")
    plain = generator.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)).token_ids
    banned = plain[0]
    bias = ((banned, -100.0),)
    got = generator.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logit_bias=bias))
    assert got.token_ids != plain and banned not in got.token_ids
    ids = list(prompt)
    for _ in range(16):  # greedy recomputed from scratch each step, the bias added to the logits
        logits = model.full_logits(ids)[-1].clone()
        logits[banned] -= 100
        ids.append(int(torch.argmax(logits)))
    assert list(got.token_ids) == ids[len(prompt):]


def test_in_one_batch_only_the_biased_sequence_is_biased(generator):
    """Two sequences choose from the rows of one pipeline step; one forces a token, the other has no bias. The
    other makes what it makes beside an unbiased twin (the same rows, so the same rounding), and the forced
    sequence the forced token throughout."""
    prompt = generator.tokenizer.encode("Hello there")
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)

    def side_by_side(second: SamplingParams):
        sequences = [generator.start(prompt, plain), generator.start(prompt, second)]
        while any(s.completion is None for s in sequences):
            active = [s for s in sequences if s.completion is None]
            assert len(active) == 2  # the same length: every step holds both
            assert not any(isinstance(step, Exception) for _, step in generator.step(active))
        generator.pipeline.release([s.id for s in sequences])
        return [s.completion for s in sequences]

    twins = side_by_side(plain)
    forced_token = next(t for t in range(generator.head.config.vocab_size) if t not in twins[0].token_ids)
    first, forced = side_by_side(dataclasses.replace(plain, logit_bias=((forced_token, 100.0),)))
    assert twins[1].token_ids == twins[0].token_ids != forced.token_ids
    assert forced.token_ids == (forced_token,) * 8
    assert first.token_ids == twins[0].token_ids
    assert [t.logprob.logprob for t in first.tokens] == pytest.approx([t.logprob.logprob for t in twins[0].tokens])
    # log-probabilities are the model's own, before the bias: at the first position both read the same logits,
    # whose likeliest token is the unbiased one's, and the forced token is less likely than it
    report = forced.tokens[0].logprob
    assert report.top == first.tokens[0].logprob.top and report.top[0][0] == first.token_ids[0]
    assert report.logprob < report.top[0][1]


def test_seeded_generation_repeats(generator):
    prompt = generator.tokenizer.encode("Hello")
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=40, seed=99)
    first = generator.generate(prompt, params)
    assert generator.generate(prompt, params).token_ids == first.token_ids
    unseeded = {generator.generate(prompt, SamplingParams(max_tokens=20, temperature=1.0)).token_ids
                for _ in range(3)}
    assert len(unseeded) > 1  # without a seed each request draws its own


BAD_PARAMS = {
    "negative max_tokens": ({"max_tokens": -1}, "max_tokens must be >= 0, got -1"),
    "negative temperature": ({"temperature": -0.5}, "temperature must be >= 0 and finite, got -0.5"),
    "NaN temperature": ({"temperature": float("nan")}, "temperature must be >= 0 and finite, got nan"),
    "infinite temperature": ({"temperature": float("inf")}, "temperature must be >= 0 and finite, got inf"),
    "seed past 64 bits": ({"seed": 1 << 63}, "seed must fit a signed 64-bit integer"),
    "zero top_p": ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    "top_p over 1": ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    "negative top_k": ({"top_k": -1}, "top_k must be >= 0"),
    "negative min_p": ({"min_p": -0.1}, r"min_p must be in \[0, 1\] \(0: off\), got -0.1"),
    "min_p over 1": ({"min_p": 1.5}, r"min_p must be in \[0, 1\] \(0: off\), got 1.5"),
    "NaN min_p": ({"min_p": float("nan")}, r"min_p must be in \[0, 1\] \(0: off\), got nan"),
    "zero repetition_penalty": ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
    "negative logprobs": ({"logprobs": -2}, "logprobs must be >= 0, got -2"),
    "prompt_logprobs alone": ({"prompt_logprobs": True}, "prompt_logprobs needs logprobs"),
    "negative logit_bias token": ({"logit_bias": ((-1, 1.0),)}, "logit_bias has a negative token id"),
    "logit_bias token twice": ({"logit_bias": ((5, 1.0), (5, 2.0))}, "logit_bias names a token more than once"),
    "NaN logit_bias": ({"logit_bias": ((5, float("nan")),)}, "logit_bias has a value that is not finite"),
}


@pytest.mark.parametrize("case", BAD_PARAMS)
def test_bad_sampling_params_raise_value_error_naming_the_field(case):
    fields, message = BAD_PARAMS[case]
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_sampling_params_checks_survive_python_O():
    """`python -O` strips asserts; the checks must still refuse, reached the way the API reaches them."""
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "from tc.head.api_requests import SamplingFields\n"
        "for fields in ({'top_p': 0.0}, {'temperature': -1.0}, {'max_tokens': -3}, {'repetition_penalty': 0.0}):\n"
        "    try:\n"
        "        SamplingFields(**fields).to_params(16)\n"
        "    except ValueError as exc:\n"
        "        print('refused:', exc)\n"
        "    else:\n"
        "        raise SystemExit(f'accepted {fields}')\n"
    )
    done = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("refused: SamplingParams:") == 4, done.stdout


def test_greedy_is_torchs_argmax_ties_nans_and_views_included():
    from tc.sampling import greedy
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(6, 151936, generator=gen)
    rows[1, 7] = rows[1, 90000] = rows[1].max() + 1  # a tie: the first wins
    rows[2, 5000] = float("nan")
    rows[3] = 0.0
    rows[4, -1] = float("inf")
    for row in [*rows, rows[:, 11], rows[0, ::3], rows[5].to(torch.bfloat16)]:
        assert greedy(row) == int(torch.argmax(row))
    assert greedy(rows[1]) == 7


def _reference_sample(logits: torch.Tensor, temperature: float, rng: torch.Generator) -> int:
    """sample() at top_p 1 written out plainly: softmax, float64 cumulative sum, one uniform draw."""
    probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
    cumulative = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    point = torch.rand((), generator=rng, dtype=torch.float64) * cumulative[-1]
    return int(torch.searchsorted(cumulative, point, right=True))


def test_sampling_reuses_its_buffers_without_changing_a_draw_across_sizes_and_threads():
    import threading
    from tc.sampling import sample
    vocabularies = [torch.randn(n, generator=torch.Generator().manual_seed(n)) * 4 for n in (151936, 1000, 151936)]
    failures: list = []

    def draws(offset: int) -> None:
        for seed in range(12):
            logits = vocabularies[(seed + offset) % 3]
            got = sample(logits, 0.7, 1.0, torch.Generator().manual_seed(seed))
            want = _reference_sample(logits, 0.7, torch.Generator().manual_seed(seed))
            if got != want:
                failures.append((offset, seed, got, want))

    threads = [threading.Thread(target=draws, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures
