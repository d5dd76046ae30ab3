"""A malformed safetensors header or shard index is refused with one WeightsError line naming the file, never a
traceback, never bytes from outside a tensor's data read as its weights, never a file outside the model directory."""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from tc.model.config import Qwen2Config
from tc.model.weights import INDEX_FILE, SINGLE_FILE, WeightIndex, WeightsError
from tiny_model import write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
NORM = "model.norm.weight"  # 64 F32 values: 256 bytes, stored after a header of several KB


def rewrite_header(path: Path, change: Callable[[dict], object]) -> None:
    """Replace the header of safetensors file `path` by change(header), keeping the data bytes as they are."""
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    new = json.dumps(change(header)).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + header_len:])


def set_entry(name: str, key: str, value: object) -> Callable[[dict], dict]:
    def change(header: dict) -> dict:
        header[name][key] = value
        return header
    return change


def drop_entry_key(name: str, key: str) -> Callable[[dict], dict]:
    def change(header: dict) -> dict:
        del header[name][key]
        return header
    return change


def replace_entry(name: str, value: object) -> Callable[[dict], dict]:
    def change(header: dict) -> dict:
        header[name] = value
        return header
    return change


def load_all(model_dir: Path) -> None:
    index = WeightIndex.open(model_dir)
    index.load(sorted(index.tensors))


def assert_one_line(exc: pytest.ExceptionInfo, path: Path) -> None:
    message = str(exc.value)
    assert "\n" not in message and str(path) in message, message


@pytest.fixture()
def tiny(tmp_path) -> Path:
    return write_tiny_model(tmp_path / "tiny", seed=0)


@pytest.fixture()
def sharded(tmp_path) -> Path:
    return write_tiny_model(tmp_path / "sharded", seed=0, shards=2)


def test_negative_offsets_do_not_read_the_header_as_weights(tiny):
    """[-L-100, -100] once pointed back into the header, and its bytes loaded as model.norm.weight."""
    path = tiny / SINGLE_FILE
    rewrite_header(path, set_entry(NORM, "data_offsets", [-256 - 100, -100]))
    with pytest.raises(WeightsError, match=rf"tensor {NORM} has data_offsets \[-356, -100\], not \[begin, end\]"
                                           r".*re-download or re-convert the checkpoint") as exc:
        load_all(tiny)
    assert_one_line(exc, path)


@pytest.mark.parametrize("change, match", [
    (lambda h: list(h), "a JSON array, not an object"),
    (replace_entry(NORM, "F32"), f"tensor {NORM} is a JSON string, not an object"),
    (drop_entry_key(NORM, "data_offsets"), f"tensor {NORM} has data_offsets None"),
    (set_entry(NORM, "data_offsets", ["0", "256"]), f"tensor {NORM} has data_offsets \\['0', '256'\\]"),
    (set_entry(NORM, "data_offsets", [0, 256, 512]), "has data_offsets \\[0, 256, 512\\]"),
    (set_entry(NORM, "data_offsets", [256, 0]), "has data_offsets \\[256, 0\\]"),
    (set_entry(NORM, "data_offsets", [0, 10 ** 9]), "has data_offsets \\[0, 1000000000\\]"),
    (set_entry(NORM, "data_offsets", [False, True]), "has data_offsets \\[False, True\\]"),
    (set_entry(NORM, "shape", None), f"tensor {NORM} has shape None, not a list of non-negative integers"),
    (set_entry(NORM, "shape", "64"), f"tensor {NORM} has shape '64', not a list"),
    (set_entry(NORM, "shape", [-64]), "has shape \\[-64\\], not a list"),
    (set_entry(NORM, "shape", [64.0]), "has shape \\[64.0\\], not a list"),
    (set_entry(NORM, "dtype", 4), f"tensor {NORM} has dtype 4, not a string"),
    (drop_entry_key(NORM, "dtype"), "has dtype None, not a string"),
], ids=["header-list", "entry-string", "no-offsets", "offsets-strings", "three-offsets", "offsets-reversed",
        "offsets-past-end", "offsets-bools", "shape-null", "shape-string", "shape-negative", "shape-float",
        "dtype-int", "no-dtype"])
def test_malformed_header_is_a_weights_error(tiny, change, match):
    path = tiny / SINGLE_FILE
    rewrite_header(path, change)
    with pytest.raises(WeightsError, match=match) as exc:
        load_all(tiny)
    assert_one_line(exc, path)


def test_metadata_entry_is_still_legal(tiny):
    path = tiny / SINGLE_FILE
    rewrite_header(path, lambda h: {**h, "__metadata__": {"format": "pt", "converter": "anything"}})
    index = WeightIndex.open(tiny)
    assert "__metadata__" not in index.tensors
    assert tuple(index.load([NORM])[NORM].shape) == (64,)


def rewrite_index(model_dir: Path, change: Callable[[dict], object]) -> Path:
    path = model_dir / INDEX_FILE
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    return path


def set_file(name: str, file: object) -> Callable[[dict], dict]:
    def change(index: dict) -> dict:
        index["weight_map"][name] = file
        return index
    return change


@pytest.mark.parametrize("change, match", [
    (lambda i: [i], "its weight_map is None, not an object"),
    (lambda i: {"metadata": i["metadata"]}, "its weight_map is None, not an object"),
    (lambda i: {**i, "weight_map": list(i["weight_map"])}, "its weight_map is \\['model.*\\.\\.\\., not an object"),
    (set_file(NORM, None), f"weight_map entry {NORM} names None, not a file name"),
    (set_file(NORM, 2), f"weight_map entry {NORM} names 2, not a file name"),
    (set_file(NORM, ""), f"weight_map entry {NORM} names '', not a file name"),
], ids=["index-list", "no-weight-map", "weight-map-list", "file-null", "file-int", "file-empty"])
def test_malformed_shard_index_is_a_weights_error(sharded, change, match):
    path = rewrite_index(sharded, change)
    with pytest.raises(WeightsError, match=match) as exc:
        WeightIndex.open(sharded)
    assert_one_line(exc, path)


def test_shard_index_that_is_not_utf8_is_a_weights_error(sharded):
    path = sharded / INDEX_FILE
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(WeightsError, match="unreadable shard index") as exc:
        WeightIndex.open(sharded)
    assert_one_line(exc, path)


@pytest.mark.parametrize("where", ["absolute", "parent", "subdir", "dot-dot", "windows-drive", "backslash"])
def test_shard_index_cannot_name_a_file_outside_the_model_directory(sharded, tmp_path, where):
    """Where a name reaches a file at all, it is a real copy of the shard holding model.norm.weight, so only the
    refusal stops it being opened."""
    shard = json.loads((sharded / INDEX_FILE).read_text())["weight_map"][NORM]
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(sharded / shard, outside / shard)
    (sharded / "sub").mkdir()
    shutil.copy(sharded / shard, sharded / "sub" / shard)
    file = {"absolute": str(outside / shard), "parent": f"../outside/{shard}", "subdir": f"sub/{shard}",
            "dot-dot": "..", "windows-drive": f"C:{shard}", "backslash": f"sub\\{shard}"}[where]
    path = rewrite_index(sharded, set_file(NORM, file))
    with pytest.raises(WeightsError, match=rf"weight_map entry {NORM} names .*, not a file name in the model "
                                           r"directory; re-download or re-convert the checkpoint") as exc:
        WeightIndex.open(sharded, only=[NORM])
    assert_one_line(exc, path)


def test_unsharded_checkpoint_still_loads_and_validates(tiny):
    index = WeightIndex.open(tiny)
    index.validate(Qwen2Config.from_file(tiny / "config.json"))
    assert len(index.load(sorted(index.tensors))) == len(index.tensors)


def test_generate_reports_a_corrupt_header_in_one_line(tiny):
    """The command line turns the WeightsError into one logged line and exit status 2, where it once generated
    from the header's bytes."""
    rewrite_header(tiny / SINGLE_FILE, set_entry(NORM, "data_offsets", [-356, -100]))
    proc = subprocess.run([sys.executable, "-m", "tc", "generate", "--model", str(tiny), "--prompt", "hi",
                           "--max-tokens", "2", "--dtype", "fp32"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"{NORM} has data_offsets [-356, -100]" in errors[0], proc.stderr


def test_deeply_nested_json_is_a_weights_error(tiny, tmp_path):
    """JSON nested deeper than the parser's recursion limit raised RecursionError, past the WeightsError catch."""
    nested = b"[" * 200_000
    path = tiny / SINGLE_FILE
    path.write_bytes(struct.pack("<Q", len(nested)) + nested)
    with pytest.raises(WeightsError, match="malformed safetensors header") as exc:
        WeightIndex.open(tiny)
    assert_one_line(exc, path)
    sharded = write_tiny_model(tmp_path / "sharded", seed=0, shards=2)
    (sharded / INDEX_FILE).write_bytes(nested)
    with pytest.raises(WeightsError, match="unreadable shard index") as exc:
        WeightIndex.open(sharded)
    assert_one_line(exc, sharded / INDEX_FILE)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_weight_that_is_not_finite_is_refused_on_every_read(tmp_path, bad):
    """One NaN or infinity in a weight makes every logit NaN (greedy then answers token 0 for ever, sampling ""):
    refused as the tensor is read, whole (load, load_rows) or in slabs (row_slabs, as a quantizing load reads)."""
    from safetensors.torch import load_file, save_file

    from tc.model.weights import WeightIndex, WeightsError
    from tiny_model import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "m", seed=4)
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.layers.2.mlp.down_proj.weight"
    tensors[name][7, 3] = bad
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    index = WeightIndex.open(model_dir)
    for read in (lambda: index.load([name]), lambda: index.load_rows([name], torch.float32),
                 lambda: list(index.row_slabs([name], torch.bfloat16, slab_bytes=256))):
        with pytest.raises(WeightsError, match=f"tensor {name} holds NaN or infinite values"):
            read()
    assert index.load(["model.layers.1.mlp.down_proj.weight"])  # the others read as before
