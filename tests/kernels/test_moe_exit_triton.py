"""The MoE block's exit fused into its down launch (`moe_triton.moe_experts_with_shared_add_norm`) vs
the unfused ops it replaces: `moe_experts_with_shared` (gate_up, down, combine), then `add_zc_rms_norm`
with the residual and the next norm.

s and h have the unfused bits at every size (the direct layout fuses, the aligned one runs the
unfused kernels); on CUDA a token fused alone has the bits it gets inside an aligned batch, which is
what keeps decode (fused) and verify (aligned) in step. The per-(token, tile) and per-token counters are
back at zero after every launch, also across CUDA-graph replays. SparseMoE's exit path equals its
unfused path and launches three kernels at one token (entry, gate_up, down with the exit).
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES, INTERPRET  # noqa: E402
from tests.kernels.test_moe_triton import launches, merged, moe_block, routing, shape, stacked_for, with_shared  # noqa: E402

import freetoken.kernels  # noqa: E402
import freetoken.layers.basic  # noqa: E402
from freetoken.kernels import moe_triton, norm_triton  # noqa: E402

EPS = 1e-6


def _block_inputs(n, device, dtype, seed):
    """x, experts [n, top_k + 1] (the shared expert last), weights, shared-gate logits, residual, norm weight."""
    gate_up, _ = stacked_for(device, dtype)
    x, experts, w = routing(n, device, dtype, seed)
    gen = torch.Generator().manual_seed(100 + seed)
    g = torch.randn(n, 1, generator=gen).to(dtype).to(device)
    residual = torch.randn(n, x.shape[1], generator=gen).to(dtype).to(device)
    norm_w = (0.1 * torch.randn(x.shape[1], generator=gen)).to(dtype).to(device)
    return x, with_shared(experts, gate_up.shape[0] - 1).to(torch.int32), w, g, residual, norm_w


def _unfused(x, experts, w, gate_up, down, g, residual, norm_w):
    y = moe_triton.moe_experts_with_shared(x, experts, w, gate_up, down, g)
    return norm_triton.add_zc_rms_norm(y, residual, norm_w, EPS)


def _counters_zero(device):
    counters = moe_triton._exit_counters.get(torch.device(device))
    return counters is None or not counters.any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("down_tiles", [0, 5])
def test_exit_has_the_unfused_bits(device, dtype, down_tiles, monkeypatch):
    """Also with down cut into tiles narrower than DOWN_BLOCK_N (the combine tile is the down tile)."""
    monkeypatch.setattr(moe_triton, "DOWN_TILES", down_tiles)
    gate_up, down = stacked_for(device, dtype)
    row_k = shape(device)[2] + 1
    for n in (1, 2, 3, 5, 12):
        inputs = _block_inputs(n, device, dtype, seed=n)
        assert moe_triton.exit_fuses(n * row_k, shape(device)[0]) == (n * row_k <= moe_triton.DIRECT_MAX_ROWS)
        s, h = moe_triton.moe_experts_with_shared_add_norm(*inputs[:3], gate_up, down, *inputs[3:], EPS)
        want_s, want_h = _unfused(*inputs[:3], gate_up, down, *inputs[3:])
        assert torch.equal(s, want_s) and torch.equal(h, want_h), f"{n} tokens"
        assert _counters_zero(device)


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA and TRITON_INTERPRET=0")
def test_a_token_fused_alone_has_its_bits_in_an_aligned_batch():
    """Decode (one token: the direct layout, exit fused) and verify (k + 1 tokens or more: aligned, unfused)."""
    gate_up, down = stacked_for("cuda", torch.bfloat16)
    x, experts, w, g, residual, norm_w = _block_inputs(8, "cuda", torch.bfloat16, seed=3)
    assert not moe_triton.is_direct(experts.numel())
    s, h = moe_triton.moe_experts_with_shared_add_norm(x, experts, w, gate_up, down, g, residual, norm_w, EPS)
    for i in range(8):
        one = (t[i : i + 1] for t in (x, experts, w))
        s1, h1 = moe_triton.moe_experts_with_shared_add_norm(*one, gate_up, down, g[i : i + 1], residual[i : i + 1], norm_w, EPS)
        assert torch.equal(s1, s[i : i + 1]) and torch.equal(h1, h[i : i + 1]), f"token {i}"
    assert _counters_zero("cuda")


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA and TRITON_INTERPRET=0")
def test_exit_replays_in_a_cuda_graph():
    gate_up, down = stacked_for("cuda", torch.bfloat16)
    inputs = list(_block_inputs(2, "cuda", torch.bfloat16, seed=4))
    moe_triton.moe_experts_with_shared_add_norm(*inputs[:3], gate_up, down, *inputs[3:], EPS)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s, h = moe_triton.moe_experts_with_shared_add_norm(*inputs[:3], gate_up, down, *inputs[3:], EPS)
    for seed in (5, 6, 7):
        for dst, src in zip(inputs, _block_inputs(2, "cuda", torch.bfloat16, seed)):
            dst.copy_(src)
        graph.replay()
        want_s, want_h = _unfused(*inputs[:3], gate_up, down, *inputs[3:])
        assert torch.equal(s, want_s) and torch.equal(h, want_h), f"replay {seed}"
        assert _counters_zero("cuda")


def _exit_block(device):
    block = merged(moe_block()).to(device)
    assert block.stacked is not None
    gen = torch.Generator().manual_seed(13)
    norms = [freetoken.layers.basic.ZeroCenteredRMSNorm(block.gate.weight.shape[1], EPS).to(device) for _ in range(2)]
    for norm in norms:
        norm.weight.data = (0.1 * torch.randn(norm.weight.shape, generator=gen)).to(device)
    return block, norms


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_moe_exit_path_equals_the_unfused_path(device, monkeypatch):
    monkeypatch.setattr(freetoken.kernels, "MODE", "triton")
    block, (norm, next_norm) = _exit_block(device)
    gen = torch.Generator().manual_seed(14)
    for n in (1, 3, 4):
        x, residual = (torch.randn(n, block.gate.weight.shape[1], generator=gen).to(device) for _ in range(2))
        s, h = block.add_norm_forward_add_norm(x, residual, norm, next_norm)
        out, stream = block.add_norm_forward(x, residual, norm)
        want_s, want_h = freetoken.kernels.add_zc_rms_norm(out, stream, next_norm.weight, next_norm.eps)
        assert torch.equal(s, want_s) and torch.equal(h, want_h), f"{n} tokens"


@pytest.mark.skipif(not INTERPRET, reason="counts launches under TRITON_INTERPRET=1")
def test_sparse_moe_exit_launches(monkeypatch):
    """One token, stacked: the entry (add, norm, gates, routing), gate_up, and down with the exit."""
    monkeypatch.setattr(freetoken.kernels, "MODE", "triton")
    block, (norm, next_norm) = _exit_block("cpu")
    x, residual = torch.randn(2, 1, block.gate.weight.shape[1])
    kernels, _ = launches(lambda: block.add_norm_forward_add_norm(x, residual, norm, next_norm), monkeypatch)
    assert kernels == ["_add_norm_route_kernel", "_gate_up_kernel", "_down_exit_kernel"], kernels
