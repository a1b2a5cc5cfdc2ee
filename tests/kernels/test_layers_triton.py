"""The model on the Triton kernels (FREETOKEN_KERNELS=triton): one launch per layer-op for the whole batch.

Oracles: transformers' logits stored in the fixtures (prefill of two sequences in one batch), and the
model's own decode: verify rows equal decode rows bit for bit, verify leaves the GDN state untouched,
and the commit replay leaves exactly the state (and KV) that decoding the accepted rows leaves.
On CPU the kernels run under TRITON_INTERPRET=1 on the tiny fixture model.
"""

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from safetensors.torch import load_file  # noqa: E402

import freetoken.kernels  # noqa: E402
from freetoken.engine.config import EngineConfig  # noqa: E402
from freetoken.engine.engine import LLMEngine  # noqa: E402
from freetoken.engine.runner import RowGroup, build_context  # noqa: E402
from freetoken.forward_context import ForwardMode  # noqa: E402
from freetoken.models.loader import load_model  # noqa: E402
from freetoken.models.qwen3_5.config import Qwen35Config  # noqa: E402
from freetoken.models.qwen3_5.weights import canonical_name  # noqa: E402

from tests.conftest import FIXTURES  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA and TRITON_INTERPRET=0")]),
]


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setattr(freetoken.kernels, "MODE", "triton")


def load(name: str, dtype: torch.dtype, device: str):
    root = FIXTURES / name / "hf"
    cfg = Qwen35Config.from_hf(json.loads((root / "config.json").read_text()))
    sd = {canonical_name(k): v for k, v in load_file(root / "model.safetensors").items()}
    model = load_model(sd, "qwen3_5", cfg.to_dict(), with_mtp=False, dtype=dtype, device=device)
    return model, LLMEngine(model, EngineConfig(device=device, dtype=str(dtype).removeprefix("torch."), max_num_seqs=4, block_size=4, max_model_len=64))


def open_seqs(engine, prompts, extra):
    seqs = []
    for ids in prompts:
        table = []
        engine.kv_pool.grow(table, len(ids) + extra)
        seqs.append((table, engine.state_pool.allocate(), ids))
    return seqs


def forward(model, engine, seqs, starts, rows, mode):
    groups = [RowGroup(table, slot, start, r) for (table, slot, _), start, r in zip(seqs, starts, rows)]
    ctx = build_context(groups, mode, engine.kv_pool, engine.state_pool, engine.device)
    return ctx, model.compute_logits(model(ctx))


# The interpreter pays ~0.1 s per launch; on CPU the MoE model (two launches per expert) runs on CUDA only.
MODELS = ["qwen35_dense", pytest.param("qwen35_moe", marks=pytest.mark.skipif(INTERPRET, reason="interpreter too slow for per-expert launches"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("gated_out", [False, True])
@torch.no_grad()
def test_batched_prefill_matches_transformers(device, name, gated_out, monkeypatch):
    monkeypatch.setattr(freetoken.kernels, "GATED_OUT_PROJ", gated_out)
    ref = load_file(FIXTURES / name / "ref" / "hf_transformers.safetensors")
    model, engine = load(name, torch.float32, device)
    prompts = [ref["seq0.input_ids"].tolist(), ref["seq1.input_ids"].tolist()]
    seqs = open_seqs(engine, prompts, 0)
    _, logits = forward(model, engine, seqs, [0, 0], prompts, ForwardMode.EXTEND)
    want = torch.cat([ref["seq0.logits"], ref["seq1.logits"]]).to(device)
    assert (logits - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gated_out", [False, True])
@torch.no_grad()
def test_verify_and_commit_equal_decode_bitwise(device, gated_out, monkeypatch):
    """With kernels.GATED_OUT_PROJ too: the GDN layers' gated norm + out_proj as one launch, waiting per
    head on the recurrence in decode and verify."""
    monkeypatch.setattr(freetoken.kernels, "GATED_OUT_PROJ", gated_out)
    model, engine = load("qwen35_dense" if device == "cpu" else "qwen35_moe", torch.bfloat16, device)
    k = 2 if device == "cpu" else 4
    prompts = [[5, 9, 300, 7, 7], [11, 600, 2]]
    drafts, accepted = [[41, 8, 900, 3][:k], [17, 17, 250, 6][:k]], [k - 1, k]
    pools = engine.state_pool.state
    seqs = open_seqs(engine, prompts, 4)
    forward(model, engine, seqs, [0, 0], prompts, ForwardMode.EXTEND)
    after_prefill = (pools.recurrent.clone(), pools.conv.clone(), [t.clone() for t in engine.kv_pool.cache.k])

    ctx, verify_logits = forward(model, engine, seqs, [len(p) for p in prompts], drafts, ForwardMode.VERIFY)
    assert torch.equal(pools.recurrent, after_prefill[0]) and torch.equal(pools.conv, after_prefill[1])
    model.commit(ctx, accepted)
    committed = (pools.recurrent.clone(), pools.conv.clone())

    # Rewind the linear state (KV rows are rewritten with the same values) and decode one row a step.
    pools.recurrent.copy_(after_prefill[0])
    pools.conv.copy_(after_prefill[1])
    slots = [slot for _, slot, _ in seqs]
    for step in range(k):
        active = [i for i in range(2) if step < accepted[i]]
        _, logits = forward(model, engine, [seqs[i] for i in active], [len(prompts[i]) + step for i in active], [[drafts[i][step]] for i in active], ForwardMode.EXTEND)
        for j, i in enumerate(active):
            assert torch.equal(logits[j], verify_logits[k * i + step]), f"sequence {i} step {step}"
    for i, slot in enumerate(slots):
        assert torch.equal(pools.conv[:, slot], committed[1][:, slot]), f"conv window of sequence {i}"
        if device == "cuda":
            assert torch.equal(pools.recurrent[:, slot], committed[0][:, slot]), f"recurrent state of sequence {i}"
        else:
            # On CPU torch's own exp/sigmoid for g and beta (outside the kernels) give a row different
            # last bits at different positions of a tensor, so only closeness holds here; the kernel's
            # replay == decode is checked bitwise in test_gdn_triton.
            torch.testing.assert_close(pools.recurrent[:, slot], committed[0][:, slot], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_gated_out_proj_is_close_to_the_gated_norm_then_out_proj(device, monkeypatch):
    """kernels.GATED_OUT_PROJ on and off: the same steps give close logits (the fused launch sums the
    out_proj's K in its own order). A prefill whose 64-row prompt takes the chunked rule (the fused
    launch without waiting on the recurrence) beside a 5-row one, then prefill, verify and a decode
    step of two short prompts (the fused launch waiting per head); the head counters end at multiples of PERIOD."""
    from freetoken.kernels import gated_out_triton

    name = "qwen35_dense" if device == "cpu" else "qwen35_moe"
    chunked = [[(37 * i + 11) % 1000 for i in range(64)], [3, 1, 4, 1, 5]]
    prompts, drafts = [[5, 9, 300, 7, 7], [11, 600, 2]], [[41, 8], [17, 250]]
    chunk_calls = []
    chunked_prefill = freetoken.kernels.gdn_chunked_prefill
    monkeypatch.setattr(freetoken.kernels, "gdn_chunked_prefill", lambda *a, **kw: chunk_calls.append(a[-1].num_rows) or chunked_prefill(*a, **kw))
    logits = {}
    for gated_out in (False, True):
        monkeypatch.setattr(freetoken.kernels, "GATED_OUT_PROJ", gated_out)
        model, engine = load(name, torch.bfloat16, device)
        steps = [forward(model, engine, open_seqs(engine, chunked, 0), [0, 0], chunked, ForwardMode.EXTEND)[1]]
        seqs = open_seqs(engine, prompts, 4)
        steps.append(forward(model, engine, seqs, [0, 0], prompts, ForwardMode.EXTEND)[1])
        steps.append(forward(model, engine, seqs, [len(p) for p in prompts], drafts, ForwardMode.VERIFY)[1])
        steps.append(forward(model, engine, seqs, [len(p) for p in prompts], [d[:1] for d in drafts], ForwardMode.EXTEND)[1])
        logits[gated_out] = steps
    assert chunk_calls and all(rows == (64, 0) for rows in chunk_calls)
    for off, on in zip(logits[False], logits[True]):
        torch.testing.assert_close(on, off, rtol=0.05, atol=0.05)
    assert not (gated_out_triton.head_ready_counters(torch.device(device)) % gated_out_triton.PERIOD).any()
