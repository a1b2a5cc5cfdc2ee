"""Unified checkpoint + DFlash draft -> a new unified checkpoint (`convert(UNIFIED, DST, dflash=DIR)`).

Oracle: the HF fixture converted with its draft in one step (`convert(HF, DST, dflash=DIR)`): adding
the draft to the HF fixture's unified conversion must give the same manifest and the same tensors
bit for bit, and the source's own tensors, tokenizer files and manifest entries come through
unchanged. Refusals leave no output and no temporary directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from freetoken.checkpoint import UnifiedCheckpoint
from freetoken.converters import convert
from freetoken.errors import CheckpointError, FreetokenError, OutputExistsError

from tests.conftest import FIXTURES

TARGET = FIXTURES / "qwen35_dense" / "hf"
DRAFT = FIXTURES / "qwen35_dense_dflash" / "dflash"

pytestmark = pytest.mark.skipif(not (TARGET.is_dir() and DRAFT.is_dir()), reason=f"fixtures not found under {FIXTURES}")


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    """The HF fixture as a unified checkpoint, that plus the draft, and the one-step HF + draft conversion."""
    root = tmp_path_factory.mktemp("unified_dflash")
    convert(TARGET, root / "plain")
    convert(root / "plain", root / "added", dflash=DRAFT)
    convert(TARGET, root / "direct", dflash=DRAFT)
    return {name: root / name for name in ("plain", "added", "direct")}


def test_same_checkpoint_as_converting_target_and_draft_together(converted):
    added, direct = UnifiedCheckpoint.open(converted["added"]), UnifiedCheckpoint.open(converted["direct"])
    assert added.manifest == direct.manifest
    for name in direct.tensor_names():
        a, b = added.get(name), direct.get(name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert sorted(p.name for p in converted["added"].iterdir()) == sorted(p.name for p in converted["direct"].iterdir())


def test_source_is_carried_over_unchanged(converted):
    plain, added = UnifiedCheckpoint.open(converted["plain"]), UnifiedCheckpoint.open(converted["added"])
    assert [n for n in added.tensor_names() if not n.startswith("dflash.")] == plain.tensor_names()
    for name in plain.tensor_names():
        a, b = added.get(name), plain.get(name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    m, p = added.manifest, plain.manifest
    assert (m.family, m.config, m.tokenizer) == (p.family, p.config, p.tokenizer)
    assert {k: v for k, v in m.draft_heads.items() if k != "dflash"} == p.draft_heads and "dflash" in m.draft_heads
    assert m.provenance.converter == p.provenance.converter == "hf"
    assert m.provenance.sources[: len(p.provenance.sources)] == p.provenance.sources
    assert m.provenance.transforms[:-1] == p.provenance.transforms
    for file in ("tokenizer.json", "tokenizer_config.json"):
        assert (converted["added"] / file).read_bytes() == (converted["plain"] / file).read_bytes()


def test_draft_is_present_and_loads(converted):
    from freetoken.spec.dflash.loader import load_draft

    ck = UnifiedCheckpoint.open(converted["added"])
    draft = load_draft(ck, ck.draft_heads["dflash"], ck.config["num_hidden_layers"], ck.config["hidden_size"], ck.config["vocab_size"], device="cpu", dtype=torch.float32)
    assert draft.config.target_layer_ids == (0, 2) and draft.config.block_size == 4


def _fails(tmp_path: Path, exc: type, match: str, src: Path, **kw) -> None:
    out = tmp_path / "out"
    with pytest.raises(exc, match=match) as info:
        convert(src, out, **kw)
    assert "\n" not in str(info.value)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_without_a_draft_nothing_to_convert(converted, tmp_path):
    _fails(tmp_path, CheckpointError, "already a unified checkpoint; nothing to convert", converted["plain"])


def test_a_source_with_a_draft_is_refused(converted, tmp_path):
    _fails(tmp_path, CheckpointError, r"already has a DFlash draft", converted["added"], dflash=DRAFT)


def test_a_bad_draft_writes_nothing(converted, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(DRAFT, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"hidden_size": 32}))
    _fails(tmp_path, CheckpointError, "hidden_size 32 differs", converted["plain"], dflash=bad)


def test_options_that_do_not_apply(converted, tmp_path):
    _fails(tmp_path, FreetokenError, "--mtp and --text-only do not apply", converted["plain"], dflash=DRAFT, text_only=True)


def test_existing_output_and_the_source_itself(converted, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(OutputExistsError):
        convert(converted["plain"], tmp_path / "out", dflash=DRAFT)
    before = sorted(p.name for p in converted["plain"].iterdir())
    with pytest.raises(CheckpointError, match="the output is the source checkpoint"):
        convert(converted["plain"], converted["plain"], dflash=DRAFT, force=True)
    assert sorted(p.name for p in converted["plain"].iterdir()) == before


def test_cli(converted, tmp_path):
    from freetoken.cli import app

    res = CliRunner().invoke(app, ["convert", str(converted["plain"]), str(tmp_path / "cli"), "--dflash", str(DRAFT)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "draft heads: mtp, dflash" in res.output
    assert UnifiedCheckpoint.open(tmp_path / "cli").manifest == UnifiedCheckpoint.open(converted["added"]).manifest
