"""Triton MoE (grouped expert GEMM) vs an fp64 dense oracle, the torch reference and SparseMoE's torch path.

Checks: values for several token counts (1, tokens sharing experts, one expert with rows over several
row blocks); each row's bits alone == inside a bigger or different batch; an expert-parallel slice
(other ranks' experts contribute exactly zero, the slices add up to the whole); on CUDA, the op
captured in a CUDA graph replays new routing exactly as eager (no host sync in the path).
On CPU the kernels run under TRITON_INTERPRET=1 at tiny shapes (H=64, E=8, top_k=2, I=32).
"""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES, INTERPRET  # noqa: E402

import freetoken.kernels  # noqa: E402
from freetoken.kernels import moe_ref, moe_triton  # noqa: E402
from freetoken.layers.moe import SparseMoE  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def shape(device):  # H, E, top_k, I
    return (64, 8, 2, 32) if device == "cpu" else (2048, 256, 8, 512)


def weights_for(device, dtype, seed=0):
    h, e, _, i = shape(device)
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype).to(device)
    down = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype).to(device)
    return gate_up, down


def routing(n, device, dtype, seed, shared=None):
    """x [n, H], experts [n, top_k] (distinct per token; all on shared[:top_k] if given), weights [n, top_k]."""
    h, e, k, _ = shape(device)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen).to(dtype)
    if shared is None:
        experts = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    else:
        experts = torch.tensor(shared[:k]).repeat(n, 1)
    w = torch.rand(n, k, generator=gen) + 0.1
    w = (w / w.sum(-1, keepdim=True)).to(dtype)
    return x.to(device), experts.to(device), w.to(device)


def dense_oracle(x, experts, weights, gate_up, down, first=0):
    """fp64, token by token and slot by slot, from the architecture equations (no shared code)."""
    x, gate_up, down = x.double(), gate_up.double(), down.double()
    inter = gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for n in range(x.shape[0]):
        for s in range(experts.shape[1]):
            e = int(experts[n, s]) - first
            if 0 <= e < gate_up.shape[0]:
                h = gate_up[e] @ x[n]
                out[n] += float(weights[n, s]) * (down[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out


CASES = [  # (tokens, shared experts or None)
    (1, None),
    (5, None),
    (19, None),  # many tokens share each of the 8 experts
    (20, (1, 3, 5, 9, 17, 33, 64, 100)),  # every token on the same top_k experts: two row blocks each
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_matches_oracle_and_reference(device, dtype):
    gate_up, down = weights_for(device, dtype)
    for seed, (n, shared) in enumerate(CASES):
        x, experts, w = routing(n, device, dtype, seed, shared)
        got = moe_triton.moe_experts(x, experts, w, gate_up, down)
        assert got.dtype == torch.float32 and got.shape == x.shape
        ref = moe_ref.moe_experts(x.cpu(), experts.cpu(), w.cpu(), gate_up.cpu(), down.cpu())
        torch.testing.assert_close(got.cpu(), ref, rtol=TOL[dtype], atol=TOL[dtype], msg=f"{n} tokens vs reference")
        if dtype == torch.float32:
            exact = dense_oracle(x.cpu(), experts.cpu(), w.cpu(), gate_up.cpu(), down.cpu())
            torch.testing.assert_close(got.cpu().double(), exact, rtol=1e-5, atol=1e-5, msg=f"{n} tokens vs fp64")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_rows_are_invariant_to_batch(device, dtype):
    gate_up, down = weights_for(device, dtype)
    x, experts, w = routing(19, device, dtype, seed=7)
    full = moe_triton.moe_experts(x, experts, w, gate_up, down)
    for i in [0, 6, 18] if device == "cpu" else range(19):
        alone = moe_triton.moe_experts(x[i : i + 1], experts[i : i + 1], w[i : i + 1], gate_up, down)
        assert torch.equal(alone, full[i : i + 1]), f"row {i} alone differs"
    # Other neighbours, another position in the row block, and a crowd on the same experts.
    x2, e2, w2 = routing(17, device, dtype, seed=8, shared=tuple(experts[3].tolist()))
    mixed = moe_triton.moe_experts(torch.cat([x2, x[3:4]]), torch.cat([e2, experts[3:4]]), torch.cat([w2, w[3:4]]), gate_up, down)
    assert torch.equal(mixed[17], full[3])


@pytest.mark.parametrize("device", DEVICES)
def test_moe_expert_parallel_slices(device):
    gate_up, down = weights_for(device, torch.float32)
    num_experts, half = gate_up.shape[0], gate_up.shape[0] // 2
    x, experts, w = routing(6, device, torch.float32, seed=3)
    experts[0] = torch.arange(experts.shape[1])  # token 0 only on rank 0's experts
    full = moe_triton.moe_experts(x, experts, w, gate_up, down)
    parts = []
    for first in (0, half):
        part = moe_triton.moe_experts(x, experts, w, gate_up[first : first + half], down[first : first + half], first)
        ref = moe_ref.moe_experts(x.cpu(), experts.cpu(), w.cpu(), gate_up[first : first + half].cpu(), down[first : first + half].cpu(), first)
        torch.testing.assert_close(part.cpu(), ref, rtol=1e-5, atol=1e-5)
        exact = dense_oracle(x.cpu(), experts.cpu(), w.cpu(), gate_up[first : first + half].cpu(), down[first : first + half].cpu(), first)
        torch.testing.assert_close(part.cpu().double(), exact, rtol=1e-5, atol=1e-5)
        parts.append(part)
    assert torch.equal(parts[1][0], torch.zeros_like(parts[1][0])), "an expert another rank holds contributed"
    assert num_experts > half
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_moe_triton_path_matches_torch_path(device, monkeypatch):
    """fp32 only: in bf16 the two paths' router logits may round apart and pick other experts on a near tie."""
    h, e, k, i = shape(device)
    block = SparseMoE(h, e, k, i, shared_intermediate_size=i)
    gen = torch.Generator().manual_seed(11)
    for p in block.parameters():
        p.data = torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
    x = torch.randn(9, h, generator=gen)
    monkeypatch.setattr(freetoken.kernels, "MODE", "torch")
    want = block(x)
    monkeypatch.setattr(freetoken.kernels, "MODE", "triton")
    got = block.to(device)(x.to(device))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA and TRITON_INTERPRET=0")
def test_moe_replays_in_a_cuda_graph():
    gate_up, down = weights_for("cuda", torch.bfloat16)
    x, experts, w = routing(8, "cuda", torch.bfloat16, seed=1)
    moe_triton.moe_experts(x, experts, w, gate_up, down)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_triton.moe_experts(x, experts, w, gate_up, down)
    for seed in (2, 3):
        x2, e2, w2 = routing(8, "cuda", torch.bfloat16, seed=seed, shared=(5, 9, 17, 33, 64, 100, 200, 255) if seed == 3 else None)
        x.copy_(x2), experts.copy_(e2), w.copy_(w2)
        graph.replay()
        assert torch.equal(out, moe_triton.moe_experts(x2, e2, w2, gate_up, down))


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA and TRITON_INTERPRET=0")
def test_sparse_moe_forward_has_no_host_sync(monkeypatch):
    h, e, k, i = shape("cuda")
    block = SparseMoE(h, e, k, i, shared_intermediate_size=i)
    for p in block.parameters():
        p.data = torch.randn(p.shape) / p.shape[-1] ** 0.5
    x = torch.randn(4, h)
    monkeypatch.setattr(freetoken.kernels, "MODE", "torch")
    want = block(x)
    monkeypatch.setattr(freetoken.kernels, "MODE", "auto")
    block, x = block.to("cuda"), x.to("cuda")
    block(x)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host sync now raises
    try:
        got = block(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
