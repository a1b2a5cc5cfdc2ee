"""Engine settings: a frozen dataclass built once from the CLI or the Python API."""

from __future__ import annotations

from dataclasses import dataclass, field

from freetoken.layers.offload_config import ExpertOffloadConfig


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"
    dtype: str = "float32"  # float32 | bfloat16 | float16
    max_num_seqs: int = 16  # running requests at once (linear-state slots)
    max_num_batched_tokens: int = 512  # prefill tokens per step (chunked prefill budget)
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: from mem_fraction on CUDA, else max_num_seqs requests of max_model_len tokens
    mem_fraction: float = 0.0  # CUDA: share of the free GPU memory (after weights and state) for the KV pool; 0 = off
    max_model_len: int = 4096
    spec: str = "none"  # none | mtp | dflash (and oracle, for benchmarks)
    num_draft_tokens: int = 0  # with dflash, 0 means the draft's block size - 1 (set when the LLM loads it)
    seed: int = 0
    tensor_parallel: int = 1  # processes sharing the model (one per GPU); see freetoken.distributed
    prefill_align: int = 64  # prompts are cut into prefill pieces at multiples of this (the chunked GDN rule's chunk)
    cuda_graphs: bool = True  # replay decode/verify forwards as CUDA graphs where supported (dense, CUDA, Triton)
    overlap: bool = True  # greedy decode without drafts: launch step n+1 before reading step n's tokens back (engine.py)
    expert_offload: ExpertOffloadConfig = field(default_factory=ExpertOffloadConfig)  # MoE experts off the device (eager path)
    prefix_cache: bool = False  # reuse KV pages and linear state of prompt prefixes computed earlier in the run (prefix_cache.py)
    prefix_snapshot_mib: float = 1024.0  # the prefix cache's budget for linear-state snapshots (hybrid models)

    def __post_init__(self):
        from freetoken.errors import FreetokenError

        if self.spec == "none" and self.num_draft_tokens:
            raise FreetokenError("--num-draft-tokens needs a spec method (--spec mtp or dflash)")
        if not 0.0 <= self.mem_fraction < 1.0:
            raise FreetokenError(f"--mem-fraction must be in [0, 1), not {self.mem_fraction}")
        if self.num_draft_tokens < 0 or self.max_num_seqs < 1 or self.block_size < 1 or self.tensor_parallel < 1:
            raise FreetokenError("engine sizes must be positive")
        check_device(self.device)

    @property
    def torch_dtype(self):
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]


def check_device(device: str) -> None:
    """`device` is cpu, cuda or cuda:N naming a GPU this process can use; else a one-line FreetokenError."""
    from freetoken.errors import FreetokenError

    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (kind == "cpu" and index) or (index and not index.isdigit()):
        raise FreetokenError(f"--device {device!r}: use cpu, cuda or cuda:N")
    if kind == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise FreetokenError(f"--device {device}, but CUDA is not available here (torch {torch.__version__}); use --device cpu")
    if index and int(index) >= torch.cuda.device_count():
        raise FreetokenError(f"--device {device}, but {torch.cuda.device_count()} GPU(s) are visible")
