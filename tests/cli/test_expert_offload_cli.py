"""`freetoken generate --expert-offload` end to end on the converted qwen35_moe fixture.

Oracles: the token ids the resident run writes (cache and hybrid must write the same on CPU), the
weight-memory line on stderr, and the exit code and one-line stderr of `freetoken.cli.main` for bad values.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from freetoken.cli import app

GENERATE = ["generate", "-p", "def f(x):", "-p", "import os", "-n", "6", "--dtype", "bfloat16"]


def _tokens(path) -> list[list[int]]:
    return [json.loads(line)["token_ids"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def moe(fixture_unified):
    return str(fixture_unified("qwen35_moe"))


def test_generate_with_offload_writes_the_resident_tokens(moe, tmp_path):
    runner = CliRunner()
    runs = {"none": [], "cache": ["--expert-offload", "cache", "--expert-cache-gb", "0.0002"],
            "hybrid": ["--expert-offload", "hybrid", "--gpu-experts", "25%"]}
    tokens = {}
    for mode, extra in runs.items():
        out = tmp_path / f"{mode}.jsonl"
        result = runner.invoke(app, [*GENERATE[:1], moe, *GENERATE[1:], "-o", str(out), *extra])
        assert result.exit_code == 0, result.output
        assert "resident on cpu" in result.output
        if mode != "none":
            assert f"offloaded to host memory ({mode})" in result.output
        tokens[mode] = _tokens(out)
    assert tokens["cache"] == tokens["none"] and tokens["hybrid"] == tokens["none"]
    assert all(len(t) == 6 for t in tokens["none"])


@pytest.mark.parametrize("args, message", [
    (["--expert-offload", "cache"], "needs --expert-cache-gb"),
    (["--expert-offload", "cache", "--expert-cache-gb", "0.00001"], "a token needs 2"),
    (["--expert-offload", "hybrid", "--gpu-experts", "lots"], "give a count"),
    (["--gpu-experts", "2"], "needs --expert-offload hybrid"),
])
def test_bad_offload_options_exit_with_one_line(moe, tmp_path, args, message):
    code = "import sys; from freetoken.cli import main; sys.argv = ['freetoken'] + sys.argv[1:]; main()"
    env = {"FREETOKEN_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-c", code, "generate", moe, "-p", "x", "-n", "2", *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr
