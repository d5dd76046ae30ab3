"""Fill in the middle: a completion that goes between a prefix (the prompt) and a suffix. Pure; no I/O.

Code models trained for it (Qwen2.5-Coder, StarCoder 2, DeepSeek-Coder and others) read the two sides wrapped in
special tokens and write the middle: `<|fim_prefix|>PREFIX<|fim_suffix|>SUFFIX<|fim_middle|>`. The prompt is
built from token ids, not text, and a text prefix and the suffix are read as plain text (TextTokenizer.encode_literal:
code that spells "<|fim_middle|>" is those characters), so neither can change where the special tokens fall.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"


@dataclass(frozen=True)
class FimTokens:
    """The ids of the model's three fill-in-the-middle tokens."""

    prefix: int
    suffix: int
    middle: int

    @classmethod
    def find(cls, token_id: Callable[[str], int | None]) -> "FimTokens | None":
        """The tokens, given a lookup from token text to id; None unless the vocabulary has all three."""
        ids = [token_id(text) for text in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE)]
        if any(i is None for i in ids):
            return None
        return cls(*ids)  # type: ignore[arg-type]

    def prompt(self, prefix_ids: Sequence[int], suffix_ids: Sequence[int]) -> list[int]:
        """prefix token, the prefix, suffix token, the suffix, middle token: the model writes what follows."""
        return [self.prefix, *prefix_ids, self.suffix, *suffix_ids, self.middle]
