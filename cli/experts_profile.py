"""`freetoken experts-profile MODEL --prompts FILE --out placement.json`: the most used routed experts per MoE layer.

Runs the prompts through the model (prefill, then --decode-tokens greedy tokens, CUDA graphs off so every
step is counted), counts the router's picks per layer and expert (layers/routing_counts.py), and writes
a placement file for `--expert-offload hybrid --expert-placement` (layers/expert_placement.py): per layer
the N most picked experts (ties to the lower id, listed ascending) under "resident", all counts under
"counts". N comes from --gpu-experts (a count, fraction or percentage of the layer's experts).
With --expert-cache-gb the profile runs the experts through the device cache (`--expert-offload cache`,
bit for bit the resident model's routing), so a model whose experts do not fit the device can be profiled
there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from freetoken.cli._options import DeviceOpt, DType, DTypeOpt, ModelArg, PromptOpt, PromptsFileOpt, console

DECODE_HELP = "Greedy tokens decoded (and counted) after each prefill."
CACHE_HELP = "Run the experts through a device cache of this many GiB (as --expert-offload cache; same routing as resident)."
GPU_EXPERTS_HELP = "Experts per layer to keep resident: a count (64), a fraction (0.25) or a percentage (25%)."


def experts_profile(
    model: ModelArg = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Write the placement JSON here.")] = Path("placement.json"),
    prompt: PromptOpt = None,
    prompts: PromptsFileOpt = None,
    gpu_experts: Annotated[str, typer.Option("--gpu-experts", help=GPU_EXPERTS_HELP)] = "25%",
    decode_tokens: Annotated[int, typer.Option("--decode-tokens", min=0, help=DECODE_HELP)] = 0,
    device: DeviceOpt = "cpu",
    dtype: DTypeOpt = DType.float32,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1)] = 16,
    expert_cache_gb: Annotated[Optional[float], typer.Option("--expert-cache-gb", help=CACHE_HELP, show_default=False)] = None,
) -> None:
    """Count router picks per MoE layer on a workload and write the top experts as a placement file."""
    from freetoken.cli.prompts import read_prompts
    from freetoken.errors import FreetokenError
    from freetoken.layers.offload_config import ExpertOffloadConfig

    resident_rule = ExpertOffloadConfig.from_options("hybrid", gpu_experts=gpu_experts)
    offload = ExpertOffloadConfig.from_options("cache", expert_cache_gb) if expert_cache_gb is not None else ExpertOffloadConfig()
    texts = read_prompts(prompt, prompts)
    if not texts:
        raise FreetokenError("experts-profile needs prompts: --prompts FILE or --prompt TEXT")
    placement = profile(model, texts, resident_rule, decode_tokens, device, dtype.value, batch_size, offload)
    if not placement["resident"]:
        raise FreetokenError("experts-profile needs a MoE model; this one has no routed experts")
    out.write_text(json.dumps(placement, indent=1) + "\n")
    console.print(f"wrote {out}: {placement['prompt_tokens']} prompt tokens, {len(placement['resident'])} MoE layers")


def profile(model: str | None, texts: list[str], resident_rule, decode_tokens: int, device: str, dtype: str,
            batch_size: int, offload=None) -> dict:
    """-> the placement file's content: {"resident": {layer: ids}, "counts": {layer: picks per id}, "prompt_tokens",
    "decode_tokens"}."""
    from freetoken.engine.config import EngineConfig
    from freetoken.layers.routing_counts import count_routing
    from freetoken.llm import LLM
    from freetoken.sampling import SamplingParams

    from freetoken.layers.offload_config import ExpertOffloadConfig

    config = EngineConfig(device=device, dtype=dtype, max_num_seqs=batch_size, max_model_len=8192, expert_offload=offload or ExpertOffloadConfig())
    llm = LLM(model, config)
    llm.model.supports_cuda_graphs = False  # a replayed graph would not reach the counter
    ids = [llm.encode(t) for t in texts]
    with count_routing(llm.model) as counts:
        # one token always: the prefill; each further one is a decode step
        llm.generate_ids(ids, SamplingParams(max_new_tokens=decode_tokens + 1, temperature=0.0))
    resident = {layer: counts.top(layer, resident_rule.num_resident_experts(len(picks)))
                for layer, picks in counts.counts.items()}
    return {"resident": resident, "counts": counts.counts, "prompt_tokens": sum(map(len, ids)), "decode_tokens": decode_tokens}
