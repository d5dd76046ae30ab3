"""tc against llama.cpp on the demo model, side by side: the benchmark the project's speed targets are judged by.

    python bench/vs_llamacpp.py [--modes fp16 int8 int4] [--tokens 64] [--prompt-tokens 512] [--depth 0]
                                [--repeat 3] [--rounds 1] [--only tc|llamacpp] [--skip-build]

For each weight mode it pairs tc with the llama.cpp format of about the same size: tc fp16 (bf16 compute) with
GGUF bf16, tc int8 with Q8_0, tc int4 with Q4_0 (llama.cpp groups by 32, tc by the topology's default 128). Under
int4 both keep the output matrix at 8 bits: tc's lm_head stays int8, and llama-quantize's usual Q6_K needs rows of
a multiple of 256, which 896 is not, so it falls back to Q8_0. Four setups run each mode:

- llama.cpp, one process: ``llama-bench -t 2 -p 512 -n 64 -o json``;
- llama.cpp split over two ``ggml-rpc-server -t 2`` on loopback (``--rpc``, ``-ts 1/1``: half the layers each);
- tc, one process (``tc.local``, the machinery of ``python -m tc generate``);
- tc, head + 2 workers on loopback (real processes, through the HTTP API).

Every process gets 2 threads. Prefill is tokens/s over a prompt of --prompt-tokens tokens (the first tokens of
bench/data/perplexity.txt, sent as token ids; tc's figure includes choosing the first token). Decode is tokens/s
over --tokens new tokens from an almost empty context, as llama-bench's tgN measures it: tc decodes after a
one-token prompt, with ``ignore_eos`` so every run makes exactly that many tokens; through the API the decode time
is a (tokens + 1)-token request minus a 1-token one, so the HTTP round trip and the one-token prefill cancel.
Figures are the mean (± standard deviation) of --repeat runs after a warm-up. Nothing is asserted. tc runs
without drafts (head.draft_tokens 0), one token a step as llama-bench makes them: a greedy run's guesses from its own
text would count its repetitions as speed (bench/bench_drafts.py measures them).

With --depth N both run after a context of N tokens already read, as a long conversation does (llama-bench's
``-d N``): decode is --tokens new tokens after an N-token prompt; tc's prefill is --prompt-tokens more tokens read
after those N, timed as an (N + prompt)-token prompt minus an N-token one, since tc reads a prompt whole.

With --rounds N every setup of every mode is measured N times, the setups taking turns in an order reversed every
other round, and each figure is the mean (± standard deviation) of its N rounds' means: on a machine whose speed
drifts by tens of per cent within minutes (a VM whose host is shared), measuring one setup after the other lets
the drift decide the ratios, and taking turns spreads it over all of them. Each round starts its processes afresh,
which matters there too: on a 2-core EPYC VM a process's memory streamed at one of two speeds for its whole life
(the demo's int8 lm_head in 2.6 or 4.0 ms a step, six one-process runs in a row, same command), so one round's
ratio can land a third either side of the next's; three rounds or more say what the machine does.

On first use the script builds llama.cpp from the source vendored in the ``llama-cpp-python`` sdist on PyPI
(fetched with pip, version and sha256 pinned): Release, ``nice``, ``-j2``, only llama-bench, llama-quantize,
ggml-rpc-server and llama-server. It never builds with ``GGML_NATIVE``: on x86 the instruction sets come from
/proc/cpuinfo, and AMX stays off (where a VM does not permit AMX tiles a native build dies with SIGILL in
prompt processing). It then converts the demo model to GGUF bf16 with the vendored ``convert_hf_to_gguf.py``
(gguf from the vendored gguf-py; sentencepiece, which it imports, pip-installed into the cache where missing)
and quantizes that to Q8_0 and Q4_0. Everything is cached under ``$TC_CACHE_DIR`` (else ``~/.cache/truecluster``)::

    <cache>/llamacpp/<version>/src/               the vendored llama.cpp tree
    <cache>/llamacpp/<version>/build-<flags>/     one build per set of CPU options
    <cache>/llamacpp/<version>/gguf/*.gguf        the converted demo model
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from _demo import builder, demo_model_dir  # noqa: E402
from cluster import Cluster, Process, free_port, write_topology  # noqa: E402

log = logging.getLogger("vs_llamacpp")

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the sdist this script was tested with; its vendor/llama.cpp is what we build
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDORED = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp"
TARGETS = ("llama-bench", "llama-quantize", "ggml-rpc-server", "llama-server")
GGUF_TYPES = {"fp16": "bf16", "int8": "q8_0", "int4": "q4_0"}  # tc weight mode -> llama.cpp type of about its size
MODEL_SLUG = "qwen2.5-coder-0.5b-instruct"
THREADS = 2  # per process, for both tools: the machine this was written for has 2 cores
PROMPT_TEXT = ROOT / "bench" / "data" / "perplexity.txt"
MARKER = ".complete"
SENTENCEPIECE = "sentencepiece>=0.1.98,<0.3.0"  # as the vendored requirements/requirements-convert_legacy_llama.txt

# x86 instruction sets: cmake option -> the /proc/cpuinfo flags it needs. GGML_AVX512 compiles with
# -mavx512{f,cd,vl,dq,bw} all at once, and the three extensions are only used inside its code paths.
_AVX512 = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")
X86_OPTIONS = (
    ("GGML_SSE42", ("sse4_2",)), ("GGML_AVX", ("avx",)), ("GGML_AVX2", ("avx2",)), ("GGML_BMI2", ("bmi2",)),
    ("GGML_FMA", ("fma",)), ("GGML_F16C", ("f16c",)), ("GGML_AVX_VNNI", ("avx_vnni",)), ("GGML_AVX512", _AVX512),
    ("GGML_AVX512_VBMI", (*_AVX512, "avx512vbmi")), ("GGML_AVX512_VNNI", (*_AVX512, "avx512_vnni")),
    ("GGML_AVX512_BF16", (*_AVX512, "avx512_bf16")),
)
# Always off, present or not: a hypervisor may advertise AMX yet not permit its tiles (SIGILL on `tileloadd`).
ALWAYS_OFF = ("GGML_NATIVE", "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
COMMON_CMAKE = (
    "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_RPC=ON", "-DGGML_CCACHE=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else the server's web UI is downloaded at build time; it is not needed here
)


class BenchError(RuntimeError):
    """A step could not run; the message says what to do."""


@dataclass(frozen=True)
class Rate:
    mean: float  # tokens/s
    stdev: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Rate":
        return cls(statistics.fmean(samples), statistics.stdev(samples) if len(samples) > 1 else 0.0)

    def __str__(self) -> str:
        return f"{self.mean:7.1f} ±{self.stdev:5.1f}"


@dataclass(frozen=True)
class Measured:
    prefill: Rate
    decode: Rate


# ----------------------------------------------------------------------------------------------------------
# Pure parts


def cpuinfo_flags(cpuinfo: str) -> frozenset[str]:
    """The instruction-set flags of the first processor in the text of /proc/cpuinfo (x86 names its line `flags`)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    raise BenchError("/proc/cpuinfo has no 'flags' line; cannot tell which x86 instruction sets to build for")


def cmake_cpu_options(machine: str, flags: frozenset[str]) -> tuple[str, ...]:
    """The CPU options of the llama.cpp build: on x86 each instruction set on exactly when every flag it needs is
    present, and GGML_NATIVE and AMX always off; elsewhere none, so cmake picks its defaults."""
    if not is_x86(machine):
        return ()
    chosen = [f"-D{option}={'ON' if set(needs) <= flags else 'OFF'}" for option, needs in X86_OPTIONS]
    return (*(f"-D{option}=OFF" for option in ALWAYS_OFF), *chosen)


def is_x86(machine: str) -> bool:
    return machine.lower() in ("x86_64", "amd64", "i386", "i686")


def parse_llama_bench(output: str) -> Measured:
    """Prefill (the ppN test) and decode (the tgN test) from `llama-bench -o json` output.

    Raises BenchError when the output is not that JSON or lacks either test.
    """
    try:
        records = json.loads(output)
    except json.JSONDecodeError as exc:
        raise BenchError(f"llama-bench did not print JSON ({exc}); was it run with -o json?") from exc
    if not isinstance(records, list):
        raise BenchError("llama-bench's JSON is not a list of tests")
    found: dict[str, Rate] = {}
    for record in records:
        try:
            prompt, gen = int(record["n_prompt"]), int(record["n_gen"])
            rate = Rate(float(record["avg_ts"]), float(record["stddev_ts"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise BenchError(f"a llama-bench record lacks n_prompt, n_gen, avg_ts or stddev_ts: {record!r}") from exc
        if prompt > 0 and gen == 0:
            found["prefill"] = rate
        elif gen > 0 and prompt == 0:
            found["decode"] = rate
    missing = {"prefill", "decode"} - found.keys()
    if missing:
        raise BenchError(f"llama-bench's output has no {' or '.join(sorted(missing))} test; run it with -p N -n N")
    return Measured(found["prefill"], found["decode"])


def round_order(setups: Sequence[str], round_number: int) -> list[str]:
    """The order the setups take their turns in a round: as given in even rounds, reversed in odd ones, so that
    none is always first or always last while the machine drifts."""
    return list(setups) if round_number % 2 == 0 else list(reversed(setups))


def pool_rounds(rounds: Sequence[Measured]) -> Measured:
    """One setup's figures over several rounds: the mean and standard deviation of the rounds' means (a single
    round's figures as they are)."""
    if len(rounds) == 1:
        return rounds[0]
    return Measured(Rate.of([m.prefill.mean for m in rounds]), Rate.of([m.decode.mean for m in rounds]))


def ratio(value: Rate, reference: Rate | None) -> str:
    return f"{value.mean / reference.mean:.2f}x" if reference is not None and reference.mean > 0 else "-"


def format_table(results: dict[tuple[str, str], Measured], modes: Sequence[str]) -> str:
    """One row per (weight mode, setup) that ran; ratios against llama.cpp's one process and its RPC split."""
    head = (f"{'setup':20s} {'weights':7s} {'prefill tok/s':>14s} {'decode tok/s':>14s} "
            f"{'prefill vs 1p':>13s} {'decode vs 1p':>12s} {'prefill vs rpc':>14s} {'decode vs rpc':>13s}")
    lines = [head, "-" * len(head)]
    for mode in modes:
        for setup in SETUPS:
            row = results.get((mode, setup))
            if row is None:
                continue
            cells = []
            for reference_setup in (LLAMA_ONE, LLAMA_RPC):
                reference = None if setup == reference_setup else results.get((mode, reference_setup))
                cells += [ratio(row.prefill, reference and reference.prefill),
                          ratio(row.decode, reference and reference.decode)]
            weights = GGUF_TYPES[mode].upper() if setup in (LLAMA_ONE, LLAMA_RPC) else mode
            lines.append(f"{setup:20s} {weights:7s} {row.prefill!s:>14s} {row.decode!s:>14s} "
                         f"{cells[0]:>13s} {cells[1]:>12s} {cells[2]:>14s} {cells[3]:>13s}")
    return "\n".join(lines)


LLAMA_ONE, LLAMA_RPC = "llama.cpp 1 process", "llama.cpp RPC x2"
TC_ONE, TC_CLUSTER = "tc 1 process", "tc head + 2 workers"
SETUPS = (LLAMA_ONE, LLAMA_RPC, TC_ONE, TC_CLUSTER)


# ----------------------------------------------------------------------------------------------------------
# llama.cpp: fetch, build, convert


def llamacpp_cache() -> Path:
    return builder().default_cache_dir() / "llamacpp" / LLAMA_CPP_PYTHON_VERSION


def this_machines_cpu_options() -> tuple[str, ...]:
    """The CPU options for a build that runs on this machine."""
    machine = platform.machine()
    flags = cpuinfo_flags(Path("/proc/cpuinfo").read_text()) if is_x86(machine) else frozenset()
    return cmake_cpu_options(machine, flags)


def fetch_source(cache: Path) -> Path:
    """The vendored llama.cpp tree, unpacked from the pinned sdist (downloaded with pip when not yet there)."""
    src = cache / "src"
    if (src / MARKER).is_file():
        return src
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        spec = f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
        log.info("downloading the %s sdist with pip (75 MB)", spec)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", scratch, spec]
        if subprocess.run(cmd, stdout=sys.stderr, check=False).returncode != 0:
            raise BenchError(f"`{' '.join(cmd)}` failed; check that PyPI is reachable")
        sdist = Path(scratch) / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            raise BenchError(f"{sdist.name} has sha256 {digest}, expected {SDIST_SHA256}; clear pip's cache and retry")
        log.info("unpacking %s", VENDORED)
        unpacked = Path(scratch) / "unpacked"
        with tarfile.open(sdist) as archive:
            # plain files and folders under VENDORED only, so nothing can land outside `unpacked`
            members = [m for m in archive.getmembers() if m.name.startswith(VENDORED + "/")
                       and (m.isfile() or m.isdir()) and ".." not in m.name.split("/")]
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.10.12
            archive.extractall(unpacked, members=members, **safe)
        shutil.rmtree(src, ignore_errors=True)
        os.rename(unpacked / VENDORED, src)
    (src / MARKER).write_text(SDIST_SHA256 + "\n")
    return src


def run_logged(cmd: Sequence[str], log_path: Path, what: str, cwd: Path | None = None,
               env: dict[str, str] | None = None) -> None:
    """Run `cmd` niced, its output to `log_path`, printing ninja's [n/N] progress about every 30 s."""
    last = 0.0
    with open(log_path, "w") as sink:
        proc = subprocess.Popen(["nice", "-n", "10", *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=cwd, env=env)
        assert proc.stdout is not None
        for line in proc.stdout:
            sink.write(line)
            step = re.match(r"\[(\d+)/(\d+)\]", line)
            if step and (time.monotonic() - last > 30 or step[1] == step[2]):
                last = time.monotonic()
                log.info("%s: step %s of %s", what, step[1], step[2])
    if proc.wait() != 0:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-20:])
        raise BenchError(f"{what} failed (exit {proc.returncode}); the whole log is {log_path}:\n{tail}")


def build_llamacpp(src: Path, cache: Path, cpu_options: tuple[str, ...], skip_build: bool) -> Path:
    """The bin/ folder of a Release build of TARGETS with `cpu_options`, built once per version and options."""
    options = (*COMMON_CMAKE, *cpu_options)
    key = hashlib.sha256("\n".join(options).encode()).hexdigest()[:12]
    build = cache / f"build-{key}"
    if (build / MARKER).is_file():
        return build / "bin"
    if skip_build:
        raise BenchError(f"no finished llama.cpp build at {build}; run once without --skip-build")
    log.info("building llama.cpp %s into %s (nice, -j2; this takes a while) with %s", LLAMA_CPP_PYTHON_VERSION,
             build, " ".join(cpu_options) or "cmake's CPU defaults")
    run_logged(["cmake", "-S", str(src), "-B", str(build), *options], cache / f"build-{key}.configure.log",
               "cmake configure")
    run_logged(["cmake", "--build", str(build), "-j", "2", "--target", *TARGETS], cache / f"build-{key}.log",
               "cmake build")
    (build / MARKER).write_text(json.dumps({"version": LLAMA_CPP_PYTHON_VERSION, "options": options}) + "\n")
    return build / "bin"


def converter_env(cache: Path) -> dict[str, str]:
    """The environment convert_hf_to_gguf.py runs in. It takes gguf from the vendored gguf-py itself, and imports
    sentencepiece even for a BPE tokenizer; where that is not installed it is pip-installed into the cache, once,
    and put on PYTHONPATH for the converter only (this environment is left as it is)."""
    env = dict(os.environ)
    if importlib.util.find_spec("sentencepiece") is not None:
        return env
    target = cache / "pydeps"
    if not (target / MARKER).is_file():
        log.info("installing sentencepiece for the converter into %s", target)
        cmd = [sys.executable, "-m", "pip", "install", "--target", str(target), SENTENCEPIECE]
        if subprocess.run(cmd, stdout=sys.stderr, check=False).returncode != 0:
            raise BenchError(f"`{' '.join(cmd)}` failed; check that PyPI is reachable, or install {SENTENCEPIECE}")
        (target / MARKER).write_text(SENTENCEPIECE + "\n")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")]))
    return env


def convert_models(src: Path, bin_dir: Path, cache: Path, modes: Sequence[str], skip_build: bool) -> dict[str, Path]:
    """The demo model as GGUF in each mode's type: bf16 by convert_hf_to_gguf.py, the rest by llama-quantize."""
    out = cache / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    paths = {mode: out / f"{MODEL_SLUG}-{GGUF_TYPES[mode]}.gguf" for mode in modes}
    bf16 = out / f"{MODEL_SLUG}-bf16.gguf"
    if skip_build and not all(p.is_file() for p in paths.values()):
        raise BenchError(f"the converted models are not all in {out}; run once without --skip-build")
    if not bf16.is_file():
        model_dir = demo_model_dir()
        log.info("converting %s to GGUF bf16", model_dir)
        partial = bf16.with_name(bf16.name + ".partial")
        run_logged([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "bf16",
                    "--outfile", str(partial)], out / "convert.log", "convert_hf_to_gguf", cwd=src,
                   env=converter_env(cache))
        os.replace(partial, bf16)
    for mode, path in paths.items():
        if not path.is_file():
            log.info("quantizing to %s", GGUF_TYPES[mode].upper())
            partial = path.with_name(path.name + ".partial")
            run_logged([str(bin_dir / "llama-quantize"), str(bf16), str(partial), GGUF_TYPES[mode].upper(),
                        str(THREADS)], out / f"quantize-{GGUF_TYPES[mode]}.log", "llama-quantize")
            os.replace(partial, path)
    return paths


# ----------------------------------------------------------------------------------------------------------
# llama.cpp: measure


def llama_bench(bin_dir: Path, model: Path, args: argparse.Namespace, rpc: Sequence[str] = ()) -> Measured:
    cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(THREADS), "-p", str(args.prompt_tokens),
           "-n", str(args.tokens), "-r", str(args.repeat), "-d", str(args.depth), "-o", "json"]
    if rpc:  # every layer on the RPC devices, half each
        cmd += ["--rpc", ",".join(rpc), "-ngl", "99", "-ts", "1/1"]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BenchError(f"`{' '.join(cmd)}` exited {result.returncode}:\n{result.stderr[-3000:]}")
    return parse_llama_bench(result.stdout)


def wait_listening(port: int, proc: Process, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise BenchError(f"ggml-rpc-server exited {proc.proc.returncode}:\n{proc.output()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise BenchError(f"ggml-rpc-server did not listen on port {port} within {timeout:.0f}s:\n{proc.output()[-2000:]}")


@contextmanager
def rpc_servers(bin_dir: Path, count: int, workdir: Path) -> Iterator[list[str]]:
    """`count` ggml-rpc-server processes on loopback with THREADS threads each; yields their host:port.

    tools/rpc/README.md says nothing of threads; rpc-server's own default is half the cores (1 on 2 cores). Each
    gets THREADS, as each tc worker does, so both splits run the same number of threads a process.
    """
    ports = [free_port() for _ in range(count)]
    servers = [Process([str(bin_dir / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", str(THREADS)],
                       workdir / f"rpc-{port}.log") for port in ports]
    try:
        for port, server in zip(ports, servers):
            wait_listening(port, server)
        yield [f"127.0.0.1:{port}" for port in ports]
    finally:
        for server in servers:
            server.stop()


# ----------------------------------------------------------------------------------------------------------
# tc: measure


def prompt_ids(model_dir: Path, count: int) -> list[int]:
    """The first `count` tokens of bench/data/perplexity.txt (--depth and then --prompt-tokens of them)."""
    from tc.model.tokenizer import TextTokenizer

    ids = TextTokenizer.load(model_dir).encode(PROMPT_TEXT.read_text(encoding="utf-8"))
    if len(ids) < count:
        raise BenchError(f"{PROMPT_TEXT} holds only {len(ids)} tokens, not {count}; ask for at most that many "
                         "--depth and --prompt-tokens together")
    return ids[:count]


def tc_single_child(mode: str, tokens: int, prompt_tokens: int, repeat: int, depth: int) -> dict:
    """Runs in a child process of its own: the whole model here, quantized as a cluster in `mode` would be."""
    import torch

    torch.set_num_threads(THREADS)
    from tc.local import load_local_generator
    from tc.model import quant
    from tc.sampling import SamplingParams

    model_dir = demo_model_dir()
    generator = load_local_generator(model_dir, "bf16")
    quant.quantize_linears(generator.head, quant.head_weight_mode(mode), quant.DEFAULT_GROUP_SIZE)
    for stage in generator.pipeline.stages:
        quant.quantize_linears(stage, mode, quant.DEFAULT_GROUP_SIZE)
    ids = prompt_ids(model_dir, depth + prompt_tokens)
    first_token = SamplingParams(max_tokens=1, temperature=0)
    decode = SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True)
    generator.generate(ids, SamplingParams(max_tokens=2, temperature=0))  # warm-up

    def reading(count: int) -> float:  # seconds to read `count` tokens of the prompt and choose the first token
        return generator.generate(ids[:count], first_token).time_to_first_token_s if count else 0.0

    prefill = [prompt_tokens / (reading(depth + prompt_tokens) - reading(depth)) for _ in range(repeat)]
    steps = [generator.generate(ids[:max(depth, 1)], decode) for _ in range(repeat)]
    if any(s.completion_tokens != tokens + 1 for s in steps):
        raise BenchError(f"a decode run made {[s.completion_tokens for s in steps]} tokens, not {tokens + 1}")
    return {"prefill": prefill, "decode": [s.decode_tokens_per_s for s in steps]}


def tc_single(mode: str, args: argparse.Namespace) -> Measured:
    cmd = [sys.executable, __file__, "--child-single", mode, "--tokens", str(args.tokens), "--prompt-tokens",
           str(args.prompt_tokens), "--repeat", str(args.repeat), "--depth", str(args.depth)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BenchError(f"the tc single-process run ({mode}) failed:\n{result.stderr[-3000:]}")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    return Measured(Rate.of(out["prefill"]), Rate.of(out["decode"]))


def timed_completion(cluster: Cluster, model: str, prompt: list[int], max_tokens: int) -> float:
    """Seconds for one whole (not streamed) completion of exactly `max_tokens` tokens, its whole prompt read: the
    same prompt again would otherwise start from the last run's kept cache and read one position."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "cache_prompt": False}
    started = time.perf_counter()
    status, reply = cluster.post("/v1/completions", body)
    elapsed = time.perf_counter() - started
    if status != 200:
        raise BenchError(f"the head answered {status}: {reply}")
    if reply["usage"]["completion_tokens"] != max_tokens:
        raise BenchError(f"asked for {max_tokens} tokens, got {reply['usage']['completion_tokens']}")
    if "prompt_tokens_details" in reply["usage"]:
        raise BenchError(f"part of the prompt was not read: {reply['usage']['prompt_tokens_details']}")
    return elapsed


def tc_cluster(mode: str, args: argparse.Namespace, workdir: Path) -> Measured:
    model_dir = demo_model_dir()
    depth = args.depth
    ids = prompt_ids(model_dir, depth + args.prompt_tokens)
    nodes = [{"id": "w1", "device": "cpu"}, {"id": "w2", "device": "cpu"}]
    topology = write_topology(workdir / f"topology-{mode}.yaml", model_dir, nodes, quant=mode, dtype="bf16",
                              head={"threads": THREADS, "draft_tokens": 0})  # one token a step, as llama-bench
    with Cluster(topology, workdir) as cluster:
        try:
            cluster.start_head()
            cluster.wait_api(timeout=300)
            for node in nodes:
                cluster.start_worker(node["id"], "--threads", str(THREADS))
            cluster.wait_ready(timeout=900)
        except AssertionError as exc:  # the test helper's way of saying a process died or never got ready
            raise BenchError(f"the tc cluster ({mode}) did not start: {exc}") from exc
        served = model_dir.name  # the head serves a local model under its directory's name
        timed_completion(cluster, served, ids, 2)  # warm-up

        def reading(count: int) -> float:  # the HTTP round trip cancels where depth > 0, and costs ~1 ms where not
            return timed_completion(cluster, served, ids[:count], 1) if count else 0.0

        prefill = [args.prompt_tokens / (reading(depth + args.prompt_tokens) - reading(depth))
                   for _ in range(args.repeat)]
        decode = []
        for _ in range(args.repeat):  # (tokens + 1) tokens minus 1 token: `tokens` decode steps, nothing else
            one = timed_completion(cluster, served, ids[:max(depth, 1)], 1)
            many = timed_completion(cluster, served, ids[:max(depth, 1)], args.tokens + 1)
            decode.append(args.tokens / max(many - one, 1e-9))
    return Measured(Rate.of(prefill), Rate.of(decode))


# ----------------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=list(GGUF_TYPES), choices=list(GGUF_TYPES))
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per decode run (default 64)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="prompt length for prefill (default 512)")
    parser.add_argument("--depth", type=int, default=0,
                        help="tokens of context already read before each test, as llama-bench's -d (default 0)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure, after a warm-up (default 3)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every setup this many times, taking turns (default 1)")
    parser.add_argument("--only", choices=["tc", "llamacpp"], help="run only one tool's setups")
    parser.add_argument("--skip-build", action="store_true",
                        help="never build or convert: use the cached build and models, or stop with an error")
    parser.add_argument("--child-single", metavar="MODE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.tokens, args.prompt_tokens, args.repeat, args.rounds) < 1:
        parser.error("--tokens, --prompt-tokens, --repeat and --rounds must be at least 1")
    if args.depth < 0:
        parser.error("--depth must be 0 or more")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="vs_llamacpp: %(message)s")
    if args.child_single:
        print(json.dumps(tc_single_child(args.child_single, args.tokens, args.prompt_tokens, args.repeat,
                                         args.depth)))
        return 0
    load_before = os.getloadavg()[0]  # every figure here moves with what else the cores are running
    try:
        results = run_all(args)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    context = f" after {args.depth} tokens of context" if args.depth else ""
    print(f"\ndemo model ({MODEL_SLUG}), {THREADS} threads a process, prefill of {args.prompt_tokens} tokens, "
          f"decode of {args.tokens} tokens{context}, mean ± sd of "
          f"{f'{args.rounds} rounds of {args.repeat} runs each' if args.rounds > 1 else f'{args.repeat} runs'}; "
          f"llama.cpp {LLAMA_CPP_PYTHON_VERSION} "
          f"(llama-cpp-python's vendored tree); {os.cpu_count()} cores, 1-minute load average "
          f"{load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end\n")
    print(format_table(results, args.modes))
    return 0


def run_all(args: argparse.Namespace) -> dict[tuple[str, str], Measured]:
    setups = [setup for setup in SETUPS if (args.only != "tc" or setup in (TC_ONE, TC_CLUSTER))
              and (args.only != "llamacpp" or setup in (LLAMA_ONE, LLAMA_RPC))]
    if args.only != "tc":
        cache = llamacpp_cache()
        src = cache / "src" if args.skip_build else fetch_source(cache)
        bin_dir = build_llamacpp(src, cache, this_machines_cpu_options(), args.skip_build)
        ggufs = convert_models(src, bin_dir, cache, args.modes, args.skip_build)
    rounds: dict[tuple[str, str], list[Measured]] = {}
    with tempfile.TemporaryDirectory(prefix="vs-llamacpp-") as tmp:
        workdir = Path(tmp)
        for round_number in range(args.rounds):
            for mode in args.modes:
                for setup in round_order(setups, round_number):
                    log.info("round %d of %d: %s, %s", round_number + 1, args.rounds, setup, mode)
                    if setup == LLAMA_ONE:
                        measured = llama_bench(bin_dir, ggufs[mode], args)
                    elif setup == LLAMA_RPC:
                        with rpc_servers(bin_dir, 2, workdir) as endpoints:
                            measured = llama_bench(bin_dir, ggufs[mode], args, endpoints)
                    elif setup == TC_ONE:
                        measured = tc_single(mode, args)
                    else:
                        measured = tc_cluster(mode, args, workdir)
                    log.info("%s %s: prefill %.1f tok/s, decode %.1f tok/s", setup, mode, measured.prefill.mean,
                             measured.decode.mean)
                    rounds.setdefault((mode, setup), []).append(measured)
    return {key: pool_rounds(measured) for key, measured in rounds.items()}


if __name__ == "__main__":
    sys.exit(main())
