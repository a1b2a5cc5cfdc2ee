"""What a converter needs to know about a family's checkpoint tensors, as data.

Each family's `weights.py` exports `RULES = WeightRules(...)`; converters reach it through the
registry (`registry.weight_rules(family)`) and never name a family. The rules say how a source
name becomes a canonical one, which canonical tensors a config implies (with shapes), which
source tensors are pieces of one canonical tensor (n-gram table shards) and which source tensors
are constants recomputed from the config (checked, then dropped).

Also here, because every family with Hugging Face MoE blocks shares it: the per-expert layout
that `save_pretrained` writes (`...mlp.experts.{e}.{gate,up,down}_proj.weight`) and its fusion
into `experts.gate_up_proj [E, 2I, H]` (gate rows first) and `experts.down_proj [E, H, I]`; and
how many MTP layers a set of canonical names holds (`mtp_layer_count`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from freetoken.errors import CheckpointError

_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")
_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight$")
EXPERT_KINDS = ("gate_proj", "up_proj", "down_proj")


def no_shards(name: str) -> None:
    """Shard rule of a family whose checkpoints store every tensor whole."""
    return None


def no_declared_shards(raw_config: dict, joined: str) -> None:
    """Shard-count rule of a family whose configs declare no shard counts."""
    return None


def no_derived_buffers(cfg: Any) -> dict[str, list[int]]:
    """Buffer rule of a family whose checkpoints carry no recomputable constants."""
    return {}


@dataclass(frozen=True)
class WeightRules:
    """A family's checkpoint-tensor rules (see the module docstring)."""

    canonical_name: Callable[[str], str]  # source name -> canonical name
    expected_tensors: Callable[..., dict[str, tuple[int, ...]]]  # (cfg, with_mtp=bool) -> canonical name -> shape
    shard_key: Callable[[str], tuple[str, int] | None] = no_shards  # canonical shard name -> (joined name, index)
    declared_shards: Callable[[dict, str], int | None] = no_declared_shards  # (raw HF config, joined name) -> shard count
    derived_buffers: Callable[[Any], dict[str, list[int]]] = no_derived_buffers  # cfg -> canonical buffer name -> values


def per_expert_key(name: str) -> tuple[str, int, str] | None:
    """`...mlp.experts.{e}.{kind}.weight` -> (`...mlp.experts`, e, kind); None for any other name."""
    m = _PER_EXPERT.match(name)
    return (m["prefix"], int(m["e"]), m["kind"]) if m else None


def fuse_group(prefix: str, group: dict, num_experts: int) -> dict:
    """Fuse one layer's per-expert tensors, keyed (expert, kind), into `gate_up_proj` and `down_proj`."""
    import torch

    missing = [f"{prefix}.{e}.{k}.weight" for e in range(num_experts) for k in EXPERT_KINDS if (e, k) not in group]
    extra = [f"{prefix}.{e}.{k}.weight" for (e, k) in group if e >= num_experts]
    if missing or extra:
        what = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(extra[:3])}"
        raise CheckpointError(f"incomplete per-expert tensors for {prefix}: {what}")
    gate_up = torch.stack([torch.cat([group[(e, "gate_proj")], group[(e, "up_proj")]], dim=0) for e in range(num_experts)])
    down = torch.stack([group[(e, "down_proj")] for e in range(num_experts)])
    return {f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": down}  # [E, 2I, H], [E, H, I]


def mtp_layer_count(names: Iterable[str]) -> int:
    """MTP layers among canonical `names`: the highest i of `mtp.layers.{i}.*` plus one, 1 when the
    `mtp.*` names carry no layer, 0 without any `mtp.*` name."""
    names = list(names)
    layers = [int(m[1]) for n in names if (m := _MTP_LAYER.match(n))]
    if layers:
        return max(layers) + 1
    return int(any(n.startswith("mtp.") for n in names))
