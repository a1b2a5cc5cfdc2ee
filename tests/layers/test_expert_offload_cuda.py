"""MoE expert offload on a GPU: the Triton kernels through slot_of, pinned host stores, hybrid on the CPU.

Oracles: the fully resident model on the same GPU (eager rows bit for bit; its CUDA-graphed greedy
tokens), greedy without speculative decoding, and (hybrid) the resident logits within a tolerance:
the CPU's products (linear_ref per row) round differently from the GPU's grouped GEMMs in the last
bits, about one bf16 ulp (2^-8 relative) per product, which the four layers carry into the logits;
0.1 absolute on logits of magnitude ~5 is some 25 bf16 ulps of the largest logit and still catches
a wrong expert or a dropped product (differences of order 1). In fp32 the bound is 1e-4.
Also on CPU: the non-expert fit check against a device's free memory (mem_get_info stubbed).
"""

from __future__ import annotations

import pytest
import torch

from freetoken.checkpoint.reader import UnifiedCheckpoint
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.errors import FreetokenError
from freetoken.layers.offload_config import ExpertOffloadConfig
from freetoken.models.expert_offload import ExpertOffloader
from freetoken.models.loader import load_model
from tests.conftest import TinySpec, greedy, run_rows

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROMPTS = [[5, 17, 30, 2, 99, 100, 7, 8, 44, 45, 46, 47, 48], [90, 3, 3, 71], [12, 60, 61, 62, 20, 21]]
TOL = {torch.float32: 1e-4, torch.bfloat16: 0.1}


def load(path, dtype, offload=None, device="cuda"):
    ck = UnifiedCheckpoint.open(path)
    return load_model(ck, ck.family, ck.config, with_mtp=True, device=device, dtype=dtype, expert_offload=offload)


def generate(model, dtype, spec="none", k=0, graphs=True):
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    config = EngineConfig(device="cuda", dtype=name, max_num_seqs=3, max_model_len=128, spec=spec, num_draft_tokens=k,
                          cuda_graphs=graphs)
    return [r.output_token_ids for r in LLMEngine(model, config).generate(PROMPTS, greedy(12))]


def checkpoints(fixture_unified, tiny_checkpoint):
    """The fixture (shared expert wider than a routed one: dense) and a tiny MoE whose shared expert is stacked as expert E."""
    stacked = tiny_checkpoint(TinySpec(moe=True, shared_expert_intermediate_size=32))[1]
    return {"dense-shared": fixture_unified("qwen35_moe"), "stacked": stacked}


def slots_gb(slots: int, dtype: torch.dtype, path) -> float:
    """--expert-cache-gb for `slots` slots in each of the 5 MoE layers (4 trunk + MTP): an expert is 3 * H * I values."""
    cfg = UnifiedCheckpoint.open(path).config
    return 5 * slots * 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * dtype.itemsize / 2**30


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("which", ["dense-shared", "stacked"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_cache_is_the_resident_model_bit_for_bit(fixture_unified, tiny_checkpoint, which, dtype):
    path = checkpoints(fixture_unified, tiny_checkpoint)[which]
    resident = load(path, dtype)
    cached = load(path, dtype, ExpertOffloadConfig("cache", expert_cache_gb=slots_gb(3, dtype, path)))
    for ids in PROMPTS:
        want, got = run_rows(resident, ids)[0], run_rows(cached, ids)[0]
        assert torch.equal(resident.compute_logits(want), cached.compute_logits(got))
    tokens = generate(resident, dtype)  # graphed
    assert generate(cached, dtype) == tokens
    assert generate(cached, dtype, "mtp", 2) == tokens
    stores = [m.offload.cache for m in cached.modules() if getattr(m, "offload", None) is not None]
    assert all(c.stats.evictions > 0 for c in stores)
    assert all(c.store._gate_up.is_pinned() for c in stores)
    if which == "stacked":
        assert all(c.gate_up.shape[0] == c.num_slots + 1 for c in stores)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_hybrid_spec_equals_no_spec_and_is_close_to_resident(fixture_unified, dtype):
    path = fixture_unified("qwen35_moe")
    hybrid = load(path, dtype, ExpertOffloadConfig("hybrid", gpu_experts=3))
    plain = generate(hybrid, dtype)
    assert generate(hybrid, dtype, "mtp", 2) == plain
    resident = load(path, dtype)
    for ids in PROMPTS:
        want = resident.compute_logits(run_rows(resident, ids)[0])
        got = hybrid.compute_logits(run_rows(hybrid, ids)[0])
        torch.testing.assert_close(got, want, rtol=0, atol=TOL[dtype])


def test_non_expert_weights_that_do_not_fit_are_one_line_errors(fixture_unified, monkeypatch):
    from freetoken.distributed.context import SINGLE
    from freetoken.models.registry import family_module

    ck = UnifiedCheckpoint.open(fixture_unified("qwen35_moe"))

    def meta_model():
        with torch.device("meta"):
            return family_module(ck.family).build(ck.config, True, SINGLE)

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 10**9))
    with pytest.raises(FreetokenError, match="does not fit even with every expert offloaded"):
        ExpertOffloader(ExpertOffloadConfig("hybrid", gpu_experts=0), "cuda", torch.float32).detach(meta_model())
    # the non-expert part (~1.5 MB) fits, 8 experts a layer do not
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1_500_000, 10**9))
    with pytest.raises(FreetokenError, match="lower --gpu-experts"):
        ExpertOffloader(ExpertOffloadConfig("hybrid", gpu_experts=8), "cuda", torch.float32).detach(meta_model())
