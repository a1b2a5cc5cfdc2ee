"""The MoE block's exit (`moe_exit_triton`): a stacked block's combine deferred to the next residual
add + norm gives s and h with the bits of the down launch's combine followed by `add_zc_rms_norm`,
for one token, a direct batch, an aligned batch and the largest deferred batch; above
COMBINE_IN_DOWN_MAX_TOKENS tokens (or with COMBINE_IN_NEXT_NORM off) the block combines itself.
A token's bits do not depend on the batch. The decoder trunk defers and gets the torch path's hidden
states (tests/models cover the whole model).
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES  # noqa: E402
from tests.kernels.test_moe_triton import routing, stacked_for, with_shared  # noqa: E402

from freetoken import kernels  # noqa: E402
from freetoken.kernels import moe_triton, norm_triton  # noqa: E402
from freetoken.kernels.moe_exit_triton import PendingCombine  # noqa: E402

EPS = 1e-6


def _block_inputs(n, device, dtype, seed):
    gate_up, down = stacked_for(device, dtype)
    x, experts, w = routing(n, device, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    logits = torch.randn(n, 3, generator=gen).to(dtype).to(device)  # the shared gate is a strided column
    residual = torch.randn(x.shape, generator=gen).to(dtype).to(device)
    norm_w = (0.1 * torch.randn(x.shape[1], generator=gen)).to(dtype).to(device)
    return (x, with_shared(experts, gate_up.shape[0] - 1), w, gate_up, down, logits[:, 1:2]), residual, norm_w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 40, 64])
def test_deferred_combine_has_the_bits_of_combine_then_add_norm(device, dtype, tokens):
    args, residual, norm_w = _block_inputs(tokens, device, dtype, seed=tokens)
    pending = moe_triton.moe_experts_with_shared(*args, defer_combine=True)
    assert isinstance(pending, PendingCombine)
    s, h = kernels.add_zc_rms_norm(pending, residual, norm_w, EPS)
    y = moe_triton.moe_experts_with_shared(*args)
    want_s, want_h = norm_triton.add_zc_rms_norm(y, residual, norm_w, EPS)
    assert torch.equal(s, want_s) and torch.equal(h, want_h)
    x, experts, w, gate_up, down, gate = args
    alone = moe_triton.moe_experts_with_shared(x[-1:], experts[-1:], w[-1:], gate_up, down, gate[-1:], defer_combine=True)
    one_s, one_h = kernels.add_zc_rms_norm(alone, residual[-1:], norm_w, EPS)
    assert torch.equal(one_s, s[-1:]) and torch.equal(one_h, h[-1:]), "the last token alone differs from it in the batch"


@pytest.mark.parametrize("device", DEVICES)
def test_the_block_combines_itself_above_the_deferred_sizes(device, monkeypatch):
    args, _, _ = _block_inputs(moe_triton.COMBINE_IN_DOWN_MAX_TOKENS + 1, device, torch.float32, seed=3)
    assert isinstance(moe_triton.moe_experts_with_shared(*args, defer_combine=True), torch.Tensor)
    x, experts, w, gate_up, down, gate = args
    small = (x[:2], experts[:2], w[:2], gate_up, down, gate[:2])
    monkeypatch.setattr(moe_triton, "COMBINE_IN_NEXT_NORM", False)
    assert torch.equal(moe_triton.moe_experts_with_shared(*small, defer_combine=True), moe_triton.moe_experts_with_shared(*small))
