"""`freetoken bench --shape qwen3.8-flash-next[-tiny]`: the qwen4_exp shapes, --layers and their floor.

Oracles: the real shape's config against `Qwen4ExpConfig.from_hf` of the text_config values written
out from architectures.md §4.1; the floor's parts against counts made another way (the parameters of
the modules a decode step touches, walked module by module, and hand arithmetic from the tiny
config's sizes and from the tensor shapes of architectures.md §4.5); the floor at full depth against
a run at full depth; oracle acceptance at corruption 0 is exactly 1 per position, and the bench's
own check that every spec run reproduces the no-spec greedy tokens; exit codes and stderr of
`freetoken.cli.main` for combinations that cannot run.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from freetoken.bench_floor import decode_floor_parts, meta_model
from freetoken.bench_shapes import SHAPES, bench_config
from freetoken.cli import app
from freetoken.errors import FreetokenError
from tests.cli.test_bench import _main

TINY = "qwen3.8-flash-next-tiny"
SMALL = ["--device", "cpu", "--dtype", "float32", "--prompt-len", "24", "--new-tokens", "9", "-b", "2"]
CONTEXT = 24 + 9 // 2  # the floor's context length: the prompt and half the new tokens


def _bench(args, out):
    result = CliRunner().invoke(app, ["bench", "--shape", TINY, *args, *SMALL, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def full_depth(tmp_path_factory):
    """The tiny shape at its 8 layers, batch 2, with exact oracle drafts."""
    return _bench(["--spec", "oracle", "-k", "2"], tmp_path_factory.mktemp("bench") / "tiny-qwen4.json")


def _params_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_tiny_shape_runs_with_oracle_drafts(full_depth):
    base, oracle = full_depth["results"]
    assert (base["shape"], base["spec"], oracle["spec"]) == (TINY, "none", "oracle")
    assert base["generated_tokens"] == oracle["generated_tokens"] == 18 and base["decode_steps"] == 9
    assert oracle["acceptance_per_position"] == [1.0, 1.0] and oracle["decode_steps"] == 3
    assert (base["layers"], base["full_depth_layers"], base["floor_layer_counts"]) == (8, 8, {"linear_attention": 6, "full_attention": 2, "ple": 1})
    assert base["floor_bytes_full_depth"] == base["floor_bytes_per_step"] == sum(base["floor_parts"].values())
    assert base["ple_table_rows"] == base["ple_table_rows_full"] == 16896  # the 16 primes 1009..1097 sum to 16826, rounded up to a multiple of 128
    assert base["floor_step_ms"] == pytest.approx(1000 * base["floor_bytes_per_step"] / full_depth["copy_bandwidth_bytes_per_s"])


def test_floor_parts_match_the_modules_a_decode_step_touches(full_depth):
    """Weights: the model's modules walked one by one (the routed experts at min(E, B*top_k) / E, as
    for Qwen3.5-35B-A3B; the embedding and n-gram table only at the rows looked up); KV, indexer keys
    and state: arithmetic on the tiny config's sizes, fp32."""
    from freetoken.models.loader import build_empty

    parts = full_depth["results"][0]["floor_parts"]
    cfg = SHAPES[TINY]
    model = build_empty("qwen4_exp", cfg.to_dict(), with_mtp=False, device="cpu", dtype=torch.float32)
    b, f32 = 2, 4
    expected = {
        "model.embedding_rows": b * 64 * f32,
        "model.weights": _params_bytes(model.lm_head) + _params_bytes(model.model.hyper_connection_mixer),
    }
    for i, layer in enumerate(model.model.layers):
        kind = "full_attention" if hasattr(layer, "self_attn") else "linear_attention"
        experts = _params_bytes(layer.mlp.experts)
        ple = _params_bytes(layer.ple) if layer.ple is not None else 0
        expected[f"{kind}.weights"] = expected.get(f"{kind}.weights", 0) + _params_bytes(layer) - experts - ple
        expected[f"{kind}.routed_experts"] = expected.get(f"{kind}.routed_experts", 0) + experts * min(8, b * 2) // 8
        if layer.ple is not None:
            table = layer.ple.ple_embedding.ngram_embedding
            expected["ple.weights"] = ple - _params_bytes(table)
            expected["ple.ngram_rows"] = b * 16 * table.weight.shape[1] * f32  # 16 heads: orders 2 and 3, 8 heads each
    attended = 8 + CONTEXT % 4  # QSA: the top budget / ratio = 2 blocks of 4 keys, and the tail
    expected |= {
        "full_attention.kv": 2 * b * attended * 2 * 32 * 2 * f32,  # 2 QSA layers, 2 KV heads of 32, K and V
        "full_attention.indexer_keys": 2 * b * (CONTEXT // 4 * 4) * 16 * f32,  # the raw keys of the 7 complete blocks
        "linear_attention.conv_window": 2 * 6 * b * 3 * (2 * 2 * 16 + 4 * 16) * f32,  # read and written: 3 rows of q|k|v
        "linear_attention.recurrent_state": 2 * 6 * b * 4 * 16 * 16 * 4,  # 4 value heads of 16 x 16, fp32
        "ple.conv_window": 2 * b * 9 * 4 * 64 * f32,  # (K - 1) * ngram_size = 9 gvn rows of S * H
        "ple.ids_window": 2 * b * 2 * 8,  # the last ngram_size - 1 ids, int64
    }
    assert parts == expected


def test_layers_keeps_the_first_layers_and_the_mtp_head(full_depth, tmp_path):
    """--layers 4 (3 GDN layers, the PLE layer among them, 1 QSA layer) with MTP drafts: the floor at full
    depth is the full-depth run's floor, and scaling the parts kind by kind gives it too."""
    report = _bench(["--layers", "4", "--spec", "mtp", "-k", "2"], tmp_path / "cut.json")
    base, mtp = report["results"]
    assert (mtp["spec"], len(mtp["acceptance_per_position"]), mtp["generated_tokens"]) == ("mtp", 2, 18)
    assert (base["layers"], base["full_depth_layers"], base["floor_layer_counts"]) == (4, 8, {"linear_attention": 3, "full_attention": 1, "ple": 1})
    full = full_depth["results"][0]
    assert base["floor_bytes_full_depth"] == full["floor_bytes_per_step"]
    scale = {"model": 1, "linear_attention": 2, "full_attention": 2, "ple": 1}
    assert sum(v * scale[k.split(".")[0]] for k, v in base["floor_parts"].items()) == full["floor_bytes_per_step"]


def test_the_real_shape_is_the_config_of_architectures_4_1():
    from freetoken.models.qwen4_exp.config import Qwen4ExpConfig

    text = dict(
        model_type="qwen4_exp_text", vocab_size=248320, hidden_size=2560, num_hidden_layers=48,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 12,
        num_attention_heads=24, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=640, shared_expert_intermediate_size=640, norm_topk_prob=True, output_gate_type="sigmoid",
        rope_parameters=dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=262144, rope_theta=1e7, partial_rotary_factor=0.25,
                             mrope_section=[11, 11, 10], mrope_interleaved=True),
        bos_token_id=248044, eos_token_id=248044, tie_word_embeddings=False, mamba_ssm_dtype="float32", max_position_embeddings=524288,
        mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False, hc_count=4, hc_lowrank=320, ple_layer_ids=[2], ple_embed_dim=2560,
        ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=20_000_000, make_ngram_vocab_size_divisible_by=128,
        seed=1234, split_ngram_parts=128, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048,
        indexer_compress_ratio=4,
    )
    assert SHAPES["qwen3.8-flash-next"] == Qwen4ExpConfig.from_hf({"model_type": "qwen4_exp", "text_config": text})


@pytest.mark.parametrize("batch_size, context_len", [(1, 544), (8, 4224)])
def test_real_shape_floor_from_the_tensor_shapes_of_architectures_4_5(batch_size, context_len):
    """--layers 8 and the full 48 layers, counted on the meta device, against the tensor shapes of
    architectures.md §4.5 in bf16 (at 4224 keys QSA attends to 2048 of them)."""
    b, bf16 = batch_size, 2
    hc = 2 * (10240 + 320 * 10240 + 10240 * 320 + 4 * 10240)  # attn and mlp hyper-connections
    moe = 512 * 2560 + 3 * 640 * 2560 + 2560  # router, shared expert, its gate
    gdn = hc + moe + 10240 * 2560 + 6144 * 2560 + 2 * 48 * 2560 + 10240 * 4 + 48 + 48 + 128 + 2560 * 6144
    qsa = hc + moe + 12288 * 2560 + 2 * 512 * 2560 + 2560 * 6144 + 2 * 256 + 640 * 2560 + 2 * 128
    experts = (512 * 1280 * 2560 + 512 * 2560 * 640) * min(512, 10 * b) // 512
    ple = 10240 * 2560 + 2560 * 2560 + 3 * 10240 + 10240 * 4
    kv_rows = min(context_len, 2048 + context_len % 4)
    for layers, (n_gdn, n_qsa) in ((8, (6, 2)), (48, (36, 12))):
        cfg = bench_config("qwen3.8-flash-next", layers)
        parts = decode_floor_parts(meta_model(cfg, "qwen4_exp", torch.bfloat16), cfg, b, context_len, bf16)
        assert parts == {
            "model.embedding_rows": b * 2560 * bf16,
            "model.weights": (248320 * 2560 + 10240 + 2 * 320 * 10240) * bf16,  # lm_head, the final mixer
            "linear_attention.weights": n_gdn * gdn * bf16,
            "linear_attention.routed_experts": n_gdn * experts * bf16,
            "linear_attention.conv_window": 2 * n_gdn * b * 3 * 10240 * bf16,
            "linear_attention.recurrent_state": 2 * n_gdn * b * 48 * 128 * 128 * 4,
            "full_attention.weights": n_qsa * qsa * bf16,
            "full_attention.routed_experts": n_qsa * experts * bf16,
            "full_attention.kv": n_qsa * b * kv_rows * 2 * 256 * 2 * bf16,
            "full_attention.indexer_keys": n_qsa * b * (context_len // 4 * 4) * 128 * bf16,
            "ple.weights": ple * bf16,
            "ple.ngram_rows": b * 16 * 160 * bf16,
            "ple.conv_window": 2 * b * 9 * 10240 * bf16,
            "ple.ids_window": 2 * b * 2 * 8,
        }


@pytest.mark.parametrize("args, message", [
    (["--layers", "9"], "has 8 decoder layers"),
    (["--layers", "0"], "has 8 decoder layers"),
    (["--spec", "dflash-oracle", "-k", "3"], "no DFlash draft shape for qwen3.8-flash-next-tiny"),
    (["--tensor-parallel", "2"], "runs on one GPU"),
])
def test_combinations_that_cannot_run_are_refused(tmp_path, args, message):
    result = CliRunner().invoke(app, ["bench", "--shape", TINY, *args, *SMALL, "--out", str(tmp_path / "out.json")])
    assert result.exit_code != 0 and isinstance(result.exception, FreetokenError) and message in str(result.exception)
    assert not (tmp_path / "out.json").exists()
    result = CliRunner().invoke(app, ["bench", str(tmp_path), "--layers", "2", *SMALL])
    assert isinstance(result.exception, FreetokenError) and "not a checkpoint" in str(result.exception)


def test_a_refusal_is_one_line_on_stderr(tmp_path):
    result = _main(["bench", "--shape", "qwen3.8-flash-next", "--layers", "49", *SMALL, "--out", str(tmp_path / "out.json")], tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == ["error: --layers 49: qwen3.8-flash-next has 48 decoder layers (give 1..48)"]
    assert not (tmp_path / "out.json").exists()
