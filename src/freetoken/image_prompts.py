"""Text prompts with images -> token ids with the images laid out, and the request's images.

Where images go: each `<image>` marker in the prompt text stands for one image, in order; a prompt
without markers gets all its images in front of its text (with `--chat`, at the start of the user
turn). A marker becomes `<|vision_start|><|image_pad|><|vision_end|>` (the placeholders of the
Qwen3-VL chat template), and the pad is then repeated once per merged image feature. The text
between markers is tokenized piece by piece, as a tokenizer splits text around special tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from freetoken.errors import FreetokenError

IMAGE_MARKER = "<image>"


@dataclass(frozen=True)
class ImageTokenIds:
    image_pad: int
    vision_start: int
    vision_end: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ImageTokenIds":
        ids = (config.get("image_token_id"), config.get("vision_start_token_id"), config.get("vision_end_token_id"))
        if None in ids:
            raise FreetokenError("the checkpoint's config has no image/vision token ids, so it cannot take image prompts")
        return cls(*(int(i) for i in ids))


def with_markers(text: str, num_images: int) -> str:
    """text with one marker per image: as given if it has markers, else the markers put in front."""
    found = text.count(IMAGE_MARKER)
    if found == 0:
        return IMAGE_MARKER * num_images + text
    if found != num_images:
        raise FreetokenError(f"the prompt has {found} {IMAGE_MARKER} marker(s) for {num_images} image(s)")
    return text


def marked_token_ids(text: str, encode: Callable[[str], list[int]], tokens: ImageTokenIds) -> list[int]:
    """Token ids of text whose markers become vision_start, one image pad, vision_end."""
    pieces = text.split(IMAGE_MARKER)
    ids = encode(pieces[0]) if pieces[0] else []
    for piece in pieces[1:]:
        ids += [tokens.vision_start, tokens.image_pad, tokens.vision_end]
        ids += encode(piece) if piece else []
    return ids


def request_images(
    token_ids: list[int], images: Sequence[str | Path | Any], config: dict[str, Any], proc
) -> tuple[list[int], Any]:
    """(expanded token ids, RequestImages) of a prompt whose ids hold one image pad per image;
    images: paths or PIL images; proc: the checkpoint's ImageProcessing."""
    from freetoken.engine.request_images import RequestImages
    from freetoken.models.vision.image_file import load_image
    from freetoken.models.vision.preprocess import preprocess
    from freetoken.models.vision.prompt import image_layout

    pictures = [load_image(i) if isinstance(i, (str, Path)) else i.convert("RGB") for i in images]
    pixel_values, grids = preprocess(pictures, proc)
    layout = image_layout(token_ids, ImageTokenIds.from_config(config).image_pad, grids, proc.merge_size)
    return layout.token_ids, RequestImages(pixel_values, grids, layout.pad_spans, layout.positions, layout.rope_delta)
