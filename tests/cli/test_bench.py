"""`freetoken bench` on CPU: the tiny shape and a fixture checkpoint, with oracle and MTP drafts.

Oracles: the JSON file the command writes (its provenance fields, the floor arithmetic against the
model's parameter bytes, oracle acceptance at corruption rate 0 is exactly 1 per position), the
bench's own check that every spec run reproduces the no-spec greedy tokens, and exit codes / stderr
of `freetoken.cli.main` for bad input.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from freetoken.cli import app
from tests.conftest import FIXTURES

SMALL = ["--device", "cpu", "--dtype", "float32", "--prompt-len", "24", "--new-tokens", "9"]


def _bench(args, out):
    result = CliRunner().invoke(app, ["bench", *args, *SMALL, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_tiny_shape_with_oracle_drafts(tmp_path):
    report = _bench(["--shape", "tiny", "--spec", "oracle", "-k", "2", "--corrupt-rate", "0", "--corrupt-rate", "0.5"], tmp_path / "tiny.json")
    assert {"command", "commit", "gpu", "date", "results"} <= set(report)
    assert report["command"].startswith("freetoken ")  # the process argv (pytest's, under CliRunner)
    base, exact, corrupted = report["results"]
    assert (base["spec"], exact["spec"], corrupted["spec"]) == ("none", "oracle", "oracle")
    assert base["shape"] == "tiny" and base["generated_tokens"] == 9 and base["decode_steps"] == 9
    assert exact["acceptance_per_position"] == [1.0, 1.0]  # drafts that replay the greedy output are all accepted
    assert exact["decode_steps"] == 3 and exact["mean_accepted_len"] == 3.0
    assert corrupted["acceptance_per_position"][0] < 1.0
    for r in report["results"]:
        assert r["floor_tokens_per_s"] == pytest.approx(r["batch_size"] / (r["floor_step_ms"] / 1000))
        assert r["fraction_of_floor"] == pytest.approx(r["floor_step_ms"] / r["step_ms"])
    assert exact["speedup_vs_no_spec"] == pytest.approx(exact["decode_tokens_per_s"] / base["decode_tokens_per_s"])


def test_tiny_shape_with_a_dflash_draft_and_oracle_tokens(tmp_path, monkeypatch):
    """dflash-oracle: the random DFlash draft runs on every step (its propose is called and its network
    runs), the oracle's tokens are proposed: all accepted at corruption 0, the greedy output kept."""
    from freetoken.spec.dflash.draft import DFlashDraft

    calls = []
    forward = DFlashDraft.forward
    monkeypatch.setattr(DFlashDraft, "forward", lambda self, *a: calls.append(1) or forward(self, *a))
    report = _bench(["--shape", "tiny", "--spec", "dflash-oracle", "-k", "8", "--corrupt-rate", "0", "--corrupt-rate", "0.3"], tmp_path / "d.json")
    base, exact, corrupted = report["results"]
    assert (exact["spec"], exact["num_draft_tokens"]) == ("dflash-oracle", 8)
    assert exact["acceptance_per_position"] == [1.0] * 8 and exact["decode_steps"] == 1 and exact["mean_accepted_len"] == 9.0
    assert corrupted["acceptance_per_position"][0] < 1.0 and corrupted["decode_steps"] > 1
    assert len(calls) >= exact["decode_steps"] + corrupted["decode_steps"]
    result = CliRunner().invoke(app, ["bench", str(tmp_path), "--spec", "dflash-oracle", "-k", "3", *SMALL])
    assert result.exit_code != 0 and "give --shape, not MODEL" in str(result.exception)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    dst = tmp_path_factory.mktemp("bench") / "qwen35_dense"
    result = CliRunner().invoke(app, ["convert", str(FIXTURES / "qwen35_dense" / "hf"), str(dst)])
    assert result.exit_code == 0, result.output
    return dst


def test_checkpoint_with_its_mtp_head(dense, tmp_path):
    """A real checkpoint: the floor counts its own parameters, and MTP drafts keep the greedy tokens."""
    from freetoken.checkpoint.reader import UnifiedCheckpoint

    report = _bench([str(dense), "--spec", "mtp", "-k", "2", "-b", "2"], tmp_path / "dense.json")
    base, mtp = report["results"]
    assert base["shape"] == mtp["shape"] == "qwen35_dense"
    assert (base["batch_size"], mtp["spec"], mtp["num_draft_tokens"]) == (2, "mtp", 2)
    assert len(mtp["acceptance_per_position"]) == 2 and mtp["generated_tokens"] == 18
    ck = UnifiedCheckpoint.open(dense)
    weights = sum(ck.get(name).numel() * 4 for name in ck.tensor_names() if not name.startswith("mtp.") and name != "model.embed_tokens.weight")
    assert base["floor_bytes_per_step"] > weights  # every weight but the embedding table (fp32 here), plus KV and state


def _main(args, tmp_path):
    env = {"FREETOKEN_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    code = "import sys; from freetoken.cli import main; sys.argv = ['freetoken'] + sys.argv[1:]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("case", ["both", "missing", "unknown_shape", "bad_device"])
def test_bad_input_is_one_line(tmp_path, case):
    args = {"both": [str(tmp_path), "--shape", "tiny"], "missing": [str(tmp_path / "nope")], "unknown_shape": ["--shape", "qwen9"],
            "bad_device": ["--shape", "tiny"]}[case]
    result = _main(["bench", *args, *SMALL, *(["--device", "cuda:99"] if case == "bad_device" else []), "--out", str(tmp_path / "out.json")], tmp_path)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert {"both": "not both", "missing": "nope", "unknown_shape": "qwen9", "bad_device": "cuda:99"}[case] in result.stderr
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("args", [["-b", "0"], ["--nope"]])
def test_a_usage_error_is_clicks_message_without_a_traceback(tmp_path, args):
    """Option errors go through click's usage message and exit 2, whichever click typer runs on
    (typer >= 0.29 carries its own copy, whose exceptions are not the click package's)."""
    result = _main(["bench", "--shape", "tiny", *SMALL, *args, "--out", str(tmp_path / "out.json")], tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.strip().splitlines()[-1].startswith("Error: "), result.stderr
    assert not (tmp_path / "out.json").exists()
