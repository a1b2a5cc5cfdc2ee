"""`freetoken convert` and `freetoken inspect` through Typer's CliRunner on a local app.

The commands are registered on a tiny app here (the real one lives in `cli/__init__.py`); the
oracle for the output is the fixture checkpoint (its tensors, config and GGUF metadata).
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest
import torch
import typer
from safetensors.torch import load_file
from typer.testing import CliRunner

from freetoken.checkpoint import UnifiedCheckpoint
from freetoken.errors import CheckpointError, FreetokenError, OutputExistsError

from tests.conftest import FIXTURES

REPO = Path(__file__).resolve().parents[2]


def _command(name: str):
    """The command function from `freetoken.cli.<name>` (from its file while the app package is absent)."""
    try:
        return getattr(importlib.import_module(f"freetoken.cli.{name}"), name)
    except ModuleNotFoundError:
        spec = importlib.util.spec_from_file_location(f"_cli_{name}", REPO / "cli" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return getattr(module, name)


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer()
    app.command()(_command("convert"))
    app.command()(_command("inspect"))
    return app


def _run(app, *args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_convert_with_options(app, tmp_path):
    src = FIXTURES / "qwen35_moe" / "hf"
    res = _run(app, "convert", src, tmp_path / "out", "--dtype", "float32", "--text-only", "--shard-size", "200KB")
    assert res.exit_code == 0, res.output
    assert "wrote" in res.output and "draft heads: mtp" in res.output
    ck = UnifiedCheckpoint.open(tmp_path / "out")
    want = {k.replace("model.language_model.", "model."): v for k, v in load_file(src / "model.safetensors").items() if not k.startswith("model.visual.")}
    assert sorted(ck.tensor_names()) == sorted(want)
    for name, t in want.items():
        assert ck.get(name).dtype == torch.float32 and torch.equal(ck.get(name), t.float())
    per_shard: dict[str, list[int]] = {}
    for name, info in ck.manifest.tensors.items():
        per_shard.setdefault(info["shard"], []).append(want[name].numel() * 4)
    assert len(per_shard) > 1 and all(sum(b) <= 200_000 or len(b) == 1 for b in per_shard.values())


def test_convert_errors(app, tmp_path):
    res = _run(app, "convert", tmp_path / "missing", tmp_path / "out")
    assert res.exit_code != 0 and isinstance(res.exception, CheckpointError)
    assert "missing: no such file or directory" in str(res.exception)
    (tmp_path / "out").mkdir()
    res = _run(app, "convert", FIXTURES / "qwen35_dense" / "hf", tmp_path / "out")
    assert res.exit_code != 0 and isinstance(res.exception, OutputExistsError) and "--force" in str(res.exception)
    res = _run(app, "convert", FIXTURES / "qwen35_dense" / "hf", tmp_path / "out2", "--shard-size", "lots")
    assert res.exit_code != 0 and isinstance(res.exception, FreetokenError) and "bad --shard-size 'lots'" in str(res.exception)
    res = _run(app, "convert", FIXTURES / "qwen35_dense" / "hf", tmp_path / "out3", "--mtp", tmp_path / "x.gguf")
    assert res.exit_code != 0 and "--mtp applies to GGUF sources only" in str(res.exception)
    res = _run(app, "convert", FIXTURES / "qwen35_dense" / "hf", tmp_path / "out4", "--dtype", "int8")
    assert res.exit_code == 2  # rejected by the option's choices
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_convert_force_replaces(app, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old").write_text("x")
    res = _run(app, "convert", FIXTURES / "qwen35_dense" / "hf", tmp_path / "out", "--force")
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "out" / "old").exists() and UnifiedCheckpoint.open(tmp_path / "out").family == "qwen3_5"


def test_inspect_unified_and_hf(app, tmp_path):
    src = FIXTURES / "qwen35_moe" / "hf"
    assert _run(app, "convert", src, tmp_path / "out").exit_code == 0
    for path in (tmp_path / "out", src):
        res = _run(app, "inspect", path)
        assert res.exit_code == 0, res.output
        for text in ("qwen3_5_moe", "3 linear attention, 1 full attention", "8 experts, top-2", "mtp", "1024x64", "8x64x64"):
            assert text in res.output, (path, text)
    res = _run(app, "inspect", tmp_path / "out")
    assert "hf (freetoken" in res.output and "model.safetensors" in res.output


def test_inspect_gguf(app):
    res = _run(app, "inspect", FIXTURES / "qwen35_moe" / "gguf" / "qwen35-moe-q8_0.gguf")
    assert res.exit_code == 0, res.output
    assert "qwen35moe" in res.output and "Q8_0" in res.output


def test_inspect_not_a_checkpoint(app, tmp_path):
    res = _run(app, "inspect", tmp_path)
    assert res.exit_code != 0 and isinstance(res.exception, CheckpointError) and "not a checkpoint" in str(res.exception)
