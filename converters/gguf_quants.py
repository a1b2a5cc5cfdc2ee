"""Torch dequantizers for the ggml block formats found in GGUF files.

Why: gguf-py's numpy dequantizers run at 4-170 MB/s on a small CPU; these run the same
arithmetic as torch ops, so they work on CUDA tensors too. Each one reproduces
`gguf.quants.dequantize` bit for bit: the same float32 operations in the same order.

Layout:
- `QUANT_TYPES`: ggml type id -> `QuantType(name, block_size, type_size)`, including Q2_0 (42),
  which gguf 0.19 does not know.
- `dequantize(raw, type_id, shape)`: packed bytes (uint8, any shape whose bytes are whole blocks)
  -> float32 tensor of `shape`, on raw's device.
- one `_dq_<type>(blocks)` per format: uint8 [N, type_size] -> float32 [N, block_size].

The IQ grids and sign tables are taken from gguf-py at first use (same data as ggml's
`iq*_grid` tables) and cached per device.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np
import torch

from freetoken.errors import FreetokenError

QK_K = 256


@dataclass(frozen=True)
class QuantType:
    name: str
    block_size: int  # elements per block
    type_size: int  # bytes per block


QUANT_TYPES: dict[int, QuantType] = {
    0: QuantType("F32", 1, 4),
    1: QuantType("F16", 1, 2),
    2: QuantType("Q4_0", 32, 18),
    3: QuantType("Q4_1", 32, 20),
    6: QuantType("Q5_0", 32, 22),
    7: QuantType("Q5_1", 32, 24),
    8: QuantType("Q8_0", 32, 34),
    10: QuantType("Q2_K", 256, 84),
    11: QuantType("Q3_K", 256, 110),
    12: QuantType("Q4_K", 256, 144),
    13: QuantType("Q5_K", 256, 176),
    14: QuantType("Q6_K", 256, 210),
    16: QuantType("IQ2_XXS", 256, 66),
    17: QuantType("IQ2_XS", 256, 74),
    18: QuantType("IQ3_XXS", 256, 98),
    19: QuantType("IQ1_S", 256, 50),
    20: QuantType("IQ4_NL", 32, 18),
    21: QuantType("IQ3_S", 256, 110),
    22: QuantType("IQ2_S", 256, 82),
    23: QuantType("IQ4_XS", 256, 136),
    29: QuantType("IQ1_M", 256, 56),
    30: QuantType("BF16", 1, 2),
    39: QuantType("MXFP4", 32, 17),
    40: QuantType("NVFP4", 64, 36),
    42: QuantType("Q2_0", 64, 18),
}
TYPE_IDS: dict[str, int] = {q.name: i for i, q in QUANT_TYPES.items()}


def type_name(type_id: int) -> str:
    if type_id in QUANT_TYPES:
        return QUANT_TYPES[type_id].name
    try:
        import gguf

        return gguf.GGMLQuantizationType(type_id).name
    except (ImportError, ValueError):
        return f"type {type_id}"


# ---------------------------------------------------------------- bit helpers


def _f16(b: torch.Tensor) -> torch.Tensor:  # [N, 2k] uint8 -> [N, k] float32
    return b.contiguous().view(torch.float16).float()


def _u16(b: torch.Tensor) -> torch.Tensor:  # [N, 2k] uint8 -> [N, k] int32 (unsigned values)
    b = b.to(torch.int32).reshape(*b.shape[:-1], -1, 2)
    return b[..., 0] | (b[..., 1] << 8)


def _u32(b: torch.Tensor) -> torch.Tensor:  # [N, 4k] uint8 -> [N, k] int64 (unsigned values)
    b = b.to(torch.int64).reshape(*b.shape[:-1], -1, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _shifts(values: list[int], ndim: int, axis: int, device) -> torch.Tensor:
    shape = [1] * ndim
    shape[axis] = len(values)
    return torch.tensor(values, dtype=torch.int32, device=device).reshape(shape)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:  # [N, m] uint8 -> [N, 2m]: low nibbles, then high
    q = qs.to(torch.int32)
    return torch.cat([q & 0x0F, q >> 4], dim=-1)


def _bits(b: torch.Tensor) -> torch.Tensor:  # [..., m] uint8 -> [..., m, 8] int32, LSB first
    return (b.to(torch.int32).unsqueeze(-1) >> _shifts(list(range(8)), b.dim() + 1, -1, b.device)) & 1


def _sign(bits: torch.Tensor) -> torch.Tensor:
    return torch.where(bits == 0, 1.0, -1.0).to(torch.float32)


@lru_cache(maxsize=None)
def _table(name: str, device: str) -> torch.Tensor:
    """gguf-py lookup tables: IQ grids [n, w] float32, `ksigns` [128] uint8, kvalues, fp8 LUTs."""
    from gguf import quants

    if name == "ksigns":
        return torch.tensor(np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8).copy(), device=device)
    if name == "iq4nl":
        return torch.tensor(quants.IQ4_NL.kvalues, dtype=torch.float32, device=device)
    if name == "fp4":
        return torch.tensor(quants.MXFP4.kvalues, dtype=torch.float32, device=device)
    if name == "e8m0_half":  # ggml_e8m0_to_fp32_half, all 256 codes
        vals = [struct.unpack("<f", struct.pack("<I", (0x00200000 << x) if x < 2 else ((x - 1) << 23)))[0] for x in range(256)]
        return torch.tensor(vals, dtype=torch.float32, device=device)
    if name == "ue4m3_half":  # unsigned E4M3 times 0.5 (kvalues are doubled); 0 and 0x7F decode to 0
        vals = []
        for x in range(256):
            e, m = (x >> 3) & 0xF, x & 7
            raw = m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            vals.append(0.0 if x in (0, 0x7F) else raw * 0.5)
        return torch.tensor(vals, dtype=torch.float32, device=device)
    cls = getattr(quants, name)
    cls.init_grid()
    return torch.from_numpy(np.ascontiguousarray(cls.grid.reshape(cls.grid_shape))).to(device)


def _t(name: str, like: torch.Tensor) -> torch.Tensor:
    return _table(name, str(like.device))


# ---------------------------------------------------------------- legacy 32-element formats


def _dq_q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    return d * (_nibbles(b[:, 2:]) - 8).float()


def _dq_q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return d * _nibbles(b[:, 4:]).float() + m


def _q5(b: torch.Tensor, off: int) -> torch.Tensor:  # 5-bit codes from qh (4 B at off) and qs
    qh = _u32(b[:, off : off + 4])  # [N, 1]
    hi = (qh >> torch.arange(32, device=b.device)) & 1  # [N, 32]
    return _nibbles(b[:, off + 4 :]) | (hi.to(torch.int32) << 4)


def _dq_q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_q5(b, 2) - 16).float()


def _dq_q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return d * _q5(b, 4).float() + m


def _dq_q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _dq_q2_0(b: torch.Tensor) -> torch.Tensor:
    # 64 elements: element j is bits 2*(j%4) of byte j//4; value (code - 1) * d
    q = (b[:, 2:].to(torch.int32).unsqueeze(-1) >> _shifts([0, 2, 4, 6], 3, 2, b.device)) & 3  # [N, 16, 4]
    return (q.reshape(-1, 64) - 1).float() * _f16(b[:, :2])


def _dq_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _t("iq4nl", b)[_nibbles(b[:, 2:])]


def _dq_mxfp4(b: torch.Tensor) -> torch.Tensor:
    d = _t("e8m0_half", b)[b[:, :1].long()]  # [N, 1]
    return d * _t("fp4", b)[_nibbles(b[:, 1:])]


def _dq_nvfp4(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _t("ue4m3_half", b)[b[:, :4].long()].reshape(n, 4, 1)
    qs = b[:, 4:].to(torch.int32).reshape(n, 4, 8)
    vals = _t("fp4", b)[torch.cat([qs & 0x0F, qs >> 4], dim=-1)]  # [N, 4, 16]
    return (d * vals).reshape(n, 64)


# ---------------------------------------------------------------- k-quants (256 elements)


def _dq_q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc = b[:, :16].to(torch.int32)
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (sc & 0xF).float()).reshape(n, 16, 1)
    ml = (dmin * (sc >> 4).float()).reshape(n, 16, 1)
    qs = b[:, 16:80].to(torch.int32).reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], 4, 2, b.device)
    q = (qs & 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _dq_q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108].to(torch.int32)
    d = _f16(b[:, 108:110])
    lo = (scales[:, :8].reshape(n, 1, 8) >> _shifts([0, 4], 3, 1, b.device)).reshape(n, 16)
    hi = (scales[:, 8:].reshape(n, 1, 4) >> _shifts([0, 2, 4, 6], 3, 1, b.device)).reshape(n, 16)
    sc = ((lo & 0x0F) | ((hi & 3) << 4)) - 32
    dl = (d * sc.float()).reshape(n, 16, 1)
    ql = (qs.to(torch.int32).reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], 4, 2, b.device)).reshape(n, 16, 16) & 3
    qh = (hmask.to(torch.int32).reshape(n, 1, 1, 32) >> _shifts(list(range(8)), 4, 2, b.device)).reshape(n, 16, 16) & 1
    q = (ql - ((qh ^ 1) << 2)).float()
    return (dl * q).reshape(n, QK_K)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [N, 12] -> 2 x [N, 8]
    s = s.to(torch.int32).reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _dq_q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (d * sc.float()).reshape(n, 8, 1)
    dm = (dmin * mn.float()).reshape(n, 8, 1)
    qs = b[:, 16:].to(torch.int32).reshape(n, 4, 1, 32) >> _shifts([0, 4], 4, 2, b.device)
    q = (qs & 0x0F).reshape(n, 8, 32).float()
    return (dl * q - dm).reshape(n, QK_K)


def _dq_q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (d * sc.float()).reshape(n, 8, 1)
    dm = (dmin * mn.float()).reshape(n, 8, 1)
    qh, qs = b[:, 16:48].to(torch.int32), b[:, 48:].to(torch.int32)
    ql = (qs.reshape(n, 4, 1, 32) >> _shifts([0, 4], 4, 2, b.device)).reshape(n, 8, 32) & 0x0F
    h = (qh.reshape(n, 1, 1, 32) >> _shifts(list(range(8)), 4, 2, b.device)).reshape(n, 8, 32) & 1
    return (dl * (ql | (h << 4)).float() - dm).reshape(n, QK_K)


def _dq_q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, :128].to(torch.int32), b[:, 128:192].to(torch.int32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210])
    dl = (d * scales).reshape(n, 16, 1)
    lo = (ql.reshape(n, 2, 1, 64) >> _shifts([0, 4], 4, 2, b.device)).reshape(n, 8, 32) & 0x0F
    hi = (qh.reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], 4, 2, b.device)).reshape(n, 8, 32) & 3
    q = ((lo | (hi << 4)) - 32).reshape(n, 16, 16).float()
    return (dl * q).reshape(n, QK_K)


# ---------------------------------------------------------------- i-quants (256 elements)


def _ksign_bits(idx: torch.Tensor) -> torch.Tensor:  # 7-bit sign indices [...] -> +-1 [..., 8]
    return _sign(_bits(_t("ksigns", idx)[idx.long()]))


def _dq_iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    qs = b[:, 2:].reshape(n, 8, 8)
    aux = _u32(qs[:, :, 4:]).reshape(n, 8)  # scale (4 bits) and four 7-bit sign indices
    db = (d * (0.5 + (aux >> 28).float()) * 0.25).reshape(n, 8, 1, 1)
    sidx = (aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=b.device)) & 0x7F  # [N, 8, 4]
    grid = _t("IQ2_XXS", b)[qs[:, :, :4].long()]  # [N, 8, 4, 8]
    return (db * grid * _ksign_bits(sidx)).reshape(n, QK_K)


def _dq_iq2_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    qs = _u16(b[:, 2:66])  # [N, 32]
    sc = _nibbles_interleaved(b[:, 66:74])  # [N, 16]
    db = (d * (0.5 + sc.float()) * 0.25).reshape(n, 16, 1, 1)
    signs = _ksign_bits(qs >> 9).reshape(n, 16, 2, 8)
    grid = _t("IQ2_XS", b)[(qs & 511).long()].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _nibbles_interleaved(s: torch.Tensor) -> torch.Tensor:  # [N, m] -> [N, 2m]: lo0, hi0, lo1, hi1, ...
    s = s.to(torch.int32)
    return torch.stack([s & 0x0F, s >> 4], dim=-1).reshape(s.shape[0], -1)


def _dq_iq2_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    qs, signs, qh, scales = b[:, 2:34], b[:, 34:66], b[:, 66:74], b[:, 74:82]
    db = (d * (0.5 + _nibbles_interleaved(scales).float()) * 0.25).reshape(n, 16, 1, 1)
    sg = _sign(_bits(signs)).reshape(n, 16, 2, 8)
    hi = ((qh.to(torch.int32).unsqueeze(-1) >> _shifts([0, 2, 4, 6], 3, 2, b.device)) & 3).reshape(n, 32)
    idx = qs.to(torch.int32) | (hi << 8)
    grid = _t("IQ2_S", b)[idx.long()].reshape(n, 16, 2, 8)
    return (db * grid * sg).reshape(n, QK_K)


def _dq_iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    qs, aux = b[:, 2:66], _u32(b[:, 66:98])  # [N, 64], [N, 8]
    db = (d * (0.5 + (aux >> 28).float()) * 0.5).reshape(n, 8, 1, 1)
    sidx = (aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=b.device)) & 0x7F
    grid = _t("IQ3_XXS", b)[qs.long()].reshape(n, 8, 4, 8)
    return (db * grid * _ksign_bits(sidx)).reshape(n, QK_K)


def _dq_iq3_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    qs, qh, signs, scales = b[:, 2:66], b[:, 66:74], b[:, 74:106], b[:, 106:110]
    sc = _nibbles_interleaved(scales)  # [N, 8]
    db = (d * (1 + 2 * sc).float()).reshape(n, 8, 1, 1)
    sg = _sign(_bits(signs)).reshape(n, 8, 4, 8)
    idx = qs.to(torch.int32) | (_bits(qh).reshape(n, 64) << 8)
    grid = _t("IQ3_S", b)[idx.long()].reshape(n, 8, 4, 8)
    return (db * grid * sg).reshape(n, QK_K)


IQ1_DELTA = 0.125


def _dq_iq1_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    qs, qh = b[:, 2:34].to(torch.int32), _u16(b[:, 34:50])  # [N, 32], [N, 8]
    dl = (d * (2 * ((qh >> 12) & 7) + 1).float()).reshape(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, IQ1_DELTA, -IQ1_DELTA).to(torch.float32).reshape(n, 8, 1, 1)
    hi = ((qh.unsqueeze(-1) >> _shifts([0, 3, 6, 9], 3, 2, b.device)) & 7).reshape(n, 32)
    grid = _t("IQ1_S", b)[(qs | (hi << 8)).long()].reshape(n, 8, 4, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


def _dq_iq1_m(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qs, qh, sc16 = b[:, :32].to(torch.int32), b[:, 32:48].to(torch.int32), _u16(b[:, 48:56])  # sc16 [N, 4]
    dbits = (sc16 & 0xF000) >> _shifts([12, 8, 4, 0], 2, 1, b.device)
    dbits = dbits[:, 0] | dbits[:, 1] | dbits[:, 2] | dbits[:, 3]  # [N]
    d = dbits.to(torch.int16).view(torch.float16).float().reshape(n, 1)
    sc = ((sc16.unsqueeze(-1) >> _shifts([0, 3, 6, 9], 3, 2, b.device)) & 7).reshape(n, 16)
    dl = (d * (2 * sc + 1).float()).reshape(n, 8, 2, 1, 1)
    h = (qh.unsqueeze(-1) >> _shifts([0, 4], 3, 2, b.device))  # [N, 16, 2]
    idx = qs | ((h & 7) << 8).reshape(n, 32)
    delta = torch.where((h & 8) == 0, IQ1_DELTA, -IQ1_DELTA).to(torch.float32).reshape(n, 8, 2, 2, 1)
    grid = _t("IQ1_S", b)[idx.long()].reshape(n, 8, 2, 2, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


def _dq_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    sh = _u16(b[:, 2:4])  # [N, 1]
    sl = _nibbles_interleaved(b[:, 4:8])  # [N, 8]
    hi = (sh >> torch.arange(0, 16, 2, device=b.device, dtype=torch.int32)) & 3  # [N, 8]
    dl = (d * ((sl | (hi << 4)) - 32).float()).reshape(n, 8, 1)
    qs = b[:, 8:].to(torch.int32).reshape(n, 8, 1, 16) >> _shifts([0, 4], 4, 2, b.device)
    q = _t("iq4nl", b)[(qs & 0x0F).reshape(n, 8, 32)]
    return (dl * q).reshape(n, QK_K)


# ---------------------------------------------------------------- dispatch

_BLOCK_FNS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    2: _dq_q4_0,
    3: _dq_q4_1,
    6: _dq_q5_0,
    7: _dq_q5_1,
    8: _dq_q8_0,
    10: _dq_q2_k,
    11: _dq_q3_k,
    12: _dq_q4_k,
    13: _dq_q5_k,
    14: _dq_q6_k,
    16: _dq_iq2_xxs,
    17: _dq_iq2_xs,
    18: _dq_iq3_xxs,
    19: _dq_iq1_s,
    20: _dq_iq4_nl,
    21: _dq_iq3_s,
    22: _dq_iq2_s,
    23: _dq_iq4_xs,
    29: _dq_iq1_m,
    39: _dq_mxfp4,
    40: _dq_nvfp4,
    42: _dq_q2_0,
}


def dequantize(raw: torch.Tensor, type_id: int, shape: tuple[int, ...], *, name: str = "tensor", chunk_blocks: int = 1 << 16) -> torch.Tensor:
    """Packed ggml bytes -> float32 tensor of `shape` (torch order, innermost last), on raw's device.

    raw: uint8, any shape, holding exactly prod(shape) / block_size blocks. Unknown types raise
    FreetokenError naming `name` and the type. Work is done `chunk_blocks` blocks at a time to
    bound the int32 temporaries.
    """
    if type_id not in QUANT_TYPES:
        raise FreetokenError(f"tensor {name}: unsupported GGUF quantization type {type_name(type_id)} (id {type_id})")
    qt = QUANT_TYPES[type_id]
    numel = math.prod(shape)
    flat = raw.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    if numel % qt.block_size or flat.numel() != numel // qt.block_size * qt.type_size:
        raise FreetokenError(f"tensor {name}: {flat.numel()} bytes do not hold {numel} {qt.name} values")
    if qt.name == "F32":
        return flat.view(torch.float32).reshape(shape).clone()
    if qt.name == "F16":
        return flat.view(torch.float16).float().reshape(shape)
    if qt.name == "BF16":
        return (flat.view(torch.int16).to(torch.int32) << 16).view(torch.float32).reshape(shape)
    blocks = flat.reshape(-1, qt.type_size)
    fn = _BLOCK_FNS[type_id]
    out = torch.empty(blocks.shape[0], qt.block_size, dtype=torch.float32, device=raw.device)
    for start in range(0, blocks.shape[0], chunk_blocks):
        out[start : start + chunk_blocks] = fn(blocks[start : start + chunk_blocks])
    return out.reshape(shape)
