"""`parity --against hf`: freetoken's greedy decoding vs transformers' `generate`, token by token."""

from __future__ import annotations

from dataclasses import replace

from freetoken.hf_oracle import hf_greedy, load_hf_model
from freetoken.parity import ParityReport, first_divergence
from freetoken.sampling import SamplingParams


def compare_with_hf(llm, prompts: list[list[int]], max_new_tokens: int) -> ParityReport:
    ckpt = llm.checkpoint
    hf_model = load_hf_model(ckpt, ckpt.config, ckpt.tensor_names(), dtype=llm.config.torch_dtype, family=ckpt.family)
    eos = tuple(llm.model.eos_token_ids)
    expected = [hf_greedy(hf_model, p, max_new_tokens, eos) for p in prompts]
    reqs, stats = llm.generate_ids(prompts, SamplingParams(max_new_tokens=max_new_tokens), replace(llm.config, spec="none", num_draft_tokens=0))
    actual = [r.output_token_ids for r in reqs]
    first, total, matching, per_prompt = first_divergence(expected, actual)
    return ParityReport(len(prompts), total, matching, per_prompt, first, [], 1.0)
