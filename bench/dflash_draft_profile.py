"""Where a DFlash-oracle decode step's time goes: propose, verify, observe, with the draft's CUDA graphs on and off.

A random-weight target of a bench shape with a random DFlash draft of its published shape
(freetoken.bench.random_model / random_dflash_draft), the `dflash-oracle` method (the draft does
all its work, the oracle's drafts are verified) and the target's verify graphs on. Each decode
step's phases are timed with a device sync before and after: propose (the draft step and its
read-back), verify (the target's k+1 rows, accept, commit), observe (the draft's context rows of
the committed rows), and the whole step. The generation runs twice per mode and the second run is
timed, so every graph (target and draft, at every context bucket the run reaches) is captured before.
One JSON line per mode, after one for the no-spec baseline; the draft floor is its weight bytes
plus the lm_head's, read once, at --bandwidth; with the graphs on, each captured draft graph's
replay is also timed alone (GPU time, keyed batch x context bucket).

    python bench/dflash_draft_profile.py [--shape qwen3.5-9b] [-k 15] [--prompt-len 512] [--batch-size 1]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import replace

import torch

from freetoken.bench import H200_COPY_BANDWIDTH, SHAPES, random_dflash_draft, random_model, replay_ms
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import LLMEngine
from freetoken.sampling import SamplingParams


class PhaseTimer:
    """Wraps an engine's decode step and its phases; each call is timed between two device syncs."""

    def __init__(self, engine: LLMEngine):
        self.sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.in_decode = False
        spec = engine.spec
        spec.propose = self._timed("propose", spec.propose)
        spec.observe = self._timed("observe", spec.observe)
        engine._verify = self._timed("verify", engine._verify)
        decode = self._timed("step", engine._decode)

        def step(requests):
            self.in_decode, self.steps = True, self.steps + 1
            try:
                return decode(requests)
            finally:
                self.in_decode = False

        engine._decode = step

    def _timed(self, name: str, fn):
        def call(*args, **kw):
            if not (self.in_decode or name == "step"):
                return fn(*args, **kw)  # prefill observes are not part of a decode step
            self.sync()
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            self.sync()
            self.totals[name] += time.perf_counter() - t0
            return out

        return call

    def per_step_ms(self) -> dict[str, float]:
        ms = {f"{name}_ms": round(1000 * t / max(self.steps, 1), 3) for name, t in self.totals.items()}
        ms["other_ms"] = round(ms.get("step_ms", 0.0) - sum(v for k, v in ms.items() if k != "step_ms"), 3)
        return ms


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, continuations: list[list[int]] | None = None):
    """Two runs of the prompts (the first untimed: every graph captured); -> (the second run's requests, its timer)."""
    timer = None
    for attempt in range(2):
        if continuations is not None:
            first = engine._next_id
            engine.spec.set_continuations({first + i: c for i, c in enumerate(continuations)}, 0.0, 0)
        if attempt == 1:
            timer = PhaseTimer(engine)
            engine.stats = type(engine.stats)(accepted_per_position=[0] * engine.spec.num_draft_tokens)
        requests = engine.generate(prompts, params)
    return requests, timer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3.5-9b")
    ap.add_argument("-k", type=int, default=15)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (with --shape tiny)")
    ap.add_argument("--bandwidth", type=float, default=H200_COPY_BANDWIDTH, help="bytes/s for the draft floor")
    args = ap.parse_args()
    cfg, dtype = SHAPES[args.shape], torch.bfloat16
    model = random_model(cfg, args.device, dtype, with_mtp=False)
    draft = model.attached_drafts["dflash"] = random_dflash_draft(args.shape, cfg, args.device, dtype)
    config = EngineConfig(device=args.device, dtype="bfloat16", max_num_seqs=args.batch_size, max_num_batched_tokens=max(args.prompt_len, 256),
                          max_model_len=args.prompt_len + args.new_tokens + args.k + 2, cuda_graphs=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size - 16, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch_size)]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    head = model.lm_head.weight if not cfg.tie_word_embeddings else model.model.embed_tokens.weight
    floor_bytes = sum(p.numel() * p.element_size() for p in draft.parameters()) + head.numel() * head.element_size()
    common = {"shape": args.shape, "k": args.k, "batch_size": args.batch_size, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "none", "draft_floor_ms": round(1000 * floor_bytes / args.bandwidth, 3)}

    base = LLMEngine(model, replace(config, overlap=False))
    requests, timer = run(base, prompts, params)
    continuations = [r.output_token_ids for r in requests]
    print(json.dumps(common | {"mode": "no-spec", "steps": timer.steps} | timer.per_step_ms()), flush=True)

    for draft_graphs in (False, True):
        engine = LLMEngine(model, replace(config, spec="dflash-oracle", num_draft_tokens=args.k))
        if not draft_graphs:
            engine.spec.graphs = None
        requests, timer = run(engine, prompts, params, continuations)
        assert [r.output_token_ids for r in requests] == continuations, "dflash-oracle changed the greedy output"
        s = engine.stats
        graphs = engine.spec.graphs.graphs if engine.spec.graphs is not None else {}
        replays = {f"{b}x{n}": round(replay_ms(entry.graph, 20), 3) for (b, n), entry in sorted(graphs.items())}  # GPU time alone
        print(json.dumps(common | {"mode": "dflash-oracle", "draft_graphs": draft_graphs, "steps": timer.steps,
                                   "mean_accepted_len": round(s.generated_tokens / max(s.decode_steps * args.batch_size, 1), 3),
                                   "draft_graph_replay_ms": replays} | timer.per_step_ms()), flush=True)


if __name__ == "__main__":
    main()
