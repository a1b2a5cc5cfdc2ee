"""Sparse MoE block: softmax router, top-k renormalised, fused experts, sigmoid-gated shared expert.

Each token is routed and computed on its own (expert products are per-row), and its expert outputs
are summed in ascending expert order in fp32, so a token's result does not depend on which other
tokens share the step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.layers.basic import MLP, Linear, _empty


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = _empty(num_experts, 2 * intermediate_size, hidden_size)  # gate rows first
        self.down_proj = _empty(num_experts, hidden_size, intermediate_size)
        self.intermediate_size = intermediate_size

    def forward_one(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x [1, H] through expert `expert` -> [1, H]."""
        gate_up = F.linear(x, self.gate_up_proj[expert])
        gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size :]
        return F.linear(F.silu(gate) * up, self.down_proj[expert])


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, shared_intermediate_size: int):
        super().__init__()
        self.gate = Linear(hidden_size, num_experts)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)
        self.shared_expert = MLP(hidden_size, shared_intermediate_size)
        self.shared_expert_gate = Linear(hidden_size, 1)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        router_probs = torch.softmax(self.gate(x).float(), dim=-1)  # [N, E]
        weights, experts = torch.topk(router_probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        routed = []
        for i in range(x.shape[0]):
            order = torch.argsort(experts[i])
            acc = torch.zeros(1, x.shape[1], dtype=torch.float32, device=x.device)
            for j in order.tolist():
                expert = int(experts[i, j])
                acc = acc + (self.experts.forward_one(x[i : i + 1], expert) * weights[i, j]).float()
            routed.append(acc)
        routed_out = torch.cat(routed).to(x.dtype) if routed else torch.zeros_like(x)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed_out + shared
