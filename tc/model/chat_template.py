"""Where a model keeps its chat template, and rendering it as transformers does. Files are read here; rendering is pure.

Theory of operation: `find_chat_templates` gathers the model's templates once, when the tokenizer loads, from
every place a HuggingFace model directory may hold them, the first found winning:

1. a file named by the topology's `chat_template:` key (an operator's override, or a template for a model that
   ships none);
2. `chat_template.jinja` beside tokenizer_config.json, and `additional_chat_templates/NAME.jinja` beside it
   (what transformers 4.43+ writes; many Hub models now ship only this);
3. `chat_template.json` (`{"chat_template": ...}`, the processors' older file, which some text models ship);
4. tokenizer_config.json's `chat_template`: a string, or a list of `{"name", "template"}`.

A model may name several templates. As in transformers, a request with tools uses "tool_use" when the model has
one, and every other request "default". `render` runs the chosen template in Jinja's immutable sandbox (the
template is code that came with the model) with the helpers transformers gives templates, so a model's own
template renders here exactly as it does there. A request may give the template variables of its own (Qwen3's
`enable_thinking`), under any name but those `render` gives it itself, and may ask it to continue the conversation's
final message rather than open a new turn, which `render` does as transformers does: it renders the conversation
whole and cuts the text where that message's own text ends.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import jinja2
import jinja2.ext
from jinja2.defaults import DEFAULT_NAMESPACE
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
LEGACY_CHAT_TEMPLATE_FILE = "chat_template.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
DEFAULT = "default"
TOOL_USE = "tool_use"
SEARCHED = (f"{CHAT_TEMPLATE_FILE}, {LEGACY_CHAT_TEMPLATE_FILE} and the chat_template key of "
            f"{TOKENIZER_CONFIG_FILE}")
# the special tokens transformers hands a chat template (its `special_tokens_map`), by their config keys
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_HELPERS = ("raise_exception", "strftime_now")
# Every name `render` gives a template itself: a variable of the request's own by one of these would replace the
# conversation, a special token or a helper (Jinja's own `range`, `namespace`, ... among them) with the client's.
# And `self`, which Jinja's Template.render takes as its own first argument, so no variable can have it.
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", *SPECIAL_TOKEN_KEYS, *_HELPERS,
                                *DEFAULT_NAMESPACE, "self"})


class ChatTemplateError(ValueError):
    """The chat template could not render these messages (a client error), or there is none."""


class ChatTemplateFileError(ValueError):
    """A chat template file is missing, unreadable or malformed (a setup error, found at start)."""


@dataclass(frozen=True)
class ChatTemplates:
    """The model's chat templates by name ("default", "tool_use", ...) and where they were found."""

    templates: Mapping[str, str]
    source: str  # e.g. "/models/qwen/chat_template.jinja", for logs and error messages
    # what the template may read besides messages and tools: the special tokens (bos_token, eos_token, ...)
    context: Mapping[str, Any] = field(default_factory=dict)

    def select(self, with_tools: bool) -> str:
        """The template for a request (with tools: "tool_use" if the model has it). Raises ChatTemplateError."""
        if with_tools and TOOL_USE in self.templates:
            return self.templates[TOOL_USE]
        if DEFAULT in self.templates:
            return self.templates[DEFAULT]
        if len(self.templates) == 1:  # one template, whatever its name
            return next(iter(self.templates.values()))
        raise ChatTemplateError(f"the model's chat templates ({self.source}) are named "
                                f"{', '.join(sorted(self.templates))} and none is \"default\"; name one "
                                "default, or give a template with chat_template: in the topology file")

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               variables: Mapping[str, Any] | None = None) -> str:
        """The prompt text for `messages` (and `tools`, as the template shows them), the template also seeing
        `variables`. With `continue_final_message`, the text ends where the final message's own text does (no
        end of its turn after it), so that what the model writes next continues that message.

        Raises ChatTemplateError when the template fails on these, or the final message's text is not to be found
        in what it writes; ValueError for `variables` named as one of RESERVED_VARIABLES, or a final message
        continued in a new turn (`add_generation_prompt` too)."""
        variables = dict(variables or {})
        taken = sorted(RESERVED_VARIABLES.intersection(variables))
        if taken:
            raise ValueError(f"the template's own variables cannot be given: {', '.join(taken)}")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message continues the final message; add_generation_prompt opens a "
                             "new turn after it: ask for one at most")
        template = self.select(with_tools=bool(tools))
        try:
            compiled = _compile(template)
            rendered = compiled.render(messages=messages, tools=tools or None,
                                       add_generation_prompt=add_generation_prompt, **self.context, **variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        # The template is the model's code, run on the client's messages: any failure in it (a `+` on a missing
        # field, an index past the end, `tojson` on a tool's schema nested deeper than Python recurses) is about
        # these messages, so it is the client's 400, not our 500.
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError, RecursionError) as exc:
            raise ChatTemplateError(f"chat template failed on these messages: {type(exc).__name__}: {exc}") \
                from exc
        return _cut_after_final_message(rendered, messages) if continue_final_message else rendered


def _cut_after_final_message(rendered: str, messages: list[dict[str, Any]]) -> str:
    """`rendered` up to the end of the final message's text, as transformers cuts it (and so vLLM): after the last
    place that text appears, with its trailing whitespace if the template kept it. Raises ChatTemplateError."""
    final = messages[-1].get("content") if messages else None
    text = final.strip() if isinstance(final, str) else ""
    if not text:
        raise ChatTemplateError("continue_final_message needs a final message with text to continue")
    if text not in rendered:
        raise ChatTemplateError("continue_final_message: the chat template does not write the final message's "
                                "text as it is, so there is no place to continue it from")
    start = rendered.rindex(text)
    whole = final.lstrip()
    # the message's trailing whitespace is the model's to continue from only where the template kept it
    return rendered[:start + (len(whole) if rendered.startswith(whole, start) else len(text))]


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' own filter: Jinja's built-in one escapes HTML characters, which would change the prompt
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which transformers knows: the marks a template for training
    (TRL's assistant-only loss) puts around the assistant's words. Rendering a prompt, they write what they hold."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    """The template compiled in the sandbox transformers uses (cached: a model has one or two)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def check_syntax(template: str, source: str) -> None:
    """Raise ChatTemplateFileError when `template` is not valid Jinja (so a bad file fails at start)."""
    try:
        _compile(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateFileError(f"{source}: line {exc.lineno}: {exc.message}; fix the template") from exc


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateFileError(f"cannot read the chat template {path}: {exc}") from exc


def _read_json(path: Path) -> Any:
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise ChatTemplateFileError(f"{path} is not valid JSON: {exc}") from exc


def _named_templates(value: Any, where: str) -> dict[str, str]:
    """A `chat_template` value as transformers writes it: a string, or a list of {"name", "template"}."""
    if isinstance(value, str):
        return {DEFAULT: value}
    if isinstance(value, list):
        named: dict[str, str] = {}
        for i, item in enumerate(value):
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise ChatTemplateFileError(f"{where}: chat_template[{i}] is not "
                                            '{"name": ..., "template": ...}; fix the file')
            named[item["name"]] = item["template"]
        return named
    raise ChatTemplateFileError(f"{where}: chat_template is neither a string nor a list of named templates")


def _jinja_files(model_dir: Path) -> dict[str, str]:
    named: dict[str, str] = {}
    main = model_dir / CHAT_TEMPLATE_FILE
    if main.is_file():
        named[DEFAULT] = _read_text(main)
    extra = model_dir / CHAT_TEMPLATE_DIR
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            named[path.stem] = _read_text(path)
    return named


def find_chat_templates(model_dir: Path, tokenizer_config: Mapping[str, Any], *, override: Path | None = None,
                        context: Mapping[str, Any] | None = None) -> ChatTemplates | None:
    """The model's chat templates, from the first place that has one (see the module's docstring); None if none.

    Raises ChatTemplateFileError when a file that is there cannot be read or parsed, or the override is missing.
    """
    context = dict(context or {})
    if override is not None:
        if not override.is_file():
            raise ChatTemplateFileError(f"the chat template file {override} does not exist; fix chat_template: in "
                                        "the topology file")
        template = _read_text(override)
        check_syntax(template, str(override))
        return ChatTemplates({DEFAULT: template}, str(override), context)
    model_dir = Path(model_dir)
    named = _jinja_files(model_dir)
    if named:
        return ChatTemplates(named, str(model_dir / CHAT_TEMPLATE_FILE), context)
    legacy = model_dir / LEGACY_CHAT_TEMPLATE_FILE
    if legacy.is_file():
        data = _read_json(legacy)
        if not isinstance(data, dict) or "chat_template" not in data:
            raise ChatTemplateFileError(f"{legacy} has no chat_template key; fix or remove the file")
        return ChatTemplates(_named_templates(data["chat_template"], str(legacy)), str(legacy), context)
    value = tokenizer_config.get("chat_template")
    if value:
        where = str(model_dir / TOKENIZER_CONFIG_FILE)
        return ChatTemplates(_named_templates(value, where), where, context)
    return None
