"""A preallocated key/value cache for one request on one pipeline stage."""
from __future__ import annotations

import torch


class CacheFullError(RuntimeError):
    """A request ran past the capacity its cache was made with."""


class KVCache:
    """Keys and values of layers [start, end) for positions [0, capacity).

    Allocated once per request so decode steps never reallocate: each step writes one position in place. Keys and
    values share one tensor, so a step stores both with one copy. Left uninitialised: a position is only ever
    read after it was written (attention reads [0, end) of what `update` stored), and untouched pages of a large
    capacity then cost no memory.
    """

    def __init__(self, layer_ids: list[int], n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.layer_ids, self.n_kv_heads, self.head_dim = list(layer_ids), n_kv_heads, head_dim
        shape = (len(layer_ids), 2, 1, n_kv_heads, capacity, head_dim)  # [layers, K/V, B, H_kv, T, D]
        self.kv = torch.empty(shape, dtype=dtype, device=device)
        self.keys, self.values = self.kv[:, 0], self.kv[:, 1]  # [layers, B, H_kv, T, D] views
        self._layers = {layer: self.kv[i] for i, layer in enumerate(layer_ids)}  # [K/V, B, H_kv, T, D] views
        self.capacity = capacity
        self.length = 0  # positions filled, the same for every layer once a forward completes
        self._layer_bytes = 2 * n_kv_heads * capacity * head_dim * dtype.itemsize  # one layer's slot in kv

    def update(self, layer: int, position_start: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys and values kv ([2, B, H_kv, L, D]) at positions [position_start, +L); return all keys and
        values so far ([B, H_kv, position_start + L, D] each)."""
        end = position_start + kv.shape[3]
        if end > self.capacity:
            raise CacheFullError(f"position {end - 1} is past this request's cache capacity {self.capacity}")
        slot = self._layers[layer]
        slot[:, :, :, position_start:end] = kv
        return slot[0, :, :, :end], slot[1, :, :, :end]

    def copy(self, capacity: int | None = None, length: int | None = None) -> "KVCache":
        """A new cache of `capacity` positions (default: this one's, and never fewer than it keeps) holding the
        first `length` positions this one holds (default: all of them, [0, self.length))."""
        length = self.length if length is None else length
        if not 0 <= length <= self.length:
            raise ValueError(f"a copy of {length} positions from a cache holding {self.length}")
        capacity = self.capacity if capacity is None else max(capacity, length)
        twin = KVCache(self.layer_ids, self.n_kv_heads, self.head_dim, capacity, self.kv.dtype, self.kv.device)
        twin.kv[:, :, :, :, :length] = self.kv[:, :, :, :, :length]
        twin.length = length
        return twin

    def cut(self, length: int, capacity: int) -> "KVCache":
        """This cache holding only its first `length` positions, with room for `capacity` (a cache taken up by a
        request whose prompt shares only its start): itself where it has the room, else a larger copy."""
        if not 0 <= length <= self.length:
            raise ValueError(f"a cut to {length} positions of a cache holding {self.length}")
        if capacity > self.capacity:
            return self.copy(capacity, length)
        self.length = length  # later positions are written again before anything reads them
        return self

    def layer_slot(self, layer: int, position: int) -> torch.Tensor:
        """The storage of `layer` ([K/V, B, H_kv, capacity, D], contiguous) for a kernel that stores `position`
        itself; raises CacheFullError where the position is past the capacity, as `update` does."""
        self._check_position(position)
        return self._layers[layer]

    def storage(self, position: int) -> tuple[int, int]:
        """Where this cache's storage starts and the bytes of each layer's slot in it (layer_ids' slots one after
        another, each as layer_slot's), for a kernel that stores `position` itself: one read of an address where a
        slot per layer would take a tensor op each. Raises as layer_slot does."""
        self._check_position(position)
        return self.kv.data_ptr(), self._layer_bytes

    def _check_position(self, position: int) -> None:
        if position >= self.capacity:
            raise CacheFullError(f"position {position} is past this request's cache capacity {self.capacity}")
        if position < 0:
            raise ValueError(f"position {position} is negative")

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes
