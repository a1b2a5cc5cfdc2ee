"""The qwen4_exp target (Qwen3.8-Flash-Next) against Hugging Face transformers, fp32 on CPU.

Oracle: the fixture's stored transformers 5.23 outputs (`qwen4_exp/ref/hf_transformers.safetensors`:
logits, the mixer output `hidden`, the wide residual `wide_last`, every layer's wide output, and
the QSA indexer's selected keys per layer), for 4 sequences, one with an EOS inside (the PLE n-gram
hash restarts after it). Our side always goes convert -> unified checkpoint -> engine pools and
contexts (runner.build_context), with the sequence fed

- whole (one prefill),
- in chunks of 3 and 5 rows (prefill pieces reading the KV, indexer keys, GDN and PLE windows
  written by the earlier pieces),
- as a prefix then one row per step (decode), every row's logits against the reference row,

and through the scheduler (several prompts, a tiny token budget), against transformers' own
greedy `generate` on the fixture checkpoint; the fixture turned into a YaRN checkpoint, against
transformers' own forward on it.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.engine.runner import RowGroup, build_context
from freetoken.errors import FreetokenError
from freetoken.forward_context import ForwardMode
from tests.conftest import FIXTURES, fixture_refs, greedy, hf_model_from_dir, load_unified, num_sequences

MODEL = "qwen4_exp"
TOL = 1e-4  # logits and mixer output
WIDE_TOL = 2e-4  # the residual streams (|x| up to ~8)


@pytest.fixture(scope="module")
def target(fixture_unified):
    return load_unified(fixture_unified(MODEL), with_mtp=False)


@pytest.fixture(scope="module")
def refs():
    return fixture_refs(MODEL)


def new_engine(model, max_num_seqs: int = 1, **kw) -> LLMEngine:
    return LLMEngine(model, EngineConfig(max_num_seqs=max_num_seqs, max_model_len=64, block_size=4, overlap=False, **kw))


@torch.no_grad()
def run_pieces(model, ids: list[int], pieces: list[int], export_layers: tuple[int, ...] = ()):
    """Feed ids in consecutive EXTEND steps of the given lengths through a fresh engine's pools ->
    (wide rows [T, S*H], exported layer rows [T, n*S*H] or None)."""
    engine = new_engine(model)
    table: list[int] = []
    engine.kv_pool.grow(table, len(ids))
    slot = engine.state_pool.allocate()
    wide, layers, start = [], [], 0
    for n in pieces:
        ctx = build_context([RowGroup(table, slot, start, ids[start : start + n])], ForwardMode.EXTEND, engine.kv_pool, engine.state_pool, engine.device)
        out = model(ctx, export_layers=export_layers)
        wide.append(out[0] if export_layers else out)
        if export_layers:
            layers.append(out[1])
        start += n
    assert start == len(ids)
    return torch.cat(wide), (torch.cat(layers) if export_layers else None)


def record_selections(model) -> tuple[dict[int, list[torch.Tensor]], list]:
    """Per QSA layer index, the indexer's selected key positions of every row (forward hooks)."""
    seen: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer, "self_attn"):
            seen[i] = []
            hooks.append(layer.self_attn.indexer.register_forward_hook(lambda _m, _a, out, i=i: seen[i].extend(out.positions())))
    return seen, hooks


def as_mask(selected: list[torch.Tensor], t: int) -> torch.Tensor:
    mask = torch.zeros(t, t, dtype=torch.uint8)
    for row, positions in enumerate(selected):
        mask[row, positions] = 1
    return mask


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def test_whole_sequences_match_transformers(target, refs):
    layers = tuple(range(target.config.num_hidden_layers))
    for i in range(num_sequences(refs)):
        ids = refs[f"seq{i}.input_ids"].tolist()
        seen, hooks = record_selections(target)
        try:
            wide, per_layer = run_pieces(target, ids, [len(ids)], export_layers=layers)
        finally:
            for h in hooks:
                h.remove()
        assert diff(wide, refs[f"seq{i}.wide_last"]) <= WIDE_TOL
        assert diff(target.model.hyper_connection_mixer(wide), refs[f"seq{i}.hidden"]) <= TOL
        assert diff(target.compute_logits(wide), refs[f"seq{i}.logits"]) <= TOL
        if f"seq{i}.layer_outputs" in refs:
            ours = per_layer.view(len(ids), len(layers), -1).transpose(0, 1)
            assert diff(ours, refs[f"seq{i}.layer_outputs"]) <= WIDE_TOL
        for layer, selected in seen.items():
            assert torch.equal(as_mask(selected, len(ids)), refs[f"seq{i}.qsa_selected.layer{layer}"]), (i, layer)


@pytest.mark.parametrize("feed", ["chunks_of_3", "chunks_of_5", "prefix_then_decode"])
def test_pieces_and_decode_rows_match_transformers(feed, target, refs):
    for i in range(num_sequences(refs)):
        ids = refs[f"seq{i}.input_ids"].tolist()
        t = len(ids)
        if feed == "prefix_then_decode":
            pieces = [t // 3] + [1] * (t - t // 3)
        else:
            size = int(feed.rsplit("_", 1)[1])
            pieces = [size] * (t // size) + ([t % size] if t % size else [])
        wide, _ = run_pieces(target, ids, pieces)
        assert diff(target.compute_logits(wide), refs[f"seq{i}.logits"]) <= TOL, (feed, i)
        assert diff(wide, refs[f"seq{i}.wide_last"]) <= WIDE_TOL, (feed, i)


def test_scheduled_generation_matches_transformers_generate(target, refs):
    """Three prompts (one crossing the EOS) in one engine under a 5-token budget, 8 greedy tokens each."""
    prompts = [refs["seq3.input_ids"].tolist(), refs["seq1.input_ids"].tolist()[:9], refs["seq2.input_ids"].tolist()[:4]]
    engine = new_engine(target, max_num_seqs=3, max_num_batched_tokens=5)
    ours = [r.output_token_ids for r in engine.generate(prompts, greedy(8))]
    hf = hf_model_from_dir(FIXTURES / MODEL / "hf")
    for prompt, out in zip(prompts, ours):
        x = torch.tensor([prompt])
        with torch.no_grad():
            want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False, pad_token_id=0)
        want = want[0, len(prompt) :].tolist()  # transformers stops at an EOS, we run on (ignore_eos)
        assert out[: len(want)] == want and len(want) >= 4


def test_dflash_is_refused_in_one_line(target):
    """DFlash drafts read H-wide layer taps; this family's layer outputs are S*H wide."""
    with pytest.raises(FreetokenError, match="qwen4_exp"):
        target.draft_network("dflash")


def test_yarn_checkpoint_matches_transformers(tmp_path, refs):
    """The fixture with YaRN RoPE (factor 4 over an original context of 8 positions, so the longest
    sequence runs well past it) against transformers' own forward on the same directory, whole and
    as a prefix then decode rows."""
    import json
    import shutil

    from tests.conftest import convert_unified, hf_logits

    hf_dir = tmp_path / "hf"
    shutil.copytree(FIXTURES / MODEL / "hf", hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    config["text_config"]["rope_parameters"] |= {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    (hf_dir / "config.json").write_text(json.dumps(config))
    model = load_unified(convert_unified(hf_dir, tmp_path / "unified"), with_mtp=False)
    assert model.config.rope_type == "yarn"
    hf = hf_model_from_dir(hf_dir)
    ids = refs["seq2.input_ids"].tolist()  # 33 tokens
    want, _ = hf_logits(hf, ids)
    assert diff(want, refs["seq2.logits"]) > 1e-2  # the scaling changes the model
    for pieces in ([len(ids)], [11] + [1] * (len(ids) - 11)):
        wide, _ = run_pieces(model, ids, pieces)
        assert diff(model.compute_logits(wide), want) <= TOL, pieces
