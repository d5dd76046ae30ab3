"""Read a model directory's safetensors from their headers, and load exactly the tensors asked for.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor name to
{dtype, shape, data_offsets}, then the raw bytes. We parse the headers ourselves so that planning needs no
weight bytes at all, and loading a layer range reads only that range's byte spans (plain reads into ordinary
memory: decoding from copied weights ran about 10% faster than from memory-mapped ones). Tensors fused into one
are read straight into their rows of it, and a weight quantized as it loads is read a slab of rows at a time.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import BinaryIO, Iterable, Iterator, Mapping, Sequence

import torch

from .config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024
REDO = "re-download or re-convert the checkpoint"  # what to do about a malformed file, closing its message
SLAB_BYTES = 4 << 20  # a weight quantized while it loads streams from its file this many bytes of rows at a time

_DTYPES: Mapping[str, tuple[torch.dtype, int]] = {
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
}

LM_HEAD = "lm_head.weight"  # the lm_head's tensor, by a causal LM's name

# Where an image-text checkpoint (Gemma 3's 4B-27B, Mistral Small 3's, Qwen3-VL's) keeps its language model, and
# where a causal LM of the same family keeps the same tensors: tc reads the language model under the causal LM's
# names and never reads the vision tower's. The first is how Gemma 3's and Mistral 3's are published (and
# transformers still writes them), the second how transformers 4.52-4.x named them in memory, which Qwen3-VL's
# published files and some re-saved copies keep.
LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                           ("model.language_model.", "model."))


class WeightsError(ValueError):
    """The model's safetensors are missing, malformed, or do not match config.json."""


def causal_lm_name(name: str) -> str:
    """A checkpoint tensor's name as a causal LM of its family names it (LANGUAGE_MODEL_PREFIXES)."""
    for prefix, replacement in LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


def _renamed(names: Iterable[str], where: Path) -> dict[str, str]:
    """{causal LM name: checkpoint name} for the checkpoint names listed in `where`. Raises WeightsError where two
    of them would become one (a language model's tensor stored under both names)."""
    renamed: dict[str, str] = {}
    for name in names:
        ours = causal_lm_name(name)
        if ours in renamed:
            raise WeightsError(f"{where}: tensors {_one_line(renamed[ours])} and {_one_line(name)} are both the "
                               f"language model's {_one_line(ours)}; {REDO}")
        renamed[ours] = name
    return renamed


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


SAVED_ROTARY_BUFFER = ".rotary_emb.inv_freq"  # declared_in_layers


def layer_prefix(index: int) -> str:
    return f"model.layers.{index}."


def layer_sources(config: ModelConfig, layer: int) -> dict[str, dict[str, tuple[int, ...]]]:
    """Every tensor of decoder layer `layer` as tc builds it (model/qwen2.py's names under the layer) -> the
    checkpoint tensors (names under the layer's prefix, with the shapes config.json implies) whose rows it holds,
    one after another.

    Module attribute names are the checkpoint's, so most tensors come from one tensor of the same name. The
    exceptions: q/k/v_proj fill one qkv_proj and gate/up_proj one gate_up_proj (a step runs four products per
    layer instead of seven; where the checkpoint stores them fused, Phi-3 both and GLM gate/up, from one tensor
    each); a mixture of experts' block is `mlp` whatever the checkpoint calls it (Mixtral's block_sparse_moe,
    whose experts call their projections w1, w3, w2); and a family may name a norm otherwise
    (ModelConfig.checkpoint_names: GLM-4's). What a family's checkpoint holds follows from its ModelConfig
    alone (its biases, norms, experts, fused tensors and names), so a new family adds no names here.
    """
    c = config
    h, d = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    sources: dict[str, dict[str, tuple[int, ...]]] = {}

    renamed = dict(c.checkpoint_names)

    def same(name: str, shape: tuple[int, ...]) -> None:
        sources[name] = {renamed.get(name, name): shape}

    if c.pre_norms:
        same("input_layernorm.weight", (h,))
    if not c.parallel_block:
        same("post_attention_layernorm.weight", (h,))
    parts = {"qkv_proj": q + 2 * kv} if c.fused_qkv else {"q_proj": q, "k_proj": kv, "v_proj": kv}
    sources["self_attn.qkv_proj.weight"] = {f"self_attn.{part}.weight": (rows, h) for part, rows in parts.items()}
    if c.qkv_bias:
        sources["self_attn.qkv_proj.bias"] = {f"self_attn.{part}.bias": (rows,) for part, rows in parts.items()}
    same("self_attn.o_proj.weight", (h, q))
    if c.o_bias:
        same("self_attn.o_proj.bias", (h,))
    if c.qk_norm:
        same("self_attn.q_norm.weight", (q if c.qk_norm_whole else d,))
        same("self_attn.k_norm.weight", (kv if c.qk_norm_whole else d,))
    if c.sandwich_norms:
        if c.pre_norms:
            same("pre_feedforward_layernorm.weight", (h,))
        same("post_feedforward_layernorm.weight", (h,))
    if c.has_experts(layer):
        assert c.experts is not None
        e = c.experts
        block = e.block_name
        sources["mlp.gate.weight"] = {f"{block}.gate.weight": (e.count, h)}  # the router
        for i in range(e.count):
            sources.update(_mlp_sources(f"mlp.experts.{i}", f"{block}.experts.{i}", h, e.intermediate_size, False,
                                        e.projections))
        if e.shared_intermediate_size:
            sources.update(_mlp_sources("mlp.shared_expert", f"{block}.shared_expert", h, e.shared_intermediate_size,
                                        False))
            sources["mlp.shared_expert_gate.weight"] = {f"{block}.shared_expert_gate.weight": (1, h)}
    elif c.fused_gate_up:
        assert not c.mlp_bias, "a fused gate_up_proj with biases"
        same("mlp.gate_up_proj.weight", (2 * c.intermediate_size, h))
        same("mlp.down_proj.weight", (h, c.intermediate_size))
    else:
        sources.update(_mlp_sources("mlp", "mlp", h, c.intermediate_size, c.mlp_bias))
    return sources


def layer_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor of decoder layer `layer`, by its name under the layer's prefix, with the shape
    config.json implies (the parts of `layer_sources`)."""
    return {name: shape for parts in layer_sources(config, layer).values() for name, shape in parts.items()}


def is_quantized(name: str, shape: tuple[int, ...] | list[int]) -> bool:
    """Whether a layer tensor loads into a linear layer that quantization replaces: every 2-D weight but a
    router's (`<block>.gate.weight`) and the gate of a shared expert (Qwen2-MoE's `shared_expert_gate.weight`, one
    row), which a mixture of experts keeps in the compute dtype (model/moe.py): their choices are what a rounding
    would flip, for a handful of bytes."""
    return len(shape) == 2 and name.endswith(".weight") and \
        not name.endswith((".gate.weight", ".shared_expert_gate.weight"))


def _mlp_sources(target: str, prefix: str, hidden: int, inner: int, bias: bool,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
                 ) -> dict[str, dict[str, tuple[int, ...]]]:
    """The gated MLP `target` (gate_up_proj, down_proj) from the checkpoint's projections `names` under `prefix`."""
    gate, up, down = names
    sources: dict[str, dict[str, tuple[int, ...]]] = {
        f"{target}.gate_up_proj.weight": {f"{prefix}.{gate}.weight": (inner, hidden),
                                          f"{prefix}.{up}.weight": (inner, hidden)},
        f"{target}.down_proj.weight": {f"{prefix}.{down}.weight": (hidden, inner)}}
    if bias:
        sources[f"{target}.gate_up_proj.bias"] = {f"{prefix}.{gate}.bias": (inner,), f"{prefix}.{up}.bias": (inner,)}
        sources[f"{target}.down_proj.bias"] = {f"{prefix}.{down}.bias": (hidden,)}
    return sources


def layer_tensor_names(config: ModelConfig, start: int, end: int) -> list[str]:
    """Checkpoint names of every tensor in layers [start, end)."""
    return [layer_prefix(i) + suffix for i in range(start, end) for suffix in layer_shapes(config, i)]


def head_tensor_names(config: ModelConfig) -> list[str]:
    """The tensors the head owns: the embedding, the final norm, and lm_head unless tied."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append(LM_HEAD)
    return names


def head_names_to_fetch(config: ModelConfig) -> list[str]:
    """head_tensor_names, and a tied model's lm_head where its checkpoint holds one (see own_lm_head)."""
    names = head_tensor_names(config)
    return names + [LM_HEAD] if config.tie_word_embeddings else names


def own_lm_head(config: ModelConfig, index: "WeightIndex") -> bool:
    """Whether the checkpoint of a model config.json ties holds an lm_head of its own. transformers 5 ties the two
    only where the checkpoint holds one of them or both alike, and keeps a different lm_head (HeadModel.load does
    the same). Raises WeightsError for one of another shape than the embedding's."""
    if not config.tie_word_embeddings or LM_HEAD not in index.tensors:
        return False
    shape, expected = index.tensors[LM_HEAD].shape, (config.vocab_size, config.hidden_size)
    if shape != expected:
        raise WeightsError(f"tensor {LM_HEAD} has shape {list(shape)}, config.json implies {list(expected)}")
    return True


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, with the shape config.json implies."""
    h = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        shapes.update({layer_prefix(i) + suffix: shape for suffix, shape in layer_shapes(config, i).items()})
    return shapes


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors file's header, its tensors by their causal LM names (causal_lm_name). Reads only the
    header bytes.

    Every entry is checked here, before any offset is trusted: a span outside the data (a negative offset
    reaches back into the header) would otherwise be read as weights without a word."""
    try:
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise WeightsError(f"{path}: too short to be a safetensors file")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > MAX_HEADER_BYTES:
                raise WeightsError(f"{path}: header of {header_len} bytes; not a safetensors file?")
            header = json.loads(f.read(header_len))
            file_size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise WeightsError(f"cannot read {path}: {exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise WeightsError(f"{path}: malformed safetensors header: {exc}; {REDO}") from exc
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: malformed safetensors header: a JSON {_json_type(header)}, not an object; {REDO}")
    data_start = 8 + header_len
    tensors: dict[str, TensorInfo] = {}
    # free-form strings (the format, the converter) under __metadata__: nothing tc reads
    for ours, name in _renamed((n for n in header if n != "__metadata__"), path).items():
        entry = header[name]
        dtype, shape, (begin, end) = _checked_entry(path, name, entry, file_size - data_start)
        tensors[ours] = TensorInfo(
            name=ours,
            file=path,
            dtype=dtype,
            shape=shape,
            start=data_start + begin,
            end=data_start + end,
        )
    return tensors


def _checked_entry(path: Path, name: str, entry: object, data_size: int
                   ) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """A header entry's dtype, shape and data_offsets, each of the type the format prescribes, the offsets
    within the `data_size` bytes after the header. Raises WeightsError naming the file and tensor otherwise."""
    def malformed(what: str) -> WeightsError:
        return WeightsError(f"{path}: malformed safetensors header: tensor {_one_line(name)} {what}; {REDO}")

    if not isinstance(entry, dict):
        raise malformed(f"is a JSON {_json_type(entry)}, not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise malformed(f"has dtype {_brief(dtype)}, not a string")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise malformed(f"has shape {_brief(shape)}, not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(n) for n in offsets)
            and offsets[0] <= offsets[1] <= data_size):
        raise malformed(f"has data_offsets {_brief(offsets)}, not [begin, end] with 0 <= begin <= end <= "
                        f"{max(data_size, 0)} (the bytes after the header)")
    return dtype, tuple(shape), (offsets[0], offsets[1])


def read_weight_map(index_path: Path) -> dict[str, str]:
    """The shard index's weight_map (tensor name, as causal_lm_name gives it -> shard file), every file a plain name
    in the model directory: an index that named "/etc/passwd" or "../x.safetensors" would have us open a file
    outside it."""
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise WeightsError(f"{index_path}: unreadable shard index: {exc}; {REDO}") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise WeightsError(f"{index_path}: malformed shard index: its weight_map is {_brief(weight_map)}, "
                           f"not an object mapping tensor names to shard files; {REDO}")
    for name, file in weight_map.items():
        if not _is_plain_file_name(file):
            raise WeightsError(f"{index_path}: malformed shard index: weight_map entry {_one_line(name)} names "
                               f"{_brief(file)}, not a file name in the model directory; {REDO}")
    return {ours: weight_map[name] for ours, name in _renamed(weight_map, index_path).items()}


def _is_plain_file_name(file: object) -> bool:
    """Whether `file` names a file directly inside a directory, on any platform: no absolute path, no separator
    (/ or \\, nor a Windows drive's "C:"), not "." or "..", no NUL (which open() refuses with a ValueError)."""
    return (isinstance(file, str) and file not in ("", ".", "..") and "\0" not in file
            and PurePosixPath(file).name == file and PureWindowsPath(file).name == file)


def _is_count(value: object) -> bool:
    """A non-negative JSON integer (True and False are ints to Python, not to JSON)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _json_type(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
    return names.get(type(value), "null")


def _brief(value: object) -> str:
    """`value` as one short line for a message, quoted if it is a string: a header can hold anything."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _one_line(name: str) -> str:
    """A tensor name for a message: as it is, unless it holds what would break the message's single line."""
    return name if name.isprintable() else repr(name)


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
            weight_map = read_weight_map(index_path)
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
        """Every tensor the checkpoint lists for layers [start, end), sorted, whether tc uses it or not, but the
        rotary frequencies transformers before 4.31 saved with each layer (huggyllama/llama-7b, early Llama 2
        fine-tunes): config.json gives them, and transformers itself leaves them unread."""
        prefixes = tuple(layer_prefix(i) for i in range(start, end))  # "model.layers.1." never matches layer 10
        return sorted(n for n in self.declared if n.startswith(prefixes) and not n.endswith(SAVED_ROTARY_BUFFER))

    def refuse_unused_in_layers(self, config: ModelConfig, start: int, end: int) -> None:
        """validate() finds every tensor tc needs; a checkpoint that lists more for layers [start, end) holds
        weights tc would leave out (a bias or norm of a variant of the family), and would run without error and
        compute the wrong thing. Raises WeightsError naming them."""
        unused = sorted(set(self.declared_in_layers(start, end)) - set(layer_tensor_names(config, start, end)))
        if unused:
            shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
            raise WeightsError(f"layers {start}-{end - 1} of this checkpoint hold tensors tc's {config.model_type} "
                               f"does not use ({shown}); it is not a plain {config.model_type} checkpoint, and "
                               "running it without them would compute the wrong thing")

    def nbytes(self, names: Iterable[str]) -> int:
        return sum(self.tensors[n].nbytes for n in names)

    def load(self, names: Iterable[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Read exactly the named tensors' bytes (nothing else), optionally cast to `dtype`."""
        by_file: dict[Path, list[TensorInfo]] = {}
        for name in names:
            info = self._checked(name)
            by_file.setdefault(info.file, []).append(info)
        out: dict[str, torch.Tensor] = {}
        for path, infos in by_file.items():
            with open(path, "rb") as f:
                for info in sorted(infos, key=lambda i: i.start):  # sequential reads
                    tensor = torch.empty(info.shape, dtype=_DTYPES[info.dtype][0])
                    _read_into(f, info, info.start, tensor)
                    out[info.name] = tensor.to(dtype) if dtype is not None else tensor
        return out

    def stacked_shape(self, names: Sequence[str]) -> tuple[int, ...]:
        """The shape of the named tensors' rows one after another (see load_rows). Raises WeightsError for a
        missing tensor or tensors whose rows differ in shape."""
        infos = self._stackable(names)
        return (sum(info.shape[0] for info in infos), *infos[0].shape[1:])

    def load_rows(self, names: Sequence[str], dtype: torch.dtype) -> torch.Tensor:
        """The named tensors' rows one after another in one new tensor of `dtype` (q, k and v_proj into one
        qkv_proj; a single name gives that tensor). A part stored in `dtype` is read straight into its rows,
        so nothing is held twice; another is read, then cast into them as .to(dtype) would.
        Raises WeightsError for a missing, truncated or mismatched tensor."""
        out = torch.empty(self.stacked_shape(names), dtype=dtype)
        at = 0
        for info in self._stackable(names):
            rows = out[at:at + info.shape[0]]
            with open(info.file, "rb") as f:
                if _DTYPES[info.dtype][0] == dtype:
                    _read_into(f, info, info.start, rows)
                else:
                    stored = torch.empty(info.shape, dtype=_DTYPES[info.dtype][0])
                    _read_into(f, info, info.start, stored)
                    rows.copy_(stored)
            at += info.shape[0]
        return out

    def row_slabs(self, names: Sequence[str], dtype: torch.dtype,
                  slab_bytes: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """The rows load_rows(names, dtype) would hold, as (first row, slab) pieces of at most `slab_bytes` as
        stored (one row at least), read in order, each into a buffer of its own: a consumer that keeps no slab
        (a quantizer) holds one slab at a time, however large the tensors. slab_bytes defaults to SLAB_BYTES.
        Raises WeightsError for a missing, truncated or mismatched tensor."""
        slab_bytes = SLAB_BYTES if slab_bytes is None else slab_bytes
        at = 0
        for info in self._stackable(names):
            stored = _DTYPES[info.dtype][0]
            rows = info.shape[0]
            row_bytes = info.nbytes // rows if rows else 0
            step = max(1, slab_bytes // row_bytes) if row_bytes else max(1, rows)
            with open(info.file, "rb") as f:
                for r0 in range(0, rows, step):
                    r1 = min(rows, r0 + step)
                    slab = torch.empty((r1 - r0, *info.shape[1:]), dtype=stored)
                    _read_into(f, info, info.start + r0 * row_bytes, slab)
                    yield at + r0, slab.to(dtype)
            at += rows

    def _checked(self, name: str) -> TensorInfo:
        """The tensor's entry, its byte span checked against its shape and dtype."""
        try:
            info = self.tensors[name]
        except KeyError:
            raise WeightsError(f"missing tensor {name}") from None
        if info.dtype not in _DTYPES:
            raise WeightsError(f"tensor {name} is stored as {info.dtype}; tc reads F32, F16 and BF16")
        if math.prod(info.shape) * _DTYPES[info.dtype][1] != info.nbytes:
            raise WeightsError(f"tensor {info.name}: byte span does not match its shape")
        return info

    def _stackable(self, names: Sequence[str]) -> list[TensorInfo]:
        infos = [self._checked(name) for name in names]
        if not infos or any(not info.shape or info.shape[1:] != infos[0].shape[1:] for info in infos):
            raise WeightsError(f"cannot stack the rows of {list(names)}: their shapes are "
                               f"{[list(info.shape) for info in infos]}")
        return infos


def _read_into(f: BinaryIO, info: TensorInfo, offset: int, tensor: torch.Tensor) -> None:
    """Fill contiguous `tensor` with the bytes of `info`'s file from `offset` on, by a plain read into memory the
    tensor owns. The file is never mapped, so RSS counts no page of it: freeing a slab or a part that was read
    gives its memory back, where a mapping's pages once touched would count until unmapped. A NaN or an infinity
    in a weight makes every logit NaN, and sampling then picks token 0 for ever: refused here, by the smallest and
    largest value (NaN spreads through both; one pass at the memory's rate, where isfinite() was 25x slower)."""
    assert tensor.is_contiguous()
    view = tensor.reshape(-1).view(torch.uint8).numpy()  # [nbytes], writes land in the tensor
    f.seek(offset)
    if f.readinto(view) != view.nbytes:
        raise WeightsError(f"{info.file}: truncated while reading {info.name}")
    if tensor.numel() and not all(math.isfinite(bound) for bound in torch.aminmax(tensor.reshape(-1))):
        raise WeightsError(f"{info.file}: tensor {info.name} holds NaN or infinite values; {REDO}")
