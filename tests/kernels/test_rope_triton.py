"""Fused q/k norm + partial RoPE + KV store (Triton) vs the torch composition it replaces: Qwen3.5's
(rope_ref.apply_rope) and the qwen4_exp QSA layer's (YaRN-scaled cos/sin per row, the indexer's raw key)."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES  # noqa: E402

from freetoken.kernels import norm_ref, rope_triton  # noqa: E402
from freetoken.kernels.attention_ref import store_kv  # noqa: E402
from freetoken.kernels.rope_ref import apply_rope, mrope_axes, rope_freqs, rope_inv_freq  # noqa: E402
from freetoken.kernels.rope_ref import row_by_row as per_row  # noqa: E402


def make(device, dtype, n, hq=4, hkv=2, d=32, rot=16, slots=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q_gate = (torch.randn(n, hq, 2 * d, generator=gen) * 2).to(dtype).to(device)  # q is the first half of each head
    kv = (torch.randn(n, 2 * hkv * d, generator=gen) * 2).to(dtype).to(device)
    k, v = kv[:, : hkv * d].view(n, hkv, d), kv[:, hkv * d :].view(n, hkv, d)  # column slices, like the merged projection
    qw, kw = (torch.randn(d, generator=gen) * 0.3).to(dtype).to(device), (torch.randn(d, generator=gen) * 0.3).to(dtype).to(device)
    positions = torch.randint(0, 5000, (n,), generator=gen).to(device)
    slot_mapping = torch.randperm(slots, generator=gen)[:n].to(device)
    inv_freq = rope_inv_freq(rot, 1e7, device=device)
    caches = [torch.zeros(slots, hkv, d, dtype=dtype, device=device) for _ in range(2)]
    return q_gate[..., :d], k, v, qw, kw, positions, inv_freq, caches, slot_mapping


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_store_matches_reference(device, dtype):
    n = 5 if device == "cpu" else 300
    d, rot = (32, 16) if device == "cpu" else (256, 64)
    q, k, v, qw, kw, pos, inv_freq, (kc, vc), slots = make(device, dtype, n, d=d, rot=rot, slots=2 * n)
    got_q = rope_triton.norm_rope_store(q, k, v, qw, kw, 1e-6, pos, inv_freq, kc, vc, slots)
    want_q = apply_rope(norm_ref.zc_rms_norm(q, qw, 1e-6), pos, inv_freq)
    want_k = apply_rope(norm_ref.zc_rms_norm(k, kw, 1e-6), pos, inv_freq)
    kc_ref, vc_ref = torch.zeros_like(kc), torch.zeros_like(vc)
    store_kv(want_k, v, kc_ref, vc_ref, slots)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_q.float(), want_q.float(), **tol)
    torch.testing.assert_close(kc.float(), kc_ref.float(), **tol)  # untouched slots stay zero in both
    assert torch.equal(vc, vc_ref)  # v is copied, not computed
    one = rope_triton.norm_rope_store(q[2:3], k[2:3], v[2:3], qw, kw, 1e-6, pos[2:3], inv_freq, kc.clone(), vc.clone(), slots[2:3])
    assert torch.equal(one[0], got_q[2])


@pytest.mark.parametrize("device", DEVICES)
def test_norm_rope_store_hand_case(device):
    # One head, D = 4, all rotated (rot = 4), w = 0: norm([3, 4, 0, 0]) * (1 + 0) = [3, 4, 0, 0] / sqrt(25 / 4)
    # = [1.2, 1.6, 0, 0]; at position 0 cos = 1, sin = 0: unchanged. inv_freq for the hand case is [1, 1].
    q = torch.tensor([[[3.0, 4.0, 0.0, 0.0]]], device=device)
    k, v = q.clone(), torch.ones(1, 1, 4, device=device)
    w = torch.zeros(4, device=device)
    kc, vc = torch.zeros(2, 1, 4, device=device), torch.zeros(2, 1, 4, device=device)
    inv_freq = torch.ones(2, device=device)
    out = rope_triton.norm_rope_store(q, k, v, w, w, 0.0, torch.tensor([0], device=device), inv_freq, kc, vc, torch.tensor([1], device=device))
    torch.testing.assert_close(out[0, 0].cpu(), torch.tensor([1.2, 1.6, 0.0, 0.0]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kc[1, 0].cpu(), torch.tensor([1.2, 1.6, 0.0, 0.0]), rtol=1e-6, atol=1e-6)
    assert torch.equal(vc[1, 0].cpu(), torch.ones(4)) and not kc[0].any()
    # position 1 with inv_freq 1: channel 0 -> 1.2 cos1 - 0 sin1; channel 2 -> 0 cos1 + 1.2 sin1
    out = rope_triton.norm_rope_store(q, k, v, w, w, 0.0, torch.tensor([1], device=device), inv_freq, kc, vc, torch.tensor([0], device=device))
    c, s = torch.cos(torch.tensor(1.0)), torch.sin(torch.tensor(1.0))
    torch.testing.assert_close(out[0, 0].cpu(), torch.stack([1.2 * c, 1.6 * c, 1.2 * s, 1.6 * s]), rtol=1e-5, atol=1e-6)


def _three_rows(pos: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """[3, N] positions: rows 1 and 2 differ from row 0 on about half the rows (image rows), equal elsewhere."""
    rows = pos.cpu().expand(3, -1).clone()
    image = torch.rand(pos.shape[0], generator=gen) < 0.5
    rows[1:, image] += torch.randint(0, 40, (2, int(image.sum())), generator=gen)
    return rows.to(pos.device).contiguous()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_store_mrope_matches_reference(device, dtype):
    n = 6 if device == "cpu" else 300
    d, rot, section = (32, 16, (4, 2, 2)) if device == "cpu" else (256, 64, (11, 11, 10))
    q, k, v, qw, kw, pos, inv_freq, (kc, vc), slots = make(device, dtype, n, d=d, rot=rot, slots=2 * n)
    pos3 = _three_rows(pos, torch.Generator().manual_seed(1))
    got_q = rope_triton.norm_rope_store(q, k, v, qw, kw, 1e-6, pos3, inv_freq, kc, vc, slots, mrope_section=section)
    want_q = apply_rope(norm_ref.zc_rms_norm(q, qw, 1e-6), pos3, inv_freq, section)
    want_k = apply_rope(norm_ref.zc_rms_norm(k, kw, 1e-6), pos3, inv_freq, section)
    kc_ref, vc_ref = torch.zeros_like(kc), torch.zeros_like(vc)
    store_kv(want_k, v, kc_ref, vc_ref, slots)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_q.float(), want_q.float(), **tol)
    torch.testing.assert_close(kc.float(), kc_ref.float(), **tol)
    # rows whose three positions are equal get exactly the 1-D kernel's bits
    equal = (pos3 == pos3[0]).all(0)
    flat = rope_triton.norm_rope_store(q, k, v, qw, kw, 1e-6, pos3[0].contiguous(), inv_freq, kc.clone(), vc.clone(), slots)
    assert equal.any() and torch.equal(got_q[equal], flat[equal])


def test_mrope_reference_reads_the_interleaved_axes():
    # rotary_dim 12 -> 6 frequencies, section (2, 2, 2): t, h, w, t, h, w; one head, all channels rotated
    inv_freq = torch.tensor([1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125])
    x = torch.randn(1, 1, 12, generator=torch.Generator().manual_seed(0))
    pos3 = torch.tensor([[3], [5], [7]])
    freqs = torch.tensor([3.0, 5.0, 7.0, 3.0, 5.0, 7.0]) * inv_freq
    cos, sin = torch.cat([freqs, freqs]).cos(), torch.cat([freqs, freqs]).sin()
    rotated = torch.cat([-x[..., 6:], x[..., :6]], dim=-1)
    torch.testing.assert_close(apply_rope(x, pos3, inv_freq, (2, 2, 2)), x * cos + rotated * sin)
    assert torch.equal(apply_rope(x, torch.tensor([[4], [4], [4]]), inv_freq, (2, 2, 2)), apply_rope(x, torch.tensor([4]), inv_freq))


YARN_SCALE = 1.0693147180559945  # 0.1 ln 2 + 1: YaRN's attention factor at factor 2 (qwen4_exp's shape)


def _qsa_ops(q, k, v, qw, kw, pos, inv_freq, section, scale, k_cache, v_cache, slots):
    """The QSA layer's torch ops the fused launch replaces: Rotary.cos_sin (fp32 cos, sin of each row
    times the attention factor, then cast), Rotary.apply after each norm, then the K/V store (k None:
    the indexer's raw key store)."""
    axes = torch.tensor(mrope_axes(inv_freq.shape[0], section)) if pos.dim() == 2 else None
    freqs = rope_freqs(pos, inv_freq, axes)
    cos = per_row(lambda f: f.cos() * scale, freqs)
    sin = per_row(lambda f: f.sin() * scale, freqs)
    cos, sin = torch.cat([cos, cos], -1).to(q.dtype), torch.cat([sin, sin], -1).to(q.dtype)

    def apply(x):
        d, half = cos.shape[-1], cos.shape[-1] // 2
        x_rot, x_pass = x[..., :d], x[..., d:]
        rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
        return torch.cat([x_rot * cos[:, None, :] + rotated * sin[:, None, :], x_pass], dim=-1)

    q = apply(norm_ref.zc_rms_norm(q, qw, 1e-6))
    if k is None:
        v_cache[slots] = v.to(v_cache.dtype)
    else:
        store_kv(apply(norm_ref.zc_rms_norm(k, kw, 1e-6)), v, k_cache, v_cache, slots)
    return q


def _qsa_case(device, dtype, n, mrope, indexer, seed=3):
    """qwen4_exp's attention (q, k, v) or indexer (q heads, one raw key as v, no k) at its rows' 1-D or
    (t, h, w) positions; the real head layouts on a GPU (24 q / 2 KV heads of 256, 4 indexer heads of
    128, 64 rotary dims), small ones on CPU."""
    cpu = device == "cpu"
    if indexer:
        hq, hkv, d, rot = (3, 1, 24, 16) if cpu else (4, 1, 128, 64)
    else:
        hq, hkv, d, rot = (4, 2, 32, 8) if cpu else (24, 2, 256, 64)
    section = (4, 2, 2) if cpu else (11, 11, 10)
    q, k, v, qw, kw, pos, inv_freq, caches, slots = make(device, dtype, n, hq=hq, hkv=hkv, d=d, rot=rot, slots=2 * n, seed=seed)
    if mrope:
        pos = _three_rows(pos, torch.Generator().manual_seed(seed))
    if indexer:
        k = kw = caches[0] = None
    return q, k, v, qw, kw, pos, inv_freq, caches, slots, section if mrope else ()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mrope", [False, True])
@pytest.mark.parametrize("indexer", [False, True])
def test_qwen4_exp_torch_path_equals_the_qsa_ops(dtype, mrope, indexer):
    """kernels.norm_rope_store with cos_scale on the torch path gives the QSA layer's ops' bits: q, the
    key and value caches (the indexer's raw key cache)."""
    from freetoken import kernels

    q, k, v, qw, kw, pos, inv_freq, (kc, vc), slots, section = _qsa_case("cpu", dtype, 5, mrope, indexer)
    kc_ref = None if kc is None else kc.clone()
    vc_ref = vc.clone()
    want = _qsa_ops(q, k, v, qw, kw, pos, inv_freq, section, YARN_SCALE, kc_ref, vc_ref, slots)
    with kernels.torch_only():
        got = kernels.norm_rope_store(q, k, v, qw, kw, 1e-6, pos, inv_freq, kc, vc, slots, mrope_section=section, cos_scale=YARN_SCALE)
    assert torch.equal(got, want) and torch.equal(vc, vc_ref) and (kc is None or torch.equal(kc, kc_ref))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("indexer", [False, True])
def test_qwen4_exp_norm_rope_store_matches_the_qsa_ops(device, dtype, indexer):
    """The launch with YaRN's scale and mRoPE positions (COS_SCALE; the indexer's without a key,
    STORE_K off) against the QSA layer's torch ops; the raw value or key is copied exactly, and a row
    alone gets the bits it gets in the batch."""
    n = 4 if device == "cpu" else 300
    q, k, v, qw, kw, pos, inv_freq, (kc, vc), slots, section = _qsa_case(device, dtype, n, True, indexer)
    kc_ref = None if kc is None else kc.clone()
    vc_ref = vc.clone()
    want = _qsa_ops(q, k, v, qw, kw, pos, inv_freq, section, YARN_SCALE, kc_ref, vc_ref, slots)
    got = rope_triton.norm_rope_store(q, k, v, qw, kw, 1e-6, pos, inv_freq, kc, vc, slots, mrope_section=section, cos_scale=YARN_SCALE)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    if kc is not None:
        torch.testing.assert_close(kc.float(), kc_ref.float(), **tol)
    assert torch.equal(vc, vc_ref)
    one = rope_triton.norm_rope_store(q[1:2], None if k is None else k[1:2], v[1:2], qw, kw, 1e-6, pos[:, 1:2].contiguous(), inv_freq,
                                      None if kc is None else kc.clone(), vc.clone(), slots[1:2], mrope_section=section, cos_scale=YARN_SCALE)
    assert torch.equal(one[0], got[1])


def test_cos_scale_multiplies_the_rotation():
    """At position 0 (cos 1, sin 0) the rotated channels are the normed ones times the scale, the others
    untouched: norm([3, 4, 0, 0]) = [1.2, 1.6, 0, 0], rotary_dim 2, scale 2 -> [2.4, 3.2, 0, 0]; the raw
    head (no key) is stored as it is."""
    q = torch.tensor([[[3.0, 4.0, 0.0, 0.0]]])
    w = torch.zeros(4)
    raw = torch.zeros(2, 1, 4)
    out = rope_triton.norm_rope_store(q, None, q, w, None, 0.0, torch.tensor([0]), torch.ones(1), None, raw, torch.tensor([1]), cos_scale=2.0)
    torch.testing.assert_close(out[0, 0], torch.tensor([2.4, 3.2, 0.0, 0.0]), rtol=1e-6, atol=1e-6)
    assert torch.equal(raw[1, 0], q[0, 0]) and not raw[0].any()
