"""A Llama-style decoder LM: RoPE, RMSNorm, grouped-query attention, SwiGLU.

Written as HF's `LlamaForCausalLM` computes it (random weights, no download):
pre-norm blocks with RMSNorm (eps 1e-6, computed in float32), rotary position
embeddings on q and k (rotate-half form, cos/sin built from `arange` at run
time), key/value heads shared by groups of query heads (repeated to the query
heads before attention, HF's `repeat_kv`), causal
`F.scaled_dot_product_attention` (one fused op in the ATen graph, and its
backward), a SwiGLU MLP, an untied LM head, no biases, no dropout, and the
shifted next-token loss computed by the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import ZooCase
from .losses import cross_entropy

CONFIGS = {
    ("llama", "tiny"): dict(batch=2, seq=128, vocab=512, d=64, heads=4, kv_heads=2, layers=2,
                            ffn=172, theta=10000.0),
}
DTYPES = {"tiny": torch.float32}


@dataclass
class CausalLMOutput:
    loss: torch.Tensor
    logits: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rope(t: int, dh: int, theta: float, device, dtype):
    """cos, sin [t, dh] of the rotary embedding (HF's LlamaRotaryEmbedding)."""
    inv = 1.0 / theta ** (torch.arange(0, dh, 2, device=device, dtype=torch.float32) / dh)
    ang = torch.arange(t, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.dh = heads, kv_heads, d // heads
        self.q = nn.Linear(d, heads * self.dh, bias=False)
        self.k = nn.Linear(d, kv_heads * self.dh, bias=False)
        self.v = nn.Linear(d, kv_heads * self.dh, bias=False)
        self.o = nn.Linear(heads * self.dh, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.dh).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.dh).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.dh).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        if rep > 1:   # HF's repeat_kv: [b, kv, t, dh] -> [b, kv * rep, t, dh]
            k = k[:, :, None].expand(b, self.kv_heads, rep, t, self.dh).reshape(b, self.heads, t, self.dh)
            v = v[:, :, None].expand(b, self.kv_heads, rep, t, self.dh).reshape(b, self.heads, t, self.dh)
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(ctx.transpose(1, 2).reshape(b, t, self.heads * self.dh))


class MLP(nn.Module):
    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.gate = nn.Linear(d, ffn, bias=False)
        self.up = nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(c["d"]), RMSNorm(c["d"])
        self.attn = Attention(c["d"], c["heads"], c["kv_heads"])
        self.mlp = MLP(c["d"], c["ffn"])

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class LlamaLM(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.theta = c["theta"]
        self.dh = c["d"] // c["heads"]
        self.embed = nn.Embedding(c["vocab"], c["d"])
        self.blocks = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.norm = RMSNorm(c["d"])
        self.lm_head = nn.Linear(c["d"], c["vocab"], bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, ids, labels):
        t = ids.shape[1]
        x = self.embed(ids)
        cos, sin = rope(t, self.dh, self.theta, ids.device, x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        v = logits.shape[-1]    # position i predicts token i + 1
        loss = cross_entropy(logits[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)


def case(name: str, size: str, seed: int, **over) -> ZooCase:
    c = {**CONFIGS[name, size], **over}
    dtype = DTYPES[size]
    model = LlamaLM(c).to(dtype)
    ids = torch.randint(0, c["vocab"], (c["batch"], c["seq"]))
    labels = ids.clone()
    desc = (f"Llama-style (L={c['layers']}, d={c['d']}, H={c['heads']}/{c['kv_heads']} kv, "
            f"RoPE, RMSNorm, SwiGLU), batch {c['batch']}, seq {c['seq']}, "
            f"{str(dtype).removeprefix('torch.')}")
    return ZooCase(name, size, model, (ids, labels), None, dtype, desc)
