"""U-Net++ (Zhou et al. 2018): U-Net whose skips are nested, dense conv pathways.

Node X[i][j] (level i, column j) convolves the concat of every earlier node on its
level, X[i][0..j-1], with the upsampled X[i+1][j-1]. Many full-resolution
tensors stay alive until the last column is done, so memory is dominated by
activations even more than in U-Net. Upsampling is a transposed conv as in the
authors' Keras code; the blocks are conv-BN-ReLU double convs as in common PyTorch
ports. No deep supervision: the loss reads X[0][depth] only.

"unetpp-nobn": the same without BatchNorm (conv with a bias, then ReLU), as in the
MAGIS authors' benchmark graph (pku-liang/MAGIS, python/magis/testing/nn/unet.py,
`unet2p`: conv + ReLU nodes, no normalization); see `unet` for why it matters.
"""
from __future__ import annotations

import torch
from torch import nn

from . import ZooCase
from .losses import cross_entropy
from .unet import double_conv

PAPER = dict(batch=16, image=256, base=32, depth=4, classes=2)
TINY = dict(batch=16, image=96, base=4, depth=4, classes=2)


class UNetPP(nn.Module):
    def __init__(self, base: int, depth: int, classes: int, in_ch: int = 3, norm: bool = True):
        super().__init__()
        self.depth = depth
        ch = [base * 2**i for i in range(depth + 1)]
        self.pool = nn.MaxPool2d(2)
        # column 0 is the encoder; nodes are keyed "i_j" because ModuleDict wants str keys
        self.node = nn.ModuleDict({"0_0": double_conv(in_ch, ch[0], norm)})
        self.up = nn.ModuleDict()
        for i in range(1, depth + 1):
            self.node[f"{i}_0"] = double_conv(ch[i - 1], ch[i], norm)
        for j in range(1, depth + 1):
            for i in range(depth + 1 - j):
                self.up[f"{i}_{j}"] = nn.ConvTranspose2d(ch[i + 1], ch[i], 2, stride=2)
                self.node[f"{i}_{j}"] = double_conv((j + 1) * ch[i], ch[i], norm)
        self.outc = nn.Conv2d(ch[0], classes, 1)

    def forward(self, x):
        d = self.depth
        xs = {(0, 0): self.node["0_0"](x)}
        for i in range(1, d + 1):
            xs[i, 0] = self.node[f"{i}_0"](self.pool(xs[i - 1, 0]))
        for j in range(1, d + 1):
            for i in range(d + 1 - j):
                ins = [xs[i, k] for k in range(j)] + [self.up[f"{i}_{j}"](xs[i + 1, j - 1])]
                xs[i, j] = self.node[f"{i}_{j}"](torch.cat(ins, 1))
        return self.outc(xs[0, d])


def case(name: str, size: str, seed: int) -> ZooCase:
    c = PAPER if size == "paper" else TINY
    norm = not name.endswith("-nobn")
    model = UNetPP(c["base"], c["depth"], c["classes"], norm=norm)
    x = torch.randn(c["batch"], 3, c["image"], c["image"])
    y = torch.randint(0, c["classes"], (c["batch"], c["image"], c["image"]))
    desc = (f"U-Net++{'' if norm else ' without BatchNorm'} (base {c['base']}, depth {c['depth']}), "
            f"batch {c['batch']}, {c['image']}px")
    return ZooCase(name, size, model, (x, y), cross_entropy, torch.float32, desc)
