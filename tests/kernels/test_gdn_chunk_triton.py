"""The chunked gated delta rule (prefill): torch reference and Triton kernel.

Oracles: the token-by-token recurrence (`gdn_ref.gdn_recurrent`, `batched.gdn_recurrent_batched`),
which the chunked form must equal up to fp32 rounding, and transformers' Qwen3.5 on CPU for the
layer wiring (a batch whose long prompts take the chunked path and whose short one takes the
recurrence, then one decode row each from the states the prefill left).
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES  # noqa: E402

import freetoken.kernels  # noqa: E402
from freetoken.kernels import batched, gdn_chunk_ref, gdn_chunk_triton  # noqa: E402
from freetoken.kernels.batched import SeqBatch  # noqa: E402
from freetoken.kernels.gdn_ref import gdn_recurrent  # noqa: E402
from freetoken.layers import linear_attn  # noqa: E402

LENGTHS = (1, 5, 64, 70, 130)  # below, at and across chunk boundaries
TOL = dict(rtol=1e-5, atol=1e-5)


def make_batch(num_rows, slots, device):
    starts = [sum(num_rows[:i]) for i in range(len(num_rows))]
    return SeqBatch(tuple(starts), tuple(num_rows), (0,) * len(num_rows), tuple(slots), (), torch.device(device))


def gdn_inputs(n, heads, dk, dv, regime, seed, device="cpu"):
    """q, k l2-normed (q scaled), v, g, beta [n, ...] fp32. regime 'decay': log-decays down to -40;
    'aligned': keys nearly parallel, beta near 1 and no decay (the worst-conditioned chunk solve)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, heads, dk, generator=gen)
    if regime == "aligned":
        k = torch.randn(1, heads, dk, generator=gen) + 0.05 * k
    k = torch.nn.functional.normalize(k, dim=-1)
    q = torch.nn.functional.normalize(torch.randn(n, heads, dk, generator=gen), dim=-1) * dk**-0.5
    v = torch.randn(n, heads, dv, generator=gen)
    g = {"random": -torch.rand(n, heads, generator=gen), "decay": -40 * torch.rand(n, heads, generator=gen), "aligned": torch.zeros(n, heads)}[regime]
    beta = 0.999 * torch.ones(n, heads) if regime == "aligned" else torch.rand(n, heads, generator=gen)
    return [t.to(device) for t in (q, k, v, g, beta)]


@pytest.mark.parametrize("regime", ["random", "decay", "aligned"])
def test_torch_chunked_matches_recurrence(regime):
    heads, dk, dv = 2, 16, 32
    gen = torch.Generator().manual_seed(11)
    for n in LENGTHS:
        inputs = gdn_inputs(n, heads, dk, dv, regime, seed=n)
        state = torch.randn(heads, dk, dv, generator=gen) * 0.5
        want_state = state.clone()
        want = gdn_recurrent(want_state, *inputs)
        got_state = state.clone()
        got = gdn_chunk_ref.gdn_chunked(got_state, *inputs)
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{n} rows, outputs: {m}")
        torch.testing.assert_close(got_state, want_state, **TOL, msg=lambda m: f"{n} rows, state: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("regime", ["random", "decay"])
def test_triton_chunked_matches_references_and_writes_only_its_slots(device, regime):
    heads, dk, dv = (2, 16, 24) if device == "cpu" else (32, 128, 128)  # Dv not a block multiple on CPU
    num_rows, slots = [*LENGTHS, 0], [4, 0, 6, 2, 1, 3]  # slot 5 unused, slot 3's sequence has no rows
    batch = make_batch(num_rows, slots, device)
    inputs = gdn_inputs(sum(num_rows), heads, dk, dv, regime, seed=3, device=device)
    gen = torch.Generator().manual_seed(5)
    pool = (torch.randn(7, heads, dk, dv, generator=gen) * 0.5).to(device)

    want_pool = pool.clone()
    want = batched.gdn_recurrent_batched(want_pool, *inputs, batch)
    ref_pool = pool.clone()
    ref = gdn_chunk_ref.gdn_chunked_batched(ref_pool, *inputs, batch)
    got_pool = pool.clone()
    got = gdn_chunk_triton.gdn_chunked(got_pool, *inputs, batch)

    # On the GPU, exp is a hardware approximation (a few ulp); with decays down to e^-40 a few state
    # entries then sit up to ~7e-5 (absolute, relative 4e-4) from the CPU-exact references.
    tol = dict(rtol=1e-3, atol=1e-4) if device == "cuda" and regime == "decay" else TOL
    for oracle, oracle_pool in ((want, want_pool), (ref, ref_pool)):
        torch.testing.assert_close(got, oracle, **tol)
        torch.testing.assert_close(got_pool, oracle_pool, **tol)
    assert torch.equal(got_pool[5], pool[5]) and torch.equal(got_pool[3], pool[3])  # unused / zero-row slots
    assert not torch.equal(got_pool[4], pool[4])  # a one-row sequence still advances its slot


@pytest.mark.parametrize("device", DEVICES)
def test_extend_split_then_recurrence_equals_the_recurrence(device, monkeypatch):
    """The layer's EXTEND rule: whole aligned chunks chunked (up to the chunkable end), every other row
    (unaligned starts, partial chunks) by the recurrence afterwards; equals the recurrence throughout."""
    monkeypatch.setattr(freetoken.kernels, "MODE", "triton")
    heads, dk, dv = (2, 16, 16) if device == "cpu" else (32, 128, 128)
    num_rows, cached, ends, slots = [70, 3, 130, 64], [0, 0, 5, 64], [None, None, None, 100], [1, 3, 0, 2]
    starts = [sum(num_rows[:i]) for i in range(len(num_rows))]
    batch = SeqBatch(tuple(starts), tuple(num_rows), tuple(cached), tuple(slots), (), torch.device(device), tuple(ends))
    chunked, rest = linear_attn.split_extend(batch)
    # 70 rows from 0: one whole chunk + 6; 3 rows: none; unaligned start 5: none; 64..128 capped at 100: none.
    assert chunked.num_rows == (64, 0, 0, 0) and rest.num_rows == (6, 3, 130, 64)
    assert rest.row_starts == (64, 70, 73, 203) and rest.num_cached == (64, 0, 5, 64)
    assert linear_attn.split_extend(batch) == (chunked, rest)  # kept for the step's other layers
    inputs = gdn_inputs(sum(num_rows), heads, dk, dv, "random", seed=9, device=device)
    pool = (torch.randn(4, heads, dk, dv, generator=torch.Generator().manual_seed(2)) * 0.5).to(device)
    want_pool = pool.clone()
    want = batched.gdn_recurrent_batched(want_pool, *inputs, batch)
    got_pool = pool.clone()
    got = freetoken.kernels.gdn_chunked_prefill(got_pool, *inputs, chunked)
    tail = freetoken.kernels.gdn_recurrent_batched(got_pool, *inputs, rest)
    got[64:] = tail[64:]
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_pool, want_pool, **TOL)


@torch.no_grad()
def test_model_prefill_and_next_decode_match_transformers(tiny_checkpoint, monkeypatch):
    """CPU default path (torch references): the first 64 rows of prompts of 100 and 70 rows take the
    chunked rule, their other rows and a 5-row prompt the recurrence, in one step; hidden states of every prompt row and of one
    decode row per sequence (from the states the prefill wrote) match transformers."""
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import LLMEngine
    from freetoken.engine.runner import RowGroup, build_context
    from freetoken.forward_context import ForwardMode
    from tests.conftest import TinySpec, hf_logits, hf_model_from_dir, load_unified

    hf_dir, unified = tiny_checkpoint(TinySpec())
    model = load_unified(unified, with_mtp=False)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=256, block_size=16))
    prompts = [[(37 * i + 11 * n) % 256 for i in range(n)] for n in (100, 5, 70)]
    tables, slots = [], []
    for ids in prompts:
        tables.append([])
        engine.kv_pool.grow(tables[-1], len(ids) + 1)
        slots.append(engine.state_pool.allocate())

    calls = []
    chunked = freetoken.kernels.gdn_chunked_prefill
    monkeypatch.setattr(freetoken.kernels, "gdn_chunked_prefill", lambda *a, **kw: calls.append(a[-1].num_rows) or chunked(*a, **kw))
    prefill = build_context([RowGroup(t, s, 0, ids) for t, s, ids in zip(tables, slots, prompts)], ForwardMode.EXTEND, engine.kv_pool, engine.state_pool, engine.device)
    hidden = model(prefill)
    assert calls and all(c == (64, 0, 64) for c in calls)  # whole aligned chunks; the 36 and 6 rows after them recur
    nxt = [[7], [8], [9]]
    decode = build_context([RowGroup(t, s, len(ids), x) for t, s, ids, x in zip(tables, slots, prompts, nxt)], ForwardMode.EXTEND, engine.kv_pool, engine.state_pool, engine.device)
    decoded = model(decode)

    # |hidden| is about 4 here; the pure recurrence lands 1.0e-4 from transformers (itself a chunked
    # rule) on the 70-row prompt, the chunked rule 0.9e-4.
    tol = dict(rtol=0, atol=2e-4)
    hf = hf_model_from_dir(hf_dir)
    start = 0
    for i, ids in enumerate(prompts):
        _, want = hf_logits(hf, ids + nxt[i])
        torch.testing.assert_close(hidden[start : start + len(ids)], want[:-1], **tol)
        torch.testing.assert_close(decoded[i], want[-1], **tol)
        start += len(ids)
