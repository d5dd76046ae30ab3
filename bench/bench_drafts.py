"""Drafts (tc/draft.py) on the demo model: greedy decode speed with guesses checked in one step, against one token a
step, in one process, the two taking turns.

    python bench/bench_drafts.py [--modes int4] [--tokens 200] [--repeat 3] [--draft-tokens 15]

Three chat requests: a code edit that repeats most of its input (a function renamed in a whole file), the same with
the file sent as OpenAI's `prediction`, and a request for new code, which repeats little. For each, decode tokens/s
(tokens after the first over the time after the first) with --draft-tokens and with none, the mean (± standard
deviation) of --repeat runs, their ratio, the tokens made a step, and whether both made the same tokens (they
should: greedy text is the same up to a genuine tie, docs/design.md "Drafts"). Nothing is asserted.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from _demo import demo_model_dir  # noqa: E402
from tc.draft import MAX_LIMIT  # noqa: E402

SOURCE = ROOT / "tc" / "model" / "kv_cache.py"  # the file to edit: ~80 lines of code and docstrings


def requests(tokenizer) -> dict[str, tuple[list[int], tuple[int, ...]]]:
    """name -> (prompt ids, prediction ids)."""
    code = SOURCE.read_text()
    edit = (f"Rename the class KVCache to LayerCache everywhere in this file. Reply with the whole file only, in a "
            f"Python code block.\n\n```python\n{code}```")
    new = "Write a Python module that parses ISO 8601 dates and durations without any library, with docstrings."

    def prompt(text: str) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))

    return {"edit": (prompt(edit), ()), "edit + prediction": (prompt(edit), tuple(tokenizer.encode(code))),
            "new code": (prompt(new), ())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["int4"], choices=["fp16", "int8", "int4"])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--draft-tokens", type=int, default=MAX_LIMIT)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from tc.local import load_local_generator
    from tc.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    print(f"| mode | request | one token a step, tok/s | drafts ({args.draft_tokens}), tok/s | ratio | tokens a step "
          "| same tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode in args.modes:
        generator = load_local_generator(demo_model_dir(), "bf16", quant=mode)
        for name, (ids, prediction) in requests(generator.tokenizer).items():
            params = SamplingParams(max_tokens=args.tokens, temperature=0, draft_reference=prediction)
            generator.draft_tokens = 0
            generator.generate(ids, SamplingParams(max_tokens=2, temperature=0))  # warm-up
            rates: dict[int, list[float]] = {0: [], args.draft_tokens: []}
            tokens: dict[int, tuple[int, ...]] = {}
            tokens_a_step = 0.0
            for _ in range(args.repeat):
                for draft in rates:  # taking turns: a machine's drift falls on both
                    generator.draft_tokens = draft
                    before = generator.accepted
                    completion = generator.generate(ids, params)
                    rates[draft].append(completion.decode_tokens_per_s)
                    tokens[draft] = completion.token_ids
                    if draft:
                        made = completion.completion_tokens
                        tokens_a_step = made / (made - (generator.accepted - before))
            plain, drafted = (statistics.mean(r) for r in rates.values())
            spread = {d: statistics.stdev(r) if len(r) > 1 else 0.0 for d, r in rates.items()}
            print(f"| {mode} | {name} | {plain:.1f} ± {spread[0]:.1f} | "
                  f"{drafted:.1f} ± {spread[args.draft_tokens]:.1f} | {drafted / plain:.2f} | {tokens_a_step:.2f} | "
                  f"{'yes' if tokens[0] == tokens[args.draft_tokens] else 'no'} ({len(tokens[0])} tokens) |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
