"""Greedy tokens from a bf16 lm_head without reading all of it: an int8 screen, and the few rows it cannot rule out.

A greedy step needs one thing from the lm_head, the index of its largest logit. A bf16 lm_head reads 2 bytes a
weight to give all of them (272 MB a token for the demo model: the largest single read of a step); its int8 copy
reads 1. For vocabulary row r the screen's logit S_r (the native int8 product: weights per row, activations per
32 columns, float32 sums left unrounded) is within B_r of the real x . W_r, by Cauchy-Schwarz term by term:

    |x| |W_r - W8_r|                      the weight's quantization, measured per row once at load
    + |x - xq| |W8_r|                     the activations' quantization: each within half a step, max|x| / 254,
                                          of its block of 32 columns
    + REL |x| (|W8_r| + |W_r - W8_r|)     float32 sums of K products, in the screen and in the full product

so the row the full product would pick lies where S_r + B_r reaches the best lower bound max(S_s - B_s), less the
rounding of the lm_head's bf16 output (two logits that round equal tie, and the first wins). Those rows (a median
of 4 of 152k for the demo model on real text, at most ~1,100; past 1 / SCREEN_MAX_SHARE of the vocabulary the
caller takes the full product) are multiplied from the bf16 weight itself in float32, rounded to bf16 as the
lm_head rounds, and the first of the largest is the token: the full product's token, but where two logits are
within the float32 sums' rounding of a tie, where the bf16 products tc chooses between already differ.

Worth it only where the int8 product streams faster than the lm_head's own: a probe at load decides
(`HeadModel.screen_greedy`).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from . import native
from .quant import quantize_int8

# More candidate rows than the vocabulary / this: the full product reads as little, so the caller takes it.
SCREEN_MAX_SHARE = 8
# The screen's product must take at most this share of the full product's time to be used: the rest of a step's
# screening (the bounds' passes over the vocabulary, the kept rows) costs ~0.5 ms, ~6% of the demo's bf16 product.
MAX_TIME_SHARE = 0.8
_ROUNDING = 2.0 ** -24  # a float32 operation's relative rounding (half an ulp)
_SLAB_ROWS = 8192  # rows of the weight measured at a time at load: their float32 copy stays small
_SLACK = 1 + 1e-3  # on the norms a step computes in float32 for the bound
BLOCK_ROWS = 64  # vocabulary rows whose largest upper bound is compared with the line at once


def screens(weight: object) -> bool:
    """Whether `weight` is one a greedy screen takes: a CPU bf16 matrix the native int8 product can tile."""
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and native.shape_ok_int8(*weight.shape))


class GreedyScreen:
    """The int8 copy of a bf16 lm_head weight [vocab, K] (the native kernels' tiled layout) with each row's
    bounds, and the weight itself (not copied) for the rows the screen keeps. One step at a time: a step's
    bounds are written into a buffer it keeps."""

    def __init__(self, weight: torch.Tensor, kernels: native.Kernels):
        if not screens(weight):
            raise ValueError(f"a greedy screen takes a CPU bf16 weight the native int8 product can tile, got "
                             f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
        rows, cols = weight.shape
        quantized = quantize_int8(weight)
        error = torch.empty(rows)
        norm = torch.empty(rows)
        for start in range(0, rows, _SLAB_ROWS):
            end = min(rows, start + _SLAB_ROWS)
            codes = quantized.qweight[start:end].float() * quantized.scale[start:end, None]
            error[start:end] = (weight[start:end].float() - codes).norm(dim=1)
            norm[start:end] = codes.norm(dim=1)
        if not (bool(torch.isfinite(error).all()) and bool(torch.isfinite(norm).all())):
            raise ValueError("the weight has rows that are not finite: a greedy screen cannot bound them")
        self.weight = weight
        self.kernels = kernels
        self.qweight = native.tile_int8(quantized.qweight)
        self.scale = quantized.scale
        self.error_norm = error  # |W_r - W8_r|
        self.norm_bound = norm.add_(error)  # |W8_r| + |W_r - W8_r|, at least |W_r| and |W8_r|
        # float32 sums of K products in either product: each within ~K * _ROUNDING of sum |x_i w_i| <= |x| |w|
        self.sum_rounding = 2 * (cols + 2) * _ROUNDING
        self.vocab = rows
        self._error_max, self._norm_max = float(error.max()), float(self.norm_bound.max())
        # each step's upper bounds, in whole blocks: the rows past the vocabulary stay -inf, below any line
        self._upper = torch.full((-(-rows // BLOCK_ROWS) * BLOCK_ROWS,), float("-inf"))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale, self.error_norm, self.norm_bound))

    def screen(self, x: torch.Tensor) -> torch.Tensor:
        """The int8 logits [rows, vocab], float32, of contiguous bf16 rows x [rows, K]."""
        return self.kernels.int8_product(x, self.qweight, self.scale, None, widened=True, rounded=False)

    def bound_terms(self, row: np.ndarray) -> tuple[float, float] | None:
        """For one row x (float32): the bound of each vocabulary row r, B_r = a |W_r - W8_r| + b (|W8_r| +
        |W_r - W8_r|), as (a, b); None where x is not finite. a = |x|; b = |x - xq| (each activation code within
        half its block's step, max|x| / 127) + the float32 sums' rounding. Both with room for their own float32
        rounding; numpy's operations on one row cost a tenth of torch's on a step's cold caches."""
        x_norm = float(np.sqrt(row @ row)) * _SLACK
        if not x_norm < float("inf"):
            return None
        half_steps = np.abs(row).reshape(-1, native.ACTIVATION_GROUP).max(axis=1) / (2 * 127)
        activation = float(np.sqrt(half_steps @ half_steps * native.ACTIVATION_GROUP)) * _SLACK
        return x_norm, activation + self.sum_rounding * x_norm

    def candidates(self, x: torch.Tensor, softcap: float | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For contiguous bf16 rows x [rows, K] (normed final hidden states): the vocabulary rows that may hold
        each row's largest logit (int64, ascending) and the logits of x there [rows, candidates] as the lm_head
        writes them (bf16 values, in float32); None where a row is not finite or too many rows remain. With
        `softcap`, the rows that may hold the largest of softcap * tanh(logit / softcap) in float32, as the head
        caps its logits (Gemma 2's final_logit_softcapping).

        Each step's work past the screen's product is a few passes over vocabulary-long vectors, which a decode
        step finds in no cache: numpy's argmax, not torch's (10 us against 125 over 152k), and the rows above
        the line found a block of BLOCK_ROWS at a time (torch's nonzero over the whole vector took 230 us)."""
        screened = self.screen(x)
        xf = x.float()
        eps = torch.finfo(x.dtype).eps
        upper = self._upper[:self.vocab]
        found = []
        for row, s in zip(xf.numpy(), screened):
            terms = self.bound_terms(row)
            if terms is None:  # inf or NaN: the full product says what it makes of it
                return None
            x_norm, weight_norm_factor = terms
            torch.add(s, self.error_norm, alpha=x_norm, out=upper).add_(self.norm_bound, alpha=weight_norm_factor)
            # a lower bound of the best logit: the screen's best row's, less its bound
            best = int(s.numpy().argmax())
            lowest_best = float(s[best]) - x_norm * float(self.error_norm[best]) \
                - weight_norm_factor * float(self.norm_bound[best])
            # the output's bf16 rounding: logits within an ulp of the best may round to its value and tie it;
            # the best is below lowest_best + 2 * (the largest bound)
            largest_bound = x_norm * self._error_max + weight_norm_factor * self._norm_max
            line = lowest_best - 2 * eps * (abs(lowest_best) + 2 * largest_bound)
            if softcap is not None:
                line = _below_the_cap(line, softcap, eps)
            blocks = np.flatnonzero(self._upper.view(-1, BLOCK_ROWS).amax(dim=1).numpy() >= line)
            rows = (blocks[:, None] * BLOCK_ROWS + np.arange(BLOCK_ROWS)).ravel()
            found.append(rows[self._upper.numpy()[rows] >= line])
            if sum(len(f) for f in found) > self.vocab // SCREEN_MAX_SHARE:
                return None
        ids = torch.from_numpy(np.unique(np.concatenate(found)))
        exact = torch.mm(xf, self.weight.index_select(0, ids).float().t()).to(x.dtype).float()
        return ids, exact


def _below_the_cap(line: float, cap: float, eps: float) -> float:
    """The line for logits capped as cap * tanh(logit / cap) in float32, given the line for the logits themselves:
    near +-cap the capped values of logits far apart round equal (with a cap of 30 every bf16 logit past ~270 caps
    to 30.0), and the first of them wins, so a row is kept where its capped logit may come within the float32
    rounding of the cap (a few ulps of cap, for the division, tanh and the product, of either row) of the best's,
    and its bf16 logit may round up to there."""
    reach = math.tanh(line / cap) - 16 * _ROUNDING
    if reach <= -1:
        return float("-inf")
    line = cap * math.atanh(reach)
    return line - 2 * eps * abs(line)
