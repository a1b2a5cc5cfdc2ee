"""The PLE layer's Triton kernels (gated value, dilated causal convolution) vs `ple_ref` (within one
rounding of the output dtype), and row invariance, verify and decode bit for bit."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES  # noqa: E402

from freetoken.kernels import dilated_conv_triton, ple_gate_triton, ple_ref  # noqa: E402
from freetoken.kernels.batched import SeqBatch  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
STREAMS, KERNEL, DILATION = 4, 4, 3
SPAN = (KERNEL - 1) * DILATION


def gate_inputs(device, dtype, rows, h, seed):
    gen = torch.Generator().manual_seed(seed)
    k, q = (torch.randn(rows, STREAMS * h, generator=gen).to(dtype).to(device) for _ in range(2))
    v = (torch.randn(rows, h, generator=gen) * 2).to(dtype).to(device)
    w = (torch.randn(STREAMS * h, generator=gen) * 0.5).to(dtype).to(device)
    return k, q, v, w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_value_matches_reference(device, dtype):
    h = 48 if device == "cpu" else 2560  # not a power of two: the block is masked
    k, q, v, w = gate_inputs(device, dtype, 5, h, 0)
    k[0, :h] = 0  # g = 0 on one stream: the clamp, and sign(0) = 0
    got, want = ple_gate_triton.gated_value(k, q, v, w, 1e-6), ple_ref.gated_value(k, q, v, w, 1e-6)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype == dtype and g.shape == r.shape == (5, STREAMS * h)
        torch.testing.assert_close(g.float(), r.float(), **TOL[dtype])
    assert torch.equal(got[0][0, :h], torch.full_like(got[0][0, :h], 0.5) * v[0])  # sigmoid(0) v


@pytest.mark.parametrize("device", DEVICES)
def test_gated_value_rows_are_invariant_to_batch(device):
    k, q, v, w = gate_inputs(device, torch.bfloat16, 5, 48 if device == "cpu" else 2560, 1)
    full = ple_gate_triton.gated_value(k, q, v, w, 1e-6)
    for i in range(5):
        alone = ple_gate_triton.gated_value(k[i : i + 1], q[i : i + 1], v[i : i + 1], w, 1e-6)
        assert torch.equal(alone[0], full[0][i : i + 1]) and torch.equal(alone[1], full[1][i : i + 1])


def conv_inputs(device, dtype, n, c=40, slots=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    windows = torch.randn(slots, SPAN, c, generator=gen).to(dtype).to(device)  # entries before position 0 hold garbage
    rows = torch.randn(n, c, generator=gen).to(dtype).to(device)
    weight = torch.randn(c, 1, KERNEL, generator=gen).to(dtype).to(device)[:, 0, :]  # the layer's strided view
    return windows, rows, weight


def make_batch(num_rows, num_cached, slots, device):
    starts = [sum(num_rows[:i]) for i in range(len(num_rows))]
    return SeqBatch(tuple(starts), tuple(num_rows), tuple(num_cached), tuple(slots), (), torch.device(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dilated_conv_matches_reference(device, dtype):
    # a sequence at its start, one with 4 positions before its window's first, one past it, one with no rows
    num_rows, num_cached, slots = [5, 2, 3, 0], [0, 5, 20, 7], [1, 2, 0, 3]
    windows, rows, weight = conv_inputs(device, dtype, sum(num_rows), c=40 if device == "cpu" else 10240, slots=4)
    batch = make_batch(num_rows, num_cached, slots, device)
    want_w = windows.clone()
    want = ple_ref.dilated_causal_conv1d_batched(want_w, rows, weight, batch, DILATION)
    got_w = windows.clone()
    got = dilated_conv_triton.dilated_causal_conv1d(got_w, rows, weight, batch, DILATION)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    assert torch.equal(got_w, want_w)  # windows are pure data movement (entries before position 0 written as 0)
    assert torch.equal(got_w[3], windows[3])


@pytest.mark.parametrize("device", DEVICES)
def test_dilated_conv_verify_then_replay_equals_decode(device):
    windows, rows, weight = conv_inputs(device, torch.bfloat16, 8, seed=5, slots=2)
    cached = [2, 11]
    batch = make_batch([4, 4], cached, [1, 0], device)
    w_verify = windows.clone()
    verify_out = dilated_conv_triton.dilated_causal_conv1d(w_verify, rows, weight, batch, DILATION, write_state=False)
    assert torch.equal(w_verify, windows)
    accepted = [3, 1]
    take = torch.tensor([0, 1, 2, 4], device=device)
    w_replay = windows.clone()
    dilated_conv_triton.dilated_causal_conv1d(w_replay, rows[take], weight, batch.with_rows(accepted), DILATION)
    w_decode = windows.clone()
    for step in range(4):
        idx = torch.tensor([step, 4 + step], device=device)
        out = dilated_conv_triton.dilated_causal_conv1d(w_decode, rows[idx], weight, make_batch([1, 1], [c + step for c in cached], [1, 0], device), DILATION)
        assert torch.equal(out, verify_out[idx]), step
        if step + 1 == 1:
            assert torch.equal(w_decode[0], w_replay[0])
        if step + 1 == 3:
            assert torch.equal(w_decode[1], w_replay[1])
