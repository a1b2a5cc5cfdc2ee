"""`freetoken generate [MODEL]`: offline batch generation with progress and a summary table.

The command parses its options into a `GenerateJob` and runs `run_job` in this process, or, with
`--tensor-parallel N`, on N worker processes (freetoken.distributed.launch), each holding a shard of
the model and producing the same tokens; only rank 0 shows progress and writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from freetoken.cli._options import (
    BatchSizeOpt, DeviceOpt, DType, DTypeOpt, ExpertCacheGbOpt, ExpertOffload, ExpertOffloadOpt, ExpertPlacementOpt, GpuExpertsOpt, MaxNewTokensOpt, MemFractionOpt, ModelArg,
    PromptOpt, PromptsFileOpt, Spec, TensorParallelOpt, ThreadsOpt, console,
)

# Measured on the embedded model (CPU: k=1 54.7 vs k=3 50.4 tokens/s; GPU batch 50: k=1 1437, k=2 900,
# k=3 853, k=4 1003 tokens/s): one draft is the fastest setting there.
DEFAULT_NUM_DRAFT_TOKENS = 1
PREFIX_CACHE_HELP = ("Reuse the KV pages and linear-attention state of prompt prefixes shared within the batch "
                     "(exact on CPU; not yet checked on a GPU, so off by default).")
DEFAULT_PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_files(path):", "class Stack:\n    def __init__(self):"]


def generate(
    model: ModelArg = None,
    prompt: PromptOpt = None,
    prompts: PromptsFileOpt = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write completions as JSONL here.")] = None,
    spec: Annotated[Spec, typer.Option("--spec", help="Speculative decoding method.")] = Spec.none,
    num_draft_tokens: Annotated[Optional[int], typer.Option("--num-draft-tokens", "-k", min=1, help="Drafts per verify step (default 1 with --spec mtp: the fastest k measured on the embedded model, bench/results/embedded-*.json; with --spec dflash the draft's block size - 1).")] = None,
    max_new_tokens: MaxNewTokensOpt = 64,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0)] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", min=0, help="0 = off.")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0)] = 1.0,
    presence_penalty: Annotated[float, typer.Option("--presence-penalty")] = 0.0,
    frequency_penalty: Annotated[float, typer.Option("--frequency-penalty")] = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="Run seed; each request draws from its own stream.")] = 0,
    batch_size: BatchSizeOpt = 16,
    device: DeviceOpt = "cpu",
    dtype: DTypeOpt = DType.float32,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each prompt in the checkpoint's chat template.")] = False,
    threads: ThreadsOpt = 1,
    mem_fraction: MemFractionOpt = 0.0,
    stats_json: Annotated[Optional[Path], typer.Option("--stats-json", help="Write the run statistics (with command, commit, date) as JSON here.")] = None,
    tensor_parallel: TensorParallelOpt = 1,
    expert_offload: ExpertOffloadOpt = ExpertOffload.none,
    expert_cache_gb: ExpertCacheGbOpt = None,
    gpu_experts: GpuExpertsOpt = None,
    expert_placement: ExpertPlacementOpt = None,
    prefix_cache: Annotated[bool, typer.Option("--prefix-cache/--no-prefix-cache", help=PREFIX_CACHE_HELP)] = False,
) -> None:
    """Generate completions for a batch of prompts."""
    from freetoken.cli.prompts import read_images, read_prompts_with_images
    from freetoken.engine.config import EngineConfig
    from freetoken.layers.offload_config import ExpertOffloadConfig

    offload = ExpertOffloadConfig.from_options(expert_offload.value, expert_cache_gb, gpu_experts, expert_placement)
    texts, image_paths = read_prompts_with_images(prompt, prompts, default=DEFAULT_PROMPTS)
    images = read_images(image_paths) if any(image_paths) else None  # a bad image fails here, before torch loads
    from freetoken.sampling import SamplingParams
    k = {Spec.mtp: num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS, Spec.dflash: num_draft_tokens or 0}.get(spec, 0)  # dflash 0: the LLM takes block size - 1
    if spec is Spec.none and num_draft_tokens:
        from freetoken.errors import FreetokenError

        raise FreetokenError("--num-draft-tokens needs a spec method (--spec mtp or dflash)")
    config = EngineConfig(device=device, dtype=dtype.value, max_num_seqs=batch_size, mem_fraction=mem_fraction, spec=spec.value, num_draft_tokens=k, seed=seed,
                          max_model_len=8192, tensor_parallel=tensor_parallel, expert_offload=offload, prefix_cache=prefix_cache)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)
    run_parallel(run_job, GenerateJob(model, texts, config, params, chat, out, stats_json, threads, images))


@dataclass(frozen=True)
class GenerateJob:
    model: str | None
    texts: list[str]
    config: Any  # EngineConfig
    params: Any  # SamplingParams
    chat: bool
    out: Path | None
    stats_json: Path | None
    threads: int
    images: list[list[Any]] | None = None  # per prompt, its decoded PIL images (JSONL "images"); None: no prompt has any


def run_parallel(fn, job) -> list:
    """fn(ParallelContext, job) here, or on job.config.tensor_parallel workers -> per-rank results.

    The checkpoint is resolved (an HF or GGUF source converted into the cache) once, before any
    worker starts, so ranks never convert concurrently.
    """
    import dataclasses

    from freetoken.distributed import SINGLE

    n = job.config.tensor_parallel
    if n == 1:
        return [fn(SINGLE, job)]
    from freetoken.distributed.launch import launch
    from freetoken.llm import resolve_checkpoint

    job = dataclasses.replace(job, model=str(resolve_checkpoint(job.model)))
    return launch(fn, n, job, device=job.config.device)


def run_job(parallel, job: GenerateJob) -> None:
    """One rank's share of `freetoken generate`: every rank generates, rank 0 reports and writes."""
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from freetoken.llm import LLM

    from freetoken.models.expert_offload import describe_weight_memory

    torch.set_num_threads(job.threads)
    llm = LLM(job.model, job.config, parallel=parallel)
    lead = parallel.rank == 0
    if lead:
        console.print(describe_weight_memory(llm.model))
    with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True, disable=not lead) as bar:
        task = bar.add_task("generate", total=len(job.texts))
        completions, stats = llm.generate(job.texts, job.params, chat=job.chat, on_step=lambda done: bar.advance(task, len(done)), images=job.images)
    if not lead:
        return
    if job.out is not None:
        _write_jsonl(job.out, completions)
    else:
        for c in completions:
            typer.echo(json.dumps({"prompt": c.prompt, "completion": c.text}, ensure_ascii=False))
    console.print(summary_table(stats))
    if job.stats_json is not None:
        _write_stats(job.stats_json, stats, llm, job.config)


def _write_stats(path: Path, stats, llm, config) -> None:
    import dataclasses
    import sys

    from freetoken.bench import environment
    from freetoken.models.expert_offload import weight_memory

    record = {"command": "freetoken " + " ".join(sys.argv[1:]), **environment(), "model": str(llm.path),
              "config": dataclasses.asdict(config), "stats": dataclasses.asdict(stats), "tokens_per_second": stats.tokens_per_second,
              "weight_memory": dataclasses.asdict(weight_memory(llm.model))}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def _write_jsonl(path: Path, completions) -> None:
    """Write atomically: a failed run leaves no half-written file."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for c in completions:
            record = {
                "prompt": c.prompt,
                "completion": c.text,
                "prompt_tokens": len(c.prompt_token_ids),
                "completion_tokens": len(c.token_ids),
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
            }
            if c.accepted_lens:
                record["accepted_lens"] = c.accepted_lens
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    tmp.replace(path)


def summary_table(stats):
    from rich.table import Table

    table = Table(title="freetoken generate", show_header=False)
    table.add_row("requests", str(stats.num_requests))
    table.add_row("prompt tokens", str(stats.prompt_tokens))
    table.add_row("generated tokens", str(stats.generated_tokens))
    table.add_row("wall time", f"{stats.seconds:.2f} s")
    table.add_row("generated tokens/s", f"{stats.tokens_per_second:.1f}")
    table.add_row("target steps", str(stats.decode_steps))
    if stats.num_preemptions:
        table.add_row("preemptions", str(stats.num_preemptions))
    if stats.prefix_cache_hits:
        share = f"{stats.prefix_cache_hit_rate:.1%} of prefill, {stats.prefix_cache_hits} hits"
        table.add_row("cached prompt tokens", f"{stats.cached_prompt_tokens} ({share})")
    if stats.num_draft_tokens:
        table.add_row("draft tokens (k)", str(stats.num_draft_tokens))
        table.add_row("acceptance per position", "  ".join(f"{a:.3f}" for a in stats.acceptance_per_position))
        table.add_row("mean accepted length", f"{stats.mean_accepted_len:.3f} tokens / target step")
    return table
