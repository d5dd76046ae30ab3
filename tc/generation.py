"""The generation loop (SPEC.md 11): embed, run the pipeline, sample, repeat.

The same loop serves the single-process generator and the head: only the `Pipeline` differs (layers in this
process, or layers on workers across the network).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from .model.qwen2 import HeadModel, Stage
from .model.tokenizer import TextTokenizer
from .sampling import SamplingParams, sample


class Pipeline(Protocol):
    """Every decoder layer of the model, in order, wherever they run."""

    def prefill(self, hidden: torch.Tensor, capacity: int) -> torch.Tensor:
        """Start a request: run positions [0, L) and keep a cache for `capacity` positions."""

    def decode(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """Run one more position through the request's caches."""


class LocalPipeline:
    """All stages in this process, each computing in its own dtype."""

    def __init__(self, stages: list[Stage], device: torch.device | str = "cpu"):
        self.stages, self.device = stages, device
        self.caches: list = []

    def _run(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        out_dtype = hidden.dtype
        for stage, cache in zip(self.stages, self.caches):
            hidden = stage(hidden.to(cache.keys.dtype), cache, position)
        return hidden.to(out_dtype)

    def prefill(self, hidden: torch.Tensor, capacity: int) -> torch.Tensor:
        self.caches = [s.new_cache(capacity, next(s.parameters()).dtype, self.device) for s in self.stages]
        return self._run(hidden, 0)

    def decode(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        return self._run(hidden, position)


class IncrementalDecoder:
    """Turns a growing list of token ids into text pieces that never split a multi-byte character.

    A byte-level BPE token can end mid-character; the decoded tail then ends in U+FFFD, so we hold text back
    until the character completes.
    """

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids before this are only context for decoding
        self.read_offset = 0  # ids before this have been emitted as text

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    time_to_first_token_s: float
    decode_s: float  # time for the tokens after the first

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.completion_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


class Generator:
    def __init__(self, head: HeadModel, tokenizer: TextTokenizer, pipeline: Pipeline, dtype: torch.dtype):
        self.head, self.tokenizer, self.pipeline, self.dtype = head, tokenizer, pipeline, dtype
        self.context_length = head.config.max_position_embeddings

    def _next_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.logits(hidden[:, -1:].to(self.dtype))[0, -1]  # [vocab]

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 on_text: Callable[[str], None] | None = None) -> Completion:
        """Generate a completion for `prompt_ids`. Raises ValueError if the prompt leaves no room."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        room = self.context_length - len(prompt_ids)
        if room < 1:
            raise ValueError(f"the prompt is {len(prompt_ids)} tokens; the context holds {self.context_length}")
        max_tokens = min(params.max_tokens, room)
        generator = None
        if params.temperature > 0:
            generator = torch.Generator()
            generator.manual_seed(params.seed if params.seed is not None else int.from_bytes(
                torch.randint(0, 2**31, (1,)).numpy().tobytes()[:4], "little"))
        started = time.perf_counter()
        ids = torch.tensor([prompt_ids])
        hidden = self.pipeline.prefill(self.head.embed(ids), capacity=len(prompt_ids) + max_tokens)
        token = sample(self._next_logits(hidden), params.temperature, params.top_p, generator)
        first_token_at = time.perf_counter()
        tokens: list[int] = []
        text, finish = "", "length"
        decoder = IncrementalDecoder(self.tokenizer)
        longest_stop = max((len(s) for s in params.stop), default=0)
        while True:
            if token in self.tokenizer.eos_token_ids:
                finish = "stop"
                break
            tokens.append(token)
            piece = decoder.push(token)
            if piece:
                text += piece
                if longest_stop:
                    hit = _find_stop(text, params.stop, len(text) - len(piece) - longest_stop + 1)
                    if hit is not None:
                        text, finish = text[:hit], "stop"
                        break
                if on_text is not None:
                    on_text(piece)
            if len(tokens) == max_tokens:
                break
            position = len(prompt_ids) + len(tokens) - 1
            hidden = self.pipeline.decode(self.head.embed(torch.tensor([[token]])), position)
            token = sample(self._next_logits(hidden), params.temperature, params.top_p, generator)
        done = time.perf_counter()
        return Completion(tuple(tokens), text, finish, len(prompt_ids), first_token_at - started,
                          done - first_token_at)


def _find_stop(text: str, stops: tuple[str, ...], search_from: int) -> int | None:
    """Index of the earliest stop string in `text` that starts at or after `search_from`."""
    hits = [i for i in (text.find(s, max(search_from, 0)) for s in stops if s) if i >= 0]
    return min(hits) if hits else None
