"""Argmax and inverse-CDF sampling over the vocabulary (Triton); oracle: `sampling_ref`.

argmax: the vocabulary of each row is split into fixed CHUNK-sized pieces, one program per
(row, chunk), so a single decode row still spreads over many SMs. Each program keeps one running
(best value, index) per lane, compared in fp32 with a strict `>`, so each lane holds the lowest index
of its maximum; NaN beats every number (torch's rule). The lanes, then the chunks (a second launch
over the [R, chunks] partials), are combined by "maximum value, then lowest index". That combine
is exact, so the result equals `torch.argmax` bit for bit whatever the split.

greedy_verify: the argmax's first launch, then one program per request that combines its k + 1 rows'
chunks as the argmax's second launch does, takes the accepted length (the drafts' leading matches)
and the next token, and writes both (and, for a one-row step that feeds its tokens forward, the
next token into `last_tokens`): a greedy CUDA-graph step ends in two launches instead of the
second argmax launch and the torch ops of `sampling.greedy_verify`.

inverse_cdf: one program per row, three passes over the row's fp32 weights: the row maximum, the
integer total of the quantized weights, then the count of integer CDF entries <= the threshold
(see `sampling_ref` for the integer scheme). All sums are int64, hence exact and order-free:
the kernel picks the same token as the torch reference for the same uniform.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels import compat_triton, pdl  # noqa: F401  (compat_triton: interpreter fix-up)
from freetoken.kernels.sampling_ref import cdf_bits

ARGMAX_BLOCK = 1024
ARGMAX_CHUNK = 8192
CDF_BLOCK = 1024


@triton.jit
def _argmax_kernel(
    x_ptr, idx_ptr, val_out_ptr, idx_out_ptr,
    N, stride_x, stride_idx,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, HAS_IDX: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    lanes = tl.arange(0, BLOCK)
    lo = chunk * CHUNK
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = lo + lanes  # a lane's first column: the answer if it never sees anything larger
    for start in range(0, CHUNK, BLOCK):
        cols = lo + start + lanes
        v = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        take = (v > best) | ((v != v) & (best == best))
        best = tl.where(take, v, best)
        best_i = tl.where(take, cols, best_i)
    is_nan = best != best
    any_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(is_nan, float("-inf"), best), axis=0)
    winner = tl.where(any_nan, is_nan, best == top)
    pos = tl.min(tl.where(winner, best_i, 2147483647), axis=0)
    value = tl.where(any_nan, float("nan"), top)
    if HAS_IDX:
        out_i = tl.load(idx_ptr + row * stride_idx + pos)
    else:
        out_i = pos.to(tl.int64)
    tl.store(val_out_ptr + row * num_chunks + chunk, value)
    tl.store(idx_out_ptr + row * num_chunks + chunk, out_i)


def _chunk_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, V] -> each ARGMAX_CHUNK-column chunk's best (value fp32, index int64), both [R, chunks]:
    the argmax's first launch (none for R = 0)."""
    r, v = x.shape
    chunks = triton.cdiv(v, ARGMAX_CHUNK)
    vals = torch.empty(r, chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(r, chunks, dtype=torch.int64, device=x.device)
    if r:
        chunk = min(ARGMAX_CHUNK, triton.next_power_of_2(v))
        _argmax_kernel[(r, chunks)](x, idx, vals, idx, v, x.stride(0), 0, CHUNK=chunk, BLOCK=min(ARGMAX_BLOCK, chunk), HAS_IDX=False,
                                    num_warps=4, **pdl.launch_kwargs())
    return vals, idx


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] (bf16/fp16/fp32) -> [R] int64: torch.argmax(x, -1), ties to the lowest index."""
    r, v = x.shape
    assert v > 0, "argmax: empty vocabulary"
    x = x if x.stride(-1) == 1 else x.contiguous()
    vals, idx = _chunk_argmax(x)
    chunks = idx.shape[1]
    if r == 0 or chunks == 1:
        return idx.view(r)
    out_val = torch.empty(r, 1, dtype=torch.float32, device=x.device)
    out_idx = torch.empty(r, 1, dtype=torch.int64, device=x.device)
    width = triton.next_power_of_2(chunks)
    _argmax_kernel[(r, 1)](vals, idx, out_val, out_idx, chunks, chunks, chunks, CHUNK=width, BLOCK=width, HAS_IDX=True, num_warps=4, **pdl.launch_kwargs())
    return out_idx.view(r)


@triton.jit
def _greedy_verify_kernel(
    val_ptr, idx_ptr, drafts_ptr, result_ptr, last_ptr,
    K1, chunks, stride_d, stride_r,
    K1_POW2: tl.constexpr, CHUNKS_POW2: tl.constexpr, FEED: tl.constexpr, PDL: tl.constexpr,
):
    pdl.sync(PDL)
    b = tl.program_id(0).to(tl.int64)
    js = tl.arange(0, K1_POW2)
    cs = tl.arange(0, CHUNKS_POW2)
    mj = js < K1
    m = mj[:, None] & (cs[None, :] < chunks)
    offs = (b * K1 + js)[:, None] * chunks + cs[None, :]
    v = tl.load(val_ptr + offs, mask=m, other=float("-inf"))  # [K1_POW2, CHUNKS_POW2]: each chunk's best
    # The argmax's combine of the chunks, row by row: NaN first, else the maximum, then the lowest chunk.
    is_nan = v != v
    any_nan = tl.max(is_nan.to(tl.int32), axis=1) > 0
    top = tl.max(tl.where(is_nan, float("-inf"), v), axis=1)
    winner = tl.where(any_nan[:, None], is_nan, v == top[:, None])
    pos = tl.min(tl.where(winner, cs[None, :], CHUNKS_POW2), axis=1)
    arg = tl.sum(tl.where(cs[None, :] == pos[:, None], tl.load(idx_ptr + offs, mask=m, other=0), 0), axis=1)  # [K1_POW2] int64
    # Accept while draft j equals the argmax of row j; the next token is the argmax of the first row that differs.
    drafts = tl.load(drafts_ptr + b * stride_d + js, mask=js < K1 - 1, other=-1)
    accepted = tl.min(tl.where((js < K1 - 1) & (drafts != arg), js, K1 - 1), axis=0)
    next_token = tl.sum(tl.where(js == accepted, arg, 0), axis=0)
    tl.store(result_ptr + b, accepted.to(tl.int64))
    tl.store(result_ptr + stride_r + b, next_token)
    if FEED:
        tl.store(last_ptr + b, next_token)


def greedy_verify(
    logits: torch.Tensor,  # [B * (k + 1), V] any float dtype (the argmax of bf16 equals that of its fp32 copy)
    drafts: torch.Tensor,  # [B, k] int64
    last_tokens: torch.Tensor | None = None,  # [>= B] int64: gets the next tokens when given
) -> torch.Tensor:  # [2, B] int64: (accepted length, next token)
    """`sampling.greedy_verify` (its accepted_len and next_token, stacked) in two launches."""
    rows, v = logits.shape
    num_seqs, k = drafts.shape
    assert rows == num_seqs * (k + 1) and v > 0, f"greedy_verify: logits {tuple(logits.shape)} for drafts {tuple(drafts.shape)}"
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    drafts = drafts if drafts.stride(-1) == 1 else drafts.contiguous()
    result = torch.empty(2, num_seqs, dtype=torch.int64, device=logits.device)
    if num_seqs == 0:
        return result
    vals, idx = _chunk_argmax(logits)
    chunks = idx.shape[1]
    feed = last_tokens is not None
    _greedy_verify_kernel[(num_seqs,)](
        vals, idx, drafts, result, last_tokens if feed else result, k + 1, chunks, drafts.stride(0), result.stride(0),
        K1_POW2=triton.next_power_of_2(k + 1), CHUNKS_POW2=triton.next_power_of_2(chunks), FEED=feed, num_warps=4, **pdl.launch_kwargs(),
    )
    return result


@triton.jit
def _quantize(w, scale):
    return (w.to(tl.float64) * scale).to(tl.int64)


@triton.jit
def _inverse_cdf_kernel(w_ptr, u_ptr, out_ptr, V, stride_w, BITS, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    base = w_ptr + row * stride_w
    lanes = tl.arange(0, BLOCK)

    peak = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + lanes
        peak = tl.maximum(peak, tl.load(base + cols, mask=cols < V, other=0.0))
    m = tl.max(peak, axis=0).to(tl.float64)
    # 2^(BITS - E) where m = mantissa * 2^E, mantissa in [0.5, 1): built from m's fp64 exponent field
    e = ((m.to(tl.int64, bitcast=True) >> 52) & 0x7FF) - 1022
    scale = ((BITS - e + 1023) << 52).to(tl.float64, bitcast=True)
    scale = tl.where(m > 0, scale, 0.0)

    total = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + lanes
        total += _quantize(tl.load(base + cols, mask=cols < V, other=0.0), scale)
    total_s = tl.sum(total, axis=0)
    u = tl.load(u_ptr + row)
    t = tl.minimum((u * total_s.to(tl.float64)).to(tl.int64), total_s - 1)

    below = tl.zeros([BLOCK], dtype=tl.int64)  # lanes whose CDF entry is <= t
    prefix = tl.full([], 0, tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + lanes
        q = _quantize(tl.load(base + cols, mask=cols < V, other=0.0), scale)
        cdf = prefix + tl.cumsum(q, axis=0)
        below += ((cdf <= t) & (cols < V)).to(tl.int64)
        prefix += tl.sum(q, axis=0)
    tl.store(out_ptr + row, tl.sum(below, axis=0))


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights [R, V] fp32 (finite, >= 0, unnormalized), u [R] fp64 in [0, 1) -> [R] int64 draws."""
    assert weights.dtype == torch.float32, f"inverse_cdf: weights are {weights.dtype}, expected float32"
    r, v = weights.shape
    out = torch.empty(r, dtype=torch.int64, device=weights.device)
    if r == 0:
        return out
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    u = u.to(device=weights.device, dtype=torch.float64).contiguous()
    block = min(CDF_BLOCK, triton.next_power_of_2(v))
    _inverse_cdf_kernel[(r,)](weights, u, out, v, weights.stride(0), cdf_bits(v), BLOCK=block, num_warps=4, **pdl.launch_kwargs())
    return out
