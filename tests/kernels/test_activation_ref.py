"""kernels/activation_ref.py: an element's bits do not depend on the call it is in, and the values are
torch's own within rounding.

The oracle for invariance is the element computed alone; for values, torch.sigmoid / F.silu /
F.softplus. The GDN recurrence inputs at a real head count (Qwen3.8-Flash-Next's 48 value heads) are checked
the same way: a decode row ([1, Hv]) and the same row inside a verify step ([4, Hv]) must give equal
bits. torch's own sigmoid and softplus do not: on this CPU they take one path for whole 32-element
chunks of a call and another for the rest, so the last 16 of a decode row's 48 gates are computed
differently from the same gates inside 4 rows (192 = 6 x 32).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from freetoken.kernels import activation_ref
from freetoken.kernels.gdn_ref import recurrence_inputs

CASES = {
    "sigmoid": (activation_ref.sigmoid, torch.sigmoid),
    "silu": (activation_ref.silu, F.silu),
    "softplus": (activation_ref.softplus, F.softplus),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bits_do_not_depend_on_the_call(name, dtype):
    ours, _ = CASES[name]
    x = (torch.randn(700, generator=torch.Generator().manual_seed(0)) * 8).to(dtype)
    alone = torch.cat([ours(x[i : i + 1]) for i in range(x.numel())])
    for offset in (0, 1, 5):
        for n in (1, 7, 16, 31, 32, 33, 63, 64, 65, 127, 128, 129, 300, 600):
            got = ours(x[offset : offset + n])
            assert torch.equal(got, alone[offset : offset + n]), (offset, n)
    assert torch.equal(ours(x.view(35, 20))[3], alone[60:80])  # a row of a 2-D call


@pytest.mark.parametrize("name", sorted(CASES))
def test_values_match_torch(name):
    ours, theirs = CASES[name]
    x = torch.cat([torch.linspace(-40, 40, 4001), torch.tensor([0.0, 20.0, 20.5, -20.0, 88.0, -88.0, -104.0])])
    torch.testing.assert_close(ours(x), theirs(x), rtol=2e-6, atol=1e-7)
    xb = x.to(torch.bfloat16)  # one rounding to bf16 of nearly the same fp32 value: at most one bf16 step apart
    assert ((ours(xb).float() - theirs(xb).float()).abs() <= theirs(xb).float().abs() * 2**-7 + 1e-30).all()


def test_gdn_inputs_of_a_decode_row_equal_its_verify_row():
    gen = torch.Generator().manual_seed(1)
    hk, hv, dk, dv = 16, 48, 128, 128  # Qwen3.8-Flash-Next's GDN heads
    conv_dim = 2 * hk * dk + hv * dv
    conv_out, a, b = torch.randn(4, conv_dim, generator=gen), torch.randn(4, hv, generator=gen) * 3, torch.randn(4, hv, generator=gen) * 3
    a_log, dt_bias = torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
    verify = recurrence_inputs(conv_out, a, b, a_log, dt_bias, hk, dk, dv)
    for row in range(4):
        decode = recurrence_inputs(conv_out[row : row + 1], a[row : row + 1], b[row : row + 1], a_log, dt_bias, hk, dk, dv)
        for name, one, many in zip("qkvgb", decode, verify):
            assert torch.equal(one[0], many[row]), (name, row)
