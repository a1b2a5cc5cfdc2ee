"""The engine's scheduling must not change what a request generates.

Oracles: the same request run alone in a fresh engine (batch invariance, DESIGN.md invariant 5),
transformers' greedy generate (one-token prompt), and the uncut greedy stream (EOS/stop tokens end
a request exactly after the first occurrence).
"""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from tests.conftest import TinySpec, greedy, hf_model_from_dir, load_unified

PROMPTS = [[i * 7 % 256 for i in range(n)] for n in (1, 2, 3, 5, 8, 13, 4, 9, 6, 11)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _run(model, prompts, params, **cfg) -> list[list[int]]:
    config = EngineConfig(dtype="bfloat16" if next(model.parameters()).dtype == torch.bfloat16 else "float32", max_model_len=64, **cfg)
    return [r.output_token_ids for r in LLMEngine(model, config).generate(prompts, params)]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("spec", [TinySpec(), TinySpec(moe=True)], ids=["dense", "moe"])
def test_continuous_batching_equals_each_request_alone(spec, dtype, tiny_checkpoint):
    model = load_unified(tiny_checkpoint(spec)[1], with_mtp=False, dtype=DTYPES[dtype])
    params = greedy(12)
    batched = _run(model, PROMPTS, params, max_num_seqs=4, max_num_batched_tokens=16)  # 10 requests, 4 at a time
    alone = [_run(model, [p], params, max_num_seqs=1)[0] for p in PROMPTS]
    assert batched == alone
    assert all(len(o) == 12 for o in batched)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_chunked_prefill_budget_does_not_change_outputs(dtype, tiny_checkpoint):
    model = load_unified(tiny_checkpoint(TinySpec(moe=True))[1], with_mtp=False, dtype=DTYPES[dtype])
    prompts = [[i * 11 % 256 for i in range(n)] for n in (17, 6, 23, 2)]
    runs = {budget: _run(model, prompts, greedy(8), max_num_seqs=4, max_num_batched_tokens=budget) for budget in (1, 3, 7, 512)}
    assert runs[1] == runs[3] == runs[7] == runs[512]


def test_long_prompts_get_the_same_state_whatever_the_cut(tiny_checkpoint):
    """Prompts past the GDN chunk (64) cut at different budgets, alone or sharing steps: the pieces are
    cut at multiples of 64, so every position takes the same rule and the GDN state after the prompt
    and the greedy continuation are bitwise the same (CPU, fp32)."""
    model = load_unified(tiny_checkpoint(TinySpec())[1], with_mtp=False)
    prompts = [[(i * 13 + 5) % 256 for i in range(n)] for n in (150, 70, 200)]
    outputs, states = {}, {}
    for budget in (100, 160, 512):
        engine = LLMEngine(model, EngineConfig(max_model_len=256, max_num_seqs=3, max_num_batched_tokens=budget))
        requests = [engine.add_request(p, greedy(6)) for p in prompts]
        cuts = []
        while any(r.in_prefill for r in requests):
            before = [r.num_cached_tokens for r in requests]
            engine.step()
            cuts += [r.num_cached_tokens for r, b in zip(requests, before) if r.num_cached_tokens != b]
        assert all(c % 64 == 0 or c in (149, 69, 199) for c in cuts), cuts  # the last prompt token is decoded
        states[budget] = [engine.state_pool.state.recurrent[:, r.state_slot].clone() for r in requests]
        while engine.scheduler.has_work:
            engine.step()
        outputs[budget] = [r.output_token_ids for r in requests]
    for budget in (160, 512):
        assert outputs[budget] == outputs[100]
        assert all(torch.equal(a, b) for a, b in zip(states[budget], states[100]))


def test_one_token_prompt_matches_transformers(tiny_checkpoint):
    hf_dir, unified = tiny_checkpoint(TinySpec())
    out = _run(load_unified(unified, with_mtp=False), [[42]], greedy(10), max_num_seqs=2)[0]
    x = torch.tensor([[42]])
    with torch.no_grad():
        want = hf_model_from_dir(hf_dir).generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert out == want[0, 1:].tolist()


def test_eos_and_stop_tokens_end_the_request(tiny_checkpoint):
    free_spec = TinySpec()
    model = load_unified(tiny_checkpoint(free_spec)[1], with_mtp=False)
    prompt = PROMPTS[5]
    full = _run(model, [prompt], greedy(24), max_num_seqs=1)[0]
    stop = full[6]
    cut = full.index(stop) + 1

    eos_spec = TinySpec(eos_token_id=stop)
    eos_model = load_unified(tiny_checkpoint(eos_spec)[1], with_mtp=False)
    assert eos_model.eos_token_ids == (stop,)
    engine = LLMEngine(eos_model, EngineConfig(max_num_seqs=2, max_model_len=64))
    stopped, ignoring = engine.generate([prompt, prompt], [greedy(24, ignore_eos=False), greedy(24, ignore_eos=True)])
    assert stopped.output_token_ids == full[:cut] and stopped.finish_reason == "stop"
    assert ignoring.output_token_ids == full

    by_stop_id = _run(model, [prompt], greedy(24, stop_token_ids=(stop,)), max_num_seqs=1)[0]
    assert by_stop_id == full[:cut]


def test_finish_reason_names_the_limit(tiny_checkpoint):
    """OpenAI semantics: "length" when max_new_tokens ends a request, "stop" for a stop token."""
    model = load_unified(tiny_checkpoint(TinySpec())[1], with_mtp=False)
    prompt = PROMPTS[5]
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=64))
    (free,) = engine.generate([prompt], greedy(5))
    (stopped,) = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=64)).generate([prompt], greedy(5, stop_token_ids=(free.output_token_ids[2],)))
    assert stopped.finish_reason == "stop"
    assert free.finish_reason == "length"


def test_kv_blocks_for_memory():
    """--mem-fraction: the pool takes that share of the free bytes, in whole blocks; too little is one clear error."""
    import pytest

    from freetoken.engine.engine import kv_blocks_for_memory
    from freetoken.errors import FreetokenError

    block = 2 * 8 * 16 * 2 * 64 * 2  # layers * block_size * kv heads * (k and v) * head_dim * bf16 bytes
    assert kv_blocks_for_memory(10 * 2**30, 0.5, block, "cuda:0") == (5 * 2**30) // block
    with pytest.raises(FreetokenError, match="holds no KV block"):
        kv_blocks_for_memory(block, 0.5, block, "cuda:0")
    with pytest.raises(FreetokenError, match="--mem-fraction"):
        EngineConfig(mem_fraction=1.5)


@pytest.mark.parametrize("device", ["gpu", "cpu:0", "cuda:x", "cuda:99"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:0"]))
def test_a_device_that_cannot_run_is_refused_up_front(device):
    from freetoken.errors import FreetokenError

    with pytest.raises(FreetokenError, match=f"--device '?{device}"):
        EngineConfig(device=device)


def test_decode_graph_buckets_and_padding_rows():
    """Batch sizes round up to 1, 2, 4, multiples of 8 and max_num_seqs; padding rows use a KV block and a
    state slot taken out of the pools."""
    from freetoken.engine.cuda_graph import DecodeGraphs, batch_buckets
    from freetoken.engine.kv_pool import KVPool
    from freetoken.engine.linear_state_pool import LinearStatePool
    from freetoken.engine.runner import RowGroup

    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    kv = KVPool(1, 10, 4, 1, 8, torch.float32, "cpu")
    states = LinearStatePool(1, 4, (3, 8), (1, 4, 4), torch.float32, "cpu")
    graphs = DecodeGraphs(torch.nn.Linear(1, 1), kv, states, torch.device("cpu"), max_blocks_per_seq=4, max_num_seqs=3)
    assert kv.num_blocks == 9 and graphs.pad_block not in kv.free_blocks
    assert graphs.pad_slot not in states.free_slots and states.num_free_slots == 3
    assert [graphs.bucket(b) for b in (1, 2, 3)] == [1, 2, 3]
    real = [RowGroup([0, 1], states.allocate(), 5, [7, 8, 9, 10, 11]) for _ in range(2)]
    graphs.buckets = [1, 4]
    padded = graphs._padded(real)
    assert padded[:2] == real and len(padded) == 4
    assert all(g.block_table == [graphs.pad_block] * 2 and g.state_slot == graphs.pad_slot and g.start == 0 and len(g.token_ids) == 5 for g in padded[2:])


def test_graph_staging_holds_what_build_context_builds():
    """The decode graphs' staging buffer, after load and upload, holds the step inputs the eager path
    builds with build_context (token ids, positions, KV slots), the cached and context lengths of
    SeqBatch, the state slots and the padded block tables."""
    from freetoken.engine.cuda_graph import _Staging
    from freetoken.engine.kv_pool import KVPool
    from freetoken.engine.runner import RowGroup, build_context
    from freetoken.forward_context import ForwardMode
    from freetoken.kernels.batched import seq_batch

    kv = KVPool(1, 12, 4, 1, 8, torch.float32, "cpu")
    groups = [RowGroup([3, 7, 1], 2, 9, [11, 12, 13]), RowGroup([5], 0, 0, [21, 22, 23])]
    staging = _Staging(2, 3, 5, torch.device("cpu"))
    staging.load(groups, kv)
    ctx = build_context(groups, ForwardMode.VERIFY, kv, None, torch.device("cpu"))
    d = staging.on_device
    assert torch.equal(d["input_ids"], ctx.input_ids) and torch.equal(d["positions"], ctx.positions)
    assert torch.equal(d["slot_mapping"], ctx.slot_mapping)
    assert torch.equal(d["context_lens"], seq_batch(ctx).context_lens)
    assert torch.equal(d["cached"], seq_batch(ctx).cached) and d["cached"].tolist() == [9, 0]
    assert d["slots"].tolist() == [2, 0]
    assert d["block_table"][0, :3].tolist() == [3, 7, 1] and d["block_table"][1, :1].tolist() == [5]
