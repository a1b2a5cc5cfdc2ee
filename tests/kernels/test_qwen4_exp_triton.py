"""The qwen4_exp model (Qwen3.8-Flash-Next) on the Triton kernels (FREETOKEN_KERNELS=triton): GDN, MoE,
linears, norms, hyper-connections, PLE and QSA on their kernels (models/qwen4_exp/model.py lists what
stays torch).

Oracles: transformers' outputs stored in the fixtures (on CUDA a prefill of every fixture sequence in
one batch: logits and the wide residual; on CPU, where the interpreter pays per row, the fp32 verify
rows' logits), and the model's own decode: verify rows equal decode rows bit
for bit (fp32 and bf16), verify leaves the GDN and PLE state untouched, and the commit replay leaves
exactly the GDN and PLE state that decoding the accepted rows leaves. On CPU the kernels run under
TRITON_INTERPRET=1 on the tiny fixture model.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

import freetoken.kernels  # noqa: E402
from freetoken.checkpoint.reader import UnifiedCheckpoint  # noqa: E402
from freetoken.engine.config import EngineConfig  # noqa: E402
from freetoken.engine.engine import LLMEngine  # noqa: E402
from freetoken.engine.runner import RowGroup, build_context  # noqa: E402
from freetoken.forward_context import ForwardMode  # noqa: E402
from freetoken.models.loader import load_model  # noqa: E402

from tests.conftest import fixture_refs, num_sequences, open_seqs  # noqa: E402
from tests.kernels.conftest import DEVICES  # noqa: E402

MODEL = "qwen4_exp"
TOL, WIDE_TOL = 1e-4, 2e-4  # as tests/models/test_qwen4_exp_vs_hf.py


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setattr(freetoken.kernels, "MODE", "triton")


def load(path, dtype: torch.dtype, device: str):
    ck = UnifiedCheckpoint.open(path)
    model = load_model(ck, ck.family, ck.config, with_mtp=False, dtype=dtype, device=device)
    config = EngineConfig(device=device, dtype=str(dtype).removeprefix("torch."), max_num_seqs=4, block_size=4, max_model_len=64)
    return model, LLMEngine(model, config)


def forward(model, engine, seqs, starts, rows, mode):
    groups = [RowGroup(table, slot, start, r) for (table, slot, _), start, r in zip(seqs, starts, rows)]
    ctx = build_context(groups, mode, engine.kv_pool, engine.state_pool, engine.device)
    wide = model(ctx)
    return ctx, wide, model.compute_logits(wide)


@pytest.mark.parametrize("device", DEVICES[1:])  # on CPU the verify test's fp32 rows are checked against transformers instead
@torch.no_grad()
def test_batched_prefill_matches_transformers(device, fixture_unified):
    """Every fixture sequence in one EXTEND step (seq3 has an EOS inside: the PLE n-gram hash restarts)."""
    refs = fixture_refs(MODEL)
    model, engine = load(fixture_unified(MODEL), torch.float32, device)
    names = [f"seq{i}" for i in range(num_sequences(refs))]
    prompts = [refs[f"{n}.input_ids"].tolist() for n in names]
    _, wide, logits = forward(model, engine, open_seqs(engine, prompts, 0), [0] * len(prompts), prompts, ForwardMode.EXTEND)
    start = 0
    for name, ids in zip(names, prompts):
        rows = slice(start, start + len(ids))
        assert (logits[rows].cpu() - refs[f"{name}.logits"]).abs().max().item() <= TOL, name
        assert (wide[rows].cpu() - refs[f"{name}.wide_last"]).abs().max().item() <= WIDE_TOL, name
        start += len(ids)


def ple_state(engine) -> list[torch.Tensor]:
    return [t.clone() for t in engine.state_pool.state.extra.values()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_verify_and_commit_equal_decode_bitwise(device, dtype, fixture_unified):
    """Two sequences, prefixes of the fixture's seq3 (an EOS inside) and seq1 (long enough for QSA to
    select blocks), verify k drafts (their next tokens) and accept some; the verify rows' logits equal
    decoding them one row a step (and, fp32, transformers' logits of those positions), and the commit
    leaves the GDN and PLE state that decoding leaves. The prompts' prefill, the common start of both,
    runs on the torch references (`kernels.torch_only`), which the interpreter runs much faster."""
    refs = fixture_refs(MODEL)
    model, engine = load(fixture_unified(MODEL), dtype, device)
    k = 2 if device == "cpu" else 3
    names, prompt_lens = ["seq3", "seq1"], [8, 12]
    full = [refs[f"{n}.input_ids"].tolist() for n in names]
    prompts = [ids[:n] for ids, n in zip(full, prompt_lens)]
    drafts, accepted = [ids[n : n + k] for ids, n in zip(full, prompt_lens)], [k - 1, k]
    pools = engine.state_pool.state
    seqs = open_seqs(engine, prompts, 4)
    with freetoken.kernels.torch_only():
        forward(model, engine, seqs, [0, 0], prompts, ForwardMode.EXTEND)
    after_prefill = (pools.recurrent.clone(), pools.conv.clone(), ple_state(engine))

    ctx, _, verify_logits = forward(model, engine, seqs, [len(p) for p in prompts], drafts, ForwardMode.VERIFY)
    if dtype == torch.float32:
        for i, (name, n) in enumerate(zip(names, prompt_lens)):
            assert (verify_logits[k * i : k * (i + 1)].cpu() - refs[f"{name}.logits"][n : n + k]).abs().max().item() <= TOL, name
    assert torch.equal(pools.recurrent, after_prefill[0]) and torch.equal(pools.conv, after_prefill[1])
    assert all(torch.equal(a, b) for a, b in zip(ple_state(engine), after_prefill[2]))
    model.commit(ctx, accepted)
    committed = (pools.recurrent.clone(), pools.conv.clone(), ple_state(engine))

    # Rewind the GDN and PLE state (KV rows are rewritten with the same values) and decode one row a step.
    pools.recurrent.copy_(after_prefill[0])
    pools.conv.copy_(after_prefill[1])
    for live, saved in zip(pools.extra.values(), after_prefill[2]):
        live.copy_(saved)
    for step in range(k):
        active = [i for i in range(2) if step < accepted[i]]
        _, _, logits = forward(model, engine, [seqs[i] for i in active], [len(prompts[i]) + step for i in active], [[drafts[i][step]] for i in active], ForwardMode.EXTEND)
        for j, i in enumerate(active):
            assert torch.equal(logits[j], verify_logits[k * i + step]), f"sequence {i} step {step}"
    for i, (_, slot, _) in enumerate(seqs):
        assert torch.equal(pools.recurrent[:, slot], committed[0][:, slot]), f"recurrent state of sequence {i}"
        assert torch.equal(pools.conv[:, slot], committed[1][:, slot]), f"conv window of sequence {i}"
        for name, live, want in zip(pools.extra, pools.extra.values(), committed[2]):
            assert torch.equal(live[:, slot], want[:, slot]), f"{name} of sequence {i}"


@pytest.mark.parametrize("device", DEVICES[1:])
@pytest.mark.parametrize("forced", [False, True], ids=["own_drafts", "right_for_2"])
def test_bf16_greedy_spec_mtp_equals_no_spec(device, forced, fixture_unified, monkeypatch):
    """bf16 greedy with MTP speculative decoding (k = 3) equals greedy without, token for token, on the
    Triton kernels; `right_for_2` forces drafts right for two tokens, then wrong (commits of 3 rows)."""
    from freetoken.llm import LLM
    from tests.conftest import greedy
    from tests.spec.test_qwen4_exp_mtp_parity import _patch_drafts, _prompts

    llm = LLM(str(fixture_unified(MODEL)), EngineConfig(device=device, dtype="bfloat16", max_num_seqs=4, max_model_len=64, spec="mtp", num_draft_tokens=3))
    want = [r.output_token_ids for r in llm.generate_ids(_prompts(), greedy(24), llm.with_spec("none", 0))[0]]
    if forced:
        vocab = llm.model.config.vocab_size

        def drafts(request, k):
            done = len(request.output_token_ids)
            good = list(want[request.request_id][done : done + k]) + [0] * k
            return good[:2] + [(t + 1) % vocab for t in good[2:k]]

        _patch_drafts(monkeypatch, drafts)
    requests, stats = llm.generate_ids(_prompts(), greedy(24), llm.with_spec("mtp", 3))
    assert [r.output_token_ids for r in requests] == want
    assert all(r.accepted_lens for r in requests)
