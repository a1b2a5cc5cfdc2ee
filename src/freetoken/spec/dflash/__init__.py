"""DFlash speculative decoding: a block-diffusion draft proposes a block of tokens in one forward."""
