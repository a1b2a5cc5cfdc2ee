"""Sampled MTP speculative decoding keeps the target's distribution (temperature, top-p, penalties).

A tiny random checkpoint with a 32-token vocabulary, so the joint distribution of the first two
generated tokens (32 x 32 cells) is estimable from 2000 requests. Oracle: that joint computed
exactly, in float64 and by hand, from transformers' logits: p(t1) from the prompt, p(t2 | t1)
from prompt + t1 with t1 penalised (presence + frequency, over generated tokens), then
temperature and the top-p nucleus. The plain engine, MTP (k = 2), a random DFlash draft (k = 3,
its q from its own logits under the same penalties, temperature and top-p) and a random DFlash2
draft (k = 3, its q the candidate selector's softmax over 6 candidates at the temperature alone)
must fit it, and the speculative runs must fit the plain one (two-sample chi-square).

Threshold: Pearson's chi-square goodness of fit over cells with expected count >= 5 (the rest
pooled into one cell), rejected at p < 1e-3. Every request has its own seeded stream, so each run
is deterministic (no flakiness). The penalties only act on t2 == t1 (about 3% of the mass
without them, 0.6% with them), which the pooled statistic cannot resolve, so the repeat count is
checked on its own: within 4 binomial standard deviations of the exact value and more than 5
below the value without penalties.
"""

from __future__ import annotations

import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.sampling import SamplingParams
from tests.conftest import TinySpec, hf_model_from_dir, load_unified

N = 2000
VOCAB = 32
PROMPT = [3, 17, 5, 9, 30]
TEMPERATURE, TOP_P, PRESENCE, FREQUENCY = 0.8, 0.9, 0.6, 0.4


def _nucleus(logits: torch.Tensor, history: list[int], penalties: bool = True) -> torch.Tensor:
    """Target distribution after penalties, temperature and top-p, float64 [V]."""
    x = logits.double().clone()
    if penalties:
        for t in set(history):
            x[t] -= PRESENCE + FREQUENCY * history.count(t)
    p = torch.softmax(x / TEMPERATURE, dim=-1)
    sorted_p, order = torch.sort(p, descending=True)
    keep = (torch.cumsum(sorted_p, 0) - sorted_p) < TOP_P  # mass ranked above the token < top_p
    out = torch.zeros_like(p)
    out[order[keep]] = sorted_p[keep]
    return out / out.sum()


@torch.no_grad()
def _exact_joint(hf_dir, penalties: bool = True) -> torch.Tensor:
    """p(t1, t2) [V, V] from transformers' fp32 logits."""
    hf = hf_model_from_dir(hf_dir)
    first = hf(torch.tensor([PROMPT])).logits[0, -1]
    seconds = hf(torch.tensor([PROMPT + [t] for t in range(VOCAB)])).logits[:, -1]  # [V, V]
    p1 = _nucleus(first, [], penalties)
    return torch.stack([p1[t] * _nucleus(seconds[t], [t], penalties) for t in range(VOCAB)])


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = (probs * n).flatten()
    observed = counts.flatten().double()
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    nonzero = exp > 0
    stat = (((obs - exp) ** 2)[nonzero] / exp[nonzero]).sum()
    df = int(nonzero.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _sample_counts(model, spec: str, k: int) -> tuple[torch.Tensor, LLMEngine]:
    params = SamplingParams(max_new_tokens=2, temperature=TEMPERATURE, top_p=TOP_P, presence_penalty=PRESENCE, frequency_penalty=FREQUENCY, ignore_eos=True)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=N, max_num_batched_tokens=N * len(PROMPT), block_size=4, max_model_len=12, spec=spec, num_draft_tokens=k, seed=7))
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.long)
    for r in engine.generate([PROMPT] * N, params):
        assert len(r.output_token_ids) == 2
        counts[r.output_token_ids[0], r.output_token_ids[1]] += 1
    return counts, engine


def test_sampled_spec_and_plain_fit_the_exact_distribution(tiny_checkpoint):
    hf_dir, unified = tiny_checkpoint(TinySpec(vocab_size=VOCAB, eos_token_id=VOCAB - 1))
    model = load_unified(unified, with_mtp=True)
    exact = _exact_joint(hf_dir)
    without_penalties = _exact_joint(hf_dir, penalties=False)

    plain, _ = _sample_counts(model, "none", 0)
    spec, engine = _sample_counts(model, "mtp", 2)
    assert engine.stats.num_verifies > 0 and engine.stats.accepted_per_position[0] > 0  # drafts were accepted
    model.attached_drafts["dflash"] = _random_dflash_draft(model.config.hidden_size)
    dflash, engine = _sample_counts(model, "dflash", 3)
    assert engine.stats.num_verifies > 0 and engine.stats.accepted_per_position[0] > 0
    model.attached_drafts["dflash"] = _random_dflash_draft(model.config.hidden_size, dflash2=True)
    dflash2, engine = _sample_counts(model, "dflash", 3)
    assert engine.stats.num_verifies > 0 and engine.stats.accepted_per_position[0] > 0

    for name, counts in (("plain", plain), ("mtp k=2", spec), ("dflash k=3", dflash), ("dflash2 k=3", dflash2)):
        assert counts[exact == 0].sum() == 0, f"{name}: tokens outside the top-p nucleus"
        assert _chi2_pvalue(counts, exact) > 1e-3, name
        repeats = counts.diagonal().sum().item()
        for p, near in ((exact.diagonal().sum().item(), True), (without_penalties.diagonal().sum().item(), False)):
            z = abs(repeats - N * p) / (N * p * (1 - p)) ** 0.5
            assert (z < 4) if near else (z > 5), f"{name}: {repeats} repeated tokens, expected {N * p:.1f} ({'with' if near else 'without'} penalties)"
    assert _two_sample_pvalue(plain, spec, exact) > 1e-3
    assert _two_sample_pvalue(plain, dflash, exact) > 1e-3
    assert _two_sample_pvalue(plain, dflash2, exact) > 1e-3


def _random_dflash_draft(hidden_size: int, dflash2: bool = False):
    """A 2-layer DFlash draft (block 4, taps 0 and 2, mask id 28) with fixture-style random weights;
    DFlash2: two-tap convolutions in groups of 16, a selector of rank 8 over 6 candidates."""
    from freetoken.spec.dflash.config import DFlashConfig
    from freetoken.spec.dflash.draft import DFlashDraft

    architecture, extra = ("DFlash2DraftModel", (2, 16, 8, 6, VOCAB)) if dflash2 else ("DFlashDraftModel", ())
    cfg = DFlashConfig(architecture, hidden_size, 2, 4, 2, 16, 128, 1e-6, 1e7, 4, 28, (0, 2), ("full_attention",) * 2, None, (False, False), False, *extra)
    draft = DFlashDraft(cfg).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.15 * torch.randn(param.shape, generator=g))
            else:
                param.copy_(torch.randn(param.shape, generator=g) * max(0.05, param.shape[1] ** -0.5))
    return draft


def _two_sample_pvalue(a: torch.Tensor, b: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square test that two equal-size samples share one distribution (cells pooled as above)."""
    big = (probs * N >= 5).flatten()
    a, b = a.flatten().double(), b.flatten().double()
    a = torch.cat([a[big], a[~big].sum()[None]])
    b = torch.cat([b[big], b[~big].sum()[None]])
    used = (a + b) > 0
    stat = (((a - b) ** 2)[used] / (a + b)[used]).sum()
    df = int(used.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))
