"""The model shapes `freetoken bench --shape` builds with random weights, and how a bench run cuts one down.

SHAPES holds each shape's config at its real size. `bench_config` returns what a run builds: the
first `layers` decoder layers of the real layer pattern (the MTP head is kept: it is built from the
config, not from a layer of the trunk), and for qwen4_exp a PLE n-gram table sized down to
BENCH_NGRAM_VOCAB_SIZE_BASE. A lookup reads one row per n-gram head whatever the table's size
(models/qwen4_exp/ple.py), so the smaller table keeps the per-token cost; it is 16.0 M rows x 160 x
bf16 = 5.1 GB, a hundred times an H100's or H200's 50 MB L2, so its rows come from HBM as the full
table's would (the real one: 320 M rows, 102 GB, does not fit one GPU beside the experts).
"""

from __future__ import annotations

from dataclasses import replace

from freetoken.errors import FreetokenError
from freetoken.models.qwen3_5.config import Qwen35Config
from freetoken.models.qwen4_exp.config import Qwen4ExpConfig

BenchConfig = Qwen35Config | Qwen4ExpConfig


def _hybrid(layers: int) -> tuple[str, ...]:
    """Three Gated DeltaNet layers, then one attention layer, repeating."""
    return tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers))


_GDN = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)

# Qwen3.8-Flash-Next, text_config (architectures.md §4.1). Every value there comes from a public
# SGLang deployment script that passes the text_config as a JSON override, not from the official
# config.json (§11 question 3); flagged as unverified there: YaRN (factor 2 over 262144) being part of
# the official config, max_position_embeddings (the script overrides it to 524288, used here),
# split_ngram_parts 128 (a checkpoint-layout field, not in the config) and tie_word_embeddings false.
# vocab_size is not in §4.1: 248320 is the Qwen3.5 vocabulary (§2.1), whose eos 248044 and video pad
# 248057 (§9) this model shares.
QWEN3_8_FLASH_NEXT = Qwen4ExpConfig(
    vocab_size=248320, hidden_size=2560, num_hidden_layers=48, layer_types=_hybrid(48),
    num_attention_heads=24, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    num_experts=512, num_experts_per_tok=10, moe_intermediate_size=640, shared_expert_intermediate_size=640, norm_topk_prob=True,
    output_gate_type="sigmoid", hc_count=4, hc_lowrank=320,
    ple_layer_ids=(2,), ple_embed_dim=2560, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=8,
    ngram_vocab_size_base=20_000_000, make_ngram_vocab_size_divisible_by=128, seed=1234,
    indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
    rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=(11, 11, 10), mrope_interleaved=True,
    rope_type="yarn", yarn_factor=2.0, yarn_original_max_position_embeddings=262144,
    rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False, mtp_num_hidden_layers=1,
    max_position_embeddings=524288, eos_token_ids=(248044,),
)

SHAPES: dict[str, BenchConfig] = {
    "qwen3.5-9b": Qwen35Config(
        vocab_size=248320, hidden_size=4096, num_hidden_layers=32, layer_types=_hybrid(32),
        num_attention_heads=16, num_key_value_heads=4, head_dim=256, intermediate_size=12288,
        mtp_num_hidden_layers=1, eos_token_ids=(248044,), **_GDN,
    ),
    "tiny": Qwen35Config(  # for smoke tests of the benchmark itself
        vocab_size=512, hidden_size=64, num_hidden_layers=4,
        layer_types=("linear_attention",) * 3 + ("full_attention",), num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        intermediate_size=128, mtp_num_hidden_layers=1, eos_token_ids=(511,),
    ),
    "qwen3.5-35b-a3b": Qwen35Config(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, layer_types=_hybrid(40),
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, mtp_num_hidden_layers=1,
        eos_token_ids=(248044,), model_type="qwen3_5_moe", **_GDN,
    ),
    "qwen3.8-flash-next": QWEN3_8_FLASH_NEXT,
    # the same architecture at test size (smoke tests of the benchmark): PLE on layer 2, QSA sparse past
    # budget + ratio - 1 = 11 keys, 16 n-gram heads as in the real shape, YaRN
    "qwen3.8-flash-next-tiny": replace(
        QWEN3_8_FLASH_NEXT, vocab_size=512, hidden_size=64, num_hidden_layers=8, layer_types=_hybrid(8),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64, hc_lowrank=16,
        ple_embed_dim=64, ngram_vocab_size_base=1000, indexer_n_heads=4, indexer_head_dim=16, indexer_budget=8,
        mrope_section=(2, 1, 1), yarn_original_max_position_embeddings=256, max_position_embeddings=512, eos_token_ids=(511,),
    ),
}

# DFlash drafts of published shapes for the bench targets (shared/reference/dflash.md §1.1): as
# z-lab/Qwen3-8B-DFlash-b16 (hidden 4096) and z-lab/Qwen3.6-35B-A3B-DFlash (April; hidden 2048);
# block 16, full bidirectional attention, taps spread over the target's layers.
DFLASH_SHAPES: dict[str, dict] = {
    "qwen3.5-9b": dict(num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288),
    "qwen3.5-35b-a3b": dict(num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144),
    "tiny": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128),
}

# The n-gram table rows per head a bench run builds (the smallest prime at or above this base), per
# shape; shapes not listed keep their own table.
BENCH_NGRAM_VOCAB_SIZE_BASE: dict[str, int] = {"qwen3.8-flash-next": 1_000_000}


def bench_config(shape: str, layers: int | None = None) -> BenchConfig:
    """The config a bench run of `shape` builds: its first `layers` decoder layers (all when None) and
    its bench-sized n-gram table. A FreetokenError (one line) for an unknown shape or a depth outside it."""
    if shape not in SHAPES:
        raise FreetokenError(f"unknown --shape {shape!r} (choose from {', '.join(SHAPES)})")
    cfg = SHAPES[shape]
    depth = cfg.num_hidden_layers
    if layers is not None and not 1 <= layers <= depth:
        raise FreetokenError(f"--layers {layers}: {shape} has {depth} decoder layers (give 1..{depth})")
    if layers is not None and layers < depth:
        cut = dict(num_hidden_layers=layers, layer_types=cfg.layer_types[:layers])
        if isinstance(cfg, Qwen4ExpConfig):
            cut["ple_layer_ids"] = tuple(i for i in cfg.ple_layer_ids if i <= layers)
        cfg = replace(cfg, **cut)
    if shape in BENCH_NGRAM_VOCAB_SIZE_BASE:
        cfg = replace(cfg, ngram_vocab_size_base=BENCH_NGRAM_VOCAB_SIZE_BASE[shape])
    return cfg


def family_of(cfg: BenchConfig) -> str:
    """The model family (models/registry.py) that builds cfg."""
    from freetoken.models.registry import family_for_model_type

    return family_for_model_type(cfg.model_type).name


def check_shape_options(shape: str, *, spec: str, layers: int | None, tensor_parallel: int) -> None:
    """A one-line FreetokenError for a --shape and options that cannot run together: an unknown shape,
    --layers outside its depth, dflash-oracle without a DFlash draft shape for it (qwen4_exp targets
    refuse DFlash drafts: their layer outputs are the S*H-wide residual), tensor parallelism on a
    family without it."""
    from freetoken.models.registry import family_module

    cfg = bench_config(shape, layers)
    if spec == "dflash-oracle" and shape not in DFLASH_SHAPES:
        why = " (qwen4_exp targets refuse DFlash drafts: their layer outputs are the S*H-wide residual)" if isinstance(cfg, Qwen4ExpConfig) else ""
        raise FreetokenError(f"--spec dflash-oracle: no DFlash draft shape for {shape}{why}")
    if tensor_parallel > 1 and not getattr(family_module(family_of(cfg)), "SUPPORTS_TENSOR_PARALLEL", False):
        raise FreetokenError(f"--tensor-parallel {tensor_parallel}: the {family_of(cfg)} family of {shape} runs on one GPU")
