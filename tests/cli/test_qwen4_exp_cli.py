"""`freetoken generate` and `freetoken parity --spec mtp` on the qwen4_exp fixture (converted from HF).

Oracles: the JSONL the command writes (re-tokenised with the fixture's own tokenizer), the parity
JSON report.
"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from freetoken.cli import app
from tests.conftest import FIXTURES

HF_DIR = FIXTURES / "qwen4_exp" / "hf"


def test_generate_with_mtp(fixture_unified, tmp_path):
    from tokenizers import Tokenizer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nimport sys\n")
    out = tmp_path / "out.jsonl"
    args = ["generate", str(fixture_unified("qwen4_exp")), "--prompts", str(prompts), "--out", str(out), "--spec", "mtp", "-k", "2", "-n", "10"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    tok = Tokenizer.from_file(str(HF_DIR / "tokenizer.json"))
    assert [r["prompt"] for r in records] == ["def add(a, b):", "import sys"]
    for r in records:
        assert r["prompt_tokens"] == len(tok.encode(r["prompt"], add_special_tokens=False).ids)
        assert r["completion_tokens"] == len(r["token_ids"]) <= 10
        assert r["completion"] == tok.decode(r["token_ids"], skip_special_tokens=True)
        assert all(0 <= a <= 2 for a in r["accepted_lens"])


def test_parity_with_mtp_passes(fixture_unified, tmp_path):
    report = tmp_path / "parity.json"
    args = ["parity", str(fixture_unified("qwen4_exp")), "--spec", "mtp", "-k", "1", "-k", "3", "-n", "12", "--dtype", "bfloat16",
            "-p", "def f(x):", "-p", "x = [", "--json", str(report)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    runs = json.loads(report.read_text())["runs"]
    assert set(runs) == {"k=1", "k=3"}
    assert all(r["passed"] is True and r["num_prompts"] == 2 and r["num_tokens"] == 24 for r in runs.values())


def test_parity_against_transformers_passes(fixture_unified, tmp_path):
    """`parity --against hf` builds transformers' Qwen4ExpForCausalLM from the unified checkpoint."""
    report = tmp_path / "parity.json"
    args = ["parity", str(fixture_unified("qwen4_exp")), "--against", "hf", "-n", "8", "-p", "def f(x):", "--json", str(report)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    run = json.loads(report.read_text())["runs"]["hf"]
    assert run["passed"] is True and run["num_tokens"] == 8
