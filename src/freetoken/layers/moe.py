"""Sparse MoE block: softmax router, top-k renormalised, fused experts, sigmoid-gated shared expert.

Experts run one at a time over all the tokens routed to them (one row-invariant linear per expert
and projection, not one per token). Expert outputs are accumulated in fp32 in ascending expert
order, which for every token is the ascending order of its own experts, so a token's result does
not depend on which other tokens share the step.

Across ranks the experts are split evenly (expert parallel): a rank runs the routed tokens through
its own experts only, and the fp32 partial sums are added over ranks in rank order (experts
grouped by rank, still a fixed order per token). The router is replicated; the shared expert is split like a dense MLP. An
expert count the ranks do not divide is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken import kernels
from freetoken.distributed.context import SINGLE, ParallelContext
from freetoken.distributed.sharding import ShardSpec
from freetoken.layers.basic import MLP, Linear, _empty


class FusedExperts(nn.Module):
    """Experts [first, first + count) of the layer; `expert` arguments are global expert ids."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, parallel: ParallelContext = SINGLE):
        super().__init__()
        self.first, stop = parallel.split(num_experts, "MoE experts (expert parallel)")
        self.count = stop - self.first
        self.gate_up_proj = _empty(self.count, 2 * intermediate_size, hidden_size)  # gate rows first
        self.down_proj = _empty(self.count, hidden_size, intermediate_size)
        self.intermediate_size = intermediate_size
        if parallel.is_parallel:
            mine = ShardSpec(0, ((self.first, stop),))
            self.shard_specs = {"gate_up_proj": mine, "down_proj": mine}

    def holds(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.count

    def forward_rows(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x [n, H] through expert `expert` -> [n, H]."""
        local = expert - self.first
        gate_up = kernels.linear(x, self.gate_up_proj[local])
        gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size :]
        return kernels.linear(F.silu(gate) * up, self.down_proj[local])


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, shared_intermediate_size: int, parallel: ParallelContext = SINGLE):
        super().__init__()
        self.gate = Linear(hidden_size, num_experts)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, parallel)
        self.shared_expert = MLP(hidden_size, shared_intermediate_size, parallel)
        self.shared_expert_gate = Linear(hidden_size, 1)
        self.top_k = top_k
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        router_probs = torch.softmax(self.gate(x).float(), dim=-1)  # [N, E]
        weights, experts = torch.topk(router_probs, self.top_k, dim=-1)  # [N, top_k]
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in torch.unique(experts).tolist():  # ascending
            if not self.experts.holds(expert):
                continue
            tokens, slot = (experts == expert).nonzero(as_tuple=True)
            y = self.experts.forward_rows(x[tokens], expert)
            acc[tokens] = acc[tokens] + (y * weights[tokens, slot][:, None]).float()
        acc = self.parallel.all_reduce(acc)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return acc.to(x.dtype) + shared
