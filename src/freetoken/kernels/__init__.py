"""The one dispatch point for every op the model runs.

Each op has a plain-torch reference (`*_ref.py`, the CPU path and the test oracle). Faster backends plug
in here; callers never import a backend module directly. The backend is chosen per call from
`FREETOKEN_KERNELS` (auto | torch | triton), read once.

Row invariance is a contract of every op here: the result for one row (token) depends only on that
row's inputs and its own context, never on how many rows share the call or which requests they
belong to. Speculative decoding's exactness rests on it (DESIGN.md, invariant 5).
"""

from __future__ import annotations

from freetoken.kernels.attention_ref import paged_attention, store_kv
from freetoken.kernels.conv_ref import causal_conv1d
from freetoken.kernels.gdn_ref import gdn_recurrent
from freetoken.kernels.linear_ref import linear
from freetoken.kernels.norm_ref import gated_rms_norm, rms_norm, zc_rms_norm
from freetoken.kernels.rope_ref import apply_rope

__all__ = [
    "apply_rope",
    "causal_conv1d",
    "gated_rms_norm",
    "gdn_recurrent",
    "linear",
    "paged_attention",
    "rms_norm",
    "store_kv",
    "zc_rms_norm",
]
