"""Explicit GGUF -> canonical (HF text-model) name tables, one per llama.cpp architecture.

Why tables of our own: gguf-py 0.19's `TensorNameMap` has no `nextn.*` tensors for qwen35 and no
`qwen4exp` at all (shared/reference/gguf.md §0, §4), and the reader must know per tensor which of
llama.cpp's converter transforms to undo.

Layout:
- `GLOBAL`, `BLOCK`, `NEXTN`: `qwen35` / `qwen35moe` (file-level tensors; `blk.N.<suffix>` ->
  `GgufName(hf suffix, undo)`, shared by trunk blocks (`model.layers.N.`) and the MTP block
  (`mtp.layers.{N - n_layer}.`); the MTP block's own tensors -> `mtp.*`).
- `Q4_GLOBAL`, `Q4_BLOCK`, `Q4_NEXTN`: `qwen4exp` (hyper-connections, QSA indexer, PLE; learnt
  from llama.cpp's `conversion/qwen4exp.py` and the fixture file's own names).
- `NameTable` (`QWEN35`, `QWEN4EXP`: which architecture uses which is gguf.ARCHITECTURES),
  `resolve(gguf_name, n_layer, table, ple_layer)` -> (canonical name(s), undo) or None.

`undo` names the inverse transforms in the order they are applied:
`norm-1` (zero-centred RMSNorm stored as 1 + w), `vrows:<w>:<offset>` (tiled -> grouped V-head
order on rows starting at `offset`, head width w; offset `kd2` = 2 * K heads * d_k),
`vcols:<w>` (the same on columns), `neg_exp` (ssm_a = -exp(A_log)), `unsqueeze1` (conv1d
[C, K] -> [C, 1, K]), `row1` (shared-expert gate stored 1-D -> [1, H]), `flat` (a hyper-connection
norm stored as [hc, H] -> [hc * H]), and the parts of one canonical tensor stored as several:
`gate_half` / `up_half` (split experts, joined on dim 1 into `experts.gate_up_proj`), `qk_q` /
`qk_k` (the QSA indexer's `index_qk_proj` split into its query and key rows, joined on dim 0).
A `GgufName` whose `hf` is a tuple of names is one GGUF tensor split evenly along its columns
into those canonical tensors (qwen4exp's `nextn.eh_proj` = [fc_embedding | fc_hidden]).
A global name may contain `{ple_layer}`: the PLE layer its table belongs to.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GgufName:
    hf: str | tuple[str, ...]  # canonical suffix (block tensors) or full canonical name(s) (global / nextn)
    undo: tuple[str, ...] = ()


@dataclass(frozen=True)
class NameTable:
    globals: dict[str, GgufName]
    block: dict[str, GgufName]
    nextn: dict[str, GgufName]


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


def _hc(gguf_prefix: str, hf_prefix: str, *, inject: bool) -> dict[str, GgufName]:
    """A hyper-connection module: its norm (1 + w, maybe [hc, H]), low-rank mixer and (in blocks) injection."""
    out = {
        f"{gguf_prefix}norm.weight": GgufName(f"{hf_prefix}.hc_norm.weight", ("norm-1", "flat")),
        f"{gguf_prefix}down.weight": GgufName(f"{hf_prefix}.input_mix_weight_down.weight"),
        f"{gguf_prefix}up.weight": GgufName(f"{hf_prefix}.input_mix_weight_up.weight"),
    }
    if inject:
        out[f"{gguf_prefix}inject.weight"] = GgufName(f"{hf_prefix}.block_inject_weight.weight")
    return out


_QWEN35_ONLY = ("attn_norm.weight", "post_attention_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")

Q4_GLOBAL: dict[str, GgufName] = {
    "token_embd.weight": GgufName("model.embed_tokens.weight"),
    "output.weight": GgufName("lm_head.weight"),
    **_hc("output_hc_", "model.hyper_connection_mixer", inject=False),
    "per_layer_token_embd.weight": GgufName("model.layers.{ple_layer}.ple.ple_embedding.ngram_embedding.weight"),
}

Q4_BLOCK: dict[str, GgufName] = {
    **{k: v for k, v in BLOCK.items() if k not in _QWEN35_ONLY},
    **_hc("hc_attn_", "attn_hyper_connection", inject=True),
    **_hc("hc_ffn_", "mlp_hyper_connection", inject=True),
    # QSA indexer: index_qk_proj's n_i * d_i query rows and d_i key rows, stored apart
    "indexer.q_proj.weight": GgufName("self_attn.indexer.index_qk_proj.weight", ("qk_q",)),
    "indexer.k_proj.weight": GgufName("self_attn.indexer.index_qk_proj.weight", ("qk_k",)),
    "indexer.q_norm.weight": GgufName("self_attn.indexer.q_layernorm.weight", ("norm-1",)),
    "indexer.k_norm.weight": GgufName("self_attn.indexer.k_layernorm.weight", ("norm-1",)),
    # PLE (its n-gram table is the global per_layer_token_embd)
    "ple_key.weight": GgufName("ple.key_proj.weight"),
    "ple_value.weight": GgufName("ple.value_proj.weight"),
    "ple_norm_key.weight": GgufName("ple.norm_key.weight", ("norm-1",)),
    "ple_norm_query.weight": GgufName("ple.norm_query.weight", ("norm-1",)),
    "ple_norm_conv.weight": GgufName("ple.norm_conv.weight", ("norm-1",)),
    "ple_conv1d.weight": GgufName("ple.conv1d.weight", ("unsqueeze1",)),
}

Q4_NEXTN: dict[str, GgufName] = {
    "nextn.eh_proj.weight": GgufName(("mtp.fc_embedding.weight", "mtp.fc_hidden.weight")),  # [H, 2H]: embedding columns first
    "nextn.fc_embd.weight": GgufName("mtp.fc_embedding.weight"),  # FR-Spec heads store the halves apart
    "nextn.fc_hidden.weight": GgufName("mtp.fc_hidden.weight"),
    "nextn.enorm.weight": GgufName("mtp.pre_fc_norm_embedding.weight", ("norm-1",)),
    "nextn.hnorm.weight": GgufName("mtp.pre_fc_norm_hidden.weight", ("norm-1", "flat")),  # the wide [hc * H] input
    **_hc("nextn.hc_head_", "mtp.hyper_connection_mixer", inject=False),
    **_hc("nextn.hc_", "mtp.hyper_connection_mixer", inject=False),  # FR-Spec spelling
}

QWEN35 = NameTable(GLOBAL, BLOCK, NEXTN)
QWEN4EXP = NameTable(Q4_GLOBAL, Q4_BLOCK, Q4_NEXTN)

_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def resolve(gguf_name: str, n_layer: int, table: NameTable = QWEN35, ple_layer: int | None = None) -> tuple[str | tuple[str, ...], tuple[str, ...]] | None:
    """GGUF tensor name -> (canonical name or names, undo steps); None when the name is not in the table.

    `n_layer` is the trunk depth: blocks >= n_layer are MTP blocks. `ple_layer`: the PLE layer a
    global n-gram table belongs to (None: such a table is not expected).
    """
    if gguf_name in table.globals:
        g = table.globals[gguf_name]
        if "{ple_layer}" in g.hf:
            return None if ple_layer is None else (g.hf.format(ple_layer=ple_layer), g.undo)
        return g.hf, g.undo
    m = _BLK.match(gguf_name)
    if m is None:
        return None
    i, suffix = int(m.group(1)), m.group(2)
    if i >= n_layer and suffix in table.nextn:
        g = table.nextn[suffix]
        return g.hf, g.undo
    if suffix not in table.block:
        return None
    g = table.block[suffix]
    prefix = f"model.layers.{i}" if i < n_layer else f"mtp.layers.{i - n_layer}"
    return f"{prefix}.{g.hf}", g.undo


def block_index(gguf_name: str) -> int | None:
    m = _BLK.match(gguf_name)
    return int(m.group(1)) if m else None
