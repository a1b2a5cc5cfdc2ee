"""Train a DFlash (v1) draft for the embedded default model on CPU.

Why: `freetoken generate --spec dflash` with no model needs a draft trained for the embedded target,
and a DFlash acceptance rate only means something for a draft trained on its target's features.

    python examples/train_dflash_demo.py --out DIR [--stdlib DIR] [--steps N] [--smoke]

The corpus is the same as examples/train_demo.py's: the stdlib .py files, split by sha1 of the
relative path (a file is held out iff sha1 % 4 == 0); training windows come from the training files
only, tokenized with the target's own tokenizer. The target runs once over the training windows;
its tapped layer outputs and its post-norm hidden stay in memory (bf16). That pass uses
train_demo.py's parallel form of the architecture with the target's weights, checked against
freetoken's own forward on one window (the largest difference goes into the log): freetoken's CPU
kernels run one row at a time, so that decode and verify agree bit for bit, about 900 tokens/s
here against about 6,800.

The draft then learns to predict, from the context rows of positions < a and the block
[x_a, mask x (B-1)], the target's next-token distribution at positions a+1 .. a+B-1 (teacher
forcing on the text), with the reference's decay weights w_j = exp(-(j-1)/gamma) over the slots.

Layout of this file:
  configs     DraftTrainConfig (default and smoke presets), the draft's DFlashConfig
  corpus      training windows from the training files, held-out windows, the held-out prompts
  target      tapped layers and post-norm hidden of the windows, checked against freetoken's forward
  draft       DFlashDraft with trainable parameters and its initialisation
  packed      several anchor blocks per window in one forward, with the training mask
  training    decay-weighted CE(text) + KL(target || draft), AdamW, cosine schedule
  output      z-lab layout (config.json, model.safetensors in bf16), train_log.json
  evaluation  slot agreement on held-out windows; greedy acceptance through freetoken's LLM
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from freetoken.errors import FreetokenError, OutputExistsError
from freetoken.kernels import apply_rope
from freetoken.spec.dflash.config import DFlashConfig
from freetoken.spec.dflash.draft import DFlashDraft

EXAMPLES = Path(__file__).resolve().parent
REPO = EXAMPLES.parent
MASK_TOKEN = "<|im_start|>"  # see DraftTrainConfig.mask_token


def _train_demo():
    """examples/train_demo.py as a module (its corpus functions)."""
    mod = sys.modules.get("train_demo")
    if mod is None:
        spec = importlib.util.spec_from_file_location("train_demo", EXAMPLES / "train_demo.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["train_demo"] = mod  # dataclasses look their module up while the class is built
        spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------------------- configs

@dataclass(frozen=True)
class DraftTrainConfig:
    """The draft's shape and the training run; every field is also a command-line option."""

    num_layers: int = 2
    intermediate_size: int = 512
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 4
    target_layers: tuple[int, ...] = (1, 4, 7)  # the last layer too: the stream the target's own prediction reads
    rope_theta: float = 1e7
    # The mask slots' token. `<|im_start|>` never occurs in the corpus (the target never saw it), and
    # in a chat prompt a role name always follows it, so it is never an anchor; `<|endoftext|>`
    # separates documents and `<|im_end|>` would end a chat turn.
    mask_token: str = MASK_TOKEN
    heldout_mod: int = 4
    max_train_files: int = 0  # 0 = all
    seq_len: int = 512
    num_windows: int = 1024  # training windows whose target features are cached (bf16)
    windows_per_step: int = 8
    anchors_per_window: int = 64
    steps: int = 1100
    lr: float = 5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float = 4.0  # slot decay w_j = exp(-(j-1)/gamma)
    ce_weight: float = 0.0  # CE against the text's tokens
    kd_weight: float = 1.0  # KL(target || draft) against the target's next-token distribution
    seed: int = 1234
    log_every: int = 50
    heldout_windows: int = 16
    eval_prompts: int = 50
    eval_new_tokens: int = 64
    eval_k: tuple[int, ...] = (1, 2, 3)

    def draft_config(self, hidden_size: int, mask_token_id: int) -> DFlashConfig:
        n = self.num_layers
        return DFlashConfig(
            architecture="DFlashDraftModel", hidden_size=hidden_size, num_hidden_layers=n, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, intermediate_size=self.intermediate_size,
            rms_norm_eps=1e-6, rope_theta=self.rope_theta, block_size=self.block_size, mask_token_id=mask_token_id,
            target_layer_ids=tuple(self.target_layers), layer_types=("full_attention",) * n, sliding_window=None,
            causal=(False,) * n, attention_bias=False,
        )


SMOKE = DraftTrainConfig(num_layers=1, intermediate_size=64, max_train_files=8, seq_len=64, num_windows=4, windows_per_step=2,
                         anchors_per_window=8, steps=3, warmup_steps=1, log_every=1, heldout_windows=2, eval_prompts=2,
                         eval_new_tokens=8, eval_k=(1,))

# ------------------------------------------------------------------------------------------ corpus

def corpus(stdlib: Path | None, cfg: DraftTrainConfig, prompts: list[str]) -> tuple[list[str], list[str], dict]:
    """(training texts, held-out texts, counts): train_demo's split of the stdlib at `stdlib`.

    A training file that contains a held-out prompt verbatim is dropped as well, so no prompt is
    ever seen in training whatever the stdlib version."""
    td = _train_demo()
    root, files = td.stdlib_files(stdlib)
    train, heldout = td.split_corpus(root, files, cfg.heldout_mod)
    texts = [td.read(p) for p in train]
    kept = [t for t in texts if not any(p in t for p in prompts)]
    info = {"stdlib": str(root), "train_files": len(kept), "train_files_dropped_for_prompts": len(texts) - len(kept),
            "heldout_files": len(heldout)}
    if cfg.max_train_files:
        kept = kept[: cfg.max_train_files]
    return kept, [td.read(p) for p in heldout], info


def pick_windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """n distinct non-overlapping windows [n, length] of the stream, in a seeded random order."""
    total = len(stream) // length
    if total < n:
        raise FreetokenError(f"the corpus gives {total} windows of {length} tokens, fewer than the {n} asked for")
    return _train_demo().windows(stream, torch.randperm(total, generator=gen)[:n] * length, length)


# ------------------------------------------------------------------------------------------ target

def demo_target(ckpt):
    """The target's weights in train_demo.py's parallel (training) form of the architecture, fp32."""
    td = _train_demo()
    model = td.Qwen35Demo(td.ModelConfig.from_hf(ckpt.config))
    names = [n for n in ckpt.tensor_names() if not n.startswith("dflash.")]  # a draft the target may already carry
    model.load_state_dict({name: ckpt.get(name).float() for name in names}, strict=True)
    return model.eval()


@torch.no_grad()
def demo_features(demo, windows: torch.Tensor, taps: tuple[int, ...], group: int = 8, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows [n, L] from position 0 -> (the tapped layers' outputs [n, L, taps*H], post-norm hidden
    [n, L, H]), computed in fp32 and stored in `dtype`."""
    feats, hidden = [], []
    for i in range(0, len(windows), group):
        ids = windows[i : i + group]
        x = demo.model.embed_tokens(ids)
        cos, sin = demo._rope(ids.shape[1], 0, ids.device)
        outs = {}
        for layer_id, layer in enumerate(demo.model.layers):
            x, _ = layer(x, cos, sin)
            outs[layer_id] = x
        feats.append(torch.cat([outs[t] for t in taps], dim=-1).to(dtype))
        hidden.append(demo.model.norm(x).to(dtype))
    return torch.cat(feats), torch.cat(hidden)


@torch.no_grad()
def runtime_features(model, ids: list[int], taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """freetoken's own forward (EXTEND from position 0) -> (exported layers [T, taps*H], post-norm hidden [T, H])."""
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import LLMEngine
    from freetoken.engine.runner import RowGroup, build_context
    from freetoken.forward_context import ForwardMode

    engine = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=len(ids), max_num_batched_tokens=len(ids)))
    table: list[int] = []
    engine.kv_pool.grow(table, len(ids))
    ctx = build_context([RowGroup(table, engine.state_pool.allocate(), 0, list(ids))], ForwardMode.EXTEND, engine.kv_pool, engine.state_pool, engine.device)
    hidden, feats = model(ctx, export_layers=taps)
    return feats, hidden


def check_features(ckpt, demo, window: torch.Tensor, taps: tuple[int, ...], tolerance: float = 1e-3) -> float:
    """Max |demo - runtime| over the tapped features and the post-norm hidden of one window; raises past tolerance."""
    from freetoken.models.loader import load_model

    runtime = load_model(ckpt, ckpt.family, ckpt.config, with_mtp=False, origin=str(ckpt.path)).eval()
    feats, hidden = runtime_features(runtime, window.tolist(), taps)
    ours_f, ours_h = demo_features(demo, window[None], taps, dtype=torch.float32)
    diff = max((ours_f[0] - feats).abs().max().item(), (ours_h[0] - hidden).abs().max().item())
    if diff > tolerance:
        raise FreetokenError(f"the training-form target differs from freetoken's forward by {diff:.2e} (> {tolerance})")
    return diff


# ------------------------------------------------------------------------------------------- draft

def new_draft(cfg: DFlashConfig, seed: int) -> DFlashDraft:
    """A DFlashDraft with trainable parameters: norms at one, matrices N(0, 0.02), the residual
    outputs (o_proj, down_proj) scaled by 1/sqrt(2 * layers)."""
    draft = DFlashDraft(cfg)
    gen = torch.Generator().manual_seed(seed)
    resid = 0.02 / math.sqrt(2 * cfg.num_hidden_layers)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (resid if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02))
    return draft.requires_grad_(True)


# ------------------------------------------------------------------------------------------ packed

def packed_mask(anchors: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """[W, 1, n*B, L + n*B] bool (True = attend) for n blocks per window at anchors [W, n]: a slot of
    block b sees the context rows at positions < anchors[b] and the B slots of block b, nothing else."""
    W, n = anchors.shape
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [W, nB]
    ctx = torch.arange(length, device=anchors.device)[None, None, :] < q_anchor[..., None]  # [W, nB, L]
    block = torch.arange(n, device=anchors.device).repeat_interleave(block_size)
    own = (block[:, None] == block[None, :]).expand(W, -1, -1)  # [W, nB, nB]
    return torch.cat([ctx, own], dim=-1)[:, None]


def packed_forward(draft: DFlashDraft, features: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """`DFlashDraft.forward` for n blocks per window at once, with its parameters.

    features [W, L, taps*H]: the target's tapped outputs at positions 0..L-1 of each window;
    block_embeds [W, n, B, H]: the target's embeddings of [x_a, mask x (B-1)] per block;
    anchors [W, n]: block b sits at positions anchors[b] .. anchors[b]+B-1 and sees context rows
    0 .. anchors[b]-1 (`packed_mask`). Returns the normed hidden [W, n, B, H]."""
    cfg = draft.config
    if any(cfg.causal) or any(t != "full_attention" for t in cfg.layer_types):
        raise FreetokenError("packed_forward covers full, bidirectional draft layers only")
    W, L, _ = features.shape
    n, B, H = anchors.shape[1], cfg.block_size, cfg.hidden_size
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inv_freq = draft._inv_freq(features.device)
    context = draft.context(features.reshape(W * L, -1))
    ctx_pos = torch.arange(L, device=features.device).repeat(W)
    pos = (anchors[..., None] + torch.arange(B, device=features.device)).reshape(-1)
    mask = packed_mask(anchors, L, B)
    x = block_embeds.reshape(W * n * B, H)
    for layer in draft.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = apply_rope(attn.q_norm(attn.q_proj(h).view(-1, nh, hd)), pos, inv_freq)
        kb, vb = attn.kv(h, pos, inv_freq)  # [kv, W*n*B, hd]
        kc, vc = attn.kv(context, ctx_pos, inv_freq)  # [kv, W*L, hd]
        k = torch.cat([kc.view(nkv, W, L, hd), kb.view(nkv, W, n * B, hd)], dim=2).transpose(0, 1)
        v = torch.cat([vc.view(nkv, W, L, hd), vb.view(nkv, W, n * B, hd)], dim=2).transpose(0, 1)
        q = q.view(W, n * B, nh, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale, enable_gqa=True)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(W * n * B, nh * hd))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return draft.norm(x).view(W, n, B, H)


def sample_anchors(W: int, n: int, length: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    """[W, n] distinct anchors per window in 1 .. L-B (every slot's target lies inside the window)."""
    return torch.stack([torch.randperm(length - block_size, generator=gen)[:n] + 1 for _ in range(W)])


# ---------------------------------------------------------------------------------------- training

def block_losses(draft, embed: torch.Tensor, feats, hidden, tokens, anchors, cfg: DraftTrainConfig, mask_id: int) -> dict[str, torch.Tensor]:
    """Decay-weighted losses of the blocks at anchors [W, n] of windows (feats, hidden, tokens [W, L]).

    Slot j (1..B-1) of the block at a predicts the token at a+j: CE against the text's token, and
    KL from the target's distribution at a+j (its logits at a+j-1) to the draft's. Also returns the
    per-slot agreement of the draft's argmax with the target's."""
    B, H = cfg.block_size, embed.shape[1]
    W, n = anchors.shape
    ids = torch.full((W, n, B), mask_id, dtype=torch.long)
    ids[..., 0] = torch.gather(tokens, 1, anchors)
    out = packed_forward(draft, feats, embed[ids], anchors)  # [W, n, B, H]
    logq = F.log_softmax(F.linear(out[:, :, 1:].reshape(-1, H), embed), dim=-1)  # [W*n*(B-1), V], slots 1..B-1
    where = (anchors[..., None] + torch.arange(1, B)).view(W, -1)  # positions predicted
    text = torch.gather(tokens, 1, where).view(-1)
    prev = torch.gather(hidden, 1, (where - 1)[..., None].expand(-1, -1, H)).view(-1, H)
    with torch.no_grad():
        teacher = F.log_softmax(F.linear(prev, embed), dim=-1)
    ce = -logq.gather(1, text[:, None]).view(-1, B - 1)  # [W*n, B-1]
    kd = (teacher.exp() * (teacher - logq)).sum(-1).view(-1, B - 1)
    w = torch.exp(-torch.arange(B - 1, dtype=torch.float) / cfg.gamma)
    w = w / w.sum()
    agree = (logq.argmax(-1) == teacher.argmax(-1)).float().view(-1, B - 1).mean(0)
    ce_w, kd_w = (ce.mean(0) * w).sum(), (kd.mean(0) * w).sum()
    return {"loss": cfg.ce_weight * ce_w + cfg.kd_weight * kd_w, "ce": ce_w, "kd": kd_w, "agree": agree}


def train(draft, embed, feats, hidden, tokens, cfg: DraftTrainConfig, mask_id: int) -> list[dict]:
    """AdamW over `cfg.steps` steps of windows_per_step windows x anchors_per_window blocks, in a seeded order."""
    decay = [p for p in draft.parameters() if p.ndim >= 2]
    no_decay = [p for p in draft.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    n_windows = feats.shape[0]
    order = torch.cat([torch.randperm(n_windows, generator=gen) for _ in range(cfg.steps * cfg.windows_per_step // n_windows + 1)])
    log, t0 = [], time.time()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = _train_demo().lr_at(step, cfg)  # the same warm-up and cosine schedule
        w = order[step * cfg.windows_per_step : (step + 1) * cfg.windows_per_step]
        anchors = sample_anchors(len(w), cfg.anchors_per_window, cfg.seq_len, cfg.block_size, gen)
        stats = block_losses(draft, embed, feats[w].float(), hidden[w].float(), tokens[w], anchors, cfg, mask_id)
        opt.zero_grad(set_to_none=True)
        stats["loss"].backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
        opt.step()
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            row = {"step": step, "loss": stats["loss"].item(), "ce": stats["ce"].item(), "kd": stats["kd"].item(),
                   "agree": [round(a, 4) for a in stats["agree"].tolist()], "seconds": time.time() - t0}
            log.append(row)
            print(f"step {step:4d}  loss {row['loss']:.4f}  ce {row['ce']:.4f}  kd {row['kd']:.4f}  agree {row['agree']}  "
                  f"{row['seconds'] / (step + 1) * 1000:.0f} ms/step", flush=True)
    return log


# ------------------------------------------------------------------------------------------ output

def save_draft(draft: DFlashDraft, out: Path, num_target_layers: int, vocab_size: int) -> None:
    """z-lab layout: config.json (Qwen3 backbone, dflash_config) and model.safetensors in bf16."""
    c = draft.config
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "intermediate_size": c.intermediate_size,
        "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": None,
        "attention_bias": False, "attention_dropout": 0.0, "max_position_embeddings": 4096, "vocab_size": vocab_size,
        "tie_word_embeddings": False, "layer_types": list(c.layer_types), "use_sliding_window": False, "sliding_window": None,
        "is_causal": False, "block_size": c.block_size, "num_target_layers": num_target_layers,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in draft.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})


# -------------------------------------------------------------------------------------- evaluation

@torch.no_grad()
def heldout_agreement(draft, embed, feats, hidden, tokens, cfg: DraftTrainConfig, mask_id: int) -> dict:
    """Per slot, how often the draft's argmax equals the target's on held-out windows (every anchor
    once, teacher forcing on the text), and the mean run of leading agreements + 1 per block."""
    B, L = cfg.block_size, cfg.seq_len
    agree = []
    for w in range(feats.shape[0]):
        anchors = torch.arange(1, L - B + 1)[None]
        ids = torch.full((1, anchors.shape[1], B), mask_id, dtype=torch.long)
        ids[..., 0] = tokens[w : w + 1, anchors[0]]
        out = packed_forward(draft, feats[w : w + 1].float(), embed[ids], anchors)
        pred = F.linear(out[0, :, 1:], embed).argmax(-1)  # [n, B-1]
        where = anchors[0, :, None] + torch.arange(1, B)
        agree.append(pred == F.linear(hidden[w].float()[where - 1], embed).argmax(-1))
    a = torch.cat(agree).float()
    return {"slot_agreement": a.mean(0).tolist(), "mean_run_plus_one": (a.cumprod(-1).sum(-1) + 1).mean().item(), "blocks": a.shape[0]}


def acceptance(target: Path, draft_dir: Path, prompts: list[str], cfg: DraftTrainConfig) -> dict:
    """Greedy `--spec dflash` through freetoken's LLM on the prompts, for each k in cfg.eval_k, fp32 on
    CPU as `freetoken generate` runs: the target with the written (bf16) draft, read and checked by
    the converter's `read_dflash` and built by the runtime's `load_draft` (in place of any draft the
    target already carries)."""
    from freetoken.converters.dflash import read_dflash
    from freetoken.engine.config import EngineConfig
    from freetoken.llm import LLM
    from freetoken.sampling import SamplingParams
    from freetoken.spec.dflash.loader import load_draft

    llm = LLM(target, EngineConfig(max_num_seqs=16, max_model_len=8192))
    draft = read_dflash(draft_dir, llm.checkpoint.config)
    tensors = dict(draft.tensors())
    source = type("Tensors", (), {"get": staticmethod(tensors.__getitem__)})
    config = llm.model.config
    llm.model.attached_drafts["dflash"] = load_draft(source, draft.config.to_dict(), config.num_hidden_layers, config.hidden_size, config.vocab_size,
                                                     device="cpu", dtype=torch.float32, origin=str(draft_dir))
    results = {}
    for k in cfg.eval_k:
        engine = replace(llm.config, spec="dflash", num_draft_tokens=k)
        _, stats = llm.generate(prompts, SamplingParams(max_new_tokens=cfg.eval_new_tokens), config=engine)
        results[f"k{k}"] = asdict(stats)
        print(f"k={k}: acceptance per position {[round(a, 3) for a in stats.acceptance_per_position]}, "
              f"mean accepted length {stats.mean_accepted_len:.3f} ({stats.decode_steps} target steps, {stats.seconds:.0f} s)", flush=True)
    return results


# -------------------------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    from freetoken.llm import DEFAULT_MODEL_DIR

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output draft directory (z-lab layout)")
    ap.add_argument("--target", type=Path, default=DEFAULT_MODEL_DIR, help="the target, a unified checkpoint (default: the embedded model)")
    ap.add_argument("--stdlib", type=Path, default=None, help="the stdlib to take the corpus from (default: this interpreter's)")
    ap.add_argument("--prompts", type=Path, default=REPO / "bench" / "data" / "heldout_prompts.jsonl", help="held-out prompts (JSONL)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps (for tests)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--force", action="store_true", help="write into a non-empty --out")
    for name, field in DraftTrainConfig.__dataclass_fields__.items():
        if name == "mask_token":
            continue
        flag = "--" + name.replace("_", "-")
        if field.type == "tuple[int, ...]":
            ap.add_argument(flag, type=lambda s: tuple(int(x) for x in s.split(",")), default=None, help="comma-separated ints")
        else:
            ap.add_argument(flag, type={"int": int, "float": float}[field.type], default=None)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    from tokenizers import Tokenizer

    from freetoken.checkpoint import UnifiedCheckpoint

    args = parse_args(argv)
    t0 = time.time()
    cfg = SMOKE if args.smoke else DraftTrainConfig()
    cfg = replace(cfg, **{k: v for k, v in vars(args).items() if k in DraftTrainConfig.__dataclass_fields__ and v is not None})
    if args.out.exists() and any(args.out.iterdir()) and not args.force:
        raise OutputExistsError("output directory is not empty (pass --force)", args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(cfg.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)

    ckpt = UnifiedCheckpoint.open(args.target)
    target = demo_target(ckpt)
    tok = Tokenizer.from_file(str(ckpt.tokenizer_path))
    eos, mask_id = ckpt.config["eos_token_ids"][0], tok.token_to_id(cfg.mask_token)
    embed = target.model.embed_tokens.weight.detach()
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()]
    train_texts, heldout_texts, info = corpus(args.stdlib, cfg, prompts)
    stream = _train_demo().token_stream(tok, train_texts, eos)
    gen = torch.Generator().manual_seed(cfg.seed)
    windows = pick_windows(stream, cfg.num_windows, cfg.seq_len, gen)
    held = pick_windows(_train_demo().token_stream(tok, heldout_texts, eos), cfg.heldout_windows, cfg.seq_len, gen)
    info |= {"train_tokens": len(stream), "window_tokens": windows.numel(), "mask_token_id": mask_id}
    print(f"corpus: {info}; setup {time.time() - t0:.1f}s", flush=True)

    t_feat = time.time()
    info["max_diff_vs_runtime"] = check_features(ckpt, target, windows[0], cfg.target_layers)
    feats, hidden = demo_features(target, windows, cfg.target_layers)
    held_feats, held_hidden = demo_features(target, held, cfg.target_layers)
    feature_seconds = time.time() - t_feat
    print(f"target features: {tuple(feats.shape)} in {feature_seconds:.0f}s; "
          f"max |difference| from freetoken's forward on one window {info['max_diff_vs_runtime']:.2e}", flush=True)

    draft = new_draft(cfg.draft_config(ckpt.config["hidden_size"], mask_id), cfg.seed)
    n_params = sum(p.numel() for p in draft.parameters())
    print(f"draft: {n_params / 1e6:.3f}M parameters ({2 * n_params / 2**20:.2f} MiB in bf16)", flush=True)
    t_train = time.time()
    curve = train(draft, embed, feats, hidden, windows, cfg, mask_id)
    train_seconds = time.time() - t_train
    draft.eval()
    save_draft(draft, args.out, ckpt.config["num_hidden_layers"], ckpt.config["vocab_size"])
    heldout = heldout_agreement(draft, embed, held_feats, held_hidden, held, cfg, mask_id)
    print(f"held-out slot agreement {[round(a, 3) for a in heldout['slot_agreement']]}, "
          f"mean run + 1 {heldout['mean_run_plus_one']:.3f}", flush=True)
    del feats, hidden
    accept = acceptance(args.target, args.out, prompts[: cfg.eval_prompts], cfg)
    from freetoken.bench import environment

    env = {k: v for k, v in environment().items() if k in ("date", "commit", "torch")}
    log = {
        "command": "python " + " ".join([str(Path(sys.argv[0]).relative_to(REPO)) if Path(sys.argv[0]).is_relative_to(REPO) else sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        **env, "train_config": asdict(cfg), "draft_config": draft.config.to_dict(), "draft_params": n_params, "corpus": info,
        "final_loss": curve[-1]["loss"], "curve": curve, "heldout": heldout, "acceptance": accept,
        "feature_seconds": feature_seconds, "train_seconds": train_seconds, "wall_seconds": time.time() - t0,
        "threads": args.threads, "python": platform.python_version(), "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
    }
    (args.out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    return log


if __name__ == "__main__":
    try:
        main()
    except FreetokenError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
