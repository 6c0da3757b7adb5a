"""Vision Transformer (pre-LN), ViT-Base/16 layout, classifying from the [CLS] token.

Patches are embedded by a strided conv, attention is explicit (no SDPA) so capture
sees the B x H x T x T scores, and there is no dropout (ViT's fine-tuning recipe).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from . import ZooCase
from .losses import cross_entropy

PAPER = dict(batch=64, image=224, patch=16, d=768, heads=12, layers=12, mlp=3072, classes=1000)
TINY = dict(batch=64, image=96, patch=8, d=64, heads=4, layers=4, mlp=256, classes=10)
# `bench peers`: twice the tiny width, at the batch where an eager step takes ~0.45 s on 2 idle cores
BENCH = dict(batch=64, image=96, patch=8, d=128, heads=4, layers=4, mlp=512, classes=10)
GPU = dict(batch=64, image=224, patch=16, d=384, heads=6, layers=6, mlp=1536, classes=1000)  # `bench gpu`


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # each [B, H, T, d/H]
        attn = (q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, mlp: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d, eps=1e-6), Attention(d, heads)
        self.ln2 = nn.LayerNorm(d, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(d, mlp), nn.GELU(), nn.Linear(mlp, d))

    def forward(self, x):
        # pre-LN: normalize the branch input, keep the residual stream raw
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ViT(nn.Module):
    def __init__(self, image: int, patch: int, d: int, heads: int, layers: int, mlp: int, classes: int):
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, d) * 0.02)
        self.blocks = nn.Sequential(*(Block(d, heads, mlp) for _ in range(layers)))
        self.ln = nn.LayerNorm(d, eps=1e-6)
        self.head = nn.Linear(d, classes)

    def forward(self, img):
        x = self.patch(img).flatten(2).transpose(1, 2)  # [B, N, d]
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        x = self.ln(self.blocks(x))
        return self.head(x[:, 0])


def case(name: str, size: str, seed: int) -> ZooCase:
    c = {"paper": PAPER, "bench": BENCH, "gpu": GPU}.get(size, TINY)
    model = ViT(c["image"], c["patch"], c["d"], c["heads"], c["layers"], c["mlp"], c["classes"])
    x = torch.randn(c["batch"], 3, c["image"], c["image"])
    y = torch.randint(0, c["classes"], (c["batch"],))
    desc = (f"ViT/{c['patch']} (L={c['layers']}, d={c['d']}, H={c['heads']}), "
            f"batch {c['batch']}, {c['image']}px")
    return ZooCase(name, size, model, (x, y), cross_entropy, torch.float32, desc)
