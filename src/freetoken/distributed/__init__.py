"""Tensor parallelism across processes: torch.distributed with gloo on CPU and NCCL on CUDA.

Layout: `context.py` (ParallelContext: rank, world size, group and the fixed-order collectives),
`sharding.py` (which slice of a checkpoint tensor a rank holds), `launch.py` (spawn N workers on
127.0.0.1, propagate a failure, time out). With one process none of this touches torch.distributed.
"""

from freetoken.distributed.context import SINGLE, ParallelContext
from freetoken.distributed.sharding import ShardSpec

__all__ = ["SINGLE", "ParallelContext", "ShardSpec"]
