"""Train the small embedded default model: a Qwen3.5 dense trunk plus its MTP head.

Why: `freetoken generate` and `freetoken parity` must do something real with no downloads, and an
MTP acceptance rate only means something for a head trained together with its target. The corpus
is the Python standard library of the running interpreter, so the script needs nothing but Python.

    python examples/train_demo.py --out DIR [--device cuda] [--steps N] [--smoke]

Layout of this file:
  configs      ModelConfig (the HF text config, flat) and TrainConfig, each with a default and a smoke preset
  corpus       stdlib .py files, a hash split into train / held-out, 50 held-out prompts
  tokenizer    byte-level BPE with Qwen3.5's split regex, special tokens at the top ids
  model        the Qwen3.5 dense architecture in parallel (training) form, HF parameter names,
               GatedDeltaNet as a chunked delta rule, gated attention through SDPA, the MTP head
  training     CE(next) + w * (CE(MTP, t+2) + KL(target || MTP)), AdamW, cosine schedule
  evaluation   held-out loss / top-1, MTP agreement with the target, chained k=3 acceptance on prompts
  output       config.json, model.safetensors (bf16, tied, mtp.* at the root), tokenizer files, train_log.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from freetoken.errors import FreetokenError, OutputExistsError

# ----------------------------------------------------------------------------------------- configs

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # eos/pad first; they take the top ids
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 5120
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 8
    full_attention_interval: int = 4  # layer i is full attention iff (i + 1) % interval == 0
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    eos_token_id: int = 5117

    @property
    def layer_types(self) -> list[str]:
        n = self.full_attention_interval
        return ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(self.num_hidden_layers)]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Read a HF config.json dict (flat text config or image-text with `text_config`)."""
        text = cfg.get("text_config", cfg)
        rope = text.get("rope_parameters") or text
        kinds = text.get("layer_types")
        interval = text.get("full_attention_interval", 4)
        if kinds is not None and kinds != [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(kinds))
        ]:
            raise FreetokenError("layer_types is not every-n-th full attention; this demo model cannot load it")
        names = {f for f in cls.__dataclass_fields__} - {"rope_theta", "partial_rotary_factor", "tie_word_embeddings"}
        kw = {k: text[k] for k in names if k in text}
        tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return cls(**kw, rope_theta=rope.get("rope_theta", 1e7),
                   partial_rotary_factor=rope.get("partial_rotary_factor", 0.25), tie_word_embeddings=tie)

    def to_hf(self) -> dict:
        """The `qwen3_5_text` config.json that transformers' Qwen3_5ForCausalLM loads."""
        half = self.rotary_dim // 2
        section = [half - 2 * (half // 3), half // 3, half // 3]  # sums to rotary_dim / 2
        d = {k: v for k, v in asdict(self).items() if k not in ("rope_theta", "partial_rotary_factor")}
        return {
            "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", **d,
            "layer_types": self.layer_types, "pad_token_id": self.eos_token_id, "bos_token_id": None,
            "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "max_position_embeddings": 4096,
            "initializer_range": 0.02, "use_cache": True, "dtype": "bfloat16",
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor,
                                "mrope_section": section, "mrope_interleaved": True},
            "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "attn_output_gate": True,
            "mamba_ssm_dtype": "float32",
        }


@dataclass(frozen=True)
class TrainConfig:
    tokenizer_vocab: int = 5120  # including the special tokens
    heldout_mod: int = 4  # a file is held out iff sha1(relative path) % heldout_mod == 0
    max_train_files: int = 0  # 0 = all
    seq_len: int = 512
    batch_size: int = 32
    steps: int = 800
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.5  # loss = CE + mtp_weight * (CE_mtp + kd_weight * KL(target || mtp))
    kd_weight: float = 1.0
    mtp_grad_to_trunk: bool = True
    seed: int = 1234
    log_every: int = 50
    eval_windows: int = 64  # held-out windows of seq_len for the teacher-forced metrics
    eval_prompts: int = 50
    eval_new_tokens: int = 64  # greedy tokens generated per prompt for the chained-acceptance check
    draft_k: int = 3


SMOKE_MODEL = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32, eos_token_id=509)
SMOKE_TRAIN = TrainConfig(tokenizer_vocab=512, max_train_files=12, seq_len=64, batch_size=2, steps=4, lr=3e-3,
                          warmup_steps=1, log_every=1, eval_windows=2, eval_prompts=4, eval_new_tokens=8)

# ------------------------------------------------------------------------------------------ corpus

EXCLUDED_PARTS = {"test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages", "encodings"}


def stdlib_files(root: Path | None = None) -> tuple[Path, list[Path]]:
    """All stdlib .py sources except tests, IDLE, installed packages and the generated codec tables,
    under `root` (default: the running interpreter's stdlib)."""
    root = Path(root or sysconfig.get_paths()["stdlib"]).resolve()
    files = [p for p in sorted(root.rglob("*.py"))
             if p.is_file() and not EXCLUDED_PARTS & set(p.relative_to(root).parts)]
    return root, files


def is_heldout(rel: str, mod: int) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % mod == 0


def split_corpus(root: Path, files: list[Path], mod: int) -> tuple[list[Path], list[Path]]:
    heldout = [p for p in files if is_heldout(p.relative_to(root).as_posix(), mod)]
    train = [p for p in files if not is_heldout(p.relative_to(root).as_posix(), mod)]
    return train, heldout


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def heldout_prompts(root: Path, heldout: list[Path], n: int) -> list[dict]:
    """n prompts of 200-400 characters, cut at line boundaries, one per held-out file.

    Files are visited in sha1 order of their relative path; in each, the prompt starts at the first
    non-blank, unindented line at or after a third of the file and takes whole lines while <= 400 chars.
    """
    prompts = []
    for p in sorted(heldout, key=lambda q: hashlib.sha1(q.relative_to(root).as_posix().encode()).hexdigest()):
        lines = read(p).splitlines(keepends=True)
        for start in range(len(lines) // 3, len(lines)):
            if not lines[start].strip() or lines[start][0].isspace():
                continue
            text = ""
            for line in lines[start:]:
                if len(text) + len(line) > 400:
                    break
                text += line
            if len(text) >= 200:
                prompts.append({"prompt": text, "file": p.relative_to(root).as_posix()})
                break
        if len(prompts) == n:
            return prompts
    raise FreetokenError(f"only {len(prompts)} held-out files give a 200-400 character prompt, need {n}", root)


# --------------------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE of vocab_size tokens (specials included), deterministic for a fixed text list."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def save_tokenizer(tok, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    cfg = {"backend": "tokenizers", "tokenizer_class": "TokenizersBackend", "clean_up_tokenization_spaces": False,
           "eos_token": SPECIAL_TOKENS[0], "pad_token": SPECIAL_TOKENS[0], "extra_special_tokens": list(SPECIAL_TOKENS[1:]),
           "model_max_length": 4096, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# ------------------------------------------------------------------------------------------- model

class ZCRMSNorm(nn.Module):
    """Zero-centred RMSNorm: x / rms(x) * (1 + w), in fp32, cast back at the end."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """GDN output norm: w * x / rms(x) * silu(z) (not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # [..., dv], [..., dv]
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * y * F.silu(z.float())).to(x.dtype)


def rope(pos: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary_dim] for positions pos [T] (NeoX layout: the half-frequencies repeated)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, device=pos.device, dtype=torch.float) / rotary_dim)
    f = pos.float()[:, None] * inv_freq
    f = torch.cat([f, f], -1)
    return f.cos(), f.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x [B, h, T, hd]
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    rot = torch.cat([-xr[..., rd // 2:], xr[..., : rd // 2]], -1)
    return torch.cat([xr * cos.to(x.dtype) + rot * sin.to(x.dtype), xp], -1)


class Attention(nn.Module):
    """Gated full attention: q_proj rows interleave [q_h ; gate_h] per head, q/k norm, partial RoPE, GQA."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.nh * self.hd * 2, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)
        self.q_norm = ZCRMSNorm(self.hd, c.rms_norm_eps)
        self.k_norm = ZCRMSNorm(self.hd, c.rms_norm_eps)

    def forward(self, x, cos, sin, kv_prefix=None, mask=None):
        """x [B, T, H]; kv_prefix: (k, v) [B, nkv, S, hd] attended before x's own keys, with mask [T, S + T]
        (True = attend); without a mask the attention is causal. Returns (out [B, T, H], (k, v) of x)."""
        B, T, _ = x.shape
        q, gate = self.q_proj(x).view(B, T, self.nh, 2 * self.hd).split(self.hd, -1)
        q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd)).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        kk, vv = (k, v) if kv_prefix is None else (torch.cat([kv_prefix[0], k], 2), torch.cat([kv_prefix[1], v], 2))
        o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        o = o.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(o), (k, v)


def chunked_gated_delta(q, k, v, g, beta, chunk: int = 64) -> torch.Tensor:
    """Gated delta rule, parallel within chunks (WY form), sequential over chunks; fp32, differentiable.

    q, k [B, T, h, dk] (normalised, q scaled), v [B, T, h, dv], g (log decay <= 0), beta [B, T, h].
    Per head: S <- e^g S; delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q. Returns o [B, T, h, dv].
    """
    B, T, h, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    n = (T + pad) // chunk
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2).reshape(B, h, n, chunk, -1) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(1, 2).reshape(B, h, n, chunk) for x in (g, beta))
    tril = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    G = g @ tril.float().T  # in-chunk cumulative log decay, as a matmul (deterministic on every device)
    decay = torch.where(tril, G[..., :, None] - G[..., None, :], float("-inf")).exp()  # [.., C, C] e^{G_i - G_j}, j <= i
    kb = k * beta[..., None]
    A = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)  # strictly lower: beta_i e^{Gi-Gj} k_i.k_j
    L = A + torch.eye(chunk, device=q.device)
    sol = torch.linalg.solve_triangular(L, torch.cat([v * beta[..., None], kb * G.exp()[..., None]], -1), upper=False)
    u, w = sol.split([dv, dk], -1)  # delta = u - w S_0 within each chunk
    intra = (q @ k.transpose(-1, -2)) * decay
    qd = q * G.exp()[..., None]
    kd = k * (G[..., -1:] - G).exp()[..., None]
    cd = G[..., -1].exp()[..., None, None]
    S = q.new_zeros(B, h, dk, dv)
    outs = []
    for i in range(n):
        delta = u[:, :, i] - w[:, :, i] @ S
        outs.append(qd[:, :, i] @ S + intra[:, :, i] @ delta)
        S = S * cd[:, :, i] + kd[:, :, i].transpose(-1, -2) @ delta
    return torch.stack(outs, 2).reshape(B, h, n * chunk, dv)[:, :, :T].transpose(1, 2)


class GatedDeltaNet(nn.Module):
    """Qwen3.5 linear attention: causal depthwise conv + silu, l2-normed q/k, GVA, delta rule, gated norm."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.nk, self.nv, self.dk, self.dv = (c.linear_num_key_heads, c.linear_num_value_heads,
                                              c.linear_key_head_dim, c.linear_value_head_dim)
        conv_dim = 2 * self.nk * self.dk + self.nv * self.dv
        self.in_proj_qkv = nn.Linear(c.hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, self.nv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, self.nv, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, self.nv, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, c.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.norm = GatedRMSNorm(self.dv, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.nv * self.dv, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, H]
        B, T, _ = x.shape
        u = self.in_proj_qkv(x)  # [B, T, C]
        w = self.conv1d.weight[:, 0]  # [C, K]
        K = w.shape[1]
        up = F.pad(u, (0, 0, K - 1, 0))
        c = F.silu(sum(up[:, j:j + T] * w[:, j] for j in range(K)))  # causal: c[t] = sum_j w_j u[t-K+1+j]
        q, k, v = c.split([self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], -1)
        r = self.nv // self.nk
        with torch.autocast(x.device.type, enabled=False):
            q = q.float().reshape(B, T, self.nk, self.dk).repeat_interleave(r, 2)
            k = k.float().reshape(B, T, self.nk, self.dk).repeat_interleave(r, 2)
            q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * self.dk ** -0.5
            k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
            beta = torch.sigmoid(self.in_proj_b(x).float())
            g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
            o = chunked_gated_delta(q, k, v.float().reshape(B, T, self.nv, self.dv), g, beta)
        z = self.in_proj_z(x).reshape(B, T, self.nv, self.dv)
        return self.out_proj(self.norm(o.to(x.dtype), z).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(c)
        else:
            self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = ZCRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = ZCRMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, kv_prefix=None, mask=None):
        """x [B, T, H] -> (x [B, T, H], (k, v) of an attention layer or None)."""
        kv = None
        if self.kind == "linear_attention":
            a = self.linear_attn(self.input_layernorm(x))
        else:
            a, kv = self.self_attn(self.input_layernorm(x), cos, sin, kv_prefix, mask)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class TextModel(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, kind) for kind in c.layer_types)
        self.norm = ZCRMSNorm(c.hidden_size, c.rms_norm_eps)


class MTPHead(nn.Module):
    """u = fc([norm_e(embed(x_{t+1})) ; norm_h(h_t)]); one full-attention layer; mtp.norm; shared lm_head."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.pre_fc_norm_embedding = ZCRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.pre_fc_norm_hidden = ZCRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(c, "full_attention")])
        self.norm = ZCRMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen35Demo(nn.Module):
    """Trunk + MTP head; state_dict keys are exactly the HF checkpoint names (model.*, mtp.*, lm_head if untied)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.config = c
        self.model = TextModel(c)
        self.mtp = MTPHead(c)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def _rope(self, T: int, start: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        return rope(torch.arange(start, start + T, device=device), self.config.rotary_dim, self.config.rope_theta)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> hidden after the final norm [B, T, H] (positions 0..T-1)."""
        x = self.model.embed_tokens(ids)
        cos, sin = self._rope(ids.shape[1], 0, ids.device)
        for layer in self.model.layers:
            x, _ = layer(x, cos, sin)
        return self.model.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, V]
        return F.linear(h, self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)

    def mtp_input(self, h: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:  # [B, T, H], [B, T]
        e = self.mtp.pre_fc_norm_embedding(self.model.embed_tokens(next_ids))
        return self.mtp.fc(torch.cat([e, self.mtp.pre_fc_norm_hidden(h)], -1))

    def mtp_forward(self, h: torch.Tensor, next_ids: torch.Tensor, kv_prefix=None, mask=None, start: int = 1):
        """Pairs (h_t, x_{t+1}) [B, T, H], [B, T] at positions start.. -> (h' after mtp.norm [B, T, H], (k, v))."""
        cos, sin = self._rope(h.shape[1], start, h.device)
        u, kv = self.mtp.layers[0](self.mtp_input(h, next_ids), cos, sin, kv_prefix, mask)
        return self.mtp.norm(u), kv


def init_weights(m: Qwen35Demo, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    resid = 0.02 / math.sqrt(2 * (m.config.num_hidden_layers + 1))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * resid)
            elif name.endswith("conv1d.weight"):
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) / math.sqrt(p.shape[-1]))
            elif name.endswith("A_log"):
                p.copy_(torch.log(1 + 15 * torch.rand(p.shape, generator=gen)))
            elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif p.ndim == 1:  # zero-centred norms
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def load_demo(path: Path, dtype=torch.float32) -> Qwen35Demo:
    """Load a checkpoint written by this script (or a Qwen3.5 dense HF checkpoint) into the training model."""
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    m = Qwen35Demo(cfg)
    sd = {}
    for f in sorted(path.glob("*.safetensors")):
        for k, v in load_file(f).items():
            k = k.replace("model.language_model.", "model.")
            if not k.startswith("model.visual."):
                sd[k] = v.to(dtype)
    m.load_state_dict(sd, strict=True)
    return m.to(dtype)


# ---------------------------------------------------------------------------------------- training

def losses(m: Qwen35Demo, x: torch.Tensor, t: TrainConfig) -> dict[str, torch.Tensor]:
    """x [B, L+1]: CE of x[t+1] from the trunk, CE of x[t+2] from the MTP pair (h_t, x_{t+1}),
    and KL from the trunk's (detached) distribution at t+1 to the MTP's at t."""
    h = m(x[:, :-1])
    logits = m.logits(h).float()
    V = logits.shape[-1]
    ce = F.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1))
    hm, _ = m.mtp_forward(h[:, :-1] if t.mtp_grad_to_trunk else h[:, :-1].detach(), x[:, 1:-1])
    mlog = m.logits(hm).float()
    ce_mtp = F.cross_entropy(mlog.reshape(-1, V), x[:, 2:].reshape(-1))
    teacher = F.log_softmax(logits[:, 1:].detach(), -1)
    kd = F.kl_div(F.log_softmax(mlog, -1), teacher, log_target=True, reduction="none").sum(-1).mean()
    loss = ce + t.mtp_weight * (ce_mtp + t.kd_weight * kd)
    return {"loss": loss, "ce": ce, "ce_mtp": ce_mtp, "kd": kd}


def lr_at(step: int, t: TrainConfig) -> float:
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    p = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def batch_starts(n_tokens: int, t: TrainConfig) -> torch.Tensor:
    """The fixed data order: [steps, batch] window starts drawn from a seeded CPU generator."""
    gen = torch.Generator().manual_seed(t.seed + 1)
    return torch.randint(0, n_tokens - t.seq_len - 1, (t.steps, t.batch_size), generator=gen)


def token_stream(tok, texts: list[str], eos: int) -> torch.Tensor:
    """The texts' ids, each followed by eos, as one stream [n] int64."""
    ids: list[int] = []
    for e in tok.encode_batch(texts):
        ids += e.ids + [eos]
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:  # -> [B, length]
    return stream[starts[:, None] + torch.arange(length)]


# -------------------------------------------------------------------------------------- evaluation

@torch.no_grad()
def eval_heldout(m: Qwen35Demo, stream: torch.Tensor, t: TrainConfig, device, amp) -> dict[str, float]:
    """Teacher-forced metrics on non-overlapping held-out windows."""
    L = t.seq_len
    n = min(t.eval_windows, (len(stream) - 1) // (L + 1))
    x = windows(stream, torch.arange(n) * (L + 1), L + 1).to(device)
    sums = {"ce": 0.0, "top1": 0.0, "mtp_top1": 0.0, "mtp_agree": 0.0}
    for i in range(0, n, t.batch_size):
        xb = x[i:i + t.batch_size]
        with amp():
            h = m(xb[:, :-1])
            logits = m.logits(h).float()
            hm, _ = m.mtp_forward(h[:, :-1], xb[:, 1:-1])
            mpred = m.logits(hm).argmax(-1)
        w = len(xb) / n
        sums["ce"] += w * F.cross_entropy(logits.reshape(-1, logits.shape[-1]), xb[:, 1:].reshape(-1)).item()
        pred = logits.argmax(-1)
        sums["top1"] += w * (pred == xb[:, 1:]).float().mean().item()
        sums["mtp_top1"] += w * (mpred == xb[:, 2:]).float().mean().item()  # vs the text's token t+2
        sums["mtp_agree"] += w * (mpred == pred[:, 1:]).float().mean().item()  # vs the target's own t+2 guess
    return sums


@torch.no_grad()
def mtp_chain(m: Qwen35Demo, seq: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Greedy chained MTP drafts from every position of seq [B, T]: k tensors [B, T-1]; drafts[j][:, t]
    guesses token t+2+j. Step 1 reads the pair (h_t, x_{t+1}); step j+1 reads (h' of step j, its draft).
    Each step attends to the true pairs 0..t and to the same chain's earlier steps, as with a KV cache."""
    h = m(seq)
    hm, (key, val) = m.mtp_forward(h[:, :-1], seq[:, 1:])  # true pairs t = 0..T-2 at positions 1..T-1
    drafts, keys, vals = [m.logits(hm).argmax(-1)], [key], [val]
    n = seq.shape[1] - 1
    causal = torch.ones(n, n, dtype=torch.bool, device=seq.device).tril()
    own = torch.eye(n, dtype=torch.bool, device=seq.device)
    for j in range(1, k):
        mask = torch.cat([causal] + [own] * j, 1)  # [n, n * (j + 1)]
        hm, (key, val) = m.mtp_forward(hm, drafts[-1], (torch.cat(keys, 2), torch.cat(vals, 2)), mask, start=1 + j)
        drafts.append(m.logits(hm).argmax(-1))
        keys.append(key)
        vals.append(val)
    return drafts


@torch.no_grad()
def eval_acceptance(m: Qwen35Demo, prompt_ids: list[list[int]], t: TrainConfig, device, amp) -> dict[str, float]:
    """Greedy MTP acceptance on the held-out prompts, simulated exactly from one pass over the target's
    own greedy continuation. Prompts are cut to their common token length so they batch.

    Drafts come from `mtp_chain`; verify rounds then walk the continuation: a round at t accepts the
    leading drafts equal to the target's tokens, plus one bonus token.
    """
    P = min(len(p) for p in prompt_ids)
    seq = torch.tensor([p[:P] for p in prompt_ids], device=device)
    for _ in range(t.eval_new_tokens):
        with amp():
            nxt = m.logits(m(seq)[:, -1:]).argmax(-1)
        seq = torch.cat([seq, nxt], 1)
    T, k = seq.shape[1], t.draft_k
    with amp():
        drafts = mtp_chain(m, seq, k)
    match = torch.stack([drafts[j][:, : T - 1 - k] == seq[:, 2 + j: 1 + j + T - k] for j in range(k)], -1)  # [B, t, k]
    res = {}
    for kk in (1, k):
        acc_k = match[..., :kk].int().cumprod(-1).sum(-1).cpu()
        steps = tokens = drafted = 0
        for b in range(len(seq)):
            pos = P - 1
            while pos < T - 1 - k:
                a = int(acc_k[b, pos])
                steps, tokens, drafted, pos = steps + 1, tokens + a + 1, drafted + kk, pos + a + 1
        res[f"accept_rate_k{kk}"] = (tokens - steps) / drafted
        res[f"mean_accepted_len_k{kk}"] = tokens / steps
    res["prompt_tokens"] = P
    return res


# ------------------------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output checkpoint directory")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's)")
    ap.add_argument("--smoke", action="store_true", help="tiny config, a few CPU steps (for tests)")
    ap.add_argument("--max-minutes", type=float, default=4.0, help="abort with an error past this wall time")
    ap.add_argument("--force", action="store_true", help="write into a non-empty --out")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.time()
    mc, tc = (SMOKE_MODEL, SMOKE_TRAIN) if args.smoke else (ModelConfig(), TrainConfig())
    if args.steps is not None:
        tc = replace(tc, steps=args.steps, warmup_steps=min(tc.warmup_steps, max(1, args.steps // 10)))
    out = args.out
    if out.exists() and any(out.iterdir()) and not args.force:
        raise OutputExistsError("output directory is not empty (pass --force)", out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(tc.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device.type == "cuda":
        # cuDNN, flash and memory-efficient attention have non-deterministic backward passes; the
        # math kernel is deterministic and cheap at this size.
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else contextlib.nullcontext

    def guard(what: str) -> None:
        minutes = (time.time() - t0) / 60
        if minutes > args.max_minutes:
            raise FreetokenError(f"{what}: {minutes:.1f} min exceeds --max-minutes {args.max_minutes}; lower --steps")

    # corpus and tokenizer
    root, files = stdlib_files()
    train_files, heldout_files = split_corpus(root, files, tc.heldout_mod)
    if tc.max_train_files:
        train_files = train_files[: tc.max_train_files]
    prompts = heldout_prompts(root, heldout_files, 50)
    with open(out / "heldout_prompts.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p["prompt"]}) + "\n")
    train_texts = [read(p) for p in train_files]
    tok = train_tokenizer(train_texts, tc.tokenizer_vocab)
    mc = replace(mc, vocab_size=tok.get_vocab_size(), eos_token_id=tok.token_to_id(SPECIAL_TOKENS[0]))
    save_tokenizer(tok, out)
    eos = mc.eos_token_id

    train_stream = token_stream(tok, train_texts, eos)
    heldout_stream = token_stream(tok, [read(p) for p in heldout_files[: max(4, tc.eval_windows)]], eos)
    prompt_ids = [tok.encode(p["prompt"]).ids for p in prompts[: tc.eval_prompts]]
    print(f"corpus: {len(train_files)} train files ({len(train_stream)} tokens), {len(heldout_files)} held out; "
          f"vocab {mc.vocab_size}; setup {time.time() - t0:.1f}s", flush=True)

    # model
    m = Qwen35Demo(mc)
    init_weights(m, tc.seed)
    m.to(device)
    n_trunk = sum(p.numel() for n, p in m.named_parameters() if not n.startswith("mtp."))
    n_mtp = sum(p.numel() for n, p in m.named_parameters() if n.startswith("mtp."))
    print(f"params: trunk {n_trunk / 1e6:.3f}M + mtp {n_mtp / 1e6:.3f}M = {(n_trunk + n_mtp) / 1e6:.3f}M "
          f"({2 * (n_trunk + n_mtp) / 2**20:.1f} MiB in bf16)", flush=True)
    decay = [p for n, p in m.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in m.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=tc.lr, betas=(0.9, 0.95), eps=1e-8)
    starts = batch_starts(len(train_stream), tc)

    # training
    t_train = time.time()
    stats = {}
    for step in range(tc.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, tc)
        x = windows(train_stream, starts[step], tc.seq_len + 1).to(device)
        with amp():
            stats = losses(m, x, tc)
        opt.zero_grad(set_to_none=True)
        stats["loss"].backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), tc.grad_clip)
        opt.step()
        if step % tc.log_every == 0 or step == tc.steps - 1:
            per_step = (time.time() - t_train) / (step + 1)
            print(f"step {step:5d}  loss {stats['loss'].item():.4f}  ce {stats['ce'].item():.4f}  "
                  f"ce_mtp {stats['ce_mtp'].item():.4f}  kd {stats['kd'].item():.4f}  lr {lr_at(step, tc):.2e}  "
                  f"{per_step * 1000:.0f} ms/step", flush=True)
            if step >= 10 and (time.time() - t0 + per_step * (tc.steps - step)) / 60 > args.max_minutes:
                raise FreetokenError(f"step {step}: projected run time exceeds --max-minutes {args.max_minutes}; "
                                     "lower --steps")
        guard(f"step {step}")
    final_loss = stats["loss"].item()
    train_seconds = time.time() - t_train

    # evaluation
    m.eval()
    held = eval_heldout(m, heldout_stream, tc, device, amp)
    acc = eval_acceptance(m, prompt_ids, tc, device, amp)
    print(f"held-out: ce {held['ce']:.4f}  top1 {held['top1']:.3f}  MTP top1(t+2) {held['mtp_top1']:.3f}  "
          f"MTP agreement with target {held['mtp_agree']:.3f}", flush=True)
    print(f"greedy MTP on {len(prompt_ids)} prompts: accept rate k=1 {acc['accept_rate_k1']:.3f}, "
          f"mean accepted length k={tc.draft_k} {acc[f'mean_accepted_len_k{tc.draft_k}']:.3f}", flush=True)
    print(f"final train loss {final_loss!r}", flush=True)

    # output
    sd = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in m.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(mc.to_hf(), indent=2) + "\n")
    gen_cfg = {"eos_token_id": eos, "pad_token_id": eos, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    log = {
        "final_train_loss": final_loss, "steps": tc.steps, "seed": tc.seed, "smoke": args.smoke,
        "train_files": len(train_files), "heldout_files": len(heldout_files), "train_tokens": len(train_stream),
        "tokens_seen": tc.steps * tc.batch_size * tc.seq_len, "params_trunk": n_trunk, "params_mtp": n_mtp,
        "heldout": held, "acceptance": acc, "train_seconds": train_seconds, "wall_seconds": time.time() - t0,
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "model_config": asdict(mc), "train_config": asdict(tc),
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    guard("end")
    return log


if __name__ == "__main__":
    try:
        main()
    except FreetokenError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
