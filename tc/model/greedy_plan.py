"""Greedy tokens from an int8 lm_head in a few native calls, on buffers kept from step to step.

Under `quant: int8` and `int4` the head's lm_head is int8 (quant.head_weight_mode), and a greedy step needs one
thing from it: the index of each row's largest logit. Through the modules that is the final norm, the lm_head's
product widened to float32, a view per row and `sampling.choose`: about ten PyTorch operations and calls, each
costing tens of microseconds on caches that the lm_head's weights (130 MB for the demo model) have just swept,
which is why decode_plan.py exists for a stage's layers. Here the rows are copied into a buffer of the plan's own,
the norm writes the next buffer as its forward would (its native kernel where forward takes it, else forward
itself), the lm_head's kernel writes the float32 logits as its `widened` would, and numpy takes each row's argmax:
the same bits as HeadModel.logits, and the same token as sampling.greedy (the first of equal logits, a NaN
counting as largest). On a 2-core Zen 4 EPYC, each after a sweep of the caches, a greedy row of the demo model
took 4.25 ms against 4.55 through the modules (the product itself ~4.1; medians of 40 interleaved pairs).

A plan holds the addresses of the modules' weights, so it serves only the norm and lm_head it was made for
(`current`); HeadModel makes a new one when either is replaced.
"""
from __future__ import annotations

import torch
from torch import nn

from . import native

MAX_ROWS = 8  # rows of a step a plan takes (a batch of greedy sequences, a draft): its logits buffer, 600 KB a row


class GreedyPlan:
    """Each row's greedy token for final hidden states [1, rows, hidden] (bf16, rows <= MAX_ROWS)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        self.norm, self.lm_head = norm, lm_head
        self._addresses = _addresses(norm, lm_head)
        with torch.inference_mode(False):  # buffers written in place by any later step, in inference mode or not
            self._x = torch.empty(MAX_ROWS, lm_head.in_features, dtype=torch.bfloat16)
            self._normed = torch.empty(MAX_ROWS, lm_head.in_features, dtype=torch.bfloat16)
            self._logits = torch.empty(MAX_ROWS, lm_head.out_features, dtype=torch.float32)
        self._logits_np = self._logits.numpy()
        self._calls: dict[int, list[native.Call]] = {}  # by rows: calls on the buffers' first rows

    @staticmethod
    def takes(norm: nn.Module, lm_head: nn.Module) -> bool:
        """Whether a plan takes this norm and lm_head: the lm_head's widened product is its native int8 kernel's,
        which a plan calls by itself, and the norm gives bf16 rows for bf16 rows (that kernel's input, as in
        HeadModel.logits: a norm of float32 weights would give float32, which the lm_head takes otherwise)."""
        if not callable(getattr(lm_head, "widened_call", None)) or getattr(norm, "weight", None) is None:
            return False
        with torch.inference_mode():
            row = torch.zeros(1, lm_head.in_features, dtype=torch.bfloat16)
            return (norm(row).dtype == torch.bfloat16
                    and lm_head.widened_call(row, torch.empty(1, lm_head.out_features)) is not None)

    def current(self, norm: nn.Module, lm_head: nn.Module) -> bool:
        """Whether it was made for these modules, holding their weights where they were then (a weight replaced
        or moved leaves the plan's calls pointing at memory the modules no longer use)."""
        return norm is self.norm and lm_head is self.lm_head and _addresses(norm, lm_head) == self._addresses

    def tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """The tokens, or None where the plan does not take these rows (too many, not bf16)."""
        rows = hidden.shape[1]
        if hidden.dtype != torch.bfloat16 or not 0 < rows <= MAX_ROWS:
            return None
        calls = self._calls.get(rows)
        if calls is None:
            calls = self._calls[rows] = self._make_calls(rows)
        self._x[:rows].copy_(hidden[0])
        native.run_calls(calls)
        return self._logits_np[:rows].argmax(axis=1).tolist()

    def _make_calls(self, rows: int) -> list[native.Call]:
        x, normed, logits = self._x[:rows], self._normed[:rows], self._logits[:rows]
        norm_call = self.norm.native_call(x, normed, planned=False)  # where forward takes the kernel
        product = self.lm_head.widened_call(normed, logits)
        if product is None:  # takes() said otherwise when the plan was made
            raise RuntimeError("the lm_head's product is no longer its native kernel's")
        return [norm_call or (_forward_into, (self.norm, x, normed), None), product]


def _addresses(norm: nn.Module, lm_head: nn.Module) -> tuple[int, ...]:
    """Where the weights a plan's calls read are."""
    return (norm.weight.data_ptr(), lm_head.qweight.data_ptr(), lm_head.scale.data_ptr())


def _forward_into(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    with torch.inference_mode():
        y.copy_(module(x))
