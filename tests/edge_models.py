"""Small models exercising capture's edge cases (not part of the zoo)."""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class BNDropNet(nn.Module):
    """BatchNorm in train mode, dropout, ReLU(inplace=True) and an unused head."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 32)
        self.bn = nn.BatchNorm1d(32)
        self.relu = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.3)
        self.l2 = nn.Linear(32, 4)
        self.unused_head = nn.Linear(32, 7)

    def forward(self, x):
        return self.l2(self.drop(self.relu(self.bn(self.l1(x)))))


class TiedLM(nn.Module):
    """Input and output embeddings share one weight."""

    def __init__(self, vocab=50, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids, labels):
        logits = self.out(torch.tanh(self.mix(self.emb(ids))))
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


@dataclass
class Output:
    loss: torch.Tensor
    hidden: torch.Tensor


class DataclassOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(6, 6)

    def forward(self, x):
        h = self.l(x).relu()
        return Output(loss=h.pow(2).mean(), hidden=h)


class TupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(6, 3)

    def forward(self, x):
        y = self.l(x)
        return y.sum() * 0.1, y


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # the offending line
            return self.l(x).sum()
        return x.sum()
