"""Mixture-of-experts feed-forward (Qwen2-MoE, Qwen3-MoE, Mixtral): a router picks top-k experts per token.

Each expert is an `MLP` like a dense layer's, so quantization replaces its linear layers like any other, and the
experts of a layer live on the worker that owns the layer (they are simply part of it). The router stays in the
compute dtype (it is a plain weight, not a Linear, so quantize_linears leaves it): its choice among experts is
what a rounding would flip; so does a shared expert's gate (Qwen2-MoE's), one row that scales the shared expert's
output. Only the experts some token chose run; a decode step runs top_k of them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .qwen2 import MLP


class SharedExpertGate(nn.Module):
    """How much of the shared expert's output a token takes: sigmoid(x . w), a plain weight of one row."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.weight))


class Router(nn.Module):
    """Softmax over the experts' logits, the top k of them (renormalised where the family does), in fp32."""

    def __init__(self, hidden: int, count: int, top_k: int, normalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(count, hidden))
        self.top_k, self.normalize = top_k, normalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> weights [T, k] in x's dtype and expert indices [T, k]."""
        logits = F.linear(x, self.weight)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        e = config.experts
        assert e is not None
        self.gate = Router(config.hidden_size, e.count, e.top_k, e.normalize_top_k)
        self.experts = nn.ModuleList(MLP(config, e.intermediate_size, False) for _ in range(e.count))
        if e.shared_intermediate_size:
            self.shared_expert = MLP(config, e.shared_intermediate_size, False)
            self.shared_expert_gate = SharedExpertGate(config.hidden_size)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # [B, L, hidden]
        flat = x.reshape(-1, shape[-1])  # [T, hidden]
        weights, chosen = self.gate(flat)  # [T, k]
        out = torch.zeros_like(flat)
        for expert in torch.unique(chosen).tolist():  # only the experts some token chose
            tokens, slot = torch.where(chosen == expert)  # [n] each
            y = self.experts[expert](flat[tokens]) * weights[tokens, slot, None]  # [n, hidden]
            out.index_add_(0, tokens, y)
        if self.shared_expert is not None:
            out = out + self.shared_expert_gate(flat) * self.shared_expert(flat)
        return out.view(shape)
