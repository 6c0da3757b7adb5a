"""Causal decoder LMs: GPT-Neo ("gpt") and BTLM ("btlm") from one code path.

Options pick the variant: learned positions or ALiBi biases, a GELU or SwiGLU MLP,
and GPT-Neo's alternating global / local (sliding-window) attention. Attention is
explicit with a causal mask (no SDPA), so capture sees the B x H x T x T scores;
masks and ALiBi biases are built from `arange`, never from tensor constants or
data. The model computes its own shifted next-token loss and returns a dataclass,
like HF's `CausalLMOutput`; the LM head is tied to the token embedding.

Both follow the HF configs except: attention scores are scaled by 1/sqrt(d_head)
(GPT-Neo does not scale; BTLM's muP uses 1/d_head and scales embeddings and
logits), and dropout is 0.1 in both, so that capture meets dropout RNG in a large
LM (GPT-Neo-1.3B's released config sets every dropout to 0). Scalings change no
shape and so no memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import ZooCase
from .losses import cross_entropy

CONFIGS = {
    ("gpt", "paper"): dict(batch=32, seq=512, vocab=50257, d=2048, heads=16, layers=24, ffn=8192,
                           max_pos=2048, pos="learned", mlp="gelu", window=256, qkv_bias=False),
    ("gpt", "tiny"): dict(batch=48, seq=128, vocab=512, d=64, heads=4, layers=4, ffn=256,
                          max_pos=128, pos="learned", mlp="gelu", window=32, qkv_bias=False),
    # `bench peers`: twice the tiny width, at the batch where an eager step takes ~0.45 s
    # on 2 idle cores
    ("gpt", "bench"): dict(batch=48, seq=128, vocab=512, d=128, heads=4, layers=4, ffn=512,
                           max_pos=128, pos="learned", mlp="gelu", window=32, qkv_bias=False),
    # `bench gpu`: a few GB of activations in bf16 on one GPU
    ("gpt", "gpu"): dict(batch=16, seq=512, vocab=8192, d=512, heads=8, layers=6, ffn=2048,
                         max_pos=512, pos="learned", mlp="gelu", window=128, qkv_bias=False),
    ("btlm", "paper"): dict(batch=32, seq=512, vocab=50257, d=2560, heads=32, layers=32, ffn=6826,
                            max_pos=None, pos="alibi", mlp="swiglu", window=None, qkv_bias=True),
    ("btlm", "tiny"): dict(batch=48, seq=128, vocab=512, d=64, heads=4, layers=4, ffn=170,
                           max_pos=None, pos="alibi", mlp="swiglu", window=None, qkv_bias=True),
}
DTYPES = {"paper": torch.bfloat16, "tiny": torch.float32, "bench": torch.float32,
          "gpu": torch.bfloat16}  # the paper runs both LMs in bf16
NAMES = {"gpt": "GPT-Neo", "btlm": "BTLM"}


@dataclass
class CausalLMOutput:
    loss: torch.Tensor
    logits: torch.Tensor


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, qkv_bias: bool, p: float):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(d, d, bias=qkv_bias) for _ in range(3))
        self.out = nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def split(self, x):  # [B, T, d] -> [B, H, T, d/H]
        b, t, d = x.shape
        return x.view(b, t, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x, allowed, bias):
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if bias is not None:
            scores = scores + bias
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        ctx = self.drop(scores.softmax(-1)) @ v
        b, h, t, dh = ctx.shape
        return self.out(ctx.transpose(1, 2).reshape(b, t, h * dh))


class MLP(nn.Module):
    def __init__(self, d: int, ffn: int, kind: str):
        super().__init__()
        self.kind = kind
        self.up, self.down = nn.Linear(d, ffn), nn.Linear(ffn, d)
        if kind == "swiglu":
            self.gate = nn.Linear(d, ffn)

    def forward(self, x):
        if self.kind == "swiglu":
            return self.down(self.up(x) * F.silu(self.gate(x)))
        return self.down(F.gelu(self.up(x), approximate="tanh"))  # GPT-Neo's gelu_new


class Block(nn.Module):
    def __init__(self, c: dict, local: bool, p: float):
        super().__init__()
        self.local = local
        self.ln1, self.ln2 = nn.LayerNorm(c["d"]), nn.LayerNorm(c["d"])
        self.attn = Attention(c["d"], c["heads"], c["qkv_bias"], p)
        self.mlp = MLP(c["d"], c["ffn"], c["mlp"])
        self.drop = nn.Dropout(p)

    def forward(self, x, causal, local, bias):
        x = x + self.drop(self.attn(self.ln1(x), local if self.local else causal, bias))
        return x + self.drop(self.mlp(self.ln2(x)))


class CausalLM(nn.Module):
    def __init__(self, c: dict, p: float = 0.1):
        super().__init__()
        self.heads, self.window = c["heads"], c["window"]
        self.wte = nn.Embedding(c["vocab"], c["d"])
        self.wpe = nn.Embedding(c["max_pos"], c["d"]) if c["pos"] == "learned" else None
        self.alibi = c["pos"] == "alibi"
        if self.alibi:
            assert c["heads"] & (c["heads"] - 1) == 0, "ALiBi slopes here assume a power-of-2 head count"
        self.drop = nn.Dropout(p)
        # GPT-Neo alternates global and local layers; without a window all are global
        self.blocks = nn.ModuleList(
            Block(c, local=c["window"] is not None and i % 2 == 1, p=p) for i in range(c["layers"])
        )
        self.ln_f = nn.LayerNorm(c["d"])
        self.lm_head = nn.Linear(c["d"], c["vocab"], bias=False)
        self.apply(_init)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, ids, labels):
        t = ids.shape[1]
        pos = torch.arange(t, device=ids.device)
        rel = pos[None, :] - pos[:, None]  # key index - query index
        causal = rel <= 0
        local = causal & (rel > -self.window) if self.window is not None else causal
        x = self.wte(ids)
        if self.wpe is not None:
            x = x + self.wpe(pos)
        bias = None
        if self.alibi:
            # slope_h = 2^(-8h/H), h = 1..H; bias is slope * distance (<= 0 on the past)
            h = torch.arange(1, self.heads + 1, device=ids.device, dtype=torch.float32)
            bias = (torch.exp2(h * (-8.0 / self.heads))[:, None, None] * rel).to(x.dtype)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, causal, local, bias)
        logits = self.lm_head(self.ln_f(x))
        # position i predicts token i + 1
        v = logits.shape[-1]
        loss = cross_entropy(logits[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)


def _init(m: nn.Module) -> None:
    # GPT-2 style N(0, 0.02); torch's N(0, 1) embeddings would blow up the tied head
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


def case(name: str, size: str, seed: int) -> ZooCase:
    c = CONFIGS[name, size]
    dtype = DTYPES[size]
    model = CausalLM(c).to(dtype)
    ids = torch.randint(0, c["vocab"], (c["batch"], c["seq"]))
    labels = ids.clone()  # its own tensor: the caller may mutate or donate either
    desc = (f"{NAMES[name]} (L={c['layers']}, d={c['d']}, H={c['heads']}, {c['pos']}, {c['mlp']}), "
            f"batch {c['batch']}, seq {c['seq']}, {str(dtype).removeprefix('torch.')}")
    return ZooCase(name, size, model, (ids, labels), None, dtype, desc)
