"""Keeps Triton's CPU interpreter (TRITON_INTERPRET=1) working with NumPy >= 2.4.

The interpreter of Triton 3.6 turns a scalar into a Python int with `int(array)` on a one-element
1-D array, which NumPy 2.4 rejects; every `range(0, K, BLOCK)` over a runtime bound then fails.
`patch()` makes that conversion go through `.item()`. It changes nothing when kernels are compiled
for a GPU, and is applied by every `*_triton` module on import.

The interpreter also computes `tl.dot` on bfloat16 operands wrongly (NumPy has no bfloat16), so
kernels take `DOT_F32 = INTERPRET` and upcast dot operands to fp32 there; bf16 x bf16 products are
exact in fp32, so only the summation order differs from the GPU's tensor-core dot.
"""

from __future__ import annotations

import os

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


def patch() -> None:
    if not INTERPRET:
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_freetoken_compat", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._freetoken_compat = True
    interpreter._patch_lang_tensor = patched


patch()
