"""The gated delta rule in chunked (WY / UT-transform) form (reference), for prefill.

Same math as `gdn_ref.gdn_recurrent`, reorganised so that a chunk of C rows costs a few matrix
products instead of C sequential rank-1 updates. Within a chunk (rows t = 0..C-1, state S0 at its
start, G_t = g_0 + ... + g_t the cumulative log-decay), the recurrence unrolls to

    delta_t = beta_t (v_t - e^{G_t} S0^T k_t - sum_{s<t} e^{G_t - G_s} (k_t . k_s) delta_s)

i.e. (I + A) delta = beta V - beta e^G K S0 with A[t, s] = beta_t e^{G_t - G_s} k_t . k_s (s < t).
With T = (I + A)^{-1} (unit lower triangular, by forward substitution):

    U = T (beta V),  W = T (beta e^G K),  delta = U - W S0
    O = (e^G Q) S0 + (Q K^T * e^{G_t - G_s}, s <= t) delta
    S1 = e^{G_last} S0 + (e^{G_last - G} K)^T delta

Every exponent is a difference G_t - G_s with s <= t, so it is <= 0: strong decay underflows to 0
and never overflows. Results equal the recurrence up to fp32 rounding, not bit for bit, so only
prefill uses this form; decode, verify and the commit replay keep the recurrence.

Layout: `gdn_chunked` (one sequence, state [Hv, Dk, Dv]), `gdn_chunked_batched` (a `SeqBatch`
over the state pool, the CPU path of `kernels.gdn_chunked_prefill`).
"""

from __future__ import annotations

import torch

from freetoken.kernels.batched import SeqBatch

CHUNK = 64


def _chunk(
    state: torch.Tensor,  # [Hv, Dk, Dv] fp32, updated in place
    q: torch.Tensor,  # [Hv, c, Dk]
    k: torch.Tensor,  # [Hv, c, Dk]
    v: torch.Tensor,  # [Hv, c, Dv]
    g: torch.Tensor,  # [Hv, c]
    beta: torch.Tensor,  # [Hv, c]
) -> torch.Tensor:  # [Hv, c, Dv]
    c = q.shape[1]
    cum = torch.cumsum(g, dim=-1)  # [Hv, c]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()  # s <= t
    gap = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf"))
    decay = torch.exp(gap)  # [Hv, c, c], e^{G_t - G_s} on and below the diagonal, 0 above
    a = (beta[:, :, None] * (k @ k.transpose(1, 2)) * decay).tril(-1)
    unit_lower = a + torch.eye(c, dtype=a.dtype, device=a.device)
    rhs = torch.cat([v * beta[..., None], k * (beta * torch.exp(cum))[..., None]], dim=-1)
    uw = torch.linalg.solve_triangular(unit_lower, rhs, upper=False, unitriangular=True)
    u, w = uw.split([v.shape[-1], k.shape[-1]], dim=-1)
    delta = u - w @ state  # [Hv, c, Dv]
    out = (q * torch.exp(cum)[..., None]) @ state + ((q @ k.transpose(1, 2)) * decay) @ delta
    last = cum[:, -1]
    state.mul_(torch.exp(last)[:, None, None]).add_((k * torch.exp(last[:, None] - cum)[..., None]).transpose(1, 2) @ delta)
    return out


def gdn_chunked(
    state: torch.Tensor,  # [Hv, Dk, Dv] fp32, updated in place
    q: torch.Tensor,  # [T, Hv, Dk] fp32, l2-normed and scaled
    k: torch.Tensor,  # [T, Hv, Dk] fp32, l2-normed
    v: torch.Tensor,  # [T, Hv, Dv] fp32
    g: torch.Tensor,  # [T, Hv] fp32 log-decay
    beta: torch.Tensor,  # [T, Hv] fp32
    chunk: int = CHUNK,
) -> torch.Tensor:
    """Advance `state` over T rows, chunk rows at a time; return the outputs [T, Hv, Dv] fp32."""
    if q.shape[0] == 0:
        return torch.empty(v.shape, dtype=torch.float32, device=v.device)
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))  # [Hv, T, D]
    g, beta = g.float().t(), beta.float().t()  # [Hv, T]
    outs = [_chunk(state, q[:, i : i + chunk], k[:, i : i + chunk], v[:, i : i + chunk], g[:, i : i + chunk], beta[:, i : i + chunk]) for i in range(0, q.shape[1], chunk)]
    return torch.cat(outs, dim=1).transpose(0, 1)


def gdn_chunked_batched(
    state: torch.Tensor,  # [slots, Hv, Dk, Dv] fp32 pool, advanced in place
    q: torch.Tensor,  # [N, Hv, Dk] fp32
    k: torch.Tensor,  # [N, Hv, Dk] fp32
    v: torch.Tensor,  # [N, Hv, Dv] fp32
    g: torch.Tensor,  # [N, Hv] fp32
    beta: torch.Tensor,  # [N, Hv] fp32
    batch: SeqBatch,
    out: torch.Tensor | None = None,  # [N, Hv, Dv] fp32: written only at the batch's rows
) -> torch.Tensor:
    """The chunked rule over each sequence's rows from its slot's state -> outputs [N, Hv, Dv] fp32."""
    if out is None:
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for i in range(batch.num_seqs):
        if batch.num_rows[i] == 0:
            continue
        rows = batch.rows(i)
        out[rows] = gdn_chunked(state[batch.state_slots[i]], q[rows], k[rows], v[rows], g[rows], beta[rows])
    return out
