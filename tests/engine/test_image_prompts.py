"""Image prompts through the engine (Qwen3.5 dense and MoE fixtures with redrawn vision towers).

Oracles: transformers' `*ForConditionalGeneration` with `pixel_values`, `image_grid_thw` and
`mm_token_type_ids` (whole-prompt logits, fp32; greedy `generate`); the same engine without
speculative decoding (greedy, token for token, fp32 and bf16) and without chunked prefill. The prefix
cache on image prompts: test_prefix_cache_images.py.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.errors import FreetokenError
from freetoken.llm import LLM
from freetoken.sampling import SamplingParams
from tests.conftest import FIXTURES, convert_unified
from tests.models.vision.conftest import random_image, vl_checkpoints, write_redrawn_checkpoint  # noqa: F401 (a fixture)

IMAGES = {"a": random_image(32, 48, 0), "b": random_image(40, 24, 1)}  # grids 14x20 and 22x14 after the min-pixels upscale
TWO_IMAGES = ("look at <image> and then <image> now", ["a", "b"])
PROMPTS = [TWO_IMAGES, ("what is this", ["b"]), ("def fibonacci(n):", [])]
LONG_TEXT = "import os\n\n\ndef list_files(path):\n    return sorted(os.listdir(path))\n\n\n" * 3


@lru_cache(maxsize=None)
def _llm(path: str, dtype: str = "float32", spec: str = "none", k: int = 0, **kw) -> LLM:
    return LLM(path, EngineConfig(dtype=dtype, max_num_seqs=4, max_model_len=512, spec=spec, num_draft_tokens=k, **kw))


def _generate(llm: LLM, prompts, new_tokens: int, config: EngineConfig | None = None) -> list[list[int]]:
    texts, images = [p for p, _ in prompts], [[IMAGES[i] for i in names] for _, names in prompts]
    completions, _ = llm.generate(texts, SamplingParams(max_new_tokens=new_tokens), images=images, config=config)
    return [c.token_ids for c in completions]


def _hf(hf_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()


def _hf_inputs(llm: LLM, text: str, names: list[str]):
    ids, images = llm.encode_with_images(text, [IMAGES[n] for n in names])
    x = torch.tensor([ids])
    image_token = llm.checkpoint.config["image_token_id"]
    return (
        ids,
        images,
        dict(
            input_ids=x,
            pixel_values=images.pixel_values,
            image_grid_thw=torch.tensor(images.grids),
            mm_token_type_ids=(x == image_token).int(),
        ),
    )


def _logits_and_hf(llm: LLM, hf_dir):  # -> (ids, images, engine logits [T, V], the forward's context, transformers' logits)
    """The engine's and transformers' fp32 logits of the two-image prompt."""
    ids, images, inputs = _hf_inputs(llm, *TWO_IMAGES)
    want = _hf(hf_dir)(**inputs).logits[0].float()
    got, ctx = _prompt_logits(llm, ids, images)
    return ids, images, got, ctx, want


def _hf_greedy(llm: LLM, hf_dir, new_tokens: int) -> list[int]:
    """transformers' greedy continuation of the two-image prompt."""
    ids, _, inputs = _hf_inputs(llm, *TWO_IMAGES)
    return _hf(hf_dir).generate(**inputs, max_new_tokens=new_tokens, do_sample=False)[0, len(ids) :].tolist()


def _prompt_logits(llm, ids: list[int], images):  # -> (logits [T, V], the forward's context)
    """The engine's logits of one whole image prompt, prefilled in one piece from an empty cache."""
    from freetoken.engine.runner import RowGroup, build_context
    from freetoken.forward_context import ForwardMode

    engine = llm.make_engine(with_images=True)
    engine._encode_images(images, 0)
    table: list[int] = []
    engine.kv_pool.grow(table, len(ids))
    group = RowGroup(table, engine.state_pool.allocate(), 0, ids, images=images)
    ctx = build_context([group], ForwardMode.EXTEND, engine.kv_pool, engine.state_pool, engine.device)
    return llm.model.compute_logits(llm.model(ctx)), ctx


@pytest.mark.parametrize("model", ["qwen35_dense", "qwen35_moe"])
@torch.no_grad()
def test_prompt_logits_match_transformers(vl_checkpoints, model):  # noqa: F811
    hf_dir, unified = vl_checkpoints[model]
    llm = _llm(str(unified))
    ids, images, got, ctx, want = _logits_and_hf(llm, hf_dir)
    assert ctx.positions.shape == (3, len(ids))
    assert ctx.image_embeds.rows.numel() == sum(t * h * w for t, h, w in images.grids) // 4
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@torch.no_grad()
def test_greedy_continuation_matches_transformers_generate(vl_checkpoints):  # noqa: F811
    hf_dir, unified = vl_checkpoints["qwen35_dense"]
    llm = _llm(str(unified))
    assert _generate(llm, [TWO_IMAGES], 6)[0] == _hf_greedy(llm, hf_dir, 6)


@pytest.mark.parametrize("model", ["qwen35_dense", "qwen35_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_spec_mtp_equals_no_spec(vl_checkpoints, model, dtype):  # noqa: F811
    unified = str(vl_checkpoints[model][1])
    want = _generate(_llm(unified, dtype), PROMPTS, 12)
    assert _generate(_llm(unified, dtype, "mtp", 2), PROMPTS, 12) == want


def test_chunked_prefill_across_an_image_equals_unchunked(vl_checkpoints):  # noqa: F811
    unified = str(vl_checkpoints["qwen35_dense"][1])
    llm = _llm(unified)
    pads = llm.encode_with_images(*TWO_IMAGES[:1], [IMAGES[n] for n in TWO_IMAGES[1]])[1].pad_spans
    assert pads[0][0] < 32 < pads[0][1]  # a 32-token chunk ends inside the first image
    chunked = EngineConfig(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=32, prefill_align=16)
    assert _generate(llm, PROMPTS, 8, chunked) == _generate(llm, PROMPTS, 8)


@pytest.mark.skipif(not (FIXTURES / "qwen35_dense_dflash").is_dir(), reason="DFlash fixtures absent")
def test_spec_dflash_equals_no_spec(tmp_path):
    hf = write_redrawn_checkpoint("qwen35_dense", tmp_path / "hf")
    unified = str(convert_unified(hf, tmp_path / "unified", dflash=FIXTURES / "qwen35_dense_dflash" / "dflash"))
    want = _generate(_llm(unified), PROMPTS, 10)
    assert _generate(_llm(unified, "float32", "dflash"), PROMPTS, 10) == want


def test_a_checkpoint_without_a_vision_tower_refuses_images(tmp_path):
    unified = convert_unified(FIXTURES / "qwen35_dense" / "hf", tmp_path / "text", text_only=True)
    with pytest.raises(FreetokenError, match="no vision tower") as err:
        _generate(LLM(str(unified), EngineConfig(max_model_len=256)), [TWO_IMAGES], 2)
    assert "\n" not in str(err.value)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["qwen35_dense", "qwen35_moe"])
def test_cuda_bf16_spec_mtp_equals_no_spec_and_cpu_prompt_logits(vl_checkpoints, model):  # noqa: F811
    """On the GPU (Triton kernels, CUDA graphs for decode): image prompts give the same greedy tokens with and
    without MTP in bf16, and fp32 greedy tokens (4) equal those of the CPU reference path."""
    unified = str(vl_checkpoints[model][1])
    want = _generate(_llm(unified, "bfloat16", device="cuda"), PROMPTS, 16)
    assert _generate(_llm(unified, "bfloat16", "mtp", 2, device="cuda"), PROMPTS, 16) == want
    assert _generate(_llm(unified, "float32", device="cuda"), PROMPTS, 4) == _generate(_llm(unified), PROMPTS, 4)
