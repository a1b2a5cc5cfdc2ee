"""examples/train_demo.py: its training model is the Qwen3.5 architecture, and its runs are reproducible.

Oracles: HF transformers' Qwen3_5ForCausalLM on the written checkpoint; the HF reference outputs
(logits, hidden, MTP logits) stored with the qwen35_dense fixture; a plain causal re-run of the MTP
layer for the chained drafts; sha1 split recomputed here; two independent smoke runs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.conftest import FIXTURES

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_demo.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_demo", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_demo"] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


td = _load_script()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two independent --smoke runs (separate processes) into fresh directories."""
    outs = []
    for i in range(2):
        out = tmp_path_factory.mktemp(f"smoke{i}") / "ckpt"
        subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--smoke"], check=True,
                       capture_output=True, text=True, timeout=300)
        outs.append(out)
    return outs


def test_smoke_runs_are_identical(runs):
    a, b = (json.loads((o / "train_log.json").read_text()) for o in runs)
    assert a["final_train_loss"] == b["final_train_loss"]
    assert a["final_train_loss"] > 0 and a["steps"] == td.SMOKE_TRAIN.steps
    assert (runs[0] / "tokenizer.json").read_bytes() == (runs[1] / "tokenizer.json").read_bytes()
    assert (runs[0] / "model.safetensors").read_bytes() == (runs[1] / "model.safetensors").read_bytes()


def test_checkpoint_loads_in_transformers_and_matches_training_model(runs):
    import transformers

    out = runs[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf, info = transformers.Qwen3_5ForCausalLM.from_pretrained(
            out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"])
    m = td.load_demo(out).eval()
    cfg = json.loads((out / "config.json").read_text())
    ids = torch.randint(0, cfg["vocab_size"], (2, 150), generator=torch.Generator().manual_seed(0))  # 3 GDN chunks
    with torch.no_grad():
        ref = hf(ids).logits
        got = m.logits(m(ids))
    assert (got - ref).abs().max().item() <= 1e-4
    assert ref.abs().max().item() > 0.1  # not a trivially zero comparison


def test_checkpoint_layout(runs):
    out = runs[0]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text" and cfg["tie_word_embeddings"] is True
    assert cfg["mtp_num_hidden_layers"] == 1
    rope = cfg["rope_parameters"]
    assert sum(rope["mrope_section"]) == int(cfg["head_dim"] * rope["partial_rotary_factor"]) // 2
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert all(f.get_slice(n).get_dtype() == "BF16" for n in names)
        assert f.get_slice("mtp.fc.weight").get_shape() == [cfg["hidden_size"], 2 * cfg["hidden_size"]]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    mtp = {n for n in names if n.startswith("mtp.")}
    assert {"mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight"} <= mtp


def test_tokenizer_special_tokens_on_top(runs):
    from tokenizers import Tokenizer

    out = runs[0]
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    cfg = json.loads((out / "config.json").read_text())
    V = tok.get_vocab_size()
    assert V == cfg["vocab_size"]
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [V - 3, V - 2, V - 1]
    assert cfg["eos_token_id"] == V - 3
    text = "def f(x):\n    return x ** 2  # é\n"
    assert tok.decode(tok.encode(text).ids) == text
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())


def test_heldout_files_disjoint_from_training_files(runs):
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    _, files = td.stdlib_files()
    rel = [p.relative_to(root).as_posix() for p in files]
    held = {r for r in rel if int(hashlib.sha1(r.encode()).hexdigest(), 16) % td.TrainConfig().heldout_mod == 0}
    train, heldout = td.split_corpus(root, files, td.TrainConfig().heldout_mod)
    train_rel = {p.relative_to(root).as_posix() for p in train}
    assert {p.relative_to(root).as_posix() for p in heldout} == held
    assert not train_rel & held and train_rel | held == set(rel)
    assert not any(part in ("test", "idlelib", "site-packages") for r in rel for part in r.split("/"))

    prompts = [json.loads(line)["prompt"] for line in (runs[0] / "heldout_prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 50 and len(set(prompts)) == 50
    texts = {r: (root / r).read_text(encoding="utf-8", errors="replace") for r in rel}
    sources = set()
    for p in prompts:
        assert 200 <= len(p) <= 400 and p.endswith("\n")
        owners = [r for r in held if p in texts[r]]
        assert owners, "a prompt that is not cut from a held-out file"
        sources.add(owners[0])
    assert len(sources) == 50


def _fixture_model():
    return td.load_demo(FIXTURES / "qwen35_dense" / "hf").eval()


def test_training_model_matches_hf_reference_outputs_incl_mtp():
    m = _fixture_model()
    ref = load_file(FIXTURES / "qwen35_dense" / "ref" / "hf_transformers.safetensors")
    for i in range(3):
        ids = ref[f"seq{i}.input_ids"].long()[None]
        with torch.no_grad():
            h = m(ids)
            hm, _ = m.mtp_forward(h[:, :-1], ids[:, 1:])
            got = {"logits": m.logits(h)[0], "hidden": h[0], "mtp_hidden": hm[0], "mtp_logits": m.logits(hm)[0]}
        for key, val in got.items():
            assert (val - ref[f"seq{i}.{key}"]).abs().max().item() <= 1e-4, (i, key)


def test_chained_drafts_equal_a_plain_causal_rerun():
    m = _fixture_model()
    seq = torch.randint(0, 1000, (2, 14), generator=torch.Generator().manual_seed(1))
    k = 3
    drafts = td.mtp_chain(m, seq, k)
    with torch.no_grad():
        h = m(seq)
        for t in (0, 5, 12):
            hs, xs = h[:, : t + 1], seq[:, 1 : t + 2]  # the true pairs 0..t, then the chain's own steps
            for j in range(k):
                hm, _ = m.mtp_forward(hs, xs)  # causal over everything, positions 1.. (as a KV cache would)
                d = m.logits(hm[:, -1:]).argmax(-1)
                assert torch.equal(d[:, 0], drafts[j][:, t]), (t, j)
                hs, xs = torch.cat([hs, hm[:, -1:]], 1), torch.cat([xs, d], 1)


def test_default_model_fits_the_size_budget():
    with torch.device("meta"):
        m = td.Qwen35Demo(td.ModelConfig())
    n = sum(p.numel() for p in m.parameters())
    assert 2 * n <= 16 * 2**20  # bf16 trunk + MTP <= 16 MiB
    assert m.config.layer_types.count("full_attention") == m.config.num_hidden_layers // 4
