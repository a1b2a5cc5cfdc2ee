"""CUDA graphs of qwen4_exp (Qwen3.8-Flash-Next) replay exactly what its eager forward computes (GPU only),
with the switch on (FREETOKEN_QWEN4_GRAPHS=1, `models.qwen4_exp.model.CUDA_GRAPHS`).

Oracle: the same engine with graphs off, in bf16, token for token: greedy without spec, with MTP
speculative decoding (the verify, its commit of the GDN and PLE state and the MTP draft loop replayed
as graphs), sampled and penalized requests (the forward graph with the sampler outside and the
commit graph), overlapped greedy decode (tokens fed back on the device) and image prompts (their
rows run eagerly beside the graphs: QSA's block positions come from the host).
"""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.models.qwen4_exp import model as qwen4_model
from freetoken.sampling import SamplingParams
from tests.engine.test_cuda_graph import _model
from tests.models.vision.conftest import vl_qwen4_exp  # noqa: F401 (a fixture)
from tests.spec.test_qwen4_exp_mtp_parity import _prompts

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODEL = "qwen4_exp"


@pytest.fixture(autouse=True)
def graphs_switch(monkeypatch):
    monkeypatch.setattr(qwen4_model, "CUDA_GRAPHS", True)


def _run(model, graphs: bool, spec: str = "none", k: int = 0, params=None, overlap: bool = True) -> list[list[int]]:
    config = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=4, spec=spec, num_draft_tokens=k, cuda_graphs=graphs, overlap=overlap,
                          max_model_len=128)
    engine = LLMEngine(model, config)
    params = params or SamplingParams(max_new_tokens=40, ignore_eos=True)
    requests = engine.generate(_prompts(), params)
    if graphs:
        assert engine.graphs is not None and engine.graphs.graphs, "no decode/verify graph was captured"
        if spec == "mtp" and params.is_plain_greedy:
            assert engine.spec.graphs is not None and engine.spec.graphs.graphs, "no MTP draft graph was captured"
    return [r.output_token_ids for r in requests]


def test_graphs_equal_eager_and_spec_equals_no_spec(fixture_unified):
    model = _model(fixture_unified, MODEL)
    eager = _run(model, graphs=False, overlap=False)
    assert _run(model, graphs=True, overlap=False) == eager
    assert _run(model, graphs=True) == eager  # overlapped decode: input tokens fed back inside the graphs
    for k in (1, 3):
        assert _run(model, graphs=True, spec="mtp", k=k) == eager


@pytest.mark.parametrize("k", [0, 3])
def test_sampled_and_penalized_requests_replay_like_eager(fixture_unified, k):
    model = _model(fixture_unified, MODEL)
    spec = "mtp" if k else "none"
    for params in (SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
                   SamplingParams(max_new_tokens=24, presence_penalty=0.5, ignore_eos=True)):
        assert _run(model, graphs=True, spec=spec, k=k, params=params) == _run(model, graphs=False, spec=spec, k=k, params=params)


def test_image_prompts_with_graphs_on_equal_graphs_off(vl_qwen4_exp):  # noqa: F811
    """Steps with image-prompt rows run eagerly; once they finish, the text prompt's steps go to the
    graphs (overlapped: the first of them follows an eager step, so it runs eagerly too)."""
    from dataclasses import replace

    from freetoken.engine.cuda_graph import DecodeGraphs
    from freetoken.llm import LLM
    from tests.engine.test_image_prompts import IMAGES, PROMPTS

    # loaded for --spec mtp (the MTP head is loaded only then); the runs without drafts override the spec
    llm = LLM(str(vl_qwen4_exp["yarn"][1]), EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=4, max_model_len=512, spec="mtp", num_draft_tokens=2))
    plain = replace(llm.config, spec="none", num_draft_tokens=0)
    assert DecodeGraphs.supported(llm.model, torch.device("cuda")) and not llm.model.graphs_cover_image_prompts
    texts, images = [p for p, _ in PROMPTS], [[IMAGES[i] for i in names] for _, names in PROMPTS]
    params = [SamplingParams(max_new_tokens=n) for n in (8, 8, 24)]  # the text-only prompt runs on alone

    def tokens(config: EngineConfig) -> list[list[int]]:
        return [c.token_ids for c in llm.generate(texts, params, images=images, config=config)[0]]

    want = tokens(replace(plain, cuda_graphs=False))
    assert tokens(plain) == want
    assert tokens(replace(plain, overlap=False)) == want
    assert tokens(llm.config) == want
