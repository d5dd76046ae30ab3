"""Draft tokens for a greedy sequence, looked up in its own text (prompt lookup decoding).

A reply often repeats its input: code edited in place, a quoted passage, a list carried over, a predicted output
that the client sends beside the prompt (OpenAI's `prediction`). Where the last few tokens chosen also appear
earlier in the text, the tokens that followed them there are a good guess at what comes next. A decode step then
runs the chosen token and that guess as one entry of several rows: each row gives the argmax after it, so every
guessed token that matches the argmax before it is checked in the same step, and the step makes as many tokens as
were guessed right plus one. Reading a stage's weights costs far more than a few more rows through them, so a step
that checks a guess costs little more than one that does not (Generator.step; docs/design.md, "Drafts").

The guesses change no token: each row's argmax is the token greedy decoding makes there, and the rows after a
wrong guess are dropped (the cache positions they wrote are cut back by the next entry, Entry.source).
"""
from __future__ import annotations

import bisect
from typing import Iterable, Sequence

NGRAM_SIZES = (3, 2)  # the tail lengths looked up, longest first: a longer match guesses better
FIRST_LIMIT = 4  # draft tokens tried first; doubled after a draft taken whole, halved after one refused at once
# Rows a decode step carries at most with its drafts, every sequence's together: what a decode plan takes
# (native.ACT_ROWS). A step of more rows runs through the modules, and a batch's many drafts would make every
# sequence's step slower for guesses that may fail.
STEP_ROWS = 16
MAX_LIMIT = STEP_ROWS - 1  # draft tokens at most in one step, for a sequence alone
MAX_PAUSE = 64  # steps at most without a draft after drafts refused at their first token, one after another


class DraftLookup:
    """Where each n-gram of a growing token text last appeared with a token after it, to guess the next tokens.

    `extend` adds tokens (kept in one list, each n-gram indexed once: the cost of a lookup does not grow with the
    text); `draft` returns the tokens that followed the last appearance of the text's tail before the tail itself.
    `reference` tokens (a predicted output) are looked up first, as text the reply is expected to repeat: at the
    first sighting after where the last guess from it ended, so that a reply that follows it takes its lines in
    order even where they repeat.
    """

    def __init__(self, reference: Sequence[int] = ()):
        self.text: list[int] = []
        self._where: dict[tuple[int, ...], int] = {}  # n-gram -> index in text of the token after its last sighting
        self.reference = list(reference)
        self._reference_where: dict[tuple[int, ...], list[int]] = {}  # n-gram -> every sighting, in order
        for end in range(1, len(self.reference)):
            for n in NGRAM_SIZES:
                if end >= n:
                    self._reference_where.setdefault(tuple(self.reference[end - n:end]), []).append(end)
        self._reference_at = 0  # where the last draft taken from the reference ended
        self._drawn_at: int | None = None  # where in the reference the last draft started; None: not from it
        self.limit = FIRST_LIMIT
        # Steps left without a draft, and how many the next draft refused at once pauses for. A row costs a step
        # more on a machine whose several-row products are bound by its arithmetic, not its memory (int4 on a
        # 2-core EPYC: a step of 2 rows took twice one of 1), so guesses that keep failing back off: 1, 2, 4 ...
        # steps between tries, until one is taken.
        self.pause, self._next_pause = 0, 1

    def extend(self, tokens: Iterable[int]) -> None:
        text, where = self.text, self._where
        for token in tokens:
            text.append(token)
            end = len(text) - 1  # the n-grams that end just before this token are followed by it
            for n in NGRAM_SIZES:
                if end >= n:
                    where[tuple(text[end - n:end])] = end

    def draft(self, most: int) -> list[int]:
        """Up to min(most, the current limit) tokens guessed to follow the text; [] where no tail appeared before."""
        most = min(most, self.limit)
        if self.pause > 0:
            self.pause -= 1
            return []
        if most <= 0:
            return []
        text, self._drawn_at = self.text, None
        for n in NGRAM_SIZES:
            if len(text) < n:
                continue
            tail = tuple(text[-n:])
            sightings = self._reference_where.get(tail)
            if sightings is not None:
                at = sightings[min(bisect.bisect_left(sightings, self._reference_at), len(sightings) - 1)]
                self._drawn_at = at
                return self.reference[at:at + most]
            at = self._where.get(tail)
            if at is not None:
                return text[at:at + most]
        return []

    def taken(self, drafted: int, accepted: int) -> None:
        """Note how many of a draft's tokens were right: the next draft may be longer, or should be shorter."""
        if self._drawn_at is not None:
            self._reference_at = self._drawn_at + accepted
        if drafted and accepted == drafted:
            self.limit = min(self.limit * 2, MAX_LIMIT)
        elif drafted and accepted == 0:
            self.limit = max(self.limit // 2, 1)
            self.pause, self._next_pause = self._next_pause, min(self._next_pause * 2, MAX_PAUSE)
        if accepted:
            self._next_pause = 1

