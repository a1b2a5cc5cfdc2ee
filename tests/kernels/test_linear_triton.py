"""Triton linear vs the torch reference (within rounding) and against itself alone (bitwise).

On CPU the kernel runs under TRITON_INTERPRET=1 at tiny shapes; on a GPU (TRITON_INTERPRET=0) the
same checks run at model-sized shapes.
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES, INTERPRET  # noqa: E402

from freetoken.kernels import linear_ref, linear_triton  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def shapes(device):
    # (M, K, N): K not a multiple of BLOCK_K, N not a multiple of BLOCK_N, M across a BLOCK_M edge.
    # (19, 300, 72) in fp32 splits K in two on the CPU (config_for); the GPU shapes split K too.
    return [(19, 80, 72), (19, 300, 72)] if device == "cpu" else [(37, 4096, 4160), (300, 1000, 2000), (5, 12288, 1024)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_matches_reference(device, dtype):
    gen = torch.Generator().manual_seed(0)
    for m, k, n in shapes(device):
        x = torch.randn(m, k, generator=gen).to(dtype).to(device)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device)
        got = linear_triton.linear(x, w)
        exact = x.double() @ w.double().T  # the fp64 product of the same rounded inputs
        assert got.dtype == dtype and got.shape == (m, n)
        torch.testing.assert_close(got.double(), exact, rtol=TOL[dtype], atol=TOL[dtype])
        ref = linear_ref.linear(x, w)
        torch.testing.assert_close(got.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_are_invariant_to_batch(device, dtype):
    gen = torch.Generator().manual_seed(1)
    m, k, n = shapes(device)[0]
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    w = torch.randn(n, k, generator=gen).to(dtype).to(device)
    full = linear_triton.linear(x, w)
    picks = [0, 5, m - 1] if device == "cpu" else range(m)
    for i in picks:
        assert torch.equal(linear_triton.linear(x[i : i + 1], w), full[i : i + 1]), f"row {i} alone differs"
    # The same row in a different batch (other neighbours, other position in the tile) is unchanged too.
    mixed = torch.cat([x[3:4], torch.randn(4, k, generator=gen).to(dtype).to(device), x[0:1]])
    out = linear_triton.linear(mixed, w)
    assert torch.equal(out[0], full[3]) and torch.equal(out[5], full[0])


@pytest.mark.parametrize("device", DEVICES)
def test_linear_handles_empty_and_strided_input(device):
    w = torch.randn(40, 24).to(device)
    assert linear_triton.linear(torch.empty(0, 24, device=device), w).shape == (0, 40)
    x = torch.randn(3, 48).to(device)[:, ::2]  # non-unit inner stride
    torch.testing.assert_close(linear_triton.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_split_k_rows_are_invariant_and_launches_cut_cleanly(device, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    m, k, n = (19, 300, 72) if device == "cpu" else (70, 12288, 1024)
    assert linear_triton.config_for(n, k, torch.float32).split > 1
    x = torch.randn(m, k, generator=gen).to(device)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device)
    full = linear_triton.linear(x, w)
    torch.testing.assert_close(full.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
    for i in (0, m - 1):
        assert torch.equal(linear_triton.linear(x[i : i + 1], w), full[i : i + 1])
    monkeypatch.setattr(linear_triton, "MAX_ROWS_PER_LAUNCH", 16)  # several launches of one config
    assert torch.equal(linear_triton.linear(x, w), full)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_conv_has_the_bits_of_linear_then_conv(device, dtype):
    """A GDN decode step's projection with the convolution in its launch == the plain linear, then
    `causal_conv1d` on its first C features (one row per sequence): the same output bits and the same
    windows after, the unconvolved features untouched; rows in other slots leave those windows alone."""
    from freetoken.kernels import conv_triton
    from freetoken.kernels.batched import SeqBatch

    m, k, n, c, num_slots = (3, 80, 72, 40, 5) if device == "cpu" else (19, 2048, 12352, 8192, 24)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device)
    windows = torch.randn(num_slots, 3, c, generator=gen).to(dtype).to(device)
    conv_weight = torch.randn(c, 1, 4, generator=gen).to(dtype).to(device)[:, 0, :]  # the layer's strided view
    slots = torch.randperm(num_slots, generator=gen)[:m].tolist()
    batch = SeqBatch(tuple(range(m)), (1,) * m, (0,) * m, tuple(slots), (), torch.device(device))
    assert linear_triton.conv_fusable(x, weight, windows, conv_weight)
    want_windows = windows.clone()
    want = linear_triton.linear(x, weight)
    want[:, :c] = conv_triton.causal_conv1d(want_windows, want[:, :c], conv_weight, batch)
    got = linear_triton.linear_conv(x, weight, windows, conv_weight, batch.slots)
    assert torch.equal(got, want)
    assert torch.equal(windows, want_windows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_deferred_sum_has_the_bits_of_linear_then_add_norm(device, dtype, rows):
    """A split-K linear's partials, added by the next residual add + norm (`add_zc_rms_norm`) or by the
    MoE entry (`add_norm_route`): the same bits as the linear's own sum followed by either. Above
    DEFER_SUM_MAX_ROWS rows, and without a K split, the linear sums itself."""
    from freetoken.kernels import moe_gate_triton, norm_triton

    k, hidden = (1100, 64) if device == "cpu" else (4096, 2048)  # the 35B-A3B output projection on the GPU
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(device)
    weight = (torch.randn(hidden, k, generator=gen) / k**0.5).to(dtype).to(device)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    norm_w = (0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    gates = (torch.randn(9, hidden, generator=gen) / hidden**0.5).to(dtype).to(device)
    assert linear_triton.config_for(hidden, k, dtype).split > 1
    pending = linear_triton.linear(x, weight, defer_sum=True)
    assert isinstance(pending, linear_triton.PendingSplitK)
    y = linear_triton.linear(x, weight)
    for got, want in zip(norm_triton.add_zc_rms_norm(pending, residual, norm_w, 1e-6), norm_triton.add_zc_rms_norm(y, residual, norm_w, 1e-6)):
        assert torch.equal(got, want)
    got = moe_gate_triton.add_norm_route(pending, residual, norm_w, 1e-6, gates, 2)  # no shared expert: the entry routes
    want = moe_gate_triton.add_norm_route(y, residual, norm_w, 1e-6, gates, 2)
    for a, b in zip(got[:5], want[:5]):
        assert torch.equal(a, b)
    more = torch.randn(linear_triton.DEFER_SUM_MAX_ROWS + 1, k, generator=gen).to(dtype).to(device)
    assert isinstance(linear_triton.linear(more, weight, defer_sum=True), torch.Tensor)
    assert isinstance(linear_triton.linear(x[:, :32].contiguous(), weight[:, :32].contiguous(), defer_sum=True), torch.Tensor)  # K = 32: no split
