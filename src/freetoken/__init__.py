"""freetoken: unified Qwen-family checkpoints and offline batch generation with lossless speculative decoding.

The public surface is small and imports nothing heavy: `freetoken --help` must stay fast.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
