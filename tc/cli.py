"""Command line: `tc head TOPOLOGY`, `tc worker --join HOST:PORT`, `tc plan TOPOLOGY`, `tc generate ...`."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from .draft import MAX_LIMIT as MAX_DRAFT_TOKENS

log = logging.getLogger("tc")
LOG_LEVELS = ["debug", "info", "warning", "error"]


def _port_number(text: str) -> int | None:
    """A port written in ASCII digits, 0-65535; None for anything else."""
    if text.isascii() and text.isdigit() and len(text) <= 5 and int(text) <= 65535:
        return int(text)
    return None


def _host_port(value: str) -> tuple[str, int]:
    from .topology import AddressError, parse_host_port

    try:  # the topology's own rules: an IPv6 host in brackets, a port 1-65535; the example is a join address,
        # not an API one (0.0.0.0:8000 there had workers dial the API port)
        address = parse_host_port(value, example="HEAD_HOST:7001, the head's head.listen address")
    except AddressError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return address.host, address.port


def _port(value: str) -> int:
    port = _port_number(value)
    if port is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port; use 0-65535 (0: any free port)")
    return port


def _in_range(value: str, kind: type, low: float, high: float) -> float:
    """`value` as a number of `kind` (int or float) in [low, high]: NaN, inf and words are refused too."""
    try:
        number = kind(value)
    except ValueError:
        number = None
    if number is None or not low <= number <= high:
        word = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{value!r} is not {word} from {low:g} to {high:g}")
    return number


# Flags that stand in for a topology key take that key's range (tc.topology, imported when such a flag is given:
# it brings torch), so that nothing passes here that the key would refuse.
def _threads(value: str) -> int:
    from .topology import MAX_THREADS
    return int(_in_range(value, int, 1, MAX_THREADS))


def _draft_tokens(value: str) -> int:
    return int(_in_range(value, int, 0, MAX_DRAFT_TOKENS))


def _gib(value: str) -> float:
    from .topology import MAX_MEMORY_GB
    number = _positive_float(value)  # (0, MAX_MEMORY_GB], as the key's
    if number > MAX_MEMORY_GB:
        raise argparse.ArgumentTypeError(f"{value!r} GiB is more than {MAX_MEMORY_GB:g}")
    return number


def _mib(value: str) -> float:
    from .topology import SIZE_RANGE_MB
    return _in_range(value, float, *SIZE_RANGE_MB)


def _wait_s(value: str) -> float:
    from .topology import HEARTBEAT_RANGE_S
    return _in_range(value, float, *HEARTBEAT_RANGE_S)


def _positive_float(value: str) -> float:
    """A finite number above 0."""
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} is not a number greater than 0")
    return number


def build_parser() -> argparse.ArgumentParser:
    from . import version_line

    parser = argparse.ArgumentParser(prog="tc", description="TrueCluster: one LLM across your machines.")
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print the tc release and exit (the head and every worker must run the same)")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                        help="how much to log (default info; also after the command, where it wins)")
    sub = parser.add_subparsers(dest="command", required=True)
    # also after the command (`tc worker --join ... --log-level debug`), where it wins over one before it
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS, help="(default info)")

    head = sub.add_parser("head", parents=[common], help="run the head: HTTP API, tokenizer, sampling; workers join it")
    head.add_argument("topology", type=Path, help="the topology YAML file")
    head.add_argument("--api-port", type=_port, help="override head.api's port")
    head.add_argument("--listen-port", type=_port, help="override head.listen's port")

    worker = sub.add_parser("worker", parents=[common],
                            help="run a worker that joins a head and serves a range of layers")
    worker.add_argument("--join", type=_host_port, metavar="HOST:PORT",
                        help="the head's listen address (required unless --bench)")
    worker.add_argument("--node-id", help="the topology entry to fill (default: the first free one that fits)")
    worker.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default auto)")
    worker.add_argument("--hf-cache-dir", type=Path, help="HuggingFace cache directory for model downloads")
    worker.add_argument("--max-memory-gb", type=_gib, metavar="GIB",
                        help="memory this worker may use, in GiB (2**30 bytes) like the topology's max_memory_gb; "
                             "its layers' weights must fit in it (default: what the device reports)")
    worker.add_argument("--threads", type=_threads, help="torch threads (default: the topology's, else all cores)")
    worker.add_argument("--retry-max-s", type=_wait_s, default=30.0, help="longest wait between join attempts")
    worker.add_argument("--join-token-file", type=Path, metavar="PATH",
                        help="file holding the cluster's join token (or set TC_JOIN_TOKEN / TC_JOIN_TOKEN_FILE)")
    worker.add_argument("--head-timeout-s", type=_wait_s, metavar="S",
                        help="rejoin when the head sends nothing for this long (default 30)")
    worker.add_argument("--max-frame-mb", type=_mib, metavar="MIB",
                        help="largest frame accepted from the head (default 256)")
    worker.add_argument("--peer-port", type=int, default=0, metavar="PORT",
                        help="port on which the stage before this one passes hidden states straight here, on the "
                             "address this worker reaches the head from (default 0: any free port)")
    worker.add_argument("--peer-host", metavar="HOST",
                        help="the address the other workers reach this one's peer port at, where it differs from "
                             "the one it reaches the head from (a NAT forwarding that port to it)")
    worker.add_argument("--no-direct-hops", action="store_true",
                        help="take hidden states from the head only (no peer port): for a machine the other "
                             "workers cannot reach")
    worker.add_argument("--bench", action="store_true",
                        help="measure what a layer costs on this machine's device, print it and exit (the figures "
                             "a topology's nodes[].speed takes)")
    worker.add_argument("--bench-dir", type=Path, metavar="DIR",
                        help="where measured speeds are kept between starts (default $TC_CACHE_DIR/bench, else "
                             "~/.cache/truecluster/bench)")
    worker.add_argument("--no-bench", action="store_true",
                        help="do not measure before joining: the head then plans this node without its speed")

    plan = sub.add_parser("plan", parents=[common],
                          help="print the layer plan for a topology without starting anything")
    plan.add_argument("topology", type=Path, help="the topology YAML file")
    plan.add_argument("--explain", action="store_true",
                      help="add memory headroom and predicted time per stage and hop, predicted tokens/s, and what "
                           "would most improve them (from nodes[].speed; the head's own speed is measured here)")

    gen = sub.add_parser("generate", parents=[common],
                         help="run the whole model in this process (the single-machine baseline)")
    gen.add_argument("--model", required=True, type=Path, help="a local model directory")
    gen.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass (default 1: all)")
    gen.add_argument("--seed", type=int, help="seed for sampling: the same seed gives the same text again")
    gen.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"],
                     help="compute dtype (default bf16)")
    gen.add_argument("--threads", type=_threads, help="torch threads (default: all cores)")
    gen.add_argument("--draft-tokens", type=_draft_tokens, default=MAX_DRAFT_TOKENS, metavar="N",
                     help="tokens a greedy run may guess ahead from its own text and check in one step; 0: none "
                          f"(default {MAX_DRAFT_TOKENS})")
    return parser


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from .local import load_local_generator
    from .sampling import SamplingParams

    try:  # checked before the model loads: a bad value should not cost the wait
        # a plain prompt's text goes on as a completion's does (its first word's space kept); a chat reply's starts
        # at its first word
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed, continues_prompt=not args.chat)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = load_local_generator(args.model, args.dtype, draft_tokens=args.draft_tokens)
    prompt = args.prompt
    if args.chat:
        prompt = generator.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    ids = generator.tokenizer.encode(prompt, add_special_tokens=not args.chat)  # a template writes its own
    try:
        result = generator.generate(ids, params, on_text=lambda piece: print(piece, end="", flush=True))
    except ValueError as exc:  # a prompt the model cannot take: empty, or longer than its context
        log.error("%s", exc)
        return 2
    print()
    print(f"[{result.prompt_tokens} prompt tokens, {result.completion_tokens} generated, "
          f"first token {result.time_to_first_token_s * 1000:.0f} ms, "
          f"{result.decode_tokens_per_s:.1f} tokens/s decode, finish: {result.finish_reason}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:
        return _dispatch(args)
    except _user_errors() as exc:
        log.error("%s", exc)
        return 2


def exit_process(code: int) -> NoReturn:
    """End the process with `code` once its output is written, without Python's finalization.

    The head and workers leave daemon threads running by design (a worker's compute thread finishing a step, a peer
    link's reader decoding a frame). Finalization ends such threads with pthread_exit as they next take the GIL,
    and one inside a torch operator then unwinds through C++ code that may not be left that way: the runtime
    calls std::terminate and the process dies of SIGABRT instead of exiting with its status. Nothing is left to do
    at this point but flush what was logged and printed.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it anyway
            pass
    os._exit(code)


def _leave_at_once_on_signal() -> None:
    """Until the head or worker sets its own handlers (once it serves, where leaving tells the others), SIGINT and
    SIGTERM end the process at once, status 0, with a line that says so: a start (a download, a load, the speed
    probe) is minutes on a large model, and the default handlers ended it with a traceback, or killed it without
    a word while torch ran, or aborted it."""
    import signal

    from .signals import on_signals

    def leave(sig: signal.Signals) -> None:
        log.info("%s received while starting: exiting", sig.name)
        exit_process(0)

    on_signals((signal.SIGINT, signal.SIGTERM), leave)


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors in what the user gave us (files, settings): one line, no traceback."""
    from .model.config import ConfigError
    from .model.tokenizer import TokenizerError
    from .model.weights import WeightsError
    from .model_source import ModelSourceError
    from .planner import PlanError
    from .topology import TopologyError

    return (ConfigError, TokenizerError, WeightsError, ModelSourceError, PlanError, TopologyError)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "generate":
        return run_generate(args)
    if args.command == "plan":
        from .head.main import run_plan

        return run_plan(args)
    if args.command == "head":
        _leave_at_once_on_signal()
        from .head.main import run_head

        return run_head(args)
    if args.command == "worker":
        _leave_at_once_on_signal()
        from .worker.main import run_worker

        return run_worker(args)
    raise AssertionError(args.command)
