"""A/B timing of kernel switches on one random-weight model, in one process (GPU only).

Builds the bench shape once, then for each variant sets module attributes of the kernels, builds a
fresh engine (so its CUDA graphs are captured with the variant) and times a greedy decode run as
`freetoken bench` does, plus the replay of the one-row decode graph. One JSON line per variant, with
a hash of its tokens so that runs of other trees (other processes) can be compared too.

    python bench/variants.py --shape qwen3.5-35b-a3b \\
        --variant unfused kernels.FUSE_MOE_ENTRY=0 moe_triton.ROUTE_PER_WARP=0 \\
        --variant shipped
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json

import torch

from freetoken.bench import SHAPES, _timed_generate, graph_forward_ms, random_model
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.sampling import SamplingParams


def _parse(variant: list[str]) -> tuple[str, list[tuple[object, str, int]]]:
    name, settings = variant[0], []
    for item in variant[1:]:
        target, value = item.split("=")
        module, attr = target.rsplit(".", 1)
        settings.append((importlib.import_module("freetoken.kernels" + ("" if module == "kernels" else f".{module}")), attr, int(value)))
    return name, settings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3.5-35b-a3b")
    ap.add_argument("--variant", nargs="+", action="append", required=True, help="NAME [module.ATTR=INT ...] (module of freetoken.kernels, or kernels itself)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="times each variant is run, interleaved")
    ap.add_argument("--layers", type=int, default=0, help="keep the shape's first LAYERS layers (a GPU with less memory than the whole shape needs)")
    args = ap.parse_args()
    cfg = SHAPES[args.shape]
    if args.layers:
        layer_types = cfg.layer_types[: args.layers]
        cfg = dataclasses.replace(cfg, num_hidden_layers=len(layer_types), layer_types=layer_types)
    config = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=1, max_num_batched_tokens=max(args.prompt_len, 256),
                          max_model_len=args.prompt_len + args.new_tokens + 2)
    model = random_model(cfg, "cuda", torch.bfloat16, with_mtp=False)
    prompt = torch.randint(0, cfg.vocab_size - 16, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    variants = [_parse(v) for v in args.variant]
    defaults = {(m, a): getattr(m, a) for _, settings in variants for m, a, _ in settings}
    outputs = {}
    for round_ in range(args.rounds):
        for name, settings in variants:
            for (m, a), value in defaults.items():
                setattr(m, a, value)
            for m, a, value in settings:
                setattr(m, a, type(getattr(m, a))(value))
            engine = LLMEngine(model, config)
            requests, _, decode_s = _timed_generate(engine, [prompt], params, "cuda")
            tokens = requests[0].output_token_ids
            outputs.setdefault("reference", tokens)
            s = engine.stats
            print(json.dumps({"variant": name, "round": round_, "step_ms": round(1000 * decode_s / s.decode_steps, 4),
                              "tokens_per_s": round(s.generated_tokens / decode_s, 1), "graph_ms": round(graph_forward_ms(engine, 1), 4),
                              "same_tokens": tokens == outputs["reference"],
                              "tokens_sha1": hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:12]}), flush=True)
            del engine
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
