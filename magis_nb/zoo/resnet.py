"""ResNet with bottleneck blocks (ResNet-50 layout, torchvision v1.5 strides).

BatchNorm stays in train mode (capture sees running-stat buffer updates) and the
ReLUs are inplace, as in torchvision: both are things capture must cope with.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import ZooCase
from .losses import cross_entropy

PAPER = dict(batch=64, image=224, width=64, blocks=(3, 4, 6, 3), classes=1000)
# Narrow channels at a moderate image size keep activations >> weights on CPU.
TINY = dict(batch=32, image=160, width=8, blocks=(2, 2, 2, 2), classes=10)


def conv_bn(cin: int, cout: int, k: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout)]


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(
            *conv_bn(cin, width, 1), nn.ReLU(inplace=True),
            *conv_bn(width, width, 3, stride), nn.ReLU(inplace=True),  # stride on the 3x3 (v1.5)
            *conv_bn(width, cout, 1),
        )
        need_proj = stride != 1 or cin != cout
        self.shortcut = nn.Sequential(*conv_bn(cin, cout, 1, stride)) if need_proj else nn.Identity()
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width: int, blocks: tuple[int, ...], classes: int):
        super().__init__()
        self.stem = nn.Sequential(
            *conv_bn(3, width, 7, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        )
        layers, cin = [], width
        for i, n in enumerate(blocks):
            w = width * 2**i
            for j in range(n):
                layers.append(Bottleneck(cin, w, 2 if (j == 0 and i > 0) else 1))
                cin = w * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def case(name: str, size: str, seed: int) -> ZooCase:
    c = PAPER if size == "paper" else TINY
    model = ResNet(c["width"], c["blocks"], c["classes"])
    x = torch.randn(c["batch"], 3, c["image"], c["image"])
    y = torch.randint(0, c["classes"], (c["batch"],))
    depth = 2 + 3 * sum(c["blocks"])
    desc = f"ResNet-{depth} (width {c['width']}), batch {c['batch']}, {c['image']}px"
    return ZooCase(name, size, model, (x, y), cross_entropy, torch.float32, desc)
