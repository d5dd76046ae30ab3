"""Constrained decoding: at each step, the tokens a grammar allows, applied right before the token is chosen.

Theory of operation: a request that must produce JSON of a schema (structured output, a forced tool call) carries
a `TokenConstraint` in its SamplingParams. The generation loop calls `start()` once per request for a fresh
`ConstraintState`, then before each choice asks it for the `allowed` tokens (a boolean mask over the logits) and
after each choice tells it the token (`advance`). When the grammar is complete only the end-of-sequence tokens
are allowed, so the completion ends there; greedy or sampled, whatever the sampler picks is valid.

The grammar engine is llguidance, an optional native package: it is imported only when a request asks for a
constraint (`GrammarEngine.load`), and its absence is a `ConstraintUnavailable` naming the package, so the head
and tc.pyz run without it. Building its view of a 150k-token vocabulary takes about a second, once per head;
a mask then costs well under a millisecond a token (bench/bench_constrained.py measures it).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol, Sequence

import torch

GRAMMAR_PACKAGE = "llguidance"
# JSON as models write it by habit (json.dumps' separators), and no free whitespace: a grammar that allows
# whitespace anywhere lets a model pad forever instead of closing the object. oneOf is read as anyOf (a value
# valid under two branches passes), as OpenAI's structured outputs and docs/api.md say: the engine refuses a
# oneOf whose branches may overlap without it.
JSON_STYLE: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                              "coerce_one_of": True}


def _style(lenient: bool) -> dict[str, Any]:
    return {**JSON_STYLE, "lenient": True} if lenient else JSON_STYLE


def _alternatives(schemas: Sequence[tuple[Mapping[str, Any], bool]]) -> str:
    """Lark rules: `value`, one of `schemas` ((schema, lenient) each), every one a JSON rule of its own. Raises
    GrammarError for no schemas (the rule would be empty: any text, or none, would do)."""
    if not schemas:
        raise GrammarError("no schema to follow")
    rules = [f"json_{i}: %json {json.dumps({**bound_numbers(schema), 'x-guidance': _style(lenient)})}"
             for i, (schema, lenient) in enumerate(schemas)]
    return "value: " + " | ".join(f"json_{i}" for i in range(len(schemas))) + "\n" + "\n".join(rules) + "\n"


# The magnitude a generated number may reach where the schema sets no bound. JSON numbers are unbounded, and a
# sampled model can write digit after digit until max_tokens ends the reply unparsed (seen at temperature 0.9:
# "population_millions": 27270000000...). Any reply within the bound is valid under the schema as given.
NUMBER_BOUND = 10**15
# Objects and arrays within one another that a schema may hold: the grammar engine's JSON reader refuses a schema
# nested deeper ("recursion limit exceeded"), and a request's body may nest far deeper than Python's own recursion
# reaches (a schema of 300 levels ended bound_numbers in a RecursionError, a 500 instead of a 400).
MAX_SCHEMA_NESTING = 128


def bound_numbers(schema: Any, _depth: int = 0) -> Any:
    """`schema` with every number and integer that has no lower or upper bound given -NUMBER_BOUND or NUMBER_BOUND
    (a copy; the schema is not changed). Every value the result allows, the original allows too. Raises
    GrammarError for a schema nested more than MAX_SCHEMA_NESTING deep."""
    if isinstance(schema, (list, dict)) and _depth >= MAX_SCHEMA_NESTING:
        raise GrammarError(f"the schema nests objects and arrays more than {MAX_SCHEMA_NESTING} levels deep")
    if isinstance(schema, list):
        return [bound_numbers(item, _depth + 1) for item in schema]
    if not isinstance(schema, dict):
        return schema
    bounded = {key: bound_numbers(value, _depth + 1) for key, value in schema.items()}
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    if {"number", "integer"} & set(k for k in kinds if isinstance(k, str)):
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            bounded["minimum"] = -NUMBER_BOUND
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            bounded["maximum"] = NUMBER_BOUND
    return bounded


class ConstraintUnavailable(RuntimeError):
    """The grammar engine is not installed here."""


class GrammarError(ValueError):
    """A schema or grammar the engine refuses: invalid, or using features it does not implement."""


class ConstraintState(Protocol):
    """One request's place in its grammar."""

    def allowed(self) -> torch.Tensor:
        """The tokens allowed next: bool [vocab]."""

    def advance(self, token_id: int) -> None:
        """The token chosen (one `allowed` allowed)."""


class TokenConstraint(Protocol):
    """What SamplingParams carries: a value that starts one state per request."""

    def start(self) -> ConstraintState:
        """A fresh state at the grammar's beginning."""


class GrammarEngine:
    """llguidance's matcher factory for one tokenizer and one logits width."""

    def __init__(self, llguidance: Any, tokenizer: Any, vocab_size: int, mask_size: int | None = None):
        self._ll, self._tokenizer, self.vocab_size = llguidance, tokenizer, vocab_size
        self.mask_size = mask_size or vocab_size  # the tokens a mask covers: the logits', and any special past them
        self._shifts = torch.arange(32, dtype=torch.int32)  # bit i of each int32 word is token 32 * word + i

    @classmethod
    def load(cls, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> "GrammarEngine":
        """The engine over `tokenizer` (a `tokenizers.Tokenizer`); `vocab_size` is the logits' width.

        Raises ConstraintUnavailable when llguidance is not installed.
        """
        try:
            import llguidance  # noqa: PLC0415 - optional and native: only requests that need it load it
        except ImportError as exc:
            raise ConstraintUnavailable(
                f"structured output needs the {GRAMMAR_PACKAGE} package on the head; install it with "
                f"pip install {GRAMMAR_PACKAGE}") from exc
        # special tokens past the logits (tokenizer.check_vocab leaves them) are in the engine's vocabulary too
        mask_size = max(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
        engine_tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=mask_size,
                                                  eos_token=sorted(eos_token_ids))
        return cls(llguidance, engine_tokenizer, vocab_size, mask_size)

    def _checked(self, grammar: str) -> "Grammar":
        failed, messages = self._ll.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if failed:
            raise GrammarError("; ".join(messages))
        return Grammar(self, grammar)

    def json_schema(self, schema: Mapping[str, Any], lenient: bool = False) -> "Grammar":
        """JSON text valid under `schema`. Raises GrammarError naming what the engine does not implement; with
        `lenient`, only a `pattern` it cannot read: the keywords and formats it does not implement are left out, so
        the text follows the rest of the schema."""
        try:
            grammar = self._ll.LLMatcher.grammar_from_json_schema(json.dumps(bound_numbers(schema)),
                                                                  overrides=_style(lenient))
        except ValueError as exc:
            raise GrammarError(str(exc)) from exc
        return self._checked(grammar)

    def check_schema(self, schema: Mapping[str, Any]) -> None:
        """Raises GrammarError where `schema` is no JSON schema (a type that is none of JSON's, `properties` that is
        not an object, a `$ref` to nothing, ...). What only constrained decoding needs passes: keywords and formats
        the engine does not implement, and a `pattern` its regex dialect does not read (JSON schema's is
        ECMAScript's, which has look-around; the engine's has not)."""
        grammar = self._ll.LLMatcher.grammar_from_json_schema(json.dumps(bound_numbers(schema)),
                                                              overrides={"lenient": True})
        failed, messages = self._ll.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if failed and not all(m.startswith("regex parse error") for m in messages):
            raise GrammarError("; ".join(messages))

    def json_choice(self, schemas: Sequence[tuple[Mapping[str, Any], bool]]) -> "Grammar":
        """JSON text valid under one of `schemas`, each (schema, lenient as json_schema's): each its own document
        (its references read from it), and each lenient or not on its own, where one anyOf of them is one or the
        other throughout. Raises GrammarError."""
        if len(schemas) == 1:
            return self.json_schema(*schemas[0])
        return self._checked(self._ll.LLMatcher.grammar_from_lark(f"start: value\n{_alternatives(schemas)}"))

    def json_sequence(self, schemas: Sequence[tuple[Mapping[str, Any], bool]], *, separator: str = "\n") -> "Grammar":
        """One or more JSON values, each valid under one of `schemas` (as json_choice's), apart by `separator`.
        Raises GrammarError."""
        lark = f"start: value ({json.dumps(separator)} value)*\n{_alternatives(schemas)}"
        return self._checked(self._ll.LLMatcher.grammar_from_lark(lark))

    def matcher(self, grammar: str) -> Any:
        return self._ll.LLMatcher(self._tokenizer, grammar)

    def unpack(self, bitmask: torch.Tensor) -> torch.Tensor:
        """int32 [words] of bits -> bool [vocab]."""
        bits = (bitmask.unsqueeze(1) >> self._shifts) & 1  # [words, 32]
        return bits.view(-1)[:self.vocab_size].bool()


@dataclass(frozen=True)
class Grammar:
    """A checked grammar: a TokenConstraint whose states are llguidance matchers."""

    engine: GrammarEngine = field(compare=False, repr=False)
    grammar: str

    def start(self) -> "GrammarState":
        return GrammarState(self.engine, self.engine.matcher(self.grammar))


class GrammarState:
    def __init__(self, engine: GrammarEngine, matcher: Any):
        self.engine, self.matcher = engine, matcher
        self._bitmask = torch.zeros((engine.mask_size + 31) // 32, dtype=torch.int32)  # [words]

    def allowed(self) -> torch.Tensor:
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.data_ptr(), self._bitmask.numel() * 4)
        if self.matcher.is_error():
            raise AssertionError(f"grammar matcher failed: {self.matcher.get_error()}")
        return self.engine.unpack(self._bitmask)

    def advance(self, token_id: int) -> None:
        # the token came through `allowed`, so refusing it is our bug, not the client's
        if not self.matcher.consume_token(token_id):
            raise AssertionError(f"grammar refused token {token_id} it allowed: {self.matcher.get_error()}")


@dataclass(frozen=True)
class AfterToken:
    """`inner`, from the token after the first `token` chosen on; every token is allowed until then.

    A thinking model's reply under a grammar: the thinking before its </think> is free, the answer after it follows
    the grammar, as vLLM constrains a reasoning model's reply. `vocab_size` is the logits' width."""

    inner: TokenConstraint
    token: int
    vocab_size: int

    def start(self) -> "AfterTokenState":
        return AfterTokenState(self)


class AfterTokenState:
    def __init__(self, constraint: AfterToken):
        self.constraint = constraint
        self.state: ConstraintState | None = None  # the inner grammar's, once `token` has been chosen
        self._any = torch.ones(constraint.vocab_size, dtype=torch.bool)

    def allowed(self) -> torch.Tensor:
        return self._any if self.state is None else self.state.allowed()

    def advance(self, token_id: int) -> None:
        if self.state is not None:
            self.state.advance(token_id)
        elif token_id == self.constraint.token:
            self.state = self.constraint.inner.start()
