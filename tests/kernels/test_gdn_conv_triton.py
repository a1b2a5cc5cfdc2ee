"""The conv-fused GDN kernel against its two-launch twin (causal_conv1d, then gdn_fused: bit for bit,
outputs, conv_out and both pools) and against the torch references (within tolerance); the
per-key-head counters are back at zero after every launch.
"""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels.conftest import DEVICES, INTERPRET  # noqa: E402
from tests.kernels.test_gdn_triton import make_batch  # noqa: E402

from freetoken.kernels import batched, conv_triton, gdn_conv_triton, gdn_triton  # noqa: E402
from freetoken.kernels.gdn_ref import recurrence_inputs  # noqa: E402


def shapes(device):
    # Hk, Hv (rep 2), Dk, Dv (several v blocks, the last one partial on CPU), K
    return (2, 4, 16, 40, 4) if device == "cpu" else (16, 32, 128, 128, 4)


def layer_inputs(n, hk, hv, dk, dv, kw, num_slots, device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    c = 2 * hk * dk + hv * dv
    windows = torch.randn(num_slots, kw - 1, c, generator=gen).to(dtype).to(device)
    rows = torch.randn(n, c, generator=gen).to(dtype).to(device)
    weight = (torch.randn(c, 1, kw, generator=gen) * 0.5).to(dtype).to(device)[:, 0, :]  # the layer's strided view
    state = (torch.randn(num_slots, hv, dk, dv, generator=gen) * 0.1).to(device)
    a = (torch.randn(n, hv, generator=gen) * 3).to(dtype).to(device)
    b = torch.randn(n, hv, generator=gen).to(dtype).to(device)
    a_log = torch.randn(hv, generator=gen).to(device)
    dt_bias = torch.randn(hv, generator=gen).to(device)
    return windows, rows, weight, state, a, b, a_log, dt_bias


def two_launches(windows, rows, weight, state, a, b, a_log, dt_bias, hk, batch, write_state, out_dtype):
    conv_out = conv_triton.causal_conv1d(windows, rows, weight, batch, write_state)
    out = gdn_triton.gdn_fused(state, conv_out, a, b, a_log, dt_bias, hk, batch, write_state, out_dtype=out_dtype)
    return out, conv_out


def check_against_two_launches(device, dtype, num_rows, slots, write_state, seed=0):
    hk, hv, dk, dv, kw = shapes(device)
    batch = make_batch(num_rows, slots, device)
    windows, rows, weight, state, a, b, a_log, dt_bias = layer_inputs(sum(num_rows), hk, hv, dk, dv, kw, max(slots) + 2, device, dtype, seed)
    want_w, want_s = windows.clone(), state.clone()
    want, want_conv = two_launches(want_w, rows, weight, want_s, a, b, a_log, dt_bias, hk, batch, write_state, dtype)
    got_w, got_s = windows.clone(), state.clone()
    got, got_conv = gdn_conv_triton.gdn_conv_fused(got_w, rows, weight, got_s, a, b, a_log, dt_bias, hk, batch, write_state, return_conv_out=True, out_dtype=dtype)
    assert torch.equal(got, want)
    assert torch.equal(got_conv, want_conv)
    assert torch.equal(got_s, want_s)
    assert torch.equal(got_w, want_w)
    if not write_state:
        assert torch.equal(got_s, state) and torch.equal(got_w, windows)
    assert not gdn_conv_triton._key_head_counters(torch.device(device)).any()
    no_conv, none = gdn_conv_triton.gdn_conv_fused(windows.clone(), rows, weight, state.clone(), a, b, a_log, dt_bias, hk, batch, write_state, out_dtype=dtype)
    assert none is None and torch.equal(no_conv, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("write_state", [True, False])
def test_verify_rows_equal_two_launches(device, dtype, write_state):
    """k+1 = 4 rows a sequence (more than K-1: the new window comes from the rows alone), one sequence with none."""
    check_against_two_launches(device, dtype, [4, 4, 0, 4], [3, 0, 1, 2], write_state)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_and_short_rows_equal_two_launches(device, dtype):
    """1 and 2 rows (fewer than K-1: the new window keeps part of the old one), in one batch."""
    check_against_two_launches(device, dtype, [1, 2, 1], [2, 0, 1], True, seed=1)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_steps_then_verify_match_the_references(device):
    """Three decode steps (state written), then a verify block: outputs, conv_out and pools against
    the torch references within tolerance."""
    hk, hv, dk, dv, kw = shapes(device)
    slots = [1, 0]
    windows, rows, weight, state, a, b, a_log, dt_bias = layer_inputs(10, hk, hv, dk, dv, kw, 2, device, torch.float32, 2)
    ref_w, ref_s = windows.clone(), state.clone()
    for step in range(3):
        idx = torch.tensor([step, 3 + step], device=device)
        batch = make_batch([1, 1], slots, device)
        got, conv_out = gdn_conv_triton.gdn_conv_fused(windows, rows[idx], weight, state, a[idx], b[idx], a_log, dt_bias, hk, batch, return_conv_out=True)
        want_conv = batched.causal_conv1d_batched(ref_w, rows[idx], weight, batch)
        want = batched.gdn_recurrent_batched(ref_s, *recurrence_inputs(want_conv, a[idx], b[idx], a_log, dt_bias, hk, dk, dv), batch)
        torch.testing.assert_close(conv_out, want_conv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(windows, ref_w, rtol=0, atol=0)
    torch.testing.assert_close(state, ref_s, rtol=2e-5, atol=2e-5)
    batch = make_batch([2, 2], slots, device)
    tail = torch.arange(6, 10, device=device)
    got, conv_out = gdn_conv_triton.gdn_conv_fused(windows, rows[tail], weight, state, a[tail], b[tail], a_log, dt_bias, hk, batch, write_state=False, return_conv_out=True)
    want_conv = batched.causal_conv1d_batched(ref_w, rows[tail], weight, batch, write_state=False)
    want = batched.gdn_recurrent_batched(ref_s, *recurrence_inputs(want_conv, a[tail], b[tail], a_log, dt_bias, hk, dk, dv), batch, write_state=False)
    torch.testing.assert_close(conv_out, want_conv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")
def test_launches_are_cut_at_the_counter_bound(monkeypatch):
    """More (sequence, key head) pairs than MAX_COUNTERS: several launches, the same bits."""
    monkeypatch.setattr(gdn_conv_triton, "MAX_COUNTERS", 2 * shapes("cpu")[0])  # two sequences a launch
    check_against_two_launches("cpu", torch.bfloat16, [1, 3, 2, 1, 4], [4, 2, 0, 1, 3], True, seed=3)



_SM90_REDUCTIONS = """
import re
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from freetoken.kernels import gdn_conv_triton, gdn_triton

FP32 = {"state_ptr", "a_log_ptr", "dt_bias_ptr", "scale"}
I32 = {"count_ptr", "starts_ptr", "counts_ptr", "slots_ptr"}
CONSTS = {"KW": 4, "BLOCK_W": 4, "BLOCK_K": 128, "BLOCK_V": 32, "OPAQUE": False, "PDL": True}

def reductions(fn):
    sig = {}
    for p in fn.params:
        n = p.name
        ptr = n.endswith("_ptr")
        sig[n] = "constexpr" if p.is_constexpr else ("*" if ptr else "") + ("fp32" if n in FP32 else "i32" if n in I32 or not ptr else "bf16")
    names = list(sig)
    consts = {(names.index(n),): v for n, v in CONSTS.items() if n in sig}
    ir = compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 64), options={"num_warps": 4, "launch_pdl": True}).asm["ttgir"]
    layouts = dict(re.findall(r"^(#\\w+) = (.*)$", ir, re.M))
    return [layouts[m] for m in re.findall(r"^\\s*}\\) : \\(tensor<[^,]*, (#\\w+)>\\) ->", ir, re.M)]

two, fused = reductions(gdn_triton._gdn_fused_kernel), reductions(gdn_conv_triton._gdn_conv_kernel)
print(len(two), two == fused)
"""


def test_sm90_build_reduces_over_the_two_launch_kernels_layouts():
    """Compile (no GPU needed; a process outside the interpreter) both recurrences for sm_90 at
    Dk = 128, BLOCK_V = 32 in bf16: the l2 norms of q and k, S^T k and S^T q reduce over the same
    layouts, so in the same order. The interpreter cannot see this."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, "-c", _SM90_REDUCTIONS], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["4", "True"]
