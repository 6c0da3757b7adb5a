"""DenseNet-BC (Huang et al.): dense blocks of BN-ReLU-conv layers joined by concat.

Each layer reads the concat of every earlier feature map in its block, so the
concatenated inputs (and BN outputs saved for backward) grow quadratically with
block length: the classic case where activations dwarf the weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import ZooCase
from .losses import cross_entropy

TINY = dict(batch=64, image=32, growth=8, blocks=(4, 4, 4), classes=10)


def bn_relu_conv(cin: int, cout: int, k: int) -> list[nn.Module]:
    return [nn.BatchNorm2d(cin), nn.ReLU(inplace=True), nn.Conv2d(cin, cout, k, padding=k // 2, bias=False)]


class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int):
        super().__init__()
        # bottleneck (the "B" in BC): 1x1 to 4k channels, then 3x3 to k
        self.body = nn.Sequential(*bn_relu_conv(cin, 4 * growth, 1), *bn_relu_conv(4 * growth, growth, 3))

    def forward(self, feats: list[torch.Tensor]) -> torch.Tensor:
        return self.body(torch.cat(feats, 1))


class DenseNet(nn.Module):
    def __init__(self, growth: int, blocks: tuple[int, ...], classes: int):
        super().__init__()
        c = 2 * growth
        self.stem = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.blocks, self.transitions = nn.ModuleList(), nn.ModuleList()
        for b, n in enumerate(blocks):
            self.blocks.append(nn.ModuleList(DenseLayer(c + i * growth, growth) for i in range(n)))
            c += n * growth
            if b < len(blocks) - 1:  # transition: compress channels by half ("C"), halve resolution
                self.transitions.append(nn.Sequential(*bn_relu_conv(c, c // 2, 1), nn.AvgPool2d(2)))
                c //= 2
        self.norm = nn.BatchNorm2d(c)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = self.stem(x)
        for b, block in enumerate(self.blocks):
            feats = [x]
            for layer in block:
                feats.append(layer(feats))
            x = torch.cat(feats, 1)
            if b < len(self.transitions):
                x = self.transitions[b](x)
        x = F.relu(self.norm(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def case(name: str, size: str, seed: int) -> ZooCase:
    c = TINY
    model = DenseNet(c["growth"], c["blocks"], c["classes"])
    x = torch.randn(c["batch"], 3, c["image"], c["image"])
    y = torch.randint(0, c["classes"], (c["batch"],))
    desc = f"DenseNet-BC (k={c['growth']}, blocks {c['blocks']}), batch {c['batch']}, {c['image']}px"
    return ZooCase(name, size, model, (x, y), cross_entropy, torch.float32, desc)
