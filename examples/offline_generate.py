"""Offline batch generation through the Python API, with MTP speculative decoding.

    python examples/offline_generate.py [MODEL]

MODEL is a unified checkpoint, an HF checkpoint or a GGUF file; without it the embedded default
model runs. Greedy output is the same with or without --spec; only the speed differs.
"""

import sys

from freetoken.engine.config import EngineConfig
from freetoken.llm import LLM
from freetoken.sampling import SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else None
llm = LLM(model, EngineConfig(spec="mtp", num_draft_tokens=2))
prompts = ["def quicksort(items):", "import json\n\n\ndef load(path):", "class LRUCache:"]
completions, stats = llm.generate(prompts, SamplingParams(max_new_tokens=48))
for c in completions:
    print(repr(c.prompt), "->", repr(c.text))
print(f"{stats.generated_tokens} tokens in {stats.seconds:.2f} s; acceptance per draft position {stats.acceptance_per_position}")
