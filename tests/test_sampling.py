"""sampling.py against hand-computed values and a plain-Python per-row reference.

The reference (`ref_process`) is written from the definitions, in float64, one row at a time:
presence subtracts once per distinct generated token, frequency subtracts count * penalty,
temperature divides, top-k keeps the k largest (ties to the lower id), top-p keeps the smallest
prefix of the descending distribution with mass >= p (at least one token).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from freetoken.errors import FreetokenError
from freetoken.kernels import sampling_ref
from freetoken.sampling import SamplingParams, apply_stop, make_generator, probs, process_logits, sample


def ref_process(row: list[float], sp: SamplingParams, history: list[int]) -> list[float]:
    x = [float(v) for v in row]
    for t, c in Counter(history).items():
        x[t] -= c * sp.frequency_penalty + sp.presence_penalty
    if sp.temperature == 0:
        return x
    x = [v / sp.temperature for v in x]
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    kept = order[: sp.top_k] if sp.top_k > 0 else order
    if sp.top_p < 1:
        m = max(x[i] for i in kept)
        z = sum(math.exp(x[i] - m) for i in kept)
        nucleus, mass = [], 0.0
        for i in kept:
            if mass >= sp.top_p:
                break
            nucleus.append(i)
            mass += math.exp(x[i] - m) / z
        kept = nucleus
    keep = set(kept)
    return [v if i in keep else -math.inf for i, v in enumerate(x)]


def ref_probs(row: list[float], sp: SamplingParams, history: list[int]) -> list[float]:
    x = ref_process(row, sp, history)
    if sp.temperature == 0:
        best = max(range(len(x)), key=lambda i: (x[i], -i))
        return [1.0 if i == best else 0.0 for i in range(len(x))]
    m = max(x)
    e = [math.exp(v - m) for v in x]
    return [v / sum(e) for v in e]


def chi2_critical(df: int, z: float = 4.265) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z = 4.265 is a 1e-5 tail."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_matches_distribution(counts: list[int], expected: list[float]) -> None:
    n = sum(counts)
    for c, p in zip(counts, expected):
        assert p > 0 or c == 0, "a token of probability 0 was sampled"
    cells = [(c, p * n) for c, p in zip(counts, expected) if p * n >= 5]
    rest_c, rest_e = n - sum(c for c, _ in cells), n - sum(e for _, e in cells)
    if rest_e > 1e-9:
        cells.append((rest_c, rest_e))
    stat = sum((c - e) ** 2 / e for c, e in cells)
    assert stat < chi2_critical(len(cells) - 1), f"chi2 {stat:.1f} over {len(cells) - 1} dof"


MIXED = [
    SamplingParams(),
    SamplingParams(presence_penalty=0.8, frequency_penalty=0.3),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=7),
    SamplingParams(temperature=0.9, top_p=0.6),
    SamplingParams(temperature=0.5, top_k=40, top_p=0.85, presence_penalty=-0.4, frequency_penalty=0.6),
    SamplingParams(frequency_penalty=2.0),
]


def mixed_histories(V: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in (0, 9, 3, 0, 5, 30, 12)]


def test_params_validation():
    for bad in (
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(max_new_tokens=0),
    ):
        with pytest.raises(FreetokenError):
            SamplingParams(**bad)
    assert SamplingParams().is_greedy and not SamplingParams(temperature=0.2).is_greedy


def test_penalties_hand_computed():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = process_logits(logits, [sp], [[3, 3, 1]])
    assert out.dtype == torch.float32
    assert out.tolist() == [[1.0, 1.25, 3.0, 3.0]]
    # greedy on the penalized row: 2 and 3 tie at 3.0 -> the lower id
    assert sample(logits, [sp], [[3, 3, 1]], [None]).tolist() == [2]
    assert probs(logits, [sp], [[3, 3, 1]]).tolist() == [[0.0, 0.0, 1.0, 0.0]]


def test_top_k_top_p_hand_computed():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))
    # top-p 0.65: 0.4 falls short, 0.4 + 0.3 reaches it -> tokens 1, 3
    p = probs(logits, [SamplingParams(temperature=1.0, top_p=0.65)], [[]])
    torch.testing.assert_close(p, torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7]]))
    # top-k 1 -> only the max; top_p tiny -> still at least one token
    for sp in (SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=1.0, top_p=0.01)):
        assert probs(logits, [sp], [[]]).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    # temperature 0.5 squares the odds: 1:16:4:9 over 30
    p = probs(logits, [SamplingParams(temperature=0.5)], [[]])
    torch.testing.assert_close(p, torch.tensor([[1 / 30, 16 / 30, 4 / 30, 9 / 30]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_process_logits_matches_reference(dtype):
    V = 64
    logits = (torch.randn(len(MIXED), V, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    hist = mixed_histories(V)
    out = process_logits(logits, MIXED, hist)
    assert out.dtype == torch.float32 and out.shape == (len(MIXED), V)
    for r, sp in enumerate(MIXED):
        ref = torch.tensor(ref_process(logits[r].float().tolist(), sp, hist[r]), dtype=torch.float64)
        assert torch.equal(torch.isinf(out[r]), torch.isinf(ref)), f"row {r}: kept set differs"
        finite = ~torch.isinf(ref)
        torch.testing.assert_close(out[r][finite].double(), ref[finite], rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(probs(logits[r : r + 1], [sp], [hist[r]])[0].double(),
                                   torch.tensor(ref_probs(logits[r].float().tolist(), sp, hist[r]), dtype=torch.float64),
                                   rtol=1e-5, atol=1e-6)


def test_row_invariance():
    V = 5000
    logits = (torch.randn(len(MIXED), V, generator=torch.Generator().manual_seed(2)) * 4).to(torch.bfloat16)
    hist = mixed_histories(V)
    batch = process_logits(logits, MIXED, hist)
    batch_p = probs(logits, MIXED, hist)
    gens = [make_generator(sp, i) for i, sp in enumerate(MIXED)]
    batch_s = sample(logits, MIXED, hist, gens)
    gens = [make_generator(sp, i) for i, sp in enumerate(MIXED)]
    for r, sp in enumerate(MIXED):
        assert torch.equal(process_logits(logits[r : r + 1], [sp], [hist[r]])[0], batch[r])
        assert torch.equal(probs(logits[r : r + 1], [sp], [hist[r]])[0], batch_p[r])
        assert sample(logits[r : r + 1], [sp], [hist[r]], [gens[r]]).item() == batch_s[r].item()


def test_sample_distribution():
    V, N = 8, 20000
    row = [0.3, 1.2, -0.5, 2.0, 0.9, 1.1, -1.0, 0.0]
    sp = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3)
    hist = [3, 3, 5]
    g = make_generator(SamplingParams(temperature=1.0, seed=123), 0)
    tokens = sample(torch.tensor([row] * N), [sp] * N, [hist] * N, [g] * N)
    counts = torch.bincount(tokens, minlength=V).tolist()
    assert_matches_distribution(counts, ref_probs(row, sp, hist))


def test_seeds():
    V, R = 1000, 50
    logits = torch.zeros(R, V)
    hist = [[]] * R

    def draw(sp: SamplingParams, request_index: int, global_seed: int = 0) -> list[int]:
        g = make_generator(sp, request_index, "cpu", global_seed=global_seed)
        return sample(logits, [sp] * R, hist, [g] * R).tolist()

    s7, s8 = SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0, seed=8)
    assert draw(s7, 0) == draw(s7, 5)  # an explicit seed ignores the request's position
    assert draw(s7, 0) != draw(s8, 0)
    free = SamplingParams(temperature=1.0)
    assert draw(free, 3) == draw(free, 3)
    assert draw(free, 3) != draw(free, 4)
    assert draw(free, 3) != draw(free, 3, global_seed=1)
    assert make_generator(SamplingParams(), 0) is None


def test_apply_stop():
    sp = SamplingParams(max_new_tokens=10, stop_token_ids=(7,))
    assert apply_stop([1, 2, 3], sp, {0}, 0) == ([1, 2, 3], False)
    assert apply_stop([1, 0, 3], sp, {0}, 0) == ([1, 0], True)  # EOS kept, rest cut
    assert apply_stop([7, 0], sp, {0}, 0) == ([7], True)
    assert apply_stop([1, 2, 3, 4], sp, {0}, 8) == ([1, 2], True)  # 8 + 2 = max_new_tokens
    assert apply_stop([1, 2], sp, {0}, 8) == ([1, 2], True)
    assert apply_stop([1], sp, {0}, 10) == ([], True)
    ignore = SamplingParams(max_new_tokens=10, stop_token_ids=(7,), ignore_eos=True)
    assert apply_stop([0, 1, 7, 2], ignore, {0}, 0) == ([0, 1, 7], True)  # stop ids still apply


def test_integer_cdf_hand_computed():
    assert sampling_ref.cdf_bits(248320) == 44 and sampling_ref.cdf_bits(4) == 60
    # max 2 = 0.5 * 2^2 -> scale 2^(60 - 2); 0.75 = 0.75 * 2^0 -> 3 * 2^56
    q = sampling_ref.quantize(torch.tensor([[1.0, 0.0, 2.0, 0.75], [0.0] * 4]))
    assert q.tolist() == [[2**58, 0, 2**59, 3 * 2**56], [0] * 4]


def test_integer_cdf_agrees_with_float64_search():
    """Away from interval boundaries the integer CDF picks what a float64 cumsum + search picks."""
    g = torch.Generator().manual_seed(3)
    w = torch.softmax(torch.randn(64, 2000, generator=g) * 4, dim=-1)
    w[::3, ::2] = 0.0
    u = torch.rand(64, generator=g, dtype=torch.float64)
    cdf = torch.cumsum(w.double(), dim=-1)
    float_pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    got = sampling_ref.inverse_cdf(w, u)
    assert torch.equal(got, float_pick)
    assert (w.gather(1, got[:, None]) > 0).all()
