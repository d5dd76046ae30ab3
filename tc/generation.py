"""The generation loop (docs/design.md, "Making a token"): embed, run the pipeline, sample, repeat.

The same loop serves the single-process generator and the head: only the `Pipeline` differs (layers in this
process, or layers on workers across the network). `Generator.stream` is the loop itself, one `Step` per
pipeline call; `Generator.generate` drains it, so streamed and whole replies can never differ.

Text leaves the loop only when it is final. A byte-level token can end inside a multi-byte character, so the
`IncrementalDecoder` holds bytes back until the character completes; and text that could still turn out to be
the start of a stop string is held back until the next tokens settle it (`held_back`). When the loop ends, what
is held is either released (EOS, length) or cut at the stop string.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

import torch

from .model.qwen2 import HeadModel
from .model.tokenizer import TextTokenizer
from .sampling import (SamplingParams, TokenHistory, TokenLogprob, choose, new_rng, prompt_logprobs,
                       token_logprob)

PROMPT_LOGITS_CHUNK = 128  # prompt positions turned into logits at once: [128, vocab] fp32 stays small


class Pipeline(Protocol):
    """Every decoder layer of the model, in order, wherever they run."""

    def prefill(self, hidden: torch.Tensor, capacity: int) -> torch.Tensor:
        """Start a request: run positions [0, L) and keep a cache for `capacity` positions."""

    def decode(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """Run one more position through the request's caches."""


class LocalPipeline:
    """All stages in this process, each computing in its own dtype."""

    def __init__(self, stages: list, device: torch.device | str = "cpu"):
        self.stages, self.device = stages, device
        self.caches: list = []

    def _run(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        out_dtype = hidden.dtype
        for stage, cache in zip(self.stages, self.caches):
            hidden = stage(hidden.to(cache.keys.device, cache.keys.dtype), cache, position)
        return hidden.to("cpu", out_dtype)  # the head works on the CPU

    def prefill(self, hidden: torch.Tensor, capacity: int) -> torch.Tensor:
        self.caches = [s.new_cache(capacity, next(s.parameters()).dtype, self.device) for s in self.stages]
        return self._run(hidden, 0)

    def decode(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        return self._run(hidden, position)


class IncrementalDecoder:
    """Turns a growing list of token ids into text pieces that never split a multi-byte character.

    A byte-level BPE token can end mid-character; the decoded tail then ends in U+FFFD, so we hold text back
    until the character completes.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids before this are only context for decoding
        self.read_offset = 0  # ids before this have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    @property
    def caught_up(self) -> bool:
        """Every id pushed so far is in the text emitted."""
        return self.read_offset == len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """What is held back, as it decodes now (a broken character included): for text that ends here."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]


def find_stop(text: str, stops: Sequence[str], search_from: int) -> int | None:
    """Index of the earliest stop string in `text` that starts at or after `search_from`."""
    hits = [i for i in (text.find(s, max(search_from, 0)) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of a stop string: it may yet become one."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop[k - 1] == text[-1] and text.endswith(stop[:k]):
                longest = k
                break
    return longest


@dataclass(frozen=True)
class TokenInfo:
    """One token of a prompt or a completion."""

    id: int
    offset: int  # where its text starts in the text (of the completion before any stop-string cut, or prompt)
    logprob: TokenLogprob | None  # None when not asked for (and for a prompt's first token, which has none)


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]  # every generated token but EOS, those that spelled a stop string included
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    time_to_first_token_s: float
    decode_s: float  # time for the tokens after the first
    tokens: tuple[TokenInfo, ...] = ()  # token_ids with their text offsets and log-probabilities
    prompt: tuple[TokenInfo, ...] = ()  # the prompt's tokens, only when SamplingParams.prompt_logprobs

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.completion_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class Step:
    """What one pipeline call added: final text and the tokens now wholly shown. The last step has `completion`.

    Joining every step's `text` gives the completion's text; joining their `tokens` gives its tokens.
    """

    text: str
    tokens: tuple[TokenInfo, ...]
    completion: Completion | None = None
    prompt: tuple[TokenInfo, ...] = ()  # on the first step only, when SamplingParams.prompt_logprobs


def text_with_offsets(tokenizer: TextTokenizer, ids: Sequence[int]) -> tuple[str, list[int]]:
    """The text of `ids` (special tokens written out, as a prompt holds them) and where each token starts."""
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=False)
    text, offsets = "", []
    for token in ids:
        offsets.append(len(text))
        text += decoder.push(token)
    return text + decoder.flush(), offsets


class CompletionText:
    """A completion's text as its tokens arrive, and how much of it (and which tokens) can be shown yet.

    `push` each sampled token; `release` after each step gives what is final; `finish` at the end gives the
    final text and whatever was still held.
    """

    def __init__(self, tokenizer: TextTokenizer, stops: tuple[str, ...]):
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = stops
        self.text = ""  # every complete character decoded so far
        self.shown = 0  # text[:shown] has left the loop
        self.tokens: list[TokenInfo] = []
        self.unsettled: list[TokenInfo] = []  # their text is not complete yet
        self.settled: list[tuple[TokenInfo, int]] = []  # (token, end of its text), not yet shown
        self.stop_at: int | None = None

    def push(self, token: int, logprob: TokenLogprob | None, look_for_stops: bool = True) -> None:
        """Add a sampled token; with `look_for_stops` False (before min_tokens) a stop string does not end it."""
        info = TokenInfo(token, len(self.text), logprob)
        self.tokens.append(info)
        self.unsettled.append(info)
        self.text += self.decoder.push(token)
        if self.decoder.caught_up:
            self.settled.extend((t, len(self.text)) for t in self.unsettled)
            self.unsettled.clear()
        if self.stops and look_for_stops:
            self.stop_at = find_stop(self.text, self.stops, self.shown)

    def release(self) -> Step:
        """The text and tokens that can be shown now; nothing that a stop string or a character may still need."""
        safe = len(self.text) - held_back(self.text, self.stops)
        delta, self.shown = self.text[self.shown:safe], max(self.shown, safe)
        count = 0
        while count < len(self.settled) and self.settled[count][1] <= self.shown:
            count += 1
        released = tuple(t for t, _ in self.settled[:count])
        del self.settled[:count]
        return Step(delta, released)

    def finish(self) -> tuple[str, str, tuple[TokenInfo, ...]]:
        """(final text, what of it is not shown yet, the tokens not shown yet) once generation ends."""
        final = self.text if self.stop_at is None else self.text[:self.stop_at]
        rest = tuple(t for t, _ in self.settled) + tuple(self.unsettled)
        return final, final[self.shown:], rest


class Generator:
    def __init__(self, head: HeadModel, tokenizer: TextTokenizer, pipeline: Pipeline, dtype: torch.dtype):
        self.head, self.tokenizer, self.pipeline, self.dtype = head, tokenizer, pipeline, dtype
        self.context_length = head.config.max_position_embeddings

    def _next_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.logits(hidden[:, -1:].to(self.dtype))[0, -1]  # [vocab]

    def _prompt_infos(self, prompt_ids: list[int], hidden: torch.Tensor, top_n: int) -> tuple[TokenInfo, ...]:
        """Each prompt token's log-probability given the tokens before it (none for the first)."""
        _, offsets = text_with_offsets(self.tokenizer, prompt_ids)
        reports: list[TokenLogprob] = []
        for start in range(0, len(prompt_ids) - 1, PROMPT_LOGITS_CHUNK):
            end = min(start + PROMPT_LOGITS_CHUNK, len(prompt_ids) - 1)
            logits = self.head.logits(hidden[:, start:end].to(self.dtype))[0]  # [end - start, vocab]
            reports += prompt_logprobs(logits, prompt_ids[start + 1:end + 1], top_n)
        return tuple(TokenInfo(t, o, r) for t, o, r in zip(prompt_ids, offsets, [None, *reports]))

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[Step]:
        """Generate a completion for `prompt_ids`, one `Step` per pipeline call, the last carrying the Completion.

        Raises ValueError if the prompt is empty or leaves no room; the pipeline's errors pass through. Closing
        the iterator early abandons the request; the next one starts with a prefill, so nothing is left behind.
        """
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        room = self.context_length - len(prompt_ids)
        if room < 1:
            raise ValueError(f"the prompt is {len(prompt_ids)} tokens; the context holds {self.context_length}")
        max_tokens = min(params.max_tokens, room)
        rng = new_rng(params.seed)
        started = time.perf_counter()
        hidden = self.pipeline.prefill(self.head.embed(torch.tensor([prompt_ids])),
                                       capacity=len(prompt_ids) + max_tokens)
        prompt_infos = (self._prompt_infos(prompt_ids, hidden, params.logprobs or 0) if params.prompt_logprobs
                        else ())
        unsent_prompt = prompt_infos  # the first step carries it
        logits = self._next_logits(hidden)
        history = TokenHistory(logits.shape[-1], prompt_ids) if params.penalised else None
        state = CompletionText(self.tokenizer, params.stop)
        first_token_at = time.perf_counter()
        finish = "length"
        eos = self.tokenizer.eos_token_ids
        grammar = params.constraint.start() if params.constraint is not None else None
        while len(state.tokens) < max_tokens:
            early = len(state.tokens) < params.min_tokens  # EOS may not end the completion yet
            token = choose(logits, params, history, rng, banned=eos if early and not params.ignore_eos else (),
                           allowed=grammar.allowed() if grammar is not None else None)
            if grammar is not None:
                grammar.advance(token)
            if not state.tokens:
                first_token_at = time.perf_counter()
            if token in eos and not params.ignore_eos:
                finish = "stop"
                break
            report = token_logprob(logits, token, params.logprobs) if params.logprobs is not None else None
            state.push(token, report, look_for_stops=len(state.tokens) + 1 >= params.min_tokens)
            if history is not None:
                history.add(token)
            if state.stop_at is not None:
                finish = "stop"
                break
            if len(state.tokens) == max_tokens:
                break
            yield dataclasses.replace(state.release(), prompt=unsent_prompt)
            unsent_prompt = ()
            position = len(prompt_ids) + len(state.tokens) - 1
            hidden = self.pipeline.decode(self.head.embed(torch.tensor([[token]])), position)
            logits = self._next_logits(hidden)
        done = time.perf_counter()
        text, rest_text, rest_tokens = state.finish()
        completion = Completion(tuple(t.id for t in state.tokens), text, finish, len(prompt_ids),
                                first_token_at - started, done - first_token_at, tuple(state.tokens), prompt_infos)
        yield Step(rest_text, rest_tokens, completion, unsent_prompt)

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 on_text: Callable[[str], None] | None = None) -> Completion:
        """Generate a whole completion for `prompt_ids` (see `stream`); `on_text` sees the text as it is final."""
        for step in self.stream(prompt_ids, params):
            if on_text is not None and step.text:
                on_text(step.text)
            if step.completion is not None:
                return step.completion
        raise AssertionError("Generator.stream ended without a completion")
