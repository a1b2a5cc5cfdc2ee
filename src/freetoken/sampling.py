"""Sampling: greedy, temperature/top-k/top-p, penalties, and lossless rejection sampling.

Why: speculative decoding must not change what the target would have produced. Greedy requests
must emit exactly the argmax plain decoding emits; sampled requests must emit tokens with exactly
the distribution plain decoding samples from. Both hold only if every verify row is processed
like the decode row at the same position: penalties see the request's generated tokens *plus the
drafts before that row*, and every step is computed per row (row-invariant), so a row's result
never depends on which other rows share the batch.

Layout:
  SamplingParams   per-request knobs (frozen, validated)
  make_generator   one torch.Generator per sampled request, deterministic per run
  process_logits   raw logits -> processed fp32 logits (penalties, temperature, top-k, top-p)
  probs / sample   the distribution actually sampled from, and one draw from it
  verify           chain rejection sampling (Leviathan et al. 2023, Chen et al. 2023) over k drafts
  apply_stop       cut newly emitted tokens at EOS / stop tokens / max_new_tokens

Order of processing per row: presence/frequency penalties -> temperature -> top-k -> top-p,
the order vLLM uses. Top-p works on the distribution left after top-k. Greedy rows
(temperature 0) get the penalties only and take the argmax (lowest index on ties).
A sample consumes exactly one uniform from the request's generator (inverse CDF), and a verify
step consumes exactly k + 1, whatever is accepted, so seeded runs are reproducible.

The argmax and the inverse-CDF draw run as Triton kernels where `kernels.use_triton` says so
(kernels/sampling_triton.py), else in torch (kernels/sampling_ref.py). The draw uses an integer
CDF whose sums do not depend on order, so CPU and GPU pick the same token for the same uniform.
Nothing here waits for the GPU: host lists reach the device through pinned memory, and verify
gathers the drafts a penalized row sees on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from freetoken import kernels
from freetoken.errors import FreetokenError
from freetoken.kernels import sampling_ref

DEFAULT_GLOBAL_SEED = 0


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 -> greedy
    top_k: int = 0  # 0 -> off
    top_p: float = 1.0
    presence_penalty: float = 0.0  # OpenAI semantics over the request's generated tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))  # lists from JSON stay hashable
        if not self.temperature >= 0:
            raise FreetokenError(f"sampling: temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise FreetokenError(f"sampling: top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise FreetokenError(f"sampling: top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise FreetokenError(f"sampling: max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy without penalties: the token is the argmax of the raw logits."""
        return self.is_greedy and not self.has_penalties


def _mix_seed(global_seed: int, request_index: int) -> int:
    """splitmix64 of (global_seed, request_index): unrelated streams for neighbouring requests."""
    mask = (1 << 64) - 1
    z = (global_seed * 0x9E3779B97F4A7C15 + request_index + 1) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def make_generator(
    params: SamplingParams,
    request_index: int,
    device: torch.device | str = "cpu",
    global_seed: int = DEFAULT_GLOBAL_SEED,
) -> torch.Generator | None:
    """The request's own random stream; None for greedy requests (they draw nothing).

    An explicit `params.seed` is used as is (same seed -> same samples, whatever the request's
    position); without one the seed is derived from `global_seed` and `request_index`.
    """
    if params.is_greedy:
        return None
    seed = params.seed if params.seed is not None else _mix_seed(global_seed, request_index)
    g = torch.Generator(device=device)
    g.manual_seed(seed & ((1 << 64) - 1))
    return g


def _host_tensor(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small host list as a tensor on `device`; on CUDA through pinned memory, so the copy does
    not wait for the GPU (a plain torch.tensor(..., device="cuda") synchronizes the stream)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _penalize(
    logits: Tensor, params: Sequence[SamplingParams], histories: Sequence[Sequence[int]], extra: tuple[Tensor, list[int]] | None = None
) -> None:
    """In place: logits[r, t] -= count_r(t) * frequency + (count_r(t) > 0) * presence.

    count_r counts histories[r] plus, if given, extra = (tokens [T] int64 on the logits' device,
    the row each token belongs to): tokens still on the device (verify's drafts) need no host copy.
    """
    rows = [r for r, p in enumerate(params) if p.has_penalties]
    extra_tokens, extra_rows = extra if extra is not None else (None, [])
    if not rows or (sum(len(histories[r]) for r in rows) == 0 and not extra_rows):
        return
    dev = logits.device
    slot = {r: i for i, r in enumerate(rows)}  # row -> its place among the penalized rows
    flat = _host_tensor([t for r in rows for t in histories[r]], torch.int64, dev)
    row_of = [slot[r] for r in rows for _ in histories[r]]
    if extra_rows:
        flat = torch.cat([flat, extra_tokens.to(dev)])
        row_of += [slot[r] for r in extra_rows]
    counts = torch.zeros(len(rows), logits.shape[1], dtype=torch.float32, device=dev)  # [R', V]
    counts.index_put_((_host_tensor(row_of, torch.int64, dev), flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)
    freq = _host_tensor([params[r].frequency_penalty for r in rows], torch.float32, dev)
    pres = _host_tensor([params[r].presence_penalty for r in rows], torch.float32, dev)
    index = _host_tensor(rows, torch.int64, dev)
    penalty = counts * freq[:, None] + (counts > 0).float() * pres[:, None]
    logits.index_copy_(0, index, logits.index_select(0, index) - penalty)


def _top_k_top_p(x: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask to -inf everything outside top-k, then outside the top-p nucleus of what is left.

    x: [R, V] fp32 (temperature applied); top_k: [R] int64 (0 = off); top_p: [R] fp32 (1 = off).
    Top-k keeps exactly k tokens (ties broken toward the lower token id). Top-p keeps the
    smallest prefix of the descending distribution whose mass reaches p (at least one token).
    """
    R, V = x.shape
    s, order = torch.sort(x, dim=-1, descending=True, stable=True)  # [R, V]
    pos = torch.arange(V, device=x.device).expand(R, V)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))
    keep = pos < k[:, None]
    s = s.masked_fill(~keep, float("-inf"))
    cum = torch.cumsum(torch.softmax(s, dim=-1), dim=-1)
    mass_before = torch.zeros_like(cum)  # mass of the tokens ranked above each token
    mass_before[:, 1:] = cum[:, :-1]
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    mask = torch.zeros_like(keep).scatter_(1, order, keep)
    return x.masked_fill(~mask, float("-inf"))


def process_logits(
    logits: Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    extra: tuple[Tensor, list[int]] | None = None,
) -> Tensor:
    """Raw logits [R, V] (any float dtype) -> processed fp32 logits [R, V].

    Row r depends only on logits[r], params[r] and histories[r] (the generated tokens before
    that row; `extra` adds device-resident tokens to some rows' histories, see `_penalize`).
    Greedy rows get penalties only; sampled rows also temperature, top-k and top-p.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(histories)
    x = logits.float().clone()  # [R, V]
    _penalize(x, params, histories, extra)
    sampled = [r for r, p in enumerate(params) if not p.is_greedy]
    if not sampled:
        return x
    dev = x.device
    index = _host_tensor(sampled, torch.int64, dev)
    temp = _host_tensor([params[r].temperature for r in sampled], torch.float32, dev)
    y = x.index_select(0, index) / temp[:, None]
    if any(params[r].top_k > 0 or params[r].top_p < 1.0 for r in sampled):
        top_k = _host_tensor([params[r].top_k for r in sampled], torch.int64, dev)
        top_p = _host_tensor([params[r].top_p for r in sampled], torch.float32, dev)
        y = _top_k_top_p(y, top_k, top_p)
    x.index_copy_(0, index, y)
    return x


def _argmax(x: Tensor) -> Tensor:
    """[R, V] -> [R] int64, lowest index on ties: the Triton kernel where the dispatch says so."""
    if kernels.use_triton(x):
        from freetoken.kernels import sampling_triton

        return sampling_triton.argmax(x)
    return sampling_ref.argmax(x)


def _one_hot_argmax(x: Tensor) -> Tensor:
    """[R, V] -> [R, V] fp32 one-hot at the argmax (lowest index on ties)."""
    out = torch.zeros_like(x, dtype=torch.float32)
    return out.scatter_(1, _argmax(x)[:, None], 1.0)


def probs(logits: Tensor, params: Sequence[SamplingParams], histories: Sequence[Sequence[int]]) -> Tensor:
    """The distribution [R, V] fp32 each row is sampled from; one-hot at the argmax for greedy rows."""
    x = process_logits(logits, params, histories)
    p = torch.softmax(x, dim=-1)
    if any(q.is_greedy for q in params):
        greedy = _host_tensor([q.is_greedy for q in params], torch.bool, x.device)
        p = torch.where(greedy[:, None], _one_hot_argmax(x), p)
    return p


def _uniforms(
    generators: Sequence[torch.Generator | None], needed: Sequence[bool], n: int, device: torch.device
) -> Tensor:
    """[len(generators), n] fp64 uniforms in [0, 1); row r from generators[r] where needed[r]
    (torch's default generator if that is None), zeros elsewhere."""
    zeros = torch.zeros(n, dtype=torch.float64, device=device)
    rows = [
        torch.rand(n, generator=g, device=g.device if g is not None else device, dtype=torch.float64).to(device) if need else zeros
        for g, need in zip(generators, needed)
    ]
    return torch.stack(rows) if rows else torch.zeros(0, n, dtype=torch.float64, device=device)


def _inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """One draw per row from unnormalized non-negative fp32 weights [R, V] with uniforms u [R] -> [R] int64.

    The chosen token always has positive weight (rows with zero total return 0). CPU and GPU pick
    the same token for the same uniform: both follow sampling_ref's integer CDF.
    """
    if kernels.use_triton(weights):
        from freetoken.kernels import sampling_triton

        return sampling_triton.inverse_cdf(weights, u)
    return sampling_ref.inverse_cdf(weights, u)


def draw(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """One token per row from a distribution probs [R, V] fp32 -> [R] int64, one uniform from each
    row's generator (the draw `sample` makes)."""
    u = _uniforms(generators, [True] * len(generators), 1, probs.device)[:, 0]
    return _inverse_cdf(probs, u)


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
) -> Tensor:
    """One token per row -> [R] int64; greedy rows take the argmax, sampled rows one draw each."""
    x = process_logits(logits, params, histories)
    sampled = [r for r, p in enumerate(params) if not p.is_greedy]
    if len(sampled) < len(params):
        tokens = _argmax(x)
    else:
        tokens = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    if sampled:
        index = _host_tensor(sampled, torch.int64, x.device)
        p = torch.softmax(x.index_select(0, index), dim=-1)
        tokens.index_copy_(0, index, draw(p, [generators[r] for r in sampled]))
    return tokens


@dataclass
class VerifyResult:
    accepted_len: Tensor  # [B] int64, number of accepted drafts (0..k)
    next_token: Tensor  # [B] int64, the correction token (first rejection) or the bonus token


def verify(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
) -> VerifyResult:
    """Accept a prefix of the drafts and emit one more token, losslessly.

    target_logits: [B, k+1, V] raw target logits; row i scores the token after draft i.
    draft_tokens:  [B, k] int64.
    draft_probs:   [B, k, V] the draft distributions q_i the drafts were sampled from, or None
                   for deterministic drafts (one-hot q).
    histories[b]:  the generated tokens of request b before this step; row i sees
                   histories[b] + draft_tokens[b, :i].
    Greedy requests accept while the draft equals the argmax and emit the argmax of the first
    mismatching row (or of row k: the bonus). Sampled requests accept d_i with probability
    min(1, p_i(d_i) / q_i(d_i)), emit a draw from norm(max(0, p_i - q_i)) at the first rejection,
    or a bonus draw from row k's p when all k are accepted.
    """
    B, k1, V = target_logits.shape
    k = k1 - 1
    dev = target_logits.device
    assert draft_tokens.shape == (B, k) and len(params) == len(histories) == len(generators) == B
    drafts = draft_tokens.to(device=dev, dtype=torch.int64)
    if all(sp.is_plain_greedy for sp in params):
        return greedy_verify(target_logits, drafts)
    row_params = [sp for sp in params for _ in range(k1)]
    row_histories = [histories[b] if params[b].has_penalties else () for b in range(B) for _ in range(k1)]
    # row (b, i) also sees drafts[b, :i]; they are gathered on the device, without a host copy
    pairs = [(b * k1 + i, b * k + j) for b in range(B) if params[b].has_penalties for i in range(k1) for j in range(i)]
    extra = None
    if pairs:
        at = _host_tensor([f for _, f in pairs], torch.int64, dev)
        extra = (drafts.reshape(-1).index_select(0, at), [r for r, _ in pairs])
    x = process_logits(target_logits.reshape(B * k1, V), row_params, row_histories, extra)  # [B*(k+1), V]
    argmax = _argmax(x).view(B, k1)  # [B, k+1]
    rows = torch.arange(B, device=dev)
    if all(sp.is_greedy for sp in params):
        return _greedy_accept(argmax, drafts)
    x = x.view(B, k1, V)
    greedy = _host_tensor([sp.is_greedy for sp in params], torch.bool, dev)  # [B]
    p = torch.softmax(x, dim=-1)  # [B, k+1, V] target distributions

    u = _uniforms(generators, [not sp.is_greedy for sp in params], k1, dev)  # [B, k+1]: k accepts + 1 draw
    p_d = p[:, :k].gather(2, drafts[..., None]).squeeze(2).double()  # [B, k]
    if draft_probs is not None:
        q = draft_probs.to(device=dev, dtype=torch.float32)  # [B, k, V]
        q_d = q.gather(2, drafts[..., None]).squeeze(2).double()
    else:
        q = None
        q_d = torch.ones_like(p_d)
    accept = torch.where(greedy[:, None], drafts == argmax[:, :k], u[:, :k] * q_d < p_d)  # [B, k]
    accepted_len = accept.long().cumprod(dim=1).sum(dim=1)  # [B]

    target = p[rows, accepted_len]  # [B, V]
    rejected = accepted_len < k
    if k > 0:
        at = accepted_len.clamp(max=k - 1)
        if q is not None:
            q_at = q[rows, at]
        else:
            q_at = torch.zeros(B, V, device=dev).scatter_(1, drafts[rows, at][:, None], 1.0)
        residual = (target - q_at).clamp_(min=0)
        usable = rejected & (residual.sum(dim=-1) > 0)
        target = torch.where(usable[:, None], residual, target)
    drawn = _inverse_cdf(target, u[:, k])
    next_token = torch.where(greedy, argmax[rows, accepted_len], drawn)
    return VerifyResult(accepted_len=accepted_len, next_token=next_token)


def greedy_verify(target_logits: Tensor, drafts: Tensor) -> VerifyResult:
    """`verify` for greedy requests without penalties, on the device only (a CUDA graph captures it).

    target_logits: [B, k+1, V] raw logits (the argmax of any float dtype equals that of its fp32
    copy); drafts: [B, k] int64 on the same device.
    """
    B, k1, V = target_logits.shape
    return _greedy_accept(_argmax(target_logits.reshape(B * k1, V)).view(B, k1), drafts)


def greedy_verify_stacked(target_logits: Tensor, drafts: Tensor, last_tokens: Tensor | None = None) -> Tensor:
    """`greedy_verify` as one [2, B] int64 tensor (accepted_len, next_token), the next tokens also
    copied into last_tokens[:B] when given: in two Triton launches where the dispatch says so.

    target_logits: [B * (k+1), V] raw logits of any float dtype; drafts: [B, k] int64."""
    if kernels.TRITON_STEP_GLUE and kernels.use_triton(target_logits):
        from freetoken.kernels import sampling_triton

        return sampling_triton.greedy_verify(target_logits, drafts, last_tokens)
    B, k = drafts.shape
    verified = greedy_verify(target_logits.view(B, k + 1, -1), drafts)
    if last_tokens is not None:
        last_tokens[:B].copy_(verified.next_token)
    return torch.stack([verified.accepted_len, verified.next_token])


def _greedy_accept(argmax: Tensor, drafts: Tensor) -> VerifyResult:
    """argmax [B, k+1], drafts [B, k]: accept while the draft is the argmax, then emit the argmax."""
    accepted_len = (drafts == argmax[:, :-1]).long().cumprod(dim=1).sum(dim=1)  # [B]
    next_token = argmax.gather(1, accepted_len[:, None]).squeeze(1)  # [B]
    return VerifyResult(accepted_len=accepted_len, next_token=next_token)


def apply_stop(
    tokens: Sequence[int],
    params: SamplingParams,
    eos_ids: Sequence[int] | set[int],
    num_generated_before: int = 0,
) -> tuple[list[int], bool]:
    """Cut newly emitted tokens where plain decoding would have stopped -> (kept, finished).

    Stops after the first stop token, the first EOS (unless ignore_eos), or once
    num_generated_before + len(kept) reaches max_new_tokens; the stopping token is kept.
    """
    eos = set() if params.ignore_eos else set(eos_ids)
    stops = set(params.stop_token_ids)
    kept: list[int] = []
    if num_generated_before >= params.max_new_tokens:
        return kept, True
    for t in tokens:
        kept.append(t)
        if t in stops or t in eos or num_generated_before + len(kept) >= params.max_new_tokens:
            return kept, True
    return kept, False
