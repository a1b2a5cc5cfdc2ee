"""The gated delta rule recurrence (reference), one sequence at a time.

This one function serves decode, the verify rows (on a scratch copy of the state) and the commit
replay (on the live state), so a replayed row updates the state exactly as decoding it would have.
Per value head, with fp32 state S [dk, dv]:
    S <- exp(g_t) * S;  delta = beta_t * (v_t - S^T k_t);  S <- S + k_t delta^T;  o_t = S^T q_t
"""

from __future__ import annotations

import torch


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
