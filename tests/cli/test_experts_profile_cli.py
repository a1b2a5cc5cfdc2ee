"""`freetoken experts-profile` and `generate --expert-placement` on the converted qwen35_moe fixture.

Oracles: router picks counted independently (hooks on each block's router linear in a plain forward,
then kernels.moe_route), the resident run's tokens, and the exit code, one-line stderr and absent
output of `freetoken.cli.main` for bad files.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from freetoken import kernels
from freetoken.cli import app
from freetoken.layers.moe import SparseMoE
from freetoken.llm import LLM
from tests.conftest import run_rows

PROMPT = "def f(x):\n    return x * 2"


@pytest.fixture(scope="module")
def moe(fixture_unified):
    return str(fixture_unified("qwen35_moe"))


def router_counts(moe_path: str, text: str) -> dict[str, list[int]]:
    llm = LLM(moe_path)
    logits: dict[str, list[torch.Tensor]] = {}
    blocks = {name.removesuffix(".mlp"): m for name, m in llm.model.named_modules() if isinstance(m, SparseMoE)}
    hooks = [m.gate.register_forward_hook(lambda _m, _i, out, layer=layer: logits.setdefault(layer, []).append(out))
             for layer, m in blocks.items()]
    run_rows(llm.model, llm.encode(text))
    for hook in hooks:
        hook.remove()
    counts = {}
    for layer, outs in logits.items():
        experts = kernels.moe_route(torch.cat(outs), blocks[layer].top_k, torch.float32)[0]
        counts[layer] = torch.bincount(experts.flatten(), minlength=8).tolist()
    return counts


def test_profile_counts_the_router_and_its_file_runs(moe, tmp_path):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "placement.json"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    result = CliRunner().invoke(app, ["experts-profile", moe, "--prompts", str(prompts), "--gpu-experts", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    written = json.loads(out.read_text())
    want = router_counts(moe, PROMPT)
    assert written["counts"] == want
    for layer, picks in want.items():
        top = sorted(range(8), key=lambda e: (-picks[e], e))[:3]
        assert written["resident"][layer] == sorted(top)
    tokens = {}
    for mode, extra in {"none": [], "placed": ["--expert-offload", "hybrid", "--expert-placement", str(out)]}.items():
        path = tmp_path / f"{mode}.jsonl"
        run = CliRunner().invoke(app, ["generate", moe, "-p", "def f(x):", "-n", "5", "-o", str(path), *extra])
        assert run.exit_code == 0, run.output
        tokens[mode] = [json.loads(line)["token_ids"] for line in path.read_text().splitlines()]
    assert tokens["placed"] == tokens["none"]


@pytest.mark.parametrize("content, args, message", [
    ("{oops", [], "cannot read it as JSON"),
    ('{"resident": {"model.layers.7": [0, 1]}}', [], "unknown MoE layer 'model.layers.7'"),
    ('{"resident": {"model.layers.0": [0, 9]}}', [], "expert 9 out of range [0, 8)"),
    ('{"resident": {"model.layers.0": [2, 2]}}', [], "expert 2 listed twice"),
    ('{"resident": {"model.layers.0": [2, 3]}}', ["--gpu-experts", "2"], "leave out --gpu-experts"),
])
def test_bad_placement_exits_with_one_line_and_writes_nothing(moe, tmp_path, content, args, message):
    placement, out = tmp_path / "p.json", tmp_path / "out.jsonl"
    placement.write_text(content)
    code = "import sys; from freetoken.cli import main; sys.argv = ['freetoken'] + sys.argv[1:]; main()"
    env = {"FREETOKEN_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-c", code, "generate", moe, "-p", "x", "-n", "2", "-o", str(out),
               "--expert-offload", "hybrid", "--expert-placement", str(placement), *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0] and str(placement) in lines[0], done.stderr
    assert not out.exists()


def test_profile_through_the_expert_cache_counts_the_same(moe, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    written = {}
    for mode, extra in {"resident": [], "cache": ["--expert-cache-gb", "0.0002"]}.items():
        out = tmp_path / f"{mode}.json"
        result = CliRunner().invoke(app, ["experts-profile", moe, "--prompts", str(prompts), "--decode-tokens", "3", "--out", str(out), *extra])
        assert result.exit_code == 0, result.output
        written[mode] = json.loads(out.read_text())
    assert written["cache"] == written["resident"]
    assert sum(map(sum, written["cache"]["counts"].values())) > 0
