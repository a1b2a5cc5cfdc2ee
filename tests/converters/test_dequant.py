"""Torch dequantizers vs gguf-py's numpy `dequantize`, bit for bit, on random blocks.

Random bytes everywhere except the fp16 scale fields, which get finite fp16 values (a NaN or inf
scale would make the comparison meaningless). Q2_0, unknown to gguf 0.19, is checked against a
numpy reading of its documented layout (gguf.md §3/§5.1: 64 elements, fp16 d, 2-bit codes
LSB-first, value (code - 1) * d).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from freetoken.converters.gguf_quants import QUANT_TYPES, dequantize
from freetoken.errors import FreetokenError

# byte offsets of the fp16 scales inside one block, per type
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0], "IQ1_S": [0],
    "IQ4_NL": [0], "IQ4_XS": [0], "MXFP4": [], "NVFP4": [], "Q2_0": [0], "IQ1_M": [],
}
N_BLOCKS = 64


def _random_blocks(name: str, rng: np.random.Generator) -> np.ndarray:
    qt = QUANT_TYPES[T[name].value if name != "Q2_0" else 42]
    raw = rng.integers(0, 256, size=(N_BLOCKS, qt.type_size), dtype=np.uint8)
    scales = rng.standard_normal(N_BLOCKS * 2).astype(np.float16).view(np.uint8).reshape(N_BLOCKS, 2, 2)
    for i, off in enumerate(F16_FIELDS[name][:2]):
        raw[:, off : off + 2] = scales[:, i]
    if name == "IQ1_M":  # the fp16 scale is spread over the top nibbles of 4 uint16 words
        d = rng.standard_normal(N_BLOCKS).astype(np.float16).view(np.uint16).astype(np.uint32)
        words = raw[:, 48:56].copy().view(np.uint16).reshape(N_BLOCKS, 4) & 0x0FFF
        for k, shift in enumerate((0, 4, 8, 12)):
            words[:, k] |= (((d >> shift) & 0xF) << 12).astype(np.uint16)
        raw[:, 48:56] = words.view(np.uint8).reshape(N_BLOCKS, 8)
    return raw


GGUF_PY_TYPES = [n for n in (q.name for q in QUANT_TYPES.values()) if n not in ("F32", "F16", "BF16", "Q2_0")]


@pytest.mark.parametrize("name", GGUF_PY_TYPES)
def test_block_types_match_gguf_py_bit_for_bit(name):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    raw = _random_blocks(name, rng)
    qt = QUANT_TYPES[T[name].value]
    rows = 4
    packed = raw.reshape(rows, -1)
    want = quants.dequantize(packed, T[name])  # [rows, cols]
    got = dequantize(torch.from_numpy(packed), T[name].value, tuple(want.shape))
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    assert want.shape[1] == N_BLOCKS // rows * qt.block_size
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32)), name


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_types_match_gguf_py(name):
    rng = np.random.default_rng(1)
    vals = rng.standard_normal((8, 32)).astype({"F32": np.float32, "F16": np.float16, "BF16": np.float32}[name])
    packed = vals.view(np.uint8) if name != "BF16" else (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    want = quants.dequantize(packed, T[name]) if name != "F16" else packed.view(np.float16).astype(np.float32)
    got = dequantize(torch.from_numpy(packed.copy()), T[name].value, (8, 32))
    assert np.array_equal(got.numpy().view(np.uint32), want.reshape(8, 32).view(np.uint32))


def _q2_0_reference(raw: np.ndarray) -> np.ndarray:
    """Straight from the doc: per block d = fp16 bytes 0-1; element j has code (qs[j//4] >> 2*(j%4)) & 3."""
    out = np.empty((raw.shape[0], 64), dtype=np.float32)
    for i, block in enumerate(raw):
        d = np.float32(block[:2].view(np.float16)[0])
        for j in range(64):
            code = (int(block[2 + j // 4]) >> (2 * (j % 4))) & 3
            out[i, j] = np.float32(code - 1) * d
    return out


def test_q2_0_matches_documented_layout():
    raw = _random_blocks("Q2_0", np.random.default_rng(42))
    want = _q2_0_reference(raw)
    got = dequantize(torch.from_numpy(raw), 42, (N_BLOCKS, 64))
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))
    # hand check of one value: code 0 -> -d
    assert got[0, 0].item() == (((raw[0, 2] & 3) - 1) * float(raw[0, :2].view(np.float16)[0]))


def test_unknown_type_names_tensor_and_type():
    with pytest.raises(FreetokenError, match=r"blk\.0\.ffn_up\.weight.*TQ1_0"):
        dequantize(torch.zeros(54, dtype=torch.uint8), 34, (256,), name="blk.0.ffn_up.weight")
    with pytest.raises(FreetokenError, match=r"w.*type 99"):
        dequantize(torch.zeros(54, dtype=torch.uint8), 99, (256,), name="w")
