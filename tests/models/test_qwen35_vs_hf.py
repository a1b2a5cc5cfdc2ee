"""The Qwen3.5 target (dense and MoE) against Hugging Face transformers on CPU, fp32.

Oracle: transformers' own `Qwen3_5[Moe]ForCausalLM` loading the checkpoint it wrote with
`save_pretrained` (eager attention and experts, its torch GDN/conv fallbacks), and the fixtures'
stored transformers outputs. The runtime side always goes convert -> unified checkpoint -> engine.

- engine path: several prompts of different lengths in one batch, chunked prefill under a small
  token budget, then token-by-token decode; every decode step's logits vs HF on the full sequence;
- greedy generation (batch 1, no padding) vs `generate(do_sample=False)`;
- the fixture checkpoints vs `ref/hf_transformers.safetensors` (logits and post-norm hidden).
"""

from __future__ import annotations

import pytest
import torch

from freetoken.checkpoint.reader import UnifiedCheckpoint
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from tests.conftest import FIXTURE_MODELS, TinySpec, fixture_refs, greedy, hf_logits, hf_model_from_dir, load_unified, num_sequences, run_rows

TOL = 1e-4
VARIANTS = {
    "dense": TinySpec(),
    "moe": TinySpec(moe=True),
    "moe-fused": TinySpec(moe=True, fused_experts=True),
    "moe-stacked-shared": TinySpec(moe=True, shared_expert_intermediate_size=32),  # merged: the shared expert as expert E
    "dense-tied": TinySpec(tied=True, seed=2),
}
PROMPTS = [[5], [17, 3, 200, 41], [9, 9, 120, 7, 66, 250, 1, 0, 31], [200 - 7 * i for i in range(15)], [i * 13 % 256 for i in range(23)]]


def _record_decode_logits(engine: LLMEngine) -> list[tuple[int, int, torch.Tensor]]:
    """Capture (request id, number of tokens fed so far, logits row) of every decode step."""
    log: list[tuple[int, int, torch.Tensor]] = []
    pending: list = []
    propose, compute_logits = engine.spec.propose, engine.model.compute_logits

    def spy_propose(requests):
        pending[:] = [(r.request_id, r.num_tokens) for r in requests]
        return propose(requests)

    def spy_logits(hidden):
        logits = compute_logits(hidden)
        assert logits.shape[0] == len(pending)  # k = 0: one row per request
        log.extend((rid, n, row) for (rid, n), row in zip(pending, logits))
        return logits

    engine.spec.propose = spy_propose
    engine.model.compute_logits = spy_logits
    return log


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_decode_logits_match_hf(variant, tiny_checkpoint):
    hf_dir, unified = tiny_checkpoint(VARIANTS[variant])
    model = load_unified(unified, with_mtp=False)
    # overlap off: the spy takes each step's batch from propose, which overlapped steps (k = 0) skip
    engine = LLMEngine(model, EngineConfig(max_num_seqs=8, max_num_batched_tokens=6, block_size=4, max_model_len=64, overlap=False))
    log = _record_decode_logits(engine)
    requests = engine.generate(PROMPTS, greedy(12))
    assert engine.stats.prefill_tokens == sum(len(p) - 1 for p in PROMPTS)

    hf = hf_model_from_dir(hf_dir)
    worst = 0.0
    for r in requests:
        assert len(r.output_token_ids) == 12
        ref, _ = hf_logits(hf, r.token_ids)
        rows = [(n, row) for rid, n, row in log if rid == r.request_id]
        assert [n for n, _ in rows] == list(range(len(r.prompt_token_ids), r.num_tokens))  # one decode per token
        for n, row in rows:
            worst = max(worst, (row - ref[n - 1]).abs().max().item())
        assert r.output_token_ids == ref[len(r.prompt_token_ids) - 1 : -1].argmax(-1).tolist()
    assert worst <= TOL, f"{variant}: max |logit diff| {worst:.3g}"


@pytest.mark.parametrize("variant", ["dense", "moe", "dense-tied"])
def test_greedy_generation_matches_hf_generate(variant, tiny_checkpoint):
    hf_dir, unified = tiny_checkpoint(VARIANTS[variant])
    model = load_unified(unified, with_mtp=False)
    hf = hf_model_from_dir(hf_dir)
    prompts = PROMPTS[1:]
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=96))
    ours = [r.output_token_ids for r in engine.generate(prompts, greedy(32))]
    for prompt, out in zip(prompts, ours):
        x = torch.tensor([prompt])
        with torch.no_grad():
            want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False, pad_token_id=0)
        assert out == want[0, len(prompt) :].tolist()
        assert len(out) == 32


def test_converted_layouts_load_the_same_weights(tiny_checkpoint):
    """Per-expert (save_pretrained) and hand-fused sources give the same unified tensors."""
    _, per_expert = tiny_checkpoint(VARIANTS["moe"])
    _, fused = tiny_checkpoint(VARIANTS["moe-fused"])
    a, b = UnifiedCheckpoint.open(per_expert), UnifiedCheckpoint.open(fused)
    assert sorted(a.tensor_names()) == sorted(b.tensor_names())
    for name in a.tensor_names():
        assert torch.equal(a.get(name), b.get(name)), name


@pytest.mark.parametrize("model", FIXTURE_MODELS)
def test_fixture_logits_and_hidden_match_hf_reference(model, fixture_unified):
    net = load_unified(fixture_unified(model), with_mtp=False)
    refs = fixture_refs(model)
    for i in range(num_sequences(refs)):
        ids = refs[f"seq{i}.input_ids"].tolist()
        hidden, _, _ = run_rows(net, ids)
        assert (hidden - refs[f"seq{i}.hidden"]).abs().max().item() <= TOL
        assert (net.compute_logits(hidden) - refs[f"seq{i}.logits"]).abs().max().item() <= TOL
