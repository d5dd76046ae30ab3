#!/usr/bin/env python3
"""llguidance (what tc uses) beside xgrammar and outlines-core on the demo model's vocabulary: how long each takes
to prepare the bench_constrained.py schema, and its mask time per token along one valid reply.

    pip install --no-deps --target /tmp/grammar_engines xgrammar apache-tvm-ffi outlines-core  # not tc's deps
    python bench/compare_grammar_engines.py [--engines-dir /tmp/grammar_engines]

Every engine walks the same reply (a JSON object valid under the schema, tokenized by the demo tokenizer): at each
token it computes the mask of allowed tokens, checks that the next token is in it, and accepts it. Figures are
medians over the reply's tokens; an engine that cannot be imported or built is reported with its error. Not quite
like for like: llguidance's figure includes unpacking its bits into the bool [vocab] mask tc applies, xgrammar's
is its packed bitmask and outlines-core's its list of allowed ids (their precomputed indexes answer most states
at once, and pay for it in preparation). Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from _demo import demo_model_dir  # noqa: E402
from bench_constrained import SCHEMA  # noqa: E402
from tc.constraint import GrammarEngine  # noqa: E402
from tc.model.tokenizer import TextTokenizer  # noqa: E402

REPLY = json.dumps({"city": "Paris", "country": "France", "landmarks": ["Eiffel Tower", "Louvre"],
                    "population_millions": 2.1, "is_capital": True})


def walk(name: str, prepare, ids: list[int]) -> str:
    """prepare() -> (mask(): bool-or-bits tensor accessor, allows(mask, token) -> bool, accept(token))."""
    started = time.perf_counter()
    try:
        mask, allows, accept = prepare()
    except Exception as exc:  # a report, not a failure: the engine could not be used here
        return f"| {name} | - | - | could not prepare: {type(exc).__name__}: {str(exc)[:120]} |"
    built = time.perf_counter() - started
    times = []
    for token in ids:
        t0 = time.perf_counter()
        m = mask()
        times.append(time.perf_counter() - t0)
        if not allows(m, token):
            return f"| {name} | {built:.2f} | - | refused token {token} of a valid reply |"
        accept(token)
    return f"| {name} | {built:.2f} | {1e3 * statistics.median(times):.3f} (p90 " \
           f"{1e3 * sorted(times)[int(0.9 * (len(times) - 1))]:.3f}) | walked {len(ids)} tokens |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines-dir", default="/tmp/grammar_engines")
    args = parser.parse_args()
    sys.path.append(args.engines_dir)
    model_dir = demo_model_dir()
    tokenizer = TextTokenizer.load(model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    ids = tokenizer.encode(REPLY)
    rows = ["| engine | prepare s | mask ms per token (median) | |", "|---|---|---|---|"]

    def llguidance():
        engine = GrammarEngine.load(tokenizer.tokenizer, vocab, tokenizer.eos_token_ids)
        state = engine.json_schema(SCHEMA).start()
        return state.allowed, lambda m, t: bool(m[t]), state.advance

    def xgrammar():
        import xgrammar as xgr
        from transformers import AutoTokenizer
        info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir), vocab_size=vocab)
        compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab)

        def mask():
            matcher.fill_next_token_bitmask(bitmask)
            return bitmask

        return mask, lambda m, t: bool((m[0, t // 32] >> (t % 32)) & 1), matcher.accept_token

    def outlines_core():
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
        hf = tokenizer.tokenizer
        eos = sorted(tokenizer.eos_token_ids)[0]
        pieces: dict[str, list[int]] = {}
        from tc.head.streaming import _BYTE_DECODER  # byte-level BPE's stand-in characters -> bytes
        for token_id in range(hf.get_vocab_size()):
            piece = hf.id_to_token(token_id)
            if piece is None or token_id == eos:
                continue
            if all(ch in _BYTE_DECODER for ch in piece):  # outlines-core wants the token's text, not BPE's symbols
                piece = bytes(_BYTE_DECODER[ch] for ch in piece).decode("utf-8", errors="replace")
            pieces.setdefault(piece, []).append(token_id)
        # the reply separates as json.dumps does (", " and ": "): one optional space between items
        index = Index(build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=r" ?"), Vocabulary(eos, pieces))
        guide = Guide(index)
        return guide.get_tokens, lambda m, t: t in m, guide.advance

    for name, prepare in (("llguidance", llguidance), ("xgrammar", xgrammar), ("outlines-core", outlines_core)):
        rows.append(walk(name, prepare, ids))
        print(rows[-1], flush=True)
    print(f"\nschema: bench_constrained.SCHEMA; reply: {len(ids)} tokens; vocabulary {vocab}; torch threads "
          f"{torch.get_num_threads()}")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
