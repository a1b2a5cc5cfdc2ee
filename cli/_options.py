"""Options shared by several commands, as Annotated aliases, and the rich console."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

console = Console(stderr=True)


class Spec(str, Enum):
    none = "none"
    mtp = "mtp"
    dflash = "dflash"


class ExpertOffload(str, Enum):
    none = "none"
    cache = "cache"
    hybrid = "hybrid"


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


ModelArg = Annotated[Optional[str], typer.Argument(help="Unified checkpoint, HF checkpoint (dir or cached repo id) or GGUF file; omit for the embedded default model.", show_default=False)]
PromptOpt = Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="A prompt (repeatable).")]
PromptsFileOpt = Annotated[Optional[Path], typer.Option("--prompts", help="Prompts file: .jsonl ({\"prompt\": ..., \"images\": [paths]} per line; <image> marks where an image goes, else images lead) or .txt (one per line).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda or cuda:N.")]
DTypeOpt = Annotated[DType, typer.Option("--dtype", help="Compute dtype.")]
MaxNewTokensOpt = Annotated[int, typer.Option("--max-new-tokens", "-n", min=1, help="Tokens to generate per prompt.")]
NumDraftOpt = Annotated[int, typer.Option("--num-draft-tokens", "-k", min=1, help="Drafts per verify step (k).")]
BatchSizeOpt = Annotated[int, typer.Option("--batch-size", min=1, help="Requests running at once.")]
ThreadsOpt = Annotated[int, typer.Option("--threads", min=1, help="CPU threads for torch (1 is fastest for small models).")]
TensorParallelOpt = Annotated[int, typer.Option("--tensor-parallel", min=1, help="Processes sharing the model (one per GPU; gloo on CPU, NCCL on CUDA). Only rank 0 writes.")]
MemFractionOpt = Annotated[float, typer.Option("--mem-fraction", min=0.0, max=0.99, help="CUDA: share of free GPU memory for the KV pool (0 = size it for --batch-size requests of the longest length).")]
ExpertOffloadOpt = Annotated[ExpertOffload, typer.Option("--expert-offload", help=(
    "MoE routed experts: none (all on the device; CUDA graphs), cache (in host memory, a device cache of "
    "--expert-cache-gb; outputs bit-identical to none) or hybrid (--gpu-experts per layer on the device, the rest "
    "computed on the CPU; bits may differ from none on a GPU, spec decoding stays exact). Both offload modes run eagerly."))]
ExpertCacheGbOpt = Annotated[Optional[float], typer.Option("--expert-cache-gb", help="--expert-offload cache: device memory for the expert slots of all MoE layers (GiB).", show_default=False)]
ExpertPlacementOpt = Annotated[Optional[str], typer.Option("--expert-placement", help="--expert-offload hybrid: a JSON file of the expert ids each MoE layer keeps on the device (freetoken experts-profile writes one); it gives the count, so leave out --gpu-experts.", show_default=False)]
GpuExpertsOpt = Annotated[Optional[str], typer.Option("--gpu-experts", help="--expert-offload hybrid: experts per layer kept on the device, a count (64) or a fraction (0.25, 25%); the first ones by id.", show_default=False)]
