"""Tensor parallelism on CPU: 2 processes joined by gloo against the single-process run.

Oracles: the single-process model loaded from the same converted fixture (logits within fp32
tolerance, greedy tokens identical), and the spec-vs-no-spec parity command at --tensor-parallel 2.
A rank made to fail must take the other down and surface as one clear error.

Worker functions are module level so the spawned processes can import them by name.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import FIXTURES

PROMPTS = [[5, 17, 300, 42, 7, 999, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [900]]


@pytest.fixture(scope="module", params=["qwen35_dense", "qwen35_moe"])
def unified(request, tmp_path_factory) -> Path:
    from freetoken.converters import convert

    dst = tmp_path_factory.mktemp(request.param) / "unified"
    convert(FIXTURES / request.param / "hf", dst)
    return dst


def forward_logits(parallel, path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Target logits [T, V] and MTP logits [T-1, V] of each prompt, each run alone from an empty cache."""
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.runner import RowGroup, build_context
    from freetoken.forward_context import ForwardMode
    from freetoken.llm import LLM

    torch.set_num_threads(1)
    llm = LLM(path, EngineConfig(spec="mtp", num_draft_tokens=1, max_num_seqs=2, max_model_len=128, tensor_parallel=parallel.world_size), parallel=parallel)
    out = []
    with torch.no_grad():
        for ids in prompts:
            engine = llm.make_engine()
            table: list[int] = []
            engine.kv_pool.grow(table, len(ids))
            slot = engine.state_pool.allocate()
            ctx = build_context([RowGroup(table, slot, 0, ids)], ForwardMode.EXTEND, engine.kv_pool, engine.state_pool, engine.device)
            hidden = llm.model(ctx)
            out.append(llm.model.compute_logits(hidden))
            if len(ids) > 1:
                mtp_ctx = build_context([RowGroup(table, None, 0, ids[1:])], ForwardMode.EXTEND, engine.kv_pool, None, engine.device)
                out.append(llm.model.mtp.compute_logits(llm.model.mtp(mtp_ctx, hidden[:-1])))
    return out


def greedy_tokens(parallel, path: str, prompts: list[list[int]], k: int) -> list[list[int]]:
    from freetoken.engine.config import EngineConfig
    from freetoken.llm import LLM
    from freetoken.sampling import SamplingParams

    torch.set_num_threads(1)
    config = EngineConfig(spec="mtp" if k else "none", num_draft_tokens=k, max_num_seqs=4, max_model_len=128, tensor_parallel=parallel.world_size)
    llm = LLM(path, config, parallel=parallel)
    requests, _ = llm.generate_ids(prompts, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
    return [r.output_token_ids for r in requests]


def all_outputs(parallel, path: str) -> dict:
    """Everything the tests compare, from one process group (spawning workers is the slow part)."""
    return {"logits": forward_logits(parallel, path, PROMPTS), "greedy": greedy_tokens(parallel, path, PROMPTS, 0), "greedy_mtp": greedy_tokens(parallel, path, PROMPTS, 2)}


@pytest.fixture(scope="module")
def runs(unified) -> tuple[dict, list[dict]]:
    """(single-process outputs, per-rank outputs of a 2-process gloo run) on one fixture."""
    from freetoken.distributed import SINGLE
    from freetoken.distributed.launch import launch

    return all_outputs(SINGLE, str(unified)), launch(all_outputs, 2, str(unified), timeout=150)


def fail_on_rank_one(parallel) -> None:
    import torch.distributed as dist

    if parallel.rank == 1:
        raise RuntimeError("injected failure on rank one")
    dist.barrier()  # rank 0 would wait here forever if nobody stopped it
    time.sleep(600)


def test_logits_match_single_process(runs):
    want, ranks = runs
    assert len(ranks) == 2
    for got in ranks:
        assert len(got["logits"]) == len(want["logits"])
        for g, w in zip(got["logits"], want["logits"]):
            assert g.shape == w.shape
            assert (g - w).abs().max().item() <= 1e-4
    for a, b in zip(ranks[0]["logits"], ranks[1]["logits"]):  # every rank holds the same gathered logits
        assert torch.equal(a, b)


def test_greedy_generation_matches_single_process(runs):
    want, ranks = runs
    assert ranks[0]["greedy"] == ranks[1]["greedy"] == want["greedy"]
    assert all(len(t) == 24 for t in want["greedy"])
    assert ranks[0]["greedy_mtp"] == ranks[1]["greedy_mtp"] == ranks[0]["greedy"]  # spec vs no-spec at TP 2


def test_rank_failure_stops_every_process():
    from freetoken.distributed.launch import launch
    from freetoken.errors import FreetokenError

    start = time.monotonic()
    with pytest.raises(FreetokenError, match="rank 1 failed: RuntimeError: injected failure on rank one"):
        launch(fail_on_rank_one, 2, timeout=60)
    assert time.monotonic() - start < 30
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.is_alive()]


def test_parity_cli_tensor_parallel_2(tmp_path):
    from freetoken.converters import convert

    dst = tmp_path / "dense"
    convert(FIXTURES / "qwen35_dense" / "hf", dst)
    cmd = [sys.executable, "-c", "from freetoken.cli import main; main()", "parity", str(dst), "--spec", "mtp", "--tensor-parallel", "2", "-n", "16", "-k", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "PASS" in res.stderr and "FAIL" not in res.stderr
