"""The pure parts of bench/vs_llamacpp.py: CPU options from /proc/cpuinfo, llama-bench's JSON, the table.

Nothing here builds, downloads or runs llama.cpp.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "vs_llamacpp.py"


def _load():
    spec = importlib.util.spec_from_file_location("vs_llamacpp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up in sys.modules
    spec.loader.exec_module(module)
    return module


vs = _load()

# flags lines as /proc/cpuinfo shows them (shortened): a KVM Sapphire Rapids that advertises AMX, an AVX2-only
# AMD, and a Skylake-SP with AVX-512 F/CD/VL/DQ/BW but none of the later extensions
XEON_AMX = ("fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma bmi2 avx2 avx512f avx512dq avx512cd avx512bw "
            "avx512vl avx512vbmi avx512_vnni avx512_bf16 avx_vnni amx_bf16 amx_tile amx_int8")
ZEN2 = "fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma bmi2 avx2 sha_ni"
SKYLAKE_SP = "fpu sse4_2 avx f16c fma bmi2 avx2 avx512f avx512dq avx512cd avx512bw avx512vl"


def cpuinfo(flags: str, cpus: int = 2) -> str:
    return "".join(f"processor\t: {i}\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\nbugs\t\t: spectre_v1\n\n"
                   for i in range(cpus))


def options(machine: str, flags: str) -> dict[str, str]:
    return dict(o.removeprefix("-D").split("=") for o in vs.cmake_cpu_options(machine, frozenset(flags.split())))


def test_cpuinfo_flags_reads_the_flags_line():
    flags = vs.cpuinfo_flags(cpuinfo(ZEN2))
    assert flags == frozenset(ZEN2.split())
    assert "spectre_v1" not in flags  # the `bugs` line is not the `flags` line


def test_cpuinfo_without_flags_is_an_error():
    with pytest.raises(vs.BenchError, match="no 'flags' line"):
        vs.cpuinfo_flags("processor\t: 0\nFeatures\t: fp asimd evtstrm\n")


@pytest.mark.parametrize("flags, on, off", [
    (XEON_AMX, {"GGML_AVX2", "GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16",
                "GGML_AVX_VNNI"}, set()),
    (ZEN2, {"GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2"},
     {"GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX_VNNI"}),
    (SKYLAKE_SP, {"GGML_AVX512"}, {"GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16"}),
    # avx512_bf16 alone is no use: ggml compiles AVX512 code with f, cd, vl, dq and bw together
    ("sse4_2 avx avx2 fma f16c avx512f avx512_bf16", {"GGML_AVX2"}, {"GGML_AVX512", "GGML_AVX512_BF16"}),
    ("sse4_2", {"GGML_SSE42"}, {"GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2"}),
])
def test_x86_options_follow_the_flags(flags, on, off):
    chosen = options("x86_64", flags)
    assert {name for name in on if chosen[name] == "ON"} == on
    assert {name for name in off if chosen[name] == "OFF"} == off
    # never native, and AMX off even where the CPU advertises it
    for name in ("GGML_NATIVE", "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"):
        assert chosen[name] == "OFF"


def test_every_x86_option_is_set_explicitly():
    # an option left out would take cmake's default, which is ON for AVX/AVX2/FMA/F16C/BMI2 and would SIGILL
    # on a CPU without them
    assert set(options("AMD64", "")) == {name for name, _ in vs.X86_OPTIONS} | set(vs.ALWAYS_OFF)
    assert set(options("AMD64", "").values()) == {"OFF"}


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "riscv64", "ppc64le"])
def test_other_machines_get_cmakes_defaults(machine):
    assert vs.cmake_cpu_options(machine, frozenset(XEON_AMX.split())) == ()


def bench_record(n_prompt: int, n_gen: int, avg_ts: float, stddev_ts: float, **extra) -> dict:
    # the fields of one test as `llama-bench -o json` prints them (tools/llama-bench/README.md), abridged
    return {"build_commit": "8cf427ff", "model_filename": "m.gguf", "model_type": "qwen2 0.5B BF16", "n_threads": 2,
            "n_gpu_layers": 99, "devices": "auto", "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": 0,
            "avg_ns": 72135640, "stddev_ns": 1453752, "avg_ts": avg_ts, "stddev_ts": stddev_ts,
            "samples_ts": [avg_ts], **extra}


def test_parse_llama_bench_takes_pp_and_tg():
    text = json.dumps([bench_record(512, 0, 184.25, 3.5), bench_record(0, 64, 20.1, 0.25)], indent=2)
    measured = vs.parse_llama_bench(text)
    assert measured == vs.Measured(prefill=vs.Rate(184.25, 3.5), decode=vs.Rate(20.1, 0.25))


def test_parse_llama_bench_does_not_depend_on_order():
    text = json.dumps([bench_record(0, 64, 37.0, 1.0), bench_record(512, 0, 260.0, 2.0)])
    measured = vs.parse_llama_bench(text)
    assert (measured.prefill.mean, measured.decode.mean) == (260.0, 37.0)


@pytest.mark.parametrize("text, message", [
    ("| model | size | params |\n|---|---|---|", "did not print JSON"),
    ('{"n_prompt": 512}', "not a list"),
    (json.dumps([bench_record(512, 0, 184.0, 1.0)]), "no decode test"),
    (json.dumps([bench_record(0, 64, 20.0, 1.0)]), "no prefill test"),
    (json.dumps([bench_record(512, 64, 20.0, 1.0)]), "no decode or prefill test"),  # a -pg test is neither
    (json.dumps([{"n_prompt": 512, "n_gen": 0}]), "lacks"),
    (json.dumps([bench_record(512, 0, "fast", 1.0), bench_record(0, 64, 20.0, 1.0)]), "lacks"),
])
def test_parse_llama_bench_refuses_what_it_cannot_read(text, message):
    with pytest.raises(vs.BenchError, match=message):
        vs.parse_llama_bench(text)


def test_rate_of_samples():
    assert vs.Rate.of([10.0, 12.0, 14.0]) == vs.Rate(12.0, 2.0)
    assert vs.Rate.of([7.5]) == vs.Rate(7.5, 0.0)


def test_table_ratios_are_against_llamacpp_of_the_same_mode():
    rate = vs.Rate
    results = {
        ("fp16", vs.LLAMA_ONE): vs.Measured(rate(200.0, 1.0), rate(20.0, 1.0)),
        ("fp16", vs.LLAMA_RPC): vs.Measured(rate(100.0, 1.0), rate(16.0, 1.0)),
        ("fp16", vs.TC_CLUSTER): vs.Measured(rate(50.0, 1.0), rate(8.0, 1.0)),
        ("int4", vs.LLAMA_ONE): vs.Measured(rate(250.0, 1.0), rate(40.0, 1.0)),
        ("int4", vs.TC_CLUSTER): vs.Measured(rate(125.0, 1.0), rate(10.0, 1.0)),
    }
    lines = vs.format_table(results, ["fp16", "int4"]).splitlines()
    assert len(lines) == 2 + 5
    fp16_cluster, int4_cluster = (line for line in lines if line.startswith(vs.TC_CLUSTER))
    assert fp16_cluster.split()[-4:] == ["0.25x", "0.40x", "0.50x", "0.50x"]
    assert int4_cluster.split()[-4:] == ["0.50x", "0.25x", "-", "-"]  # no RPC run of int4
    one_process = next(line for line in lines if line.startswith(vs.LLAMA_ONE))
    assert one_process.split()[-4:] == ["-", "-", "2.00x", "1.25x"]  # never against itself


def test_rounds_take_turns_in_alternating_order():
    setups = [vs.LLAMA_ONE, vs.LLAMA_RPC, vs.TC_ONE, vs.TC_CLUSTER]
    assert vs.round_order(setups, 0) == setups
    assert vs.round_order(setups, 1) == list(reversed(setups))
    assert vs.round_order(setups, 2) == setups
    assert setups == [vs.LLAMA_ONE, vs.LLAMA_RPC, vs.TC_ONE, vs.TC_CLUSTER]  # the caller's list is left alone


def test_rounds_pool_into_the_mean_and_spread_of_their_means():
    rate = vs.Rate
    one = vs.Measured(rate(100.0, 9.0), rate(20.0, 3.0))
    assert vs.pool_rounds([one]) is one  # a single round keeps its own runs' spread
    pooled = vs.pool_rounds([one, vs.Measured(rate(120.0, 1.0), rate(30.0, 1.0)),
                             vs.Measured(rate(140.0, 1.0), rate(25.0, 1.0))])
    assert pooled == vs.Measured(rate(120.0, 20.0), rate(25.0, 5.0))


def test_a_prompt_longer_than_the_text_names_depth_too(tiny_model_dir):
    """--depth N reads N tokens of the text before the --prompt-tokens ones: the refusal counts and names both."""
    from tc.model.tokenizer import TextTokenizer

    held = len(TextTokenizer.load(tiny_model_dir).encode(vs.PROMPT_TEXT.read_text(encoding="utf-8")))
    assert len(vs.prompt_ids(tiny_model_dir, held)) == held
    with pytest.raises(vs.BenchError, match=rf"holds only {held} tokens, not {held + 1}; .* --depth and --prompt"):
        vs.prompt_ids(tiny_model_dir, held + 1)
