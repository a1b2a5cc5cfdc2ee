"""The prefix cache shares pages across identical images, and only across identical images.

Oracle: the same engine with the cache off (token for token, and the same accepted drafts), on the
Qwen3.5 dense and qwen4_exp fixtures with redrawn vision towers, greedy and seeded sampling, --spec
none and mtp (dflash on Qwen3.5 dense). Every prompt is 90 tokens of text, one image (70 pads at
91..160) and 90 more tokens of text before its own question, so the deepest snapshot two of them
share is at 192, past the image. The cache-on engine runs two batches: the first computes the
prefix through image `a` (and, through a text-only prompt, a snapshot at 64); in the second, image
`a` again hits at 192, while image `c` (same size, so the same token ids, other pixels) hits only at
64, before its first pad. Positions are checked on the layouts: same text and image before a token,
same positions, whatever comes later.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.llm import LLM
from freetoken.sampling import SamplingParams
from tests.conftest import FIXTURES, convert_unified
from tests.engine.test_image_prompts import IMAGES, LONG_TEXT
from tests.models.vision.conftest import random_image, vl_checkpoints, vl_qwen4_exp, write_redrawn_checkpoint  # noqa: F401 (fixtures)

SAME_SIZE_AS_A = random_image(32, 48, 5)  # image "a"'s grid, other pixels
PICTURES = {"a": IMAGES["a"], "b": IMAGES["b"], "c": SAME_SIZE_AS_A}
FIRST_BATCH = [(LONG_TEXT + "<image>" + LONG_TEXT + "what is it?", "a"), (LONG_TEXT + "<image>" + LONG_TEXT + "which colour?", "a"),
               (LONG_TEXT + "no image here", None)]
SECOND_BATCH = [(LONG_TEXT + "<image>" + LONG_TEXT + "what is it?", "c"), (LONG_TEXT + "<image>" + LONG_TEXT + "how many?", "a")]
NEW_TOKENS = 6
SAMPLED = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, presence_penalty=0.3)


@lru_cache(maxsize=None)
def _llm(path: str, spec: str, device: str = "cpu", dtype: str = "float32") -> LLM:
    k = 0 if spec == "none" else 2
    return LLM(path, EngineConfig(device=device, dtype=dtype, max_num_seqs=4, max_model_len=512, spec=spec, num_draft_tokens=k, seed=7))


def _encoded(llm: LLM, prompts):
    """-> (token ids, RequestImages or None) per prompt, each encoded afresh (features are per request)."""
    out = []
    for text, name in prompts:
        out.append(llm.encode_with_images(text, [PICTURES[name]]) if name else (llm.encode(text), None))
    return out


def _generate(engine, llm: LLM, prompts, params):
    encoded = _encoded(llm, prompts)
    return engine.generate([ids for ids, _ in encoded], params, images=[im for _, im in encoded])


def _check_cache_on_equals_off(llm: LLM, params: SamplingParams) -> None:
    off = _generate(llm.make_engine(with_images=True), llm, FIRST_BATCH + SECOND_BATCH, params)
    engine = llm.make_engine(replace(llm.config, prefix_cache=True), with_images=True)
    on = _generate(engine, llm, FIRST_BATCH, params) + _generate(engine, llm, SECOND_BATCH, params)
    assert [r.output_token_ids for r in on] == [r.output_token_ids for r in off]
    assert [r.accepted_lens for r in on] == [r.accepted_lens for r in off]
    assert all(len(r.output_token_ids) == NEW_TOKENS for r in on)
    first_pad, pads_end = on[0].images.pad_spans[0]
    assert (first_pad, pads_end) == (91, 161)
    # image a: past the image (192) twice; image c: before its first pad only (64, the text-only prompt's snapshot)
    assert (engine.prefix_cache.stats.hits, engine.prefix_cache.stats.cached_tokens) == (3, 192 + 64 + 192)
    # the vision tower ran for the requests that computed an image pad, not for the hits past the image
    assert [r.images is not None and r.images.features is not None for r in on] == [True, False, False, True, False]


@pytest.mark.parametrize("spec,params", [("none", SamplingParams(max_new_tokens=NEW_TOKENS)), ("none", SAMPLED),
                                         ("mtp", SamplingParams(max_new_tokens=NEW_TOKENS)), ("mtp", SAMPLED)])
def test_qwen35_dense_identical_images_share_pages_exactly(vl_checkpoints, spec, params):  # noqa: F811
    _check_cache_on_equals_off(_llm(str(vl_checkpoints["qwen35_dense"][1]), spec), params)


@pytest.mark.parametrize("spec,params", [("none", SamplingParams(max_new_tokens=NEW_TOKENS)), ("mtp", SAMPLED)])
def test_qwen4_exp_identical_images_share_pages_exactly(vl_qwen4_exp, spec, params):  # noqa: F811
    _check_cache_on_equals_off(_llm(str(vl_qwen4_exp["default"][1]), spec), params)


@pytest.mark.skipif(not (FIXTURES / "qwen35_dense_dflash").is_dir(), reason="DFlash fixtures absent")
def test_qwen35_dense_dflash_identical_images_share_pages_exactly(tmp_path):
    hf = write_redrawn_checkpoint("qwen35_dense", tmp_path / "hf")
    unified = convert_unified(hf, tmp_path / "unified", dflash=FIXTURES / "qwen35_dense_dflash" / "dflash")
    _check_cache_on_equals_off(_llm(str(unified), "dflash"), SamplingParams(max_new_tokens=NEW_TOKENS))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen35_dense", "qwen4_exp"])
@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_identical_images_share_pages_exactly_on_the_gpu(vl_checkpoints, vl_qwen4_exp, family, spec):  # noqa: F811
    """bf16 on the Triton kernels, decode and verify graphed where the model allows it."""
    path = vl_checkpoints["qwen35_dense"][1] if family == "qwen35_dense" else vl_qwen4_exp["default"][1]
    _check_cache_on_equals_off(_llm(str(path), spec, "cuda", "bfloat16"), SamplingParams(max_new_tokens=NEW_TOKENS))


@torch.no_grad()
def test_same_text_and_image_before_a_token_give_it_the_same_position_and_key(vl_checkpoints):  # noqa: F811
    llm = _llm(str(vl_checkpoints["qwen35_dense"][1]), "none")
    shared = LONG_TEXT + "<image>" + LONG_TEXT
    ids, a = llm.encode_with_images(shared + "done", [PICTURES["a"]])
    longer_ids, a_then_b = llm.encode_with_images(shared + "and <image> too", [PICTURES["a"], PICTURES["b"]])
    n = len(llm.encode_with_images(shared, [PICTURES["a"]])[0])
    assert ids[:n] == longer_ids[:n] and a.content_hashes[0] == a_then_b.content_hashes[0]
    assert torch.equal(a.positions(0, n), a_then_b.positions(0, n))  # a later image does not move earlier tokens
    assert a.positions(n, 1)[0, 0] == n + a.rope_delta < n  # past the image a token sits before its index (the grid's doing)

    c_ids, c = llm.encode_with_images(shared + "done", [PICTURES["c"]])
    _, b = llm.encode_with_images(shared + "done", [PICTURES["b"]])
    assert c_ids == ids and torch.equal(c.positions(0, len(ids)), a.positions(0, len(ids)))  # only the pixels differ
    assert c.content_hashes != a.content_hashes and c.content_key(80, 96) != a.content_key(80, 96)
    assert a.content_key(0, 91) == () and a.content_key(96, 112) == ((a.content_hashes[0], 5),)
    assert not torch.equal(b.positions(n, 1), a.positions(n, 1))  # another grid: other positions after it
