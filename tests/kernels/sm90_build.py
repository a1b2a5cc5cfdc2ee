"""Compile a Triton kernel for sm_90 on the CPU (no GPU needed) and return its PTX.

Tests call it in a process outside the interpreter (`run`): the kernel tests' own process has
TRITON_INTERPRET=1, and Triton reads that before it compiles anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ptx(kernel, signature: dict[str, str], constants: dict, options: dict, divisible: tuple[str, ...] = ()) -> str:
    """The sm_90 PTX of `kernel` for `signature` (name -> Triton type, the constexprs included),
    `constants` (constexpr values) and compile `options`; `divisible` names the arguments the
    launcher would specialise as multiples of 16."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    signature = {name: signature[name] for name in kernel.arg_names}  # in the kernel's argument order
    names = list(signature)
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    return compile(source, target=GPUTarget("cuda", 90, 64), options=options).asm["ptx"]



def ptx_of(kernel, pointers: dict[str, str], ints: tuple[str, ...], floats: tuple[str, ...], constants: dict, options: dict,
           unspecialised: tuple[str, ...] = ()) -> str:
    """`ptx` with the signature given as pointer types, i32 and fp32 argument names and the constexprs;
    every integer argument but the `unspecialised` ones is taken as a multiple of 16."""
    signature = dict(pointers) | {name: "i32" for name in ints} | {name: "fp32" for name in floats} | {name: "constexpr" for name in constants}
    divisible = tuple(n for n in signature if signature[n] not in ("constexpr", "fp32") and n not in unspecialised)
    return ptx(kernel, signature, constants, options, divisible)

def run(script: str) -> str:
    """The standard output of a Python `script` run with TRITON_INTERPRET=0 (it may import this module)."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
