"""Reading an image file into an RGB PIL image, fully decoded (a truncated or corrupt file fails here,
not later). Pillow only: the CLI decodes every image of a run before it imports torch or loads a model."""

from __future__ import annotations

from pathlib import Path


def load_image(path: str | Path):
    """The image at `path` as a decoded RGB PIL image; a one-line FreetokenError naming the file if it
    is missing, not an image, or truncated."""
    from PIL import Image, UnidentifiedImageError

    from freetoken.errors import FreetokenError

    path = Path(path)
    if not path.is_file():
        raise FreetokenError("image file not found", path)
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except UnidentifiedImageError:
        raise FreetokenError("cannot read the image (not an image file Pillow knows)", path) from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise FreetokenError(f"cannot read the image ({type(exc).__name__}: {_first_line(exc)})", path) from None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no details"
