"""U-Net++ (Zhou et al. 2018): U-Net whose skips are nested, dense conv pathways.

Node X[i][j] (level i, column j) convolves the concat of every earlier node on its
level, X[i][0..j-1], with the upsampled X[i+1][j-1]. Many full-resolution
tensors stay alive until the last column is done, so memory is dominated by
activations even more than in U-Net. Upsampling is a transposed conv as in the
authors' Keras code; the blocks are conv-BN-ReLU double convs as in common PyTorch
ports. No deep supervision: the loss reads X[0][depth] only.

"unetpp-nobn": the same without BatchNorm (conv with a bias, then ReLU); see
`unet` for why it matters.

"unetpp-magis": U-Net++ as the MAGIS authors' benchmark graph builds it
(pku-liang/MAGIS, python/magis/testing/nn/unet.py, `unet2p`): 64 to 1024
channels, one conv + ReLU per node, no normalization, average-pool down and
nearest-neighbour interpolation up. Only the ends differ: 3 input channels and a
2-class cross-entropy where theirs has 1 channel and a sigmoid (12 MiB of input
at paper size; the loss is a rounding error). Interpolation reaches the graph as
index arithmetic (`aten._unsafe_index` and, backward, `_unsafe_index_put`), which
is why fission has rules for advanced indexing (analysis/dims_index.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import ZooCase
from .losses import cross_entropy
from .unet import double_conv

PAPER = dict(batch=16, image=256, base=32, depth=4, classes=2)
TINY = dict(batch=16, image=96, base=4, depth=4, classes=2)
MAGIS = dict(PAPER, base=64)  # the authors' hidden sizes 64 ... 1024


class UNetPP(nn.Module):
    """``magis=False``: double-conv nodes, max-pool, transposed-conv upsampling (the
    common port; ``norm`` adds BatchNorm). ``magis=True``: the authors' graph, one
    conv + ReLU per node, avg-pool, nearest interpolation, no normalization."""

    def __init__(self, base: int, depth: int, classes: int, in_ch: int = 3, norm: bool = True,
                 magis: bool = False):
        super().__init__()
        self.depth, self.magis = depth, magis
        ch = [base * 2**i for i in range(depth + 1)]

        def block(cin, cout):
            if magis:
                return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(inplace=True))
            return double_conv(cin, cout, norm)

        self.pool = nn.AvgPool2d(2) if magis else nn.MaxPool2d(2)
        # column 0 is the encoder; nodes are keyed "i_j" because ModuleDict wants str keys
        self.node = nn.ModuleDict({"0_0": block(in_ch, ch[0])})
        self.up = nn.ModuleDict()
        for i in range(1, depth + 1):
            self.node[f"{i}_0"] = block(ch[i - 1], ch[i])
        for j in range(1, depth + 1):
            for i in range(depth + 1 - j):
                if magis:   # j skips at ch[i], then the interpolated ch[i + 1]
                    self.node[f"{i}_{j}"] = block(j * ch[i] + ch[i + 1], ch[i])
                else:
                    self.up[f"{i}_{j}"] = nn.ConvTranspose2d(ch[i + 1], ch[i], 2, stride=2)
                    self.node[f"{i}_{j}"] = block((j + 1) * ch[i], ch[i])
        self.outc = nn.Conv2d(ch[0], classes, 1)

    def upsample(self, x, key):
        if self.magis:
            return F.interpolate(x, scale_factor=2, mode="nearest")
        return self.up[key](x)

    def forward(self, x):
        d = self.depth
        xs = {(0, 0): self.node["0_0"](x)}
        for i in range(1, d + 1):
            xs[i, 0] = self.node[f"{i}_0"](self.pool(xs[i - 1, 0]))
        for j in range(1, d + 1):
            for i in range(d + 1 - j):
                ins = [xs[i, k] for k in range(j)] + [self.upsample(xs[i + 1, j - 1], f"{i}_{j}")]
                xs[i, j] = self.node[f"{i}_{j}"](torch.cat(ins, 1))
        return self.outc(xs[0, d])


def case(name: str, size: str, seed: int) -> ZooCase:
    magis = name.endswith("-magis")
    c = TINY if size != "paper" else MAGIS if magis else PAPER
    norm = not (magis or name.endswith("-nobn"))
    model = UNetPP(c["base"], c["depth"], c["classes"], norm=norm, magis=magis)
    x = torch.randn(c["batch"], 3, c["image"], c["image"])
    y = torch.randint(0, c["classes"], (c["batch"], c["image"], c["image"]))
    kind = " as the MAGIS authors' benchmark" if magis else "" if norm else " without BatchNorm"
    desc = (f"U-Net++{kind} (base {c['base']}, depth {c['depth']}), "
            f"batch {c['batch']}, {c['image']}px")
    return ZooCase(name, size, model, (x, y), cross_entropy, torch.float32, desc)
