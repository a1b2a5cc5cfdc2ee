"""The DFlash (v1) draft network against the `dflash` package's torch reference.

Oracle: `qwen35_dense_dflash/ref/dflash.safetensors` (fixtures/README.md, Round 2), computed by the
PyPI `dflash` 0.1.0 modules on the fixture draft `qwen35_dense_dflash/dflash` with the target
`qwen35_dense/hf`: per sequence the context vectors, the draft cache rows of every context
position, and one draft block per anchor a (context rows 0..a-1, the block at a..a+B-1), its
hidden, its logits through the target's lm_head and their argmax. The block embeddings and the
lm_head are the target's tensors, read from its safetensors file.

The masks of sliding and causal layers (absent from the fixture, whose layers are full and
bidirectional) are checked against the rule of reference/dflash.md §1.3 point 5, and through the
forward by perturbing the keys the rule hides.
"""

from __future__ import annotations

import json
from functools import cache

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from freetoken.errors import FreetokenError, UnsupportedModelError
from freetoken.spec.dflash.config import DFlashConfig
from freetoken.spec.dflash.draft import DFlashDraft, attention_mask
from tests.conftest import FIXTURES

DRAFT_DIR = FIXTURES / "qwen35_dense_dflash" / "dflash"
REF = FIXTURES / "qwen35_dense_dflash" / "ref" / "dflash.safetensors"
TARGET = FIXTURES / "qwen35_dense" / "hf" / "model.safetensors"
SEQS = [0, 1, 2]

needs_fixtures = pytest.mark.skipif(not (DRAFT_DIR.is_dir() and REF.is_file() and TARGET.is_file()), reason=f"DFlash fixtures not found under {FIXTURES}")
needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TINY = {
    "architecture": "DFlashDraftModel", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e7, "block_size": 4, "mask_token_id": 1023, "target_layer_ids": [0, 2],
    "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8, "causal": [False, True], "attention_bias": False,
}  # fmt: skip


def fixture_config_dict(draft_dir=DRAFT_DIR) -> dict:
    """The manifest entry the converter writes, built by hand from a fixture draft's HF config.json
    (the DFlash one: block_size at the top level, full layers without is_causal, so bidirectional)."""
    hf = json.loads((draft_dir / "config.json").read_text())
    nested = hf["dflash_config"]
    return {
        "architecture": hf["architectures"][0],
        "hidden_size": hf["hidden_size"],
        "num_hidden_layers": hf["num_hidden_layers"],
        "num_attention_heads": hf["num_attention_heads"],
        "num_key_value_heads": hf["num_key_value_heads"],
        "head_dim": hf["head_dim"],
        "intermediate_size": hf["intermediate_size"],
        "rms_norm_eps": hf["rms_norm_eps"],
        "rope_theta": float(hf["rope_parameters"]["rope_theta"]),
        "block_size": nested.get("block_size", hf.get("block_size")),
        "mask_token_id": nested["mask_token_id"],
        "target_layer_ids": nested["target_layer_ids"],
        "layer_types": hf["layer_types"],
        "sliding_window": hf["sliding_window"],
        "causal": [hf.get("is_causal", False)] * hf["num_hidden_layers"],
        "attention_bias": hf["attention_bias"],
    }


@cache
def _draft(dtype: torch.dtype, device: str) -> DFlashDraft:
    draft = DFlashDraft(DFlashConfig.from_dict(fixture_config_dict()))
    draft.load_state_dict(load_file(DRAFT_DIR / "model.safetensors"))  # strict: names match 1:1; stored bf16, exact in either dtype
    return draft.to(device, dtype).eval()


@cache
def _target_embed_head() -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding table and (untied) lm_head, fp32 [V, H] each."""
    with safe_open(TARGET, "pt") as f:
        return f.get_tensor("model.language_model.embed_tokens.weight").float(), f.get_tensor("lm_head.weight").float()


@cache
def _refs() -> dict[str, torch.Tensor]:
    return load_file(REF)


@torch.no_grad()
def _run_sequence(draft: DFlashDraft, seq: int, dtype: torch.dtype = torch.float32, device: str = "cpu", refs: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Our context, cache rows and, per anchor, the block's hidden and logits (fp32, on the CPU), for
    one sequence of `refs` (this draft's reference file by default)."""
    refs, (embed, head) = refs if refs is not None else _refs(), _target_embed_head()
    p = f"seq{seq}."
    features = refs[p + "target_features"].to(device, dtype)
    t = features.shape[0]
    context = draft.context(features)
    ctx_k, ctx_v = draft.context_kv(context, torch.arange(t, device=device))
    hidden, logits = [], []
    for ids, a in zip(refs[p + "block_ids"].long(), refs[p + "anchor_positions"].tolist()):
        b = ids.shape[0]
        h = draft(embed[ids].to(device, dtype), torch.arange(a, a + b, device=device), ctx_k[:, :, :a], ctx_v[:, :, :a], torch.arange(a, device=device))
        hidden.append(h.float().cpu())
        logits.append(h[1:].float().cpu() @ head.T)
    return {"context": context.float().cpu(), "ctx_k": ctx_k.float().cpu(), "ctx_v": ctx_v.float().cpu(), "draft_hidden": torch.stack(hidden), "draft_logits": torch.stack(logits)}


# --- config ---


def test_config_from_dict_round_trip_and_rejections():
    d = TINY
    cfg = DFlashConfig.from_dict(d)
    assert cfg.target_layer_ids == (0, 2) and cfg.causal == (False, True) and cfg.num_taps == 2
    assert cfg.window(0) is None and cfg.window(1) == 8
    assert DFlashConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(FreetokenError, match="missing keys \\['causal'\\]"):
        DFlashConfig.from_dict({k: v for k, v in d.items() if k != "causal"})
    with pytest.raises(FreetokenError, match="unexpected keys \\['num_target_layers'\\]"):
        DFlashConfig.from_dict(d | {"num_target_layers": 4})
    with pytest.raises(UnsupportedModelError, match="'DFlash3DraftModel' \\(supported: DFlashDraftModel, DFlash2DraftModel\\)"):
        DFlashConfig.from_dict(d | {"architecture": "DFlash3DraftModel"})
    with pytest.raises(FreetokenError, match="DFlash2 draft: conv_kernel_size None"):  # DFlash2 without its fields
        DFlashConfig.from_dict(d | {"architecture": "DFlash2DraftModel"})
    with pytest.raises(FreetokenError, match="sliding_window"):
        DFlashConfig.from_dict(d | {"sliding_window": None})
    with pytest.raises(FreetokenError, match="do not fit"):
        DFlashConfig.from_dict(d | {"causal": [False]})


# --- against the reference ---


@needs_fixtures
def test_parameter_names_are_the_checkpoint_tensor_names():
    with safe_open(DRAFT_DIR / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert set(DFlashDraft(DFlashConfig.from_dict(fixture_config_dict())).state_dict()) == names


@needs_fixtures
@pytest.mark.parametrize("seq", SEQS)
def test_context_and_cache_rows_match_reference(seq):
    """Measured max |diff| (fp32, one thread; |values| up to about 3.5): context 1.4e-6, ctx_k and ctx_v 8.3e-7."""
    ours, refs = _run_sequence(_draft(torch.float32, "cpu"), seq), _refs()
    for name in ("context", "ctx_k", "ctx_v"):
        torch.testing.assert_close(ours[name], refs[f"seq{seq}.{name}"], rtol=1e-5, atol=1e-5, msg=name)


@needs_fixtures
@pytest.mark.parametrize("seq", SEQS)
def test_draft_block_matches_reference(seq):
    """Every anchor: hidden of all B slots, logits of slots 1.. and their argmax. Measured max |diff|
    (|values| up to about 3.7): hidden 2.1e-6, logits 2.5e-6."""
    ours, refs = _run_sequence(_draft(torch.float32, "cpu"), seq), _refs()
    torch.testing.assert_close(ours["draft_hidden"], refs[f"seq{seq}.draft_hidden"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours["draft_logits"], refs[f"seq{seq}.draft_logits"], rtol=1e-5, atol=1e-5)
    assert torch.equal(ours["draft_logits"].argmax(-1), refs[f"seq{seq}.draft_argmax"].long())


@needs_fixtures
@torch.no_grad()
def test_context_rows_depend_only_on_their_own_row():
    """Rows computed in two halves, or in a shuffled order, are the rows computed all at once."""
    draft, refs = _draft(torch.float32, "cpu"), _refs()
    context = draft.context(refs["seq2.target_features"])
    t = context.shape[0]
    pos = torch.arange(t)
    k, v = draft.context_kv(context, pos)
    halves = [draft.context_kv(context[s], pos[s]) for s in (slice(0, t // 2), slice(t // 2, t))]
    torch.testing.assert_close(torch.cat([h[0] for h in halves], dim=2), k, rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.cat([h[1] for h in halves], dim=2), v, rtol=0, atol=1e-6)
    perm = torch.randperm(t, generator=torch.Generator().manual_seed(0))
    kp, vp = draft.context_kv(context[perm], pos[perm])
    torch.testing.assert_close(kp, k[:, :, perm], rtol=0, atol=1e-6)
    torch.testing.assert_close(vp, v[:, :, perm], rtol=0, atol=1e-6)


@needs_fixtures
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_bf16_close_to_fp32_reference(device):
    """bf16 weights and inputs. Measured on CPU: hidden max |diff| 0.048 (|values| up to
    about 3.4); argmax equal on 35 of 36 slots (the fp32 top-2 gap is 1.3e-3 on some slots)."""
    refs = _refs()
    agree = total = 0
    for seq in SEQS:
        ours = _run_sequence(_draft(torch.bfloat16, device), seq, torch.bfloat16, device)
        torch.testing.assert_close(ours["draft_hidden"], refs[f"seq{seq}.draft_hidden"], rtol=0.05, atol=0.1)
        agree += int((ours["draft_logits"].argmax(-1) == refs[f"seq{seq}.draft_argmax"].long()).sum())
        total += refs[f"seq{seq}.draft_argmax"].numel()
    assert agree >= 0.8 * total, f"top-1 agrees on {agree} of {total} slots"


# --- masks ---


def _rule(q: int, k: int, causal: bool, window: int | None) -> bool:
    """reference/dflash.md §1.3 point 5, one (query, key) pair at a time."""
    if causal and k > q:
        return False
    if window is not None and q - k >= window:
        return False
    return window is None or causal or k - q < window


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 3])
def test_attention_mask_follows_the_reference_rule(causal, window):
    n, a, b = 6, 6, 4  # context positions 0..5, block 6..9
    q_pos = torch.arange(a, a + b)
    k_pos = torch.cat([torch.arange(n), q_pos])
    mask = attention_mask(q_pos, k_pos, causal, window)
    expected = torch.tensor([[_rule(q, k, causal, window) for k in k_pos.tolist()] for q in q_pos.tolist()])
    if mask is None:
        assert expected.all()
    else:
        assert torch.equal(mask, expected)


def _random_draft(layer_type: str, window: int | None, causal: bool) -> DFlashDraft:
    """One layer, so that what a query sees is not mixed through a second layer."""
    draft = DFlashDraft(DFlashConfig.from_dict(TINY | {"num_hidden_layers": 1, "layer_types": [layer_type], "sliding_window": window, "causal": [causal]}))
    g = torch.Generator().manual_seed(0)
    for name, p in draft.named_parameters():
        p.copy_(1 + 0.15 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight") else torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return draft.eval()


@pytest.mark.parametrize("causal", [False, True])
@torch.no_grad()
def test_sliding_and_causal_masks_in_forward(causal):
    """Window 3, context at 0..5, block at 6..9: context rows 0..3 are out of every query's window,
    row 4 is in the anchor's. Slot 3 (position 9) is out of slot 0's window either way; slots 1 and 2
    see it, and slot 0 sees slot 1, only when not causal."""
    draft = _random_draft("sliding_attention", 3, causal)
    g = torch.Generator().manual_seed(1)
    n, a, b, h = 6, 6, 4, draft.config.hidden_size
    ctx_k, ctx_v = draft.context_kv(torch.randn(n, h, generator=g), torch.arange(n))
    embeds = torch.randn(b, h, generator=g)

    def run(e: torch.Tensor = embeds, k: torch.Tensor = ctx_k, v: torch.Tensor = ctx_v) -> torch.Tensor:
        return draft(e, torch.arange(a, a + b), k, v, torch.arange(n))

    def bump(t: torch.Tensor, rows: slice, dim: int) -> torch.Tensor:
        t = t.clone()
        t.narrow(dim, rows.start, rows.stop - rows.start).add_(1.0)
        return t

    base = run()
    assert torch.equal(run(k=bump(ctx_k, slice(0, 4), 2), v=bump(ctx_v, slice(0, 4), 2)), base)
    assert not torch.allclose(run(k=bump(ctx_k, slice(4, 5), 2), v=bump(ctx_v, slice(4, 5), 2))[0], base[0])
    slot3 = run(bump(embeds, slice(3, 4), 0))
    assert torch.equal(slot3[0], base[0])
    assert torch.equal(slot3[1:3], base[1:3]) == causal
    assert torch.equal(run(bump(embeds, slice(1, 2), 0))[0], base[0]) == causal
