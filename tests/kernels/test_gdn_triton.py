"""Triton GDN recurrence and short convolution vs the batched torch references, and the state
invariant: verify leaves the pools untouched, and replaying accepted rows gives the state (and the
outputs) that decoding them one at a time gives, bit for bit.
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES, INTERPRET  # noqa: E402

from freetoken.kernels import batched, conv_triton, gdn_triton  # noqa: E402
from freetoken.kernels.batched import SeqBatch  # noqa: E402



def make_batch(num_rows, slots, device):
    starts = [sum(num_rows[:i]) for i in range(len(num_rows))]
    return SeqBatch(tuple(starts), tuple(num_rows), (0,) * len(num_rows), tuple(slots), (), torch.device(device))


def gdn_inputs(n, heads, dk, dv, device, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(n, heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(n, heads, dk, generator=gen), dim=-1)
    v = torch.randn(n, heads, dv, generator=gen)
    g = -torch.rand(n, heads, generator=gen)
    beta = torch.rand(n, heads, generator=gen)
    return [t.to(device) for t in (q, k, v, g, beta)]


def dims(device):
    return (2, 16, 24) if device == "cpu" else (16, 128, 128)  # heads, Dk, Dv (Dv not a block multiple on CPU)


@pytest.mark.parametrize("device", DEVICES)
def test_gdn_matches_reference_and_writes_only_its_slots(device):
    heads, dk, dv = dims(device)
    num_rows, slots = [3, 1, 0, 4], [4, 0, 2, 1]
    batch = make_batch(num_rows, slots, device)
    gen = torch.Generator().manual_seed(7)
    pool = (torch.randn(5, heads, dk, dv, generator=gen) * 0.1).to(device)
    inputs = gdn_inputs(sum(num_rows), heads, dk, dv, device, 0)
    want_pool = pool.clone()
    want = batched.gdn_recurrent_batched(want_pool, *inputs, batch)
    got_pool = pool.clone()
    got = gdn_triton.gdn_recurrent(got_pool, *inputs, batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_pool, want_pool, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_pool[3], pool[3]) and torch.equal(got_pool[2], pool[2])  # unused / zero-row slots


@pytest.mark.parametrize("device", DEVICES)
def test_gdn_verify_then_replay_equals_decode(device):
    heads, dk, dv = dims(device)
    gen = torch.Generator().manual_seed(3)
    pool = (torch.randn(3, heads, dk, dv, generator=gen) * 0.1).to(device)
    rows_per_seq, accepted = 4, [2, 4, 0]
    batch = make_batch([rows_per_seq] * 3, [2, 0, 1], device)
    q, k, v, g, beta = gdn_inputs(3 * rows_per_seq, heads, dk, dv, device, 1)

    # Verify: outputs for all rows, the pool untouched.
    verify_pool = pool.clone()
    verify_out = gdn_triton.gdn_recurrent(verify_pool, q, k, v, g, beta, batch, write_state=False)
    assert torch.equal(verify_pool, pool)

    # Commit: replay the accepted prefix of each sequence, packed, without outputs.
    take = torch.cat([torch.arange(i * rows_per_seq, i * rows_per_seq + n) for i, n in enumerate(accepted)]).to(device)
    replay_pool = pool.clone()
    assert gdn_triton.gdn_recurrent(replay_pool, q[take], k[take], v[take], g[take], beta[take], batch.with_rows(accepted), compute_output=False) is None

    # Plain decode: one row per sequence per step, all sequences in one launch.
    decode_pool = pool.clone()
    for step in range(rows_per_seq):
        rows = torch.tensor([i * rows_per_seq + step for i in range(3)], device=device)
        out = gdn_triton.gdn_recurrent(decode_pool, q[rows], k[rows], v[rows], g[rows], beta[rows], make_batch([1, 1, 1], [2, 0, 1], device))
        assert torch.equal(out, verify_out[rows]), f"decode step {step} output != verify row"
        if step + 1 == 2:
            assert torch.equal(decode_pool[2], replay_pool[2])  # sequence 0 accepted 2 rows
    assert torch.equal(decode_pool[0], replay_pool[0])  # sequence 1 accepted all 4
    assert torch.equal(replay_pool[1], pool[1])  # sequence 2 accepted none


def conv_inputs(device, dtype, n, c=40, kw=4, slots=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    windows = torch.randn(slots, kw - 1, c, generator=gen).to(dtype).to(device)
    rows = torch.randn(n, c, generator=gen).to(dtype).to(device)
    weight = torch.randn(c, 1, kw, generator=gen).to(dtype).to(device)[:, 0, :]  # the layer's strided view
    return windows, rows, weight


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_matches_reference(device, dtype):
    num_rows, slots = [5, 1, 0], [1, 2, 0]  # slot 0's sequence has no rows: its window stays
    windows, rows, weight = conv_inputs(device, dtype, sum(num_rows), c=40 if device == "cpu" else 8200, slots=3)
    batch = make_batch(num_rows, slots, device)
    want_w = windows.clone()
    want = batched.causal_conv1d_batched(want_w, rows, weight, batch)
    got_w = windows.clone()
    got = conv_triton.causal_conv1d(got_w, rows, weight, batch)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    assert torch.equal(got_w, want_w)  # windows are pure data movement


@pytest.mark.parametrize("device", DEVICES)
def test_conv_verify_then_replay_equals_decode(device):
    dtype = torch.bfloat16
    windows, rows, weight = conv_inputs(device, dtype, 8, seed=5, slots=2)
    batch = make_batch([4, 4], [1, 0], device)
    w_verify = windows.clone()
    verify_out = conv_triton.causal_conv1d(w_verify, rows, weight, batch, write_state=False)
    assert torch.equal(w_verify, windows)
    accepted = [3, 1]
    take = torch.tensor([0, 1, 2, 4], device=device)
    w_replay = windows.clone()
    conv_triton.causal_conv1d(w_replay, rows[take], weight, batch.with_rows(accepted))
    w_decode = windows.clone()
    for step in range(4):
        idx = torch.tensor([step, 4 + step], device=device)
        out = conv_triton.causal_conv1d(w_decode, rows[idx], weight, make_batch([1, 1], [1, 0], device))
        assert torch.equal(out, verify_out[idx])
        if step + 1 == 1:
            assert torch.equal(w_decode[0], w_replay[0])
        if step + 1 == 3:
            assert torch.equal(w_decode[1], w_replay[1])


def fused_inputs(n, hk, hv, dk, dv, device, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    conv_out = (torch.randn(n, 2 * hk * dk + hv * dv, generator=gen) * 2).to(dtype).to(device)
    a = (torch.randn(n, hv, generator=gen) * 3).to(dtype).to(device)  # both softplus branches: a + dt_bias > 20 too
    a[0, 0] = 30.0
    b = torch.randn(n, hv, generator=gen).to(dtype).to(device)
    a_log = torch.randn(hv, generator=gen).to(device)
    dt_bias = torch.randn(hv, generator=gen).to(device)
    return conv_out, a, b, a_log, dt_bias


@pytest.mark.parametrize("device", DEVICES)
def test_gdn_fused_matches_reference_prep_and_recurrence(device):
    from freetoken.kernels.gdn_ref import recurrence_inputs

    hk, hv, dk, dv = (2, 4, 16, 24) if device == "cpu" else (16, 32, 128, 128)
    num_rows, slots = [3, 1, 0, 4], [4, 0, 2, 1]
    n = sum(num_rows)
    batch = make_batch(num_rows, slots, device)
    conv_out, a, b, a_log, dt_bias = fused_inputs(n, hk, hv, dk, dv, device, 0)
    state = torch.randn(5, hv, dk, dv, generator=torch.Generator().manual_seed(1)).to(device) * 0.1
    want_state = state.clone()
    want = batched.gdn_recurrent_batched(want_state, *recurrence_inputs(conv_out, a, b, a_log, dt_bias, hk, dk, dv), batch)
    got = gdn_triton.gdn_fused(state, conv_out, a, b, a_log, dt_bias, hk, batch)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(state, want_state, rtol=2e-5, atol=2e-5)
    assert torch.equal(state[3], want_state[3])  # a slot no sequence owns is untouched


@pytest.mark.parametrize("device", DEVICES)
def test_gdn_fused_verify_then_replay_equals_decoding_one_by_one(device):
    hk, hv, dk, dv = (2, 4, 16, 24) if device == "cpu" else (16, 32, 128, 128)
    rows = 4
    conv_out, a, b, a_log, dt_bias = fused_inputs(rows, hk, hv, dk, dv, device, 2, torch.bfloat16)
    start = torch.randn(1, hv, dk, dv, generator=torch.Generator().manual_seed(3)).to(device) * 0.1
    decoded_state = start.clone()
    decoded = [gdn_triton.gdn_fused(decoded_state, conv_out[t : t + 1], a[t : t + 1], b[t : t + 1], a_log, dt_bias, hk, make_batch([1], [0], device), out_dtype=torch.bfloat16)
               for t in range(3)]
    verify_state = start.clone()
    verified = gdn_triton.gdn_fused(verify_state, conv_out, a, b, a_log, dt_bias, hk, make_batch([rows], [0], device), write_state=False, out_dtype=torch.bfloat16)
    assert torch.equal(verify_state, start)  # verify reads the state only
    for t in range(3):
        assert torch.equal(verified[t], decoded[t][0])
    replay = SeqBatch((0,), (3,), (0,), (0,), (), torch.device(device))  # accept 3 of the 4 rows, in place
    assert gdn_triton.gdn_fused(verify_state, conv_out, a, b, a_log, dt_bias, hk, replay, compute_output=False) is None
    assert torch.equal(verify_state, decoded_state)
