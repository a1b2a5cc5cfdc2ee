"""Sparse MoE block: softmax router, top-k renormalised, fused experts, sigmoid-gated shared expert.

The routed experts are one op, `kernels.moe_experts`: a grouped GEMM in Triton on CUDA (no host
sync, so the block can be captured in a CUDA graph) and an expert-at-a-time loop on CPU. Either way
a token's weighted expert outputs are added in fp32 in ascending expert id, so its result does not
depend on which other tokens share the step.

Across ranks the experts are split evenly (expert parallel): a rank runs the routed tokens through
its own experts only (the others contribute zero), and the fp32 partial sums are added over ranks in
rank order (experts grouped by rank, still a fixed order per token). The router is replicated; the
shared expert is split like a dense MLP. An expert count the ranks do not divide is refused.
"""

from __future__ import annotations

import torch
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
        acc = kernels.moe_experts(x, experts, weights, self.experts.gate_up_proj, self.experts.down_proj, self.experts.first)  # [N, H] fp32
        acc = self.parallel.all_reduce(acc)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return acc.to(x.dtype) + shared
