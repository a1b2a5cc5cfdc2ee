"""qwen4_exp's verify step over static inputs, as a CUDA graph captures it (`DecodeGraphs.static_step`),
run eagerly on CPU under the Triton interpreter: every per-step value must reach the kernels through
the step's device tensors, never through host values frozen when the step was built.

Oracle: the eager verify and commit of the same rows (build_context), bit for bit. The static step is
built for one batch (sequence a, then b) and run with the staging loaded for another (b, then a,
other drafts): every slot, cached length, block table, position and id differs per batch index.
"""

import os
from dataclasses import replace

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

import freetoken.kernels  # noqa: E402
from freetoken.engine.cuda_graph import DecodeGraphs  # noqa: E402
from freetoken.engine.runner import RowGroup, build_context  # noqa: E402
from freetoken.forward_context import ForwardMode  # noqa: E402

from tests.conftest import fixture_refs  # noqa: E402
from tests.kernels.conftest import INTERPRET  # noqa: E402
from tests.kernels.test_qwen4_exp_triton import MODEL, forward, load, open_seqs  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setattr(freetoken.kernels, "MODE", "triton")


def linear_state(engine) -> list[torch.Tensor]:
    pools = engine.state_pool.state
    return [t.clone() for t in (pools.conv, pools.recurrent, *pools.extra.values())]


def set_linear_state(engine, saved: list[torch.Tensor]) -> None:
    pools = engine.state_pool.state
    for live, values in zip((pools.conv, pools.recurrent, *pools.extra.values()), saved):
        live.copy_(values)


@torch.no_grad()
def test_static_verify_and_commit_equal_eager(fixture_unified):
    refs = fixture_refs(MODEL)
    model, engine = load(fixture_unified(MODEL), torch.float32, "cpu")
    full = [refs[f"{n}.input_ids"].tolist() for n in ("seq3", "seq1")]  # seq3 has an EOS inside (the PLE n-grams restart)
    prompts = [full[0][:6], full[1][:12]]
    seqs = open_seqs(engine, prompts, 4)
    with freetoken.kernels.torch_only():
        forward(model, engine, seqs, [0, 0], prompts, ForwardMode.EXTEND)
    after_prefill = linear_state(engine)

    def groups(order, drafts):
        return [RowGroup(seqs[i][0], seqs[i][1], len(prompts[i]), drafts[i]) for i in order]

    graphs = DecodeGraphs(model, engine.kv_pool, engine.state_pool, engine.device, max_blocks_per_seq=8, max_num_seqs=4)
    static = graphs.static_step(groups([0, 1], [[5, 9], [11, 3]]), ForwardMode.VERIFY, greedy=False)
    step_b = groups([1, 0], [full[1][12:14], full[0][6:8]])
    accepted = [1, 2]  # sequence 1 commits one of its two rows, sequence 0 both

    ctx = build_context(step_b, ForwardMode.VERIFY, engine.kv_pool, engine.state_pool, engine.device)
    hidden = model(ctx)
    logits = model.compute_logits(hidden)
    model.commit(ctx, accepted)
    eager_state = linear_state(engine)

    set_linear_state(engine, after_prefill)
    static.staging.load(step_b, engine.kv_pool)
    static_hidden, _, static_logits, _ = static.run()
    assert torch.equal(static_hidden, hidden) and torch.equal(static_logits, logits)
    assert all(torch.equal(a, b) for a, b in zip(linear_state(engine), after_prefill)), "verify writes no linear state"
    static.accepted_rows.copy_(torch.tensor(accepted, dtype=torch.int32))
    model.commit(static.ctx, static.replay)
    for name, got, want in zip(["conv", "recurrent", *engine.state_pool.state.extra], linear_state(engine), eager_state):
        assert torch.equal(got, want), name
    # QSA's pooled block keys read image prompts' positions on the host: their rows stay eager
    assert graphs.covers(step_b) and not graphs.covers([replace(step_b[0], images=object()), step_b[1]])


def test_graphs_switch(fixture_unified, monkeypatch):
    """supports_cuda_graphs: off unless FREETOKEN_QWEN4_GRAPHS=1 (model.CUDA_GRAPHS); the expert offload's
    False keeps it off."""
    from freetoken.models.qwen4_exp import model as qwen4_model

    model, _ = load(fixture_unified(MODEL), torch.float32, "cpu")
    monkeypatch.setattr(qwen4_model, "CUDA_GRAPHS", False)
    assert not model.supports_cuda_graphs
    monkeypatch.setattr(qwen4_model, "CUDA_GRAPHS", True)
    assert model.supports_cuda_graphs
    model.supports_cuda_graphs = False
    assert not model.supports_cuda_graphs
