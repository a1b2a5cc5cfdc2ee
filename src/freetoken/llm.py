"""The Python entry point: a model path in, completions out.

`LLM(model)` accepts a unified checkpoint, a Hugging Face checkpoint or a GGUF file (converted once
into the cache directory, `FREETOKEN_CACHE` or ~/.cache/freetoken), or None for the small model that
ships inside the package. It loads the target (and its draft head when a spec method asks for it),
builds the engine and runs batches of text prompts, which may carry images (image_prompts.py) when
the checkpoint has a vision tower.

Under tensor parallelism every rank constructs its own `LLM(..., parallel=ctx)` inside a worker
started by `freetoken.distributed.launch` (the CLI's `--tensor-parallel N` does this): each loads
its shard, runs the same engine steps and gets the same tokens; the caller lets rank 0 write.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

from freetoken.engine.config import EngineConfig
from freetoken.errors import FreetokenError
from freetoken.sampling import SamplingParams

DEFAULT_MODEL_DIR = Path(__file__).parent / "assets" / "default-model"


def cache_dir() -> Path:
    return Path(os.environ.get("FREETOKEN_CACHE", Path.home() / ".cache" / "freetoken"))


def resolve_checkpoint(model: str | Path | None, progress: Callable[[int], None] | None = None) -> Path:
    """The unified checkpoint directory for `model`, converting HF or GGUF sources once into the cache."""
    from freetoken.converters.detect import detect_format, resolve_source

    if model is None:
        if not (DEFAULT_MODEL_DIR / "manifest.json").exists():
            raise FreetokenError("no MODEL given and the embedded default model is not installed", DEFAULT_MODEL_DIR)
        return DEFAULT_MODEL_DIR
    path = resolve_source(model)
    fmt = detect_format(path)
    if fmt == "unified":
        return path
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_mtime_ns}:{stat.st_size}".encode()).hexdigest()[:16]
    dst = cache_dir() / "converted" / f"{path.name}-{key}"
    if not (dst / "manifest.json").exists():
        from freetoken.converters import convert

        dst.parent.mkdir(parents=True, exist_ok=True)
        convert(path, dst, force=True, progress=progress)
    return dst


@dataclass
class Completion:
    prompt: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    accepted_lens: list[int] = field(default_factory=list)


@dataclass
class RunStats:
    num_requests: int
    prompt_tokens: int
    generated_tokens: int
    seconds: float
    decode_steps: int
    num_preemptions: int
    num_draft_tokens: int
    acceptance_per_position: list[float]  # P(draft i accepted) per verify
    mean_accepted_len: float  # tokens emitted per request per target step (accepted drafts + 1)
    cached_prompt_tokens: int = 0  # prompt tokens taken from the prefix cache, not prefilled (counted per admission)
    prefix_cache_hits: int = 0  # admissions that reused a cached prefix
    prefix_cache_hit_rate: float = 0.0  # cached prompt tokens / (cached + prefilled)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


class LLM:
    def __init__(self, model: str | Path | None = None, config: EngineConfig | None = None, progress: Callable[[int], None] | None = None, parallel=None):
        from freetoken.checkpoint.reader import UnifiedCheckpoint
        from freetoken.distributed.context import SINGLE
        from freetoken.models.loader import load_model

        self.config = config or EngineConfig()
        self.parallel = parallel or SINGLE
        if self.config.tensor_parallel != self.parallel.world_size:
            raise FreetokenError(
                f"tensor_parallel={self.config.tensor_parallel} needs that many processes: start them with "
                "freetoken.distributed.launch (the CLI's --tensor-parallel does)"
            )
        if self.parallel.is_parallel and self.config.device.startswith("cuda"):
            self.config = replace(self.config, device=f"cuda:{self.parallel.rank}")
        self.path = resolve_checkpoint(model, progress)
        self.checkpoint = UnifiedCheckpoint.open(self.path)
        wants_mtp = self.config.spec == "mtp"
        if wants_mtp and "mtp" not in self.checkpoint.draft_heads:
            raise FreetokenError("the checkpoint has no MTP head, so --spec mtp cannot run; use --spec none", self.path)
        wants_dflash = self.config.spec == "dflash"
        if wants_dflash and "dflash" not in self.checkpoint.draft_heads:
            raise FreetokenError("the checkpoint has no DFlash draft, so --spec dflash cannot run; convert it with --dflash DRAFT_DIR, or use --spec none", self.path)
        if wants_dflash and self.parallel.is_parallel:
            raise FreetokenError("--spec dflash does not run with --tensor-parallel yet")
        self.model = load_model(
            self.checkpoint, self.checkpoint.family, self.checkpoint.config, with_mtp=wants_mtp,
            device=self.config.device, dtype=self.config.torch_dtype, origin=str(self.path), parallel=self.parallel,
            expert_offload=self.config.expert_offload,
        )
        if wants_dflash:
            from freetoken.spec.dflash.loader import load_draft

            cfg = self.model.config
            self.model.attached_drafts["dflash"] = load_draft(
                self.checkpoint, self.checkpoint.draft_heads["dflash"], cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size,
                device=self.config.device, dtype=self.config.torch_dtype, origin=str(self.path),
            )
            if not self.config.num_draft_tokens:
                self.config = replace(self.config, num_draft_tokens=self.model.attached_drafts["dflash"].config.block_size - 1)
        self._vision_tower = None  # loaded with the first image prompt
        self.tokenizer = None
        if self.checkpoint.tokenizer_path is not None:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(self.checkpoint.tokenizer_path))

    # -- text ----------------------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise FreetokenError("the checkpoint has no tokenizer.json; pass token ids", self.path)
        if chat:
            prompt = self.apply_chat_template(prompt)
        return self.tokenizer.encode(prompt, add_special_tokens=False).ids

    def encode_with_images(self, prompt: str, images: Sequence, chat: bool = False):
        """(token ids with the images laid out, RequestImages) of a prompt and its images (paths or PIL
        images); the markers and placement rules are image_prompts.py's."""
        from freetoken import image_prompts

        self._check_images()
        if self.tokenizer is None:
            raise FreetokenError("the checkpoint has no tokenizer.json; image prompts need one", self.path)
        text = image_prompts.with_markers(prompt, len(images))
        if chat:
            text = self.apply_chat_template(text)
        tokens = image_prompts.ImageTokenIds.from_config(self.checkpoint.config)
        ids = image_prompts.marked_token_ids(text, self.encode, tokens)
        return image_prompts.request_images(ids, images, self.checkpoint.config, self.image_processing)

    def _check_images(self) -> None:
        if "vision_config" not in self.checkpoint.config or "model.visual.patch_embed.proj.weight" not in self.checkpoint:
            raise FreetokenError("the checkpoint has no vision tower, so it cannot take image prompts", self.path)

    @property
    def image_processing(self):
        """The checkpoint's ImageProcessing (its manifest's, else Qwen3-VL's scaled to the patch size)."""
        from freetoken.models.vision.config import ImageProcessing, VisionConfig

        config = self.checkpoint.config
        if "image_processing" in config:
            return ImageProcessing.from_dict(config["image_processing"])
        return ImageProcessing.from_hf(None, VisionConfig.from_dict(config["vision_config"]))

    @property
    def vision_tower(self):
        if self._vision_tower is None:
            from freetoken.models.vision.load import load_vision_tower

            self._check_images()
            self._vision_tower = load_vision_tower(self.checkpoint, self.checkpoint.config["vision_config"], device=self.config.device,
                                                   dtype=self.config.torch_dtype, origin=str(self.path))
        return self._vision_tower

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if self.tokenizer is not None else ""

    def apply_chat_template(self, prompt: str) -> str:
        template = self.checkpoint.chat_template
        if not template:
            raise FreetokenError("the checkpoint has no chat template; drop --chat", self.path)
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(template).render(messages=[{"role": "user", "content": prompt}], add_generation_prompt=True)

    # -- generation ----------------------------------------------------------------------------------
    def make_engine(self, config: EngineConfig | None = None, with_images: bool = False):
        from freetoken.engine.engine import LLMEngine

        return LLMEngine(self.model, config or self.config, origin=str(self.path), vision_tower=self.vision_tower if with_images else None)

    def generate_ids(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams], config: EngineConfig | None = None, on_step=None,
                     images: Sequence | None = None):
        """images: per prompt, its RequestImages (encode_with_images) or None."""
        with_images = images is not None and any(i is not None for i in images)
        engine = self.make_engine(config, with_images)
        start = time.perf_counter()
        requests = engine.generate(prompts, params, on_step=on_step, images=images if with_images else None)
        seconds = time.perf_counter() - start
        s = engine.stats
        k = engine.spec.num_draft_tokens
        stats = RunStats(
            num_requests=len(requests),
            prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
            generated_tokens=sum(len(r.output_token_ids) for r in requests),
            seconds=seconds,
            decode_steps=s.decode_steps,
            num_preemptions=s.num_preemptions,
            num_draft_tokens=k,
            acceptance_per_position=[a / s.num_verifies for a in s.accepted_per_position] if s.num_verifies else [],
            mean_accepted_len=(sum(sum(r.accepted_lens) for r in requests) / s.num_verifies + 1.0) if s.num_verifies else 1.0,
        )
        if engine.prefix_cache is not None:
            cached = engine.prefix_cache.stats.cached_tokens
            stats = replace(stats, cached_prompt_tokens=cached, prefix_cache_hits=engine.prefix_cache.stats.hits,
                            prefix_cache_hit_rate=cached / (cached + s.prefill_tokens) if cached + s.prefill_tokens else 0.0)
        return requests, stats

    def generate(self, prompts: Sequence[str], params: SamplingParams, chat: bool = False, config: EngineConfig | None = None, on_step=None,
                 images: Sequence[Sequence] | None = None) -> tuple[list[Completion], RunStats]:
        """images: per prompt, a list of image paths or PIL images (empty for a text prompt)."""
        if images is None or not any(images):
            ids, laid_out = [self.encode(p, chat) for p in prompts], None
        else:
            encoded = [self.encode_with_images(p, im, chat) if im else (self.encode(p, chat), None) for p, im in zip(prompts, images)]
            ids, laid_out = [e[0] for e in encoded], [e[1] for e in encoded]
        requests, stats = self.generate_ids(ids, params, config, on_step, laid_out)
        completions = [
            Completion(p, r.prompt_token_ids, r.output_token_ids, self.decode(r.output_token_ids), r.finish_reason, r.accepted_lens)
            for p, r in zip(prompts, requests)
        ]
        return completions, stats

    def with_spec(self, spec: str, num_draft_tokens: int) -> EngineConfig:
        return replace(self.config, spec=spec, num_draft_tokens=num_draft_tokens)
