"""Explicit GGUF -> canonical (HF text-model) name table for `qwen35` / `qwen35moe`.

Why a table of our own: gguf-py 0.19's `TensorNameMap` has no `nextn.*` tensors for these
architectures (shared/reference/gguf.md §1.7), and the reader must know per tensor which of
llama.cpp's converter transforms to undo.

Layout:
- `GLOBAL`: file-level tensors.
- `BLOCK`: `blk.N.<suffix>` -> `GgufName(hf suffix, undo)`, shared by trunk blocks
  (`model.layers.N.`) and the MTP block (`mtp.layers.{N - n_layer}.`).
- `NEXTN`: the MTP block's own tensors -> `mtp.*`.
- `resolve(gguf_name, n_layer)` -> (canonical name, undo) or None.

`undo` names the inverse transforms in the order they are applied:
`norm-1` (zero-centred RMSNorm stored as 1 + w), `vrows:<w>:<offset>` (tiled -> grouped V-head
order on rows starting at `offset`, head width w; offset `kd2` = 2 * K heads * d_k),
`vcols:<w>` (the same on columns), `neg_exp` (ssm_a = -exp(A_log)), `unsqueeze1` (conv1d
[C, K] -> [C, 1, K]), `row1` (shared-expert gate stored 1-D -> [1, H]), `gate_half` / `up_half`
(split experts, fused into `experts.gate_up_proj`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GgufName:
    hf: str  # canonical suffix (block tensors) or full canonical name (global / nextn)
    undo: tuple[str, ...] = ()


GLOBAL: dict[str, GgufName] = {
    "token_embd.weight": GgufName("model.embed_tokens.weight"),
    "output_norm.weight": GgufName("model.norm.weight", ("norm-1",)),
    "output.weight": GgufName("lm_head.weight"),
}

BLOCK: dict[str, GgufName] = {
    "attn_norm.weight": GgufName("input_layernorm.weight", ("norm-1",)),
    "post_attention_norm.weight": GgufName("post_attention_layernorm.weight", ("norm-1",)),
    # full (gated) attention; q_proj keeps HF's per-head [query | gate] interleave
    "attn_q.weight": GgufName("self_attn.q_proj.weight"),
    "attn_k.weight": GgufName("self_attn.k_proj.weight"),
    "attn_v.weight": GgufName("self_attn.v_proj.weight"),
    "attn_output.weight": GgufName("self_attn.o_proj.weight"),
    "attn_q_norm.weight": GgufName("self_attn.q_norm.weight", ("norm-1",)),
    "attn_k_norm.weight": GgufName("self_attn.k_norm.weight", ("norm-1",)),
    # Gated DeltaNet
    "attn_qkv.weight": GgufName("linear_attn.in_proj_qkv.weight", ("vrows:dv:kd2",)),
    "attn_gate.weight": GgufName("linear_attn.in_proj_z.weight", ("vrows:dv:0",)),
    "ssm_beta.weight": GgufName("linear_attn.in_proj_b.weight", ("vrows:1:0",)),
    "ssm_alpha.weight": GgufName("linear_attn.in_proj_a.weight", ("vrows:1:0",)),
    "ssm_conv1d.weight": GgufName("linear_attn.conv1d.weight", ("vrows:dv:kd2", "unsqueeze1")),
    "ssm_dt.bias": GgufName("linear_attn.dt_bias", ("vrows:1:0",)),
    "ssm_dt": GgufName("linear_attn.dt_bias", ("vrows:1:0",)),
    "ssm_a": GgufName("linear_attn.A_log", ("neg_exp", "vrows:1:0")),
    "ssm_norm.weight": GgufName("linear_attn.norm.weight"),  # gated norm, not zero-centred
    "ssm_out.weight": GgufName("linear_attn.out_proj.weight", ("vcols:dv",)),
    # dense MLP
    "ffn_gate.weight": GgufName("mlp.gate_proj.weight"),
    "ffn_up.weight": GgufName("mlp.up_proj.weight"),
    "ffn_down.weight": GgufName("mlp.down_proj.weight"),
    # MoE
    "ffn_gate_inp.weight": GgufName("mlp.gate.weight"),
    "ffn_gate_exps.weight": GgufName("mlp.experts.gate_up_proj", ("gate_half",)),
    "ffn_up_exps.weight": GgufName("mlp.experts.gate_up_proj", ("up_half",)),
    "ffn_gate_up_exps.weight": GgufName("mlp.experts.gate_up_proj"),
    "ffn_down_exps.weight": GgufName("mlp.experts.down_proj"),
    "ffn_gate_shexp.weight": GgufName("mlp.shared_expert.gate_proj.weight"),
    "ffn_up_shexp.weight": GgufName("mlp.shared_expert.up_proj.weight"),
    "ffn_down_shexp.weight": GgufName("mlp.shared_expert.down_proj.weight"),
    "ffn_gate_inp_shexp.weight": GgufName("mlp.shared_expert_gate.weight", ("row1",)),
}

NEXTN: dict[str, GgufName] = {
    "nextn.eh_proj.weight": GgufName("mtp.fc.weight"),
    "nextn.enorm.weight": GgufName("mtp.pre_fc_norm_embedding.weight", ("norm-1",)),
    "nextn.hnorm.weight": GgufName("mtp.pre_fc_norm_hidden.weight", ("norm-1",)),
    "nextn.shared_head_norm.weight": GgufName("mtp.norm.weight", ("norm-1",)),
}
# dedicated MTP embedding / head tables: Qwen3.5 heads share the target's, freetoken has no slot
NEXTN_DEDICATED = ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight")

_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def resolve(gguf_name: str, n_layer: int) -> tuple[str, tuple[str, ...]] | None:
    """GGUF tensor name -> (canonical name, undo steps); None when the name is not in the table.

    `n_layer` is the trunk depth: blocks >= n_layer are MTP blocks.
    """
    if gguf_name in GLOBAL:
        g = GLOBAL[gguf_name]
        return g.hf, g.undo
    m = _BLK.match(gguf_name)
    if m is None:
        return None
    i, suffix = int(m.group(1)), m.group(2)
    if i >= n_layer and suffix in NEXTN:
        g = NEXTN[suffix]
        return g.hf, g.undo
    if suffix not in BLOCK:
        return None
    g = BLOCK[suffix]
    prefix = f"model.layers.{i}" if i < n_layer else f"mtp.layers.{i - n_layer}"
    return f"{prefix}.{g.hf}", g.undo


def block_index(gguf_name: str) -> int | None:
    m = _BLK.match(gguf_name)
    return int(m.group(1)) if m else None
