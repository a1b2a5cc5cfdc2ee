"""The Qwen3.5 MTP draft network against transformers' generic MTP module and the fixtures.

Oracle: `transformers.modeling_layers.MtpModel` (architectures.md §5.1) built on transformers'
causal LM with `num_mtp_layers = 1`, `mtp_layer_types = ["full_attention"]`; its weights are
mapped by hand from the checkpoint (`mtp.fc -> layers.0.eh_proj`, `pre_fc_norm_embedding -> enorm`,
`pre_fc_norm_hidden -> hnorm`, `norm -> post_norm`, `layers.0.* -> layers.0.mtp_block.*`). Its
input is transformers' own post-norm hidden, so the whole chain target -> MTP is independent.
Also the fixtures' stored MTP logits of transformers and of llama.cpp.

All T-1 pairs (h_t, x_{t+1}) of a sequence go through the MTP layer as one causal sequence.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from freetoken.errors import FreetokenError
from tests.conftest import FIXTURE_MODELS, TinySpec, fixture_refs, hf_model_from_dir, load_unified, num_sequences, our_mtp_logits

TOL = 1e-4
SEQS = [[17, 3, 200, 41, 8, 8, 120], [i * 37 % 256 for i in range(21)]]

_RENAMES = {"mtp.fc.": "layers.0.eh_proj.", "mtp.pre_fc_norm_embedding.": "layers.0.enorm.", "mtp.pre_fc_norm_hidden.": "layers.0.hnorm.", "mtp.norm.": "layers.0.post_norm.", "mtp.layers.0.": "layers.0.mtp_block."}


def hf_mtp(hf, mtp_tensors: dict[str, torch.Tensor]):
    from transformers.modeling_layers import MtpModel

    hf.config.num_mtp_layers = 1
    hf.config.mtp_layer_types = ["full_attention"]
    mtp = MtpModel(hf, 1).float().eval()
    state = {}
    for name, t in mtp_tensors.items():
        prefix = next(p for p in _RENAMES if name.startswith(p))
        state[_RENAMES[prefix] + name[len(prefix) :]] = t.float()
    missing, unexpected = mtp.load_state_dict(state, strict=False)
    assert not unexpected and all(m.startswith(("embed_tokens", "shared_head")) for m in missing), (missing, unexpected)
    return mtp


@torch.no_grad()
def hf_mtp_logits(hf, mtp, ids: list[int]) -> torch.Tensor:
    """transformers: target post-norm hidden, then every pair (h_t, x_{t+1}) at positions 1..T-1 -> [T-1, V]."""
    x = torch.tensor([ids])
    hidden = hf(x, output_hidden_states=True).hidden_states[-1]  # [1, T, H] post-norm
    out = mtp.forward_layer(0, hidden[:, :-1], torch.arange(1, len(ids))[None], None, input_ids=x[:, 1:])
    return mtp._project_to_logits(out)[0].float()


def _mtp_source_tensors(hf_dir) -> dict[str, torch.Tensor]:
    from tests.conftest import _fuse_experts

    tensors = {k: v for k, v in load_file(hf_dir / "model.safetensors").items() if k.startswith("mtp.")}
    return _fuse_experts(tensors)  # transformers' MoE block holds fused experts


@pytest.mark.parametrize("spec", [TinySpec(), TinySpec(moe=True)], ids=["dense", "moe"])
def test_mtp_matches_transformers_generic_mtp(spec, tiny_checkpoint):
    hf_dir, unified = tiny_checkpoint(spec)
    model = load_unified(unified, with_mtp=True)
    hf = hf_model_from_dir(hf_dir)
    mtp = hf_mtp(hf, _mtp_source_tensors(hf_dir))
    for ids in SEQS:
        want = hf_mtp_logits(hf, mtp, ids)
        got = our_mtp_logits(model, ids)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= TOL
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("model", FIXTURE_MODELS)
@pytest.mark.parametrize("which", ["hf_transformers", "llamacpp_f32"])
def test_mtp_matches_fixture_references(model, which, fixture_unified):
    net = load_unified(fixture_unified(model), with_mtp=True)
    refs = fixture_refs(model, which)
    for i in range(num_sequences(refs)):
        ids = refs[f"seq{i}.input_ids"].tolist()
        assert (our_mtp_logits(net, ids) - refs[f"seq{i}.mtp_logits"]).abs().max().item() <= TOL


def test_checkpoint_without_mtp_refuses_spec_mtp(tiny_checkpoint):
    from freetoken.engine.config import EngineConfig
    from freetoken.llm import LLM

    _, unified = tiny_checkpoint(TinySpec(with_mtp=False))
    with pytest.raises(FreetokenError) as e:
        LLM(str(unified), EngineConfig(spec="mtp", num_draft_tokens=2))
    msg = str(e.value)
    assert "MTP" in msg and "\n" not in msg and str(unified) in msg
