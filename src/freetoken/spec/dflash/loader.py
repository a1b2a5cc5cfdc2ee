"""Build a unified checkpoint's DFlash or DFlash2 draft (`draft_heads["dflash"]`, tensors under `dflash.*`) for its target."""

from __future__ import annotations

import torch

from freetoken.errors import CheckpointError, FreetokenError
from freetoken.models.loader import fill_parameters
from freetoken.spec.dflash.config import DFlashConfig
from freetoken.spec.dflash.draft import DFlashDraft

PREFIX = "dflash."


@torch.no_grad()
def load_draft(source, head: dict, target_num_layers: int, target_hidden_size: int, target_vocab_size: int, *, device: torch.device | str, dtype: torch.dtype,
               origin: str | None = None) -> DFlashDraft:
    """The draft described by `head` (the manifest's draft_heads["dflash"]) with its weights from
    `source` (anything with get(name)), checked against the target it drafts for."""
    try:
        cfg = DFlashConfig.from_dict(head)
    except FreetokenError as exc:
        raise type(exc)(str(exc), origin) from None
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"malformed DFlash draft entry in the manifest ({type(exc).__name__}: {exc})", origin) from None
    if cfg.hidden_size != target_hidden_size:
        raise CheckpointError(f"the DFlash draft's hidden size {cfg.hidden_size} differs from the target's {target_hidden_size}", origin)
    outside = [i for i in cfg.target_layer_ids if not 0 <= i < target_num_layers]
    if outside:
        raise CheckpointError(f"the DFlash draft reads target layers {outside}, outside the target's {target_num_layers}", origin)
    if cfg.is_dflash2 and cfg.vocab_size != target_vocab_size:
        raise CheckpointError(f"the DFlash2 draft's selector covers {cfg.vocab_size} tokens, the target's vocabulary {target_vocab_size}", origin)
    draft = empty_draft(cfg, device=device, dtype=dtype)
    fill_parameters(draft, source.get, prefix=PREFIX, origin=origin)
    return draft


def empty_draft(cfg: DFlashConfig, *, device: torch.device | str, dtype: torch.dtype) -> DFlashDraft:
    """The draft network of cfg on `device` in `dtype`, in eval mode, its parameters allocated but not filled."""
    with torch.device("meta"):
        draft = DFlashDraft(cfg)
    return draft.to_empty(device=device).to(dtype).eval()
