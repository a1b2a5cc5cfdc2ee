"""The one Gated DeltaNet layer ("linear_attention").

in_proj_qkv -> causal depthwise conv (+silu) -> q, k, v heads; beta = sigmoid(b),
g = -exp(A_log) * softplus(a + dt_bias); the delta-rule recurrence with fp32 state; gated RMSNorm
with z; out_proj. Value head j reads key head j // (Hv / Hk).

State handling (DESIGN.md invariant 4): in EXTEND mode the conv window and recurrent state advance
in place; in VERIFY mode they are only read and each row's inputs are stashed; `commit` replays the
accepted rows through the same batched recurrence and convolution. Each op covers all sequences of
the step in one call (one kernel launch on the GPU).

Prefill: in EXTEND mode a sequence with at least CHUNKED_MIN_ROWS rows in the step runs the
chunked form of the rule (`kernels.gdn_chunked_prefill`), which equals the recurrence up to fp32
rounding; every other sequence (decode rows, short prompt pieces) runs the recurrence. The choice
depends only on the sequence's own row count, never on which requests share the step. Decode,
verify and the commit replay therefore always run the recurrence, bit for bit alike.

Across ranks the key heads and the value heads are split evenly (value head j reads key head
j // (Hv / Hk), so a rank's value heads read only its own key heads); the fused [q | k | v]
projection and the convolution keep the rank's part of each third, and the state pool holds only
the rank's heads and channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken import kernels
from freetoken.distributed.context import SINGLE, ParallelContext
from freetoken.distributed.sharding import ShardSpec
from freetoken.forward_context import ForwardContext, ForwardMode, GDNStash
from freetoken.layers.basic import GatedRMSNorm, _empty
from freetoken.layers.parallel import ColumnParallelLinear, RowParallelLinear

CHUNKED_MIN_ROWS = 64  # one full chunk: below it the chunked form does a chunk's work for fewer rows


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _split_by_length(batch: kernels.SeqBatch) -> tuple[kernels.SeqBatch, kernels.SeqBatch]:
    """(chunked, recurrent): the step's sequences at their own rows, each keeping only the sequences on
    its side of CHUNKED_MIN_ROWS; kept on the batch for the step's other GDN layers."""
    split = batch.__dict__.get("_gdn_split")
    if split is None:
        long = [n >= CHUNKED_MIN_ROWS for n in batch.num_rows]
        split = (
            batch.accepted([n if is_long else 0 for n, is_long in zip(batch.num_rows, long)]),
            batch.accepted([0 if is_long else n for n, is_long in zip(batch.num_rows, long)]),
        )
        batch.__dict__["_gdn_split"] = split
    return split


def _extend_recurrence(pool: torch.Tensor, q, k, v, g, beta, batch: kernels.SeqBatch) -> torch.Tensor:  # -> [N, Hv, Dv] fp32
    """EXTEND: the chunked rule for sequences with >= CHUNKED_MIN_ROWS rows, the recurrence for the rest."""
    lengths = batch.num_rows
    if all(n < CHUNKED_MIN_ROWS for n in lengths):
        return kernels.gdn_recurrent_batched(pool, q, k, v, g, beta, batch)
    if all(n >= CHUNKED_MIN_ROWS for n in lengths):
        return kernels.gdn_chunked_prefill(pool, q, k, v, g, beta, batch)
    chunked, recurrent = _split_by_length(batch)
    out = kernels.gdn_recurrent_batched(pool, q, k, v, g, beta, recurrent)
    return kernels.gdn_chunked_prefill(pool, q, k, v, g, beta, chunked, out=out)


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
        """conv_out [T, C], a, b [T, Hv] -> q, k [T, Hv, Dk], v [T, Hv, Dv], g, beta [T, Hv], all fp32."""
        t = conv_out.shape[0]
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.conv_dim - 2 * self.key_dim], dim=-1)
        repeat = self.num_v_heads // self.num_k_heads
        q = _l2norm(q.reshape(t, self.num_k_heads, self.k_head_dim)).repeat_interleave(repeat, dim=1) * self.k_head_dim**-0.5
        k = _l2norm(k.reshape(t, self.num_k_heads, self.k_head_dim)).repeat_interleave(repeat, dim=1)
        v = v.reshape(t, self.num_v_heads, self.v_head_dim).float()
        beta = torch.sigmoid(b.float())
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        return q, k, v, g, beta

    def _batch_recurrence_inputs(self, conv_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: kernels.SeqBatch):
        """_recurrence_inputs over the whole step. On CPU, torch computes exp/sigmoid differently for
        elements in its vector body and its scalar tail, so a row's bits depend on its position in
        the tensor: there it goes sequence by sequence, exactly as the per-sequence path did. CUDA
        elementwise kernels treat every element alike."""
        if conv_out.is_cuda:
            return self._recurrence_inputs(conv_out, a, b)
        parts = [self._recurrence_inputs(conv_out[r], a[r], b[r]) for r in map(batch.rows, range(batch.num_seqs))]
        return tuple(torch.cat(p) for p in zip(*parts))

    def merge_projections(self) -> None:
        """Read the four input projections [qkv | z | b | a] as one weight."""
        if self.in_proj_weight is None:
            from freetoken.layers.merge import merge_linears

            self.in_proj_weight = merge_linears([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])

    def _project(self, x: torch.Tensor):
        """x [N, H] -> mixed_qkv [N, C], z [N, Hv, Dv], b, a [N, Hv] (column views when merged)."""
        n = x.shape[0]
        if self.in_proj_weight is None:
            mixed_qkv, z, b, a = self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        else:
            hv = self.num_v_heads
            mixed_qkv, z, b, a = torch.split(kernels.linear(x, self.in_proj_weight), [self.conv_dim, hv * self.v_head_dim, hv, hv], dim=-1)
        return mixed_qkv, z.view(n, self.num_v_heads, self.v_head_dim), b, a

    def _fused(self, x: torch.Tensor, ctx: ForwardContext, batch: kernels.SeqBatch) -> bool:
        """Whether the recurrence prepares its own inputs (the Triton path): every step except an
        extend that has a sequence long enough for the chunked rule."""
        if not kernels.use_triton(x):
            return False
        return ctx.mode is ForwardMode.VERIFY or all(count < CHUNKED_MIN_ROWS for count in batch.num_rows)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # [N, H] -> [N, H]
        n = x.shape[0]
        mixed_qkv, z, b, a = self._project(x)
        conv_weight = self.conv1d.weight[:, 0, :]
        state = ctx.linear_state
        batch = kernels.seq_batch(ctx)
        verify = ctx.mode is ForwardMode.VERIFY
        conv_pool, recurrent_pool = state.conv[self.state_index], state.recurrent[self.state_index]
        conv_out = kernels.causal_conv1d_batched(conv_pool, mixed_qkv, conv_weight, batch, write_state=not verify)
        if self._fused(x, ctx, batch):
            core = kernels.gdn_fused_recurrent(recurrent_pool, conv_out, a, b, self.A_log, self.dt_bias, self.num_k_heads, batch, write_state=not verify, out_dtype=x.dtype)
            if verify:
                ctx.stash[self.state_index] = GDNStash(mixed_qkv, (conv_out, a, b), fused=True)
            y = self.norm(core, z).reshape(n, self.num_v_heads * self.v_head_dim)
            return self.out_proj(y)
        q, k, v, g, beta = self._batch_recurrence_inputs(conv_out, a, b, batch)
        if verify:
            core = kernels.gdn_recurrent_batched(recurrent_pool, q, k, v, g, beta, batch, write_state=False)
        else:
            core = _extend_recurrence(recurrent_pool, q, k, v, g, beta, batch)
        core = core.to(x.dtype)
        if verify:
            ctx.stash[self.state_index] = GDNStash(mixed_qkv, (q, k, v, g, beta))
        y = self.norm(core, z).reshape(n, self.num_v_heads * self.v_head_dim)
        return self.out_proj(y)

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
