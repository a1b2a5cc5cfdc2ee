"""`freetoken generate --prompts FILE.jsonl` with images: PNG files written here, end to end.

Oracles: the prompt length the layout must have (the fixture tokenizer's ids of the text around the
placeholders, plus one pad per merged 2x2 patch block: a 32x48 image is upscaled to 56x80 pixels,
14x20 patches, 70 pads); the Python API without speculative decoding (the CLI runs --spec mtp);
the installed `freetoken` command for the one-line error and exit code 1.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from typer.testing import CliRunner

from freetoken.cli import app
from freetoken.engine.config import EngineConfig
from freetoken.llm import LLM
from freetoken.sampling import SamplingParams
from tests.models.vision.conftest import random_image, vl_checkpoints  # noqa: F401 (a fixture)


def _write_prompts(tmp_path, lines: list[dict]):
    random_image(32, 48, 0).save(tmp_path / "a.png")
    random_image(40, 24, 1).save(tmp_path / "b.png")
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_generate_with_images_end_to_end(vl_checkpoints, tmp_path):  # noqa: F811
    from tokenizers import Tokenizer

    hf_dir, unified = vl_checkpoints["qwen35_dense"]
    lines = [
        {"prompt": "see <image> and <image>", "images": ["a.png", "b.png"]},
        {"prompt": "what is it", "images": ["a.png"]},
        {"prompt": "def add(a, b):"},
    ]
    prompts = _write_prompts(tmp_path, lines)
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(
        app, ["generate", str(unified), "--prompts", str(prompts), "--out", str(out), "--spec", "mtp", "-n", "6"]
    )
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]

    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    text_len = lambda s: len(tok.encode(s, add_special_tokens=False).ids)  # noqa: E731
    assert (
        records[0]["prompt_tokens"] == text_len("see ") + text_len(" and ") + 2 * 2 + 70 + 77
    )  # b: 40x24 -> 88x56 px, 22x14 patches
    assert records[1]["prompt_tokens"] == 2 + 70 + text_len("what is it")  # no marker: the image leads
    llm = LLM(str(unified), EngineConfig(max_model_len=512))
    images = [[tmp_path / p for p in line.get("images", [])] for line in lines]
    want, _ = llm.generate([line["prompt"] for line in lines], SamplingParams(max_new_tokens=6), images=images)
    assert [r["token_ids"] for r in records] == [c.token_ids for c in want]


def test_a_missing_image_is_a_one_line_error(vl_checkpoints, tmp_path):  # noqa: F811
    prompts = _write_prompts(tmp_path, [{"prompt": "see <image>", "images": ["missing.png"]}])
    result = subprocess.run(
        ["freetoken", "generate", str(vl_checkpoints["qwen35_dense"][1]), "--prompts", str(prompts), "-n", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "image file not found" in lines[0] and "missing.png" in lines[0], result.stderr


def test_a_truncated_image_fails_before_the_model_loads(vl_checkpoints, tmp_path):  # noqa: F811
    """A corrupt PNG (its second half cut off) gives one line naming it, exit 1, no output files, and
    torch is never imported (so no model was loaded)."""
    lines = [{"prompt": "see <image>", "images": ["a.png"]}, {"prompt": "x <image>", "images": ["cut.png"]}]
    prompts = _write_prompts(tmp_path, lines)
    whole = (tmp_path / "b.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(whole[: len(whole) // 2])
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    argv = ["freetoken", "generate", str(vl_checkpoints["qwen35_dense"][1]), "--prompts", str(prompts), "-n", "2",
            "--out", str(out), "--stats-json", str(stats)]
    code = (
        "import sys\n"
        "from freetoken.cli import main\n"
        f"sys.argv = {argv!r}\n"
        "try:\n"
        "    main()\n"
        "finally:\n"
        "    print('torch imported' if 'torch' in sys.modules else 'torch not imported')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 1 and "cannot read the image" in errors[0] and "truncated" in errors[0], result.stderr
    assert str(tmp_path / "cut.png") in errors[0]
    assert result.stdout.strip() == "torch not imported" and not out.exists() and not stats.exists()


def test_chat_with_images_matches_transformers(vl_checkpoints, tmp_path):  # noqa: F811
    """--chat: the markers (or, without any, the images) sit in the user turn of the checkpoint's chat
    template. Oracle: the chat text written out here with Qwen3-VL's vision placeholders, each pad
    repeated once per merged patch block of transformers' image processor output (as its Qwen3-VL
    processor does), tokenized by transformers, and the greedy tokens of transformers' generate."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from freetoken.models.vision.image_file import load_image
    from tests.models.vision.conftest import hf_processor

    hf_dir, unified = vl_checkpoints["qwen35_dense"]
    lines = [{"prompt": "compare <image> with <image>", "images": ["a.png", "b.png"]},
             {"prompt": "what is it", "images": ["b.png"]}]
    prompts = _write_prompts(tmp_path, lines)
    out = tmp_path / "out.jsonl"
    argv = ["generate", str(unified), "--prompts", str(prompts), "--out", str(out), "--chat", "-n", "5"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]

    image = "<|vision_start|><|image_pad|><|vision_end|>"
    chats = [f"<|im_start|>user\ncompare {image} with {image}<|im_end|>\n<|im_start|>assistant\n",
             f"<|im_start|>user\n{image}what is it<|im_end|>\n<|im_start|>assistant\n"]
    llm = LLM(str(unified))
    processor, tokenizer = hf_processor(llm.image_processing), AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for chat, line, record in zip(chats, lines, records):
        pixels = processor([load_image(tmp_path / p) for p in line["images"]], return_tensors="pt")
        counts = iter((pixels["image_grid_thw"].prod(-1) // 4).tolist())
        ids = [t for i in tokenizer(chat)["input_ids"] for t in ([i] * next(counts) if i == pad else [i])]
        x = torch.tensor([ids])
        pictures = [load_image(tmp_path / p) for p in line["images"]]
        assert llm.encode_with_images(line["prompt"], pictures, chat=True)[0] == ids and record["prompt_tokens"] == len(ids)
        with torch.no_grad():
            got = model.generate(input_ids=x, **pixels, mm_token_type_ids=(x == pad).int(), max_new_tokens=5, do_sample=False)
        model.model.rope_deltas = None
        assert record["token_ids"] == got[0, len(ids) :].tolist()
