"""The DFlash2 draft network and its candidate selector against the `dflash` package's torch reference.

Oracle: `qwen35_dense_dflash/ref/dflash2.safetensors` (fixtures/README.md, Round 2), computed by the
PyPI `dflash` 0.1.0 modules on the fixture draft `qwen35_dense_dflash/dflash2` (2 sliding layers,
window 8, bidirectional; two-tap convolutions in groups of 16; selector rank 8, top 4) with the
target `qwen35_dense/hf`: per sequence the context vectors and cache rows, one draft block per
anchor (hidden, logits through the target's lm_head), and the selector's candidates, its greedy walk
from the anchor and its distribution q at temperature 1 along that walk. The selector's walk differs
from the slots' argmax on 23 of the 36 slots, so a selector that fell back to the argmax fails.
The convolution is also checked against its definition written out element by element.
"""

from __future__ import annotations

import json
from functools import cache

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from freetoken.errors import FreetokenError
from freetoken.spec.dflash.config import DFlashConfig
from freetoken.spec.dflash.dflash2 import grouped_conv
from freetoken.spec.dflash.draft import DFlashDraft
from tests.conftest import FIXTURES
from tests.spec.test_dflash_draft import TINY, _target_embed_head
from tests.spec.test_dflash_draft import _run_sequence as run_dflash_sequence
from tests.spec.test_dflash_draft import fixture_config_dict as v1_config_dict

DRAFT_DIR = FIXTURES / "qwen35_dense_dflash" / "dflash2"
REF = FIXTURES / "qwen35_dense_dflash" / "ref" / "dflash2.safetensors"
SEQS = [0, 1, 2]

pytestmark = pytest.mark.skipif(not (DRAFT_DIR.is_dir() and REF.is_file()), reason=f"DFlash2 fixtures not found under {FIXTURES}")
needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def fixture_config_dict() -> dict:
    """The manifest entry the converter writes, built by hand from the fixture's HF config.json
    (block_size and the DFlash2 settings in dflash_config, is_causal false)."""
    nested = json.loads((DRAFT_DIR / "config.json").read_text())["dflash_config"]
    dflash2 = {key: nested[key] for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
    return v1_config_dict(DRAFT_DIR) | dflash2 | {"vocab_size": json.loads((DRAFT_DIR / "config.json").read_text())["vocab_size"]}


@cache
def _draft(dtype: torch.dtype, device: str) -> DFlashDraft:
    draft = DFlashDraft(DFlashConfig.from_dict(fixture_config_dict()))
    draft.load_state_dict(load_file(DRAFT_DIR / "model.safetensors"))  # strict: names match 1:1
    return draft.to(device, dtype).eval()


@cache
def _refs() -> dict[str, torch.Tensor]:
    return load_file(REF)


def _run_sequence(draft: DFlashDraft, seq: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Our context, cache rows and, per anchor, the block's hidden [A, B, H] and logits [A, B-1, V] (fp32, CPU)."""
    return run_dflash_sequence(draft, seq, dtype, device, refs=_refs())


def test_parameter_names_are_the_checkpoint_tensor_names():
    with safe_open(DRAFT_DIR / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert set(_draft(torch.float32, "cpu").state_dict()) == names


@pytest.mark.parametrize("seq", SEQS)
def test_context_cache_rows_and_block_match_reference(seq):
    """Measured max |diff| (fp32, |values| up to about 4): cache rows 1.0e-6, hidden 4.3e-6, logits 5.7e-6."""
    ours, refs = _run_sequence(_draft(torch.float32, "cpu"), seq), _refs()
    for name in ("context", "ctx_k", "ctx_v", "draft_hidden", "draft_logits"):
        torch.testing.assert_close(ours[name], refs[f"seq{seq}.{name}"], rtol=1e-5, atol=2e-5, msg=name)
    assert torch.equal(ours["draft_logits"].argmax(-1), refs[f"seq{seq}.draft_argmax"].long())


@pytest.mark.parametrize("seq", SEQS)
@torch.no_grad()
def test_selector_candidates_walk_and_q_match_reference(seq):
    draft, refs, p = _draft(torch.float32, "cpu"), _refs(), f"seq{seq}."
    ours = _run_sequence(draft, seq)
    selector = draft.candidate_selector
    hidden, logits, anchors = ours["draft_hidden"][:, 1:], ours["draft_logits"], refs[p + "block_ids"][:, 0].long()
    _, candidate_ids = selector.candidates(logits)
    assert torch.equal(candidate_ids, refs[p + "selector_candidates"].long())
    drafts, q = selector.walk(hidden, logits, anchors, [0.0] * len(anchors), [None] * len(anchors))
    assert q is None and torch.equal(drafts, refs[p + "selector_path"].long())
    unary, projected = logits.topk(selector.top_k, dim=-1).values, selector.hidden_projection(hidden)
    predecessors = torch.cat([anchors[:, None], drafts[:, :-1]], dim=1)
    q_t1 = torch.stack([torch.softmax(selector.scores(unary[:, j], candidate_ids[:, j], predecessors[:, j], projected[:, j]), -1) for j in range(drafts.shape[1])], dim=1)
    torch.testing.assert_close(q_t1, refs[p + "selector_q_t1"], rtol=0, atol=2e-6)


@torch.no_grad()
def test_sampled_walk_draws_from_its_q():
    """A mixed batch: the greedy walk keeps the reference path with one-hot q; the sampled walks draw
    a candidate of each slot, with q the softmax of the scores after the token drawn before it, at
    their temperature; a generator seeded alike draws alike."""
    draft, refs = _draft(torch.float32, "cpu"), _refs()
    ours = _run_sequence(draft, 2)
    selector = draft.candidate_selector
    hidden, logits = ours["draft_hidden"][:, 1:], ours["draft_logits"]
    anchors = refs["seq2.block_ids"][:, 0].long()
    temperatures = [0.0, 1.0, 0.5, 2.0]

    def run(seed: int):
        gens = [torch.Generator().manual_seed(seed + i) for i in range(len(anchors))]
        return selector.walk(hidden, logits, anchors, temperatures, gens)

    drafts, q = run(0)
    again, q_again = run(0)
    assert torch.equal(drafts, again) and torch.equal(q, q_again)
    assert torch.equal(drafts[0], refs["seq2.selector_path"][0].long())
    assert torch.equal(q[0], torch.zeros_like(q[0]).scatter_(1, drafts[0][:, None], 1.0))
    unary, candidate_ids = selector.candidates(logits)
    projected = selector.hidden_projection(hidden)
    for i in (1, 2, 3):
        before = torch.cat([anchors[i : i + 1], drafts[i, :-1]])
        for j in range(drafts.shape[1]):
            scores = selector.scores(unary[i : i + 1, j], candidate_ids[i : i + 1, j], before[j : j + 1], projected[i : i + 1, j])[0]
            expected = torch.zeros(logits.shape[-1]).index_put_((candidate_ids[i, j],), torch.softmax(scores / temperatures[i], -1))
            torch.testing.assert_close(q[i, j], expected, rtol=0, atol=1e-7)
            assert drafts[i, j] in candidate_ids[i, j]
    assert not torch.equal(run(0)[0][1:], run(100)[0][1:])  # other seeds, other draws (on this data)


@pytest.mark.parametrize("num_rows", [1, 3, 5])
def test_grouped_conv_equals_its_definition(num_rows):
    """out[i, c] = sum over taps t <= i of (base[t, c] + dynamic[i, t, c // group]) * x[i - t, c], element by element."""
    g = torch.Generator().manual_seed(num_rows)
    taps, hidden, group = 3, 8, 4
    x, dynamic, base = torch.randn(num_rows, hidden, generator=g), torch.randn(num_rows, taps, hidden // group, generator=g), torch.randn(taps, hidden, generator=g)
    expected = torch.zeros(num_rows, hidden, dtype=torch.float64)
    for i in range(num_rows):
        for c in range(hidden):
            for t in range(min(taps, i + 1)):
                expected[i, c] += (float(base[t, c]) + float(dynamic[i, t, c // group])) * float(x[i - t, c])
    torch.testing.assert_close(grouped_conv(x, dynamic, base).double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_bf16_close_to_fp32_reference(device):
    """bf16 weights and inputs: hidden within 0.1 of the fp32 reference, the selector's walk equal on most slots."""
    refs, agree, total = _refs(), 0, 0
    draft = _draft(torch.bfloat16, device)
    for seq in SEQS:
        ours = _run_sequence(draft, seq, torch.bfloat16, device)
        torch.testing.assert_close(ours["draft_hidden"], refs[f"seq{seq}.draft_hidden"], rtol=0.05, atol=0.1)
        anchors = refs[f"seq{seq}.block_ids"][:, 0].long().to(device)
        hidden, logits = ours["draft_hidden"][:, 1:].to(device, torch.bfloat16), ours["draft_logits"].to(device)
        drafts, _ = draft.candidate_selector.walk(hidden, logits, anchors, [0.0] * len(anchors), [None] * len(anchors))
        agree += int((drafts.cpu() == refs[f"seq{seq}.selector_path"].long()).sum())
        total += drafts.numel()
    assert agree >= 0.8 * total, f"the walk agrees on {agree} of {total} slots"


def test_config_checks():
    d = fixture_config_dict()
    cfg = DFlashConfig.from_dict(d)
    assert cfg.is_dflash2 and cfg.num_conv_groups == 4 and DFlashConfig.from_dict(cfg.to_dict()) == cfg
    assert "vocab_size" not in DFlashConfig.from_dict(TINY).to_dict()  # a DFlash entry carries no DFlash2 fields
    with pytest.raises(FreetokenError, match="conv_group_size 48 does not divide hidden_size 64"):
        DFlashConfig.from_dict(d | {"conv_group_size": 48})
    with pytest.raises(FreetokenError, match="selector_rank None"):
        DFlashConfig.from_dict({k: v for k, v in d.items() if k != "selector_rank"})
    with pytest.raises(FreetokenError, match="selector_top_k 2000 exceeds"):
        DFlashConfig.from_dict(d | {"selector_top_k": 2000})
    with pytest.raises(FreetokenError, match="with DFlash2 fields \\['conv_kernel_size'\\]"):
        DFlashConfig.from_dict(TINY | {"conv_kernel_size": 2})


@pytest.mark.parametrize("version", ["dflash", "dflash2"])
@torch.no_grad()
def test_blocks_batched_equal_blocks_alone(version):
    """The runtime drafts all requests' blocks in one forward, contexts padded to the longest: every
    block equals the same block run alone (fp32, within 5e-6: the padded rows get no weight, the
    batched matmuls round differently, measured 1.3e-6 with |values| up to about 4), for the
    fixture anchors of all three sequences (contexts of 1 to 33 rows) at once, with both drafts."""
    from tests.spec import test_dflash_draft as v1

    draft, refs = (_draft, _refs) if version == "dflash2" else (v1._draft, v1._refs)
    draft, refs = draft(torch.float32, "cpu"), refs()
    embed, _ = _target_embed_head()
    blocks = []  # (block ids [B], anchor, K [L, kv, a, hd], V)
    for seq in SEQS:
        p = f"seq{seq}."
        features = refs[p + "target_features"]
        keys, values = draft.context_kv(draft.context(features), torch.arange(features.shape[0]))
        blocks += [(ids, a, keys[:, :, :a], values[:, :, :a]) for ids, a in zip(refs[p + "block_ids"].long(), refs[p + "anchor_positions"].tolist())]
    b, size, longest = len(blocks), blocks[0][0].shape[0], max(a for _, a, _, _ in blocks)
    keys = torch.zeros(draft.config.num_hidden_layers, b, draft.config.num_key_value_heads, longest, draft.config.head_dim)
    values = torch.zeros_like(keys)
    for i, (_, a, k, v) in enumerate(blocks):
        keys[:, i, :, :a], values[:, i, :, :a] = k, v
    anchors = torch.tensor([a for _, a, _, _ in blocks])
    batched = draft(embed[torch.stack([ids for ids, _, _, _ in blocks])], anchors[:, None] + torch.arange(size), keys, values,
                    torch.arange(longest).expand(b, longest), torch.arange(longest)[None] < anchors[:, None])
    for i, (ids, a, k, v) in enumerate(blocks):
        alone = draft(embed[ids], torch.arange(a, a + size), k, v, torch.arange(a))
        torch.testing.assert_close(batched[i], alone, rtol=0, atol=5e-6)
