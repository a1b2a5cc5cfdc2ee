"""The qwen4_exp MTP head against the fixture's `ref/mtp_explicit.safetensors`.

That reference is an explicit re-implementation of architectures.md §5.2 (fixtures/README.md): it
reproduces transformers' own qwen4 modules (a decoder layer and the gated residual loaded with the
`mtp.*` tensors) to 4.8e-7, so it checks the layer code against transformers, but it is NOT
independent of the data-flow description (one RMS over all S*H channels for pre_fc_norm_hidden,
X0_s = fc_hidden(h_s) + fc_embedding(norm(e)), the head's own mixer, the shared lm_head) that this
implementation follows too; transformers has no qwen4 MTP of its own.

Its input h_t is the stored transformers `wide_last`, so the target's errors do not enter. All T-1
pairs (h_t, x_{t+1}) of a sequence go through the MTP layer as one causal sequence; the reference
runs them at positions 1..T-1, we at the target positions 0..T-2 (RoPE and QSA block keys are
relative, so only rounding differs).
"""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.runner import RowGroup, build_context
from freetoken.forward_context import ForwardMode
from tests.conftest import fixture_refs, load_unified, num_sequences
from tests.models.test_qwen4_exp_vs_hf import MODEL, TOL, WIDE_TOL, as_mask, diff, new_engine


@pytest.fixture(scope="module")
def model(fixture_unified):
    return load_unified(fixture_unified(MODEL), with_mtp=True)


@torch.no_grad()
def test_mtp_matches_explicit_reference(model):
    hf, ref = fixture_refs(MODEL), fixture_refs(MODEL, "mtp_explicit")
    mtp = model.mtp
    inputs, selected = [], []
    hooks = [
        mtp.layers[0].register_forward_pre_hook(lambda _m, args: inputs.append(args[0])),
        mtp.layers[0].self_attn.indexer.register_forward_hook(lambda _m, _a, out: selected.extend(out.positions())),
    ]
    try:
        for i in range(num_sequences(ref)):
            ids = ref[f"seq{i}.input_ids"].tolist()
            inputs.clear(), selected.clear()
            engine = new_engine(model)
            table: list[int] = []
            engine.kv_pool.grow(table, len(ids))
            ctx = build_context([RowGroup(table, None, 0, ids[1:])], ForwardMode.EXTEND, engine.kv_pool, None, engine.device)
            wide = mtp(ctx, hf[f"seq{i}.wide_last"][:-1])
            assert diff(inputs[0], ref[f"seq{i}.mtp_input_wide"]) <= WIDE_TOL
            assert diff(wide, ref[f"seq{i}.mtp_wide"]) <= WIDE_TOL
            assert diff(mtp.hyper_connection_mixer(wide), ref[f"seq{i}.mtp_hidden"]) <= TOL
            assert diff(mtp.compute_logits(wide), ref[f"seq{i}.mtp_logits"]) <= TOL
            assert torch.equal(as_mask(selected, len(ids) - 1), ref[f"seq{i}.mtp_qsa_selected"]), i
    finally:
        for h in hooks:
            h.remove()
