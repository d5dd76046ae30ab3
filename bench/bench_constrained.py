#!/usr/bin/env python3
"""What constrained decoding costs per token, and whether sampled structured replies stay valid.

Runs JSON-schema-constrained generations on the demo model (Qwen2.5-Coder-0.5B-Instruct, 151,936 logits) in
one process, through the same generation loop the head runs, and reports per token:

- mask: computing the grammar's allowed tokens and applying them to the logits (llguidance + torch);
- head: the head's own work for a token (final norm, lm_head, choosing), the smallest per-token time of any
  deployment, so the strictest comparison;
- step: a whole decode step here (every layer in this process; on a cluster the layers' time is larger still);
- the critical path: the generation loop makes each mask on a helper thread while the layers run (it depends only
  on the tokens chosen so far), so what a mask adds to a token is the decode step with a constraint minus the same
  step without one, over the same prompts and lengths in the same run.

Then it checks `--requests` sampled replies at `--temperature` against their schema with `jsonschema`.
The target is a mask cost of at most 10% of the head's per-token time.

On a host with few cores, torch's OpenMP threads spin for a while after each operation and take the CPU the
grammar engine needs right after the forward pass: with 2 busy cores the mask measured 58 ms a token under the
default policy and 0.85 ms with OMP_WAIT_POLICY=PASSIVE (which sped up the decode step itself as well). Run
the head (and this bench) with OMP_WAIT_POLICY=PASSIVE on such hosts.

Usage: python bench/bench_constrained.py [--requests 50] [--temperature 0.9] [--dtype fp32]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from _demo import demo_model_dir  # noqa: E402
from tc.constraint import Grammar, GrammarEngine  # noqa: E402
from tc.local import load_local_generator  # noqa: E402
from tc.sampling import SamplingParams, choose, new_rng  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40},
    "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
    "population_millions": {"type": "number"}, "is_capital": {"type": "boolean"}},
    "required": ["city", "country", "landmarks", "population_millions", "is_capital"],
    "additionalProperties": False}
CITIES = ["Paris", "Rome", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Seoul", "Lagos"]


class TimedGrammar:
    """The grammar, with the time of each mask (computed, and applied to a logits-sized tensor) recorded."""

    def __init__(self, grammar: Grammar, vocab_size: int, times: list[float]):
        self.grammar, self.times = grammar, times
        self.logits = torch.zeros(vocab_size)

    def start(self) -> "TimedGrammar.State":
        return TimedGrammar.State(self.grammar.start(), self.logits, self.times)

    class State:
        def __init__(self, state, logits: torch.Tensor, times: list[float]):
            self.state, self.logits, self.times = state, logits, times

        def allowed(self) -> torch.Tensor:
            started = time.perf_counter()
            allowed = self.state.allowed()
            self.logits.masked_fill(~allowed, float("-inf"))  # what choose() does with it
            self.times.append(time.perf_counter() - started)
            return allowed

        def advance(self, token_id: int) -> None:
            self.state.advance(token_id)


def head_token_time(generator, steps: int = 30) -> float:
    """Median time of the head's own work for one token: final norm, lm_head and the choice."""
    hidden = torch.randn(1, 1, generator.head.config.hidden_size)
    params, rng, times = SamplingParams(temperature=0.9), new_rng(0), []
    for _ in range(steps):
        started = time.perf_counter()
        logits = generator._logits(hidden)[0, -1]
        choose(logits, params, None, rng)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    args = parser.parse_args()

    generator = load_local_generator(demo_model_dir(), args.dtype)
    tokenizer, vocab = generator.tokenizer, generator.head.config.vocab_size
    started = time.perf_counter()
    engine = GrammarEngine.load(tokenizer.tokenizer, vocab, tokenizer.eos_token_ids)
    print(f"grammar engine over {vocab} logits built in {time.perf_counter() - started:.2f}s (once per head)")
    mask_times: list[float] = []
    constraint = TimedGrammar(engine.json_schema(SCHEMA), vocab, mask_times)

    valid, step_times, lengths = 0, [], []
    for i in range(args.requests):
        city = CITIES[i % len(CITIES)]
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"Describe {city} as JSON."}])
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=i,
                                constraint=constraint)
        completion = generator.generate(tokenizer.encode(prompt), params)
        lengths.append(completion.completion_tokens)
        if completion.completion_tokens > 1:
            step_times.append(completion.decode_s / (completion.completion_tokens - 1))
        try:
            jsonschema.validate(json.loads(completion.text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            print(f"request {i}: INVALID ({completion.finish_reason}): {exc}: {completion.text!r}")
        print(f"request {i + 1}/{args.requests}: {completion.completion_tokens} tokens, {completion.finish_reason}")

    free_steps = []  # the same prompts and lengths without the constraint: the step's own time
    for i in range(args.requests):
        city = CITIES[i % len(CITIES)]
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"Describe {city} as JSON."}])
        params = SamplingParams(max_tokens=lengths[i], temperature=args.temperature, seed=i, ignore_eos=True)
        completion = generator.generate(tokenizer.encode(prompt), params)
        if completion.completion_tokens > 1:
            free_steps.append(completion.decode_s / (completion.completion_tokens - 1))
    mask = statistics.mean(mask_times)
    head = head_token_time(generator)
    step = statistics.median(step_times) if step_times else float("nan")
    free = statistics.median(free_steps) if free_steps else float("nan")
    print(f"\n{valid}/{args.requests} replies valid against the schema at temperature {args.temperature}")
    p99 = sorted(mask_times)[int(0.99 * (len(mask_times) - 1))]
    print(f"mask per token: mean {mask * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms, over {len(mask_times)} tokens")
    print(f"head per token (norm + lm_head + choice): {head * 1e3:.2f} ms -> mask is {100 * mask / head:.1f}%")
    print(f"whole decode step here: {step * 1e3:.1f} ms -> mask is {100 * mask / step:.2f}%")
    added = step - free
    print(f"on the critical path (mask made while the layers run): step {step * 1e3:.1f} ms constrained against "
          f"{free * 1e3:.1f} ms free -> {added * 1e3:+.2f} ms a token, {100 * added / head:+.1f}% of the head's time")
    return 0 if valid == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
