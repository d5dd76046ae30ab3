"""The model's tokenizer (tokenizer.json through `tokenizers`) and its chat template (`chat_template`)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping, Sequence

from tokenizers import Tokenizer

from .chat_template import (SEARCHED, SPECIAL_TOKEN_KEYS, ChatTemplateError, ChatTemplateFileError, ChatTemplates,
                            find_chat_templates)
from .config import ConfigError, token_ids

__all__ = ["ChatTemplateError", "TextTokenizer", "TokenizerError", "check_vocab", "token_bound"]


class TokenizerError(ValueError):
    """The model directory's tokenizer files are missing or unusable."""


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, {} when there is no such file. Raises TokenizerError naming it."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8 text at all
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} holds a {type(data).__name__}, not a JSON object: is the file damaged?")
    return data


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as {"content": ...}; anything else names no token
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _eos_ids(path: Path, data: dict[str, Any]) -> list[int]:
    """The eos_token_id ids `data` (read from `path`) gives. Raises TokenizerError for a value not made of ids."""
    try:
        return token_ids(data.get("eos_token_id"), f"{path} sets eos_token_id")
    except ConfigError as exc:
        raise TokenizerError(str(exc)) from exc


def check_vocab(tokenizer: "TextTokenizer", vocab_size: int, model_dir: Path) -> None:
    """Refuse a tokenizer with ids past the model's embedding (config.json's vocab_size) that ordinary text becomes
    or that ends a reply: a prompt would fail inside the head rather than once here, or no reply would end. Special
    tokens past it are left (Gemma 3 1B's tokenizer.json holds its image model's <image_soft_token> at 262144, one
    past the text model's rows): the model never writes one, and the API refuses a prompt that holds one
    (`token_bound`). Raises TokenizerError."""
    specials = {i for i, token in tokenizer.tokenizer.get_added_tokens_decoder().items() if token.special}
    past = [i for i in tokenizer.tokenizer.get_vocab(with_added_tokens=True).values() if i >= vocab_size]
    if any(i not in specials or i in tokenizer.eos_token_ids for i in past):
        size = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
        raise TokenizerError(f"{Path(model_dir) / 'tokenizer.json'} holds {size} tokens but config.json's vocab_size "
                             f"is {vocab_size}; use the tokenizer that came with this model")


def token_bound(tokenizer: "TextTokenizer", vocab_size: int) -> int:
    """One past the greatest token id a prompt may hold: the tokenizer's ids (rows of the embedding past them are
    padding) that the model's embedding has rows for (`vocab_size`; check_vocab leaves special tokens past it)."""
    return min(tokenizer.tokenizer.get_vocab_size(with_added_tokens=True), vocab_size)


@dataclass
class TextTokenizer:
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    chat_templates: ChatTemplates | None
    special_tokens: dict[str, str | None]

    @classmethod
    def load(cls, model_dir: Path, chat_template: Path | None = None) -> "TextTokenizer":
        """The tokenizer of `model_dir`; `chat_template` names a template file that replaces the model's own.

        Raises TokenizerError when tokenizer.json is missing or a tokenizer or template file is unreadable.
        """
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{model_dir}: no tokenizer.json; tc needs a fast (tokenizers) tokenizer file")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot read as a tokenizer
            raise TokenizerError(f"cannot read {path} as a tokenizer: {exc}; is the file damaged?") from exc
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        specials = {k: _token_text(tok_config.get(k)) for k in SPECIAL_TOKEN_KEYS}
        eos: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            eos.update(_eos_ids(model_dir / name, _read_json(model_dir / name)))
        if specials["eos_token"] is not None:
            token_id = tokenizer.token_to_id(specials["eos_token"])
            if token_id is not None:
                eos.add(token_id)
        try:
            # a token the config sets to null is not given at all, as in transformers: `{{ bos_token }}` writes
            # nothing (not "None") and `bos_token is defined` is false
            named = {key: token for key, token in specials.items() if token is not None}
            templates = find_chat_templates(model_dir, tok_config, override=chat_template, context=named)
        except ChatTemplateFileError as exc:
            raise TokenizerError(str(exc)) from exc
        return cls(tokenizer, frozenset(eos), templates, specials)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The ids of `text`. A chat template writes the special tokens itself, so by default none are added; a
        plain prompt takes `add_special_tokens`: what the tokenizer's post-processor puts around a text (the BOS
        token of Llama, Gemma and Mistral), as transformers' tokenizer(text) and vLLM's completions do."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_literal(self, text: str) -> list[int]:
        """The ids of `text` read as plain text throughout: a special token's spelling in it is its characters, not
        the token (source code that names "<|fim_middle|>" in a fill in the middle's prefix or suffix, which would
        otherwise move where the model reads the middle to be)."""
        return self._literal.encode(text, add_special_tokens=False).ids

    @cached_property
    def _literal(self) -> Tokenizer:
        # a copy: the flag is the tokenizer's own, and other threads encode with the shared one meanwhile
        literal = Tokenizer.from_str(self.tokenizer.to_str())
        literal.encode_special_tokens = True
        return literal

    def leading_ids(self) -> list[int]:
        """The tokens the post-processor puts before a text (Llama's, DeepSeek's BOS; none for Qwen's)."""
        plain = self.encode("a")
        ids = self.encode("a", add_special_tokens=True)
        starts = [i for i in range(len(ids) - len(plain) + 1) if ids[i:i + len(plain)] == plain]
        return ids[:starts[0]] if starts else []

    def encode_prompt(self, text: str) -> list[int]:
        """A plain prompt's ids: with what the post-processor puts around a text (Llama's, Gemma's BOS), but not a
        second BOS where the text starts with its own, as a client that renders the chat template itself sends it
        (llama.cpp warns of the doubled token, which a model reads as it never saw in training)."""
        ids = self.encode(text, add_special_tokens=True)
        if len(ids) > 1 and ids[0] == ids[1] and ids[0] in self.special_ids and ids[1:] == self.encode(text):
            return ids[1:]  # the post-processor's, before the text's own; two the text holds itself stay
        return ids

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids of the added tokens marked special: those that `decode` drops by default."""
        return frozenset(i for i, token in self.tokenizer.get_added_tokens_decoder().items() if token.special)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, kept: frozenset[int] = frozenset()) -> str:
        """The text of `ids`; with `skip_special_tokens`, the special tokens' text is left out, but for those in
        `kept` (markers a reply's parser reads, such as a tool call's, where a tokenizer marks them special)."""
        if skip_special_tokens and kept:
            ids, skip_special_tokens = [i for i in ids if i in kept or i not in self.special_ids], False
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def token_id(self, text: str) -> int | None:
        """The id of the token spelled exactly `text` (a special token such as "<|fim_prefix|>"), or None."""
        return self.tokenizer.token_to_id(text)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                            tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                            variables: Mapping[str, Any] | None = None) -> str:
        """Render `messages` (and `tools`) with the model's own chat template, as transformers does; `variables`
        are the template's besides (ChatTemplates.render says which names it keeps for itself).

        Raises ChatTemplateError when the model has no template or it fails on these messages.
        """
        if self.chat_templates is None:
            raise ChatTemplateError(f"this model has no chat template (looked in {SEARCHED}); give one with "
                                    "chat_template: in the topology file, or use /v1/completions")
        return self.chat_templates.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message, variables=variables)
