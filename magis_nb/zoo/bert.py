"""BERT encoder (post-LN) with a masked-LM head that computes its own loss.

Written the way HF `BertForPreTraining` is, minus the NSP loss: attention is explicit
(matmul, softmax, dropout, matmul; no SDPA) so capture sees the B x H x T x T
scores, the decoder is tied to the word embeddings, and the pooler is computed but
unused by the loss, so its parameters receive no gradient (capture must cope).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from . import ZooCase
from .losses import cross_entropy

PAPER = dict(batch=32, seq=512, vocab=30522, d=768, heads=12, layers=12, ffn=3072, max_pos=512)
TINY = dict(batch=48, seq=128, vocab=512, d=64, heads=4, layers=4, ffn=256, max_pos=128)
# `bench peers`: twice the tiny width, at the batch where an eager step takes ~0.45 s on 2 idle cores
BENCH = dict(batch=48, seq=128, vocab=512, d=128, heads=4, layers=4, ffn=512, max_pos=128)
MLM_FRACTION = 0.15  # share of positions with a label; the rest are ignore_index


class SelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, p: float):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def split(self, x):  # [B, T, d] -> [B, H, T, d/H]
        b, t, d = x.shape
        return x.view(b, t, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x):
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        ctx = self.drop(scores.softmax(-1)) @ v
        b, h, t, dh = ctx.shape
        return ctx.transpose(1, 2).reshape(b, t, h * dh)


class Layer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int, p: float):
        super().__init__()
        self.attn = SelfAttention(d, heads, p)
        self.attn_out, self.attn_drop, self.ln1 = nn.Linear(d, d), nn.Dropout(p), nn.LayerNorm(d, eps=1e-12)
        self.up, self.act, self.down = nn.Linear(d, ffn), nn.GELU(), nn.Linear(ffn, d)
        self.ffn_drop, self.ln2 = nn.Dropout(p), nn.LayerNorm(d, eps=1e-12)

    def forward(self, x):
        # post-LN: normalize after each residual sum (original BERT)
        x = self.ln1(x + self.attn_drop(self.attn_out(self.attn(x))))
        return self.ln2(x + self.ffn_drop(self.down(self.act(self.up(x)))))


class BertForMaskedLM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, ffn: int, max_pos: int, p: float = 0.1):
        super().__init__()
        self.word = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_pos, d)
        self.token_type = nn.Embedding(2, d)
        self.emb_ln, self.emb_drop = nn.LayerNorm(d, eps=1e-12), nn.Dropout(p)
        self.layers = nn.ModuleList(Layer(d, heads, ffn, p) for _ in range(layers))
        self.pooler = nn.Linear(d, d)  # [CLS] head for NSP; no loss uses it here
        self.mlm_dense, self.mlm_act, self.mlm_ln = nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d, eps=1e-12)
        self.mlm_bias = nn.Parameter(torch.zeros(vocab))
        self.apply(_init)


    def forward(self, ids, labels):
        t = ids.shape[1]
        pos = torch.arange(t, device=ids.device)
        # a single segment: every token has type 0
        x = self.word(ids) + self.pos(pos) + self.token_type.weight[0]
        x = self.emb_drop(self.emb_ln(x))
        for layer in self.layers:
            x = layer(x)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        h = self.mlm_ln(self.mlm_act(self.mlm_dense(x)))
        logits = h @ self.word.weight.t() + self.mlm_bias  # decoder tied to word embeddings
        loss = cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        return {"loss": loss, "logits": logits, "pooler_output": pooled}


def _init(m: nn.Module) -> None:
    # BERT's init (N(0, 0.02)); torch's default N(0, 1) embeddings would make the
    # tied decoder's logits, and so the initial loss, absurdly large
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear):
        nn.init.zeros_(m.bias)


def case(name: str, size: str, seed: int) -> ZooCase:
    c = {"paper": PAPER, "bench": BENCH}.get(size, TINY)
    model = BertForMaskedLM(c["vocab"], c["d"], c["heads"], c["layers"], c["ffn"], c["max_pos"])
    shape = (c["batch"], c["seq"])
    ids = torch.randint(0, c["vocab"], shape)
    labels = torch.randint(0, c["vocab"], shape)
    # unlabelled positions use ignore_index, as an MLM data collator does
    labels = torch.where(torch.rand(shape) < MLM_FRACTION, labels, torch.full_like(labels, -100))
    desc = (f"BERT (L={c['layers']}, d={c['d']}, H={c['heads']}), "
            f"batch {c['batch']}, seq {c['seq']}, vocab {c['vocab']}")
    return ZooCase(name, size, model, (ids, labels), None, torch.float32, desc)
