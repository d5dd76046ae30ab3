"""A preallocated key/value cache for one request on one pipeline stage."""
from __future__ import annotations

import torch


class CacheFullError(RuntimeError):
    """A request ran past the capacity its cache was made with."""


class KVCache:
    """Keys and values of layers [start, end) for positions [0, capacity).

    Allocated once per request so decode steps never reallocate: each step writes one position in place.
    """

    def __init__(self, layer_ids: list[int], n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (len(layer_ids), 1, n_kv_heads, capacity, head_dim)  # [layers, B, H_kv, T, D]
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.slot = {layer: i for i, layer in enumerate(layer_ids)}
        self.capacity = capacity
        self.length = 0  # positions filled, the same for every layer once a forward completes

    def update(self, layer: int, position_start: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([B, H_kv, L, D]) at positions [position_start, +L); return all keys/values so far."""
        end = position_start + k.shape[2]
        if end > self.capacity:
            raise CacheFullError(f"position {end - 1} is past this request's cache capacity {self.capacity}")
        i = self.slot[layer]
        self.keys[i, :, :, position_start:end] = k
        self.values[i, :, :, position_start:end] = v
        return self.keys[i, :, :, :end], self.values[i, :, :, :end]  # [B, H_kv, end, D]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes
