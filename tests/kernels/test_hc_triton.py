"""The hyper-connections' Triton kernels (kernels/hc_triton.py) vs their torch twins (kernels/hc_ref.py):
within one rounding of the output dtype (exp's last bits; under the interpreter also its bf16 casts,
which truncate where a GPU rounds to nearest even), the injection's sum bit for bit where both round
alike (fp32, and bf16 on a GPU), each row alone equal to the same row in a batch, and a
hyper-connection with its injection run in five launches and no torch op."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

import freetoken.kernels  # noqa: E402
from freetoken.kernels import hc_ref, hc_triton, norm_ref  # noqa: E402
from freetoken.models.qwen4_exp.hyper_connection import GatedResidual, inject  # noqa: E402
from freetoken.models.qwen4_exp.ops import GroupedZCRMSNorm  # noqa: E402
from tests.kernels.conftest import DEVICES, INTERPRET  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
STREAMS, EPS = 4, 1e-6


def shapes(device) -> tuple[int, int]:
    """(H, r): not powers of two on CPU (masked blocks, two mean programs a row), the real ones on a GPU."""
    return (1100, 12) if device == "cpu" else (2560, 320)


def rand(gen, device, dtype, *shape, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(device)


def inputs(device, dtype, rows, seed=0):
    """x, up, xn [rows, S*H], y [rows, H], the merged projection's output [rows, r + S], injection weights
    [rows, S] in (0, 2), a norm weight [S*H]."""
    h, r = shapes(device)
    gen = torch.Generator().manual_seed(seed)
    return dict(x=rand(gen, device, dtype, rows, STREAMS * h), up=rand(gen, device, dtype, rows, STREAMS * h, scale=2.0),
                xn=rand(gen, device, dtype, rows, STREAMS * h), y=rand(gen, device, dtype, rows, h),
                down_inject=rand(gen, device, dtype, rows, r + STREAMS, scale=8.0), weights=(2 * torch.rand(rows, STREAMS, generator=gen)).to(dtype).to(device),
                norm_weight=rand(gen, device, dtype, STREAMS * h, scale=0.3))


def run_all(impl, a: dict) -> list[torch.Tensor]:
    """Every kernel's outputs on `a`: the gates (with and without injection columns), the mean, the
    injection alone and with the next norm."""
    r = a["down_inject"].shape[1] - STREAMS
    g, w = impl.gates(a["down_inject"], r, STREAMS)
    g_mixer, w_mixer = impl.gates(a["down_inject"][:, :r], r, STREAMS)
    assert w_mixer.shape == (a["x"].shape[0], 0)
    u = impl.mix_mean(a["up"], a["xn"], STREAMS)
    x, y, weights = a["x"], a["y"], a["weights"]
    if impl is hc_ref:
        x_alone, (x_normed, xn) = hc_ref.inject(x, y, weights), hc_ref.inject_norm(x, y, weights, a["norm_weight"], EPS)
    else:
        x_alone, none = hc_triton.inject(x, y, weights)
        assert none is None
        x_normed, xn = hc_triton.inject(x, y, weights, a["norm_weight"], EPS)
    return [g, w, g_mixer, u, x_alone, x_normed, xn]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_reference(device, dtype):
    a = inputs(device, dtype, 3)
    got, want = run_all(hc_triton, a), run_all(hc_ref, a)
    h = a["y"].shape[1]
    # the norm of the kernel's own sum (an ulp of the sum moves the norm more than the tolerance)
    want[-1] = norm_ref.grouped_zc_rms_norm(got[-2], a["norm_weight"], h, EPS)
    for name, g, r in zip(["silu", "weights", "silu (mixer)", "mean", "inject", "inject + norm", "norm"], got, want):
        assert g.dtype == r.dtype == dtype and g.shape == r.shape, name
        if name.startswith("inject"):  # a sum that may cancel: within two roundings of its terms' size
            terms = a["x"].float().abs() + (a["y"].float()[:, None, :] * a["weights"].float()[:, :, None]).abs().reshape(a["x"].shape)
            assert ((g.float() - r.float()).abs() <= 2 * torch.finfo(dtype).eps * terms).all(), name
        else:
            torch.testing.assert_close(g.float(), r.float(), **TOL[dtype], msg=name)
    if dtype == torch.float32 or device == "cuda":  # each product and sum rounded as torch rounds it
        assert torch.equal(got[4], want[4]) and torch.equal(got[5], want[5])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_alone_equal_rows_in_batch(device, dtype):
    a = inputs(device, dtype, 4, seed=1)
    batch = run_all(hc_triton, a)
    for row in (0, 3):
        alone = run_all(hc_triton, {k: v if k == "norm_weight" else v[row : row + 1] for k, v in a.items()})
        assert all(torch.equal(one[0], full[row]) for one, full in zip(alone, batch)), row


def test_hand_case():
    """Values the formulas give exactly: d = 0 -> silu 0, i = 0 -> weight 2 * 1/2 = 1; up = 0 -> the mean
    of xn / 2; weight 1 and y = 1 add one to every stream."""
    h, r = shapes("cpu")
    down_inject = torch.zeros(1, r + STREAMS)
    g, w = hc_triton.gates(down_inject, r, STREAMS)
    assert torch.equal(g, torch.zeros(1, r)) and torch.equal(w, torch.ones(1, STREAMS))
    xn = torch.arange(STREAMS * h, dtype=torch.float32)[None] / 1024
    want = sum(xn.view(STREAMS, h)[s] / 2 for s in range(STREAMS)) / STREAMS
    torch.testing.assert_close(hc_triton.mix_mean(torch.zeros_like(xn), xn, STREAMS)[0], want, rtol=1e-6, atol=0)
    x = torch.randn(1, STREAMS * h)
    assert torch.equal(hc_triton.inject(x, torch.ones(1, h), w)[0], x + 1)


class _Launches(TorchDispatchMode):
    """Records the Triton launches (under the interpreter) and every torch op that computes something
    (not a view or an allocation) outside them."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.kernels: list[str] = []
        self.torch_ops: list[str] = []
        self._inside = 0
        run = interpreter.InterpretedFunction.run

        def counted_run(fn, *args, **kwargs):
            self.kernels.append(fn.fn.__name__)
            self._inside += 1
            try:
                return run(fn, *args, **kwargs)
            finally:
                self._inside -= 1

        monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted_run)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._inside and not func.is_view and not name.startswith(("empty", "new_empty")):
            self.torch_ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not INTERPRET, reason="counts the interpreter's launches")
def test_a_hyper_connection_and_its_injection_are_five_launches(monkeypatch):
    """On the Triton path a hyper-connection whose normed input the previous launch wrote, and the
    injection of its block's output with the next norm, run as: the merged down/inject linear, the
    gates, W_up, the mean, the injection; no torch op computes anything between them."""
    monkeypatch.setattr(freetoken.kernels, "MODE", "triton")
    h, r = shapes("cpu")
    gen = torch.Generator().manual_seed(2)
    hc, next_norm = GatedResidual(h, STREAMS, r, EPS), GroupedZCRMSNorm(STREAMS * h, h, EPS)
    for p in (*hc.parameters(), *next_norm.parameters()):
        p.data = 0.1 * torch.randn(p.shape, generator=gen)
    x, y = torch.randn(2, STREAMS * h, generator=gen), torch.randn(2, h, generator=gen)
    xn = hc.hc_norm(x)
    hc(x, xn)  # merges the projections and sizes the linears' workspaces
    with _Launches(monkeypatch) as launches:
        u, weights = hc(x, xn)
        inject(x, y, weights, next_norm)
    assert launches.kernels == ["_linear_kernel", "_gates_kernel", "_linear_kernel", "_mix_mean_kernel", "_inject_kernel"]
    assert launches.torch_ops == []
