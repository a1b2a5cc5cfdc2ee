"""Load a MoE model with its routed experts off the device (layers/offload_config.py), and say where its bytes are.

`ExpertOffloader.detach` runs on the model while it is still on the meta device: every SparseMoE drops
its expert parameters, so materialising the model allocates only the dense parts, routers and shared
experts; it also checks that those, with the expert slots (cache) or resident experts (hybrid), fit
the device's free memory, and says so in one line if not. `attach` then gives each block its host
store (read lazily from the checkpoint) and its CachedExperts or HybridExperts, and turns CUDA graphs
off for the model (the offload reads the routing on the host each layer; the eager path runs).

`weight_memory` / `describe_weight_memory`: resident bytes on the device (each storage once) and the
experts' bytes in host memory, for `freetoken generate` and `freetoken bench`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.distributed.sharding import ShardSpec, read_shard
from freetoken.errors import CheckpointError, FreetokenError
from freetoken.layers.expert_cache import ExpertSlotCache
from freetoken.layers.expert_offload import CachedExperts, HybridExperts
from freetoken.layers.expert_placement import layer_name
from freetoken.layers.expert_store import HostExpertStore, expert_bytes
from freetoken.layers.moe import moe_blocks
from freetoken.layers.offload_config import ExpertOffloadConfig

GIB = 2**30


@dataclass(frozen=True)
class ExpertShape:
    num_experts: int  # E
    top_k: int
    gate_up: tuple[int, int]  # one expert's [2I, H]
    down: tuple[int, int]  # [H, I]


class ExpertOffloader:
    def __init__(self, config: ExpertOffloadConfig, device: torch.device | str, dtype: torch.dtype, parallel_world_size: int = 1):
        if parallel_world_size > 1:
            raise FreetokenError("--expert-offload does not run with --tensor-parallel")
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        self.shapes: dict[str, ExpertShape] = {}  # SparseMoE module name -> its experts' shape
        self.num_slots = 0  # cache: slots per MoE layer

    def expert_bytes(self, shape: ExpertShape) -> int:
        return expert_bytes(shape.gate_up, shape.down, self.dtype)

    @torch.no_grad()
    def detach(self, model: torch.nn.Module) -> None:
        """On the meta device: drop every SparseMoE's routed expert parameters and check that the rest fits."""
        for name, moe in moe_blocks(model):
            experts = moe.experts
            per_expert = tuple(experts.gate_up_proj.shape[1:]), tuple(experts.down_proj.shape[1:])
            self.shapes[name] = ExpertShape(experts.count, moe.top_k, *per_expert)
            del experts.gate_up_proj, experts.down_proj
        if not self.shapes:
            raise FreetokenError("--expert-offload needs a MoE model; this one has no routed experts")
        if self.config.placement is not None:
            self.config.placement.check_layers({layer_name(name): s.num_experts for name, s in self.shapes.items()})
        resident = sum(p.numel() * p.element_size() for p in model.parameters())
        self._check_fits(resident, self._plan_expert_bytes())

    def _plan_expert_bytes(self) -> int:
        """Device bytes of the experts this mode keeps there (cache slots or resident experts); sets num_slots."""
        shapes = list(self.shapes.values())
        if self.config.mode == "hybrid":
            return sum(self.config.num_resident_experts(s.num_experts) * self.expert_bytes(s) for s in shapes)
        largest = max(self.expert_bytes(s) for s in shapes)
        per_layer = int(self.config.expert_cache_gb * GIB) // len(shapes)
        need = max(s.top_k for s in shapes)
        self.num_slots = min(per_layer // largest, max(s.num_experts for s in shapes))
        if self.num_slots < need:
            floor = need * largest * len(shapes) / GIB
            gb = self.config.expert_cache_gb
            raise FreetokenError(f"--expert-cache-gb {gb:g} gives {self.num_slots} expert slots per MoE layer; "
                                 f"a token needs {need}: use at least {floor:.3g}")
        return sum(min(self.num_slots, s.num_experts) * self.expert_bytes(s) for s in shapes)

    def _check_fits(self, resident_bytes: int, expert_device_bytes: int) -> None:
        if self.device.type != "cuda":
            return
        free, _ = torch.cuda.mem_get_info(self.device)
        if resident_bytes > free:
            raise FreetokenError(f"the model's non-expert weights need {resident_bytes / GIB:.2f} GiB but {self.device} has "
                                 f"{free / GIB:.2f} GiB free: it does not fit even with every expert offloaded")
        if resident_bytes + expert_device_bytes > free:
            knob = "--expert-cache-gb" if self.config.mode == "cache" else "--gpu-experts"
            raise FreetokenError(f"the non-expert weights ({resident_bytes / GIB:.2f} GiB) and the experts kept on {self.device} "
                                 f"({expert_device_bytes / GIB:.2f} GiB) exceed its {free / GIB:.2f} GiB free: lower {knob}")

    @torch.no_grad()
    def attach(self, model: torch.nn.Module, source) -> None:
        """Give every SparseMoE its offloaded experts, read from `source` (a TensorSource)."""
        pin = self.device.type == "cuda"
        for name, moe in moe_blocks(model):
            shape = self.shapes[name]
            gate_up_name, down_name = f"{name}.experts.gate_up_proj", f"{name}.experts.down_proj"
            for tensor, per_expert in ((gate_up_name, shape.gate_up), (down_name, shape.down)):
                _check_stored_shape(source, tensor, (shape.num_experts, *per_expert))
            if self.config.mode == "cache":
                store = HostExpertStore(source, gate_up_name, down_name, 0, shape.num_experts, shape.gate_up, shape.down,
                                        self.dtype, pin)
                slots = min(self.num_slots, shape.num_experts)
                moe.offload = CachedExperts(ExpertSlotCache(store, slots, self.device, moe.stacks_shared_expert), shape.top_k)
                continue
            resident = self.config.resident_experts(layer_name(name), shape.num_experts)
            resident_set = set(resident)
            by_rank = tuple(resident + [e for e in range(shape.num_experts) if e not in resident_set])  # rank -> expert id
            store = HostExpertStore(source, gate_up_name, down_name, len(resident), shape.num_experts, shape.gate_up, shape.down,
                                    self.dtype, pin, checkpoint_ids=by_rank)
            gate_up = _read_experts(source, gate_up_name, resident, self.device, self.dtype)
            down = _read_experts(source, down_name, resident, self.device, self.dtype)
            rank = torch.argsort(torch.tensor(by_rank)).to(self.device)  # expert id -> rank
            moe.offload = HybridExperts(gate_up, down, store, shape.top_k, rank)
        model.supports_cuda_graphs = False
        model.expert_offload = self.config


def _check_stored_shape(source, name: str, shape: tuple[int, ...]) -> None:
    manifest = getattr(source, "manifest", None)
    try:
        stored = tuple(manifest.tensors[name]["shape"]) if manifest is not None else tuple(source.get(name).shape)
    except KeyError:
        raise CheckpointError(f"missing tensor {name}") from None
    if stored != shape:
        raise CheckpointError(f"tensor {name} has shape {stored}, expected {shape}")


def _read_experts(source, name: str, experts: list[int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The given experts' rows of tensor `name`, in that order -> [len(experts), ...] on device."""
    runs: list[tuple[int, int]] = []  # consecutive ids read as one range
    for e in experts:
        if runs and runs[-1][1] == e:
            runs[-1] = (runs[-1][0], e + 1)
        else:
            runs.append((e, e + 1))
    tensor = read_shard(source, name, ShardSpec(0, tuple(runs) or ((0, 0),)))
    return tensor.to(device=device, dtype=dtype).contiguous()


@dataclass(frozen=True)
class WeightMemory:
    device: str
    resident_bytes: int  # every weight on the device, expert slots or resident experts included (each storage once)
    expert_device_bytes: int  # of which the offloaded blocks' expert slots / resident experts
    offloaded_bytes: int  # routed experts held in host memory once all are loaded
    mode: str  # none | cache | hybrid


def weight_memory(model: torch.nn.Module) -> WeightMemory:
    blocks = [m.offload for _, m in moe_blocks(model) if m.offload is not None]
    tensors = [*model.parameters(), *model.buffers()]
    for offload in blocks:
        tensors += offload.device_tensors
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.device.type != "meta"}
    device = str(next(model.parameters()).device)
    mode = getattr(model, "expert_offload", ExpertOffloadConfig()).mode
    expert_device_bytes, host_bytes = sum(o.device_bytes for o in blocks), sum(o.host_bytes for o in blocks)
    return WeightMemory(device, sum(storages.values()), expert_device_bytes, host_bytes, mode)


def describe_weight_memory(model: torch.nn.Module) -> str:
    """One line: resident bytes on the device and offloaded bytes in host memory."""
    m = weight_memory(model)
    line = f"weights: {_size(m.resident_bytes)} resident on {m.device}"
    if m.mode == "none":
        return line + (" (every expert resident)" if moe_blocks(model) else "")
    blocks = [b.offload for _, b in moe_blocks(model)]
    if m.mode == "cache":
        where = f"{blocks[0].cache.num_slots} expert slots per layer"
    else:
        where = f"{blocks[0].num_resident_experts} resident experts per layer"
    offloaded = f"{_size(m.offloaded_bytes)} of experts offloaded to host memory ({m.mode})"
    return line + f" (of which {_size(m.expert_device_bytes)} in {where}); {offloaded}"


def _size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / 2**20:.2f} MiB"
