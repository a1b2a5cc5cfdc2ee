"""sigmoid, silu and softplus whose bits do not depend on the tensor an element sits in.

On CPU torch evaluates these three with one approximation for calls over a few elements and a
vectorised one for longer calls, so the same value can come out with other last bits in a decode
step (one row: a [1, 32] gate) than in a verify step (k+1 rows) or beside other requests, which
would break greedy parity (DESIGN.md, invariant 5). exp, log and division give the same bits for
an element in any call, so on CPU the activations are written with them:

    sigmoid(x)  = 1 / (1 + exp(-x))
    silu(x)     = x / (1 + exp(-x))
    softplus(x) = x if x > 20 else log1p(exp(x))          (torch's threshold 20, beta 1)

with log1p(e) = log(u) * e / (u - 1), u = 1 + e (e where u rounds to 1): Kahan's form, accurate to a
few ulps from log and division alone (torch's log1p is not call-invariant either).

computed in fp32 (or the input's wider dtype) and rounded once to the input's dtype, as torch does.
They differ from torch's own by an ulp or so. CUDA elementwise kernels treat every element alike,
so there the torch functions are used as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return torch.sigmoid(x)
    w = _wide(x)
    return (1 / (1 + torch.exp(-w))).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return F.silu(x)
    w = _wide(x)
    return (w / (1 + torch.exp(-w))).to(x.dtype)


def softplus(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return F.softplus(x)
    w = _wide(x)
    e = torch.exp(w)
    u = 1 + e
    log1p = torch.where(u == 1, e, torch.log(u) * e / (u - 1))
    return torch.where(w > 20, w, log1p).to(x.dtype)
