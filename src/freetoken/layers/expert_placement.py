"""`--expert-placement FILE.json`: which routed experts each MoE layer keeps on the device (hybrid offload).

The file is a JSON object whose "resident" maps MoE layer names (the blocks' module paths without
".mlp": "model.layers.0", "mtp.layers.0") to lists of expert ids; `freetoken experts-profile` writes
one, with the router's pick counts beside it ("counts", not read here). Every list has the same length
N, which is the resident count (so --gpu-experts is not given with a file); a MoE layer the file does
not list keeps experts [0, N). Ids may come in any order; the layer's resident set is sorted.
`read_placement` checks what the file alone can show; `check_layers` what needs the model (layer
names, expert counts). Every error is one line naming the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from freetoken.errors import FreetokenError


def layer_name(block_name: str) -> str:
    """A SparseMoE module's layer as placement files name it: "model.layers.3.mlp" -> "model.layers.3"."""
    return block_name.removesuffix(".mlp")


@dataclass(frozen=True)
class ExpertPlacement:
    path: str  # the file it was read from, for errors
    count: int  # N: resident experts per layer
    resident: tuple[tuple[str, tuple[int, ...]], ...]  # (layer name, its resident expert ids ascending)

    def resident_experts(self, layer: str) -> list[int]:
        """The layer's resident ids, ascending: the file's list, or [0, N) for a layer it does not list."""
        return list(dict(self.resident).get(layer, range(self.count)))

    def check_layers(self, num_experts: dict[str, int]) -> None:
        """num_experts: the model's MoE layer name -> its expert count. Unknown layers and ids >= E are errors."""
        for layer, ids in self.resident:
            if layer not in num_experts:
                known = ", ".join(num_experts)
                raise FreetokenError(f"{self.path}: unknown MoE layer {layer!r} (this model's: {known})")
            if ids and ids[-1] >= num_experts[layer]:
                raise FreetokenError(f"{self.path}: layer {layer!r}: expert {ids[-1]} out of range [0, {num_experts[layer]})")
        for layer, experts in num_experts.items():
            if self.count > experts:
                raise FreetokenError(f"{self.path}: {self.count} resident experts per layer, but layer {layer!r} has {experts}")


def read_placement(path: str | Path) -> ExpertPlacement:
    """Parse and check FILE -> ExpertPlacement; a one-line FreetokenError naming the file otherwise."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise FreetokenError(f"--expert-placement {path}: cannot read it as JSON ({reason})") from None
    resident = data.get("resident") if isinstance(data, dict) else None
    if not isinstance(resident, dict) or not resident:
        raise FreetokenError(f'{path}: expected {{"resident": {{"<MoE layer>": [expert ids], ...}}}}')
    layers = []
    for layer, ids in resident.items():
        if not isinstance(ids, list) or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in ids):
            raise FreetokenError(f"{path}: layer {layer!r}: expected a list of expert ids (integers >= 0)")
        if len(set(ids)) != len(ids):
            duplicate = next(e for e in ids if ids.count(e) > 1)
            raise FreetokenError(f"{path}: layer {layer!r}: expert {duplicate} listed twice")
        layers.append((layer, tuple(sorted(ids))))
    counts = {len(ids) for _, ids in layers}
    if len(counts) > 1:
        (first, a), (other, b) = layers[0], next(entry for entry in layers if len(entry[1]) != len(layers[0][1]))
        raise FreetokenError(f"{path}: layer {first!r} lists {len(a)} experts, layer {other!r} {len(b)}: "
                             "every layer keeps the same count")
    return ExpertPlacement(str(path), counts.pop(), tuple(layers))
