"""Reading prompts from the command line or a file.

A .jsonl line is a JSON string or an object {"prompt": "...", "images": ["a.png", ...]}; image paths
are relative to the prompts file's folder. Where the images go in the prompt: freetoken/image_prompts.py
(`<image>` markers, else in front of the text). `read_images` decodes every image of a run up front
(Pillow only, no torch), so a missing or corrupt file fails the command before a model loads.
"""

from __future__ import annotations

import json
from pathlib import Path

from freetoken.errors import FreetokenError


def read_prompts(prompt: list[str] | None, prompts_file: Path | None, default: list[str] | None = None) -> list[str]:
    return read_prompts_with_images(prompt, prompts_file, default)[0]


def read_prompts_with_images(prompt: list[str] | None, prompts_file: Path | None, default: list[str] | None = None) -> tuple[list[str], list[list[str]]]:
    """(prompts, each prompt's image paths)."""
    prompts = list(prompt or [])
    images: list[list[str]] = [[] for _ in prompts]
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
                paths = item.get("images", []) if isinstance(item, dict) else []
                if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
                    raise FreetokenError(f"line {n}: \"images\" must be a list of paths", prompts_file)
                prompts.append(value)
                images.append([str(prompts_file.parent / p) for p in paths])
        else:
            lines = [line for line in text.splitlines() if line.strip()]
            prompts += lines
            images += [[] for _ in lines]
    if not prompts:
        if default is None:
            raise FreetokenError("no prompts: give --prompt TEXT or --prompts FILE")
        prompts = list(default)
        images = [[] for _ in prompts]
    return prompts, images


def read_images(paths: list[list[str]]) -> list[list]:
    """Per prompt, its image files decoded to RGB PIL images (each file read once); a one-line
    FreetokenError naming the first missing, unreadable or truncated file."""
    from freetoken.models.vision.image_file import load_image

    decoded: dict[str, object] = {}
    for path in (p for prompt_paths in paths for p in prompt_paths):
        if path not in decoded:
            decoded[path] = load_image(path)
    return [[decoded[p] for p in prompt_paths] for prompt_paths in paths]
