"""MoE expert offload on the qwen35_moe fixture (8 experts, top-2, 4 trunk MoE layers + 1 in the MTP head).

Oracles: the fully resident model (its logits bit for bit, its greedy tokens) and greedy generation
without speculative decoding; the slot cache against hand-worked LRU sequences and the host store's
own expert weights read straight from the checkpoint.

cache: 3 slots per layer (< 8 experts, so prompts force evictions, and a prefill's tokens split into
groups whose experts fit) gives the resident logits bit for bit in fp32 and bf16. hybrid: experts
[0, 3) resident; on this CPU-only machine the host products are the resident path's (linear_ref, the
call-invariant activations) and the order is ascending id, so the logits are the resident ones bit for
bit too (on a GPU the CPU's products may differ in the last bits: tests/layers/test_expert_offload_cuda.py);
greedy with MTP equals greedy without, within the mode.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.checkpoint.reader import UnifiedCheckpoint
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.errors import FreetokenError
from freetoken.layers.expert_cache import ExpertSlotCache
from freetoken.layers.expert_store import HostExpertStore
from freetoken.layers.offload_config import ExpertOffloadConfig, parse_gpu_experts
from freetoken.models.expert_offload import weight_memory
from freetoken.models.loader import load_model
from tests.conftest import TinySpec, greedy, run_rows

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MOE_LAYERS = 5  # 4 trunk layers + the MTP head's
EXPERT_ELEMENTS = 64 * 64 + 64 * 32  # gate_up [2I, H] + down [H, I] of the fixture
PROMPTS = [[5, 17, 300, 2, 99, 1000, 7, 8, 44, 45, 46, 47, 48], [900, 3, 3, 71], [12, 600, 601, 602, 20, 21]]


def cache_config(slots: int, dtype: torch.dtype) -> ExpertOffloadConfig:
    return ExpertOffloadConfig("cache", expert_cache_gb=MOE_LAYERS * slots * EXPERT_ELEMENTS * dtype.itemsize / 2**30)


@pytest.fixture(scope="module")
def checkpoint(fixture_unified):
    return UnifiedCheckpoint.open(fixture_unified("qwen35_moe"))


def load(ck, dtype, offload=None):
    return load_model(ck, ck.family, ck.config, with_mtp=True, dtype=dtype, expert_offload=offload)


def caches(model) -> list[ExpertSlotCache]:
    return [m.offload.cache for m in model.modules() if getattr(m, "offload", None) is not None]


def generate(model, spec: str = "none", k: int = 0, dtype: str = "float32", prompts=PROMPTS) -> list[list[int]]:
    config = EngineConfig(dtype=dtype, max_num_seqs=3, max_model_len=128, spec=spec, num_draft_tokens=k)
    return [r.output_token_ids for r in LLMEngine(model, config).generate(prompts, greedy(12))]


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_is_the_resident_model_bit_for_bit(checkpoint, dtype):
    torch_dtype = DTYPES[dtype]
    resident = load(checkpoint, torch_dtype)
    cached = load(checkpoint, torch_dtype, cache_config(3, torch_dtype))
    assert [c.num_slots for c in caches(cached)] == [3] * MOE_LAYERS
    for ids in PROMPTS:
        want, got = run_rows(resident, ids)[0], run_rows(cached, ids)[0]
        assert torch.equal(resident.compute_logits(want), cached.compute_logits(got))
    name = "float32" if dtype == "fp32" else "bfloat16"
    assert generate(cached, dtype=name) == generate(resident, dtype=name)
    assert generate(cached, "mtp", 2, name) == generate(resident, dtype=name)
    stats = [c.stats for c in caches(cached)]
    assert all(s.evictions > 0 and s.hits > 0 for s in stats), stats
    assert not cached.supports_cuda_graphs


@pytest.mark.parametrize("dtype", DTYPES)
def test_hybrid_spec_equals_no_spec_and_matches_resident_on_cpu(checkpoint, dtype):
    torch_dtype = DTYPES[dtype]
    name = "float32" if dtype == "fp32" else "bfloat16"
    hybrid = load(checkpoint, torch_dtype, ExpertOffloadConfig("hybrid", gpu_experts=3))
    plain = generate(hybrid, dtype=name)
    assert generate(hybrid, "mtp", 2, name) == plain
    assert generate(hybrid, "mtp", 1, name) == plain
    resident = load(checkpoint, torch_dtype)
    for ids in PROMPTS:
        assert torch.equal(resident.compute_logits(run_rows(resident, ids)[0]), hybrid.compute_logits(run_rows(hybrid, ids)[0]))


@pytest.mark.parametrize("placement", [dict(gpu_experts=0), dict(gpu_expert_fraction=1.0)])
def test_hybrid_all_on_one_side(checkpoint, placement):
    resident = load(checkpoint, torch.float32)
    hybrid = load(checkpoint, torch.float32, ExpertOffloadConfig("hybrid", **placement))
    ids = PROMPTS[0]
    assert torch.equal(run_rows(resident, ids)[0], run_rows(hybrid, ids)[0])


def test_weight_memory_counts_slots_and_host_bytes(checkpoint):
    resident = weight_memory(load(checkpoint, torch.float32))
    cached = weight_memory(load(checkpoint, torch.float32, cache_config(3, torch.float32)))
    hybrid = weight_memory(load(checkpoint, torch.float32, ExpertOffloadConfig("hybrid", gpu_experts=2)))
    all_experts = MOE_LAYERS * 8 * EXPERT_ELEMENTS * 4
    assert resident.offloaded_bytes == 0 and resident.mode == "none"
    assert cached.offloaded_bytes == all_experts and cached.expert_device_bytes == MOE_LAYERS * 3 * EXPERT_ELEMENTS * 4
    slot_maps = MOE_LAYERS * 8 * 4  # slot_of, int32 per expert
    assert cached.resident_bytes == resident.resident_bytes - all_experts + cached.expert_device_bytes + slot_maps
    assert hybrid.offloaded_bytes == MOE_LAYERS * 6 * EXPERT_ELEMENTS * 4
    assert hybrid.expert_device_bytes == MOE_LAYERS * 2 * EXPERT_ELEMENTS * 4
    assert hybrid.resident_bytes == resident.resident_bytes - all_experts + hybrid.expert_device_bytes


def _store(checkpoint, layer: int = 0) -> HostExpertStore:
    prefix = f"model.layers.{layer}.mlp.experts"
    names = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
    return HostExpertStore(checkpoint, *names, 0, 8, (64, 64), (64, 32), torch.float32, pin=False)


def test_slot_cache_lru_and_slot_of(checkpoint):
    cache = ExpertSlotCache(_store(checkpoint), num_slots=3, device=torch.device("cpu"), with_shared_row=False)
    gate_up = checkpoint.get("model.layers.0.mlp.experts.gate_up_proj").float()
    cache.fetch([4, 1])  # slots 0, 1 (ascending id); LRU order 1, 4
    cache.fetch([4, 6])  # 6 into the free slot 2; order 1, 4, 6
    cache.fetch([0, 6])  # evicts 1 (least recent, not needed); order 4, 6, 0
    cache.fetch([2, 5])  # evicts 4 then 6
    assert cache.resident_experts() == [0, 2, 5]
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (2, 6, 3)
    slot_of = cache.slot_of.tolist()
    assert [e for e in range(8) if slot_of[e] >= 0] == [0, 2, 5]
    for expert in (0, 2, 5):
        assert torch.equal(cache.gate_up[slot_of[expert]], gate_up[expert])


def test_token_groups_fit_the_slots(checkpoint):
    cache = ExpertSlotCache(_store(checkpoint), num_slots=3, device=torch.device("cpu"), with_shared_row=False)
    routed = [[0, 1], [1, 2], [2, 3], [3, 0], [4, 5], [5, 4]]
    assert cache.token_groups(routed) == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="cache"), "needs --expert-cache-gb"),
    (dict(mode="cache", expert_cache_gb=-1.0), "needs --expert-cache-gb > 0"),
    (dict(mode="hybrid"), "needs --gpu-experts"),
    (dict(mode="hybrid", gpu_expert_fraction=1.5), "must be in [0, 1]"),
    (dict(mode="none", gpu_experts=3), "needs --expert-offload hybrid"),
    (dict(mode="hybrid", gpu_experts=3, expert_cache_gb=1.0), "needs --expert-offload cache"),
    (dict(mode="swap"), "use none, cache or hybrid"),
])
def test_bad_offload_configs_are_one_line_errors(kwargs, message):
    with pytest.raises(FreetokenError, match=message.replace("[", r"\[")):
        ExpertOffloadConfig(**kwargs)


def test_gpu_experts_text():
    assert parse_gpu_experts("64") == (64, None)
    assert parse_gpu_experts("0.25") == (None, 0.25)
    assert parse_gpu_experts("50%") == (None, 0.5)
    assert ExpertOffloadConfig("hybrid", gpu_expert_fraction=0.5).num_resident_experts(256) == 128
    with pytest.raises(FreetokenError):
        parse_gpu_experts("half")


def test_cache_too_small_and_dense_models_are_refused(checkpoint, fixture_unified):
    with pytest.raises(FreetokenError, match="a token needs 2"):
        load(checkpoint, torch.float32, cache_config(1, torch.float32))
    dense = UnifiedCheckpoint.open(fixture_unified("qwen35_dense"))
    with pytest.raises(FreetokenError, match="needs a MoE model"):
        load(dense, torch.float32, ExpertOffloadConfig("hybrid", gpu_experts=1))


def test_cache_with_the_shared_expert_stacked_is_the_resident_model(tiny_checkpoint):
    """A shared expert as wide as a routed one is stacked after the slots (the merged block's layout); on CPU it runs dense."""
    ck = UnifiedCheckpoint.open(tiny_checkpoint(TinySpec(moe=True, shared_expert_intermediate_size=32))[1])
    resident = load(ck, torch.bfloat16)
    cached = load(ck, torch.bfloat16, ExpertOffloadConfig("cache", expert_cache_gb=MOE_LAYERS * 3 * 3 * 64 * 32 * 2 / 2**30))
    prompts = [[t % 256 for t in p] for p in PROMPTS]  # the tiny vocabulary
    # the engines merge the blocks, which stacks the shared expert
    assert generate(cached, dtype="bfloat16", prompts=prompts) == generate(resident, dtype="bfloat16", prompts=prompts)
    assert all(c.gate_up.shape[0] == c.num_slots + 1 for c in caches(cached))
    shared = cached.model.layers[0].mlp.shared_expert
    assert shared.down_proj.weight.data_ptr() == caches(cached)[0].down[-1].data_ptr()
    for ids in prompts:
        assert torch.equal(resident.compute_logits(run_rows(resident, ids)[0]), cached.compute_logits(run_rows(cached, ids)[0]))
