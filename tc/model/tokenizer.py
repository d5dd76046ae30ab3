"""The model's tokenizer (tokenizer.json through `tokenizers`) and chat template (Jinja2, as HF renders it)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class TokenizerError(ValueError):
    """The model directory's tokenizer files are missing or unusable."""


class ChatTemplateError(ValueError):
    """The chat template could not render these messages (a client error)."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as {"content": ...}
    if isinstance(value, dict):
        return value.get("content")
    return value


@dataclass
class TextTokenizer:
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    chat_template: str | None
    special_tokens: dict[str, str | None]

    @classmethod
    def load(cls, model_dir: Path) -> "TextTokenizer":
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{model_dir}: no tokenizer.json; tc needs a fast (tokenizers) tokenizer file")
        tokenizer = Tokenizer.from_file(str(path))
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        gen_config = _read_json(model_dir / "generation_config.json")
        model_config = _read_json(model_dir / "config.json")
        specials = {k: _token_text(tok_config.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
        eos: set[int] = set()
        for source in (gen_config.get("eos_token_id"), model_config.get("eos_token_id")):
            if isinstance(source, int):
                eos.add(source)
            elif isinstance(source, list):
                eos.update(i for i in source if isinstance(i, int))
        if specials["eos_token"] is not None:
            token_id = tokenizer.token_to_id(specials["eos_token"])
            if token_id is not None:
                eos.add(token_id)
        template = tok_config.get("chat_template")
        if isinstance(template, list):  # some models name several templates; use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(tokenizer, frozenset(eos), template, specials)

    def encode(self, text: str) -> list[int]:
        # the chat template writes the special tokens itself, so none are added here
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render `messages` with the model's own chat template, as transformers does."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(message)

        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
