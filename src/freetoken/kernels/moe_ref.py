"""Routing and routed experts of a sparse MoE block (reference: the CPU path and the oracle
of moe_route_triton and moe_triton).

Experts run one at a time over every token routed to them: one row-invariant linear per expert and
projection. A token's weighted expert outputs are added in fp32 in ascending expert id, which for
every token is the ascending order of its own experts, so its result does not depend on which other
tokens share the call. `torch.unique(...).tolist()` reads the routing on the host: fine on CPU, and
the reason the Triton path exists.
"""

from __future__ import annotations

import torch

from freetoken.kernels import activation_ref, linear_ref, norm_ref


def route(
    logits: torch.Tensor,  # [N, E] router logits
    top_k: int,
    dtype: torch.dtype,
    with_shared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # experts [N, top_k (+ 1)] int64, weights [N, top_k] dtype
    """Softmax in fp32, top_k, weights renormalised then cast to dtype; with_shared appends column E."""
    weights, experts = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if with_shared:
        experts = torch.cat([experts, torch.full_like(experts[:, :1], logits.shape[1])], dim=1)
    return experts, (weights / weights.sum(dim=-1, keepdim=True)).to(dtype)


def moe_experts(
    x: torch.Tensor,  # [N, H]
    experts: torch.Tensor,  # [N, top_k] global expert ids
    weights: torch.Tensor,  # [N, top_k] renormalised router weights, x.dtype
    gate_up: torch.Tensor,  # [C, 2I, H] experts [first, first + C), gate rows first
    down: torch.Tensor,  # [C, H, I]
    first: int = 0,
    shared: torch.Tensor | None = None,  # [N, H] shared expert output, x.dtype
    shared_gate: torch.Tensor | None = None,  # [N, 1] shared expert gate logit, x.dtype
    slot_of: torch.Tensor | None = None,  # [E] int: expert id -> its row of gate_up / down (-1: not held); None: id - first
) -> torch.Tensor:  # [N, H]: fp32 sum over the held experts of weight * expert(x); x.dtype block output with shared
    """Routed experts; given `shared` and `shared_gate`, acc.to(x.dtype) + sigmoid(shared_gate) * shared.
    With slot_of the weights are read at each expert's slot; the experts are still added in ascending id."""
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for tokens, _, product in _routed_products(x, experts, weights, gate_up, down, first, slot_of):
        acc[tokens] = acc[tokens] + product.float()
    if shared is None:
        return acc
    return acc.to(x.dtype) + activation_ref.sigmoid(shared_gate) * shared


def expert_products(
    x: torch.Tensor,  # [N, H]
    experts: torch.Tensor,  # [N, top_k] global expert ids
    weights: torch.Tensor,  # [N, top_k] renormalised router weights, x.dtype
    gate_up: torch.Tensor,  # [C, 2I, H] experts [first, first + C), gate rows first
    down: torch.Tensor,  # [C, H, I]
    first: int = 0,
) -> torch.Tensor:  # [N, top_k, H] x.dtype: weight * expert(x) where the expert is held, else 0
    """Each routed product as moe_experts adds it (before its fp32 cast), one expert at a time."""
    out = torch.zeros((*experts.shape, x.shape[1]), dtype=x.dtype, device=x.device)
    for tokens, slot, product in _routed_products(x, experts, weights, gate_up, down, first):
        out[tokens, slot] = product
    return out


def _routed_products(x, experts, weights, gate_up, down, first: int, slot_of: torch.Tensor | None = None):
    """For each held expert in ascending id: (tokens [n], their routing column [n], weight * expert(x) [n, H] x.dtype).
    An expert's weights are gate_up / down [id - first], or [slot_of[id]] with slot_of; ids outside them are skipped."""
    count, two_i, _ = gate_up.shape
    inter = two_i // 2
    slots = None if slot_of is None else slot_of.tolist()
    for expert in torch.unique(experts).tolist():  # ascending
        local = expert - first if slots is None else slots[expert]
        if not 0 <= local < count:
            continue
        tokens, column = (experts == expert).nonzero(as_tuple=True)
        h = linear_ref.linear(x[tokens], gate_up[local])
        y = linear_ref.linear(activation_ref.silu(h[:, :inter]) * h[:, inter:], down[local])
        yield tokens, column, y * weights[tokens, column][:, None]


def add_products(
    acc: torch.Tensor,  # [N, H] fp32 partial sum of the experts below `first`
    experts: torch.Tensor,  # [N, top_k] global expert ids, distinct per token
    products: torch.Tensor,  # [N, top_k, H] expert_products' (0 where not held)
    first: int,
) -> torch.Tensor:  # [N, H] fp32
    """acc plus each token's products of experts >= first, added in ascending expert id (moe_experts' order)."""
    order = torch.argsort(experts, dim=1)
    rows = torch.arange(experts.shape[0], device=experts.device)
    for k in range(experts.shape[1]):
        column = order[:, k]
        held = experts[rows, column] >= first
        acc = torch.where(held[:, None], acc + products[rows, column].float(), acc)
    return acc


def moe_experts_with_shared(
    x: torch.Tensor,  # [N, H]
    experts: torch.Tensor,  # [N, top_k + 1] expert ids, column top_k = E (the shared expert)
    weights: torch.Tensor,  # [N, top_k] renormalised router weights, x.dtype
    gate_up: torch.Tensor,  # [E + 1, 2I, H] the routed experts, then the shared expert; gate rows first
    down: torch.Tensor,  # [E + 1, H, I]
    shared_gate: torch.Tensor,  # [N, 1] shared expert gate logit, x.dtype
    slot_of: torch.Tensor | None = None,  # [E + 1] int: expert id -> its row of gate_up / down, slot_of[E] the last; None: the id
) -> torch.Tensor:  # [N, H] x.dtype
    """The block output with expert E (the last row of gate_up / down) run as the dense shared MLP:
    acc.to(x.dtype) + sigmoid(shared_gate) * shared."""
    shared = linear_ref.linear(norm_ref.silu_mul(linear_ref.linear(x, gate_up[-1])), down[-1])
    routed_slots = None if slot_of is None else slot_of[:-1]
    return moe_experts(x, experts[:, :-1], weights, gate_up[:-1], down[:-1], 0, shared, shared_gate, routed_slots)
