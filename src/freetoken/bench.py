"""Decode benchmarks on random-weight models of real shapes (no download needed), or on a checkpoint.

`run_bench` times prefill and decode separately and reports decode tokens/s next to the
memory-bandwidth floor of a decode step (bench_floor.py: every active weight byte read once, plus
the KV rows attended, the indexer keys and the linear state read and written), over the measured
copy bandwidth of the GPU. The shapes and how a run cuts one down (`layers`) are in bench_shapes.py.
Under tensor parallelism (`parallel`) each rank holds its shard; the weights are drawn whole, in the
same order, so every degree runs the same model, and the floor is that of one rank's bytes.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from freetoken.bench_floor import decode_floor_parts, layer_counts, meta_model, ngram_table_rows
from freetoken.bench_shapes import DFLASH_SHAPES, SHAPES, BenchConfig, bench_config, family_of
from freetoken.distributed.context import SINGLE, ParallelContext
from freetoken.engine.config import EngineConfig
from freetoken.layers.offload_config import ExpertOffloadConfig
from freetoken.models.expert_offload import weight_memory
from freetoken.models.qwen3_5.config import Qwen35Config
from freetoken.sampling import SamplingParams

H200_COPY_BANDWIDTH = 4.25e12  # bytes/s, measured device-to-device copy on this H200 (DESIGN.md)

DFLASH_BLOCK_SIZE = 16


@torch.no_grad()
def random_dflash_draft(shape: str, cfg: Qwen35Config, device: str, dtype: torch.dtype, seed: int = 0):
    """A DFlash draft of DFLASH_SHAPES[shape] for the target cfg, with seeded random weights (norm
    weights 1, matrices N(0, 1/fan_in)); its mask token is the last of the vocabulary."""
    from freetoken.converters.dflash import build_target_layer_ids
    from freetoken.spec.dflash.config import DFlashConfig
    from freetoken.spec.dflash.loader import empty_draft

    layers = DFLASH_SHAPES[shape]["num_hidden_layers"]
    draft_cfg = DFlashConfig(
        architecture="DFlashDraftModel", hidden_size=cfg.hidden_size, **DFLASH_SHAPES[shape], rms_norm_eps=1e-6, rope_theta=1e7,
        block_size=DFLASH_BLOCK_SIZE, mask_token_id=cfg.vocab_size - 1, target_layer_ids=tuple(build_target_layer_ids(cfg.num_hidden_layers, layers)),
        layer_types=("full_attention",) * layers, sliding_window=None, causal=(False,) * layers, attention_bias=False,
    )
    draft = empty_draft(draft_cfg, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    for name, p in draft.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    return draft


@torch.no_grad()
def random_model(cfg: BenchConfig, device: str, dtype: torch.dtype, with_mtp: bool, seed: int = 0, parallel: ParallelContext = SINGLE):
    """A model of cfg's shape (its family's) with seeded random weights of sensible scale (no branch is an identity)."""
    from freetoken.distributed.sharding import read_shard, shard_spec_of
    from freetoken.models.loader import build_empty

    model = build_empty(family_of(cfg), cfg.to_dict(), with_mtp=with_mtp, device=device, dtype=dtype, parallel=parallel)
    full_shapes = {}
    if parallel.is_parallel:
        from freetoken.models.qwen3_5.model import Qwen35ForCausalLM

        with torch.device("meta"):
            full_shapes = {n: p.shape for n, p in Qwen35ForCausalLM(cfg, with_mtp).named_parameters()}
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shard in model.named_parameters():
        spec = shard_spec_of(model, name) if parallel.is_parallel else None
        p = shard if spec is None else torch.empty(full_shapes[name], dtype=dtype, device=device)
        _fill(name, p, gen, device)
        if spec is not None:
            shard.copy_(read_shard({name: p}, name, spec))
    return model


def _fill(name: str, p: torch.Tensor, gen: torch.Generator, device: str) -> None:
    """Draw parameter `name` (its whole tensor p) from gen by the rule for its kind."""
    if name.endswith("A_log"):
        p.copy_(torch.log(torch.rand(p.shape, generator=gen, device=device) * 15 + 1))
    elif name.endswith("dt_bias"):
        p.fill_(1.0)
    elif name.endswith("linear_attn.norm.weight"):
        p.fill_(1.0)
    elif p.ndim == 1:
        p.normal_(0.0, 0.1, generator=gen)
    elif name.endswith("conv1d.weight"):
        p.normal_(0.0, 0.3, generator=gen)
    else:
        p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)


@dataclass
class BenchResult:
    shape: str
    batch_size: int
    prompt_len: int
    new_tokens: int
    spec: str
    num_draft_tokens: int
    corrupt_rate: float | None  # oracle drafts only (oracle, dflash-oracle): chance that a draft is replaced by a wrong token
    dtype: str
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    generated_tokens: int
    decode_tokens_per_s: float
    step_ms: float
    acceptance_per_position: list[float]
    mean_accepted_len: float
    floor_bytes_per_step: int
    floor_step_ms: float
    floor_tokens_per_s: float
    fraction_of_floor: float  # floor step time / measured step time
    speedup_vs_no_spec: float | None  # decode tokens/s over the no-spec run of the same invocation
    step_cost_vs_decode: float | None  # step time over the no-spec decode step time
    kernels: str
    tensor_parallel: int = 1
    cuda_graphs: bool = False
    forward_ms: float | None = None  # one replay of the step's graph (decode, or verify of k+1 rows; greedy: with verify and commit), GPU time
    forward_cost_vs_decode: float | None = None  # forward_ms over the no-spec decode forward_ms
    expert_offload: str = "none"  # none | cache | hybrid (layers/offload_config.py)
    resident_weight_bytes: int | None = None  # weights on the device (models/expert_offload.weight_memory)
    offloaded_weight_bytes: int | None = None  # routed experts in host memory
    layers: int | None = None  # decoder layers of the benched model
    full_depth_layers: int | None = None  # decoder layers of the shape (or checkpoint) at its real depth
    floor_parts: dict[str, int] | None = None  # floor_bytes_per_step by `<kind>.<part>` (bench_floor.py)
    floor_layer_counts: dict[str, int] | None = None  # layers of each kind in the benched model
    floor_bytes_full_depth: int | None = None  # the same count on the model at its real depth (bench_floor.meta_model)
    ple_table_rows: int | None = None  # rows of the benched n-gram table per PLE layer (a lookup reads one per head and token)
    ple_table_rows_full: int | None = None  # rows of the real table


def graph_forward_ms(engine, rows_per_request: int, repeats: int = 50) -> float | None:
    """Mean GPU time of one replay of the engine's captured step graph with rows_per_request rows
    per request (its last use; the pools' contents no longer matter)."""
    graphs = getattr(engine, "graphs", None)
    if graphs is None or not torch.cuda.is_available():
        return None
    entries = [g for (_, rows, _, _), g in graphs.graphs.items() if rows == rows_per_request]
    if not entries:
        return None
    return replay_ms(entries[0].graph, repeats)


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int) -> float:
    """Mean GPU milliseconds of one replay of a captured graph (after one untimed replay)."""
    graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / repeats


def _warm_up(engine, prompts: list[list[int]]) -> None:
    """One short run of the same shapes first, so kernel compilation and allocator growth are not timed."""
    for p in prompts:
        engine.add_request(p[:16], SamplingParams(max_new_tokens=3, ignore_eos=True))
    while engine.has_work:
        engine.step()
    engine.stats = type(engine.stats)(accepted_per_position=[0] * engine.spec.num_draft_tokens)


def _timed_generate(engine, prompts: list[list[int]], params: SamplingParams, device: str):
    """Run to completion, timing prefill steps and decode steps separately -> (requests, prefill_s, decode_s).

    A prefill step is timed alone (synchronised before and after). A run of decode steps is timed as a
    whole, from a synchronised start to a synchronised end, so the engine's overlap (the next step
    launched before this one is read back) is measured as it runs."""
    _warm_up(engine, prompts)
    requests = [engine.add_request(p, params) for p in prompts]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    prefill_s = decode_s = 0.0
    decode_since = None  # start of the current run of decode steps
    while engine.has_work:
        in_prefill = any(r.in_prefill for r in engine.scheduler.running) or bool(engine.scheduler.waiting)
        if in_prefill:
            sync()
            if decode_since is not None:
                decode_s += time.perf_counter() - decode_since
                decode_since = None
            t0 = time.perf_counter()
            engine.step()
            sync()
            prefill_s += time.perf_counter() - t0
        else:
            if decode_since is None:
                sync()
                decode_since = time.perf_counter()
            engine.step()
    sync()
    if decode_since is not None:
        decode_s += time.perf_counter() - decode_since
    return requests, prefill_s, decode_s


def run_bench(shape: str | None, *, model: str | Path | None = None, batch_size: int = 1, prompt_len: int = 512, new_tokens: int = 64, spec: str = "none",
              num_draft_tokens: int = 0, corrupt_rates: tuple[float, ...] = (0.0,), device: str = "cuda", dtype: str = "bfloat16", seed: int = 0,
              parallel: ParallelContext = SINGLE, cuda_graphs: bool = True, mem_fraction: float = 0.0,
              expert_offload: ExpertOffloadConfig | None = None, layers: int | None = None) -> list[BenchResult]:
    """The no-spec run, then (if spec != none) the spec run(s) on the same model and prompts (on this rank).

    The model is a random-weight model of a bench shape (its first `layers` decoder layers, all when
    None; bench_shapes.bench_config), or (given `model`) a checkpoint's; the prompts are seeded
    random token ids either way."""
    from freetoken.engine.engine import LLMEngine

    if parallel.is_parallel and device.startswith("cuda"):
        device = f"cuda:{parallel.rank}"
    offload = expert_offload or ExpertOffloadConfig()
    base_config = EngineConfig(device=device, dtype=dtype, max_num_seqs=batch_size, max_num_batched_tokens=max(prompt_len, 256),
                               max_model_len=prompt_len + new_tokens + num_draft_tokens + 2, seed=seed, cuda_graphs=cuda_graphs, mem_fraction=mem_fraction,
                               tensor_parallel=parallel.world_size, expert_offload=offload)
    if model is None and offload.enabled:
        from freetoken.errors import FreetokenError

        raise FreetokenError("--expert-offload needs MODEL (a checkpoint whose experts are read from disk), not --shape")
    if model is None:
        full_cfg, cfg = SHAPES[shape], bench_config(shape, layers)
        model = random_model(cfg, device, base_config.torch_dtype, with_mtp=spec == "mtp", seed=seed, parallel=parallel)
        if spec == "dflash-oracle":
            model.attached_drafts["dflash"] = random_dflash_draft(shape, cfg, device, base_config.torch_dtype, seed)
    else:
        from freetoken.llm import LLM

        shape = Path(str(model)).name
        model = LLM(model, replace(base_config, spec=spec, num_draft_tokens=num_draft_tokens), parallel=parallel).model
        cfg = full_cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab_size - 16, (prompt_len,), generator=gen).tolist() for _ in range(batch_size)]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    context_len = prompt_len + new_tokens // 2
    floor_parts = decode_floor_parts(model, cfg, batch_size, context_len, base_config.torch_dtype.itemsize)
    floor = sum(floor_parts.values())
    floor_step = floor / H200_COPY_BANDWIDTH
    full_model = model if full_cfg is cfg else meta_model(full_cfg, family_of(full_cfg), base_config.torch_dtype, parallel)
    floor_full_depth = sum(decode_floor_parts(full_model, full_cfg, batch_size, context_len, base_config.torch_dtype.itemsize).values())
    memory = weight_memory(model)
    kernels = os.environ.get("FREETOKEN_KERNELS", "auto")

    def result(engine, spec_name, k, rate, prefill_s, decode_s, base: BenchResult | None) -> BenchResult:
        s = engine.stats
        tps = s.generated_tokens / decode_s if decode_s else 0.0
        step_ms = 1000 * decode_s / max(s.decode_steps, 1)
        acc = [a / s.num_verifies for a in s.accepted_per_position] if s.num_verifies else []
        mean_len = s.generated_tokens / max(s.decode_steps * batch_size, 1)
        return BenchResult(
            shape, batch_size, prompt_len, new_tokens, spec_name, k, rate, dtype, prefill_s, decode_s, s.decode_steps, s.generated_tokens,
            tps, step_ms, acc, mean_len, floor, 1000 * floor_step, batch_size / floor_step,
            (1000 * floor_step) / step_ms if step_ms else 0.0,
            tps / base.decode_tokens_per_s if base else None, step_ms / base.step_ms if base else None, kernels, parallel.world_size,
            engine.graphs is not None, expert_offload=offload.mode, resident_weight_bytes=memory.resident_bytes, offloaded_weight_bytes=memory.offloaded_bytes,
            layers=cfg.num_hidden_layers, full_depth_layers=full_cfg.num_hidden_layers, floor_parts=floor_parts, floor_layer_counts=layer_counts(cfg),
            floor_bytes_full_depth=floor_full_depth, ple_table_rows=ngram_table_rows(model), ple_table_rows_full=ngram_table_rows(full_model),
        )

    engine = LLMEngine(model, base_config)
    requests, prefill_s, decode_s = _timed_generate(engine, prompts, params, device)
    base = result(engine, "none", 0, None, prefill_s, decode_s, None)
    base.forward_ms = graph_forward_ms(engine, 1)
    results = [base]
    if spec == "none":
        return results
    continuations = [r.output_token_ids for r in requests]
    oracle = spec in ("oracle", "dflash-oracle")
    for rate in corrupt_rates if oracle else (None,):
        engine = LLMEngine(model, replace(base_config, spec=spec, num_draft_tokens=num_draft_tokens))
        if oracle:
            # request ids 0..B-1 are the warm-up requests of _timed_generate
            engine.spec.set_continuations({len(prompts) + i: c for i, c in enumerate(continuations)}, rate, seed)
        reqs, prefill_s, decode_s = _timed_generate(engine, prompts, params, device)
        if [r.output_token_ids for r in reqs] != continuations:
            raise AssertionError(f"{spec} k={num_draft_tokens} changed the greedy output")
        run = result(engine, spec, num_draft_tokens, rate, prefill_s, decode_s, base)
        run.forward_ms = graph_forward_ms(engine, num_draft_tokens + 1)
        if run.forward_ms and base.forward_ms:
            run.forward_cost_vs_decode = run.forward_ms / base.forward_ms
        results.append(run)
    return results


def environment() -> dict:
    def _git(*args: str) -> str:
        try:
            repo = Path(__file__).resolve().parents[2]
            return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": os.environ.get("FREETOKEN_COMMIT") or _git("rev-parse", "HEAD"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (cpu: " + (platform.processor() or platform.machine()) + ")",
        "torch": torch.__version__,
        "copy_bandwidth_bytes_per_s": H200_COPY_BANDWIDTH,
    }


def write_results(path: Path, command: str, results: list[BenchResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": command, **environment(), "results": [asdict(r) for r in results]}, indent=2) + "\n")
