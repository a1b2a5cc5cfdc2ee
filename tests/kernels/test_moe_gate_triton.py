"""The fused MoE entry (`moe_gate_triton.add_norm_route`) vs the unfused ops it replaces, and the
routing left to the expert GEMMs (`moe_triton.GemmRoute`) vs the entry's own.

s and h have the bits of the Triton `add_zc_rms_norm`; the shared-gate logit is the torch dot within
rounding; experts, weights and direct row blocks are those of `moe_route_triton.route` on the torch logits
(the gate rows are built so that a token's logits are well spaced: no near-ties). A token's results
are the same bits alone, in a batch, and when the batch is cut into several launches; the per-token
counters are back at zero after every launch.
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES  # noqa: E402

from freetoken.kernels import moe_gate_triton, moe_ref, moe_route_triton, moe_triton, norm_triton  # noqa: E402

EPS = 1e-6


def _inputs(n, hidden, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=gen).to(dtype).to(device)
    residual = torch.randn(n, hidden, generator=gen).to(dtype).to(device)
    norm_w = (0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    return x, residual, norm_w


def _spaced_gates(h, num_experts, seed):
    """[E + 1, H] gates whose router logits for the one token h [H] are a shuffle of values 0.25 apart
    (rank one: row e = value_e * h / |h|^2), then a random shared-gate row."""
    gen = torch.Generator().manual_seed(seed)
    hf = h.float().cpu()
    values = (torch.arange(num_experts) - num_experts / 2) * 0.25
    rows = values[torch.randperm(num_experts, generator=gen)][:, None] * hf[None, :] / hf.dot(hf)
    return torch.cat([rows, torch.randn(1, hf.numel(), generator=gen) / hf.numel() ** 0.5]).to(h.dtype).to(h.device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_shared", [False, True])
def test_matches_the_unfused_ops(device, dtype, with_shared, monkeypatch):
    monkeypatch.setattr(moe_gate_triton, "ROUTE_IN_GEMMS", False)  # the entry routes (routing in the GEMMs: below)
    hidden, num_experts, top_k = 64, 12, 3
    x, residual, norm_w = _inputs(1, hidden, dtype, device, seed=1)
    want_s, want_h = norm_triton.add_zc_rms_norm(x, residual, norm_w, EPS)
    gates = _spaced_gates(want_h[0], num_experts, seed=2)
    s, h, experts, weights, shared_gate, blocks = moe_gate_triton.add_norm_route(x, residual, norm_w, EPS, gates, top_k, with_shared)
    assert torch.equal(s, want_s) and torch.equal(h, want_h)
    logits = (want_h.float() @ gates.float().T).to(dtype)
    torch.testing.assert_close(shared_gate, logits[:, -1:], rtol=2e-2, atol=2e-2)
    want_experts, want_weights, want_blocks = moe_route_triton.route(logits[:, :-1], top_k, dtype, with_shared)
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(weights, want_weights, rtol=1e-2, atol=1e-2)
    assert torch.equal(experts[:, :top_k].cpu().long(), moe_ref.route(logits[:, :-1].cpu(), top_k, dtype)[0])
    assert blocks is not None and torch.equal(blocks.sorted_ids, want_blocks.sorted_ids) and torch.equal(blocks.block_expert, want_blocks.block_expert)


@pytest.mark.parametrize("device", DEVICES)
def test_a_token_has_the_same_bits_alone_in_a_batch_and_across_launches(device, monkeypatch):
    hidden, num_experts, top_k, n = 64, 12, 3, 9
    x, residual, norm_w = _inputs(n, hidden, torch.bfloat16, device, seed=3)
    gates = (torch.randn(num_experts + 1, hidden, generator=torch.Generator().manual_seed(4)) / 8).to(torch.bfloat16).to(device)
    batch = moe_gate_triton.add_norm_route(x, residual, norm_w, EPS, gates, top_k, with_shared=True)
    assert batch[5] is None  # 9 tokens x 4 rows > DIRECT_MAX_ROWS: no direct blocks
    monkeypatch.setattr(moe_gate_triton, "MAX_TOKENS_PER_LAUNCH", 4)
    cut = moe_gate_triton.add_norm_route(x, residual, norm_w, EPS, gates, top_k, with_shared=True)
    for got, want in zip(cut[:5], batch[:5]):
        assert torch.equal(got, want)
    monkeypatch.setattr(moe_gate_triton, "ROUTE_IN_GEMMS", False)  # one token is direct: the entry routes
    for t in range(n):
        alone = moe_gate_triton.add_norm_route(x[t : t + 1], residual[t : t + 1], norm_w, EPS, gates, top_k, with_shared=True)
        for got, want in zip(alone[:5], batch[:5]):
            assert torch.equal(got, want[t : t + 1]), f"token {t}"
    assert not moe_gate_triton._token_counters(x.device).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("row_wait", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_routing_in_the_expert_gemms_equals_the_entrys(device, tokens, row_wait, dtype, monkeypatch):
    """In the direct layout with the shared expert stacked the entry leaves the routing to gate_up and
    down (`GemmRoute`): the same experts, weights and block output bits as the entry's routing, with
    the combine in the down launch and deferred to the next add + norm."""
    from tests.kernels.test_moe_triton import shape, stacked_for

    monkeypatch.setattr(moe_triton, "DOWN_WAITS_FOR_ROW", row_wait)
    hidden, num_experts, top_k, _ = shape(device)
    gate_up, down = stacked_for(device, dtype)
    x, residual, norm_w = _inputs(tokens, hidden, dtype, device, seed=tokens)
    gates = (torch.randn(num_experts + 1, hidden, generator=torch.Generator().manual_seed(5)) / 8).to(dtype).to(device)
    rows = tokens * (top_k + 1)
    up_tiles = -(-gate_up.shape[1] // 2 // moe_triton.GATE_UP_BLOCK_N)
    down_tiles = -(-hidden // moe_triton.DOWN_BLOCK_N)
    period = 1 << (up_tiles + down_tiles - 1).bit_length()
    ready = moe_triton.row_ready_counters(torch.device(device), period)
    ready_before = ready[:rows].clone()
    results = {}
    for route_in_gemms in (True, False):
        monkeypatch.setattr(moe_gate_triton, "ROUTE_IN_GEMMS", route_in_gemms)
        s, h, experts, weights, shared_gate, blocks = moe_gate_triton.add_norm_route(x, residual, norm_w, EPS, gates, top_k, with_shared=True)
        assert isinstance(blocks, moe_triton.GemmRoute) == route_in_gemms
        y = moe_triton.moe_experts_with_shared(h, experts, weights, gate_up, down, shared_gate, blocks)
        pending = moe_triton.moe_experts_with_shared(h, experts, weights, gate_up, down, shared_gate, blocks, defer_combine=True)
        assert pending.rows_weighted_by_id == route_in_gemms
        stored = (experts.clone(), weights.clone())
        if route_in_gemms:  # down weighted the rows and put them in expert order: the exit reads no routing
            pending.experts.fill_(num_experts - 1)
            pending.weights.fill_(-3.0)
            pending.shared_gate.fill_(7.0)
        exit_s, exit_h = pending.add_zc_rms_norm(s, norm_w, EPS)
        results[route_in_gemms] = (y, *stored, exit_s, exit_h)
    for got, want in zip(results[True], results[False]):
        assert torch.equal(got, want)
    # Each GemmRoute gate_up + down pair (two here) takes every row's ready counter up by one PERIOD
    # (moe_triton.DOWN_WAITS_FOR_ROW), and no other row's; without the row wait they stay put.
    assert torch.equal(ready[:rows] - ready_before, torch.full_like(ready_before, 2 * period if row_wait else 0))


def test_row_ready_counters_are_kept_apart_per_period():
    """A counter left at a multiple of 64 is not one of 128: shapes of other periods get their own."""
    cpu = torch.device("cpu")
    assert moe_triton.row_ready_counters(cpu, 64) is moe_triton.row_ready_counters(cpu, 64)
    assert moe_triton.row_ready_counters(cpu, 64) is not moe_triton.row_ready_counters(cpu, 128)
