"""L2 prefetch programs (kernels/l2_prefetch.py): they wait before they prefetch, they move no value.

On the CPU: the sm_90 build of a launch with prefetch programs queues `prefetch.global.L2` only after
its grid-dependency wait, and the spans are off where they cannot apply. On CUDA: every launch that
takes a prefetch gives the same bits with and without it (a model step is checked the same way by
bench/variants.py, whose same_tokens compares the variants' tokens).
"""

from __future__ import annotations

import json

import pytest
import torch

from freetoken.kernels import l2_prefetch
from tests.kernels import sm90_build
from tests.kernels.conftest import INTERPRET

_BUILD = """
import json, sys
from freetoken.kernels import gdn_triton, norm_triton
from tests.kernels import sm90_build

def ptx(kernel, pointers, ints, constants, floats=()):
    signature = dict(pointers) | {name: "i32" for name in ints} | {name: "fp32" for name in floats} | {name: "constexpr" for name in constants}
    return sm90_build.ptx(kernel, signature, constants, {"num_warps": 4, "launch_pdl": True})

pf = {"pf_ptr": "*u8"}
built = {
    "add_zc_rms_norm": ptx(norm_triton._add_zc_rms_norm_kernel, {n: "*bf16" for n in ("x_ptr", "r_ptr", "w_ptr", "sum_ptr", "y_ptr")} | pf,
                           ("D", "stride_x", "stride_xs", "stride_r", "stride_s", "stride_y", "pf_lines", "num_rows"),
                           dict(X_SPLIT=0, BLOCK_D=2048, PREFETCH=True, PDL=True), floats=("eps",)),
    "gdn_fused": ptx(gdn_triton._gdn_fused_kernel,
                     {"state_ptr": "*fp32", "x_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "a_log_ptr": "*fp32", "dt_bias_ptr": "*fp32",
                      "o_ptr": "*bf16", "starts_ptr": "*i32", "counts_ptr": "*i32", "slots_ptr": "*i32"} | pf,
                     ("Dk", "Dv", "key_dim", "rep", "write_state", "write_output", "s_slot", "s_head", "s_k", "x_row", "a_row", "b_row",
                      "o_row", "o_head", "pf_lines", "num_seqs"),
                     dict(BLOCK_K=128, BLOCK_V=32, PREFETCH=True, PDL=True), floats=("scale",)),
}
json.dump(built, sys.stdout)
"""


@pytest.fixture(scope="module")
def builds():
    return json.loads(sm90_build.run(_BUILD))


@pytest.mark.parametrize("kernel", ["add_zc_rms_norm", "gdn_fused"])
def test_prefetch_programs_wait_before_they_prefetch_in_the_sm90_build(builds, kernel):
    ptx = builds[kernel]
    first_prefetch = ptx.find("prefetch.global.L2 ")
    assert first_prefetch != -1, "no L2 prefetch in the build"
    assert -1 < ptx.find("griddepcontrol.wait") < first_prefetch
    assert ptx.count("griddepcontrol.wait") == 2  # the prefetch programs' and the launch's own programs'


def test_spans_are_off_where_they_cannot_apply(monkeypatch):
    weight = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert l2_prefetch.span(weight, 1, 1 << 20) is None  # a CPU tensor: no L2 to fill
    assert l2_prefetch.span(None, 1, 1 << 20) is None
    span = l2_prefetch.Span(weight.view(-1).view(torch.uint8), 64)
    assert l2_prefetch.launch_args(span, 128, weight)[0] == 1
    assert l2_prefetch.launch_args(span, 1, weight)[0] == l2_prefetch.PROGRAMS
    assert l2_prefetch.launch_args(None, 1, weight) == (0, {"pf_ptr": weight, "pf_lines": 0, "PREFETCH": False})
    monkeypatch.setattr(l2_prefetch, "INPUT_BYTES", 0)
    assert l2_prefetch.site_bytes("input") == 0
    with pytest.raises(KeyError):
        l2_prefetch.site_bytes("lm_head")


def _weight_span(nbytes: int = 1 << 20) -> l2_prefetch.Span:
    weight = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    span = l2_prefetch.span(weight, 1, nbytes)
    assert span is not None and span.num_lines == nbytes // l2_prefetch.LINE
    return span


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("split", [False, True])
def test_add_norm_gives_the_same_bits_with_the_prefetch(rows, split):
    from freetoken import kernels
    from freetoken.kernels import linear_triton

    torch.manual_seed(0)
    hidden = 2048
    residual = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16) * 0.1
    if split:
        x = linear_triton.PendingSplitK(torch.randn(4, rows, hidden, device="cuda"), torch.bfloat16)
    else:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    want = kernels.add_zc_rms_norm(x, residual, weight, 1e-6)
    got = kernels.add_zc_rms_norm(x, residual, weight, 1e-6, _weight_span())
    assert all(torch.equal(a, b) for a, b in zip(want, got))
