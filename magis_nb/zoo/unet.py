"""U-Net for semantic segmentation (Ronneberger et al.; the common PyTorch layout).

Four max-pool downsamplings of conv-BN-ReLU double convs, transposed-conv
upsampling, skip connections by channel concat, and a per-pixel cross-entropy
loss. The long-lived skip tensors are what makes U-Net memory-hungry.

"unet-nobn" is the same network without its BatchNorms (convs with biases, then
ReLU): the U-Net of the MAGIS authors' benchmark graphs (pku-liang/MAGIS,
python/magis/testing/nn/unet.py, conv + ReLU blocks, no normalization), the
workload behind the paper's Fig. 9 bar. It matters for fission: training-mode
batch norm takes its statistics over the whole batch, so with BatchNorm no
region may split the batch, and without it the whole step can be split.
"""
from __future__ import annotations

import torch
from torch import nn

from . import ZooCase
from .losses import cross_entropy

PAPER = dict(batch=32, image=256, base=64, depth=4, classes=2)
TINY = dict(batch=16, image=128, base=8, depth=4, classes=2)
BENCH = dict(batch=12, image=128, base=16, depth=4, classes=2)  # `bench peers`: ~0.45 s/step on 2 idle cores
GPU = dict(batch=16, image=256, base=32, depth=4, classes=2)   # `bench gpu`: a few GB


def double_conv(cin: int, cout: int, norm: bool = True, dims: int = 2) -> nn.Sequential:
    """conv-BN-ReLU twice; ``norm=False``: conv (with a bias)-ReLU twice.
    ``dims``: 2 for images, 3 for volumes (Conv3d, BatchNorm3d)."""
    conv, bn = getattr(nn, f"Conv{dims}d"), getattr(nn, f"BatchNorm{dims}d")
    layers = []
    for a in (cin, cout):
        if norm:
            layers += [conv(a, cout, 3, padding=1, bias=False), bn(cout)]
        else:
            layers.append(conv(a, cout, 3, padding=1))
        layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class UNet(nn.Module):
    """``dims=3``: the same layout for volumes (the 3-D U-Net of medical imaging)."""

    def __init__(self, base: int, depth: int, classes: int, in_ch: int = 3, norm: bool = True,
                 dims: int = 2):
        super().__init__()
        pool, up = getattr(nn, f"MaxPool{dims}d"), getattr(nn, f"ConvTranspose{dims}d")
        ch = [base * 2**i for i in range(depth + 1)]
        self.inc = double_conv(in_ch, ch[0], norm, dims)
        self.down = nn.ModuleList(
            nn.Sequential(pool(2), double_conv(ch[i], ch[i + 1], norm, dims)) for i in range(depth)
        )
        self.up = nn.ModuleList(up(ch[i + 1], ch[i], 2, stride=2) for i in reversed(range(depth)))
        self.dec = nn.ModuleList(double_conv(2 * ch[i], ch[i], norm, dims) for i in reversed(range(depth)))
        self.outc = getattr(nn, f"Conv{dims}d")(ch[0], classes, 1)

    def forward(self, x):
        skips = [self.inc(x)]
        for down in self.down:
            skips.append(down(skips[-1]))
        x = skips.pop()
        for up, dec in zip(self.up, self.dec):
            x = dec(torch.cat([skips.pop(), up(x)], 1))
        return self.outc(x)


def case(name: str, size: str, seed: int) -> ZooCase:
    c = {"paper": PAPER, "bench": BENCH, "gpu": GPU}.get(size, TINY)
    norm = not name.endswith("-nobn")
    model = UNet(c["base"], c["depth"], c["classes"], norm=norm)
    x = torch.randn(c["batch"], 3, c["image"], c["image"])
    y = torch.randint(0, c["classes"], (c["batch"], c["image"], c["image"]))
    desc = (f"U-Net{'' if norm else ' without BatchNorm'} (base {c['base']}, depth {c['depth']}), "
            f"batch {c['batch']}, {c['image']}px")
    return ZooCase(name, size, model, (x, y), cross_entropy, torch.float32, desc)
