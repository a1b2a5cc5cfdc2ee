"""The one dispatch point for every op the model runs.

Each op has a plain-torch reference (`*_ref.py`, `batched.py`: the CPU path and the test oracle) and,
for the hot ops, a Triton kernel (`*_triton.py`). Callers never import a backend module directly.
The backend is chosen per call: Triton when the tensors are on CUDA, triton imports and
`FREETOKEN_KERNELS` (auto | torch | triton, read once) is not "torch"; otherwise the reference.
`FREETOKEN_KERNELS=triton` also runs the kernels on CPU tensors under `TRITON_INTERPRET=1`, and
raises if triton is missing.

Row invariance is a contract of every op here: the result for one row (token) depends only on that
row's inputs and its own context, never on how many rows share the call or which requests they
belong to. Speculative decoding's exactness rests on it (DESIGN.md, invariant 5).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import TYPE_CHECKING

import torch

from freetoken.errors import FreetokenError
from freetoken.kernels import activation_ref, batched, linear_ref, norm_ref
from freetoken.kernels.attention_ref import store_kv
from freetoken.kernels.batched import SeqBatch, seq_batch
from freetoken.kernels.rope_ref import apply_rope, mrope_axes, rotate, scaled_cos_sin

if TYPE_CHECKING:
    from freetoken.kernels.l2_prefetch import Span
    from freetoken.kernels.linear_triton import PendingSplitK
    from freetoken.kernels.moe_exit_triton import PendingCombine
    from freetoken.kernels.moe_route_triton import RowBlocks

MODE = os.environ.get("FREETOKEN_KERNELS", "auto")
FUSE_MOE_ENTRY = True  # SparseMoE enters through moe_add_norm_route (False: add+norm, gates linear, route; for A/B timing)
# Embedding, fed-back tokens and greedy verify as Triton kernels, greedy graphs' logits left bf16
# (False: torch). 35B-A3B decode step cut to 24 layers on an H100: 1.844 / 1.839 ms with them against
# 1.855 / 1.848 (logs/variants-35b-l24-switches-e0ac495-h100.jsonl).
TRITON_STEP_GLUE = True
_torch_only_depth = 0  # > 0 inside `torch_only()`


@contextlib.contextmanager
def torch_only():
    """Run every op inside on its torch reference, CUDA tensors included (e.g. a test's common starting
    state before the Triton path). Not thread-safe; nests."""
    global _torch_only_depth
    _torch_only_depth += 1
    try:
        yield
    finally:
        _torch_only_depth -= 1


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on tensor `t` runs its Triton kernel."""
    if MODE not in ("auto", "torch", "triton"):
        raise FreetokenError(f"FREETOKEN_KERNELS={MODE!r}: expected auto, torch or triton")
    if MODE == "torch" or _torch_only_depth:
        return False
    if MODE == "triton" and not _triton_importable():
        raise FreetokenError("FREETOKEN_KERNELS=triton: the triton package is not importable")
    if t.is_cuda:
        return _triton_importable()
    return MODE == "triton" and os.environ.get("TRITON_INTERPRET", "0") == "1"


def linear(x: torch.Tensor, weight: torch.Tensor, defer_sum: bool = False) -> "torch.Tensor | PendingSplitK":
    """x [M, K] @ weight [N, K]^T -> [M, N]; row-invariant. defer_sum: on the Triton path a split-K
    launch at decode sizes may return its slices' partials, which only `add_zc_rms_norm` and
    `moe_add_norm_route` take (they add them, with the same bits)."""
    if use_triton(x):
        from freetoken.kernels import linear_triton

        return linear_triton.linear(x, weight, defer_sum=defer_sum)
    return linear_ref.linear(x, weight)


def linear_conv(x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, conv_weight: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
    """A GDN decode step's input projection with its convolution (Triton only): x [M, K] (one row per
    sequence) @ weight [N, K]^T -> [M, N] whose first C features are silu(conv) over the windows
    [slots, 3, C] of `slots` [M] (advanced in place; conv_weight [C, 4]), as `linear` then
    `causal_conv1d_batched` give them. None where the fused launch does not apply (call those two)."""
    from freetoken.kernels import linear_triton

    return linear_triton.linear_conv(x, weight, windows, conv_weight, slots) if linear_triton.conv_fusable(x, weight, windows, conv_weight) else None


def l2_span(weight: torch.Tensor | None, x: torch.Tensor, site: str) -> "Span | None":
    """The L2 prefetch of `weight` that a latency-bound launch over rows x [N, ...] queues for the GEMM
    after it, at `site` ("out_proj", "input" or "mlp": kernels/l2_prefetch.py); None off the Triton
    CUDA path, for many rows, or where the site is off. Only the launches that take a `prefetch` use it."""
    if not (x.is_cuda and use_triton(x)):
        return None
    from freetoken.kernels import l2_prefetch

    return l2_prefetch.span(weight, x.shape[0], l2_prefetch.site_bytes(site))


def zc_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm(x) * (1 + w); x [..., D], weight [D]."""
    if use_triton(x):
        from freetoken.kernels import norm_triton

        return norm_triton.zc_rms_norm(x, weight, eps)
    return norm_ref.zc_rms_norm(x, weight, eps)


def grouped_zc_rms_norm(x: torch.Tensor, weight: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """norm(x) * (1 + w) with one RMS per `group`-wide slice; x [..., G * group], weight [G * group]."""
    if use_triton(x):
        from freetoken.kernels import norm_triton

        return norm_triton.grouped_zc_rms_norm(x, weight, group, eps)
    return norm_ref.grouped_zc_rms_norm(x, weight, group, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * norm(x); x [..., D], weight [D]."""
    if use_triton(x):
        from freetoken.kernels import norm_triton

        return norm_triton.rms_norm(x, weight, eps)
    return norm_ref.rms_norm(x, weight, eps)


def add_zc_rms_norm(x: "torch.Tensor | PendingCombine | PendingSplitK", residual: torch.Tensor, weight: torch.Tensor, eps: float, prefetch: "Span | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, norm(s) * (1 + w)) with s = x + residual; x, residual [N, D]. x may be a MoE block's output
    whose combine was deferred (`moe_experts_with_shared`) or a linear's whose slices' sum was
    (`linear`): then this launch finishes it too. prefetch: `l2_span`'s, queued by the launch."""
    if not isinstance(x, torch.Tensor):
        return x.add_zc_rms_norm(residual, weight, eps, prefetch)
    if use_triton(x):
        from freetoken.kernels import norm_triton

        return norm_triton.add_zc_rms_norm(x, residual, weight, eps, prefetch)
    return norm_ref.add_zc_rms_norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [N, 2I] = [gate | up] -> [N, I]."""
    if use_triton(gate_up):
        from freetoken.kernels import norm_triton

        return norm_triton.silu_mul(gate_up)
    return norm_ref.silu_mul(gate_up)


def embedding(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """weight[ids]: ids [N] int -> [N, H] rows of weight [V, H]."""
    if TRITON_STEP_GLUE and use_triton(weight) and weight.stride(1) == 1:
        from freetoken.kernels import embed_triton

        return embed_triton.embedding(weight, ids)
    return weight[ids]


def take_fed_back(input_ids: torch.Tensor, fed_back_rows: torch.Tensor, last_tokens: torch.Tensor) -> None:
    """In place: input_ids[i] = last_tokens[fed_back_rows[i]] where fed_back_rows[i] >= 0 (all [N] on the device)."""
    if TRITON_STEP_GLUE and use_triton(input_ids):
        from freetoken.kernels import embed_triton

        embed_triton.take_fed_back(input_ids, fed_back_rows, last_tokens)
        return
    input_ids.copy_(torch.where(fed_back_rows >= 0, last_tokens.index_select(0, fed_back_rows.clamp(min=0)), input_ids))


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, act: str = "silu") -> torch.Tensor:
    """w * norm(x) * act(gate); x, gate [..., D], weight [D]."""
    if use_triton(x):
        from freetoken.kernels import norm_triton

        return norm_triton.gated_rms_norm(x, gate, weight, eps, act)
    return norm_ref.gated_rms_norm(x, gate, weight, eps, act)


def norm_rope_store(q, k, v, q_weight, k_weight, eps: float, positions, inv_freq, k_cache, v_cache, slot_mapping, prefetch: "Span | None" = None,
                    mrope_section: tuple[int, ...] = (), cos_scale: float | None = None) -> torch.Tensor:
    """zc_rms_norm then partial RoPE of q [N, Hq, D] and k [N, Hkv, D] at positions [N] (or [3, N], interleaved
    mRoPE over mrope_section); k and v [N, Hkv, D] stored at slot_mapping [N] in the caches [num_slots, Hkv, D];
    returns the rotated q. k None (with k_weight and k_cache None): v alone is stored, as it is. cos_scale None:
    Qwen3.5's cos/sin (rope_ref.apply_rope); a float: qwen4_exp's, times cos_scale (rope_ref.scaled_cos_sin).
    prefetch: `l2_span`'s."""
    if use_triton(q):
        from freetoken.kernels import rope_triton

        return rope_triton.norm_rope_store(q, k, v, q_weight, k_weight, eps, positions, inv_freq, k_cache, v_cache, slot_mapping, prefetch,
                                           mrope_section, 1.0 if cos_scale is None else cos_scale)
    if cos_scale is None:
        q = apply_rope(norm_ref.zc_rms_norm(q, q_weight, eps), positions, inv_freq, mrope_section)
        k = apply_rope(norm_ref.zc_rms_norm(k, k_weight, eps), positions, inv_freq, mrope_section)
        store_kv(k, v, k_cache, v_cache, slot_mapping)
        return q
    axes = torch.tensor(mrope_axes(inv_freq.shape[0], mrope_section)) if positions.dim() == 2 else None
    cos, sin = scaled_cos_sin(positions, inv_freq, axes, cos_scale, q.dtype)
    q = rotate(norm_ref.zc_rms_norm(q, q_weight, eps), cos, sin)
    if k is None:
        v_cache[slot_mapping] = v.to(v_cache.dtype)
    else:
        store_kv(rotate(norm_ref.zc_rms_norm(k, k_weight, eps), cos, sin), v, k_cache, v_cache, slot_mapping)
    return q


def paged_attention_batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: SeqBatch, block_size: int, scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, Hq, D] over the paged caches [num_slots, Hkv, D], each row causally in its sequence -> [N, Hq, D],
    times sigmoid(gate [N, Hq, D]) when a gate is given."""
    if use_triton(q):
        from freetoken.kernels import attention_triton

        return attention_triton.paged_attention(q, k_cache, v_cache, batch, block_size, scale, gate)
    out = batched.paged_attention_batched(q, k_cache, v_cache, batch, block_size, scale)
    return out if gate is None else out * activation_ref.sigmoid(gate)


def hc_gates(down_inject: torch.Tensor, rank: int, streams: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A hyper-connection's gates from its merged down/inject projection down_inject [N, rank + k]:
    (silu(d / S) [N, rank], injection weights 2 sigmoid(i / S) [N, k]); see hc_ref."""
    if use_triton(down_inject):
        from freetoken.kernels import hc_triton

        return hc_triton.gates(down_inject, rank, streams)
    from freetoken.kernels import hc_ref

    return hc_ref.gates(down_inject, rank, streams)


def hc_mix_mean(up: torch.Tensor, xn: torch.Tensor, streams: int) -> torch.Tensor:
    """A hyper-connection's block input u = mean_s(sigmoid(up_s) * xn_s) [N, H] of up, xn [N, S*H]; see hc_ref."""
    if use_triton(xn):
        from freetoken.kernels import hc_triton

        return hc_triton.mix_mean(up, xn, streams)
    from freetoken.kernels import hc_ref

    return hc_ref.mix_mean(up, xn, streams)


def hc_inject(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, norm_weight: torch.Tensor | None = None,
              eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """X = x [N, S*H] + weights [N, S] (x) y [N, H], and with norm_weight [S*H] its per-stream zero-centred
    norm (the next hyper-connection's input) -> (X, Xn or None); see hc_ref."""
    if use_triton(x):
        from freetoken.kernels import hc_triton

        return hc_triton.inject(x, y, weights, norm_weight, eps)
    from freetoken.kernels import hc_ref

    if norm_weight is None:
        return hc_ref.inject(x, y, weights), None
    return hc_ref.inject_norm(x, y, weights, norm_weight, eps)


def qsa_select(q: torch.Tensor, raw_keys: torch.Tensor, k_norm_weight: torch.Tensor, eps: float, block_cos: torch.Tensor, block_sin: torch.Tensor,
               batch: SeqBatch, page_size: int, ratio: int, top_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """QSA key-block selection: indexer queries q [N, H, d_i] against the key blocks pooled from the raw
    indexer keys [num_slots, (1,) d_i] (k_layernorm weight [d_i], cos/sin [S or 1, max_blocks, rotary_dim]
    at each block's first position) -> (kept block ids [N, top_blocks] int32 ascending, -1 padded;
    counts [N] int32); see qsa_ref for the tie order."""
    if use_triton(q):
        from freetoken.kernels import qsa_select_triton

        return qsa_select_triton.qsa_select(q, raw_keys, k_norm_weight, eps, block_cos, block_sin, batch, page_size, ratio, top_blocks)
    from freetoken.kernels import qsa_ref

    return qsa_ref.qsa_select(q, raw_keys, k_norm_weight, eps, block_cos, block_sin, batch, page_size, ratio, top_blocks)


def qsa_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor, batch: SeqBatch,
                  page_size: int, ratio: int, scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, Hq, D] over the paged caches [num_slots, Hkv, D], each row over the tokens of its kept key
    blocks (qsa_select's block_ids [N, top_blocks], counts [N]) and its tail -> [N, Hq, D], times
    sigmoid(gate [N, Hq, D]) when a gate is given."""
    if use_triton(q):
        from freetoken.kernels import qsa_attention_triton

        return qsa_attention_triton.qsa_attention(q, k_cache, v_cache, block_ids, counts, batch, page_size, ratio, scale, gate)
    from freetoken.kernels import qsa_ref

    return qsa_ref.qsa_attention(q, k_cache, v_cache, block_ids, counts, batch, page_size, ratio, scale, gate)


def causal_conv1d_batched(windows: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, batch: SeqBatch, write_state: bool = True) -> torch.Tensor:
    """silu(causal conv) of rows [N, C] with the window pool [slots, K-1, C]; windows advance if write_state."""
    if use_triton(rows):
        from freetoken.kernels import conv_triton

        return conv_triton.causal_conv1d(windows, rows, weight, batch, write_state)
    return batched.causal_conv1d_batched(windows, rows, weight, batch, write_state)


def dilated_causal_conv1d_batched(windows: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, batch: SeqBatch, dilation: int, write_state: bool = True) -> torch.Tensor:
    """silu(dilated causal conv) of rows [N, C] with the window pool [slots, (K-1) * dilation, C] (entries of
    positions before 0 read as zero), weight [C, K]; windows advance if write_state (the PLE layer's)."""
    if use_triton(rows):
        from freetoken.kernels import dilated_conv_triton

        return dilated_conv_triton.dilated_causal_conv1d(windows, rows, weight, batch, dilation, write_state)
    from freetoken.kernels import ple_ref

    return ple_ref.dilated_causal_conv1d_batched(windows, rows, weight, batch, dilation, write_state)


def ple_ngram_tokens(windows: torch.Tensor, ids: torch.Tensor, batch: SeqBatch, eos: int, ngram_size: int, write_state: bool = True) -> torch.Tensor:
    """The PLE layer's n-gram token columns [N, ngram_size] int64 of the step's ids [N] after each sequence's
    id window (the pool [slots, ngram_size - 1]); windows advance if write_state; see ple_ref."""
    if use_triton(ids):
        from freetoken.kernels import ple_ngram_triton

        return ple_ngram_triton.ngram_tokens(windows, ids, batch, eos, ngram_size, write_state)
    from freetoken.kernels import ple_ref

    return ple_ref.ngram_tokens_batched(windows, ids, batch, eos, ngram_size, write_state)


def ple_gated_value(k: torch.Tensor, q: torch.Tensor, v: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The PLE layer's gated value gv and its per-stream norm gvn [N, S*H] of k, q [N, S*H], v [N, H]; see ple_ref."""
    if use_triton(v):
        from freetoken.kernels import ple_gate_triton

        return ple_gate_triton.gated_value(k, q, v, norm_weight, eps)
    from freetoken.kernels import ple_ref

    return ple_ref.gated_value(k, q, v, norm_weight, eps)


def gdn_fused_recurrent(state, conv_out, a, b, a_log, dt_bias, num_k_heads: int, batch: SeqBatch, write_state: bool = True, compute_output: bool = True, out_dtype: torch.dtype = torch.float32, prefetch: "Span | None" = None):
    """The gated delta rule over the state pool [slots, Hv, Dk, Dv] with its input preparation fused in
    (Triton only): conv_out [N, C], a, b [N, Hv]; see gdn_triton.gdn_fused. prefetch: `l2_span`'s."""
    from freetoken.kernels import gdn_triton

    return gdn_triton.gdn_fused(state, conv_out, a, b, a_log, dt_bias, num_k_heads, batch, write_state, compute_output, out_dtype, prefetch)


def gdn_recurrent_batched(state, q, k, v, g, beta, batch: SeqBatch, write_state: bool = True, compute_output: bool = True):
    """Gated delta rule over the state pool [slots, Hv, Dk, Dv]; see batched.gdn_recurrent_batched."""
    if use_triton(q):
        from freetoken.kernels import gdn_triton

        return gdn_triton.gdn_recurrent(state, q, k, v, g, beta, batch, write_state, compute_output)
    return batched.gdn_recurrent_batched(state, q, k, v, g, beta, batch, write_state, compute_output)


def gdn_chunked_prefill(state, q, k, v, g, beta, batch: SeqBatch, out=None):
    """Chunked (C=64) gated delta rule for prefill; advances the slots in place -> outputs [N, Hv, Dv] fp32
    (into `out` at the batch's rows if given). Equals gdn_recurrent_batched up to fp32 rounding only."""
    if use_triton(q):
        from freetoken.kernels import gdn_chunk_triton

        return gdn_chunk_triton.gdn_chunked(state, q, k, v, g, beta, batch, out)
    from freetoken.kernels import gdn_chunk_ref

    return gdn_chunk_ref.gdn_chunked_batched(state, q, k, v, g, beta, batch, out)


def moe_route(logits: torch.Tensor, top_k: int, dtype: torch.dtype | None = None, with_shared: bool = False, first: int = 0, count: int | None = None) -> tuple[torch.Tensor, torch.Tensor, RowBlocks | None]:
    """Router logits [N, E] -> (experts [N, top_k], their renormalised softmax weights [N, top_k] in dtype
    (default logits.dtype), blocks); softmax and renormalisation in fp32. with_shared: experts
    [N, top_k + 1] with column top_k = E, the shared expert held as one more expert. blocks: on the
    Triton path for few rows, the expert GEMMs' row blocks for the experts [first, first + count)
    (default all), written by the routing launch (moe_route_triton.RowBlocks); else None. Pass them on to
    moe_experts / moe_experts_with_shared, which then launch no layout kernel."""
    dtype = dtype or logits.dtype
    if use_triton(logits):
        from freetoken.kernels import moe_route_triton

        return moe_route_triton.route(logits, top_k, dtype, with_shared, first, count)
    from freetoken.kernels import moe_ref

    return (*moe_ref.route(logits, top_k, dtype, with_shared), None)


def moe_add_norm_route(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, gates: torch.Tensor, top_k: int, with_shared: bool = False, first: int = 0, count: int | None = None, prefetch: "Span | None" = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, RowBlocks | None]:
    """A MoE block's entry: s = x + residual, h = zc_rms_norm(s), the merged gates [E + 1, H] (router rows,
    then the shared-expert gate) applied to h, and the routing of the router logits ->
    (s, h, experts, weights, shared-gate logits [N, 1], blocks), as add_zc_rms_norm, linear and
    moe_route give them; one launch on the Triton path. x may be a linear's deferred split-K sum.
    prefetch: `l2_span`'s, queued by the launch."""
    if not isinstance(x, torch.Tensor) or use_triton(x):
        from freetoken.kernels import moe_gate_triton

        return moe_gate_triton.add_norm_route(x, residual, norm_weight, eps, gates, top_k, with_shared, first, count, prefetch)
    s, h = add_zc_rms_norm(x, residual, norm_weight, eps)
    logits = linear(h, gates)
    return (s, h, *moe_route(logits[:, :-1], top_k, x.dtype, with_shared, first, count)[:2], logits[:, -1:], None)


def moe_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, first: int = 0, shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None, blocks: RowBlocks | None = None, slot_of: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts: x [N, H], experts/weights [N, top_k], gate_up [C, 2I, H], down [C, H, I] -> fp32 [N, H];
    given the shared expert's output [N, H] and gate logit [N, 1], the block output
    acc.to(x.dtype) + sigmoid(shared_gate) * shared in x.dtype. blocks: moe_route's (a Triton layout;
    the result does not depend on it). slot_of [E] (first 0): expert id -> its row of gate_up / down,
    for weights held in cache slots; every routed expert must have one; each row gets the same bits."""
    if use_triton(x):
        from freetoken.kernels import moe_triton

        return moe_triton.moe_experts(x, experts, weights, gate_up, down, first, shared, shared_gate, blocks, slot_of)
    from freetoken.kernels import moe_ref

    return moe_ref.moe_experts(x, experts, weights, gate_up, down, first, shared, shared_gate, slot_of)


def moe_experts_with_shared(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, shared_gate: torch.Tensor, blocks: RowBlocks | None = None, defer_combine: bool = False, slot_of: torch.Tensor | None = None) -> "torch.Tensor | PendingCombine":
    """The block output with the shared expert held as expert E: x [N, H], experts [N, top_k + 1] (column
    top_k = E), weights [N, top_k], gate_up [E + 1, 2I, H], down [E + 1, H, I], shared_gate [N, 1] ->
    acc.to(x.dtype) + sigmoid(shared_gate) * shared in x.dtype, acc over the top_k routed experts.
    blocks: moe_route's (a Triton layout; the result does not depend on it). defer_combine: on the
    Triton path at decode sizes the result may be a PendingCombine, which only `add_zc_rms_norm` takes.
    slot_of [E + 1]: expert id -> its row of gate_up / down (an expert cache's slots, slot_of[E] the
    last row); every routed expert must have one; each row gets the same bits."""
    if use_triton(x):
        from freetoken.kernels import moe_triton

        return moe_triton.moe_experts_with_shared(x, experts, weights, gate_up, down, shared_gate, blocks, defer_combine, slot_of)
    from freetoken.kernels import moe_ref

    return moe_ref.moe_experts_with_shared(x, experts, weights, gate_up, down, shared_gate, slot_of)


__all__ = [
    "SeqBatch",
    "add_zc_rms_norm",
    "silu_mul",
    "apply_rope",
    "causal_conv1d_batched",
    "dilated_causal_conv1d_batched",
    "embedding",
    "take_fed_back",
    "torch_only",
    "gated_rms_norm",
    "grouped_zc_rms_norm",
    "hc_gates",
    "hc_inject",
    "hc_mix_mean",
    "gdn_chunked_prefill",
    "gdn_fused_recurrent",
    "gdn_recurrent_batched",
    "l2_span",
    "linear",
    "linear_conv",
    "moe_add_norm_route",
    "moe_experts",
    "moe_experts_with_shared",
    "moe_route",
    "norm_rope_store",
    "paged_attention_batched",
    "ple_gated_value",
    "ple_ngram_tokens",
    "qsa_attention",
    "qsa_select",
    "rms_norm",
    "seq_batch",
    "store_kv",
    "use_triton",
    "zc_rms_norm",
]
