"""Triton RMSNorms vs `norm_ref` (within one rounding of the output dtype) and row invariance (bitwise)."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES, INTERPRET  # noqa: E402

from freetoken.kernels import norm_ref, norm_triton  # noqa: E402

# One output ulp: the fp32 chains differ from torch's only in rsqrt and summation order.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def make(device, dtype, rows, d, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 3, d, generator=gen) * 3).to(dtype).to(device)
    z = torch.randn(rows, 3, d, generator=gen).to(dtype).to(device)
    w = (torch.randn(d, generator=gen) * 0.5).to(dtype).to(device)
    return x, z, w


def ops():
    return {
        "zc": (lambda x, z, w: norm_triton.zc_rms_norm(x, w, 1e-6), lambda x, z, w: norm_ref.zc_rms_norm(x, w, 1e-6)),
        "plain": (lambda x, z, w: norm_triton.rms_norm(x, w, 1e-6), lambda x, z, w: norm_ref.rms_norm(x, w, 1e-6)),
        "silu": (lambda x, z, w: norm_triton.gated_rms_norm(x, z, w, 1e-6, "silu"), lambda x, z, w: norm_ref.gated_rms_norm(x, z, w, 1e-6, "silu")),
        "sigmoid": (lambda x, z, w: norm_triton.gated_rms_norm(x, z, w, 1e-6, "sigmoid"), lambda x, z, w: norm_ref.gated_rms_norm(x, z, w, 1e-6, "sigmoid")),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["zc", "plain", "silu", "sigmoid"])
def test_norm_matches_reference(device, dtype, name):
    d = 48 if device == "cpu" else 5120  # not a power of two: the block is masked
    x, z, w = make(device, dtype, 4, d, 0)
    fast, ref = ops()[name]
    got, want = fast(x, z, w), ref(x, z, w)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["zc", "silu"])
def test_norm_rows_are_invariant_to_batch(device, name):
    x, z, w = make(device, torch.bfloat16, 5, 48 if device == "cpu" else 4096, 1)
    fast, _ = ops()[name]
    full = fast(x, z, w)
    for i in range(5):
        assert torch.equal(fast(x[i : i + 1], z[i : i + 1], w), full[i : i + 1])


@pytest.mark.parametrize("device", DEVICES)
def test_zero_centred_norm_hand_value(device):
    # x = [3, 4]: mean square 12.5, so norm(x) = x / sqrt(12.5); w = [0, 1] scales by [1, 2].
    x = torch.tensor([[3.0, 4.0]], device=device)
    got = norm_triton.zc_rms_norm(x, torch.tensor([0.0, 1.0], device=device), 0.0)
    expect = torch.tensor([[3.0, 8.0]], device=device) / 12.5**0.5
    torch.testing.assert_close(got, expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_zc_rms_norm_matches_reference(device, dtype):
    d = 48 if device == "cpu" else 4096
    x, z, w = make(device, dtype, 5, d, 3)
    x, r = x[:, 0], z[:, 1]
    s, y = norm_triton.add_zc_rms_norm(x, r, w, 1e-6)
    s_ref, y_ref = norm_ref.add_zc_rms_norm(x, r, w, 1e-6)
    if INTERPRET and dtype == torch.bfloat16:  # the interpreter's bf16 cast is not round-to-nearest
        torch.testing.assert_close(s.float(), s_ref.float(), **TOL[dtype])
    else:
        assert torch.equal(s, s_ref)  # one rounding of the exact sum, as in torch
    torch.testing.assert_close(y.float(), y_ref.float(), **TOL[dtype])
    s1, y1 = norm_triton.add_zc_rms_norm(x[2:3], r[2:3], w, 1e-6)
    assert torch.equal(s1, s[2:3]) and torch.equal(y1, y[2:3])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_reference(device, dtype):
    i = 40 if device == "cpu" else 12288
    gen = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(3, 2 * i, generator=gen) * 3).to(dtype).to(device)
    got, want = norm_triton.silu_mul(gate_up), norm_ref.silu_mul(gate_up)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    assert torch.equal(norm_triton.silu_mul(gate_up[1:2]), got[1:2])


@pytest.mark.parametrize("device", DEVICES)
def test_gated_norm_reads_a_strided_gate_in_place(device):
    d = 48 if device == "cpu" else 128
    x, z, w = make(device, torch.float32, 4, d, 5)
    wide = torch.randn(4, 3 * d + 7, generator=torch.Generator().manual_seed(6)).to(device)
    gate = wide[:, 5 : 5 + 3 * d].view(4, 3, d)  # rows 3d + 7 apart: not reshapeable to 2-D
    got = norm_triton.gated_rms_norm(x, gate, w, 1e-6, "silu")
    torch.testing.assert_close(got, norm_ref.gated_rms_norm(x, gate, w, 1e-6, "silu"), **TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_zc_norm_matches_reference_and_per_group_norms(device, dtype):
    streams, h = 4, 48 if device == "cpu" else 2560
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(5, streams * h, generator=gen) * 3).to(dtype).to(device)
    x[:, h : 2 * h] *= 40  # streams of different scales: one RMS each
    w = (torch.randn(streams * h, generator=gen) * 0.5).to(dtype).to(device)
    got, want = norm_triton.grouped_zc_rms_norm(x, w, h, 1e-6), norm_ref.grouped_zc_rms_norm(x, w, h, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    per_stream = torch.cat([norm_ref.zc_rms_norm(x[:, s * h : (s + 1) * h], w[s * h : (s + 1) * h], 1e-6) for s in range(streams)], dim=1)
    torch.testing.assert_close(want.float(), per_stream.float(), **TOL[dtype])
    for i in range(5):
        assert torch.equal(norm_triton.grouped_zc_rms_norm(x[i : i + 1], w, h, 1e-6), got[i : i + 1])
