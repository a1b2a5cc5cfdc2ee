"""Image prompts on qwen4_exp (Qwen3.8-Flash-Next): the fixture with a redrawn vision tower, with its
own RoPE and made YaRN. Its QSA layers select keys sparsely here (budget 8, blocks of 4, prompts of
over 150 tokens), so the indexer's pooled block keys take the mRoPE positions of their first tokens;
PLE hashes the image-pad ids like any token.

Oracles: transformers' `Qwen4ExpForConditionalGeneration` with `pixel_values`, `image_grid_thw` and
`mm_token_type_ids` (whole-prompt logits, fp32; greedy `generate`); the same engine without
speculative decoding (greedy, token for token, fp32 and bf16) and without chunked prefill. The prefix
cache on image prompts: test_prefix_cache_images.py.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.config import EngineConfig
from tests.engine.test_image_prompts import IMAGES, PROMPTS, TWO_IMAGES, _generate, _hf_greedy, _llm, _logits_and_hf
from tests.models.vision.conftest import vl_qwen4_exp  # noqa: F401 (a fixture)


@pytest.mark.parametrize("rope", ["default", "yarn"])
@torch.no_grad()
def test_prompt_logits_match_transformers(vl_qwen4_exp, rope):  # noqa: F811
    hf_dir, unified = vl_qwen4_exp[rope]
    llm = _llm(str(unified))
    assert llm.model.config.rope_type == rope
    ids, _, got, ctx, want = _logits_and_hf(llm, hf_dir)
    assert ctx.positions.shape == (3, len(ids)) and len(ids) > 150
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("rope", ["default", "yarn"])
@torch.no_grad()
def test_greedy_continuation_matches_transformers_generate(vl_qwen4_exp, rope):  # noqa: F811
    hf_dir, unified = vl_qwen4_exp[rope]
    llm = _llm(str(unified))
    assert _generate(llm, [TWO_IMAGES], 6)[0] == _hf_greedy(llm, hf_dir, 6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_spec_mtp_equals_no_spec(vl_qwen4_exp, dtype):  # noqa: F811
    unified = str(vl_qwen4_exp["default"][1])
    want = _generate(_llm(unified, dtype), PROMPTS, 12)
    assert _generate(_llm(unified, dtype, "mtp", 2), PROMPTS, 12) == want


def test_chunked_prefill_across_an_image_equals_unchunked(vl_qwen4_exp):  # noqa: F811
    unified = str(vl_qwen4_exp["yarn"][1])
    llm = _llm(unified)
    pads = llm.encode_with_images(TWO_IMAGES[0], [IMAGES[n] for n in TWO_IMAGES[1]])[1].pad_spans
    assert pads[0][0] < 32 < pads[0][1]  # a 32-token chunk ends inside the first image
    chunked = EngineConfig(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=32, prefill_align=16)
    assert _generate(llm, PROMPTS, 8, chunked) == _generate(llm, PROMPTS, 8)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_spec_mtp_equals_no_spec_and_cpu_tokens(vl_qwen4_exp):  # noqa: F811
    """On the GPU: image prompts give the same greedy tokens with and without MTP in bf16, and fp32 greedy
    tokens (4) equal those of the CPU run."""
    unified = str(vl_qwen4_exp["yarn"][1])
    want = _generate(_llm(unified, "bfloat16", device="cuda"), PROMPTS, 16)
    assert _generate(_llm(unified, "bfloat16", "mtp", 2, device="cuda"), PROMPTS, 16) == want
    assert _generate(_llm(unified, "float32", device="cuda"), PROMPTS, 4) == _generate(_llm(unified), PROMPTS, 4)
