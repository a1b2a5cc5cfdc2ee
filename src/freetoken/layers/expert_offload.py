"""A sparse MoE block's routed experts off the device: a device cache of slots, or a static GPU/CPU split.

Both are called by `SparseMoE.forward` with the block's routing (experts [N, top_k (+ 1)], weights
[N, top_k], the routing's row blocks) and return the block output [N, H] in x.dtype, as
`SparseMoE._experts` does. Each reads the routing on the host (one sync per MoE layer).

CachedExperts (`--expert-offload cache`): the router's experts are fetched into the layer's slots
(expert_cache.py), then the resident path's own kernels run on the slots through `slot_of`. The
kernels order every reduction by expert id, never by slot, so each row has the bits of the resident
model: with the shared expert stacked (as the resident block stacks it on the Triton path) through
moe_experts_with_shared, else moe_experts with the dense shared MLP.

HybridExperts (`--expert-offload hybrid`): N experts per layer are resident ([0, N), or a placement
file's ids). The block renumbers the layer's experts so the resident ones come first: `rank` maps an
expert id to its place in [resident ids ascending, host ids ascending], the identity for [0, N). On
the ranks, the device computes the fp32 partial sum over the resident experts (kernels.moe_experts,
ascending rank = ascending id), the CPU computes each routed product of the host experts from host
memory (moe_ref.expert_products: one row at a time, call-invariant activations), and the device adds
those to the partial in ascending rank (moe_ref.add_products). So each token's sum is fixed: its
resident experts in ascending id, then its host experts in ascending id; for [0, N) that is ascending
id, the resident model's order, and on a CPU-only machine the products are the resident path's too,
so the bits equal it. On a GPU the CPU's products differ in the last bits from the GPU's, but a row's
result still depends only on the row (static placement, fixed order), so speculative decoding stays
exact within the mode.
"""

from __future__ import annotations

import torch

from freetoken import kernels
from freetoken.kernels import activation_ref, moe_ref
from freetoken.layers.expert_cache import ExpertSlotCache
from freetoken.layers.expert_store import HostExpertStore
from freetoken.layers.moe import view_shared_mlp, shared_gate_up


class CachedExperts:
    def __init__(self, cache: ExpertSlotCache, top_k: int):
        self.cache = cache
        self.top_k = top_k

    @property
    def device_bytes(self) -> int:
        return self.cache.device_bytes

    @property
    def device_tensors(self) -> list[torch.Tensor]:
        return [self.cache.gate_up, self.cache.down, self.cache.slot_of]

    @property
    def host_bytes(self) -> int:
        return self.cache.store.capacity_bytes

    def stack_shared(self, mlp) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the shared MLP into the slots' last row (its parameters become views of it) -> (gate_up, down)."""
        gate_up, down = self.cache.gate_up, self.cache.down
        assert gate_up.shape[0] == self.cache.num_slots + 1, "the cache was made without a row for the shared expert"
        gate_up[-1].copy_(shared_gate_up(mlp))
        down[-1].copy_(mlp.down_proj.weight)
        view_shared_mlp(mlp, gate_up[-1], down[-1])
        return gate_up, down

    def __call__(self, moe, x, experts, weights, blocks, shared_gate, stacked: bool) -> torch.Tensor:  # x [N, H] -> [N, H]
        routed = experts[:, : self.top_k].tolist()
        groups = self.cache.token_groups(routed)
        if len(groups) == 1:
            self.cache.fetch([e for row in routed for e in row])
            return self._run(moe, x, experts, weights, blocks, shared_gate, stacked)
        y = torch.empty_like(x)
        for group in groups:
            self.cache.fetch([e for t in group for e in routed[t]])
            rows = torch.tensor(group, device=x.device)
            y[rows] = self._run(moe, x[rows], experts[rows], weights[rows], None, shared_gate[rows], stacked)
        return y

    def _run(self, moe, x, experts, weights, blocks, shared_gate, stacked: bool) -> torch.Tensor:
        cache = self.cache
        if stacked:
            return kernels.moe_experts_with_shared(x, experts, weights, cache.gate_up, cache.down, shared_gate, blocks,
                                                   slot_of=cache.slot_of)
        slots = cache.num_slots
        return kernels.moe_experts(x, experts, weights, cache.gate_up[:slots], cache.down[:slots], 0, moe.shared_expert(x),
                                   shared_gate, blocks, slot_of=cache.slot_of[: cache.store.num_experts])


class HybridExperts:
    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, store: HostExpertStore, top_k: int, rank: torch.Tensor):
        self.gate_up = gate_up  # [N, 2I, H] the resident experts (ranks [0, N)) on the device
        self.down = down  # [N, H, I]
        self.store = store  # ranks [N, E) in host memory
        self.top_k = top_k
        self.rank = rank  # [E] int64 on the device: expert id -> rank (resident ids ascending, then host ids ascending)

    @property
    def num_resident_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def device_bytes(self) -> int:
        return (self.gate_up.numel() + self.down.numel()) * self.gate_up.element_size()

    @property
    def device_tensors(self) -> list[torch.Tensor]:
        return [self.gate_up, self.down]

    @property
    def host_bytes(self) -> int:
        return self.store.capacity_bytes

    def stack_shared(self, mlp):
        """Never stacked: the block runs its shared expert as the dense MLP."""
        return None

    def __call__(self, moe, x, experts, weights, blocks, shared_gate, stacked: bool) -> torch.Tensor:  # x [N, H] -> [N, H]
        assert not stacked, "a hybrid block keeps its shared expert dense"
        first_host = self.num_resident_experts
        ranks = self.rank[experts]  # [N, top_k] ids -> ranks: the resident experts are [0, N)
        ranks_host = ranks.cpu()
        on_host = ranks_host >= first_host  # [N, top_k]
        host_ranks = sorted(set(ranks_host[on_host].tolist()))
        rows_host = on_host.any(dim=1).nonzero().flatten()
        # the device's part is queued first, so on CUDA it runs while the CPU computes its products
        if first_host:
            acc = kernels.moe_experts(x, ranks, weights, self.gate_up, self.down, 0)  # [N, H] fp32
        else:
            acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if host_ranks:
            gate_up, down = self.store.weights(host_ranks)
            idx = rows_host.to(x.device)
            x_host, weights_host = x[idx].cpu(), weights[idx].cpu()
            products = moe_ref.expert_products(x_host, ranks_host[rows_host], weights_host, gate_up, down, first_host)
            acc[idx] = moe_ref.add_products(acc[idx], ranks[idx], products.to(x.device), first_host)
        return acc.to(x.dtype) + activation_ref.sigmoid(shared_gate) * moe.shared_expert(x)
