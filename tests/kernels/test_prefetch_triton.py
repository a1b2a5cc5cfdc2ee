"""The L2 prefetch of an output projection's weight on a side stream (kernels/prefetch_triton.py).

On the CPU: a no-op for CPU rows (no side stream, nothing pending), and the kernel's sm_90 build
queues `prefetch.global.L2::evict_last` per line under a predicate. On CUDA: a captured step that
forks the prefetch and joins it at the end replays with the same result as eager, and the layers'
decode rows prefetch while prefill rows do not.
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tests.kernels import sm90_build  # noqa: E402
from tests.kernels.conftest import INTERPRET  # noqa: E402

from freetoken import kernels  # noqa: E402
from freetoken.kernels import prefetch_triton  # noqa: E402


def test_cpu_rows_prefetch_nothing():
    kernels.prefetch_l2(torch.randn(8, 8), torch.randn(1, 8))
    assert not prefetch_triton._pending and not prefetch_triton._side_streams


def test_prefetch_kernel_queues_l2_line_prefetches_in_the_sm90_build():
    ptx = sm90_build.run(
        """
from freetoken.kernels import prefetch_triton as p
from tests.kernels.sm90_build import ptx
print(ptx(p._prefetch_kernel, {"base_ptr": "*u8", "num_lines": "i32", "LINES_PER_PROGRAM": "constexpr", "BLOCK": "constexpr"},
          {"LINES_PER_PROGRAM": p.BYTES_PER_PROGRAM // p.LINE, "BLOCK": p.BLOCK_LINES}, {"num_warps": 4}, ("base_ptr",)))
"""
    )
    assert "prefetch.global.L2::evict_last" in ptx and "@p prefetch" in ptx
    assert "ld.global" not in ptx and "st.global" not in ptx


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA and TRITON_INTERPRET=0")
def test_prefetch_forks_and_joins_inside_a_cuda_graph():
    w = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)

    def step():
        kernels.prefetch_l2(w, x)
        return kernels.linear(x, w)

    step()  # compile outside the capture
    kernels.join_prefetches()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
        kernels.join_prefetches()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, kernels.linear(x, w))
    assert not prefetch_triton._pending
    assert prefetch_triton.applies(x) and not prefetch_triton.applies(torch.empty(prefetch_triton.MAX_ROWS + 1, 1, device="cuda"))
