"""qwen4_exp's hyper-connections on the torch path (kernels/hc_ref.py, what CPU runs) equal, bit for bit, the
torch ops they replace, composed one at a time as architectures.md §4.2 writes them: the per-stream norm,
W_down and W_inject as two linears, / S, silu, W_up, sigmoid, the product with Xn, the streams summed in
order and divided by S, 2 sigmoid(W_inject Xn / S), and the injection x + i_s * y. Merging W_down and
W_inject into one weight keeps the checkpoint's parameter names and values."""

import pytest
import torch

from freetoken import kernels
from freetoken.kernels import activation_ref, linear_ref, norm_ref
from freetoken.models.qwen4_exp.hyper_connection import GatedResidual, inject
from freetoken.models.qwen4_exp.ops import GroupedZCRMSNorm

STREAMS, EPS = 4, 1e-6


def composed(hc: GatedResidual, x: torch.Tensor, y: torch.Tensor):
    """(u, injection weights, x + i (x) y) by the unfused ops; u alone for the final mixer."""
    n, s, h = x.shape[0], STREAMS, x.shape[1] // STREAMS
    xn = norm_ref.grouped_zc_rms_norm(x, hc.hc_norm.weight, h, EPS)
    down = activation_ref.silu(linear_ref.linear(xn, hc.input_mix_weight_down.weight) / s)
    m = activation_ref.sigmoid(linear_ref.linear(down, hc.input_mix_weight_up.weight))
    parts = (m * xn).view(n, s, h)
    total = parts[:, 0]
    for i in range(1, s):
        total = total + parts[:, i]
    u = total / s
    if hc.block_inject_weight is None:
        return u
    weights = 2 * activation_ref.sigmoid(linear_ref.linear(xn, hc.block_inject_weight.weight) / s)
    return u, weights, x + (y[:, None, :] * weights[:, :, None]).reshape(n, -1)


def hyper_connection(h: int, rank: int, dtype: torch.dtype, with_inject: bool, gen: torch.Generator) -> GatedResidual:
    hc = GatedResidual(h, STREAMS, rank, EPS, with_inject)
    for p in hc.parameters():
        p.data = (torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5).to(dtype)
    return hc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h, rank", [(64, 16), (2560, 320)], ids=["fixture", "real"])
@torch.no_grad()
def test_torch_path_equals_the_unfused_ops_bitwise(dtype, h, rank):
    gen = torch.Generator().manual_seed(0)
    hc, mixer = hyper_connection(h, rank, dtype, True, gen), hyper_connection(h, rank, dtype, False, gen)
    next_norm = GroupedZCRMSNorm(STREAMS * h, h, EPS)
    next_norm.weight.data = (0.3 * torch.randn(STREAMS * h, generator=gen)).to(dtype)
    x = (2 * torch.randn(3, STREAMS * h, generator=gen)).to(dtype)
    y = torch.randn(3, h, generator=gen).to(dtype)
    want_u, want_weights, want_x = composed(hc, x, y)
    want_mixed = composed(mixer, x, y)
    with kernels.torch_only():
        u, weights = hc(x)
        new_x, none = inject(x, y, weights)
        fused_x, fused_xn = inject(x, y, weights, next_norm)
        mixed = mixer(x)
        u_of_normed, _ = hc(x, hc.hc_norm(x))
    assert none is None and torch.equal(u, want_u) and torch.equal(weights, want_weights) and torch.equal(u_of_normed, want_u)
    assert torch.equal(new_x, want_x) and torch.equal(fused_x, want_x)
    assert torch.equal(fused_xn, norm_ref.grouped_zc_rms_norm(want_x, next_norm.weight, h, EPS))
    assert torch.equal(mixed, want_mixed)


def test_merged_projection_keeps_the_parameters():
    gen = torch.Generator().manual_seed(1)
    hc = hyper_connection(64, 16, torch.float32, True, gen)
    before = {name: t.clone() for name, t in hc.state_dict().items()}
    hc.merge_projections()
    after = hc.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[name], t) for name, t in before.items())
    merged = hc.down_inject_weight
    assert merged.shape == (16 + STREAMS, STREAMS * 64)
    assert hc.input_mix_weight_down.weight.data_ptr() == merged.data_ptr()
    assert hc.block_inject_weight.weight.data_ptr() == merged[16:].data_ptr()
