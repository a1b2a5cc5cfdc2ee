"""Image prompts and the prefix cache through the Python API.

    python examples/image_prompt.py MODEL IMAGE [IMAGE ...]

MODEL is a Qwen3.5 (dense or MoE) or qwen4_exp checkpoint with its vision tower (`model.visual.*`),
unified, HF or converted; each IMAGE is a file Pillow reads. Every `<image>` marker in a prompt takes
the next of its images. The prompts share a long text prefix, which the prefix cache computes once;
the output is the same with the cache off.
"""

import sys

from freetoken.engine.config import EngineConfig
from freetoken.llm import LLM
from freetoken.sampling import SamplingParams

model, image_paths = sys.argv[1], sys.argv[2:]
llm = LLM(model, EngineConfig(prefix_cache=True))
shared = "You describe pictures in one short sentence, plainly and without guessing.\n" * 8
prompts = [shared + "A picture: <image> Describe it.", shared + "Two pictures: <image> and <image>. Compare them.", shared + "No picture here."]
images = [image_paths[:1], (image_paths * 2)[:2], []]
completions, stats = llm.generate(prompts, SamplingParams(max_new_tokens=24), images=images)
for c in completions:
    print(repr(c.prompt[len(shared):]), "->", repr(c.text))
print(f"{stats.generated_tokens} tokens in {stats.seconds:.2f} s; {stats.cached_prompt_tokens} prompt tokens from the prefix cache")
