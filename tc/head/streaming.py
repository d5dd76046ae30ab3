"""Replies of the two generation endpoints, whole or streamed, in OpenAI's shapes.

A streamed reply is the whole reply cut at each generation step, so both are built here from the same pieces:
a `ReplyFormat` per endpoint turns a `Completion` into the whole body, and each `Step` into chunks. Joining the
chunks' text (and their log-probability entries) gives exactly the whole body's, because the generation loop
only ever releases final text. A chat reply that may call tools reads its text through `ToolCallStream`, which
holds back what may be a call and settles it as the whole reply's parser does (tool_calls.py). A thinking model's
reply first goes through `ReasoningSplit` (reasoning.py), which tells its thinking from its answer at the think
tokens; the whole reply is split by the same object, fed everything at once, so the two agree.

Streams are server-sent events: `data: {chunk}` lines, then `data: [DONE]`. `EventStream` is the WSGI body. A
request for several choices (`n`) streams them side by side: one step of each in turn (they share the batch's
steps), each chunk naming its choice's index, and one usage chunk for all of them at the end.
Waitress only learns that a client has gone when a write fails, and the first write after a client closes its
socket still succeeds (the reply to it is a reset), so before each next step the stream writes an SSE comment
(`: `, which clients skip) behind the step's chunk. A client that walks away is thus noticed within one step;
Waitress stops iterating and calls `close()`, which ends the generation and frees the cluster.
"""
from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterator, Protocol, Sequence

from ..generation import Completion, Step, TokenInfo
from ..model.tokenizer import TextTokenizer
from ..sampling import TokenLogprob
from .reasoning import ReasoningSplit, ThinkTokens
from .service import GenerationGroup, GenerationStream
from .tool_calls import ToolCall, ToolCallStream, Tools, parse_tool_calls

DONE = b"data: [DONE]\n\n"
CALL_ID_LENGTH = 9
CALL_ID_CHARACTERS = string.ascii_letters + string.digits
KEEPALIVE = b": \n\n"  # an SSE comment: clients skip it; writing it shows whether the client is still there
# Written too each time this long passes without a step: a step may wait long (a lost worker's resume grace
# period), and proxies cut a stream silent for a minute (nginx's proxy_read_timeout, most load balancers' idle
# timeout); a client that has gone is noticed then, rather than at the next step
IDLE_KEEPALIVE_S = 10.0


# Characters JSON leaves raw (it escapes those under U+0020) that some line readers end a line at (Python's
# str.splitlines, which requests' iter_lines uses): an event split there is no JSON. Escaped, they read the same.
_LINE_LIKE = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as JSON (which escapes \\n and \\r inside strings; the other
    characters some readers split lines at are escaped here)."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_LIKE)
    return b"data: " + text.encode() + b"\n\n"


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-level alphabet: each printable stand-in character -> the byte it encodes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_DECODER = _byte_decoder()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback: a token for one raw byte


def _decoder_steps(tokenizer: TextTokenizer) -> list[dict[str, Any]]:
    """The steps of the tokenizer's decoder, as tokenizer.json writes them ([] when it has none)."""
    decoder = tokenizer.tokenizer.decoder
    if decoder is None:
        return []
    state = json.loads(decoder.__getstate__())
    return list(state.get("decoders", [])) if state.get("type") == "Sequence" else [state]


class TokenText:
    """Each token's exact bytes and its display string, as OpenAI's log-probability entries show them.

    A token's piece in the vocabulary spells its bytes one of two ways: byte-level BPE (GPT-2's, Qwen's, Llama 3's)
    writes each byte as a stand-in character; SentencePiece (Llama 2's, Mistral's, Gemma's) writes text with "▁"
    for a space, and a byte that is no whole character as a piece of its own, "<0xE6>". The tokenizer's decoder
    says which. A piece is read on its own, not decoded, since decoding strips the space a word starts with.
    """

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self._added = {i: t.content for i, t in tokenizer.tokenizer.get_added_tokens_decoder().items()}
        self._cache: dict[int, tuple[bytes, str]] = {}
        steps = _decoder_steps(tokenizer)
        kinds = {step.get("type") for step in steps}
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        # what the decoder writes in place of SentencePiece's "▁" (and any other string it replaces)
        self._replaced = [(step["pattern"]["String"], step.get("content", "")) for step in steps
                          if step.get("type") == "Replace" and "String" in (step.get("pattern") or {})]
        self._replaced += [(step.get("replacement", "▁"), " ") for step in steps if step.get("type") == "Metaspace"]

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tokenizer.tokenizer.id_to_token(token_id)
        if piece is None:  # an id past the tokenizer's vocabulary (an embedding row kept for padding)
            return b""
        if self._byte_level:
            if all(ch in _BYTE_DECODER for ch in piece):
                return bytes(_BYTE_DECODER[ch] for ch in piece)
        elif self._byte_fallback or self._replaced:  # SentencePiece
            byte = _BYTE_PIECE.fullmatch(piece) if self._byte_fallback else None
            if byte:
                return bytes([int(byte.group(1), 16)])
            for pattern, content in self._replaced:
                piece = piece.replace(pattern, content)
            return piece.encode()
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def get(self, token_id: int) -> tuple[bytes, str]:
        """(the token's UTF-8 bytes, its text; "bytes:\\xNN..." when the bytes are not whole characters)."""
        cached = self._cache.get(token_id)
        if cached is None:
            raw = self._bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            cached = self._cache[token_id] = (raw, text)
        return cached

    def text(self, token_id: int) -> str:
        return self.get(token_id)[1]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _completion_usage(completion: Completion) -> dict[str, Any]:
    counts: dict[str, Any] = usage(completion.prompt_tokens, completion.completion_tokens)
    if completion.cached_prompt_tokens:  # as OpenAI reports a prompt cache's hits
        counts["prompt_tokens_details"] = {"cached_tokens": completion.cached_prompt_tokens}
    return counts


class ReplyFormat(Protocol):
    def whole(self, completion: Completion) -> dict[str, Any]:
        """The non-streamed reply body."""

    def opening(self, first: Step) -> list[dict[str, Any]]:
        """Chunks sent before the first step's own."""

    def deltas(self, step: Step) -> list[dict[str, Any]]:
        """The chunks for one step; none when the step has nothing to show."""

    def closing(self, completion: Completion) -> list[dict[str, Any]]:
        """The last chunks: whatever was held back, then the one that carries the finish reason."""

    def usage_chunk(self, completion: Completion) -> dict[str, Any]:
        """The last chunk when the client asked for usage: no choices, only usage."""


@dataclass(frozen=True)
class ReplyContext:
    """What every chunk of one reply repeats."""

    id: str
    created: int
    model: str
    include_usage: bool = False  # streamed: every chunk carries "usage": null, and a usage chunk comes last


class CompletionReply:
    """/v1/completions: text, OpenAI's legacy `logprobs` object, and `echo` of the prompt."""

    def __init__(self, context: ReplyContext, token_text: TokenText, *, logprobs: int | None,
                 echo_text: str | None = None):
        self.context, self.token_text, self.logprobs, self.echo_text = context, token_text, logprobs, echo_text

    def _logprobs(self, tokens: Sequence[TokenInfo], shift: int) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        entries = [self._entry(t, shift) for t in tokens]
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [e[2] for e in entries], "text_offset": [e[3] for e in entries]}

    def _entry(self, token: TokenInfo, shift: int) -> tuple[str, float | None, dict[str, float] | None, int]:
        report = token.logprob
        if report is None:  # the prompt's first token: nothing came before it
            return self.token_text.text(token.id), None, None, token.offset + shift
        # OpenAI: the `logprobs` most likely tokens, and always the chosen one (so up to logprobs + 1 entries)
        top: dict[str, float] = {}
        for i, lp in report.top:  # most likely first: of tokens that read the same, the likeliest keeps the key
            top.setdefault(self.token_text.text(i), lp)
        top.setdefault(self.token_text.text(token.id), report.logprob)
        return self.token_text.text(token.id), report.logprob, top, token.offset + shift

    def _head(self, obj: str = "text_completion") -> dict[str, Any]:
        return {"id": self.context.id, "object": obj, "created": self.context.created, "model": self.context.model}

    def _choice(self, text: str, logprobs: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
        return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {**self._head(), "choices": choices}
        if self.context.include_usage:
            chunk["usage"] = None
        return chunk

    @property
    def _shift(self) -> int:
        return len(self.echo_text) if self.echo_text is not None else 0

    @staticmethod
    def _scored(tokens: Sequence[TokenInfo], completion: Completion | None) -> Sequence[TokenInfo]:
        """`tokens`, and after the last of them the end-of-sequence token that ended the completion, if one did: it
        was generated like any other, and a client that scores a text (lm-evaluation-harness: echo, max_tokens 1)
        drops the last entry as the generated one; without it, that would be the text's own last token."""
        if completion is None or completion.end is None:
            return tokens
        return (*tokens, completion.end)

    def whole(self, completion: Completion) -> dict[str, Any]:
        text, logprobs = completion.text, self._logprobs(self._scored(completion.tokens, completion), self._shift)
        if self.echo_text is not None:
            text = self.echo_text + text
            prompt = self._logprobs(completion.prompt, 0)
            if logprobs is not None and prompt is not None:
                logprobs = {key: prompt[key] + logprobs[key] for key in logprobs}
        return {**self._head(), "choices": [self._choice(text, logprobs, completion.finish_reason)],
                "usage": _completion_usage(completion)}

    def opening(self, first: Step) -> list[dict[str, Any]]:
        """With echo, the prompt's text (and its log-probabilities) comes first."""
        if self.echo_text is None:
            return []
        return [self._chunk([self._choice(self.echo_text, self._logprobs(first.prompt, 0), None)])]

    def deltas(self, step: Step) -> list[dict[str, Any]]:
        tokens = self._scored(step.tokens, step.completion)
        if not step.text and not (tokens and self.logprobs is not None):
            return []
        return [self._chunk([self._choice(step.text, self._logprobs(tokens, self._shift), None)])]

    def closing(self, completion: Completion) -> list[dict[str, Any]]:
        return [self._chunk([self._choice("", None, completion.finish_reason)])]

    def usage_chunk(self, completion: Completion) -> dict[str, Any]:
        return {**self._head(), "choices": [], "usage": _completion_usage(completion)}


def new_call_id() -> str:
    """A call's id: nine letters and digits. The client sends it back with the call and its result, and Mistral's
    chat templates refuse any other length (its models' own ids are nine letters and digits), where an id in
    OpenAI's longer form would have failed the conversation's next request."""
    return "".join(secrets.choice(CALL_ID_CHARACTERS) for _ in range(CALL_ID_LENGTH))


@dataclass(frozen=True)
class ToolCalling:
    """A chat reply that may call tools: their names (to their parameters' schemas), whether it may make several
    calls, and how ids are made.
    `legacy`: the tools came as the deprecated `functions`, so the reply's one call is a `function_call` (no id)
    and its finish_reason "function_call", as OpenAI answers that form."""

    tools: Tools
    parallel: bool = True
    new_id: Callable[[], str] = field(default=new_call_id)
    legacy: bool = False

    @property
    def finish_reason(self) -> str:
        return "function_call" if self.legacy else "tool_calls"


def _call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


@dataclass(frozen=True)
class Reasoning:
    """A reply of a model that thinks: its think tokens, and whether its prompt left the thinking open. `split`
    False: the client asked for the thinking inline; the message still has reasoning_content, null."""

    tokens: ThinkTokens
    opened: bool
    split: bool = True


class ChatReply:
    """/v1/chat/completions: an assistant message, and OpenAI's chat `logprobs` object ({"content": [...]}).

    With `tools`, calls the model wrote become `message.tool_calls` (finish_reason "tool_calls"); streamed, each
    call is two deltas, as OpenAI sends them: its index, id, type and name, then its arguments. In the deprecated
    form (`tools.legacy`) the one call is `message.function_call`, streamed as its name, then its arguments.
    With `reasoning`, the thinking goes in `message.reasoning_content` (streamed: `delta.reasoning_content`, all of
    it before the answer's deltas) and only the answer in `content`, where the tool calls are looked for; the
    `logprobs` entries cover every token generated, tags and thinking included, each on the chunk of its step.
    """

    def __init__(self, context: ReplyContext, token_text: TokenText, *, logprobs: int | None,
                 tools: ToolCalling | None = None, reasoning: Reasoning | None = None):
        self.context, self.token_text, self.logprobs, self.tools = context, token_text, logprobs, tools
        self.reasoning = reasoning
        self._calls = (ToolCallStream(tools.tools, tools.new_id, parallel=tools.parallel) if tools is not None
                       else None)
        self._calls_sent = 0
        self._split = self._new_split()

    def _new_split(self) -> ReasoningSplit | None:
        if self.reasoning is None or not self.reasoning.split:
            return None
        return ReasoningSplit(self.reasoning.tokens, opened=self.reasoning.opened)

    def _alternative(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw, text = self.token_text.get(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    def _entry(self, token: TokenInfo) -> dict[str, Any]:
        report: TokenLogprob | None = token.logprob
        assert report is not None  # asked for, so every generated token has one
        return {**self._alternative(token.id, report.logprob),
                "top_logprobs": [self._alternative(i, lp) for i, lp in report.top]}

    def _logprobs(self, tokens: Sequence[TokenInfo]) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        return {"content": [self._entry(t) for t in tokens], "refusal": None}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.context.id, "object": obj, "created": self.context.created, "model": self.context.model}

    def _chunk(self, delta: dict[str, Any], logprobs: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
        chunk = {**self._head("chat.completion.chunk"),
                 "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if self.context.include_usage:
            chunk["usage"] = None
        return chunk

    def whole(self, completion: Completion) -> dict[str, Any]:
        content: str | None = completion.text
        thinking = None
        split = self._new_split()
        if split is not None:
            thinking, content = split.finish(completion.text, completion.tokens)
            thinking, content = thinking or None, content if split.answered else None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        finish = completion.finish_reason
        if self.tools is not None and content is not None:
            parsed = parse_tool_calls(content, self.tools.tools, self.tools.new_id)
            calls = parsed.calls if self.tools.parallel else parsed.calls[:1]
            if calls:
                message = {"role": "assistant", "content": parsed.content}
                if self.tools.legacy:  # the deprecated form's one call
                    message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
                else:
                    message["tool_calls"] = [_call_body(c) for c in calls]
                finish = self.tools.finish_reason
        if self.reasoning is not None:
            message["reasoning_content"] = thinking
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(completion.tokens),
                  "finish_reason": finish}
        return {**self._head("chat.completion"), "choices": [choice], "usage": _completion_usage(completion)}

    def opening(self, first: Step) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""}, None, None)]

    def _call_chunks(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        chunks = []
        for call in calls:
            index, self._calls_sent = self._calls_sent, self._calls_sent + 1
            if self.tools is not None and self.tools.legacy:  # the reply's one call (parallel is off): no index
                chunks += [self._chunk({"function_call": {"name": call.name, "arguments": ""}}, None, None),
                           self._chunk({"function_call": {"arguments": call.arguments}}, None, None)]
                continue
            header = {"index": index, "id": call.id, "type": "function",
                      "function": {"name": call.name, "arguments": ""}}
            chunks.append(self._chunk({"tool_calls": [header]}, None, None))
            chunks.append(self._chunk({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]},
                                      None, None))
        return chunks

    def _text_chunks(self, text: str, tokens: Sequence[TokenInfo]) -> list[dict[str, Any]]:
        if self._calls is None:
            if not text and not (tokens and self.logprobs is not None):
                return []
            return [self._chunk({"content": text}, self._logprobs(tokens), None)]
        content, calls = self._calls.push(text)
        chunks = []
        if content or (tokens and self.logprobs is not None):
            chunks.append(self._chunk({"content": content} if content else {}, self._logprobs(tokens), None))
        return chunks + self._call_chunks(calls)

    def _split_chunks(self, thinking: str, answer: str, tokens: Sequence[TokenInfo]) -> list[dict[str, Any]]:
        """A step's thinking, then its answer; the step's log-probability entries go with the first chunk."""
        chunks = []
        if thinking:
            chunks.append(self._chunk({"reasoning_content": thinking}, self._logprobs(tokens), None))
            tokens = ()
        if self._calls is None:
            if answer or (tokens and self.logprobs is not None):
                chunks.append(self._chunk({"content": answer} if answer else {}, self._logprobs(tokens), None))
            return chunks
        return chunks + self._text_chunks(answer, tokens)

    def deltas(self, step: Step) -> list[dict[str, Any]]:
        if self._split is not None:
            return self._split_chunks(*self._split.push(step.text, step.tokens), step.tokens)
        return self._text_chunks(step.text, step.tokens)

    def closing(self, completion: Completion) -> list[dict[str, Any]]:
        chunks: list[dict[str, Any]] = []
        if self._split is not None:  # what it held back: thinking that never closed is all thinking
            chunks += self._split_chunks(*self._split.finish(), ())
        if self._calls is not None:
            content, calls = self._calls.finish()
            if content:
                chunks.append(self._chunk({"content": content}, None, None))
            chunks += self._call_chunks(calls)
        finish = self.tools.finish_reason if self.tools is not None and self._calls_sent else completion.finish_reason
        return chunks + [self._chunk({}, None, finish)]

    def usage_chunk(self, completion: Completion) -> dict[str, Any]:
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": _completion_usage(completion)}


class EventStream:
    """The WSGI body of a streamed reply. Waitress writes each item as it comes and always calls close().

    `group`'s choices and `replies` go in pairs. The stream is made once the choices have their first steps, or
    IDLE_KEEPALIVE_S has passed waiting for them (queued behind a full batch, or reading a long prompt): errors of
    starting within that time are raised here, and so have their HTTP status; a wait past it is shown by an SSE
    comment at once and each IDLE_KEEPALIVE_S after (a proxy cuts a stream silent for a minute, a client's
    headers timeout a request without a status line). `error_body` turns an exception raised mid-stream into an
    OpenAI error object, sent as the last event (the status line has gone out); `on_close` runs once when the
    reply ends, however it ends.
    """

    def __init__(self, group: GenerationGroup, replies: list[ReplyFormat], *, include_usage: bool,
                 error_body: Callable[[Exception], dict[str, Any]], on_close: Callable[["EventStream"], None]):
        self.group, self.replies, self.include_usage = group, replies, include_usage
        self._error_body, self._on_close = error_body, on_close
        self._closed = False
        group.wait(IDLE_KEEPALIVE_S)
        self._chunks = self._events()

    def _started(self) -> Generator[bytes, None, list[GenerationStream]]:
        """The choices' streams, once they have their first steps; a keep-alive meanwhile (see the class)."""
        if not self.group.started:
            yield KEEPALIVE  # the status line goes out with the first bytes: silent since the request came
        while (generations := self.group.wait(IDLE_KEEPALIVE_S)) is None:
            yield KEEPALIVE
        return generations

    def _choice_events(self, index: int, step: Step, opened: bool) -> Iterator[bytes]:
        """The chunks of one choice's step, their choices carrying `index`."""
        reply = self.replies[index]
        chunks = [] if opened else reply.opening(step)
        chunks += reply.deltas(step)
        if step.completion is not None:
            chunks += reply.closing(step.completion)
        for chunk in chunks:
            for choice in chunk["choices"]:
                choice["index"] = index
            yield sse(chunk)

    def _events(self) -> Iterator[bytes]:
        completions: dict[int, Completion] = {}
        opened: set[int] = set()
        try:
            steps = [generation.steps(IDLE_KEEPALIVE_S) for generation in (yield from self._started())]
            running = list(range(len(steps)))
            while running:
                for index in list(running):
                    while (step := next(steps[index])) is None:
                        yield KEEPALIVE
                    yield from self._choice_events(index, step, index in opened)
                    opened.add(index)
                    if step.completion is not None:
                        completions[index] = step.completion
                        running.remove(index)
                if running:
                    # Before the next step, one more write: a client that has closed its socket answers the
                    # previous write with a reset, so this write fails and Waitress stops the stream here,
                    # rather than after another step.
                    yield KEEPALIVE
            if self.include_usage:
                yield sse(self._usage([completions[i] for i in range(len(steps))]))
        except Exception as exc:  # the client hears of it in the stream; the log has the rest
            yield sse(self._error_body(exc))
            return
        yield DONE

    def _usage(self, completions: list[Completion]) -> dict[str, Any]:
        chunk = self.replies[0].usage_chunk(completions[0])  # one choice: its own usage, cached tokens and all
        if len(completions) > 1:  # the prompt counted once, and every choice's tokens
            chunk["usage"] = usage(completions[0].prompt_tokens, sum(c.completion_tokens for c in completions))
        return chunk

    def __iter__(self) -> "EventStream":
        return self

    def __next__(self) -> bytes:
        return next(self._chunks)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._chunks.close()
        finally:
            self.group.close()
            self._on_close(self)
