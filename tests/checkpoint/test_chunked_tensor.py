"""The writer's ChunkedTensor: pieces written one at a time, checked against the declared shape.

Oracle: the concatenation of the pieces, read back through the unified reader.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.checkpoint import ChunkedTensor, Provenance, UnifiedCheckpoint, write_checkpoint
from freetoken.errors import CheckpointError

PROVENANCE = Provenance("test", "0", (), ())


def _write(dst, tensors, **kw):
    return write_checkpoint(dst, family="qwen3_5", config={}, tensors=tensors, draft_heads={}, tokenizer_files={}, provenance=PROVENANCE, **kw)


def _chunked(pieces: list[torch.Tensor], shape: tuple[int, ...]) -> ChunkedTensor:
    return ChunkedTensor(shape, pieces[0].dtype, lambda: iter(pieces))


def test_pieces_are_joined_on_dim_0_and_cast(tmp_path):
    pieces = [torch.randn(3, 4), torch.randn(5, 4)]
    small = torch.randn(2, 2)
    _write(tmp_path / "ck", [("a", small), ("table", _chunked(pieces, (8, 4))), ("b", small + 1)], dtype=torch.bfloat16, shard_size=100)
    ck = UnifiedCheckpoint.open(tmp_path / "ck")
    assert torch.equal(ck.get("table"), torch.cat(pieces).to(torch.bfloat16))
    assert torch.equal(ck.get("a"), small.to(torch.bfloat16)) and torch.equal(ck.get("b"), (small + 1).to(torch.bfloat16))
    assert ck.manifest.tensors["table"]["shape"] == [8, 4] and ck.manifest.tensors["table"]["dtype"] == "bfloat16"


@pytest.mark.parametrize("pieces, match", [
    ([torch.randn(3, 4), torch.randn(4, 4)], "its pieces hold 7 rows, expected 8"),
    ([torch.randn(3, 4), torch.randn(5, 4), torch.randn(1, 4)], "its pieces hold 9 rows, expected 8"),
    ([torch.randn(3, 4), torch.randn(5, 3)], "does not fit"),
])
def test_pieces_that_do_not_fit_leave_nothing(tmp_path, pieces, match):
    with pytest.raises(CheckpointError, match=match):
        _write(tmp_path / "ck", [("table", _chunked(pieces, (8, 4)))])
    assert list(tmp_path.iterdir()) == []
