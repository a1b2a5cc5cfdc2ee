"""Where Triton needs help: its CPU interpreter (TRITON_INTERPRET=1) with NumPy >= 2.4, and products
that torch rounds on their own.

The interpreter of Triton 3.6 turns a scalar into a Python int with `int(array)` on a one-element
1-D array, which NumPy 2.4 rejects; every `range(0, K, BLOCK)` over a runtime bound then fails.
`patch()` makes that conversion go through `.item()`. It changes nothing when kernels are compiled
for a GPU, and is applied by every `*_triton` module on import.

The interpreter also computes `tl.dot` on bfloat16 operands wrongly (NumPy has no bfloat16), so
kernels take `DOT_F32 = INTERPRET` and upcast dot operands to fp32 there; bf16 x bf16 products are
exact in fp32, so only the summation order differs from the GPU's tensor-core dot.

`mul_rn` is a product the compiler cannot fuse into a following add. With FP fusion on (Triton's
default) `a * b + c` compiles to one fma, and a bf16 `(a * b).to(bf16)` added in bf16 is narrowed to
bf16 ops and contracted into fma.rn.bf16x2 as well: one rounding where torch rounds twice. Where a
kernel must round a product as torch does before adding it, it takes `mul_rn` (PTX mul.rn.f32, which
is never contracted, subnormals kept); the interpreter, which fuses nothing, multiplies.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


@triton.jit
def _mul_compiled(a, b):
    a, b = tl.broadcast(a.to(tl.float32), b.to(tl.float32))
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _mul_interpreted(a, b):
    return a * b


mul_rn = _mul_interpreted if INTERPRET else _mul_compiled  # fp32 a * b, rounded alone (module docstring)


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
