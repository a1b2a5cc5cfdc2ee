"""Sparse MoE block: softmax router, top-k renormalised, fused experts, sigmoid-gated shared expert.

Routing (`kernels.moe_route`) and the routed experts (`kernels.moe_experts`) are Triton kernels on
CUDA (no host sync, so the block can be captured in a CUDA graph) and torch on CPU, where the experts
run one at a time. Either way a token's weighted expert outputs are added in fp32 in ascending
expert id, so its result does not depend on which other tokens share the step. On the Triton path
the router and the shared-expert gate are read as one [E + 1, H] weight once merged (layers/merge.py),
and the experts' combine kernel also adds the gated shared expert (without expert parallelism).

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
        self.gates_weight: torch.Tensor | None = None  # [E + 1, H] = [router | shared gate] once merged

    def merge_projections(self) -> None:
        """Read the router and the shared-expert gate as one weight (on the Triton path)."""
        if self.gates_weight is None:
            from freetoken.layers.merge import merge_linears

            self.gates_weight = merge_linears([self.gate, self.shared_expert_gate])

    def _gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [N, H] -> router [N, E], shared gate [N, 1]
        if self.gates_weight is not None and kernels.use_triton(x):
            logits = kernels.linear(x, self.gates_weight)  # [N, E + 1]
            return logits[:, :-1], logits[:, -1:]
        return self.gate(x), self.shared_expert_gate(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        router, shared_gate = self._gates(x)
        experts, weights = kernels.moe_route(router, self.top_k, x.dtype)  # [N, top_k]
        routed = (x, experts, weights, self.experts.gate_up_proj, self.experts.down_proj, self.experts.first)
        if self.parallel.is_parallel:
            acc = self.parallel.all_reduce(kernels.moe_experts(*routed))  # [N, H] fp32
            return acc.to(x.dtype) + torch.sigmoid(shared_gate) * self.shared_expert(x)
        return kernels.moe_experts(*routed, self.shared_expert(x), shared_gate)
