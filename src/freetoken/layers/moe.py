"""Sparse MoE block: softmax router, top-k renormalised, fused experts, sigmoid-gated shared expert.

Routing (`kernels.moe_route`) and the routed experts (`kernels.moe_experts`) are Triton kernels on
CUDA (no host sync, so the block can be captured in a CUDA graph) and torch on CPU, where the experts
run one at a time. Either way a token's weighted expert outputs are added in fp32 in ascending
expert id, so its result does not depend on which other tokens share the step. On the Triton path
the router and the shared-expert gate are read as one [E + 1, H] weight once merged (layers/merge.py).
Merged, without expert parallelism and with the shared expert as wide as a routed one, the shared
expert is also stacked after the routed experts as expert E ([E + 1, 2I, H] and [E + 1, H, I]; the
experts' and the shared MLP's parameters become views of them): every token is routed to it as one
more row of the grouped GEMMs, and the combine adds it gated. Otherwise the shared expert runs as a
dense MLP and the combine adds its output. The torch path is unchanged by either.

Launches per block on the Triton path, merged: the decoder layer hands the block the mixer's output
and the residual (`add_norm_forward`), and one launch does the residual add, the post-attention norm,
the gate logits and the routing (`kernels.moe_add_norm_route`); at small decode and verify sizes
(N * R <= 32 routed rows, R = top_k + 1 stacked, else top_k; `moe_route_triton.DIRECT_MAX_ROWS`) it also
writes the expert GEMMs' row blocks (one row per block), and up to moe_triton.COMBINE_IN_DOWN_MAX_TOKENS
tokens the down launch also combines, so with the stacked shared expert the add, norm and block are
three launches (that one, gate_up, down), and with a dense shared MLP six (and the MLP's gate_up
linear, silu_mul and down linear). In the decoder trunk (`defer_output`) the stacked block's combine
moves instead into the next residual add + norm's launch (kernels/moe_exit_triton.py). Above those sizes, the rows are grouped by expert first (align)
and the combine has its own launch: one launch more each. A row's result has the same bits either way.

Across ranks the experts are split evenly (expert parallel): a rank runs the routed tokens through
its own experts only (the others contribute zero), and the fp32 partial sums are added over ranks in
rank order (experts grouped by rank, still a fixed order per token). The router is replicated; the
shared expert is split like a dense MLP. An expert count the ranks do not divide is refused.

With its routed experts offloaded (`offload`, layers/expert_offload.py: a device cache of expert slots,
or a static GPU/CPU split) the block routes as above but without the fused entry, and hands the routing
to the offload, which reads it on the host to place the experts and then runs the same expert kernels.
A `routing_observer` (layers/routing_counts.py) is handed each routing's expert ids [N, top_k]; while
one is set the block skips the fused entry too.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken import kernels
from freetoken.distributed.context import SINGLE, ParallelContext
from freetoken.distributed.sharding import ShardSpec
from freetoken.kernels import activation_ref
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
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # gate_up [E + 1, 2I, H], down [E + 1, H, I] once merged
        self.offload = None  # an OffloadedExperts when the routed experts live off the device (layers/expert_offload.py)
        self.routing_observer = None  # a callable given each routing's expert ids [N, top_k] (layers/routing_counts.py)

    def merge_projections(self) -> None:
        """Read the router and the shared-expert gate as one weight, and stack the shared expert after
        the routed ones when it is as wide and the experts are not split (on the Triton path)."""
        if self.gates_weight is None:
            from freetoken.layers.merge import merge_linears

            self.gates_weight = merge_linears([self.gate, self.shared_expert_gate])
        if self.stacked is None and self.stacks_shared_expert:
            self.stacked = _stack_shared_expert(self.experts, self.shared_expert) if self.offload is None else self.offload.stack_shared(self.shared_expert)

    @property
    def stacks_shared_expert(self) -> bool:
        """Whether merging stacks the shared expert after the routed ones (as wide, experts not split)."""
        return not self.parallel.is_parallel and self.shared_expert.down_proj.weight.shape[1] == self.experts.intermediate_size

    def _gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [N, H] -> router [N, E], shared gate [N, 1]
        if self.gates_weight is not None and kernels.use_triton(x):
            logits = kernels.linear(x, self.gates_weight)  # [N, E + 1]
            return logits[:, :-1], logits[:, -1:]
        return self.gate(x), self.shared_expert_gate(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        router, shared_gate = self._gates(x)
        stacked = self.stacked is not None and kernels.use_triton(x)
        routing = kernels.moe_route(router, self.top_k, x.dtype, **self._routed(stacked))
        if self.routing_observer is not None:
            self.routing_observer(routing[0][:, : self.top_k])
        if self.offload is not None:
            return self.offload(self, x, *routing, shared_gate, stacked)
        return self._experts(x, *routing, shared_gate, stacked)

    def add_norm_forward(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module, defer_output: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(block(norm(x + residual)), x + residual): on the Triton path with merged gates the add, the
        norm, the gates and the routing are one launch (`kernels.moe_add_norm_route`); [N, H] each.
        defer_output: the block output may come back as a `PendingCombine` for the caller's next
        `kernels.add_zc_rms_norm`, which then combines it (stacked shared expert, decode sizes)."""
        unfused = self.offload is not None or self.routing_observer is not None
        if unfused or self.gates_weight is None or not kernels.use_triton(residual) or not kernels.FUSE_MOE_ENTRY:
            residual, h = kernels.add_zc_rms_norm(x, residual, norm.weight, norm.eps)
            return self(h), residual
        stacked = self.stacked is not None
        # the entry launch prefetches the stacked shared expert's gate_up rows into L2 (kernels.l2_span)
        prefetch = kernels.l2_span(self.stacked[0][-1], residual, "mlp") if stacked else None
        residual, h, experts, weights, shared_gate, blocks = kernels.moe_add_norm_route(
            x, residual, norm.weight, norm.eps, self.gates_weight, self.top_k, **self._routed(stacked), prefetch=prefetch,
        )
        return self._experts(h, experts, weights, blocks, shared_gate, stacked, defer_output), residual

    def _routed(self, stacked: bool) -> dict:
        """Routing's with_shared / first / count: the stacked shared expert as one more expert, else this rank's experts."""
        return dict(with_shared=True, first=0, count=None) if stacked else dict(with_shared=False, first=self.experts.first, count=self.experts.count)

    def _experts(self, x, experts, weights, blocks, shared_gate, stacked: bool, defer_combine: bool = False) -> torch.Tensor:  # routed (and shared) experts of x [N, H] -> [N, H]
        if stacked:  # experts [N, top_k + 1], weights [N, top_k]
            return kernels.moe_experts_with_shared(x, experts, weights, *self.stacked, shared_gate, blocks, defer_combine)
        routed = (x, experts, weights, self.experts.gate_up_proj, self.experts.down_proj, self.experts.first)
        if self.parallel.is_parallel:
            acc = self.parallel.all_reduce(kernels.moe_experts(*routed, blocks=blocks))  # [N, H] fp32
            return acc.to(x.dtype) + activation_ref.sigmoid(shared_gate) * self.shared_expert(x)
        return kernels.moe_experts(*routed, self.shared_expert(x), shared_gate, blocks)


def moe_blocks(model: nn.Module) -> list[tuple[str, SparseMoE]]:
    """The model's SparseMoE blocks with their module names, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, SparseMoE)]


def _stack_shared_expert(experts: FusedExperts, mlp: MLP) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [E + 1, 2I, H] (gate rows first) and down [E + 1, H, I]: the experts, then the MLP as
    expert E. The experts' and the MLP's parameters become views of them (names and shapes unchanged)."""
    gate_up = torch.cat([experts.gate_up_proj.detach(), shared_gate_up(mlp).detach()[None]])
    down = torch.cat([experts.down_proj.detach(), mlp.down_proj.weight.detach()[None]])
    count = experts.count
    view = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
    experts.gate_up_proj, experts.down_proj = view(gate_up[:count]), view(down[:count])
    view_shared_mlp(mlp, gate_up[count], down[count])
    return gate_up, down


def shared_gate_up(mlp: MLP) -> torch.Tensor:  # -> [2I, H], gate rows first
    return mlp.gate_up_weight if mlp.gate_up_weight is not None else torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])


def view_shared_mlp(mlp: MLP, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """Make the MLP's parameters views of gate_up [2I, H] (gate rows first) and down [H, I], which hold its weights."""
    inter = gate_up.shape[0] // 2
    view = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
    mlp.gate_proj.weight, mlp.up_proj.weight = view(gate_up[:inter]), view(gate_up[inter:])
    mlp.down_proj.weight = view(down)
    mlp.gate_up_weight = gate_up
