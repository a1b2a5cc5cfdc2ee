"""GGUF-converted checkpoints run like llama.cpp ran the same files.

Oracle: llama.cpp's outputs stored in the fixtures (`ref/llamacpp_<type>.safetensors`: logits,
post-norm hidden and MTP draft logits on the same GGUF files). F32 files must agree to 1e-4.
Q8_0 references come from llama.cpp's quantized kernels (activations rounded to 8 bits too) on
small random models that amplify rounding (fixtures/README.md: fp32 transformers vs llama.cpp
Q8_0 differ by 0.37 (dense) and 1.7 (MoE) in the logits); our run of the dequantized weights sits
between the two, so the check is top-token agreement and a relative bound taken from that table.
Also `freetoken parity` (spec vs no-spec) on a GGUF-converted checkpoint.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from freetoken.converters.gguf import convert_gguf
from tests.conftest import FIXTURE_MODELS, FIXTURES, fixture_refs, load_unified, num_sequences, our_mtp_logits, run_rows

TOL = 1e-4


def _gguf(model: str, kind: str):
    return FIXTURES / model / "gguf" / f"{model.replace('_', '-')}-{kind}.gguf"


def _outputs(path, refs):
    net = load_unified(path, with_mtp=True)
    for i in range(num_sequences(refs)):
        ids = refs[f"seq{i}.input_ids"].tolist()
        hidden, _, _ = run_rows(net, ids)
        yield i, hidden, net.compute_logits(hidden), our_mtp_logits(net, ids)


@pytest.mark.parametrize("model", FIXTURE_MODELS)
@pytest.mark.parametrize("layout", ["full", "trunk+sidecar"])
def test_f32_gguf_matches_llamacpp(model, layout, tmp_path):
    if layout == "full":
        convert_gguf(_gguf(model, "f32"), tmp_path / "u", dtype=torch.float32)
    else:
        mtp = FIXTURES / model / "gguf" / f"mtp-{model.replace('_', '-')}-f32.gguf"
        convert_gguf(_gguf(model, "trunk-f32"), tmp_path / "u", mtp=mtp, dtype=torch.float32)
    refs = fixture_refs(model, "llamacpp_f32")
    for i, hidden, logits, mtp_logits in _outputs(tmp_path / "u", refs):
        assert (hidden - refs[f"seq{i}.hidden"]).abs().max().item() <= TOL
        assert (logits - refs[f"seq{i}.logits"]).abs().max().item() <= TOL
        assert (mtp_logits - refs[f"seq{i}.mtp_logits"]).abs().max().item() <= TOL


Q8_RELATIVE = {"qwen35_dense": 0.1, "qwen35_moe": 0.45}  # fixtures/README.md: HF vs llama.cpp Q8_0, 9.7e-2 and 4.3e-1


@pytest.mark.parametrize("model,kind", [("qwen35_dense", "q8_0"), ("qwen35_moe", "q8_0"), ("qwen35_moe", "gateup-q8_0")])
def test_q8_0_gguf_close_to_llamacpp(model, kind, tmp_path):
    convert_gguf(_gguf(model, kind), tmp_path / "u", dtype=torch.float32)
    refs = fixture_refs(model, "llamacpp_q8_0")
    agree = agree_mtp = total = total_mtp = 0
    for i, _, logits, mtp_logits in _outputs(tmp_path / "u", refs):
        ref, ref_mtp = refs[f"seq{i}.logits"], refs[f"seq{i}.mtp_logits"]
        assert (logits - ref).abs().max() <= Q8_RELATIVE[model] * ref.abs().max()
        agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
        agree_mtp += int((mtp_logits.argmax(-1) == ref_mtp.argmax(-1)).sum())
        total, total_mtp = total + len(ref), total_mtp + len(ref_mtp)
    # README: HF fp32 vs llama.cpp Q8_0 agree on 53/56 (dense) and 48/56 (MoE) top tokens.
    assert agree >= 0.85 * total and agree_mtp >= 0.8 * total_mtp, (agree, total, agree_mtp, total_mtp)


def test_gateup_and_split_q8_0_give_identical_logits(tmp_path):
    convert_gguf(_gguf("qwen35_moe", "q8_0"), tmp_path / "split", dtype=torch.float32)
    convert_gguf(_gguf("qwen35_moe", "gateup-q8_0"), tmp_path / "gateup", dtype=torch.float32)
    refs = fixture_refs("qwen35_moe", "llamacpp_q8_0")
    for (_, _, a, am), (_, _, b, bm) in zip(_outputs(tmp_path / "split", refs), _outputs(tmp_path / "gateup", refs)):
        assert torch.equal(a, b) and torch.equal(am, bm)


def test_parity_command_passes_on_a_gguf_checkpoint(tmp_path):
    from freetoken.cli import app

    convert_gguf(_gguf("qwen35_moe", "f32"), tmp_path / "u", dtype=torch.float32)
    report = tmp_path / "parity.json"
    result = CliRunner().invoke(app, ["parity", str(tmp_path / "u"), "--spec", "mtp", "-k", "2", "-n", "24", "-p", "def f(x):", "-p", "import os", "--json", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())["runs"]
    assert data["k=2"]["passed"] is True and data["k=2"]["num_tokens"] == 48
