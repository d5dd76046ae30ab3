"""Choosing the next token from logits, and reporting how likely it was. Pure functions of tensors.

The order is the one vLLM uses: the tokens that may not come next masked out (a grammar's, EOS before min_tokens),
then the request's logit_bias added, then penalties (repetition, then presence and frequency), then temperature,
then top-k and top-p, then min-p, then one draw from the request's `SeededRandom`. Min-p alone comes where
transformers puts it, after top-p: vLLM filters it before top-k and top-p, and its top-p then reads the renormalised
rest, which can keep fewer tokens; after top-p, min-p keeps exactly the nucleus's tokens that it keeps alone.
Greedy (temperature 0) takes the argmax after the bias and the penalties. Log-probabilities are reported from the
raw model distribution (`log_softmax` of the fp32 logits), as OpenAI and vLLM report them, whatever the sampler did;
before the bias too, as vLLM reads them.
"""
from __future__ import annotations

import math
import secrets
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from .constraint import TokenConstraint


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and how to choose each token. Neutral values switch a feature off."""

    max_tokens: int = 16  # 0 only runs the prompt (for its log-probabilities)
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_k: int = 0  # 0: every token
    min_p: float = 0.0  # drop tokens less likely than this times the most likely one; 0: none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # report each generated token's log-probability and this many alternatives
    prompt_logprobs: bool = False  # also report the prompt tokens' log-probabilities (with `logprobs` alternatives)
    min_tokens: int = 0  # EOS is never chosen, and stop strings are not looked for, before this many tokens
    ignore_eos: bool = False  # EOS is a token like any other: generation runs to max_tokens or a stop string
    constraint: TokenConstraint | None = None  # a grammar the tokens must follow (structured output); None: any
    # OpenAI's logit_bias: (token id, value) pairs, each value added to that token's logit before the penalties
    logit_bias: tuple[tuple[int, float], ...] = ()
    # the text continues the prompt's (a text completion): a SentencePiece word's space stays at its start, where
    # a reply of its own (a chat message) starts at its first word, as transformers decodes it
    continues_prompt: bool = False
    # llama.cpp's cache_prompt: the prompt may start from a kept cache that holds its start (head.prefix_cache);
    # False reads all of it, as a request alone would (the same positions computed the same way, run after run)
    cache_prompt: bool = True
    # tokens the reply is expected to repeat (chat's `prediction`): a greedy sequence guesses its next tokens from
    # them first (draft.py); they change no token, only how many one step makes
    draft_reference: tuple[int, ...] = ()
    # special tokens whose text the reply keeps, where decoding drops the others: markers its parser reads (a tool
    # call's "[TOOL_CALLS]" or "<tool_call>" where the tokenizer marks them special; tool_calls.marker_tokens)
    kept_tokens: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        """Raises ValueError for a value the sampler cannot use (the HTTP API refuses these before they get here).

        Plain checks, not asserts: `python -O` drops asserts, and NaN must fail too (hence `not x >= 0`).
        """
        problems = [
            (not self.max_tokens >= 0, f"max_tokens must be >= 0, got {self.max_tokens}"),
            (not 0 <= self.temperature < math.inf, f"temperature must be >= 0 and finite, got {self.temperature}"),
            (self.seed is not None and not -(1 << 63) <= self.seed < 1 << 63,
             f"seed must fit a signed 64-bit integer, got {self.seed}"),
            (not 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (not self.top_k >= 0, f"top_k must be >= 0 (0: every token), got {self.top_k}"),
            (not 0 <= self.min_p <= 1, f"min_p must be in [0, 1] (0: off), got {self.min_p}"),
            (not self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.logprobs is not None and not self.logprobs >= 0, f"logprobs must be >= 0, got {self.logprobs}"),
            (self.prompt_logprobs and self.logprobs is None,
             "prompt_logprobs needs logprobs (the number of alternatives to report, 0 for none)"),
            (not 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"),
            (any(not token >= 0 for token, _ in self.logit_bias), "logit_bias has a negative token id"),
            (len({token for token, _ in self.logit_bias}) != len(self.logit_bias),
             "logit_bias names a token more than once"),
            (not all(math.isfinite(value) for _, value in self.logit_bias),
             "logit_bias has a value that is not finite"),
        ]
        for failed, message in problems:
            if failed:
                raise ValueError(f"SamplingParams: {message}")

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass(frozen=True)
class TokenLogprob:
    """One position's report: the chosen token's log-probability and the most likely tokens there."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


class SeededRandom:
    """One request's uniform random numbers, from all 64 bits of its seed.

    torch's CPU generator (mt19937) keeps only the low 32 bits of a seed: seeded alone, seeds that differ only above
    them (-1 and 2**32 - 1, or 5 and 5 + 2**32) would draw the same numbers, and give the same text. So the low 32
    bits seed one generator and the high 32 bits a second, and each number is the sum of theirs modulo 1: uniform
    (as the sum modulo 1 of two independent uniform numbers is), and its own for each seed. A seed whose high bits
    are 0 has no second generator: it draws what torch's generator seeded with it draws."""

    def __init__(self, seed: int):
        bits = seed % 2**64  # a signed 64-bit seed as its two's complement
        self.low = torch.Generator().manual_seed(bits & 0xFFFFFFFF)
        self.high = torch.Generator().manual_seed(bits >> 32) if bits >> 32 else None

    def uniform(self) -> torch.Tensor:
        """The next number, uniform in [0, 1), as a float64 scalar."""
        point = torch.rand((), generator=self.low, dtype=torch.float64)
        if self.high is not None:
            point = (point + torch.rand((), generator=self.high, dtype=torch.float64)) % 1.0
        return point


def new_rng(seed: int | None) -> SeededRandom:
    """The random numbers of one request: from `seed` (a signed 64-bit integer), else from the OS."""
    return SeededRandom(seed if seed is not None else secrets.randbits(64))


class TokenHistory:
    """Which tokens a request has seen, for the penalties: counts of generated tokens, and every token seen."""

    def __init__(self, vocab_size: int, prompt_ids: list[int]):
        self.counts = torch.zeros(vocab_size)  # [V] times each token was generated
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # [V] in the prompt or generated
        self.seen[torch.tensor(prompt_ids, dtype=torch.long)] = True

    def add(self, token: int) -> None:
        self.counts[token] += 1
        self.seen[token] = True


PENALISED_LIMIT = 1e30  # how far from 0 an extreme repetition penalty takes a seen logit: well inside fp32's range
# Penalties in this range cannot take a logit of a real model (|logit| < 1e10) past PENALISED_LIMIT, so they are
# applied as they are, without looking at the logits first.
PLAIN_PENALTIES = (1e-20, 1e20)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's repetition penalty: seen tokens' positive logits divided by `penalty`, negative ones multiplied.

    A penalty near 0 (or a huge one) would take a seen logit past the largest float: inf, and then NaN in the
    sampler (inf - inf), which then draws a token that has nothing to do with the logits. So the divisor and
    the factor are held where the most extreme seen logit lands at PENALISED_LIMIT: the seen tokens keep their
    order among themselves and are still as far beyond the others as the penalty asks, each one finite."""
    if penalty == 1.0:
        return logits
    divisor = factor = penalty
    if not PLAIN_PENALTIES[0] <= penalty <= PLAIN_PENALTIES[1]:
        finite_seen = seen & torch.isfinite(logits)  # a token masked to -inf (grammar, banned) stays so
        largest = float(logits.masked_fill(~finite_seen, 0.0).max())
        smallest = float(logits.masked_fill(~finite_seen, 0.0).min())
        # neither under fp32's smallest normal number: there it is 0, and 0 / 0 and -inf * 0 are NaN
        tiny = torch.finfo(torch.float32).tiny
        divisor = max(penalty, largest / PENALISED_LIMIT, tiny)
        factor = max(min(penalty, PENALISED_LIMIT / -smallest) if smallest < 0 else penalty, tiny)
    penalised = torch.where(logits < 0, logits * factor, logits / divisor)
    return torch.where(seen, penalised, logits)


def apply_presence_frequency(logits: torch.Tensor, counts: torch.Tensor, presence: float,
                             frequency: float) -> torch.Tensor:
    """OpenAI's penalties: subtract `frequency` per earlier occurrence and `presence` once if any."""
    if not presence and not frequency:
        return logits
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence


def penalise(logits: torch.Tensor, history: TokenHistory | None, params: SamplingParams) -> torch.Tensor:
    if history is None:
        return logits
    logits = apply_repetition_penalty(logits, history.seen, params.repetition_penalty)
    return apply_presence_frequency(logits, history.counts, params.presence_penalty, params.frequency_penalty)


def apply_logit_bias(logits: torch.Tensor, bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """`logits` [vocab] with each (token, value) of `bias` added, in this thread's scratch buffer (valid until the
    next call here), never in `logits`: they may be a row that another choice of the same prompt reads too
    (Generator.start_choices). A logit masked to -inf stays -inf, so a bias never brings back a token a grammar or
    min_tokens ruled out."""
    if not bias:
        return logits
    tokens = torch.tensor([token for token, _ in bias], dtype=torch.long)
    values = torch.tensor([value for _, value in bias], dtype=logits.dtype)
    return _scratch.like("biased", logits).copy_(logits).index_add_(0, tokens, values)


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the `k` largest logits (all of them for k = 0 or k >= vocab); the rest become -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


NUCLEUS_CANDIDATES = 1024  # the most likely tokens a nucleus is looked for among first (a full sort is the fallback)


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of most likely tokens whose mass reaches `top_p` (at least one token): their probabilities
    (the rest of the candidates zeroed) and their token ids, most likely first.

    A full sort of a 152k vocabulary took 10-40 ms a token; the nucleus almost always lies within the top
    NUCLEUS_CANDIDATES, which `topk` finds in ~1 ms. Where the candidates' mass does not reach top_p, the full sort
    decides, so the set is the same either way."""
    k = min(NUCLEUS_CANDIDATES, probs.shape[-1])
    sorted_probs, order = torch.topk(probs, k)  # most likely first
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    if k < probs.shape[-1] and cumulative[-1] < top_p:  # the nucleus reaches past the candidates
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
    drop = cumulative - sorted_probs >= top_p  # the mass before this token already reached top_p
    drop[..., 0] = False  # a top_p below fp32's smallest number compares as 0, which would drop even this one
    return sorted_probs.masked_fill(drop, 0.0), order


def filter_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches `top_p` (at least one token)."""
    if top_p >= 1.0:
        return probs
    kept, order = nucleus(probs, top_p)
    return torch.zeros_like(probs).scatter(-1, order, kept)


def below_min_p(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Which tokens min-p drops (bool, like `probs`, in this thread's scratch buffer: valid until the next call
    here): those less likely than `min_p` times the most likely one, as transformers' MinPLogitsWarper and vLLM drop.

    The most likely token is never among them, so at least one is always kept (what MinPLogitsWarper's
    min_tokens_to_keep=1 ensures): with min_p <= 1 the threshold is a product of its probability and a factor of at
    most 1, which rounds to at most that probability. Where probs is the nucleus (the rest zeroed) the threshold is
    the same fraction of the same token's probability as over the renormalised nucleus transformers reads."""
    threshold = probs.max() * min_p
    return torch.lt(probs, threshold, out=_scratch.like("below_min_p", probs, torch.bool))


def filter_min_p(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Zero the tokens less likely than `min_p` times the most likely one (none for min_p = 0)."""
    if min_p <= 0:
        return probs
    return probs.masked_fill(below_min_p(probs, min_p), 0.0)


class _Scratch(threading.local):
    """Vocabulary-sized buffers for sampling, kept per thread and reused for every token.

    A fresh 0.6-1.2 MB tensor per operation is memory that glibc maps and unmaps each time (it serves allocations
    that large with mmap), and the page faults made a sampled token cost ~1.9 ms instead of ~0.4 ms on a 152k
    vocabulary; the head samples every sequence of every step on one thread. Each buffer is only written and read
    within one call, so reuse changes no result."""

    def __init__(self) -> None:
        self.tensors: dict[tuple, torch.Tensor] = {}

    def like(self, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = tensor.dtype if dtype is None else dtype
        key = (name, dtype, tensor.device, tuple(tensor.shape))
        buffer = self.tensors.get(key)
        if buffer is None:
            buffer = self.tensors[key] = torch.empty(tensor.shape, dtype=dtype, device=tensor.device)
        return buffer


_scratch = _Scratch()


def draw(weights: torch.Tensor, generator: SeededRandom | torch.Generator | None) -> int:
    """An index drawn with probability proportional to `weights` (>= 0, not all 0).

    The inverse of the cumulative distribution at one uniform number: one random number and one pass in float64.
    (torch.multinomial took 10-25 ms over a 152k vocabulary.) A zero weight is never drawn: its cumulative value
    equals the one before it, and the search takes the first that exceeds the number."""
    cumulative = torch.cumsum(weights, dim=-1, dtype=torch.float64, out=_scratch.like("cumulative", weights,
                                                                                   torch.float64))
    uniform = generator.uniform() if isinstance(generator, SeededRandom) else \
        torch.rand((), generator=generator, dtype=torch.float64)
    point = uniform * cumulative[-1]
    index = int(torch.searchsorted(cumulative, point, right=True))
    if index >= weights.shape[-1]:  # rounding put the point on the total: the last token that has any weight
        index = int(torch.nonzero(weights).max())
    return index


def greedy(logits: torch.Tensor) -> int:
    """The index of the largest of `logits` [vocab] (the first of equal ones; a NaN counts as largest, as in torch).

    On the CPU by numpy, whose argmax is vectorised where PyTorch's is not: over a 152k vocabulary 14 us against
    150 us, per sequence and token."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 1:
        return int(logits.numpy().argmax())
    return int(torch.argmax(logits))


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: SeededRandom | torch.Generator | None,
           top_k: int = 0, min_p: float = 0.0) -> int:
    """The next token id for fp32 `logits` [vocab] (already penalised). Greedy at temperature 0, whatever top_p
    and min_p say."""
    # a temperature below the logits' dtype's smallest number is 0 there; greedy is what it tends to anyway
    if temperature == 0 or logits.new_tensor(temperature) == 0:
        return greedy(logits)
    logits = filter_top_k(logits, top_k)
    # shifted so the largest is 0 before dividing: a tiny temperature then gives -inf for the rest, never inf - inf
    shifted = torch.sub(logits, logits.max(), out=_scratch.like("shifted", logits)).div_(temperature)
    probs = torch.softmax(shifted, dim=-1, out=_scratch.like("probs", logits))
    if top_p >= 1.0:
        if min_p > 0:  # in place: probs is this call's own scratch buffer
            probs.masked_fill_(below_min_p(probs, min_p), 0.0)
        return draw(probs, generator)
    kept, order = nucleus(probs, top_p)
    if min_p > 0:  # after top-p, as transformers orders them
        kept.masked_fill_(below_min_p(kept, min_p), 0.0)
    return int(order[draw(kept, generator)])


def choose(logits: torch.Tensor, params: SamplingParams, history: TokenHistory | None,
           rng: SeededRandom | torch.Generator, banned: Sequence[int] = (), allowed: torch.Tensor | None = None
           ) -> int:
    """The next token for raw fp32 `logits` [vocab] under `params`: one of `allowed` (bool [vocab]) if given,
    never one of `banned`."""
    if allowed is not None:  # before everything else: penalties and top-k/top-p/min-p then see only valid tokens
        logits = logits.masked_fill(~allowed, float("-inf"))
    if banned:
        logits = logits.index_fill(0, torch.tensor(list(banned), dtype=torch.long), float("-inf"))
    logits = apply_logit_bias(logits, params.logit_bias)  # after the masks and before the penalties, as in vLLM
    return sample(penalise(logits, history, params), params.temperature, params.top_p, rng, params.top_k,
                  params.min_p)


def token_logprob(logits: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    """`token`'s log-probability under raw `logits` [vocab], with the `top_n` most likely tokens."""
    logits = logits.float()
    return _report(torch.log_softmax(logits, dim=-1, out=_scratch.like("logprobs", logits)), token, top_n)


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """For logits [L, vocab] at positions 0..L-1, the log-probability of each next token next_ids[0..L-1]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [L, V]
    return [_report(row, token, top_n) for row, token in zip(logprobs, next_ids)]


def _report(logprobs: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        values, ids = torch.topk(logprobs, min(top_n, logprobs.shape[-1]))
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(float(logprobs[token]), top)
