"""Portable weight-only quantization (int8 per output channel, int4 per group)."""
from __future__ import annotations

WEIGHT_MODES = ("fp16", "int8", "int4")
DEFAULT_GROUP_SIZE = 128


def quantized_nbytes(shape: tuple[int, int], mode: str, group_size: int = DEFAULT_GROUP_SIZE) -> int:
    """Bytes a linear weight of `shape` [out, in] takes in memory in weight mode `mode`."""
    out_features, in_features = shape
    if mode == "fp16":
        return out_features * in_features * 2
    if mode == "int8":
        return out_features * in_features + out_features * 4  # int8 values + fp32 scale per row
    if mode == "int4":
        groups = -(-in_features // group_size)
        return out_features * in_features // 2 + out_features * groups * 2 * 2  # nibbles + fp16 scale, zero
    raise ValueError(f"unknown weight mode {mode!r}; expected one of {WEIGHT_MODES}")
