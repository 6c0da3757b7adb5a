"""A plain MLP: the simplest chain-shaped training graph.

The batch is large next to the hidden width so that activations, not weights,
dominate memory, as in the paper's workloads.
"""
from __future__ import annotations

import torch
from torch import nn

from . import ZooCase
from .losses import cross_entropy

TINY = dict(batch=16384, d_in=256, hidden=256, layers=4, classes=10)


class MLP(nn.Module):
    def __init__(self, d_in: int, hidden: int, layers: int, classes: int):
        super().__init__()
        dims = [d_in] + [hidden] * layers
        blocks = []
        for a, b in zip(dims[:-1], dims[1:]):
            # inplace ReLU on a fresh Linear output: legal, and capture must handle it
            blocks += [nn.Linear(a, b), nn.ReLU(inplace=True)]
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.body(x))


def case(name: str, size: str, seed: int) -> ZooCase:
    c = TINY
    model = MLP(c["d_in"], c["hidden"], c["layers"], c["classes"])
    x = torch.randn(c["batch"], c["d_in"])
    y = torch.randint(0, c["classes"], (c["batch"],))
    desc = f"MLP {c['layers']}x{c['hidden']}, batch {c['batch']}"
    return ZooCase(name, size, model, (x, y), cross_entropy, torch.float32, desc)
