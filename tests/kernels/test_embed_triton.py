"""The Triton embedding gather and token feed-back vs torch indexing (bitwise: they only move values)."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES  # noqa: E402

from freetoken.kernels import embed_triton  # noqa: E402


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [48, 1030])
def test_embedding_equals_torch_indexing(device, dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    weight = torch.randn(97, hidden, generator=gen).to(dtype).to(device)
    ids = torch.tensor([5, 0, 96, 5, 41], device=device)
    assert torch.equal(embed_triton.embedding(weight, ids), weight[ids])
    assert embed_triton.embedding(weight, ids[:0]).shape == (0, hidden)


@pytest.mark.parametrize("device", DEVICES)
def test_take_fed_back_equals_the_torch_form(device):
    input_ids = torch.tensor([11, 12, 13, 14, 15], device=device)
    fed_back_rows = torch.tensor([2, -1, 0, -1, 3], device=device)
    last_tokens = torch.tensor([100, 101, 102, 103, 104, 105], device=device)
    want = torch.where(fed_back_rows >= 0, last_tokens.index_select(0, fed_back_rows.clamp(min=0)), input_ids)
    embed_triton.take_fed_back(input_ids, fed_back_rows, last_tokens)
    assert torch.equal(input_ids, want)
    assert input_ids.tolist() == [102, 12, 100, 14, 103]


@pytest.mark.parametrize("glue", [True, False])
def test_step_glue_dispatch_equals_torch(monkeypatch, glue):
    """kernels.TRITON_STEP_GLUE on (the Triton kernels, CPU interpreter) and off (torch): the embedding
    gather, the fed-back tokens and the stacked greedy verify give the torch results."""
    from freetoken import kernels, sampling

    monkeypatch.setattr(kernels, "MODE", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kernels, "TRITON_STEP_GLUE", glue)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(50, 40, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([3, 49, 0, 3])
    assert torch.equal(kernels.embedding(weight, ids), weight[ids])
    input_ids = torch.tensor([7, 8, 9])
    kernels.take_fed_back(input_ids, torch.tensor([-1, 1, 0]), torch.tensor([20, 21]))
    assert input_ids.tolist() == [7, 21, 20]
    num_seqs, k, v = 2, 2, 300
    logits = torch.randn(num_seqs * (k + 1), v, generator=gen).to(torch.bfloat16)
    argmax = logits.float().argmax(-1).view(num_seqs, k + 1)
    drafts = argmax[:, :k].clone()
    drafts[1, 0] = (argmax[1, 0] + 1) % v  # sequence 0 accepts both drafts, sequence 1 none
    last_tokens = torch.zeros(4, dtype=torch.int64)
    got = sampling.greedy_verify_stacked(logits, drafts, last_tokens)
    want = torch.stack([torch.tensor([2, 0]), torch.stack([argmax[0, 2], argmax[1, 0]])])
    assert torch.equal(got, want) and torch.equal(last_tokens[:2], want[1])
