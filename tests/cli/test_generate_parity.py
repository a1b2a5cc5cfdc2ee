"""`freetoken generate` and `freetoken parity` end to end on the fixture checkpoints.

Oracles: the files the commands write (JSONL records re-tokenised with the fixture's own
tokenizer, the parity JSON report), exit codes and stderr of `freetoken.cli.main`, and a fresh
interpreter for the import-time check.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from freetoken.cli import app
from tests.conftest import FIXTURES

DENSE_HF = FIXTURES / "qwen35_dense" / "hf"


@pytest.fixture(scope="module")
def unified(tmp_path_factory):
    dst = tmp_path_factory.mktemp("cli") / "dense"
    result = CliRunner().invoke(app, ["convert", str(DENSE_HF), str(dst)])
    assert result.exit_code == 0, result.output
    return dst


def _main(args, tmp_path):
    """Run `freetoken.cli.main` in a subprocess: exit code and stderr as a user sees them."""
    env = {"FREETOKEN_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    code = "import sys; from freetoken.cli import main; sys.argv = ['freetoken'] + sys.argv[1:]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120)


def test_generate_jsonl_with_mtp(unified, tmp_path):
    from tokenizers import Tokenizer

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "import sys"]) + "\n")
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["generate", str(unified), "--prompts", str(prompts), "--out", str(out), "--spec", "mtp", "-k", "2", "-n", "12"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    tok = Tokenizer.from_file(str(DENSE_HF / "tokenizer.json"))
    assert [r["prompt"] for r in records] == ["def add(a, b):", "import sys"]
    for r in records:
        assert r["prompt_tokens"] == len(tok.encode(r["prompt"], add_special_tokens=False).ids)
        assert r["completion_tokens"] == len(r["token_ids"]) <= 12
        assert r["completion"] == tok.decode(r["token_ids"], skip_special_tokens=True)
        assert len(r["accepted_lens"]) >= 1 and all(0 <= a <= 2 for a in r["accepted_lens"])


def test_generate_txt_prompts_and_hf_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("for i in range(3):\n\nclass A:\n")
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["generate", str(DENSE_HF), "--prompts", str(prompts), "--out", str(out), "-n", "6"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["for i in range(3):", "class A:"]
    assert all(r["completion_tokens"] == 6 or r["finish_reason"] == "stop" for r in records)
    assert list((tmp_path / "cache" / "converted").glob("*/manifest.json"))  # converted once into the cache


def test_parity_command_reports_pass(unified, tmp_path):
    report = tmp_path / "parity.json"
    result = CliRunner().invoke(app, ["parity", str(unified), "--spec", "mtp", "-k", "1", "-k", "3", "-n", "16", "-p", "def f(x):", "-p", "x = [", "--json", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert {"command", "commit", "gpu", "date", "dtype", "device"} <= set(data)
    assert set(data["runs"]) == {"k=1", "k=3"}
    assert all(r["passed"] is True and r["num_prompts"] == 2 and r["num_tokens"] == 32 for r in data["runs"].values())


def test_trunk_only_checkpoint_with_spec_mtp_fails_in_one_line(tmp_path):
    alone = tmp_path / "alone" / "qwen35-dense-trunk-f32.gguf"  # away from the mtp-*.gguf sidecar the converter would pair
    alone.parent.mkdir()
    shutil.copy(FIXTURES / "qwen35_dense" / "gguf" / alone.name, alone)
    trunk = tmp_path / "trunk"
    assert CliRunner().invoke(app, ["convert", str(alone), str(trunk)]).exit_code == 0
    proc = _main(["generate", str(trunk), "-p", "x", "--spec", "mtp", "-n", "2"], tmp_path)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "MTP" in lines[0] and "Traceback" not in proc.stderr


def test_missing_model_path_fails_in_one_line(tmp_path):
    proc = _main(["generate", str(tmp_path / "nope"), "-p", "x"], tmp_path)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "nope" in lines[0] and "Traceback" not in proc.stderr


def test_help_does_not_import_torch():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from freetoken.cli import app\n"
        "r = CliRunner().invoke(app, ['--help'])\n"
        "assert r.exit_code == 0 and 'generate' in r.output, r.output\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
