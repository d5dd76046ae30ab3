"""Read a model directory's safetensors from their headers, and load exactly the tensors asked for.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor name to
{dtype, shape, data_offsets}, then the raw bytes. We parse the headers ourselves so that planning needs no
weight bytes at all, and loading a layer range reads only that range's byte spans (plain reads into ordinary
memory: decoding from copied weights ran about 10% faster than from memory-mapped ones).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch

from .config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024

_DTYPES: Mapping[str, tuple[torch.dtype, int]] = {
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
}

class WeightsError(ValueError):
    """The model's safetensors are missing, malformed, or do not match config.json."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def layer_prefix(index: int) -> str:
    return f"model.layers.{index}."


def layer_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of decoder layer `layer`, by its name under the layer's prefix, with the shape config.json
    implies. What a family's checkpoint holds follows from its ModelConfig alone (its biases, norms, experts and
    whether it stores q/k/v and gate/up fused), so a new family adds no names here."""
    c = config
    h, d = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    parts = {"qkv_proj": q + 2 * kv} if c.fused_checkpoint else {"q_proj": q, "k_proj": kv, "v_proj": kv}
    for part, rows in parts.items():
        shapes[f"self_attn.{part}.weight"] = (rows, h)
        if c.qkv_bias:
            shapes[f"self_attn.{part}.bias"] = (rows,)
    shapes["self_attn.o_proj.weight"] = (h, q)
    if c.o_bias:
        shapes["self_attn.o_proj.bias"] = (h,)
    if c.qk_norm:
        shapes.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    if c.sandwich_norms:
        shapes.update({"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)})
    if c.has_experts(layer):
        assert c.experts is not None
        e = c.experts
        block = e.block_name
        shapes[f"{block}.gate.weight"] = (e.count, h)  # the router
        for i in range(e.count):
            shapes.update(_mlp_shapes(f"{block}.experts.{i}", h, e.intermediate_size, False, e.projections))
        if e.shared_intermediate_size:
            shapes.update(_mlp_shapes(f"{block}.shared_expert", h, e.shared_intermediate_size, False))
            shapes[f"{block}.shared_expert_gate.weight"] = (1, h)
    elif c.fused_checkpoint:
        shapes.update({"mlp.gate_up_proj.weight": (2 * c.intermediate_size, h),
                       "mlp.down_proj.weight": (h, c.intermediate_size)})
    else:
        shapes.update(_mlp_shapes("mlp", h, c.intermediate_size, c.mlp_bias))
    return shapes


def is_quantized(name: str, shape: tuple[int, ...] | list[int]) -> bool:
    """Whether a layer tensor loads into a linear layer that quantization replaces: every 2-D weight but a
    router's (`<block>.gate.weight`, which a mixture of experts keeps in the compute dtype: model/moe.py)."""
    return len(shape) == 2 and name.endswith(".weight") and not name.endswith(".gate.weight")


def _mlp_shapes(prefix: str, hidden: int, inner: int, bias: bool,
                names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> dict[str, tuple[int, ...]]:
    gate, up, down = names
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}.{gate}.weight": (inner, hidden),
                                          f"{prefix}.{up}.weight": (inner, hidden),
                                          f"{prefix}.{down}.weight": (hidden, inner)}
    if bias:
        shapes.update({f"{prefix}.{gate}.bias": (inner,), f"{prefix}.{up}.bias": (inner,),
                       f"{prefix}.{down}.bias": (hidden,)})
    return shapes


def layer_tensor_names(config: ModelConfig, start: int, end: int) -> list[str]:
    """Checkpoint names of every tensor in layers [start, end)."""
    return [layer_prefix(i) + suffix for i in range(start, end) for suffix in layer_shapes(config, i)]


def head_tensor_names(config: ModelConfig) -> list[str]:
    """The tensors the head owns: the embedding, the final norm, and lm_head unless tied."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, with the shape config.json implies."""
    h = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        shapes.update({layer_prefix(i) + suffix: shape for suffix, shape in layer_shapes(config, i).items()})
    return shapes


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors file's header. Reads only the header bytes."""
    try:
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise WeightsError(f"{path}: too short to be a safetensors file")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > MAX_HEADER_BYTES:
                raise WeightsError(f"{path}: header of {header_len} bytes; not a safetensors file?")
            header = json.loads(f.read(header_len))
    except OSError as exc:
        raise WeightsError(f"cannot read {path}: {exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WeightsError(f"{path}: malformed safetensors header: {exc}") from exc
    data_start = 8 + header_len
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        tensors[name] = TensorInfo(
            name=name,
            file=path,
            dtype=entry["dtype"],
            shape=tuple(entry["shape"]),
            start=data_start + begin,
            end=data_start + end,
        )
    return tensors


class WeightIndex:
    """Where every tensor of a model directory lives, from the headers alone."""

    def __init__(self, tensors: Mapping[str, TensorInfo], declared: Iterable[str] | None = None):
        self.tensors = dict(tensors)
        # every tensor the directory lists, including those in shards left unread (the shard index names them)
        self.declared = frozenset(self.tensors).union(declared or ())

    @classmethod
    def open(cls, model_dir: Path, only: Iterable[str] | None = None) -> "WeightIndex":
        """Index `model_dir`: one model.safetensors, or shards listed by model.safetensors.index.json.

        With `only`, read just the shards holding those tensors (a worker may have downloaded no others).
        """
        model_dir = Path(model_dir)
        index_path = model_dir / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError) as exc:
                raise WeightsError(f"{index_path}: unreadable shard index: {exc}") from exc
            wanted = weight_map if only is None else {n: weight_map[n] for n in only if n in weight_map}
            files = sorted(set(wanted.values()))
        elif (model_dir / SINGLE_FILE).is_file():
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise WeightsError(
                f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}; tc loads HuggingFace safetensors models"
            )
        tensors: dict[str, TensorInfo] = {}
        for file in files:
            tensors.update(read_header(model_dir / file))
        if weight_map is not None:
            for name, file in wanted.items():
                info = tensors.get(name)
                if info is None or info.file.name != file:
                    raise WeightsError(f"{index_path}: {name} is listed in {file} but not stored there")
        return cls(tensors, declared=weight_map)

    def validate(self, config: ModelConfig, only: Iterable[str] | None = None) -> None:
        """Check every tensor the model needs (or those in `only`) exists with the shape config.json implies."""
        shapes = expected_shapes(config)
        for name in (shapes if only is None else only):
            shape = shapes[name]
            info = self.tensors.get(name)
            if info is None:
                raise WeightsError(f"missing tensor {name}; the checkpoint does not match config.json")
            if info.shape != shape:
                raise WeightsError(
                    f"tensor {name} has shape {list(info.shape)}, config.json implies {list(shape)}"
                )
            if info.dtype not in _DTYPES:
                raise WeightsError(f"tensor {name} is stored as {info.dtype}; tc reads F32, F16 and BF16")

    def declared_in_layers(self, start: int, end: int) -> list[str]:
        """Every tensor the checkpoint lists for layers [start, end), sorted, whether tc uses it or not."""
        prefixes = tuple(layer_prefix(i) for i in range(start, end))  # "model.layers.1." never matches layer 10
        return sorted(n for n in self.declared if n.startswith(prefixes))

    def nbytes(self, names: Iterable[str]) -> int:
        return sum(self.tensors[n].nbytes for n in names)

    def load(self, names: Iterable[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Read exactly the named tensors' bytes (nothing else), optionally cast to `dtype`."""
        by_file: dict[Path, list[TensorInfo]] = {}
        for name in names:
            try:
                info = self.tensors[name]
            except KeyError:
                raise WeightsError(f"missing tensor {name}") from None
            by_file.setdefault(info.file, []).append(info)
        out: dict[str, torch.Tensor] = {}
        for path, infos in by_file.items():
            with open(path, "rb") as f:
                for info in sorted(infos, key=lambda i: i.start):  # sequential reads
                    torch_dtype, itemsize = _DTYPES[info.dtype]
                    numel = 1
                    for d in info.shape:
                        numel *= d
                    if numel * itemsize != info.nbytes:
                        raise WeightsError(f"tensor {info.name}: byte span does not match its shape")
                    buf = bytearray(info.nbytes)
                    f.seek(info.start)
                    if f.readinto(buf) != info.nbytes:
                        raise WeightsError(f"{path}: truncated while reading {info.name}")
                    tensor = torch.frombuffer(buf, dtype=torch_dtype).reshape(info.shape) if numel else \
                        torch.empty(info.shape, dtype=torch_dtype)
                    out[info.name] = tensor.to(dtype) if dtype is not None else tensor
        return out
