"""Reading prompts from the command line or a file."""

from __future__ import annotations

import json
from pathlib import Path

from freetoken.errors import FreetokenError


def read_prompts(prompt: list[str] | None, prompts_file: Path | None, default: list[str] | None = None) -> list[str]:
    prompts = list(prompt or [])
    if prompts_file is not None:
        if not prompts_file.is_file():
            raise FreetokenError("prompts file not found", prompts_file)
        text = prompts_file.read_text(encoding="utf-8")
        if prompts_file.suffix == ".jsonl":
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise FreetokenError(f"line {n} is not JSON ({exc.msg})", prompts_file) from None
                value = item.get("prompt", item.get("text")) if isinstance(item, dict) else item
                if not isinstance(value, str):
                    raise FreetokenError(f"line {n} has no \"prompt\" string", prompts_file)
                prompts.append(value)
        else:
            prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        if default is None:
            raise FreetokenError("no prompts: give --prompt TEXT or --prompts FILE")
        prompts = list(default)
    return prompts
