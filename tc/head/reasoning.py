"""A reasoning model's thinking, told apart from its answer, as vLLM's and llama.cpp's servers return them. Pure.

Theory of operation: Qwen3, QwQ and the DeepSeek-R1 distills write their thinking between `<think>` and
`</think>`, then the answer (Seed-OSS and Command R7B between tags of their own, read the same way). Both tags are
tokens of their own (added to the vocabulary), so the reply is split on token ids, never on text a model may spell
itself: `ThinkTokens.find` finds them once, when the head loads, and `thinks` decides whether this model's replies
are split at all (both tokens, and a chat template that writes them).

Where a reply starts depends on its prompt: a template may open `<think>` itself (DeepSeek-R1's; Qwen3's newer
ones), so the reply starts inside the thinking; Qwen3's with `enable_thinking: false` writes an empty, closed block,
so the reply has none. `ThinkTokens.opened_in` reads that from the last tag of the prompt's last turn. Otherwise
the reply thinks only when its first token is `<think>`.

`ReasoningSplit` takes a reply as the generation loop releases it: text, and the tokens whose text it holds, each
with its offset in the reply's text. A tag's token is released in the same step as its text's last character, so
the text up to a `</think>` token's offset is thinking and the rest answer; a tail of text that may still become
the tag is held until its token settles it. The thinking goes out without the whitespace around it, the answer
without the line breaks the model writes between the tag and it (its first line's indent stays: it may be code's).
A reply that never closes its thinking (max_tokens, a stop string) is all thinking, as vLLM reads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

from ..generation import TokenInfo
from ..model.tokenizer import TextTokenizer

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# the tag pairs thinking models write, in the order a vocabulary is searched for them: Seed-OSS's and Command
# R7B's are their own (Command R7B's plan before a tool call is its thinking, as llama.cpp reads it)
THINK_TAGS = ((THINK_OPEN, THINK_CLOSE), ("<seed:think>", "</seed:think>"), ("<|START_THINKING|>", "<|END_THINKING|>"))


@dataclass(frozen=True)
class ThinkTokens:
    """The ids of a model's <think> and </think> tokens (or its own pair's), and the text each decodes to in a
    reply; `tags` names the pair."""

    open: int
    close: int
    open_text: str
    close_text: str
    tags: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)

    @classmethod
    def find(cls, tokenizer: TextTokenizer) -> "ThinkTokens | None":
        """The think tokens of the first pair in THINK_TAGS the vocabulary has both of as added tokens (not text
        that happens to be a token); None where it has no pair."""
        added = {token.content: token_id for token_id, token in
                 tokenizer.tokenizer.get_added_tokens_decoder().items()}
        for tags in THINK_TAGS:
            if tags[0] in added and tags[1] in added:
                opening, closing = added[tags[0]], added[tags[1]]
                # the text a reply holds for each: the tag itself, or nothing where the tokenizer marks it special
                return cls(opening, closing, tokenizer.decode([opening]), tokenizer.decode([closing]), tags)
        return None

    def opened_in(self, prompt_ids: Sequence[int], turn_ends: Collection[int] = ()) -> bool:
        """Whether the prompt leaves a <think> open (its template began the thinking), so the reply starts in it.

        Only the tags after the last of `turn_ends` (the tokens that end a turn: the model's end-of-sequence ids)
        count: one before it is in an earlier message (a user who typed "<think>" is no thinking begun)."""
        for token in reversed(prompt_ids):
            if token in (self.open, self.close):
                return token == self.open
            if token in turn_ends:
                return False
        return False


def thinks(tokenizer: TextTokenizer) -> tuple[ThinkTokens | None, str]:
    """(the think tokens when this model's replies are to be split, why or why not, for the log)."""
    tokens = ThinkTokens.find(tokenizer)
    if tokens is None:
        return None, f"the vocabulary has no {THINK_OPEN} and {THINK_CLOSE} tokens"
    opening, closing = tokens.tags
    templates = tokenizer.chat_templates
    if templates is None or not any(opening in t or closing in t for t in templates.templates.values()):
        return None, f"the vocabulary has {opening} and {closing}, but the chat template does not write them"
    return tokens, f"the vocabulary has {opening} and {closing} tokens and the chat template writes them"


class ReasoningUnavailable(ValueError):
    """Splitting the thinking was asked for, but the model has no think tokens to split it at."""


def reasoning_tokens(tokenizer: TextTokenizer, setting: bool | None) -> tuple[ThinkTokens | None, str]:
    """The think tokens to split replies at under the topology's `reasoning_content` (None: auto, as `thinks`
    decides), and why, for the log. Raises ReasoningUnavailable for true on a model without them."""
    if setting is False:
        return None, "reasoning_content: false in the topology"
    if setting is None:
        return thinks(tokenizer)
    tokens = ThinkTokens.find(tokenizer)
    if tokens is None:
        raise ReasoningUnavailable(f"the model's vocabulary has no {THINK_OPEN} and {THINK_CLOSE} tokens to split "
                                   "its thinking at; remove the key, or set it to auto")
    return tokens, "reasoning_content: true in the topology"


def _held_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`: the tag's text may be arriving."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplit:
    """One reply's thinking and answer as its steps arrive: `push` each step's text and tokens, then `finish` once.

    Each returns (thinking to send now, answer to send now). `answered` says whether the reply got past its
    thinking; a reply that did not has no answer at all (its content is null), where one that did may have "".
    """

    def __init__(self, tokens: ThinkTokens, *, opened: bool):
        self.tokens = tokens
        self.thinking = opened  # the reply is inside its thinking
        self.answered = False  # the reply is past its thinking (or never had any): the rest is answer
        self.decided = opened  # whether the reply's first token has said if it thinks
        self.text = ""  # the reply's text so far
        self.at = 0  # text[:at] went out, or was a tag
        self.open_at: int | None = None  # where the reply's opening <think> starts, when it has one
        self.close_at: int | None = None  # where the first </think> in its thinking starts, once its token came
        self.thought = ""  # thinking sent so far: whitespace before the first of it is dropped
        self.answer = ""  # answer after a think block sent so far: line breaks before the first of it are dropped

    def _note(self, tokens: Sequence[TokenInfo]) -> None:
        for token in tokens:
            if not self.decided:
                self.decided = True
                if token.id == self.tokens.open:
                    self.open_at, self.thinking = token.offset, True
                else:
                    self.answered = True
            elif self.thinking and self.close_at is None and token.id == self.tokens.close:
                self.close_at = token.offset

    def _thought(self, text: str) -> str:
        if not self.thought:
            text = text.lstrip()
        self.thought += text
        return text

    def _answer(self, text: str, after_thinking: bool) -> str:
        if after_thinking and not self.answer:
            text = text.lstrip("\r\n")  # only line breaks: the first line's indent may be code's
        self.answer += text
        return text

    def _split(self, final: bool) -> tuple[str, str]:
        thinking, answer = "", ""
        if not self.decided:
            if not final:
                return "", ""  # no token yet says whether the reply thinks
            self.decided = self.answered = True
        if self.open_at is not None:  # the opening tag is no thinking
            end = self.open_at + len(self.tokens.open_text)
            if len(self.text) < end and not final:
                return "", ""
            self.at, self.open_at = max(self.at, min(end, len(self.text))), None
        after_thinking = False
        if self.thinking:
            close = self.close_at
            closed = close is not None and len(self.text) >= close + len(self.tokens.close_text)
            if closed:
                end = close
            else:
                held = 0 if final else _held_tail(self.text[self.at:], self.tokens.close_text)
                end = len(self.text) - held
            # whitespace waits: before the tag (or the reply's end) it is dropped, before more thinking it goes out
            end = self.at + len(self.text[self.at:end].rstrip())
            thinking = self._thought(self.text[self.at:end])
            if not closed:
                self.at = end
                return thinking, ""
            self.at = close + len(self.tokens.close_text)
            self.thinking, self.answered, after_thinking = False, True, True
        if self.answered:
            after_thinking = after_thinking or self.close_at is not None
            answer = self._answer(self.text[self.at:], after_thinking)
            self.at = len(self.text)
        return thinking, answer

    def push(self, text: str, tokens: Sequence[TokenInfo]) -> tuple[str, str]:
        self.text += text
        self._note(tokens)
        return self._split(final=False)

    def finish(self, text: str = "", tokens: Sequence[TokenInfo] = ()) -> tuple[str, str]:
        """The last step's: whatever was held goes out (thinking that never closed is all thinking)."""
        self.text += text
        self._note(tokens)
        return self._split(final=True)
