"""verify(): greedy hand cases, and sampled outputs checked by distribution.

Distribution oracle: a toy "bigram" target whose next-token logits depend only on the last
token (table L), and a toy draft with its own table. Many independent requests run one
verify step (k = 2) and, where fewer than two tokens came out, a second step. The first two
emitted tokens must follow p(t1) * p(t2 | t1), where p is built by a plain-Python reference of
the row processors (penalties over the history including t1, temperature, top-k, top-p) —
never by the code under test. Chi-square thresholds sit at a 1e-5 tail (Wilson-Hilferty), so a
correct sampler fails with probability about 1e-5 for an arbitrary seed; seeds are fixed.
"""

from __future__ import annotations


import pytest
import torch

from freetoken.sampling import SamplingParams, make_generator, verify
from tests.test_sampling import assert_matches_distribution, ref_probs


# ---------------------------------------------------------------- greedy


def one_hot_rows(argmaxes: list[int], V: int = 5) -> torch.Tensor:
    """[k+1, V] logits whose row i has its maximum at argmaxes[i]."""
    rows = torch.arange(V, dtype=torch.float32).flip(0).repeat(len(argmaxes), 1) * 0.1
    for i, a in enumerate(argmaxes):
        rows[i, a] = 5.0
    return rows


@pytest.mark.parametrize(
    "drafts, accepted, nxt",
    [
        ([2, 4, 1], 3, 3),  # all accepted, bonus from row k
        ([0, 4, 1], 0, 2),  # first rejected
        ([2, 0, 1], 1, 4),  # middle rejected
        ([2, 4, 0], 2, 1),  # last rejected
    ],
)
def test_greedy_hand_cases(drafts, accepted, nxt):
    logits = one_hot_rows([2, 4, 1, 3])[None]  # [1, 4, 5]
    sp = SamplingParams()
    res = verify(logits, torch.tensor([drafts]), None, [sp], [[]], [None])
    assert res.accepted_len.tolist() == [accepted] and res.next_token.tolist() == [nxt]
    assert res.accepted_len.dtype == torch.int64 and res.next_token.dtype == torch.int64


def test_greedy_k0_and_batch():
    logits = torch.stack([one_hot_rows([3]), one_hot_rows([0])])  # [2, 1, 5]
    res = verify(logits, torch.zeros(2, 0, dtype=torch.int64), None, [SamplingParams()] * 2, [[], []], [None] * 2)
    assert res.accepted_len.tolist() == [0, 0] and res.next_token.tolist() == [3, 0]


def test_greedy_penalty_sees_earlier_drafts():
    # every row prefers 1 over 2 by 0.1; with frequency penalty 1, once 1 is in the history of a
    # row, 2 wins. Row 0 history: [] -> 1; row 1 history: [d1=1] -> 2.
    row = [0.0, 5.0, 4.9, 0.0, 0.0]
    logits = torch.tensor([[row, row, row]])
    sp = SamplingParams(frequency_penalty=1.0)
    res = verify(logits, torch.tensor([[1, 1]]), None, [sp], [[]], [None])
    assert res.accepted_len.tolist() == [1] and res.next_token.tolist() == [2]
    res = verify(logits, torch.tensor([[1, 2]]), None, [sp], [[]], [None])
    # row 2 history [1, 2]: both penalized once -> 1 (4.0) beats 2 (3.9): bonus 1
    assert res.accepted_len.tolist() == [2] and res.next_token.tolist() == [1]
    # the request's own earlier tokens count too: history [1] makes row 0 pick 2
    res = verify(logits, torch.tensor([[1, 2]]), None, [sp], [[1]], [None])
    assert res.accepted_len.tolist() == [0] and res.next_token.tolist() == [2]


def test_greedy_rows_unaffected_by_sampled_neighbours():
    V, k = 50, 3
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, k + 1, V, generator=g).to(torch.bfloat16)
    drafts = logits[:, :k].float().argmax(-1)
    drafts[0, 2] = (drafts[0, 2] + 1) % V  # force a rejection in request 0
    params = [SamplingParams(presence_penalty=0.3), SamplingParams(temperature=1.0, top_k=5), SamplingParams()]
    hist = [[1, 2], [3], []]
    gens = [make_generator(sp, i) for i, sp in enumerate(params)]
    both = verify(logits, drafts, None, params, hist, gens)
    for b in (0, 2):
        alone = verify(logits[b : b + 1], drafts[b : b + 1], None, [params[b]], [hist[b]], [None])
        assert both.accepted_len[b] == alone.accepted_len[0] and both.next_token[b] == alone.next_token[0]
    assert both.accepted_len[0].item() == 2


# ---------------------------------------------------------------- sampled, by distribution

V, K, N = 6, 2, 20000
PROMPT_LAST = 0
HISTORY = [1, 1, 3]


def tables() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    target = torch.randn(V, V, generator=g) * 1.5  # L[c] = target logits after token c
    draft = target + torch.randn(V, V, generator=g) * 1.5  # a correlated, imperfect draft
    return target, draft


def run_step(target, draft_q, one_hot, last, hist, sp, k, gen_v, gen_d):
    """One verify step for each trial; `last` [M] is the context's last token."""
    M = last.shape[0]
    drafts, qs, rows = [], [], [target[last]]
    prev = last
    for _ in range(k):
        q = torch.softmax(draft_q[prev], dim=-1)  # [M, V]
        d = q.argmax(-1) if one_hot else torch.multinomial(q, 1, generator=gen_d).squeeze(1)
        drafts.append(d)
        qs.append(q)
        rows.append(target[d])
        prev = d
    draft_tokens = torch.stack(drafts, 1) if k else torch.zeros(M, 0, dtype=torch.int64)
    draft_probs = None if one_hot or not k else torch.stack(qs, 1)
    res = verify(torch.stack(rows, 1), draft_tokens, draft_probs, [sp] * M, hist, [gen_v] * M)
    return draft_tokens, res


CASES = {
    "penalties_q": (SamplingParams(temperature=0.9, presence_penalty=0.7, frequency_penalty=0.6), False),
    "penalties_onehot": (SamplingParams(temperature=0.9, presence_penalty=0.7, frequency_penalty=0.6), True),
    "topk_topp_q": (SamplingParams(temperature=1.3, top_k=4, top_p=0.8, presence_penalty=0.5, frequency_penalty=0.4), False),
    "topk_topp_onehot": (SamplingParams(temperature=1.3, top_k=4, top_p=0.8, presence_penalty=0.5, frequency_penalty=0.4), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_verify_is_lossless(case):
    sp, one_hot = CASES[case]
    target, draft_q = tables()
    gen_v = make_generator(SamplingParams(temperature=1.0, seed=1000 + len(case)), 0)
    gen_d = torch.Generator().manual_seed(77)

    last = torch.full((N,), PROMPT_LAST)
    drafts, res = run_step(target, draft_q, one_hot, last, [HISTORY] * N, sp, K, gen_v, gen_d)
    acc, nxt = res.accepted_len, res.next_token
    assert ((acc >= 0) & (acc <= K)).all()
    t1 = torch.where(acc >= 1, drafts[:, 0], nxt)
    t2 = torch.where(acc >= 2, drafts[:, 1], nxt)  # valid where acc >= 1
    again = (acc == 0).nonzero().squeeze(1)  # one token so far: take one more step from t1
    hist2 = [HISTORY + [t] for t in t1[again].tolist()]
    drafts2, res2 = run_step(target, draft_q, one_hot, t1[again], hist2, sp, K, gen_v, gen_d)
    t2[again] = torch.where(res2.accepted_len >= 1, drafts2[:, 0], res2.next_token)

    p1 = ref_probs(target[PROMPT_LAST].tolist(), sp, HISTORY)
    joint = [p1[a] * ref_probs(target[a].tolist(), sp, HISTORY + [a])[b] for a in range(V) for b in range(V)]
    assert_matches_distribution(torch.bincount(t1, minlength=V).tolist(), p1)
    assert_matches_distribution(torch.bincount(t1 * V + t2, minlength=V * V).tolist(), joint)
    # the drafts were neither always accepted nor always rejected, so both paths were exercised
    assert 0.05 < (acc == 0).float().mean() < 0.95 and (acc == K).any()


def test_sampled_k0_and_bonus_from_last_row():
    sp = SamplingParams(temperature=0.7, frequency_penalty=0.5)
    target, _ = tables()
    gen = make_generator(sp, 0)
    # k = 0: a plain sample from row 0
    res = verify(target[[2]].expand(N, 1, V), torch.zeros(N, 0, dtype=torch.int64), None, [sp] * N, [[2, 2]] * N, [gen] * N)
    assert res.accepted_len.eq(0).all()
    assert_matches_distribution(torch.bincount(res.next_token, minlength=V).tolist(), ref_probs(target[2].tolist(), sp, [2, 2]))
    # q == p for both drafts: every draft is accepted, the bonus follows p of row k
    p_rows = [ref_probs(target[0].tolist(), sp, []), ref_probs(target[4].tolist(), sp, [3])]
    q = torch.tensor(p_rows, dtype=torch.float32)[None].expand(N, 2, V)
    logits = torch.stack([target[0], target[4], target[5]])[None].expand(N, 3, V)
    res = verify(logits, torch.tensor([[3, 1]]).expand(N, 2), q, [sp] * N, [[]] * N, [gen] * N)
    assert res.accepted_len.float().mean() > 0.999
    bonus = res.next_token[res.accepted_len == 2]
    assert_matches_distribution(torch.bincount(bonus, minlength=V).tolist(), ref_probs(target[5].tolist(), sp, [3, 1]))


def test_verify_seeded_reproducible():
    target, draft_q = tables()
    sp = SamplingParams(temperature=1.0, seed=42)
    last = torch.arange(64) % V

    def once(seed_params: SamplingParams) -> list[list[int]]:
        gens = [make_generator(seed_params, i) for i in range(64)]
        rows = torch.stack([target[last], target[(last + 1) % V], target[(last + 2) % V]], 1)
        drafts = torch.stack([(last + 1) % V, (last + 2) % V], 1)
        res = verify(rows, drafts, None, [seed_params] * 64, [[]] * 64, gens)
        return [res.accepted_len.tolist(), res.next_token.tolist()]

    assert once(sp) == once(sp)
    assert once(sp) != once(SamplingParams(temperature=1.0, seed=43))
