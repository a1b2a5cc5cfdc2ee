"""The one Gated DeltaNet layer ("linear_attention").

in_proj_qkv -> causal depthwise conv (+silu) -> q, k, v heads; beta = sigmoid(b),
g = -exp(A_log) * softplus(a + dt_bias); the delta-rule recurrence with fp32 state; gated RMSNorm
with z; out_proj. Value head j reads key head j // (Hv / Hk).

On the Triton path a decode step (one row per sequence) runs the convolution inside the input
projection's launch (`kernels.linear_conv`: the same bits as the projection, then the convolution).

State handling (DESIGN.md invariant 4): in EXTEND mode the conv window and recurrent state advance
in place; in VERIFY mode they are only read and each row's inputs are stashed; `commit` replays the
accepted rows through the same batched recurrence and convolution. Each op covers all sequences of
the step in one call (one kernel launch on the GPU).

Prefill: in EXTEND mode whole CHUNK-aligned chunks of a prompt run the chunked form of the rule
(`kernels.gdn_chunked_prefill`, equal to the recurrence up to fp32 rounding); the prompt's last
partial chunk, generated tokens and decode rows run the recurrence (`split_extend`). Which rule a
position gets depends on the position and the prompt length only, never on how the scheduler cut
the prompt or which requests share the step (the scheduler cuts at multiples of CHUNK), so a
recompute after preemption reproduces the same bits. Decode, verify and the commit replay always
run the recurrence, bit for bit alike.

Across ranks the key heads and the value heads are split evenly (value head j reads key head
j // (Hv / Hk), so a rank's value heads read only its own key heads); the fused [q | k | v]
projection and the convolution keep the rank's part of each third, and the state pool holds only
the rank's heads and channels.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken import kernels
from freetoken.distributed.context import SINGLE, ParallelContext
from freetoken.distributed.sharding import ShardSpec
from freetoken.forward_context import ForwardContext, ForwardMode, GDNStash
from freetoken.kernels import gdn_ref
from freetoken.layers.basic import GatedRMSNorm, _empty
from freetoken.layers.parallel import ColumnParallelLinear, RowParallelLinear

CHUNK = 64  # the chunked rule's chunk; prefill pieces are cut at multiples of it (engine/scheduler.py)


def split_extend(batch: kernels.SeqBatch) -> tuple[kernels.SeqBatch | None, kernels.SeqBatch]:
    """(chunked part or None, recurrent part) of an EXTEND step, kept on the batch for its other GDN layers.

    A sequence whose rows start at a multiple of CHUNK sends its rows up to the last multiple of CHUNK
    at or before min(its end, its chunkable end) to the chunked rule; its other rows (all of them if
    the start is not aligned) run the recurrence afterwards. So the rule a position gets depends on
    the position and the prompt length alone, not on how the prompt was cut into steps."""
    cached = batch.__dict__.get("_gdn_split")
    if cached is not None:
        return cached
    ends = batch.chunkable_ends or (None,) * batch.num_seqs
    chunk_rows = []
    for start, n, limit in zip(batch.num_cached, batch.num_rows, ends):
        end = start + n if limit is None else min(start + n, limit)
        chunk_rows.append(max(0, end // CHUNK * CHUNK - start) if start % CHUNK == 0 else 0)
    if not any(chunk_rows):
        split = (None, batch)
    else:
        chunked = kernels.SeqBatch(batch.row_starts, tuple(chunk_rows), batch.num_cached, batch.state_slots, batch.block_tables, batch.device)
        rest = kernels.SeqBatch(
            tuple(s + c for s, c in zip(batch.row_starts, chunk_rows)), tuple(n - c for n, c in zip(batch.num_rows, chunk_rows)),
            tuple(s + c for s, c in zip(batch.num_cached, chunk_rows)), batch.state_slots, batch.block_tables, batch.device,
        )
        split = (chunked, rest)
    batch.__dict__["_gdn_split"] = split
    return split


def _rows_of(batch: kernels.SeqBatch) -> torch.Tensor:
    """[n] int64 indices of the batch's rows."""
    idx = [r for i in range(batch.num_seqs) for r in range(batch.row_starts[i], batch.row_starts[i] + batch.num_rows[i])]
    return torch.tensor(idx, dtype=torch.long, device=batch.device)


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int, conv_kernel: int, eps: float, state_index: int, gate_act: str = "silu", parallel: ParallelContext = SINGLE):
        super().__init__()
        k0, k1 = parallel.split(num_k_heads, "GDN key heads")
        v0, v1 = parallel.split(num_v_heads, "GDN value heads")
        self.num_k_heads, self.num_v_heads = k1 - k0, v1 - v0
        self.k_head_dim, self.v_head_dim = k_head_dim, v_head_dim
        self.key_dim = self.num_k_heads * k_head_dim
        self.conv_dim = 2 * self.key_dim + self.num_v_heads * v_head_dim
        full_key_dim = num_k_heads * k_head_dim
        qkv_rows = (  # this rank's rows of each third of [q | k | v]
            (k0 * k_head_dim, k1 * k_head_dim),
            (full_key_dim + k0 * k_head_dim, full_key_dim + k1 * k_head_dim),
            (2 * full_key_dim + v0 * v_head_dim, 2 * full_key_dim + v1 * v_head_dim),
        )
        self.in_proj_qkv = ColumnParallelLinear(hidden_size, 2 * full_key_dim + num_v_heads * v_head_dim, parallel, qkv_rows)
        self.in_proj_z = ColumnParallelLinear(hidden_size, num_v_heads * v_head_dim, parallel, ((v0 * v_head_dim, v1 * v_head_dim),))
        self.in_proj_b = ColumnParallelLinear(hidden_size, num_v_heads, parallel, ((v0, v1),))
        self.in_proj_a = ColumnParallelLinear(hidden_size, num_v_heads, parallel, ((v0, v1),))
        self.conv1d = nn.Module()
        self.conv1d.weight = _empty(self.conv_dim, 1, conv_kernel)
        self.A_log = _empty(self.num_v_heads)
        self.dt_bias = _empty(self.num_v_heads)
        self.norm = GatedRMSNorm(v_head_dim, eps, gate_act)
        self.out_proj = RowParallelLinear(num_v_heads * v_head_dim, hidden_size, parallel, ((v0 * v_head_dim, v1 * v_head_dim),))
        if parallel.is_parallel:
            self.conv1d.shard_specs = {"weight": ShardSpec(0, qkv_rows)}
            self.shard_specs = {"A_log": ShardSpec(0, ((v0, v1),)), "dt_bias": ShardSpec(0, ((v0, v1),))}
        self.state_index = state_index  # which slice of the linear-state pool this layer owns
        self.in_proj_weight: torch.Tensor | None = None  # [qkv | z | b | a] rows once merged (layers/merge.py)

    def _recurrence_inputs(self, conv_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
        """conv_out [N, C], a, b [N, Hv] -> q, k [N, Hv, Dk], v [N, Hv, Dv], g, beta [N, Hv], all fp32;
        a row's bits depend on that row alone (kernels/activation_ref.py)."""
        return gdn_ref.recurrence_inputs(conv_out, a, b, self.A_log, self.dt_bias, self.num_k_heads, self.k_head_dim, self.v_head_dim)

    def merge_projections(self) -> None:
        """Read the four input projections [qkv | z | b | a] as one weight."""
        if self.in_proj_weight is None:
            from freetoken.layers.merge import merge_linears

            self.in_proj_weight = merge_linears([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])

    @property
    def input_weight(self) -> torch.Tensor | None:
        """The merged input projection (None until merged): the first GEMM of the layer's forward."""
        return self.in_proj_weight

    def _split(self, projected: torch.Tensor):
        """The merged projection's output [N, C + Hv * Dv + 2 Hv] -> column views [N, C], z [N, Hv, Dv], b, a [N, Hv]."""
        hv = self.num_v_heads
        first, z, b, a = torch.split(projected, [self.conv_dim, hv * self.v_head_dim, hv, hv], dim=-1)
        return first, z.view(projected.shape[0], hv, self.v_head_dim), b, a

    def _project(self, x: torch.Tensor):
        """x [N, H] -> mixed_qkv [N, C], z [N, Hv, Dv], b, a [N, Hv] (column views when merged)."""
        if self.in_proj_weight is not None:
            return self._split(kernels.linear(x, self.in_proj_weight))
        z = self.in_proj_z(x).view(x.shape[0], self.num_v_heads, self.v_head_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)

    def _project_conv(self, x: torch.Tensor, windows: torch.Tensor, batch: kernels.SeqBatch):
        """An EXTEND step's projection and convolution (the windows advance) -> conv_out [N, C], z [N, Hv, Dv],
        b, a [N, Hv]. At decode (one row per sequence, merged projections, Triton) the convolution runs
        in the projection's launch (`kernels.linear_conv`); otherwise the projection, then the convolution."""
        conv_weight = self.conv1d.weight[:, 0, :]
        if self.in_proj_weight is not None and kernels.use_triton(x) and all(n == 1 for n in batch.num_rows):
            fused = kernels.linear_conv(x, self.in_proj_weight, windows, conv_weight, batch.slots)
            if fused is not None:
                return self._split(fused)
        mixed_qkv, z, b, a = self._project(x)
        return kernels.causal_conv1d_batched(windows, mixed_qkv, conv_weight, batch), z, b, a

    def _recurrence(self, pool, conv_out, a, b, batch: kernels.SeqBatch, write_state: bool, out_dtype: torch.dtype, prefetch=None):
        """The recurrence over batch's rows: the fused kernel on the Triton path (which queues `prefetch`,
        kernels.l2_span), else torch -> [N, Hv, Dv]."""
        if kernels.use_triton(conv_out):
            return kernels.gdn_fused_recurrent(pool, conv_out, a, b, self.A_log, self.dt_bias, self.num_k_heads, batch, write_state=write_state, out_dtype=out_dtype, prefetch=prefetch)
        q, k, v, g, beta = self._recurrence_inputs(conv_out, a, b)
        return kernels.gdn_recurrent_batched(pool, q, k, v, g, beta, batch, write_state=write_state).to(out_dtype)

    def _extend(self, pool, conv_out, a, b, batch: kernels.SeqBatch, out_dtype: torch.dtype, prefetch=None) -> torch.Tensor:  # -> [N, Hv, Dv]
        """EXTEND: whole aligned chunks by the chunked rule, then every other row by the recurrence."""
        chunked, rest = split_extend(batch)
        if chunked is None:
            return self._recurrence(pool, conv_out, a, b, batch, True, out_dtype, prefetch)
        q, k, v, g, beta = self._recurrence_inputs(conv_out, a, b)
        out = kernels.gdn_chunked_prefill(pool, q, k, v, g, beta, chunked)  # fp32; the chunked rows only
        if sum(rest.num_rows):
            rows = _rows_of(rest)
            if kernels.use_triton(conv_out):
                tail = self._recurrence(pool, conv_out, a, b, rest, True, torch.float32)
            else:
                tail = kernels.gdn_recurrent_batched(pool, q, k, v, g, beta, rest)
            out[rows] = tail[rows]
        return out.to(out_dtype)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, defer_sum: bool = False) -> torch.Tensor:  # [N, H] -> [N, H]
        """defer_sum: out_proj's output may be its split-K partials, for the decoder's next add + norm."""
        n = x.shape[0]
        state = ctx.linear_state
        batch = kernels.seq_batch(ctx)
        conv_pool, recurrent_pool = state.conv[self.state_index], state.recurrent[self.state_index]
        prefetch = kernels.l2_span(self.out_proj.weight, x, "out_proj")  # by the recurrence's launch
        if ctx.mode is ForwardMode.VERIFY:
            mixed_qkv, z, b, a = self._project(x)
            conv_out = kernels.causal_conv1d_batched(conv_pool, mixed_qkv, self.conv1d.weight[:, 0, :], batch, write_state=False)
            if kernels.use_triton(x):
                core = kernels.gdn_fused_recurrent(recurrent_pool, conv_out, a, b, self.A_log, self.dt_bias, self.num_k_heads, batch, write_state=False, out_dtype=x.dtype, prefetch=prefetch)
                ctx.stash[self.state_index] = GDNStash(mixed_qkv, (conv_out, a, b), fused=True)
            else:
                q, k, v, g, beta = self._recurrence_inputs(conv_out, a, b)
                core = kernels.gdn_recurrent_batched(recurrent_pool, q, k, v, g, beta, batch, write_state=False).to(x.dtype)
                ctx.stash[self.state_index] = GDNStash(mixed_qkv, (q, k, v, g, beta))
        else:
            conv_out, z, b, a = self._project_conv(x, conv_pool, batch)
            core = self._extend(recurrent_pool, conv_out, a, b, batch, x.dtype, prefetch)
        y = self.norm(core, z).reshape(n, self.num_v_heads * self.v_head_dim)
        return self.out_proj(y, defer_sum=defer_sum)

    def commit(self, ctx: ForwardContext, replay: kernels.SeqBatch) -> None:
        """Fold the replay batch's rows (each sequence's first accepted verify rows) into the live state."""
        stash = ctx.stash[self.state_index]
        state = ctx.linear_state
        recurrent, conv = state.recurrent[self.state_index], state.conv[self.state_index]
        if stash.fused:
            kernels.gdn_fused_recurrent(recurrent, *stash.inputs, self.A_log, self.dt_bias, self.num_k_heads, replay, compute_output=False)
        else:
            kernels.gdn_recurrent_batched(recurrent, *stash.inputs, replay, compute_output=False)
        kernels.causal_conv1d_batched(conv, stash.conv_rows, self.conv1d.weight[:, 0, :], replay)
