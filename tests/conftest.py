"""Shared test helpers: the fixture path, one torch thread, and tiny random Hugging Face checkpoints.

Why one thread: the models here are tiny, and multi-threaded torch spends far more time
synchronising than computing (about 8x slower).

Why a builder: transformers is the oracle for the target, so the tests write checkpoints with
transformers' own `save_pretrained` (`Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM`). HF's init
makes the zero-centred norms, the GDN output norm, conv and decay parameters near-identities
(architectures.md §8.3, gotcha 6), so every tensor is redrawn with fixture-like statistics first.

Layout: FIXTURES, TinySpec, hf_text_config, random_state, write_hf_checkpoint, convert_unified,
load_unified, hf_model_from_dir, hf_logits, run_rows (one engine-path forward), our_mtp_logits,
fixture_refs, and session fixtures for converted checkpoints.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

# The fixtures beside the checkout, or where FREETOKEN_FIXTURES points (a copy on another machine).
FIXTURES = Path(os.environ.get("FREETOKEN_FIXTURES") or Path(__file__).resolve().parents[1] / ".." / "shared" / "fixtures")
FIXTURE_MODELS = ("qwen35_dense", "qwen35_moe")


@dataclass(frozen=True)
class TinySpec:
    """A tiny Qwen3.5 text model: 3 GDN layers + 1 gated-attention layer, value heads > key heads."""

    moe: bool = False
    vocab_size: int = 256
    hidden_size: int = 64
    tied: bool = False
    fused_experts: bool = False  # rewrite save_pretrained's per-expert tensors as released checkpoints store them
    shared_expert_intermediate_size: int = 64  # 32 (= moe_intermediate_size): the Triton path stacks the shared expert as expert E
    with_mtp: bool = True
    eos_token_id: int | None = None  # None: vocab_size, an id no model can emit (generation runs to max_new_tokens)
    seed: int = 1  # seed 0 puts one position of the tied variant near a conditioning cliff (HF full vs HF decode 1.5e-4)


def hf_text_config(spec: TinySpec):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tied,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        eos_token_id=spec.vocab_size if spec.eos_token_id is None else spec.eos_token_id,
        pad_token_id=0,
        bos_token_id=None,
    )
    if spec.moe:
        return Qwen3_5MoeTextConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=spec.shared_expert_intermediate_size, **common)
    return Qwen3_5TextConfig(intermediate_size=128, **common)


def _draw(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """A fixture-style random value for a tensor, chosen by its name (fixtures/README.md)."""
    n = lambda std: torch.randn(shape, generator=g) * std  # noqa: E731
    if name.endswith("linear_attn.norm.weight"):
        return 1 + n(0.15)  # plain gated RMSNorm: weight around one
    if name.endswith("norm.weight"):
        return n(0.15)  # zero-centred norms (input/post-attention, q/k, final, MTP)
    if name.endswith("conv1d.weight"):
        return n(0.3)
    if name.endswith("A_log"):
        return torch.log(torch.rand(shape, generator=g) * 1.9 + 0.1)
    if name.endswith("dt_bias"):
        return 0.5 + n(0.3)
    if name.endswith("embed_tokens.weight"):
        return n(0.25)
    if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
        return n(0.3)
    fan_in = shape[-1]
    return n(max(0.05, fan_in**-0.5))


def random_state(spec: TinySpec) -> dict[str, torch.Tensor]:
    """Random weights for every parameter of transformers' causal LM for `spec` (HF text names)."""
    from transformers import AutoModelForCausalLM

    config = hf_text_config(spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(spec.seed)
    state = {}
    for name, p in model.state_dict().items():
        if spec.tied and name == "lm_head.weight":
            continue
        state[name] = _draw(name, tuple(p.shape), g).contiguous()
    return state


def _mtp_tensors(spec: TinySpec, g: torch.Generator) -> dict[str, torch.Tensor]:
    from freetoken.models.qwen3_5.config import Qwen35Config
    from freetoken.models.qwen3_5.weights import expected_tensors

    cfg = Qwen35Config.from_hf(hf_text_config(spec).to_dict())
    shapes = {n: s for n, s in expected_tensors(cfg, with_mtp=True).items() if n.startswith("mtp.")}
    out = {n: _draw(n, s, g) for n, s in sorted(shapes.items())}
    if spec.moe and not spec.fused_experts:
        out = _split_experts(out)
    return out


def _split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused `experts.gate_up_proj [E, 2I, H]` / `experts.down_proj [E, H, I]` -> per-expert tensors."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :half].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, half:].contiguous()
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def _fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert `experts.{e}.{gate,up,down}_proj.weight` -> fused, written by hand (not by the code under test)."""
    import re

    pat = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out = {}
    for name, t in tensors.items():
        m = pat.match(name)
        if m:
            groups.setdefault(m[1], {})[(int(m[2]), m[3])] = t
        else:
            out[name] = t
    for prefix, grp in groups.items():
        num = 1 + max(e for e, _ in grp)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([grp[(e, "gate_proj")], grp[(e, "up_proj")]]) for e in range(num)])
        out[f"{prefix}.down_proj"] = torch.stack([grp[(e, "down_proj")] for e in range(num)])
    return out


def write_hf_checkpoint(dst: Path, spec: TinySpec) -> Path:
    """Write a tiny random checkpoint with transformers' save_pretrained (+ an MTP head at the root)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    config = hf_text_config(spec)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(random_state(spec), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if spec.tied:
        model.tie_weights()
    model.save_pretrained(dst)
    files = sorted(dst.glob("*.safetensors"))
    assert len(files) == 1, files
    tensors = load_file(files[0])
    if spec.with_mtp:
        tensors |= _mtp_tensors(spec, torch.Generator().manual_seed(spec.seed + 1000))
    if spec.moe and spec.fused_experts:
        tensors = _fuse_experts(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, files[0], metadata={"format": "pt"})
    if spec.with_mtp:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["mtp_num_hidden_layers"] = 1
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def convert_unified(src: Path, dst: Path, **kw) -> Path:
    from freetoken.converters import convert

    convert(src, dst, **kw)
    return dst


def load_unified(path: Path, *, with_mtp: bool = True, dtype: torch.dtype = torch.float32):
    from freetoken.checkpoint.reader import UnifiedCheckpoint
    from freetoken.models.loader import load_model

    ck = UnifiedCheckpoint.open(path)
    return load_model(ck, ck.family, ck.config, with_mtp=with_mtp, dtype=dtype)


def hf_model_from_dir(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' own loader on an HF directory, eager attention and experts (the oracle)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager", experts_implementation="eager")
    return model.eval()


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' fp32 logits [T, V] and post-norm hidden [T, H] of one sequence, no padding."""
    x = torch.tensor([ids])
    out = model(x, attention_mask=torch.ones_like(x), position_ids=torch.arange(len(ids))[None], output_hidden_states=True)
    return out.logits[0].float(), out.hidden_states[-1][0].float()


@torch.no_grad()
def run_rows(model, ids: list[int], *, block_size: int = 16):
    """One EXTEND forward of a fresh sequence through the engine's runner -> (hidden [T, H], engine, block table)."""
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import LLMEngine
    from freetoken.engine.runner import RowGroup, build_context
    from freetoken.forward_context import ForwardMode

    dtype = "bfloat16" if next(model.parameters()).dtype == torch.bfloat16 else "float32"
    device = next(model.parameters()).device.type  # the pools on the model's device
    engine = LLMEngine(model, EngineConfig(device=device, dtype=dtype, max_num_seqs=2, max_model_len=256, block_size=block_size))
    table: list[int] = []
    engine.kv_pool.grow(table, len(ids))
    slot = engine.state_pool.allocate()
    ctx = build_context([RowGroup(table, slot, 0, list(ids))], ForwardMode.EXTEND, engine.kv_pool, engine.state_pool, engine.device)
    return model(ctx), engine, table


def open_seqs(engine, prompts: list[list[int]], extra: int) -> list[tuple[list[int], int, list[int]]]:
    """One (block table, state slot, prompt) per prompt in the engine's pools, the table grown to the
    prompt's length + extra tokens."""
    seqs = []
    for ids in prompts:
        table: list[int] = []
        engine.kv_pool.grow(table, len(ids) + extra)
        seqs.append((table, engine.state_pool.allocate(), ids))
    return seqs


@torch.no_grad()
def our_mtp_logits(model, ids: list[int]) -> torch.Tensor:
    """Target rows, then every pair (h_t, x_{t+1}) through the MTP head as one sequence -> [T-1, V]."""
    from freetoken.engine.runner import RowGroup, build_context
    from freetoken.forward_context import ForwardMode

    hidden, engine, table = run_rows(model, ids)
    ctx = build_context([RowGroup(table, None, 0, ids[1:])], ForwardMode.EXTEND, engine.kv_pool, None, engine.device)
    return model.mtp.compute_logits(model.mtp(ctx, hidden[:-1]))


def fixture_refs(model: str, which: str = "hf_transformers") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(FIXTURES / model / "ref" / f"{which}.safetensors")


def num_sequences(refs: dict[str, torch.Tensor]) -> int:
    return len({k.split(".")[0] for k in refs})


@pytest.fixture(scope="session")
def fixture_unified(tmp_path_factory):
    """The shared fixtures converted once per session: model name -> unified checkpoint directory."""
    cache: dict[str, Path] = {}

    def get(model: str) -> Path:
        if model not in cache:
            cache[model] = convert_unified(FIXTURES / model / "hf", tmp_path_factory.mktemp(model) / "unified")
        return cache[model]

    return get


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """TinySpec -> (HF directory, unified directory), built once per session."""
    cache: dict[TinySpec, tuple[Path, Path]] = {}

    def get(spec: TinySpec) -> tuple[Path, Path]:
        if spec not in cache:
            root = tmp_path_factory.mktemp("tiny")
            hf = write_hf_checkpoint(root / "hf", spec)
            cache[spec] = (hf, convert_unified(hf, root / "unified"))
        return cache[spec]

    return get


def greedy(max_new_tokens: int, **kw):
    from freetoken.sampling import SamplingParams

    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=kw.pop("ignore_eos", True), **kw)

