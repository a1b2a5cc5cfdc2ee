"""Where a MoE model's routed experts live: all on the device, offloaded behind a device cache, or split.

none    every expert resident on the device (the default; the CUDA-graphed path).
cache   every routed expert in host memory; the device holds `expert_cache_gb` of expert slots, split
        evenly over the MoE layers; each layer fetches the experts its router picks (LRU). The same
        kernels run on the same weights, so the outputs are those of `none`, bit for bit.
hybrid  per layer N experts resident on the device: [0, N) (N = `gpu_experts`, or `gpu_expert_fraction`
        of the layer's experts), or the ids a `placement` file lists (layers/expert_placement.py);
        the others computed on the CPU from host memory.
        The placement is static, so a row's bits do not depend on what ran before; they may differ
        from `none` on a GPU (the CPU's products are not the GPU's), not on a CPU-only machine.

Both offload modes read the routing on the host every MoE layer, so they run the eager path (no
CUDA graphs). The dense parts, the router and the shared expert stay resident.
"""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.errors import FreetokenError
from freetoken.layers.expert_placement import ExpertPlacement, read_placement

OFFLOAD_MODES = ("none", "cache", "hybrid")


@dataclass(frozen=True)
class ExpertOffloadConfig:
    mode: str = "none"  # none | cache | hybrid
    expert_cache_gb: float | None = None  # cache: device memory for the expert slots of every MoE layer together (GiB)
    gpu_experts: int | None = None  # hybrid: experts per layer resident on the device
    gpu_expert_fraction: float | None = None  # hybrid: the resident share of each layer's experts, instead of gpu_experts
    placement: ExpertPlacement | None = None  # hybrid: each layer's resident ids from a file, instead of gpu_experts

    def __post_init__(self):
        if self.mode not in OFFLOAD_MODES:
            raise FreetokenError(f"--expert-offload {self.mode!r}: use none, cache or hybrid")
        cache_given = self.expert_cache_gb is not None
        split_given = self.gpu_experts is not None or self.gpu_expert_fraction is not None
        if self.mode != "cache" and cache_given:
            raise FreetokenError("--expert-cache-gb needs --expert-offload cache")
        if self.mode != "hybrid" and split_given:
            raise FreetokenError("--gpu-experts needs --expert-offload hybrid")
        if self.mode != "hybrid" and self.placement is not None:
            raise FreetokenError("--expert-placement needs --expert-offload hybrid")
        if split_given and self.placement is not None:
            path = self.placement.path
            raise FreetokenError(f"--expert-placement {path} gives the resident count itself: leave out --gpu-experts")
        if self.mode == "cache" and not (cache_given and self.expert_cache_gb > 0):
            raise FreetokenError("--expert-offload cache needs --expert-cache-gb > 0 (device memory for expert slots, GiB)")
        if self.mode == "hybrid":
            if self.placement is None and (self.gpu_experts is None) == (self.gpu_expert_fraction is None):
                raise FreetokenError("--expert-offload hybrid needs --gpu-experts: a count N >= 0 or a fraction in [0, 1]")
            if self.gpu_experts is not None and self.gpu_experts < 0:
                raise FreetokenError(f"--gpu-experts {self.gpu_experts}: must be >= 0")
            if self.gpu_expert_fraction is not None and not 0.0 <= self.gpu_expert_fraction <= 1.0:
                raise FreetokenError(f"--gpu-experts {self.gpu_expert_fraction}: a fraction must be in [0, 1]")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def resident_experts(self, layer: str, num_experts: int) -> list[int]:
        """hybrid: the layer's resident expert ids, ascending (the placement file's, else [0, N))."""
        if self.placement is not None:
            return self.placement.resident_experts(layer)
        return list(range(self.num_resident_experts(num_experts)))

    def num_resident_experts(self, num_experts: int) -> int:
        """hybrid: experts per layer on the device (the fraction rounded down, the count capped at num_experts)."""
        if self.placement is not None:
            return self.placement.count
        if self.gpu_experts is not None:
            return min(self.gpu_experts, num_experts)
        return int(num_experts * self.gpu_expert_fraction)

    @classmethod
    def from_options(cls, mode: str, expert_cache_gb: float | None = None, gpu_experts: str | None = None,
                     placement_file: str | None = None) -> ExpertOffloadConfig:
        """From the CLI's text: --gpu-experts is a count ("64") or a fraction ("0.25", "25%"); --expert-placement a file."""
        count, fraction = parse_gpu_experts(gpu_experts) if gpu_experts is not None else (None, None)
        if placement_file is not None and mode != "hybrid":
            raise FreetokenError("--expert-placement needs --expert-offload hybrid")
        placement = read_placement(placement_file) if placement_file is not None else None
        return cls(mode, expert_cache_gb, count, fraction, placement)


def parse_gpu_experts(text: str) -> tuple[int | None, float | None]:
    """"64" -> (64, None); "0.25" or "25%" -> (None, 0.25); else a one-line FreetokenError."""
    value = text.strip()
    try:
        if value.endswith("%"):
            return None, float(value[:-1]) / 100
        if value.isdigit():
            return int(value), None
        if "." in value:
            return None, float(value)
    except ValueError:
        pass
    raise FreetokenError(f"--gpu-experts {text!r}: give a count (64), a fraction (0.25) or a percentage (25%)")
