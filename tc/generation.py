"""The generation loop (docs/design.md, "Making a token"): embed, run the pipeline, sample, repeat.

The same loop serves the single-process generator and the head: only the `Pipeline` differs (layers in this
process, or layers on workers across the network).

Each request is a `SequenceState`: its prompt, its sampling state (seed, penalties, grammar) and its text so far.
`Generator.step` runs one pipeline call for a batch of them: every decoding sequence contributes its last token
(a greedy one, with the tokens it guesses follow it: draft.py), sequences still reading their prompt contribute the
next chunk of it, and the rows go through the pipeline as one ragged batch (each weight read once for all of them).
Each sequence that reached a new token then chooses it from its own logits, with its own state, so a request's
output never depends on what runs beside it (up to the roundings of products over other rows: docs/design.md). The
head's scheduler (head/service.py) calls `step` for the sequences it holds; `Generator.stream` calls it for one, so
streamed and whole replies, alone or batched, come from the same code.

Text leaves the loop only when it is final. A byte-level token can end inside a multi-byte character, so the
`IncrementalDecoder` holds bytes back until the character completes; and text that could still turn out to be
the start of a stop string is held back until the next tokens settle it (`held_back`). When the loop ends, what
is held is either released (EOS, length) or cut at the stop string.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from .draft import STEP_ROWS, DraftLookup
from .model.kv_cache import KVCache
from .model.qwen2 import HeadModel, Span
from .model.tokenizer import TextTokenizer
from .sampling import (SamplingParams, TokenHistory, TokenLogprob, choose, greedy, new_rng, prompt_logprobs,
                       token_logprob)
from .trace import mark

log = logging.getLogger(__name__)

PROMPT_LOGITS_CHUNK = 128  # prompt positions turned into logits at once: [128, vocab] fp32 stays small
CHARACTER_TOKENS = 4  # the most tokens one character's bytes span (UTF-8's longest)


@dataclass(frozen=True)
class Entry:
    """One sequence's rows in a pipeline step: positions [start, start + length) of `sequence`.

    An entry at start 0 begins the sequence: every stage makes it a fresh cache of `capacity` positions (its prompt
    plus its max_tokens). Later entries continue from exactly where the cache ends, growing it to `capacity` where
    that is more (a cache taken up by a request that continues the text it holds). An entry naming a `source`
    starts from the first `start` positions of that sequence's cache instead: its own, cut back to them (a cache
    taken up by a request whose prompt shares only its start), or another's, copied (which keeps its own). After
    its rows run, every stage copies the sequence's cache into a new one for each id in `copies` (the other
    choices of a request whose prompt was read once), which then continue as sequences of their own.
    """

    sequence: int
    start: int
    length: int
    capacity: int
    copies: tuple[int, ...] = ()
    source: int | None = None


class Pipeline(Protocol):
    """Every decoder layer of the model, in order, wherever they run, with a KV cache per sequence."""

    def run(self, entries: Sequence[Entry], hidden: torch.Tensor) -> torch.Tensor:
        """Run the entries' rows, [1, sum of lengths, hidden] one entry after another, through every layer."""

    def release(self, sequences: Sequence[int]) -> None:
        """Drop these sequences' caches (unknown ones are ignored)."""

    def holds(self, sequence: int) -> bool:
        """Whether every stage still holds this sequence's cache (to be continued by a later entry)."""

    # A pipeline may also have `max_positions`: the most positions one run may carry (a remote one's frames are
    # bounded), past which Generator.step reads prompts over several steps. None, or no such attribute: any.


class LocalPipeline:
    """All stages in this process, each computing in its own dtype."""

    def __init__(self, stages: list, device: torch.device | str = "cpu"):
        self.stages, self.device = stages, device
        self.caches: dict[int, list[KVCache]] = {}  # sequence -> its cache on each stage

    def run(self, entries: Sequence[Entry], hidden: torch.Tensor) -> torch.Tensor:
        for entry in entries:
            if entry.source is not None:
                if entry.source not in self.caches:
                    raise ValueError(f"sequence {entry.sequence} starts from sequence {entry.source}'s cache, "
                                     "which is not held")
                held = self.caches[entry.source]
                self.caches[entry.sequence] = [
                    cache.cut(entry.start, entry.capacity) if entry.source == entry.sequence
                    else cache.copy(entry.capacity, entry.start) for cache in held]
            elif entry.start == 0:
                self.caches[entry.sequence] = [s.new_cache(entry.capacity, next(s.parameters()).dtype, self.device)
                                               for s in self.stages]
            elif entry.sequence not in self.caches:
                raise ValueError(f"sequence {entry.sequence} continues at position {entry.start} but has no cache")
            elif entry.capacity > self.caches[entry.sequence][0].capacity:
                self.caches[entry.sequence] = [cache.copy(entry.capacity) for cache in self.caches[entry.sequence]]
        out_dtype = hidden.dtype
        for i, stage in enumerate(self.stages):
            spans = [Span(self.caches[e.sequence][i], e.start, e.length) for e in entries]
            cache = spans[0].cache
            hidden = stage.forward_batch(hidden.to(cache.keys.device, cache.keys.dtype), spans)
        for entry in entries:
            for copy in entry.copies:
                self.caches[copy] = [cache.copy() for cache in self.caches[entry.sequence]]
        return hidden.to("cpu", out_dtype)  # the head works on the CPU

    def release(self, sequences: Sequence[int]) -> None:
        for sequence in sequences:
            self.caches.pop(sequence, None)

    def holds(self, sequence: int) -> bool:
        return sequence in self.caches

    # One sequence at a time, for tools and tests that drive the layers directly.
    def prefill(self, hidden: torch.Tensor, capacity: int) -> torch.Tensor:
        self.caches.clear()
        return self.run([Entry(0, 0, hidden.shape[1], capacity)], hidden)

    def decode(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        return self.run([Entry(0, position, hidden.shape[1], self.caches[0][0].capacity)], hidden)


class IncrementalDecoder:
    """Turns a growing list of token ids into text pieces that never split a multi-byte character.

    A byte-level BPE token can end mid-character; the decoded tail then ends in U+FFFD, so we hold text back
    until the character completes. `context` are tokens the text comes after (a prompt's last ones), read only as
    context: a SentencePiece decoder (Llama 2's, Mistral's) drops the space a text starts with, which the first
    token's word keeps when it continues a text. `kept`: special tokens whose text stays all the same
    (TextTokenizer.decode).
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True, context: Sequence[int] = (),
                 kept: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.skip_special_tokens, self.kept = skip_special_tokens, kept
        self.ids: list[int] = list(context)
        self.prefix_offset = 0  # ids before this are only context for decoding
        self.read_offset = len(self.ids)  # ids before this have been emitted as text (or are the context)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens, kept=self.kept)

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
        # A character cut short is in the last CHARACTER_TOKENS tokens (it has at most 4 bytes, a token at least
        # one). Held ids past those end in U+FFFD of the text itself (the character, or bytes that never make one,
        # as mojibake holds them): held for ever, every token would decode them all again (an echoed prompt of 30k
        # of them took the head a minute). Those before the last tokens go out where the text splits cleanly around
        # them: what went out, they and the last tokens each read on their own as they read together.
        # (SentencePiece's byte fallback reads a run of bytes broken anywhere as U+FFFD for each, the whole
        # characters before included, and drops the space a text starts with: a split that changes what the
        # text reads is not taken; the bytes after one read on their own, their whole characters as such.)
        cut = len(self.ids) - CHARACTER_TOKENS
        if cut > self.read_offset:
            settled = self._decode(self.ids[self.read_offset:cut])
            if settled and full == prefix + settled + self._decode(self.ids[cut:]):
                self.prefix_offset, self.read_offset = self.read_offset, cut
                return settled
        return ""

    def flush(self) -> str:
        """What is held back, as it decodes now (a broken character included): for text that ends here."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        held = self.ids[self.read_offset:]
        self.prefix_offset = self.read_offset = len(self.ids)
        if full.startswith(prefix):
            return full[len(prefix):]
        # SentencePiece's byte fallback decodes a run of byte tokens as a whole, and a run that ends broken as
        # U+FFFD for every byte, the whole characters before included ("日" + E6 9C: five). Those characters
        # are out already, so the held bytes read on their own.
        return self._decode(held)


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
    # The end-of-sequence token that ended it, at the text's end: not in token_ids, the text or the counts, but
    # chosen like any other, so it has a log-probability (with SamplingParams.logprobs). None: it ended otherwise.
    end: TokenInfo | None = None
    cached_prompt_tokens: int = 0  # prompt tokens a finished request's cache held, so not read again

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


_FAILED = object()  # what _guarded returns for a call that raised


def _guarded(failed: dict[int, Exception], sequence: "SequenceState", call: Callable[[], Any]) -> Any:
    """call() for `sequence`'s own part of a step; an Exception it raises is logged and kept in failed[its id]
    (the first one: a sequence whose mask failed is not read further), and _FAILED is returned."""
    try:
        return call()
    except Exception as exc:
        log.exception("sequence %d failed in its part of a step; the others in the step go on", sequence.id)
        failed.setdefault(sequence.id, exc)
        return _FAILED


def joined(steps: Sequence[Step]) -> Step:
    """Steps made one after another as one: their text and tokens in order, the first's prompt, the last's
    completion."""
    if len(steps) == 1:
        return steps[0]
    return Step("".join(s.text for s in steps), tuple(t for s in steps for t in s.tokens), steps[-1].completion,
                steps[0].prompt)


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

    def __init__(self, tokenizer: TextTokenizer, stops: tuple[str, ...], context: Sequence[int] = (),
                 kept: frozenset[int] = frozenset()):
        self.decoder = IncrementalDecoder(tokenizer, context=context, kept=kept)
        self.stops = stops
        self.text = ""  # every complete character decoded so far
        self.shown = 0  # text[:shown] has left the loop
        self.tokens: list[TokenInfo] = []
        self.unsettled: list[TokenInfo] = []  # their text is not complete yet
        self.settled: list[tuple[TokenInfo, int]] = []  # (token, end of its text), not yet shown
        self.stop_at: int | None = None
        self.stops_count = False  # whether a stop string ends the completion yet (min_tokens)

    def push(self, token: int, logprob: TokenLogprob | None, look_for_stops: bool = True) -> None:
        """Add a sampled token; with `look_for_stops` False (before min_tokens) a stop string does not end it."""
        info = TokenInfo(token, len(self.text), logprob)
        self.tokens.append(info)
        self.unsettled.append(info)
        self.text += self.decoder.push(token)
        if self.decoder.caught_up:
            self.settled.extend((t, len(self.text)) for t in self.unsettled)
            self.unsettled.clear()
        self.stops_count = look_for_stops
        if self.stops and look_for_stops:
            self.stop_at = find_stop(self.text, self.stops, self.shown)

    def release(self) -> Step:
        """The text and tokens that can be shown now; nothing that a stop string or a character may still need."""
        # Only the text not shown yet can start a stop string: what went out started none when it went, and
        # find_stop looks from `shown` on. Looking at every end of the whole text, as long as a stop string, cost
        # each token time in the text's length: 32 stop strings of 30k characters, 30 ms a token at 16k.
        safe = len(self.text) - held_back(self.text[self.shown:], self.stops)
        delta, self.shown = self.text[self.shown:safe], max(self.shown, safe)
        count = 0
        while count < len(self.settled) and self.settled[count][1] <= self.shown:
            count += 1
        released = tuple(t for t, _ in self.settled[:count])
        del self.settled[:count]
        return Step(delta, released)

    def finish(self) -> tuple[str, str, tuple[TokenInfo, ...]]:
        """(final text, what of it is not shown yet, the tokens not shown yet) once generation ends; `stop_at` is
        set if the text is cut at a stop string."""
        if self.stop_at is None:
            # The last tokens may end inside a character (max_tokens, or EOS, struck mid-character): their bytes
            # are part of the text all the same, and decode as the tokenizer decodes the whole completion (a
            # broken character as U+FFFD). After a stop string they are cut with the rest.
            self.text += self.decoder.flush()
            if self.stops and self.stops_count:  # what they held back ("Hi" + " \xf0\x9f") may spell one
                self.stop_at = find_stop(self.text, self.stops, self.shown)
        final = self.text if self.stop_at is None else self.text[:self.stop_at]
        rest = tuple(t for t, _ in self.settled) + tuple(self.unsettled)
        return final, final[self.shown:], rest


TEXT_CONTEXT_TOKENS = 4  # prompt tokens a completion's text is decoded after, when it continues the prompt


def _text_context(tokenizer: TextTokenizer, prompt_ids: Sequence[int]) -> Sequence[int]:
    """The prompt's last tokens, to decode a completion's text after; none when they end inside a character (its
    rest, in the completion, would read as a change to their text rather than text of its own)."""
    context = prompt_ids[-TEXT_CONTEXT_TOKENS:]
    return () if tokenizer.decode(context).endswith("\ufffd") else context


class SequenceState:
    """One request in the loop: its prompt, where it stands, its own sampling state and its text so far.

    A sequence reads its prompt (one or more entries), then decodes one position per step (a greedy one, its
    guesses too: plan_draft, check_draft). `advance` takes the logits of its newest position, chooses a token with
    the request's own parameters and generator, and returns the `Step` it adds; the last one carries the
    Completion.
    """

    def __init__(self, sequence_id: int, prompt_ids: list[int], params: SamplingParams, tokenizer: TextTokenizer,
                 context_length: int):
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        room = context_length - len(prompt_ids)
        if room < (1 if params.max_tokens else 0):  # a prompt only scored (max_tokens 0) may fill the context
            raise ValueError(f"the prompt is {len(prompt_ids)} tokens; the context holds {context_length}")
        self.id, self.prompt_ids, self.params, self.tokenizer = sequence_id, list(prompt_ids), params, tokenizer
        self.max_tokens = min(params.max_tokens, room)
        self.capacity = len(prompt_ids) + self.max_tokens
        self.rng = new_rng(params.seed)
        self.history: TokenHistory | None = None  # made with the first logits, which give the vocabulary's size
        context = _text_context(tokenizer, prompt_ids) if params.continues_prompt else ()
        # special tokens a stop string names: their text is kept to be found, and, as EOS, they are never chosen
        # before min_tokens (nor would their text be cut there)
        self.stop_ids = stop_tokens(tokenizer, params.stop)
        self.text = CompletionText(tokenizer, params.stop, context, params.kept_tokens | self.stop_ids)
        self.grammar = params.constraint.start() if params.constraint is not None else None
        self.prefilled = 0  # prompt positions through the pipeline
        self.cached = 0  # of those, how many a finished request's cache held already (take_cache, copy_cache)
        # The sequence whose cache the first entry starts from (its own, cut back, or another's, copied); None once
        # that entry is made, or when it starts a fresh cache or continues its own as it is
        self.source: int | None = None
        # A sequence in the batch that reads the same prompt start: this one copies its cache once it has read the
        # `cached` positions this one shares (copy_cache's `after`); None once copied, or when it copies none
        self.after: SequenceState | None = None
        self.fed: list[int] = []  # the tokens decode steps fed in: with the prompt read, what its cache holds
        self.next_token: int | None = None  # the token the next decode step feeds in
        # Tokens guessed to follow next_token, fed in with it (draft.py); [] for a step of one row. `lookup` is made
        # for a sequence that chooses the argmax, at its first decode step (plan_draft).
        self.draft: list[int] = []
        self.lookup: DraftLookup | None = None
        self.prompt_reports: list[TokenLogprob] = []
        self.unsent_prompt: tuple[TokenInfo, ...] = ()  # the prompt's tokens, for the first step to carry
        self.prompt_infos: tuple[TokenInfo, ...] = ()
        self.next_allowed: torch.Tensor | None = None  # the grammar's mask for the next choice, if made ahead
        # Another choice of the same request, whose prompt this one shares: it reads the prompt for both, and this
        # one starts from a copy of its cache (Generator.step). None: this sequence reads its own prompt.
        self.leader: SequenceState | None = None
        self.started: float | None = None  # when its first entry ran
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.completion: Completion | None = None

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt_ids)

    @property
    def position(self) -> int:
        """The next position to run: the prompt's next, or the position of the token chosen last."""
        return self.prefilled if not self.decoding else len(self.prompt_ids) + len(self.text.tokens) - 1

    def entry(self, prompt_budget: int) -> tuple[Entry, list[int]]:
        """This step's entry and the token ids it feeds in: the last token, or up to `prompt_budget` of the prompt."""
        if self.started is None:
            self.started = time.perf_counter()
        if self.decoding:
            assert self.next_token is not None
            start = self.position
            # a step whose draft was refused in part wrote positions past this one: the entry cuts them off
            source = self.id if self.prefilled + len(self.fed) > start else None
            del self.fed[start - self.prefilled:]
            ids = [self.next_token, *self.draft]
            self.fed += ids
            return Entry(self.id, start, len(ids), self.capacity, source=source), ids
        ids = self.prompt_ids[self.prefilled:self.prefilled + prompt_budget]
        entry = Entry(self.id, self.prefilled, len(ids), self.capacity, source=self.pending_source)
        self.source = self.after = None
        return entry, ids

    def read_prompt(self, entry: Entry, hidden: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor]
                    ) -> None:
        """Note a prompt entry's rows ([1, L, hidden] out of the pipeline): logprobs of the prompt's tokens if
        asked for (each row predicts the token after it), and how far the prompt has been read."""
        end = entry.start + entry.length
        if self.params.prompt_logprobs:
            predicted = min(end, len(self.prompt_ids) - 1) - entry.start  # the last prompt row predicts no prompt token
            for i in range(0, predicted, PROMPT_LOGITS_CHUNK):
                j = min(i + PROMPT_LOGITS_CHUNK, predicted)
                targets = self.prompt_ids[entry.start + i + 1:entry.start + j + 1]
                self.prompt_reports += prompt_logprobs(logits_of(hidden[:, i:j])[0], targets, self.params.logprobs or 0)
        self.prefilled = end
        if self.decoding and self.params.prompt_logprobs:
            _, offsets = text_with_offsets(self.tokenizer, self.prompt_ids)
            self.prompt_infos = tuple(TokenInfo(t, o, r) for t, o, r in
                                      zip(self.prompt_ids, offsets, [None, *self.prompt_reports]))
            self.unsent_prompt = self.prompt_infos

    def plan_draft(self, most: int) -> int:
        """Guess up to `most` tokens to follow next_token, fed in with it by the next entry (a sequence that chooses
        the argmax, with tokens left to make); returns how many."""
        self.draft = []
        left = self.max_tokens - len(self.text.tokens) - 1  # tokens to make after those the step's first row makes
        if most <= 0 or left <= 0 or not self.chooses_the_argmax:
            return 0
        if self.lookup is None:
            self.lookup = DraftLookup(self.params.draft_reference)
            self.lookup.extend(self.prompt_ids)
        self.lookup.extend(t.id for t in self.text.tokens[len(self.lookup.text) - len(self.prompt_ids):])
        self.draft = self.lookup.draft(min(most, left))
        return len(self.draft)

    def check_draft(self, chosen: Sequence[int]) -> tuple[Step, int]:
        """Take the argmax of each of the last entry's rows (`chosen`, one per row: after next_token and after each
        draft token): the first, then each next one while the draft token before it was the argmax there; returns
        what they add, as one Step, and how many draft tokens it took as its tokens."""
        draft, self.draft = self.draft, []
        accepted = 0
        while accepted < len(draft) and draft[accepted] == chosen[accepted]:
            accepted += 1
        if self.lookup is not None:
            self.lookup.taken(len(draft), accepted)
        steps = []
        for token in chosen[:accepted + 1]:
            steps.append(self.add_token(token))
            if steps[-1].completion is not None:  # EOS, a stop string: the guesses after it made no token
                break
        return joined(steps), len(steps) - 1

    def cache_ids(self) -> list[int]:
        """The tokens whose positions this sequence's cache holds for its text, once its last step has run: where
        that step's draft was refused in part, the positions of the refused guesses follow them in the cache (an
        entry that continues it cuts them off: take_cache's `cut`)."""
        tokens = self.text.tokens
        kept = 0
        while kept < len(self.fed) and kept < len(tokens) and self.fed[kept] == tokens[kept].id:
            kept += 1
        return self.prompt_ids[:self.prefilled] + self.fed[:kept]

    def take_cache(self, sequence: int, held: int, cut: bool = False) -> None:
        """Continue the cache of `sequence`, a finished one whose first `held` positions hold this prompt's first
        `held` tokens (fewer than the prompt has: its last position must run for the first token's logits): the
        first entry reads the prompt from there, and grows the cache to this sequence's capacity. With `cut`, the
        cache may hold more positions than those (text this prompt does not share, a refused draft's guesses), and
        that entry cuts it back (to where it ends, where it holds no more)."""
        assert self.prefilled == self.cached and 0 < held < len(self.prompt_ids)
        self.id, self.prefilled, self.cached = sequence, held, held
        self.source, self.after = (sequence if cut else None), None

    def copy_cache(self, sequence: "int | SequenceState", held: int) -> None:
        """Start from a copy of the first `held` positions of `sequence`'s cache, which hold (or, for a sequence in
        the batch still reading its prompt, will hold) this prompt's first `held` tokens: a finished one's, kept
        for others, or one in the batch, which this one waits for until it has read them (`ready`). The first
        entry reads the prompt from there."""
        assert self.prefilled == 0 and 0 < held < len(self.prompt_ids)
        self.prefilled, self.cached = held, held
        if isinstance(sequence, SequenceState):
            self.after = sequence
        else:
            self.source = sequence

    def read_whole(self) -> None:
        """Give up the copy this sequence waits to make (its source is gone): its first entry reads all of the
        prompt."""
        assert self.pending_source is not None and self.prefilled == self.cached
        self.prefilled = self.cached = 0
        self.source = self.after = None

    @property
    def pending_source(self) -> int | None:
        """The sequence whose cache this one's first entry starts from, while that entry is still to be made."""
        return self.after.id if self.after is not None else self.source

    @property
    def ready(self) -> bool:
        """Whether its first entry can run: a sequence it copies from in the batch has read what it shares."""
        return self.after is None or self.after.holds_prompt(self.cached)

    def holds_prompt(self, positions: int) -> bool:
        """Whether this sequence's cache holds its prompt's first `positions` positions on every stage now."""
        return self.pending_source is None and self.prefilled >= positions

    def take_prompt_from(self, leader: "SequenceState") -> None:
        """Start decoding from the leader's reading of the same prompt (its cache was copied for this one, unless it
        ends with the token it chooses from the leader's logits)."""
        self.prefilled, self.leader = leader.prefilled, None
        self.prompt_reports, self.prompt_infos = leader.prompt_reports, leader.prompt_infos
        self.unsent_prompt = self.prompt_infos

    def prepare_mask(self) -> None:
        """Compute the grammar's mask for the next choice now (the scheduler does it while the pipeline runs)."""
        if self.grammar is not None:
            self.next_allowed = self.grammar.allowed()

    @property
    def chooses_the_argmax(self) -> bool:
        """Whether its next token is the raw logits' argmax, and nothing else is read from them: greedy, with no
        logit_bias, penalty, grammar, EOS held back (min_tokens) or log-probabilities (the head may then find the
        token without all the logits: HeadModel.greedy_tokens, whose screen bounds the raw logits only)."""
        params = self.params
        return (params.temperature == 0 and params.logprobs is None and not params.penalised and self.grammar is None
                and not params.logit_bias and self.max_tokens > 0
                and (len(self.text.tokens) >= params.min_tokens or params.ignore_eos and not self.stop_ids))

    def advance(self, logits: torch.Tensor) -> Step:
        """Choose the next token from `logits` ([vocab], fp32) and return what it adds."""
        params, state = self.params, self.text
        if self.max_tokens == 0:  # the prompt alone was asked for (echo with its log-probabilities)
            return self._finish("length")
        if params.penalised and self.history is None:
            self.history = TokenHistory(logits.shape[-1], self.prompt_ids)
        early = len(state.tokens) < params.min_tokens  # EOS and the stop strings' tokens may not end it yet
        banned = (frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids) | self.stop_ids if early else ()
        if banned and max(banned) >= logits.shape[-1]:  # a special token past the logits (check_vocab): never chosen
            banned = frozenset(t for t in banned if t < logits.shape[-1])
        allowed = None
        if self.grammar is not None:
            allowed = self.next_allowed if self.next_allowed is not None else self.grammar.allowed()
            self.next_allowed = None
        token = choose(logits, params, self.history, self.rng, banned=banned, allowed=allowed)
        if self.grammar is not None:
            self.grammar.advance(token)
        return self.add_token(token, logits)

    def add_token(self, token: int, logits: torch.Tensor | None = None) -> Step:
        """Add `token`, chosen from `logits` by `advance` (which its log-probabilities are read from), or without
        them where it `chooses_the_argmax`, and return what it adds."""
        params, state = self.params, self.text
        eos = self.tokenizer.eos_token_ids
        self.last_token_at = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = self.last_token_at
        if token in eos and not params.ignore_eos:
            return self._finish("stop", end=(token, token_logprob(logits, token, params.logprobs)
                                              if params.logprobs is not None else None))
        report = token_logprob(logits, token, params.logprobs) if params.logprobs is not None else None
        state.push(token, report, look_for_stops=len(state.tokens) + 1 >= params.min_tokens)
        if self.history is not None:
            self.history.add(token)
        if state.stop_at is not None:
            return self._finish("stop")
        if len(state.tokens) == self.max_tokens:
            return self._finish("length")
        self.next_token = token
        step = dataclasses.replace(state.release(), prompt=self.unsent_prompt)
        self.unsent_prompt = ()
        return step

    def _finish(self, reason: str, end: tuple[int, TokenLogprob | None] | None = None) -> Step:
        """The last Step; `end` is the end-of-sequence token that ends the completion, with its report."""
        text, rest_text, rest_tokens = self.text.finish()
        if self.text.stop_at is not None:  # a stop string in the text the last tokens held back cuts it too
            reason = "stop"
        started = self.started if self.started is not None else time.perf_counter()
        first = self.first_token_at if self.first_token_at is not None else started
        last = self.last_token_at if self.last_token_at is not None else first
        self.completion = Completion(tuple(t.id for t in self.text.tokens), text, reason, len(self.prompt_ids),
                                     first - started, last - first, tuple(self.text.tokens), self.prompt_infos,
                                     TokenInfo(end[0], len(self.text.text), end[1]) if end is not None else None,
                                     self.cached)
        return Step(rest_text, rest_tokens, self.completion, self.unsent_prompt)


def stop_tokens(tokenizer: TextTokenizer, stop: Sequence[str]) -> frozenset[int]:
    """The special tokens spelled exactly as one of the `stop` strings: editors stop Qwen2.5-Coder's completions at
    "<|file_sep|>" or "<|fim_pad|>", and Llama 3's at "<|eot_id|>". A reply's text leaves special tokens out, so
    their text is kept in it (CompletionText's `kept`) for the stop string to be found, and cut off with it."""
    ids = (tokenizer.token_id(text) for text in stop)
    return frozenset(i for i in ids if i is not None and i in tokenizer.special_ids)


def prompt_shares(readers: Sequence[SequenceState], budget: int, whole: SequenceState | None = None
                  ) -> dict[int, int]:
    """How many prompt positions each of `readers` (sequences reading their prompt, in line) reads this step, by
    sequence id, out of `budget`: `whole` first, as much of its prompt as the budget holds; then the first in line
    an equal share of what is left, and what remains after that to the prompts with least left to read, shortest
    first (in line where they tie, so prompts of one length are read first come first served). A short prompt
    admitted beside a long one is thus read at once and gets its first token in this step, rather than waiting for
    the long one's chunks to end (a 30,000-token prompt held a chat's first token for ~120 steps), and no prompt
    waits for ever: the first in line always reads its share."""
    needs = {s.id: len(s.prompt_ids) - s.prefilled for s in readers}
    shares = dict.fromkeys(needs, 0)
    if whole is not None:
        shares[whole.id] = min(needs[whole.id], budget)
        budget -= shares[whole.id]
    rest = [s.id for s in readers if s is not whole]
    if rest:  # at least one position, where the budget is smaller than the prompts: the first never waits for ever
        shares[rest[0]] = min(needs[rest[0]], budget, max(1, budget // len(rest)))
        budget -= shares[rest[0]]
    for sequence_id in sorted(rest, key=needs.__getitem__):
        more = min(needs[sequence_id] - shares[sequence_id], budget)
        shares[sequence_id] += more
        budget -= more
    return shares


class Generator:
    """Turns prompts into completions over a pipeline: `start` a sequence, `step` a batch of them."""

    def __init__(self, head: HeadModel, tokenizer: TextTokenizer, pipeline: Pipeline, dtype: torch.dtype,
                 draft_tokens: int = 0):
        self.head, self.tokenizer, self.pipeline, self.dtype = head, tokenizer, pipeline, dtype
        self.context_length = head.config.context_length
        self._ids = itertools.count(1)
        self._masks: concurrent.futures.ThreadPoolExecutor | None = None  # grammar masks, made beside the pipeline
        self.prompt_positions = 0  # prompt positions run through the pipeline so far (a prompt read for n, once)
        # tokens a greedy sequence may guess ahead in one step (draft.py; the head's is head.draft_tokens); 0 runs
        # every decode step on one row
        self.draft_tokens = draft_tokens
        self.drafted = self.accepted = 0  # draft tokens run so far, and of those, the tokens chosen

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.logits(hidden.to(self.dtype))  # [1, rows, vocab] fp32

    def _mask_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._masks is None:
            self._masks = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        return self._masks

    def start(self, prompt_ids: list[int], params: SamplingParams) -> SequenceState:
        """A new sequence for `prompt_ids`. Raises ValueError if the prompt is empty or leaves no room."""
        rows = self.head.config.vocab_size
        if any(t >= rows for t in params.draft_reference):
            # a predicted output's special tokens past the embedding (tokenizer.check_vocab leaves them): no reply
            # holds one, and a step that ran one as a draft would fail for the whole batch
            params = dataclasses.replace(params, draft_reference=tuple(t for t in params.draft_reference if t < rows))
        return SequenceState(next(self._ids), prompt_ids, params, self.tokenizer, self.context_length)

    def start_choices(self, prompt_ids: list[int], choices: Sequence[SamplingParams]) -> list[SequenceState]:
        """A sequence per entry of `choices` for the same prompt. The first reads the prompt; each other choice
        that asks for the same cache and prompt log-probabilities follows it: it starts from a copy of the first's
        cache and chooses its first token from the first's logits, each with its own sampling state. If the first
        is gone before the prompt is read (its client left), the next choice reads it for the rest."""
        sequences = [self.start(prompt_ids, params) for params in choices]
        leader = sequences[0]
        for sequence in sequences[1:]:
            if (sequence.capacity, sequence.params.prompt_logprobs, sequence.params.logprobs) == \
                    (leader.capacity, leader.params.prompt_logprobs, leader.params.logprobs):
                sequence.leader = leader
        return sequences

    def step(self, sequences: Sequence[SequenceState], prompt_budget: int | None = None
             ) -> list[tuple[SequenceState, Step | Exception]]:
        """One pipeline call for `sequences` (none of them finished); returns the steps of those that chose a token,
        and for each sequence whose own part of the step failed (making its grammar's mask, reading its prompt's
        log-probabilities, choosing its token) the error instead: it ends that sequence alone (its followers with
        it), while the others go on. What all share (the pipeline, the lm_head) fails the whole step.

        Decoding sequences each run one position, and greedy ones the tokens they guess follow it (draft.py), up to
        STEP_ROWS rows in all, first come first served. Sequences reading their prompt share `prompt_budget` prompt
        positions (prompt_shares: shortest first, the first in line always a share; the rest wait for a later
        step); with none decoding, the first reads all of its prompt and the others share what the budget
        leaves; with no budget, each reads all of its prompt; all as far as the pipeline's max_positions allow. A
        follower (`start_choices`) waits while its leader reads the prompt, and gets a copy of the leader's cache
        in the step that reads the prompt's end; a sequence that copies the start of another's
        (SequenceState.copy_cache) waits until that one has read it. The pipeline's errors pass through.
        """
        present, heirs = {s.id for s in sequences}, {}
        for sequence in sequences:
            leader = sequence.leader
            if leader is not None and leader.decoding:  # it read the prompt in an earlier step, without this one
                sequence.leader = None
            elif leader is not None and leader.id not in present:  # it left: its first follower here leads the rest
                heir = heirs.setdefault(leader.id, sequence)
                sequence.leader = None if heir is sequence else heir
        followers: dict[int, list[SequenceState]] = {}
        for sequence in sequences:
            if sequence.leader is not None:
                followers.setdefault(sequence.leader.id, []).append(sequence)
        # a sequence that copies another's cache waits until that one's entries before this step have read what
        # they share (not this step's: every stage copies before the step's rows run)
        unready = {s for s in sequences if not s.ready}
        readers = [s for s in sequences if not s.decoding and s.leader is None and s not in unready]
        budget, whole = prompt_budget, None
        if budget is not None and not any(s.decoding for s in sequences) and readers:
            # nothing decodes: the first prompt in line is read whole, and others beside it only as far as the
            # budget goes, so that long prompts arriving together get their first tokens one after another, not
            # all at the end of one long step (and the next reads in chunks beside the first one's decoding)
            whole = readers[0]
            budget = max(budget, len(whole.prompt_ids) - whole.prefilled)
        decoding = [s for s in sequences if s.decoding]
        spare = STEP_ROWS - len(decoding)  # rows the step may add for drafts, first come first served
        for sequence in decoding:
            spare -= sequence.plan_draft(min(self.draft_tokens, spare))
        cap = getattr(self.pipeline, "max_positions", None)
        if cap is not None:  # what a step may carry, less the positions of decoding sequences; at least one
            if sum(1 + len(s.draft) for s in decoding) > cap:
                for sequence in decoding:
                    sequence.draft = []
            room = max(1, cap - sum(1 + len(s.draft) for s in decoding))
            budget = room if budget is None else min(budget, room)
        shares = None if budget is None else prompt_shares(readers, budget, whole)
        planned: list[tuple[SequenceState, Entry]] = []
        forked: list[tuple[SequenceState, SequenceState]] = []  # (follower, leader) whose cache it gets this step
        ids: list[int] = []
        for sequence in sequences:
            if sequence.leader is not None and sequence.started is None:
                sequence.started = time.perf_counter()  # in the batch from here, waiting for the leader's reading
            if sequence.leader is not None or sequence in unready or \
                    (not sequence.decoding and shares is not None and shares[sequence.id] <= 0):
                continue
            entry, entry_ids = sequence.entry(len(sequence.prompt_ids) if shares is None or sequence.decoding
                                              else shares[sequence.id])
            if not sequence.decoding and entry.start + entry.length == len(sequence.prompt_ids):
                waiting = followers.get(sequence.id, [])
                # a follower that ends with the token it chooses now (max_tokens 0 or 1) needs no cache
                entry = dataclasses.replace(entry, copies=tuple(f.id for f in waiting if f.max_tokens > 1))
                forked += [(f, sequence) for f in waiting]
            planned.append((sequence, entry))
            ids += entry_ids
        # Grammar masks depend only on the tokens chosen so far, so they are made while the pipeline runs, off the
        # critical path (llguidance releases the GIL; a remote pipeline mostly waits on its sockets).
        choosing_next = [s for s, e in planned if s.grammar is not None and e.start + e.length >= len(s.prompt_ids)]
        choosing_next += [f for f, _ in forked if f.grammar is not None]
        failed: dict[int, Exception] = {}  # by sequence id: its own part of this step failed
        masks = self._mask_pool().submit(lambda: [_guarded(failed, s, s.prepare_mask) for s in choosing_next]) \
            if choosing_next else None
        try:
            hidden = self.pipeline.run([e for _, e in planned], self.head.embed_ids(ids))
        finally:
            if masks is not None:
                masks.result()
        self.prompt_positions += sum(e.length for s, e in planned if not s.decoding)
        # choosing: (sequence, its first row among the rows chosen from, its rows); spans: those rows' (start,
        # length) in hidden, in order
        row, choosing, spans, kept = 0, [], [], 0
        for sequence, entry in planned:
            start, length = row, entry.length
            row += entry.length
            if not sequence.decoding and sequence.id not in failed:
                rows = hidden[:, start:start + length]
                _guarded(failed, sequence, lambda: sequence.read_prompt(entry, rows, self._logits))
                if not sequence.decoding:
                    continue  # more of its prompt to read, or it failed
                start, length = start + length - 1, 1
            if sequence.id in failed:
                continue
            choosing.append((sequence, kept, length))  # a draft's rows: after each token fed
            spans.append((start, length))
            kept += length
        for follower, leader in forked:  # each chooses from the leader's logits, with its own sampling state
            if leader.id in failed:  # it chooses from the leader's reading of the prompt, which did not finish
                failed.setdefault(follower.id, failed[leader.id])
            elif _guarded(failed, follower, lambda: follower.take_prompt_from(leader)) is not _FAILED:
                choosing.append((follower, next(i for s, i, _ in choosing if s is leader), 1))
        stepped = [*(s for s, _ in planned), *(f for f, _ in forked)]
        choosing = [c for c in choosing if c[0].id not in failed]  # a grammar's mask failed after its rows were kept
        if not choosing:
            return [(s, failed[s.id]) for s in stepped if s.id in failed]
        # a decode step chooses from every row of hidden, in order: hidden itself then, not a copy (each PyTorch
        # call costs tens of microseconds on caches the stages' weights have swept)
        rows = hidden if kept == hidden.shape[1] else torch.cat([hidden[:, a:a + n] for a, n in spans], dim=1)
        tokens = self.head.greedy_tokens(rows.to(self.dtype)) if all(s.chooses_the_argmax for s, _, _ in choosing) \
            else None
        logits = self._logits(rows)[0] if tokens is None else None  # [rows, vocab]: one lm_head read for all
        chosen: list[tuple[SequenceState, Step | Exception]] = []
        for sequence, i, n in choosing:
            step = _guarded(failed, sequence, lambda: self._choose(sequence, tokens, logits, i, n))
            if step is not _FAILED:
                chosen.append((sequence, step))
        mark("chosen")
        return [(s, failed[s.id]) for s in stepped if s.id in failed] + chosen

    def _choose(self, sequence: SequenceState, tokens: list[int] | None, logits: torch.Tensor | None, i: int,
                n: int) -> Step:
        """`sequence`'s step from its n rows at i of this step's greedy `tokens`, else of its `logits`."""
        if n > 1:  # a draft: the argmax of each row, which chooses_the_argmax makes the token chosen there
            step, accepted = sequence.check_draft(
                tokens[i:i + n] if tokens is not None else [greedy(logits[j]) for j in range(i, i + n)])
            self.drafted, self.accepted = self.drafted + n - 1, self.accepted + accepted
            return step
        return sequence.add_token(tokens[i]) if tokens is not None else sequence.advance(logits[i])

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[Step]:
        """Generate a completion for `prompt_ids` alone, one `Step` per token, the last carrying the Completion.

        Raises ValueError if the prompt is empty or leaves no room; the pipeline's errors pass through. Closing
        the iterator early abandons the request, and its caches are released either way.
        """
        sequence = self.start(prompt_ids, params)
        try:
            while True:
                for _, step in self.step([sequence]):
                    if isinstance(step, Exception):
                        raise step
                    yield step
                    if step.completion is not None:
                        return
        finally:
            self.pipeline.release([sequence.id])

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 on_text: Callable[[str], None] | None = None) -> Completion:
        """Generate a whole completion for `prompt_ids` (see `stream`); `on_text` sees the text as it is final."""
        for step in self.stream(prompt_ids, params):
            if on_text is not None and step.text:
                on_text(step.text)
            if step.completion is not None:
                return step.completion
        raise AssertionError("Generator.stream ended without a completion")
