"""Slot pool for Gated DeltaNet state: per running request, each linear-attention layer's conv
window (the last K-1 raw inputs, model dtype) and recurrent state (fp32), plus any other per-request
state the model declares (`StateSpec`s, e.g. qwen4_exp's PLE windows), all indexed by the same slot."""

from __future__ import annotations

import torch

from freetoken.forward_context import LinearState, StateSpec


class LinearStatePool:
    def __init__(self, num_layers: int, num_slots: int, conv_shape: tuple[int, int], recurrent_shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device | str,
                 extra_specs: tuple[StateSpec, ...] = ()):
        self.state = LinearState(
            conv=torch.zeros((num_layers, num_slots, *conv_shape), dtype=dtype, device=device),
            recurrent=torch.zeros((num_layers, num_slots, *recurrent_shape), dtype=torch.float32, device=device),
            extra={s.name: torch.zeros((s.num_layers, num_slots, *s.shape), dtype=s.dtype or dtype, device=device) for s in extra_specs},
        )
        self.free_slots = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def allocate(self) -> int:
        """A zeroed slot (the state of an empty prefix)."""
        slot = self.free_slots.pop()
        self.state.conv[:, slot].zero_()
        self.state.recurrent[:, slot].zero_()
        for pool in self.state.extra.values():
            pool[:, slot].zero_()
        return slot

    def reserve_slot(self) -> int:
        """Take one free slot out of circulation for good."""
        return self.free_slots.pop(0)

    def free(self, slot: int) -> None:
        self.free_slots.append(slot)

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot holds across every layer and state."""
        tensors = [self.state.conv, self.state.recurrent, *self.state.extra.values()]
        return sum(t[:, 0].numel() * t.element_size() for t in tensors)


def copy_slot(dst: LinearState, dst_slot: int, src: LinearState, src_slot: int) -> None:
    """Copy one slot's whole state (conv windows, recurrent state, extra states) between pools of one layout."""
    dst.conv[:, dst_slot].copy_(src.conv[:, src_slot])
    dst.recurrent[:, dst_slot].copy_(src.recurrent[:, src_slot])
    for name, pool in dst.extra.items():
        pool[:, dst_slot].copy_(src.extra[name][:, src_slot])
