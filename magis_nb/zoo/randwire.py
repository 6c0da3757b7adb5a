"""RandWire (Xie et al. 2019): stages whose cells are wired by a random graph.

Each stage is a Watts-Strogatz graph WS(N, K, P) drawn from `random.Random(seed)`
and oriented from lower to higher node index, which makes it a DAG. A node sums
its inputs, then applies ReLU, a separable 3x3 conv and BN (the paper also learns
a sigmoid weight per edge; a plain sum keeps the graph simpler). Nodes without
predecessors read the stage input (with the stage's stride); the stage output is
the mean of the nodes without successors. The irregular fan-in/fan-out gives the
scheduler real freedom, unlike the chains and U-shapes elsewhere in the zoo.
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

from . import ZooCase
from .losses import cross_entropy

TINY = dict(batch=64, image=32, channels=16, stages=3, nodes=8, k=4, p=0.75, classes=10)


def ws_dag(n: int, k: int, p: float, rng: random.Random) -> list[list[int]]:
    """Predecessor lists of a Watts-Strogatz graph oriented low -> high index."""
    adj = {i: set() for i in range(n)}
    for i in range(n):  # ring lattice: each node joined to its k/2 nearest on each side
        for d in range(1, k // 2 + 1):
            adj[i].add((i + d) % n)
            adj[(i + d) % n].add(i)
    for d in range(1, k // 2 + 1):  # rewire each lattice edge with probability p (as networkx does)
        for i in range(n):
            j = (i + d) % n
            if j not in adj[i] or rng.random() >= p or len(adj[i]) >= n - 1:
                continue
            w = rng.randrange(n)
            while w == i or w in adj[i]:
                w = rng.randrange(n)
            adj[i].discard(j), adj[j].discard(i)
            adj[i].add(w), adj[w].add(i)
    return [sorted(u for u in adj[v] if u < v) for v in range(n)]


class Node(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.depthwise = nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False)
        self.pointwise = nn.Conv2d(cin, cout, 1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        x = inputs[0]
        for t in inputs[1:]:
            x = x + t
        # not inplace: with one input, x is a predecessor's output that others also read
        return self.bn(self.pointwise(self.depthwise(F.relu(x))))


class Stage(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, preds: list[list[int]]):
        super().__init__()
        self.preds = preds
        self.sinks = [v for v in range(len(preds)) if all(v not in p for p in preds)]
        self.nodes = nn.ModuleList(
            Node(cout if p else cin, cout, 1 if p else stride) for p in preds
        )

    def forward(self, x):
        outs = []
        for node, p in zip(self.nodes, self.preds):
            outs.append(node([outs[u] for u in p] if p else [x]))
        y = outs[self.sinks[0]]
        for v in self.sinks[1:]:
            y = y + outs[v]
        return y / len(self.sinks)


class RandWire(nn.Module):
    def __init__(self, channels: int, stages: int, nodes: int, k: int, p: float, classes: int, seed: int):
        super().__init__()
        rng = random.Random(seed)
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels))
        layers, c = [], channels
        for s in range(stages):
            cout = channels * 2**s
            layers.append(Stage(c, cout, 1 if s == 0 else 2, ws_dag(nodes, k, p, rng)))
            c = cout
        self.stages = nn.Sequential(*layers)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = F.relu(self.stages(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def case(name: str, size: str, seed: int) -> ZooCase:
    c = TINY
    model = RandWire(c["channels"], c["stages"], c["nodes"], c["k"], c["p"], c["classes"], seed)
    x = torch.randn(c["batch"], 3, c["image"], c["image"])
    y = torch.randint(0, c["classes"], (c["batch"],))
    desc = (f"RandWire WS({c['nodes']},{c['k']},{c['p']}) x{c['stages']} stages, C={c['channels']}, "
            f"batch {c['batch']}, {c['image']}px, seed {seed}")
    return ZooCase(name, size, model, (x, y), cross_entropy, torch.float32, desc)
