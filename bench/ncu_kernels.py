"""Kernels of the 35B-A3B decode step in isolation, for Nsight Compute: the MoE experts at one token
(the shared expert stacked, direct layout) and the GDN in- and out-projections, four times each.

    ncu -k regex:"_gate_up_kernel|_down_kernel|_linear_kernel" --launch-skip 8 --launch-count 4 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
        --section WarpStateStats --section SchedulerStats python3 bench/ncu_kernels.py

(GPU only; the third round's four kernels, after two rounds of compiling and warming up.)
"""

import torch

from freetoken.kernels import linear_triton as lt
from freetoken.kernels import moe_route_triton as mr
from freetoken.kernels import moe_triton as mt

torch.manual_seed(0)
H, E, K, I = 2048, 256, 8, 512
gate_up = torch.randn(E + 1, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
down = torch.randn(E + 1, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
w_in = torch.randn(12352, H, device="cuda", dtype=torch.bfloat16) * 0.02
w_out = torch.randn(H, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
o = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
g = torch.randn(1, 1, device="cuda", dtype=torch.bfloat16)
for _ in range(4):
    experts, weights, blocks = mr.route(torch.randn(1, E, device="cuda"), K, torch.bfloat16, with_shared=True)  # new experts each round
    mt.moe_experts_with_shared(x, experts, weights, gate_up, down, g, blocks)
    lt.linear(x, w_in)
    lt.linear(o, w_out)
torch.cuda.synchronize()
