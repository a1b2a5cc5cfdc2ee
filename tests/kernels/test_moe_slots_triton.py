"""Expert weights read through slot_of (an expert cache's slots) give every row the bits of the same
call on the experts stored by id: the Triton kernels and the torch reference, both row layouts
(direct at few routed rows, aligned above moe_route_triton.DIRECT_MAX_ROWS), with the routed experts
alone (fp32 partial), with the dense shared expert's output, and with the shared expert stacked as
expert E. The oracle is the unslotted call on the weights in id order; the slots hold a permutation
of them plus unused rows filled with noise, which a wrong indirection would read.
On CPU the kernels run under TRITON_INTERPRET=1 at tiny shapes (H=64, E=8, top_k=2, I=32).
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES  # noqa: E402

from freetoken.kernels import moe_ref, moe_route_triton, moe_triton  # noqa: E402


def shape(device):  # H, E, top_k, I
    return (64, 8, 2, 32) if device == "cpu" else (2048, 256, 8, 512)


def problem(device, dtype, n, seed=0):
    h, e, k, i = shape(device)
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(e + 1, 2 * i, h, generator=gen) / h**0.5).to(dtype)
    down = (torch.randn(e + 1, h, i, generator=gen) / i**0.5).to(dtype)
    x = torch.randn(n, h, generator=gen).to(dtype)
    experts = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    weights = torch.softmax(torch.randn(n, k, generator=gen), -1).to(dtype)
    shared_gate = torch.randn(n, 1, generator=gen).to(dtype)
    # slots: a permutation of the routed experts, then two noise rows, then (stacked) the shared expert
    perm = torch.randperm(e, generator=gen)
    noise_up = torch.randn(2, 2 * i, h, generator=gen).to(dtype)
    noise_down = torch.randn(2, h, i, generator=gen).to(dtype)
    slot_gate_up = torch.cat([gate_up[:e][perm], noise_up, gate_up[e:]])
    slot_down = torch.cat([down[:e][perm], noise_down, down[e:]])
    slot_of = torch.empty(e + 1, dtype=torch.int32)
    slot_of[perm] = torch.arange(e, dtype=torch.int32)
    slot_of[e] = e + 2
    to = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    return to(gate_up, down, x, experts, weights, shared_gate, slot_gate_up, slot_down, slot_of)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [3, moe_route_triton.DIRECT_MAX_ROWS])  # direct, then aligned row blocks
def test_slotted_experts_have_the_bits_of_the_stored_order(device, dtype, n):
    gate_up, down, x, experts, weights, gate, slot_gate_up, slot_down, slot_of = problem(device, dtype, n)
    e = shape(device)[1]
    routed_slots = slot_gate_up[: e + 2], slot_down[: e + 2]
    shared = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    stacked_ids = torch.cat([experts, torch.full_like(experts[:, :1], e)], dim=1)
    for impl in (moe_triton, moe_ref):
        want = impl.moe_experts(x, experts, weights, gate_up[:e], down[:e])
        assert torch.equal(impl.moe_experts(x, experts, weights, *routed_slots, slot_of=slot_of[:e]), want)
        want = impl.moe_experts(x, experts, weights, gate_up[:e], down[:e], 0, shared, gate)
        assert torch.equal(impl.moe_experts(x, experts, weights, *routed_slots, 0, shared, gate, slot_of=slot_of[:e]), want)
        want = impl.moe_experts_with_shared(x, stacked_ids, weights, gate_up, down, gate)
        got = impl.moe_experts_with_shared(x, stacked_ids, weights, slot_gate_up, slot_down, gate, slot_of=slot_of)
        assert torch.equal(got, want)
