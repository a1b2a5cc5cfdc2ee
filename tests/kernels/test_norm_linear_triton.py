"""The linears with their input norm fused in, vs the norm and the linear run one after the other.

`gated_norm_linear` (a GDN layer's gated RMSNorm, head by head, inside out_proj's K loop) and
`add_norm_linear` (the residual add and the zero-centred norm inside the input projection; the rstd
scales the dot's result) against the torch references of the norm then the linear, within rounding;
each row's bits alone == inside a batch (row invariance); split K and a head per K step for the gated
form; the residual sum written once; the dispatch in `freetoken.kernels` falls back to the two ops
where the fused form does not apply.
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES  # noqa: E402

from freetoken import kernels  # noqa: E402
from freetoken.kernels import linear_ref, linear_triton, norm_ref, norm_triton  # noqa: E402

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def gated_shapes(device):  # (M, heads, D, N)
    return [(5, 4, 32, 72), (19, 8, 16, 40)] if device == "cpu" else [(1, 32, 128, 2048), (37, 32, 128, 2048), (4, 32, 128, 4096)]


def norm_shapes(device):  # (M, K, N)
    return [(5, 64, 72), (19, 100, 40)] if device == "cpu" else [(1, 2048, 12352), (37, 2048, 9216), (4, 4096, 12352)]


def _gated_inputs(m, heads, d, n, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, heads, d, generator=gen) * 3).to(dtype).to(device)
    z_wide = torch.randn(m, heads * d + 7, generator=gen).to(dtype).to(device)  # z a column view, as in the merged projection
    z = z_wide[:, 3 : 3 + heads * d].view(m, heads, d)
    norm_w = (1 + torch.randn(d, generator=gen) / 4).to(dtype).to(device)
    w = (torch.randn(n, heads * d, generator=gen) / (heads * d) ** 0.5).to(dtype).to(device)
    return x, z, norm_w, w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "sigmoid"])
def test_gated_norm_linear_matches_norm_then_linear(device, dtype, act):
    for m, heads, d, n in gated_shapes(device):
        x, z, norm_w, w = _gated_inputs(m, heads, d, n, dtype, device)
        cfg = linear_triton.gated_norm_config(w, d)
        assert cfg is not None and cfg.block_k == d
        got = linear_triton.gated_norm_linear(x, z, norm_w, 1e-6, act, w, cfg)
        h = norm_ref.gated_rms_norm(x.cpu(), z.cpu(), norm_w.cpu(), 1e-6, act).reshape(m, heads * d)
        want = linear_ref.linear(h, w.cpu())
        assert got.dtype == dtype and got.shape == (m, n)
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])
        for i in (0, m - 1):  # row invariance
            alone = linear_triton.gated_norm_linear(x[i : i + 1], z[i : i + 1], norm_w, 1e-6, act, w, cfg)
            assert torch.equal(alone, got[i : i + 1]), f"row {i} alone differs"


@pytest.mark.parametrize("device", DEVICES)
def test_gated_norm_linear_splits_k_by_heads(device):
    """With K split over programs each slice is whole heads, and the fp32 norm weight rounds as norm_triton's."""
    m, heads, d, n = gated_shapes(device)[0]
    x, z, norm_w, w = _gated_inputs(m, heads, d, n, torch.float32, device, seed=3)
    cfg = linear_triton.gated_norm_config(w, d)
    forced = linear_triton.LinearConfig(cfg.block_n, d, 2, cfg.num_warps, cfg.num_stages)
    got = linear_triton.gated_norm_linear(x, z, norm_w, 1e-6, "silu", w, forced)
    want = linear_ref.linear(norm_ref.gated_rms_norm(x.cpu(), z.cpu(), norm_w.cpu(), 1e-6).reshape(m, -1), w.cpu())
    torch.testing.assert_close(got.cpu(), want, rtol=TOL[torch.float32], atol=TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_norm_linear_matches_add_norm_then_linear(device, dtype, with_residual):
    gen = torch.Generator().manual_seed(1)
    for m, k, n in norm_shapes(device):
        x = (torch.randn(m, k, generator=gen) * 4).to(dtype).to(device)
        residual = (torch.randn(m, k, generator=gen) * 4).to(dtype).to(device) if with_residual else None
        norm_w = (torch.randn(k, generator=gen) / 4).to(dtype).to(device)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device)
        cfg = linear_triton.norm_linear_config(w)
        assert cfg is not None
        got, s = linear_triton.add_norm_linear(x, residual, norm_w, 1e-6, w, cfg)
        if with_residual:
            want_s, h = norm_ref.add_zc_rms_norm(x.cpu(), residual.cpu(), norm_w.cpu(), 1e-6)
        else:
            want_s, h = x.cpu(), norm_ref.zc_rms_norm(x.cpu(), norm_w.cpu(), 1e-6)
        if with_residual:  # rounded once, as the residual-add norm kernel does (the interpreter truncates to bf16)
            assert torch.equal(s, norm_triton.add_zc_rms_norm(x, residual, norm_w, 1e-6)[0]), "the residual sum differs from add_zc_rms_norm's"
            torch.testing.assert_close(s.cpu(), want_s, rtol=TOL[dtype], atol=0)
        else:
            assert s.data_ptr() == x.data_ptr()
        want = linear_ref.linear(h, w.cpu())
        assert got.dtype == dtype and got.shape == (m, n)
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])
        for i in (0, m - 1):
            alone, s_alone = linear_triton.add_norm_linear(x[i : i + 1], None if residual is None else residual[i : i + 1], norm_w, 1e-6, w, cfg)
            assert torch.equal(alone, got[i : i + 1]) and torch.equal(s_alone, s[i : i + 1]), f"row {i} alone differs"


@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_falls_back_where_the_fused_form_does_not_apply(device, monkeypatch):
    """A head that is not a power-of-two K step, or a weight whose K is split: the norm, then the linear."""
    monkeypatch.setattr(kernels, "MODE", "triton")
    gen = torch.Generator().manual_seed(2)
    x, z = torch.randn(3, 4, 12, generator=gen).to(device), torch.randn(3, 4, 12, generator=gen).to(device)
    norm_w, w = torch.randn(12, generator=gen).to(device), torch.randn(8, 48, generator=gen).to(device)
    assert linear_triton.gated_norm_config(w, 12) is None
    want = kernels.linear(kernels.gated_rms_norm(x, z, norm_w, 1e-6).reshape(3, 48), w)
    assert torch.equal(kernels.gated_norm_linear(x, z, norm_w, 1e-6, "silu", w), want)
    wide = torch.randn(16, 4096, generator=gen).to(device)  # few output tiles, long K: split
    assert linear_triton.norm_linear_config(wide) is None
    xs, res, nw = (torch.randn(2, 4096, generator=gen).to(device) for _ in range(3))
    y, s = kernels.add_norm_linear(xs, res, nw, 1e-6, wide)
    want_s, h = kernels.add_zc_rms_norm(xs, res, nw, 1e-6)
    assert torch.equal(s, want_s) and torch.equal(y, kernels.linear(h, wide))
