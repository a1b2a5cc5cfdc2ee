"""Hugging Face transformers as an oracle: build its model for a unified checkpoint.

The unified checkpoint uses HF's own tensor names, so the trunk loads name for name into
the transformers class of its family's `hf_text_config` (`Qwen3_5ForCausalLM`,
`Qwen3_5MoeForCausalLM`, `Qwen4ExpForCausalLM`). Used by `parity --against hf` and by the tests.
Needs `transformers`, which is not a runtime dependency.
"""

from __future__ import annotations

from typing import Any

import torch

from freetoken.errors import FreetokenError
from freetoken.models.loader import TensorSource


def hf_text_config(config: dict[str, Any], family: str = "qwen3_5"):
    """transformers' text config for a normalized config of `family` (its module's `hf_text_config`)."""
    from freetoken.models.registry import family_module

    return family_module(family).hf_text_config(config)


@torch.no_grad()
def load_hf_model(source: TensorSource, config: dict[str, Any], names: list[str], dtype: torch.dtype = torch.float32, family: str = "qwen3_5"):
    """transformers' causal LM for the trunk tensors of `source` (eager attention and experts); buffers
    transformers computes itself (qwen4_exp's n-gram hash constants) are not read."""
    from transformers import AutoModelForCausalLM

    hf_config = hf_text_config(config, family)
    hf_config._attn_implementation = "eager"
    hf_config._experts_implementation = "eager"
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    state = {n: source.get(n) for n in names if n.startswith(("model.", "lm_head.")) and not n.startswith("model.visual.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    buffers = dict(model.named_buffers())
    missing = [m for m in missing if not (m == "lm_head.weight" and hf_config.tie_word_embeddings) and m not in buffers]
    if missing or unexpected:
        raise FreetokenError(f"transformers model does not match the checkpoint: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if hf_config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]) -> list[int]:
    """transformers' own greedy generate for one prompt (no padding)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=list(eos_ids) or None, pad_token_id=eos_ids[0] if eos_ids else 0)
    return out[0, len(prompt):].tolist()
