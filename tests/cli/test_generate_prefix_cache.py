"""`freetoken generate --prefix-cache` end to end: the same completions as `--no-prefix-cache`, and the
run statistics (summary table, --stats-json) report the cached prompt tokens.

Oracles: the JSONL the same command writes with the cache off; the prompt token counts of the
fixture's own tokenizer (the shared part is long enough for a page- and chunk-aligned snapshot).
"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from freetoken.cli import app
from tests.conftest import FIXTURES

SYSTEM = "You are a careful assistant. Answer in Python. " * 12
QUESTIONS = ["def add(a, b):", "import sys", "class Stack:", "for i in range(10):"]


def test_generate_with_prefix_cache_equals_without_and_reports_the_cached_tokens(fixture_unified, tmp_path):
    from tokenizers import Tokenizer

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": SYSTEM + q}) for q in QUESTIONS) + "\n")
    model = str(fixture_unified("qwen35_dense"))
    runs = {}
    for flag in ("--no-prefix-cache", "--prefix-cache"):
        out, stats = tmp_path / f"{flag}.jsonl", tmp_path / f"{flag}.json"
        args = ["generate", model, "--prompts", str(prompts), "--out", str(out), "--spec", "mtp", "-n", "6", "--batch-size", "4"]
        result = CliRunner().invoke(app, [*args, "--stats-json", str(stats), flag])
        assert result.exit_code == 0, result.output
        token_ids = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
        runs[flag] = (token_ids, json.loads(stats.read_text()), result.output)
    (plain, plain_stats, plain_output), (cached, cached_stats, cached_output) = runs["--no-prefix-cache"], runs["--prefix-cache"]
    assert cached == plain
    assert plain_stats["config"]["prefix_cache"] is False and plain_stats["stats"]["cached_prompt_tokens"] == 0
    assert "cached prompt tokens" not in plain_output

    tok = Tokenizer.from_file(str(FIXTURES / "qwen35_dense" / "hf" / "tokenizer.json"))
    ids = [tok.encode(SYSTEM + q, add_special_tokens=False).ids for q in QUESTIONS]
    shared = next(i for i in range(min(map(len, ids))) if len({p[i] for p in ids}) > 1)  # tokens all prompts agree on
    per_hit = shared // 64 * 64  # the deepest multiple of the GDN chunk (and of the page) inside the shared prefix
    s = cached_stats["stats"]
    hits = len(QUESTIONS) - 1  # the first request computes the shared prefix, the others wait for it
    assert per_hit >= 64 and s["prefix_cache_hits"] == hits and s["cached_prompt_tokens"] == per_hit * hits
    assert 0 < s["prefix_cache_hit_rate"] < 1 and "cached prompt tokens" in cached_output
