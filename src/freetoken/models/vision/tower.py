"""The vision tower (Qwen3-VL ViT without deepstack): patches [P, patch_dim] of images with grids
(t, h, w) in patches -> merged features [P / merge^2, out_hidden_size], one per image-pad token.

    x = Conv3d patch embed (a linear map of each flattened patch) + bilinear-interpolated position table
    blocks: x += proj(attn(LN1(x)))  with 2-D RoPE (h, w) and attention within each frame
            x += fc2(gelu_tanh(fc1(LN2(x))))
    merger: LN(x) per patch, each merge x merge block of patches concatenated, fc2(gelu(fc1(.)))

Rows come in merge-block order (block row, block col, row in block, col in block), as the image
preprocessing lays them out, so a block's merge^2 patches are consecutive rows. Parameter names are
the checkpoint's under `model.visual.`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.models.vision.config import VisionConfig

LAYER_NORM_EPS = 1e-6


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # [P, patch_dim] -> [P, D]
        cfg = self.cfg
        x = patches.view(-1, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size).to(self.proj.weight.dtype)
        return self.proj(x).view(-1, cfg.hidden_size)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frame_lens: list[int]) -> torch.Tensor:
        """x [P, D], cos/sin [P, head_dim] fp32; each frame's rows attend to each other only."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        outs = []
        for qf, kf, vf in zip(*(t.split(frame_lens) for t in (q, k, v))):  # [p, heads, hd] each
            scores = torch.einsum("qhd,khd->hqk", qf, kf) * self.head_dim**-0.5
            probs = torch.softmax(scores.float(), dim=-1).to(vf.dtype)
            outs.append(torch.einsum("hqk,khd->qhd", probs, vf))
        return self.proj(torch.cat(outs).reshape(n, -1))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of every channel of x [P, heads, hd] in fp32 (channel i pairs with i + hd/2)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        if cfg.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(f"vision hidden_act {cfg.hidden_act!r} is not supported (gelu_pytorch_tanh)")
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [P, D] -> [P, D]
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frame_lens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frame_lens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.merged_dim = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim, bias=True)
        self.linear_fc2 = nn.Linear(self.merged_dim, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [P, D] -> [P / merge^2, out_hidden_size]
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x).view(-1, self.merged_dim))))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [sum t*h*w, patch_dim] of images with grids (t, h, w) -> features [sum t*h*w / merge^2, out_hidden_size]."""
        rows, cols = patch_coordinates(grids, self.cfg.spatial_merge_size, patches.device)
        x = self.patch_embed(patches)
        x = x + self.interpolated_positions(rows, cols, grids).to(x.dtype)
        cos, sin = self.rope(rows, cols)
        frame_lens = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, frame_lens)
        return self.merger(x)

    def interpolated_positions(self, rows: torch.Tensor, cols: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The square position table resampled bilinearly (corners aligned) to each grid -> [P, D]."""
        side = int(self.cfg.num_position_embeddings**0.5)
        heights = torch.cat([torch.full((t * h * w,), h) for t, h, w in grids]).to(rows.device)
        widths = torch.cat([torch.full((t * h * w,), w) for t, h, w in grids]).to(rows.device)
        (h0, h1), (dh0, dh1) = _taps(rows, heights, side)
        (w0, w1), (dw0, dw1) = _taps(cols, widths, side)
        table = self.pos_embed.weight
        return (
            (table[h0 * side + w0] * (dh0 * dw0)[:, None] + table[h0 * side + w1] * (dh0 * dw1)[:, None])
            + table[h1 * side + w0] * (dh1 * dw0)[:, None]
        ) + table[h1 * side + w1] * (dh1 * dw1)[:, None]

    def rope(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, head_dim] fp32: a quarter of the channels' frequencies at the row index, a quarter at
        the column, the half repeated."""
        quarter = self.cfg.head_dim // 2
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float, device=rows.device) / quarter))
        freqs = torch.cat([rows.float()[:, None] * inv_freq, cols.float()[:, None] * inv_freq], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def _taps(
    index: torch.Tensor, size: torch.Tensor, side: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Bilinear taps (floor, floor + 1 clamped) and weights of grid index [P] on an axis of `size` cells
    mapped onto `side` table cells with the end points aligned."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    frac = src - floor
    low = floor.long()
    return (low, (low + 1).clamp(max=side - 1)), (1 - frac, frac)


def patch_coordinates(grids: list[tuple[int, int, int]], merge: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) [P] of every patch row in merge-block order, frames repeating the same grid."""
    rows, cols = [], []
    for t, h, w in grids:
        r = torch.arange(h, device=device).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
        c = torch.arange(w, device=device).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
        rows.append(r.permute(0, 2, 1, 3).reshape(-1).repeat(t))
        cols.append(c.permute(0, 2, 1, 3).reshape(-1).repeat(t))
    return torch.cat(rows), torch.cat(cols)
