"""Fill in the middle: a completion that goes between a prefix (the prompt) and a suffix. Pure; no I/O.

Code models trained for it read the two sides wrapped in special tokens and write the middle: Qwen2.5-Coder's
`<|fim_prefix|>PREFIX<|fim_suffix|>SUFFIX<|fim_middle|>`, and the same order under other spellings (FIM_SPELLINGS:
StarCoder's and Granite Code's `<fim_prefix>`, DeepSeek-Coder's `<｜fim▁begin｜>`), after the tokens the model's
tokenizer puts before any text (DeepSeek-Coder's BOS; none for Qwen or StarCoder). The prompt is built from token
ids, not text, and a text prefix and the suffix are read as plain text (TextTokenizer.encode_literal: code that
spells "<|fim_middle|>" is those characters), so neither can change where the special tokens fall.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
# (prefix, suffix, middle) as each family spells them, looked for in this order
FIM_SPELLINGS = (
    (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE),  # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder 2, Granite Code
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)


@dataclass(frozen=True)
class FimTokens:
    """The ids of the model's three fill-in-the-middle tokens, and of those its tokenizer puts before a text."""

    prefix: int
    suffix: int
    middle: int
    leading: tuple[int, ...] = ()

    @classmethod
    def find(cls, token_id: Callable[[str], int | None], leading: Sequence[int] = ()) -> "FimTokens | None":
        """The tokens of the first spelling whose three tokens the vocabulary has, given a lookup from token text
        to id; None where it has no spelling's all three."""
        for spelling in FIM_SPELLINGS:
            ids = [token_id(text) for text in spelling]
            if all(i is not None for i in ids):
                return cls(*ids, leading=tuple(leading))  # type: ignore[arg-type]
        return None

    def prompt(self, prefix_ids: Sequence[int], suffix_ids: Sequence[int]) -> list[int]:
        """leading tokens, prefix token, the prefix, suffix token, the suffix, middle token: the model writes what
        follows."""
        return [*self.leading, self.prefix, *prefix_ids, self.suffix, *suffix_ids, self.middle]
