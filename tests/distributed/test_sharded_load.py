"""Loading one rank's shard reads only its slices, and the ranks' shards tile every tensor.

Building and loading a shard needs no process group (collectives run only in forward), so both
ranks of a 2-way split are loaded here in one process. Oracle: the checkpoint's tensors read whole
with safetensors.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import FIXTURES


class Recorder:
    """A tensor source that forwards to a checkpoint and remembers how each tensor was read."""

    def __init__(self, checkpoint):
        self.checkpoint, self.whole, self.sliced = checkpoint, set(), set()

    def get(self, name):
        self.whole.add(name)
        return self.checkpoint.get(name)

    def get_slice(self, name, dim, start, stop):
        self.sliced.add(name)
        return self.checkpoint.get_slice(name, dim, start, stop)


@pytest.mark.parametrize("family", ["qwen35_dense", "qwen35_moe"])
def test_two_rank_shards_tile_the_checkpoint(family, tmp_path):
    from safetensors.torch import load_file

    from freetoken.checkpoint.reader import UnifiedCheckpoint
    from freetoken.converters import convert
    from freetoken.distributed import ParallelContext
    from freetoken.distributed.sharding import shard_spec_of
    from freetoken.models.loader import load_model

    convert(FIXTURES / family / "hf", tmp_path / "u")
    ck = UnifiedCheckpoint.open(tmp_path / "u")
    whole = {}
    for shard in sorted((tmp_path / "u").glob("*.safetensors")):
        whole.update(load_file(shard))

    covered: dict[str, torch.Tensor] = {}  # name -> how many ranks hold each index along the split dim
    for rank in range(2):
        source = Recorder(ck)
        model = load_model(source, ck.family, ck.config, with_mtp=True, parallel=ParallelContext(rank, 2))
        assert not source.whole & source.sliced
        for name, param in model.named_parameters():
            spec = shard_spec_of(model, name)
            full = whole[name].float()
            if spec is None:  # replicated: read whole, equal to the checkpoint
                assert name in source.whole and torch.equal(param, full)
                continue
            assert name in source.sliced and name not in source.whole
            want = torch.cat([full.narrow(spec.dim, a, b - a) for a, b in spec.ranges], dim=spec.dim)
            assert torch.equal(param, want)
            count = covered.setdefault(name, torch.zeros(full.shape[spec.dim], dtype=torch.int64))
            for a, b in spec.ranges:
                count[a:b] += 1
    # every sharded tensor is split, not copied: each index held by exactly one rank
    assert covered and all(bool((c == 1).all()) for c in covered.values())
    assert {"model.embed_tokens.weight", "lm_head.weight", "mtp.fc.weight"} <= set(covered)
