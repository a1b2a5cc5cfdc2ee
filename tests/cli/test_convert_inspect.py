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
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


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


DRAFTS = FIXTURES / "qwen35_dense_dflash"


@pytest.mark.parametrize("target", [FIXTURES / "qwen35_dense" / "hf", FIXTURES / "qwen35_dense" / "gguf" / "qwen35-dense-f32.gguf"])
def test_convert_and_inspect_with_dflash(app, tmp_path, target):
    res = _run(app, "convert", target, tmp_path / "out", "--dflash", DRAFTS / "dflash")
    assert res.exit_code == 0, res.output
    assert "draft heads: mtp, dflash" in res.output
    draft = load_file(DRAFTS / "dflash" / "model.safetensors")
    ck = UnifiedCheckpoint.open(tmp_path / "out")
    assert all(torch.equal(ck.get(f"dflash.{n}"), t) for n, t in draft.items())
    res = _run(app, "inspect", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert "dflash (block size 4, 2 layers, taps [0, 2], mask id 1023)" in res.output
    assert "mtp (num_layers=1)" in res.output and "DFlash draft from" in res.output


def test_inspect_draft_directories(app):
    res = _run(app, "inspect", DRAFTS / "dflash2")
    assert res.exit_code == 0, res.output
    for field, value in (("architecture", "DFlash2DraftModel"), ("block size", "4"), ("taps (target layers)", "[0, 2]"), ("mask token id", "1023"),
                         ("conv kernel / group", "2 / 16"), ("selector rank / top-k", "8 / 4")):
        assert any(field in line and value in line for line in res.output.splitlines()), (field, res.output)
    res = _run(app, "inspect", DRAFTS / "dflash")
    assert res.exit_code == 0 and "DFlashDraftModel" in res.output and "selector" not in res.output, res.output


def test_convert_and_inspect_with_dflash2(app, tmp_path):
    res = _run(app, "convert", FIXTURES / "qwen35_dense" / "hf", tmp_path / "out", "--dflash", DRAFTS / "dflash2")
    assert res.exit_code == 0, res.output
    res = _run(app, "inspect", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert "dflash (DFlash2, block size 4, 2 layers, taps [0, 2], mask id 1023, selector top 4 rank 8)" in res.output


def test_convert_dflash_errors(app, tmp_path):
    target = FIXTURES / "qwen35_dense" / "hf"
    res = _run(app, "convert", DRAFTS / "dflash", tmp_path / "a", "--dflash", DRAFTS / "dflash")
    assert res.exit_code != 0 and isinstance(res.exception, CheckpointError)
    assert str(res.exception) == f"{DRAFTS / 'dflash'}: a DFlash draft, not a target: pass it with --dflash next to its target"
    res = _run(app, "convert", target, tmp_path / "b", "--dflash", DRAFTS / "dflash2" / "config.json")
    assert res.exit_code != 0 and isinstance(res.exception, CheckpointError)
    assert str(res.exception).startswith(f"{DRAFTS / 'dflash2' / 'config.json'}: not a DFlash draft directory")
    res = _run(app, "convert", target, tmp_path / "c", "--dflash", tmp_path / "nothing")
    assert res.exit_code != 0 and "nothing: no such file or directory" in str(res.exception)
    assert list(tmp_path.iterdir()) == []


def test_progress_total_counts_the_draft():
    source_bytes = importlib.import_module("freetoken.cli.convert")._source_bytes
    target, draft = FIXTURES / "qwen35_dense" / "hf", DRAFTS / "dflash"
    sizes = [(target / "model.safetensors").stat().st_size, (draft / "model.safetensors").stat().st_size]
    assert source_bytes(str(target), None, str(draft)) == sum(sizes)
    assert source_bytes(str(target), None, None) == sizes[0]
