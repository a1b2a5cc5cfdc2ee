"""The prefix cache on the GPU path (GPU only): Triton kernels (the chunked GDN prefill's state at a
chunk boundary, restored into a slot), CUDA graphs for decode/verify and the MTP draft, bf16.

Oracle: the same engine with the cache off. Greedy outputs and accepted lengths must be identical,
and the cache must have been used (cached prompt tokens).
"""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.sampling import SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SYSTEM = [(i * 37 + 11) % 900 + 20 for i in range(150)]
SUFFIXES = [[(i * 13 + j * 101) % 900 + 20 for i in range(n)] for j, n in enumerate((3, 20, 41, 70, 9))]
PROMPTS = [SYSTEM + s for s in SUFFIXES] + [SYSTEM[:128] + [7, 8, 9]]


def _model(fixture_unified, family: str):
    from freetoken.checkpoint.reader import UnifiedCheckpoint
    from freetoken.models.loader import load_model

    ck = UnifiedCheckpoint.open(fixture_unified(family))
    return load_model(ck, ck.family, ck.config, with_mtp=True, device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("spec,k", [("none", 0), ("mtp", 2)])
@pytest.mark.parametrize("family", ["qwen35_dense", "qwen35_moe"])
def test_cache_on_equals_off_on_the_gpu(family, spec, k, fixture_unified):
    model = _model(fixture_unified, family)
    runs = {}
    for on in (False, True):
        config = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=4, max_model_len=320, spec=spec, num_draft_tokens=k,
                              prefix_cache=on)
        engine = LLMEngine(model, config)
        requests = engine.generate(PROMPTS, SamplingParams(max_new_tokens=32, ignore_eos=True))
        runs[on] = [r.output_token_ids for r in requests], [r.accepted_lens for r in requests], engine
    assert runs[True][:2] == runs[False][:2]
    assert runs[True][2].prefix_cache.stats.cached_tokens >= 128 * 4
