"""The GDN output's gated norm + out_proj in one launch (`gated_out_triton`) vs the torch reference
(norm_ref's gated norm, then the product) within rounding, against itself (a row alone and in batches:
bitwise), and waiting per head on the recurrence (`HeadReady`): the bits of the launch that waits for
the whole recurrence, with each used head's counter moved by exactly PERIOD per use.
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES  # noqa: E402

from freetoken.kernels import gated_out_triton, gdn_triton, linear_triton, norm_ref  # noqa: E402
from freetoken.kernels.gated_out_triton import PERIOD, HeadReady  # noqa: E402

EPS = 1e-6
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def shape(device):
    """(head dim, output features): Nout not a multiple of BLOCK_N, so a masked feature tile."""
    return (16, 96) if device == "cpu" else (128, 2080)


def inputs(n, heads, d, nout, dtype, device, seed, norm_dtype=None):
    """core [N, Hv, D], z [N, Hv, D] (a column view of a wider projection, as the merged one gives it),
    the norm weight [D] and out_proj's weight [Nout, Hv * D]."""
    gen = torch.Generator().manual_seed(seed)
    core = (torch.randn(n, heads, d, generator=gen) * 3).to(dtype).to(device)
    projected = torch.randn(n, 2 * heads * d + 2 * heads, generator=gen).to(dtype).to(device)
    z = projected[:, heads * d : 2 * heads * d].view(n, heads, d)
    norm_w = (1 + 0.3 * torch.randn(d, generator=gen)).to(norm_dtype or dtype).to(device)
    weight = (torch.randn(nout, heads * d, generator=gen) / (heads * d) ** 0.5).to(dtype).to(device)
    return core, z, norm_w, weight


def summed(y):
    """A result, its deferred slices added in slice order (as the next add + norm adds them)."""
    if isinstance(y, linear_triton.PendingSplitK):
        total = y.partials[0].clone()
        for part in y.partials[1:]:
            total += part
        return total.to(y.dtype)
    return y


def reference(core, z, norm_w, weight, act):
    n = core.shape[0]
    y = norm_ref.gated_rms_norm(core, z, norm_w, EPS, act).reshape(n, -1)
    return y.double() @ weight.double().T


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [1, 2, 4, 8])
@pytest.mark.parametrize("act", ["silu", "sigmoid"])
def test_matches_gated_norm_then_linear(device, dtype, heads, act):
    d, nout = shape(device)
    core, z, norm_w, weight = inputs(5, heads, d, nout, dtype, device, seed=heads)
    want = reference(core, z, norm_w, weight, act)
    for defer in (False, True):
        got = gated_out_triton.gated_out_proj(core, z, norm_w, EPS, act, weight, defer_sum=defer)
        split = gated_out_triton.config_for(heads, d).split
        assert isinstance(got, linear_triton.PendingSplitK) == (defer and split > 1)
        got = summed(got)
        assert got.dtype == dtype and got.shape == (5, nout)
        torch.testing.assert_close(got.double(), want, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_a_wider_norm_weight_rounds_the_norm_in_fp32(device):
    """bf16 core and fp32 norm weight: the gated norm's output is fp32 (torch's promotion), cast to bf16 for the product."""
    d, nout = shape(device)
    core, z, norm_w, weight = inputs(3, 4, d, nout, torch.bfloat16, device, seed=7, norm_dtype=torch.float32)
    got = gated_out_triton.gated_out_proj(core, z, norm_w, EPS, "silu", weight)
    torch.testing.assert_close(got.double(), reference(core, z, norm_w, weight, "silu"), **TOL[torch.bfloat16])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("defer", [False, True])
def test_a_row_has_the_same_bits_alone_and_in_batches(device, defer, monkeypatch):
    """1, 5 and 20 rows (across a BLOCK_M edge), with a K split: each row's result (or its slices'
    partials) is the same alone, in a batch, and when the batch is cut into several launches."""
    d, nout = (32, 96) if device == "cpu" else shape(device)
    core, z, norm_w, weight = inputs(20, 8, d, nout, torch.bfloat16, device, seed=3)
    assert gated_out_triton.config_for(8, d).split == 2

    def run(rows):
        y = gated_out_triton.gated_out_proj(core[rows], z[rows], norm_w, EPS, "silu", weight, defer_sum=defer)
        return y.partials.transpose(0, 1) if isinstance(y, linear_triton.PendingSplitK) else y  # [rows, ...] either way

    full = run(slice(0, 20))
    five = run(slice(15, 20))
    for i in (0, 7, 15, 16, 19):
        assert torch.equal(run(slice(i, i + 1))[0], full[i]), f"row {i} alone"
    for i in range(5):
        assert torch.equal(five[i], full[15 + i]), f"row {15 + i} in a batch of 5"
    if not defer:
        monkeypatch.setattr(linear_triton, "MAX_ROWS_PER_LAUNCH", 16)
        assert torch.equal(run(slice(0, 20)), full)


@pytest.mark.parametrize("device", DEVICES)
def test_no_rows(device):
    d, nout = shape(device)
    core, z, norm_w, weight = inputs(0, 4, d, nout, torch.bfloat16, device, seed=0)
    assert gated_out_triton.gated_out_proj(core, z, norm_w, EPS, "silu", weight, defer_sum=True).shape == (0, nout)


@pytest.mark.parametrize("device", DEVICES)
def test_waiting_per_head_on_the_recurrence(device):
    """The recurrence raises its heads' counters (gdn_fused(head_ready=...)) and the gated out_proj
    waits on them (ready=HeadReady): the bits of the launch pair without counters; each use takes every
    used head's counter up by exactly PERIOD (to a multiple of it), and leaves the other heads' alone."""
    from tests.kernels.test_gdn_triton import fused_inputs, make_batch

    hk, hv, dk, dv, nout = (2, 8, 16, 64, 96) if device == "cpu" else (16, 32, 128, 128, 2080)
    num_rows, slots = [1, 1, 1], [2, 0, 1]
    n = sum(num_rows)
    batch = make_batch(num_rows, slots, device)
    start = torch.randn(3, hv, dk, dv, generator=torch.Generator().manual_seed(1)).to(device) * 0.1
    _, z, norm_w, weight = inputs(n, hv, dv, nout, torch.bfloat16, device, seed=2)
    counters = gated_out_triton.head_ready_counters(torch.device(device))
    assert counters is gated_out_triton.head_ready_counters(torch.device(device))
    before = counters.clone()
    ready = HeadReady(counters, batch.num_seqs * gdn_triton.value_tiles(dv))
    assert ready.target == 3 * (dv // min(gdn_triton.BLOCK_V, dv))
    waiting_state, plain_state = start.clone(), start.clone()
    for use in range(2):
        conv_out, a, b, a_log, dt_bias = fused_inputs(n, hk, hv, dk, dv, device, 10 + use, torch.bfloat16)
        core = gdn_triton.gdn_fused(waiting_state, conv_out, a, b, a_log, dt_bias, hk, batch, out_dtype=torch.bfloat16, head_ready=counters)
        got = gated_out_triton.gated_out_proj(core, z, norm_w, EPS, "silu", weight, defer_sum=use == 1, ready=ready)
        plain = gdn_triton.gdn_fused(plain_state, conv_out, a, b, a_log, dt_bias, hk, batch, out_dtype=torch.bfloat16)
        want = gated_out_triton.gated_out_proj(plain, z, norm_w, EPS, "silu", weight, defer_sum=use == 1)
        assert torch.equal(core, plain) and torch.equal(waiting_state, plain_state)
        assert torch.equal(summed(got), summed(want))
        moved = counters - before
        assert torch.equal(moved[:hv], torch.full_like(moved[:hv], (use + 1) * PERIOD)), f"use {use}: {moved[:hv].tolist()}"
        assert not moved[hv:].any() and not (counters[:hv] % PERIOD).any()
