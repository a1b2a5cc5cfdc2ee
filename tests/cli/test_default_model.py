"""The embedded default model: shipped inside the package, used when no MODEL is given.

Oracles: greedy decoding without speculation (parity, fp32 and bf16, as CI must show), the
size budget of the issue, and transformers loading the shipped tensors under their HF names.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from freetoken.cli import app
from freetoken.llm import DEFAULT_MODEL_DIR

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_files(path):", "class Stack:\n    def __init__(self):", "for i in range(10):"]


def test_default_model_is_shipped_and_small():
    files = [p for p in DEFAULT_MODEL_DIR.rglob("*") if p.is_file()]
    assert (DEFAULT_MODEL_DIR / "manifest.json").is_file() and (DEFAULT_MODEL_DIR / "tokenizer.json").is_file()
    assert sum(p.stat().st_size for p in files) <= 16 * 2**20
    manifest = json.loads((DEFAULT_MODEL_DIR / "manifest.json").read_text())
    assert "mtp" in manifest["draft_heads"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_parity_on_the_default_model(dtype, tmp_path):
    report = tmp_path / "parity.json"
    args = ["parity", "--dtype", dtype, "-n", "40", "-k", "1", "-k", "3", "--json", str(report)]
    for p in PROMPTS:
        args += ["--prompt", p]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    runs = json.loads(report.read_text())["runs"]
    assert set(runs) == {"k=1", "k=3"}
    for run in runs.values():
        assert run["passed"] and run["num_matching"] == run["num_tokens"] == 40 * len(PROMPTS)
        # A head trained with its target: most first drafts are accepted.
        assert run["acceptance_per_position"][0] > 0.3


def test_generate_without_model(tmp_path):
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["generate", "-n", "12", "--spec", "mtp", "--out", str(out)])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 3 and all(r["completion_tokens"] == 12 or r["finish_reason"] == "stop" for r in lines)
    assert "mean accepted length" in result.output


def test_default_model_loads_in_transformers():
    """The unified checkpoint's names are HF's: transformers' greedy continuation equals ours."""
    import torch

    from freetoken.checkpoint.reader import UnifiedCheckpoint
    from freetoken.engine.config import EngineConfig
    from freetoken.hf_oracle import hf_greedy, load_hf_model
    from freetoken.llm import LLM
    from freetoken.sampling import SamplingParams

    ckpt = UnifiedCheckpoint.open(DEFAULT_MODEL_DIR)
    hf = load_hf_model(ckpt, ckpt.config, ckpt.tensor_names(), dtype=torch.float32)
    llm = LLM(None, EngineConfig())
    ids = llm.encode(PROMPTS[0])
    (req,), _ = llm.generate_ids([ids], SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert hf_greedy(hf, ids, 24, ()) == req.output_token_ids
