"""Triton argmax and inverse-CDF sampler vs torch.argmax, the torch reference and hand-computed values.

Oracles: `torch.argmax` on the same device (random rows, ties, -inf, all dtypes); hand-computed
indices where torch's behaviour is not the point (NaN); `sampling_ref.inverse_cdf` for exact token
equality on the same uniforms; hand-computed interval boundaries; and the known distribution
itself: evenly spaced uniforms u_j = (j + 1/2) / N must land in token i between N p_i - 1 and
N p_i + 1 times (a total-variation bound of V / 2N), and a chi-square test over seeded draws
(300 under the CPU interpreter, 4000 on a GPU; tests/test_sampling.py draws 20000 through the
torch path, which the kernel equals token for token). Under the interpreter each program costs
milliseconds, so shapes stay small there (a second argmax chunk still appears at V > 8192).
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES  # noqa: E402
from tests.test_sampling import assert_matches_distribution  # noqa: E402

import freetoken.kernels  # noqa: E402
from freetoken import sampling  # noqa: E402
from freetoken.kernels import sampling_ref, sampling_triton  # noqa: E402
from freetoken.sampling import SamplingParams, make_generator  # noqa: E402

NEG = float("-inf")


def vocab_sizes(device):
    # not multiples of the block; 9000 spans two argmax chunks of 8192
    return [5, 1000, 9000] if device == "cpu" else [5, 1000, 9000, 151936, 248320]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_matches_torch(device, dtype):
    gen = torch.Generator().manual_seed(0)
    for v in vocab_sizes(device):
        x = (torch.randn(3, v, generator=gen) * 4).to(dtype)
        x[1, torch.randint(0, v, (v // 3,), generator=gen)] = NEG
        x = x.to(device)
        got = sampling_triton.argmax(x)
        assert got.dtype == torch.int64 and got.shape == (3,)
        assert torch.equal(got, torch.argmax(x, dim=-1)), f"V={v}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_ties_and_infinities(device, dtype):
    v = 9000
    x = torch.randn(7, v, generator=torch.Generator().manual_seed(1))
    x[0, [1029, 5, 8200]] = 50.0  # same lane (5, 1029) and the second chunk: lowest wins
    x[1, [8999, 8192]] = 50.0  # both maxima in the second chunk
    x[2] = NEG  # all -inf -> 0
    x[3] = NEG
    x[3, 7777] = -1e30
    x[4] = 0.0  # all equal -> 0
    x[4, 3000] = -0.0  # -0 == +0: still 0
    x[5, :] = NEG
    x[5, [4000, 300]] = float("inf")
    x[6] = 1.0
    x = x.to(dtype).to(device)
    got = sampling_triton.argmax(x)
    assert got.tolist() == [5, 8192, 0, 7777, 0, 300, 0]
    assert torch.equal(got, torch.argmax(x, dim=-1))


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_nan_counts_as_maximum(device):
    x = torch.zeros(3, 9000)
    x[0, [700, 20]] = float("nan")
    x[0, 5] = float("inf")
    x[1, [8500, 8300]] = float("nan")
    x[2, 4] = 3.0
    assert sampling_triton.argmax(x.to(device)).tolist() == [20, 8300, 4]


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_strided_and_empty(device):
    x = torch.randn(4, 3, 1000, generator=torch.Generator().manual_seed(2)).to(device)
    rows = x[:, 1]  # row stride 3000
    assert torch.equal(sampling_triton.argmax(rows), rows.argmax(-1))
    cols = x[:, :, ::2].reshape(4, -1)[:2]  # copied; and a non-unit inner stride
    assert torch.equal(sampling_triton.argmax(x[0, :, ::2]), x[0, :, ::2].argmax(-1))
    assert torch.equal(sampling_triton.argmax(cols), cols.argmax(-1))
    assert sampling_triton.argmax(torch.empty(0, 10, device=device)).shape == (0,)


def weight_rows(v: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of the kinds the sampler meets: softmax rows, sparse rows, residual-like tiny rows, zero rows."""
    w = torch.softmax(torch.randn(8, v, generator=gen) * 3, dim=-1)
    w[1, ::2] = 0.0  # only odd tokens possible
    w[2] = 0.0  # zero total -> 0
    w[3] *= 1e-30  # tiny scale: fixed point is relative to the row maximum
    w[4] = torch.rand(v, generator=gen) * 1e-40  # subnormal fp32
    w[5] = 0.0
    w[5, v - 1] = 0.25  # one possible token
    w[6] = torch.softmax(torch.randn(v, generator=gen) * 30, dim=-1)  # peaked, many underflow to 0
    return w


@pytest.mark.parametrize("device", DEVICES)
def test_inverse_cdf_equals_reference(device):
    gen = torch.Generator().manual_seed(3)
    for v in [5, 1000, 3000] if device == "cpu" else [5, 1000, 3000, 248320]:
        w = weight_rows(v, gen)
        for u in (torch.rand(8, generator=gen, dtype=torch.float64), torch.tensor([0.0, 1 - 2**-53] * 4, dtype=torch.float64)):
            got = sampling_triton.inverse_cdf(w.to(device), u.to(device))
            ref = sampling_ref.inverse_cdf(w, u)
            assert got.dtype == torch.int64 and torch.equal(got.cpu(), ref), f"V={v}"
            assert (w[torch.arange(8), ref] > 0).tolist() == [True, True, False, True, True, True, True, True]
            assert ref[2] == 0 and ref[5] == v - 1 and ref[1] % 2 == 1


@pytest.mark.parametrize("device", DEVICES)
def test_inverse_cdf_boundaries_hand_computed(device):
    # weights 1 : 1 : 2 (exact in fixed point): token 0 on [0, 1/4), 1 on [1/4, 1/2), 2 on [1/2, 1)
    w = torch.tensor([[1.0, 1.0, 2.0]]).expand(6, 3)
    u = torch.tensor([0.0, 0.25 - 2**-54, 0.25, 0.5 - 2**-54, 0.5, 1 - 2**-53], dtype=torch.float64)
    want = [0, 0, 1, 1, 2, 2]
    assert sampling_ref.inverse_cdf(w, u).tolist() == want
    assert sampling_triton.inverse_cdf(w.to(device), u.to(device)).tolist() == want


P = [0.05, 0.2, 0.0, 0.1, 0.3, 0.0, 0.15, 0.2]


@pytest.mark.parametrize("device", DEVICES)
def test_inverse_cdf_stratified_uniforms_hit_the_distribution(device):
    n = 200 if device == "cpu" else 20000
    w = torch.tensor(P).expand(n, len(P)).contiguous() * 3.7  # unnormalized
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    counts = torch.bincount(sampling_triton.inverse_cdf(w.to(device), u.to(device)).cpu(), minlength=len(P))
    for c, p in zip(counts.tolist(), P):
        assert abs(c - n * p) <= 1, f"{counts.tolist()} vs {[n * p for p in P]}"


@pytest.mark.parametrize("device", DEVICES)
def test_inverse_cdf_seeded_draws_chi_square(device):
    n = 300 if device == "cpu" else 4000
    w = torch.tensor(P).expand(n, len(P)).contiguous()
    u = torch.rand(n, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    tokens = sampling_triton.inverse_cdf(w.to(device), u.to(device)).cpu()
    assert_matches_distribution(torch.bincount(tokens, minlength=len(P)).tolist(), P)


def test_dispatch_samples_the_same_tokens_as_torch(monkeypatch):
    """sample / probs / verify through the Triton kernels (CPU interpreter) equal the torch path exactly."""
    v, k = 300, 2
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.5),
        SamplingParams(frequency_penalty=1.0),
        SamplingParams(temperature=1.2, top_k=20, frequency_penalty=0.4),
    ]
    hist = [[1, 2], [5], [], [7, 7]]
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, k + 1, v, generator=gen) * 3
    logits[0, :, [10, 11]] = 20.0  # a tie for the greedy request
    drafts = torch.randint(0, v, (4, k), generator=gen)
    drafts[0] = 10
    q = torch.softmax(torch.randn(4, k, v, generator=gen), dim=-1)

    def run(mode):
        monkeypatch.setattr(freetoken.kernels, "MODE", mode)
        gens = [make_generator(sp, i) for i, sp in enumerate(params)]
        s = sampling.sample(logits[:, 0], params, hist, gens)
        p = sampling.probs(logits[:, 0], params, hist)
        out = [s, p]
        for dp in (None, q):
            r = sampling.verify(logits, drafts, dp, params, hist, gens)
            out += [r.accepted_len, r.next_token]
        return out

    torch_out, triton_out = run("torch"), run("triton")
    assert torch_out[0][0] == 10 and torch_out[2][0] == 2  # greedy: tie -> 10, both drafts accepted
    for a, b in zip(torch_out, triton_out):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_verify_matches_torch(device, k, dtype):
    """The two-launch greedy verify vs torch.argmax and the accept rule written out: drafts matching
    0..k leading rows, a maximum tied across the two chunks (the lower index wins), a NaN row; the
    next tokens also land in last_tokens."""
    num_seqs, v = 4, 9000
    gen = torch.Generator().manual_seed(k)
    logits = torch.randn(num_seqs * (k + 1), v, generator=gen).to(dtype)
    logits[0, [100, 8500]] = 50.0  # a tie across chunks
    logits[-1, 8300] = float("nan")
    argmax = torch.argmax(logits.float(), dim=-1).view(num_seqs, k + 1)
    assert argmax[0, 0] == 100 and argmax[-1, -1] == 8300
    drafts = argmax[:, :k].clone()
    for b in range(num_seqs):  # sequence b matches its first min(b, k) drafts
        if b < k:
            drafts[b, b] = (argmax[b, b] + 1) % v
    last_tokens = torch.full((num_seqs + 2,), -7, dtype=torch.int64, device=device)
    got = sampling_triton.greedy_verify(logits.to(device), drafts.to(device), last_tokens)
    accepted = torch.tensor([min(b, k) for b in range(num_seqs)])
    want = torch.stack([accepted, argmax[torch.arange(num_seqs), accepted]])
    assert torch.equal(got.cpu(), want)
    assert torch.equal(last_tokens[:num_seqs].cpu(), want[1]) and (last_tokens[num_seqs:] == -7).all()
    torch_path = sampling.greedy_verify(logits.view(num_seqs, k + 1, v), drafts)
    assert torch.equal(torch.stack([torch_path.accepted_len, torch_path.next_token]), want)
