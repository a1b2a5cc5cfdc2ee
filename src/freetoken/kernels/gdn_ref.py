"""The gated delta rule recurrence (reference), one sequence at a time.

This one function serves decode, the verify rows (on a scratch copy of the state) and the commit
replay (on the live state), so a replayed row updates the state exactly as decoding it would have.
Per value head, with fp32 state S [dk, dv]:
    S <- exp(g_t) * S;  delta = beta_t * (v_t - S^T k_t);  S <- S + k_t delta^T;  o_t = S^T q_t
"""

from __future__ import annotations

import torch

from freetoken.kernels import activation_ref


def gdn_recurrent(
    state: torch.Tensor,  # [Hv, Dk, Dv] fp32, updated in place
    q: torch.Tensor,  # [T, Hv, Dk] fp32, l2-normed and scaled
    k: torch.Tensor,  # [T, Hv, Dk] fp32, l2-normed
    v: torch.Tensor,  # [T, Hv, Dv] fp32
    g: torch.Tensor,  # [T, Hv] fp32 log-decay
    beta: torch.Tensor,  # [T, Hv] fp32
    compute_output: bool = True,
) -> torch.Tensor | None:
    """Advance `state` over T rows; return the outputs [T, Hv, Dv] (fp32) unless compute_output is False."""
    outputs = []
    for t in range(q.shape[0]):
        s = state * torch.exp(g[t])[:, None, None]
        kv_mem = (s * k[t][:, :, None]).sum(dim=1)  # [Hv, Dv]
        delta = (v[t] - kv_mem) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        state.copy_(s)
        if compute_output:
            outputs.append((s * q[t][:, :, None]).sum(dim=1))
    return torch.stack(outputs) if compute_output else None


def recurrence_inputs(
    conv_out: torch.Tensor,  # [T, 2 * Hk * Dk + Hv * Dv] = [q | k | v] after the short convolution
    a: torch.Tensor,  # [T, Hv]
    b: torch.Tensor,  # [T, Hv]
    a_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    num_k_heads: int,
    k_head_dim: int,
    v_head_dim: int,
):
    """-> q, k [T, Hv, Dk] (l2-normed; q scaled by Dk^-0.5), v [T, Hv, Dv], g, beta [T, Hv], all fp32.
    Value head j reads key head j // (Hv / Hk)."""
    t = conv_out.shape[0]
    num_v_heads = a.shape[-1]
    key_dim = num_k_heads * k_head_dim
    q, k, v = torch.split(conv_out, [key_dim, key_dim, num_v_heads * v_head_dim], dim=-1)
    repeat = num_v_heads // num_k_heads

    def l2norm(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)

    q = l2norm(q.reshape(t, num_k_heads, k_head_dim)).repeat_interleave(repeat, dim=1) * k_head_dim**-0.5
    k = l2norm(k.reshape(t, num_k_heads, k_head_dim)).repeat_interleave(repeat, dim=1)
    v = v.reshape(t, num_v_heads, v_head_dim).float()
    beta = activation_ref.sigmoid(b.float())
    g = -torch.exp(a_log.float()) * activation_ref.softplus(a.float() + dt_bias.float())
    return q, k, v, g, beta
