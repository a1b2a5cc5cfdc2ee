"""Greedy parity: the same prompts decoded with and without speculative decoding, token by token.

`compare_greedy` runs both from one loaded model and reports per prompt whether the streams are
identical and, where not, the first divergence with the target's top-2 logit margin at that point.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from freetoken.sampling import SamplingParams


@dataclass
class Divergence:
    prompt_index: int
    position: int  # index into the generated tokens
    expected: int  # token without spec (or from the reference)
    actual: int  # token with spec
    top2_margin: float | None  # target logit gap between its two best tokens at that point


@dataclass
class ParityReport:
    num_prompts: int
    num_tokens: int  # generated tokens compared
    num_matching: int
    per_prompt_match: list[bool]
    first_divergence: Divergence | None
    acceptance_per_position: list[float]
    mean_accepted_len: float

    @property
    def passed(self) -> bool:
        return self.first_divergence is None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        return d


def first_divergence(expected: list[list[int]], actual: list[list[int]]) -> tuple[Divergence | None, int, int, list[bool]]:
    total = matching = 0
    first = None
    per_prompt = []
    for i, (e, a) in enumerate(zip(expected, actual)):
        n = max(len(e), len(a))
        total += n
        same = sum(1 for x, y in zip(e, a) if x == y)
        matching += same
        per_prompt.append(e == a)
        if e != a and first is None:
            pos = next((j for j, (x, y) in enumerate(zip(e, a)) if x != y), min(len(e), len(a)))
            first = Divergence(i, pos, e[pos] if pos < len(e) else -1, a[pos] if pos < len(a) else -1, None)
    return first, total, matching, per_prompt


@torch.no_grad()
def top2_margin(llm, token_ids: list[int]) -> float:
    """The target's logit gap between its two best next tokens after token_ids."""
    from freetoken.engine.runner import RowGroup, build_context
    from freetoken.forward_context import ForwardMode

    engine = llm.make_engine(replace(llm.config, spec="none", num_draft_tokens=0))
    table: list[int] = []
    engine.kv_pool.grow(table, len(token_ids))
    slot = engine.state_pool.allocate() if engine.state_pool is not None else None
    ctx = build_context([RowGroup(table, slot, 0, list(token_ids))], ForwardMode.EXTEND, engine.kv_pool, engine.state_pool, engine.device)
    logits = llm.model.compute_logits(llm.model(ctx)[-1:])[0]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def compare_greedy(llm, prompts: list[list[int]], max_new_tokens: int, num_draft_tokens: int, spec: str = "mtp") -> ParityReport:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    base, _ = llm.generate_ids(prompts, params, replace(llm.config, spec="none", num_draft_tokens=0))
    spec_reqs, stats = llm.generate_ids(prompts, params, replace(llm.config, spec=spec, num_draft_tokens=num_draft_tokens))
    expected = [r.output_token_ids for r in base]
    actual = [r.output_token_ids for r in spec_reqs]
    first, total, matching, per_prompt = first_divergence(expected, actual)
    if first is not None:
        first.top2_margin = top2_margin(llm, prompts[first.prompt_index] + expected[first.prompt_index][: first.position])
    return ParityReport(len(prompts), total, matching, per_prompt, first, stats.acceptance_per_position, stats.mean_accepted_len)
