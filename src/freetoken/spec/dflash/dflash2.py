"""The two modules DFlash2 adds to a DFlash draft (shared/reference/dflash.md §3).

`GroupedDynamicConv` wraps each sublayer (attention, MLP) of a draft layer: `prepare` convolves the
sublayer's normed input over the block's rows and predicts the kernel `finish` applies to the
sublayer's output. Each convolution is causal within the block (row i reads rows i, i-1, ...,
i-K+1; rows before the anchor are zeros): out[i] = sum_t (base[t] + dyn[i, t, g]) * x[i - t], the
dynamic part dyn = kernel_projection(normed input) shared by the `group_size` channels of group g.
The context rows never pass through it.

`CandidateSelector` replaces each slot's argmax: the top_k tokens of a slot's logits are its
candidates, and a walk from the anchor scores candidate c after predecessor a as
logit[c] + <A[a] * P h_slot, B[c]> (A, B the predecessor and successor codebooks [V, r], P the
hidden projection [r, H]); greedy takes the best score, sampling draws from softmax(score / T).

Numerics follow the package's torch modules: the convolution and the pairwise term in the draft's
dtype, the products summed in its order (base tap, then the dynamic one); the unary logits fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken import sampling
from freetoken.spec.dflash.config import DFlashConfig


def _shifted(rows: torch.Tensor, t: int) -> torch.Tensor:  # [..., B, G, g] -> same: row i holds rows[i - t], zeros before row t
    out = torch.zeros_like(rows)
    n = rows.shape[-3]
    if t < n:
        out[..., t:, :, :] = rows[..., : n - t, :, :]
    return out


def grouped_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """x [..., B, H] (blocks' rows), dynamic [..., B, K, G], base [K, H] -> [..., B, H]:
    out[i] = sum_t base[t] * x[i - t] + dynamic[i, t, g] * x[i - t], summed tap by tap in that order."""
    hidden, groups = x.shape[-1], dynamic.shape[-1]
    rows = x.view(*x.shape[:-1], groups, hidden // groups)
    out = torch.zeros_like(rows)
    for t in range(base.shape[0]):
        shifted = _shifted(rows, t)
        out = out + base[t].view(groups, -1) * shifted
        out = torch.addcmul(out, dynamic[..., t, :, None], shifted)
    return out.view(x.shape)


class GroupedDynamicConv(nn.Module):
    """`attention_conv` / `mlp_conv` of a DFlash2 layer: base_kernel [2 (prepare, finish), K, H],
    kernel_projection [2 * K * G, H]."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        k, h, g = cfg.conv_kernel_size, cfg.hidden_size, cfg.num_conv_groups
        self.kernel_size, self.num_groups = k, g
        self.base_kernel = nn.Parameter(torch.empty(2, k, h), requires_grad=False)
        self.kernel_projection = nn.Linear(h, 2 * k * g, bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's normed input x [..., B, H] -> (its convolution [..., B, H], the finishing kernel [..., B, K, G])."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.num_groups)
        return grouped_conv(x, dynamic[..., 0, :, :], self.base_kernel[0]), dynamic[..., 1, :, :]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        """The sublayer's output y [..., B, H] and prepare's kernel [..., B, K, G] -> [..., B, H]."""
        return grouped_conv(y, dynamic, self.base_kernel[1])


class CandidateSelector(nn.Module):
    """`candidate_selector`: the codebooks [V, r] (stored without `.weight`) and hidden_projection [r, H]."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank), requires_grad=False)
        self.successor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank), requires_grad=False)
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot logits [..., V] fp32 -> their top_k (values, token ids) [..., top_k], best first."""
        return torch.topk(logits, self.top_k, dim=-1, sorted=True)

    def scores(self, unary: torch.Tensor, candidate_ids: torch.Tensor, predecessors: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
        """One slot of n walks: unary, candidate_ids [n, top_k] (from `candidates`), predecessors [n]
        (the token each walk chose last, the anchor first), projected [n, r] (hidden_projection of the
        slot's hidden) -> scores [n, top_k] fp32."""
        query = self.predecessor_codebook[predecessors] * projected  # [n, r]
        pairwise = torch.einsum("nr,nkr->nk", query, self.successor_codebook[candidate_ids])
        return unary + pairwise

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor, temperatures: list[float],
             generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """n walks over k slots: hidden [n, k, H] and logits [n, k, V] fp32 of the slots, anchors [n]
        -> (drafts [n, k], their distributions q [n, k, V] fp32, None when every walk is greedy).

        A walk at temperature 0 takes the best score (the first candidate on ties); otherwise it draws
        from softmax(score / T) over the candidates with one uniform of its generator a slot, and q is
        that distribution (one-hot at the pick for the greedy walks of a mixed batch). Only the
        temperature applies here, as in the dflash package: q need not be the target's processed
        distribution, the verify is exact for any q."""
        sampled = [i for i, t in enumerate(temperatures) if t > 0]
        if not sampled:
            return self.greedy_walk(hidden, logits, anchors), None
        unary, candidate_ids = self.candidates(logits)  # [n, k, top_k]
        projected = self.hidden_projection(hidden)  # [n, k, r]
        index = torch.tensor(sampled, dtype=torch.long, device=logits.device)
        temperature = torch.tensor([temperatures[i] for i in sampled], dtype=torch.float32, device=logits.device)[:, None]
        chosen, drafts, probs = anchors, [], []
        for j in range(logits.shape[1]):
            scores = self.scores(unary[:, j], candidate_ids[:, j], chosen, projected[:, j])  # [n, top_k] fp32
            chosen = candidate_ids[:, j].gather(1, scores.argmax(dim=-1, keepdim=True))[:, 0]
            q = torch.zeros_like(logits[:, j]).scatter_(1, chosen[:, None], 1.0)  # [n, V]
            over_candidates = torch.softmax(scores[index] / temperature, dim=-1)
            q[index] = torch.zeros_like(q[index]).scatter_(1, candidate_ids[index, j], over_candidates)
            chosen[index] = sampling.draw(q[index], [generators[i] for i in sampled])
            probs.append(q)
            drafts.append(chosen)
        return torch.stack(drafts, dim=1), torch.stack(probs, dim=1)

    def greedy_walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """`walk` with every temperature 0: hidden [n, k, H], logits [n, k, V] fp32, anchors [n] -> drafts
        [n, k]. Device work alone (no host sync), so a CUDA graph can hold it."""
        unary, candidate_ids = self.candidates(logits)  # [n, k, top_k]
        projected = self.hidden_projection(hidden)  # [n, k, r]
        chosen, drafts = anchors, []
        for j in range(logits.shape[1]):
            scores = self.scores(unary[:, j], candidate_ids[:, j], chosen, projected[:, j])  # [n, top_k] fp32
            chosen = candidate_ids[:, j].gather(1, scores.argmax(dim=-1, keepdim=True))[:, 0]
            drafts.append(chosen)
        return torch.stack(drafts, dim=1)
