"""Per-head zero-centred RMSNorm + partial NeoX RoPE for q and k, and the KV-cache store (Triton).

One launch replaces the attention layer's q_norm, k_norm, two rotations and the two cache writes.
Program (r, j) takes row r and head j of [q heads | k heads]: it normalises the head in fp32,
multiplies by (1 + w) and rounds to the input dtype (as `zc_rms_norm`), then rotates the first
rotary_dim channels (channel i pairs with i + rotary_dim / 2) with cos/sin of position * inv_freq
rounded to the input dtype, each product and the sum rounded as in `rope_ref.apply_rope`; with MROPE
the row has three positions (t, h, w) pos_stride apart and frequency i reads the one
`rope_ref.mrope_axes` names (the h row for i % 3 == 1, i < 3 * S_H; the w row for i % 3 == 2,
i < 3 * S_W; else t), a gather whose result equals the 1-D one when the three are equal. A k head
is written straight into the key cache at the row's slot, and the program of k head j also copies
v head j into the value cache. Rows are independent: nothing depends on the batch.

Two constexprs serve qwen4_exp and leave the Qwen3.5 build as it is at their defaults: COS_SCALE
multiplies the fp32 cos and sin before their rounding (YaRN's attention factor, as
`rope_ref.scaled_cos_sin`), and STORE_K False stores no key: the launch norms and rotates the q heads
and copies one raw head per row (its "v") into a cache (the QSA indexer's queries and raw key).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels import compat_triton, l2_prefetch, pdl

NUM_WARPS = 4  # of the fused q/k norm + RoPE + cache write; 2 or 8 the same within noise in the 35B-A3B step (logs/variants-35b-small-kernels.jsonl)


@triton.jit
def _norm_rope_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, pos_ptr, inv_freq_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    Hq, D, eps,
    q_row, q_head, k_row, k_head, v_row, v_head, qo_row, qo_head, cache_slot, cache_head, pf_ptr, pf_lines, num_rows, pos_stride,
    ROT: tl.constexpr, D_PAD: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
    MROPE: tl.constexpr = False, S_H: tl.constexpr = 0, S_W: tl.constexpr = 0, COS_SCALE: tl.constexpr = 1.0, STORE_K: tl.constexpr = True,
):
    if PREFETCH:  # the programs past the launch's rows prefetch the next GEMM's weight (l2_prefetch)
        if tl.program_id(0) >= num_rows:
            l2_prefetch.run(pf_ptr, pf_lines, num_rows, PDL)
            return
    pdl.sync(PDL)
    r = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    ds = tl.arange(0, D_PAD)
    md = ds < D
    half = ROT // 2
    partner = tl.where(ds < half, ds + half, ds - half)
    is_q = j < Hq
    if is_q:
        src = q_ptr + r * q_row + j * q_head
        w_ptr = qw_ptr
    else:
        src = k_ptr + r * k_row + (j - Hq) * k_head
        w_ptr = kw_ptr
    x_raw = tl.load(src + ds, mask=md, other=0.0)
    x = x_raw.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + ds, mask=md, other=0.0).to(tl.float32)
    y = (x * rstd * (1.0 + w)).to(x_raw.dtype)
    rot = ds < ROT
    xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    yp = (xp * rstd * (1.0 + wp)).to(x_raw.dtype).to(tl.float32)
    yp = tl.where(ds < half, -yp, yp)  # rotate_half: [-x2, x1]
    fi = ds % half
    if MROPE:
        axis = tl.where((fi % 3 == 1) & (fi < 3 * S_H), 1, tl.where((fi % 3 == 2) & (fi < 3 * S_W), 2, 0))
        pos = tl.load(pos_ptr + axis * pos_stride + r).to(tl.float32)
    else:
        pos = tl.load(pos_ptr + r).to(tl.float32)
    freq = pos * tl.load(inv_freq_ptr + fi, mask=rot, other=0.0)
    if COS_SCALE != 1.0:
        cos = (tl.cos(freq) * COS_SCALE).to(x_raw.dtype).to(tl.float32)
        sin = (tl.sin(freq) * COS_SCALE).to(x_raw.dtype).to(tl.float32)
    else:
        cos = tl.cos(freq).to(x_raw.dtype).to(tl.float32)
        sin = tl.sin(freq).to(x_raw.dtype).to(tl.float32)
    a = compat_triton.mul_rn(y.to(tl.float32), cos).to(x_raw.dtype).to(tl.float32)  # rounded alone, not fused into the sum
    b = compat_triton.mul_rn(yp, sin).to(x_raw.dtype).to(tl.float32)
    out = tl.where(rot, (a + b).to(x_raw.dtype), y)
    if is_q:
        tl.store(q_out_ptr + r * qo_row + j * qo_head + ds, out, mask=md)
    else:
        slot = tl.load(slot_ptr + r).to(tl.int64)
        kv = j - Hq
        dst = slot * cache_slot + kv * cache_head + ds
        if STORE_K:
            tl.store(k_cache_ptr + dst, out.to(k_cache_ptr.dtype.element_ty), mask=md)
        v = tl.load(v_ptr + r * v_row + kv * v_head + ds, mask=md, other=0.0)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=md)


def norm_rope_store(
    q: torch.Tensor,  # [N, Hq, D] (any row/head strides)
    k: torch.Tensor | None,  # [N, Hkv, D]; None: no key (v is stored raw, k_weight and k_cache unused)
    v: torch.Tensor,  # [N, Hkv, D]
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor | None,  # [D]
    eps: float,
    positions: torch.Tensor,  # [N], or [3, N] (t, h, w) with mrope_section
    inv_freq: torch.Tensor,  # [rotary_dim / 2] fp32
    k_cache: torch.Tensor | None,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    slot_mapping: torch.Tensor,  # [N]
    prefetch: l2_prefetch.Span | None = None,
    mrope_section: tuple[int, ...] = (),
    cos_scale: float = 1.0,
) -> torch.Tensor:
    """Normed, rotated q [N, Hq, D] (contiguous); normed, rotated k and raw v land in the caches.
    cos_scale multiplies the fp32 cos and sin before they are rounded. prefetch: queued by extra
    programs of the launch (l2_prefetch)."""
    n, hq, d = q.shape
    store_k = k is not None
    if not store_k:  # the key programs read v in k's place and skip the key store
        k, k_weight, k_cache = v, q_weight, v_cache
    hkv = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and positions.stride(-1) == 1
    q_out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    if n == 0:
        return q_out
    extra, pf_args = l2_prefetch.launch_args(prefetch, hq + hkv, q_out)
    mrope = {"MROPE": True, "S_H": mrope_section[1], "S_W": mrope_section[2]} if positions.dim() == 2 else {}
    variant = ({"COS_SCALE": cos_scale} if cos_scale != 1.0 else {}) | ({} if store_k else {"STORE_K": False})
    _norm_rope_kernel[(n + extra, hq + hkv)](
        q, k, v, q_weight, k_weight, positions, inv_freq, slot_mapping, q_out, k_cache, v_cache,
        hq, d, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), num_rows=n, pos_stride=positions.stride(0) if positions.dim() == 2 else 0, **pf_args, **mrope, **variant,
        ROT=2 * inv_freq.shape[0], D_PAD=triton.next_power_of_2(d), num_warps=NUM_WARPS, **pdl.launch_kwargs(),
    )
    return q_out
