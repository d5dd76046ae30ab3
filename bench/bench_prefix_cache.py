"""A conversation's later turns, or chats that share a long system prompt: time to first token with
head.prefix_cache on and off, beside llama.cpp's server.

    python bench/bench_prefix_cache.py [--mode int4] [--turns 4] [--tokens 48] [--only tc|llamacpp]
                                       [--scenario conversation|shared|together]

A chat client sends the whole conversation with every request. In the conversation scenario one conversation opens
with a source file to read (about 1,500 tokens of tc's own code) and a question, and goes on for --turns turns,
each sending back the last reply and a new question. In the shared scenario, --turns chats one after another each
open with the same system prompt (the same file, as an agent's instructions or a code base's context) and ask their
own question; in the together scenario, as many chats with that system prompt arrive at once (an agent's fleet).
Every reply is greedy and --tokens long at most, streamed. For each request it prints the prompt's
tokens, those the server did not read again (tc: `usage.prompt_tokens_details.cached_tokens`; llama.cpp:
`timings.cache_n`), and the time to the first token of the reply.

tc runs as head + 2 workers on loopback (real processes, 2 threads each, bf16 compute, the demo model in --mode),
once with head.prefix_cache on (its default) and once off; llama.cpp as one `llama-server` process with its prompt
cache (`cache_prompt`, on by default), 2 threads, the same weights as bench/vs_llamacpp.py pairs them (int4 beside
Q4_0, fp16 beside bf16). Nothing is asserted: read the ratios of one run on one machine.
"""
from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from _demo import demo_model_dir  # noqa: E402
from bench_batching import demo_cluster, llama_server  # noqa: E402

QUESTIONS = ["What does the Generator class in this file do? Answer in two sentences.",
             "Which method chooses the next token?", "How does it handle stop strings?",
             "Write a one-line docstring for SequenceState.", "What would you rename, and why?",
             "Summarise our conversation in one sentence."]


def chat_turn(port: int, model: str, messages: list[dict], tokens: int) -> dict:
    """One streamed greedy reply: its text, the time to its first token, and the server's usage and timings."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 200, reply.read()
    text, first, usage, timings = "", None, {}, {}
    for line in reply:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        timings = chunk.get("timings") or timings
        for choice in chunk.get("choices", []):
            piece = choice.get("delta", {}).get("content") or ""
            if piece and first is None:
                first = time.perf_counter() - started
            text += piece
    conn.close()
    return {"text": text, "ttft": first if first is not None else float("nan"), "usage": usage, "timings": timings}


def measured(result: dict) -> dict:
    """A reply's prompt tokens, those not read again, and its time to first token, from either server."""
    usage = result["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", result["timings"].get("cache_n", 0))
    return {"prompt": usage.get("prompt_tokens", result["timings"].get("prompt_n", 0) + cached), "cached": cached,
            "ttft": result["ttft"]}


def source_file() -> str:
    return (ROOT / "tc" / "generation.py").read_text()[:6000]


def conversation(port: int, model: str, args: argparse.Namespace) -> list[dict]:
    messages = [{"role": "system", "content": "You are a concise assistant for Python programmers."},
                {"role": "user", "content": f"Here is a file:\n\n```python\n{source_file()}\n```\n\n{QUESTIONS[0]}"}]
    turns = []
    for turn in range(args.turns):
        result = chat_turn(port, model, messages, args.tokens)
        turns.append(measured(result))
        messages += [{"role": "assistant", "content": result["text"]},
                     {"role": "user", "content": QUESTIONS[(turn + 1) % len(QUESTIONS)]}]
    return turns


def shared_system_prompt(port: int, model: str, args: argparse.Namespace) -> list[dict]:
    system = ("You are a concise assistant for Python programmers. Questions are about this file:\n\n"
              f"```python\n{source_file()}\n```")
    return [measured(chat_turn(port, model, [{"role": "system", "content": system},
                                             {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                               args.tokens)) for i in range(args.turns)]


def together(port: int, model: str, args: argparse.Namespace) -> list[dict]:
    system = ("You are a concise assistant for Python programmers. Questions are about this file:\n\n"
              f"```python\n{source_file()}\n```")
    with ThreadPoolExecutor(args.turns) as pool:
        return list(pool.map(lambda i: measured(chat_turn(port, model, [
            {"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            args.tokens)), range(args.turns)))


SCENARIOS = {"conversation": conversation, "shared": shared_system_prompt, "together": together}


def tc_turns(args: argparse.Namespace, workdir: Path, prefix_cache: bool) -> list[dict]:
    with demo_cluster(args.mode, workdir, f"prefix-{prefix_cache}", prefix_cache=prefix_cache) as cluster:
        return SCENARIOS[args.scenario](cluster.api_port, demo_model_dir().name, args)


def llamacpp_turns(args: argparse.Namespace, workdir: Path) -> list[dict]:
    slots = args.turns if args.scenario == "together" else 1  # a slot each, as tc's batch has a place each
    with llama_server(args.mode, slots, 8192 * slots, workdir) as port:
        return SCENARIOS[args.scenario](port, "model", args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="int4", choices=["fp16", "int8", "int4"])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--only", choices=["tc", "llamacpp"])
    parser.add_argument("--scenario", default="conversation", choices=list(SCENARIOS))
    args = parser.parse_args()
    setups: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.only != "llamacpp":
            setups["tc, prefix_cache on"] = tc_turns(args, Path(tmp), True)
            setups["tc, prefix_cache off"] = tc_turns(args, Path(tmp), False)
        if args.only != "tc":
            setups["llama-server"] = llamacpp_turns(args, Path(tmp))
    reference = setups.get("tc, prefix_cache off")
    print(f"| setup ({args.mode}, {args.scenario}) | request | prompt tokens | not read again | TTFT s "
          "| x prefix_cache off |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, turns in setups.items():
        for i, turn in enumerate(turns):
            ratio = f"{reference[i]['ttft'] / turn['ttft']:.2f}" if reference else "-"
            print(f"| {name} | {i + 1} | {turn['prompt']} | {turn['cached']} | {turn['ttft']:.3f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
