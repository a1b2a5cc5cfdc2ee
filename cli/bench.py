"""`freetoken bench [MODEL | --shape qwen3.5-9b]`: decode speed next to the memory-bandwidth floor.

Without MODEL the model is a random-weight model of a real shape (no download); with MODEL it is
that checkpoint (unified, HF or GGUF), so `--spec mtp` measures its own MTP head's acceptance. With
`--tensor-parallel N` every batch size runs on N worker processes; rank 0's timings are reported and
written.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from freetoken.cli._options import (
    DeviceOpt, DType, DTypeOpt, ExpertCacheGbOpt, ExpertOffload, ExpertOffloadOpt, ExpertPlacementOpt, GpuExpertsOpt, MemFractionOpt, TensorParallelOpt, console,
)


def bench(
    model: Annotated[Optional[str], typer.Argument(metavar="MODEL", help="Checkpoint to benchmark (unified, HF or GGUF); omit for a random-weight model of --shape.", show_default=False)] = None,
    shape: Annotated[Optional[str], typer.Option("--shape", show_default=False, help=(
        "qwen3.5-9b (default without MODEL) | qwen3.5-35b-a3b | qwen3.8-flash-next | tiny | qwen3.8-flash-next-tiny"))] = None,
    layers: Annotated[Optional[int], typer.Option("--layers", show_default=False, help=(
        "--shape only: keep the first N decoder layers of the shape's layer pattern (the MTP head is kept); the JSON also gives the floor at full depth."))] = None,
    batch_size: Annotated[list[int], typer.Option("--batch-size", "-b", min=1, help="Batch sizes (repeatable).")] = [1],  # noqa: B006
    prompt_len: Annotated[int, typer.Option("--prompt-len", min=1)] = 512,
    new_tokens: Annotated[int, typer.Option("--new-tokens", min=1)] = 64,
    spec: Annotated[str, typer.Option("--spec", help=(
        "none | mtp | oracle (drafts replay the known greedy continuation) | "
        "dflash-oracle (a random DFlash draft of a published shape runs in full, the oracle's drafts are proposed)"))] = "none",
    num_draft_tokens: Annotated[int, typer.Option("--num-draft-tokens", "-k", min=0)] = 0,
    corrupt_rate: Annotated[list[float], typer.Option("--corrupt-rate", help="Oracle drafts: chance each draft is wrong (repeatable).")] = [0.0],  # noqa: B006
    device: DeviceOpt = "cuda",
    dtype: DTypeOpt = DType.bfloat16,
    out: Annotated[Optional[Path], typer.Option("--out", help="JSON results file (default bench/results/<shape>-<spec>.json).")] = None,
    tensor_parallel: TensorParallelOpt = 1,
    cuda_graphs: Annotated[bool, typer.Option("--cuda-graphs/--no-cuda-graphs", help="Replay decode and verify steps as CUDA graphs (CUDA, Triton path).")] = True,
    mem_fraction: MemFractionOpt = 0.0,
    expert_offload: ExpertOffloadOpt = ExpertOffload.none,
    expert_cache_gb: ExpertCacheGbOpt = None,
    gpu_experts: GpuExpertsOpt = None,
    expert_placement: ExpertPlacementOpt = None,
) -> None:
    """Benchmark decode on a checkpoint or a random-weight model of a real shape; reports the bandwidth floor."""
    from rich.table import Table

    from freetoken.bench import H200_COPY_BANDWIDTH, run_bench, write_results
    from freetoken.bench_shapes import check_shape_options
    from freetoken.errors import FreetokenError
    from freetoken.layers.offload_config import ExpertOffloadConfig

    if model is not None and shape is not None:
        raise FreetokenError("give MODEL or --shape, not both")
    if model is None:
        shape = shape or "qwen3.5-9b"
    elif tensor_parallel > 1:
        from freetoken.llm import resolve_checkpoint

        model = str(resolve_checkpoint(model))  # converted once, before the workers start
    if model is not None and layers is not None:
        raise FreetokenError("--layers cuts a random-weight --shape, not a checkpoint")
    if spec not in ("none", "mtp", "oracle", "dflash-oracle"):
        raise FreetokenError(f"unknown --spec {spec!r} (none, mtp, oracle, dflash-oracle)")
    if spec == "dflash-oracle" and model is not None:
        raise FreetokenError("--spec dflash-oracle runs a random draft of --shape's published DFlash shape: give --shape, not MODEL")
    if spec != "none" and num_draft_tokens < 1:
        raise FreetokenError(f"--spec {spec} needs --num-draft-tokens >= 1")
    if model is None:
        check_shape_options(shape, spec=spec, layers=layers, tensor_parallel=tensor_parallel)
    kwargs = dict(model=model, prompt_len=prompt_len, new_tokens=new_tokens, spec=spec, num_draft_tokens=num_draft_tokens,
                  corrupt_rates=tuple(corrupt_rate), device=device, dtype=dtype.value, cuda_graphs=cuda_graphs, mem_fraction=mem_fraction,
                  expert_offload=ExpertOffloadConfig.from_options(expert_offload.value, expert_cache_gb, gpu_experts, expert_placement), layers=layers)
    if tensor_parallel == 1:
        results = [r for b in batch_size for r in run_bench(shape, batch_size=b, **kwargs)]
    else:
        from freetoken.distributed.launch import launch

        results = launch(bench_rank, tensor_parallel, shape, list(batch_size), kwargs, device=device)[0]
    tp = f", tensor-parallel {tensor_parallel}" if tensor_parallel > 1 else ""
    label = results[0].shape  # the shape, or the checkpoint's name
    table = Table(title=f"freetoken bench {label} ({dtype.value}, {device}{tp})")
    for col in ("batch", "spec", "decode tok/s", "step ms", "floor step ms", "fraction of floor", "accept/pos", "tok/step", "speedup", "step cost", "forward ms", "forward cost"):
        table.add_column(col)
    for r in results:
        name = f"{r.spec} k={r.num_draft_tokens}" + (f" corrupt={r.corrupt_rate:g}" if r.corrupt_rate is not None else "")
        table.add_row(str(r.batch_size), name, f"{r.decode_tokens_per_s:.1f}", f"{r.step_ms:.2f}", f"{r.floor_step_ms:.2f}",
                      f"{r.fraction_of_floor:.1%}", _acceptance(r.acceptance_per_position), f"{r.mean_accepted_len:.2f}",
                      f"{r.speedup_vs_no_spec:.2f}x" if r.speedup_vs_no_spec else "-", f"{r.step_cost_vs_decode:.2f}x" if r.step_cost_vs_decode else "-",
                      f"{r.forward_ms:.2f}" if r.forward_ms else "-", f"{r.forward_cost_vs_decode:.2f}x" if r.forward_cost_vs_decode else "-")
    console.print(table)
    first = results[0]
    if first.resident_weight_bytes is not None:
        console.print(f"weights: {first.resident_weight_bytes / 2**30:.2f} GiB resident on {device}, "
                      f"{first.offloaded_weight_bytes / 2**30:.2f} GiB of experts in host memory (expert offload: {first.expert_offload})")
    if first.layers is not None and first.layers < first.full_depth_layers:
        console.print(f"first {first.layers} of {first.full_depth_layers} layers; floor at full depth (batch {first.batch_size}): "
                      f"{1000 * first.floor_bytes_full_depth / H200_COPY_BANDWIDTH:.2f} ms per step")
    if first.ple_table_rows is not None and first.ple_table_rows != first.ple_table_rows_full:
        console.print(f"n-gram table: {first.ple_table_rows:,} rows per PLE layer (real: {first.ple_table_rows_full:,}); a lookup reads one row per head and token either way")
    depth = f"-{layers}layers" if layers is not None else ""
    path = out or Path("bench/results") / f"{label}{depth}-{spec}.json"
    write_results(path, "freetoken " + " ".join(sys.argv[1:]), results)
    console.print(f"wrote {path}")


def _acceptance(per_position: list[float]) -> str:
    """Acceptance per draft position for the table: all of them up to 4, else the first 3 and the last."""
    shown = [f"{a:.2f}" for a in per_position]
    return " ".join(shown if len(shown) <= 4 else shown[:3] + ["..", shown[-1]]) or "-"


def bench_rank(parallel, shape: str | None, batch_sizes: list[int], kwargs: dict) -> list:
    """One rank's share of the benchmark: every rank runs every batch size in step."""
    from freetoken.bench import run_bench

    return [r for b in batch_sizes for r in run_bench(shape, batch_size=b, parallel=parallel, **kwargs)]
