"""The embedded default model: shipped inside the package, used when no MODEL is given.

Oracles: greedy decoding without speculation (parity, fp32 and bf16, as CI must show), the
size budget of the issue, and transformers loading the shipped tensors under their HF names.
"""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from freetoken.cli import app
from freetoken.llm import DEFAULT_MODEL_DIR

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_files(path):", "class Stack:\n    def __init__(self):", "for i in range(10):"]


def test_default_model_is_shipped_and_small():
    files = [p for p in DEFAULT_MODEL_DIR.rglob("*") if p.is_file()]
    assert (DEFAULT_MODEL_DIR / "manifest.json").is_file() and (DEFAULT_MODEL_DIR / "tokenizer.json").is_file()
    manifest = json.loads((DEFAULT_MODEL_DIR / "manifest.json").read_text())
    assert {"mtp", "dflash"} <= set(manifest["draft_heads"])
    draft = {name: info for name, info in manifest["tensors"].items() if name.startswith("dflash.")}
    assert draft and all(info["dtype"] == "bfloat16" for info in draft.values())
    draft_bytes = sum(2 * math.prod(info["shape"]) for info in draft.values())
    assert draft_bytes <= 3 * 2**20  # the DFlash draft: a few MB
    assert sum(p.stat().st_size for p in files) - draft_bytes <= 16 * 2**20  # the model with its MTP head


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


@pytest.mark.parametrize("spec", ["mtp", "dflash"])
def test_generate_without_model(spec, tmp_path):
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["generate", "-n", "12", "--spec", spec, "--out", str(out)])
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


def test_dflash_draft_is_lossless_and_accepted_as_measured(tmp_path):
    """The embedded DFlash draft on the first 4 held-out prompts, 32 tokens each, fp32 on CPU: greedy
    output identical to no-spec, and mean accepted lengths as recorded when the draft was made
    (128 tokens in 93 / 87 verify steps at k = 1 / 3; all 50 prompts: bench/results/embedded-dflash-k*-cpu.json)."""
    from pathlib import Path

    heldout = Path(__file__).resolve().parents[2] / "bench" / "data" / "heldout_prompts.jsonl"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(heldout.read_text().splitlines(keepends=True)[:4]))
    report = tmp_path / "parity.json"
    args = ["parity", "--spec", "dflash", "-k", "1", "-k", "3", "-n", "32", "--prompts", str(prompts), "--json", str(report)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    runs = json.loads(report.read_text())["runs"]
    for name, recorded in (("k=1", 128 / 93), ("k=3", 128 / 87)):
        assert runs[name]["passed"] and runs[name]["num_tokens"] == 128
        assert runs[name]["mean_accepted_len"] == pytest.approx(recorded, abs=0.03), name
