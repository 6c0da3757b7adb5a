"""Spatial fission: image regions run in tiles with halos (Note [tiles with halos]
in analysis/spatial.py). Every tiled program runs against eager PyTorch
(allclose) with its measured peak equal to the simulated one, on random
convolution/pool/upsample chains and on the zoo's U-Net."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from magis_nb.analysis import DGraph, apply_fission
from magis_nb.analysis.halo import window
from magis_nb.analysis.spatial import check, spatial_candidates, tiling
from magis_nb.program import trace
from magis_nb.verify import Reference
from magis_nb.zoo.unet import UNet

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def tiled_checks(model, inputs, max_n, loss_fn=None):
    """Every spatial candidate of ``model``'s step on ``inputs`` (inference, or a
    training step with ``loss_fn``) at every n <= max_n: the program and
    [(candidate, n, measured peak, simulated peak)]. Asserts allclose and peaks equal."""
    mode = "infer" if loss_fn is None else "train"
    prog = trace(model, inputs, loss_fn=loss_fn, mode=mode)
    dg = DGraph(prog.graph)
    ref = Reference(model, inputs, loss_fn, mode, 0)
    got = []
    for c in spatial_candidates(prog.graph, {}, 0):
        for n in range(2, max_n + 1):
            if c.max_n % n:
                continue
            split = prog.with_graph(apply_fission(dg, [c.ftrans(n)]))
            chk = ref.check(split.module())
            sim = split.simulate().peak
            assert chk.comparison.allclose, (c.tiles, n, chk.comparison.mismatches)
            assert chk.measured_peak == sim, (c.tiles, n)
            got.append((c, n, chk.measured_peak, sim))
    return prog, got


def tiled_runs(model, x, max_n=4):
    """`tiled_checks` of ``model``'s inference: (dims, n, measured peak, simulated peak)."""
    _, got = tiled_checks(model, (x,), max_n)
    return [(c.tiles, n, measured, sim) for c, n, measured, sim in got]


class Chain(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for m in self.layers:
            x = torch.relu(m(x)) if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) else m(x)
        return x


@st.composite
def layer(draw, ch):
    kind = draw(st.sampled_from(["conv", "conv", "tconv", "max", "avg", "nearest", "bilinear",
                                 "pad"]))
    if kind == "pad":                # F.pad, TF "same" padding; negative pads crop
        return nn.ConstantPad2d(tuple(draw(st.integers(-1, 2)) for _ in range(4)),
                                draw(st.sampled_from([0.0, 1.5])))
    if kind == "conv":
        k = draw(st.integers(1, 5))
        groups = draw(st.sampled_from([1, ch]))
        return nn.Conv2d(ch, ch, k, stride=draw(st.integers(1, 2)), padding=draw(st.integers(0, 3)),
                         dilation=draw(st.integers(1, 2)), groups=groups,
                         bias=draw(st.booleans()))
    if kind == "tconv":
        k = draw(st.integers(1, 4))
        return nn.ConvTranspose2d(ch, ch, k, stride=draw(st.integers(1, 3)),
                                  padding=draw(st.integers(0, (k - 1) // 2)),
                                  dilation=draw(st.integers(1, 2)))
    if kind == "max":
        k = draw(st.integers(2, 3))
        return nn.MaxPool2d(k, stride=draw(st.integers(1, 2)), padding=draw(st.integers(0, k // 2)),
                            dilation=draw(st.integers(1, 2)), ceil_mode=draw(st.booleans()))
    if kind == "avg":
        k = draw(st.integers(2, 3))
        return nn.AvgPool2d(k, stride=draw(st.integers(1, 2)), padding=draw(st.integers(0, k // 2)))
    return nn.Upsample(scale_factor=2, mode=kind)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.data())
def test_random_conv_chains_in_tiles_are_exact(data):
    """Random kernel/stride/padding/dilation/groups: each tiled chain equals eager."""
    ch = 2
    layers = [data.draw(layer(ch)) for _ in range(data.draw(st.integers(2, 4)))]
    size = data.draw(st.integers(16, 28))
    torch.manual_seed(0)
    model = Chain(layers).eval()
    x = torch.randn(1, ch, size, size + data.draw(st.integers(0, 6)))
    try:
        with torch.no_grad():
            out = model(x)
    except RuntimeError:
        assume(False)               # the image shrank to nothing: not a valid chain
    # a dilated max pool whose window holds padding alone makes -inf, then NaN
    assume(bool(torch.isfinite(out).all()))
    assume(tiled_runs(model, x, max_n=3))   # some tiling (n divides the output)


@pytest.mark.parametrize("layers,size", [
    ([nn.Conv2d(2, 2, 1, stride=2), nn.Conv2d(2, 2, 1, stride=2), nn.Conv2d(2, 2, 1, stride=2, padding=3)], 17),
    ([nn.MaxPool2d(2), nn.MaxPool2d(2), nn.Conv2d(2, 2, 1, stride=2, padding=1)], 16),
])
def test_a_tile_whose_window_is_padding_alone(layers, size):
    """A 1x1 convolution with padding 3: its first output rows read nothing but
    padding, so the tile makes those rows itself and asks nothing of the layers
    before (found by the random chains above)."""
    torch.manual_seed(0)
    assert tiled_runs(Chain(layers).eval(), torch.randn(1, 2, size, size), max_n=3)


@st.composite
def layer_nd(draw, ch, nd):
    """A layer of a 1-D (NCL) or 3-D (NCDHW) chain."""
    conv = {1: nn.Conv1d, 3: nn.Conv3d}[nd]
    kind = draw(st.sampled_from(["conv", "conv", "tconv", "pool", "nearest", "linear", "pad"]))
    if kind == "conv":
        return conv(ch, ch, draw(st.integers(1, 3)), stride=draw(st.integers(1, 2)),
                    padding=draw(st.integers(0, 2)), dilation=draw(st.integers(1, 2)),
                    groups=draw(st.sampled_from([1, ch])))
    if kind == "tconv":
        k = draw(st.integers(1, 3))
        return {1: nn.ConvTranspose1d, 3: nn.ConvTranspose3d}[nd](
            ch, ch, k, stride=draw(st.integers(1, 2)), padding=draw(st.integers(0, (k - 1) // 2)))
    if kind == "pool":
        if nd == 1:
            return nn.AvgPool1d(2, padding=draw(st.integers(0, 1)))
        pool = draw(st.sampled_from([nn.MaxPool3d, nn.AvgPool3d]))
        return pool(2, stride=draw(st.integers(1, 2)), padding=draw(st.integers(0, 1)))
    if kind == "pad":
        pad = {1: nn.ConstantPad1d, 3: nn.ConstantPad3d}[nd]
        return pad(tuple(draw(st.integers(-1, 2)) for _ in range(2 * nd)), 0.5)
    mode = "nearest" if kind == "nearest" else {1: "linear", 3: "trilinear"}[nd]
    return nn.Upsample(scale_factor=2, mode=mode)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.data())
def test_random_1d_and_3d_chains_in_tiles_are_exact(data):
    """Audio-like NCL and volume NCDHW chains split along length, or along
    depth and along depth, height and width."""
    nd = data.draw(st.sampled_from([1, 3]))
    ch = 2
    layers = [data.draw(layer_nd(ch, nd)) for _ in range(data.draw(st.integers(2, 3)))]
    torch.manual_seed(0)
    model = Chain(layers).eval()
    side = data.draw(st.integers(24, 40) if nd == 1 else st.integers(8, 12))
    x = torch.randn(1, ch, *([side] * nd))
    try:
        with torch.no_grad():
            out = model(x)
    except RuntimeError:
        assume(False)
    assume(bool(torch.isfinite(out).all()))
    assume(tiled_runs(model, x, max_n=2))


class Skips(nn.Module):
    """Two scales joined by a channel concat and an add, with batch norm, and a
    table broadcast along the height but not the width (windowed along one
    split dim only, as rotary tables are)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.c = nn.Conv2d(8, 2, 3, padding=2, dilation=2)
        self.register_buffer("row", torch.linspace(0.5, 1.5, 32).view(1, 1, 1, 32))

    def forward(self, x):
        a = F.relu(self.bn(self.a(x)))
        b = self.b(F.max_pool2d(a, 2))
        u = (self.up(b) + a) * self.row
        return self.c(torch.cat([a, u], 1)) * 0.5


def test_skip_connections_and_eval_batch_norm_in_tiles():
    torch.manual_seed(0)
    model = Skips().eval()
    with torch.no_grad():
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2)
    got = tiled_runs(model, torch.randn(2, 3, 24, 32))
    assert {(dims, n) for dims, n, *_ in got} >= {((2,), 2), ((2, 3), 2), ((2,), 4), ((2, 3), 4)}


def test_unet_inference_in_tiles_is_exact_and_lowers_the_peak():
    """Tiles of the whole U-Net (every level, skips included) at 128 px. A 2x2
    tiling already halves the peak here."""
    torch.manual_seed(0)
    model = UNet(4, 3, 2).eval()
    x = torch.randn(1, 3, 128, 128)
    base = trace(model, (x,), mode="infer").simulate().peak
    got = tiled_runs(model, x, max_n=2)
    assert got and min(sim for *_, sim in got) < 0.75 * base


def test_no_tiles_across_a_read_pool_index():
    # (a training step's backward tiles: tests/test_spatial_grads.py)
    x = torch.randn(1, 2, 16, 16)

    class Unpool(nn.Module):
        def forward(self, x):
            y, i = F.max_pool2d(x, 2, return_indices=True)
            return F.max_unpool2d(F.relu(y), i, 2)
    g = trace(Unpool(), (x,), mode="infer").graph
    pool = next(n for n in g.ops if n.target.startswith("aten.max_pool2d"))
    assert window(pool, [(1, 2, 16, 16)], [(1, 2, 8, 8), (1, 2, 8, 8)], 2, indices_read=True) is None
    for c in spatial_candidates(g, {}, 0):
        assert pool.id not in c.ops


def test_barriers_and_reasons():
    torch.manual_seed(0)
    model = Chain([nn.Conv2d(2, 2, 3, padding=1), nn.AvgPool2d(2, ceil_mode=True),
                   nn.Conv2d(2, 2, 3, padding=1)]).eval()
    prog = trace(model, (torch.randn(1, 2, 16, 15),), mode="infer")
    g = prog.graph
    ops = frozenset(n.id for n in g.ops)
    why = tiling(g, ops, (2,))
    assert isinstance(why, str) and "avg_pool2d" in why
    conv = frozenset(n.id for n in g.ops if n.id < min(v for v in ops
                                                        if "avg" in g.nodes[v].target))
    assert check(g, conv, (2,), 2) is None
    assert "does not divide" in check(g, conv, (2,), 3)
    assert "does not divide" in check(g, conv, (2, 3), 2)       # the width is 15


def test_transformers_mobilenet_inference_in_tiles():
    """A real model as its users build it: Hugging Face's MobileNetV2 (TF-style
    "same" padding by F.pad, depthwise convolutions, ReLU6), one region of
    every op up to the classifier's pooling, in tiles."""
    from magis_nb.bench.corpus_models import MODELS

    torch.manual_seed(0)
    case = MODELS["mobilenet-v2"][1]()

    class Logits(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(pixel_values=x).logits
    model = Logits(case.model.eval())
    got = tiled_runs(model, case.inputs["pixel_values"][:2], max_n=2)
    assert got


def test_tiles_of_rotary_attention_keep_the_layout_later_views_expect():
    """In a language model's inference the 4-D attention tensors ([B, H, S, D],
    made by a transpose) are elementwise-tiled too. Rotary embeddings there
    write a tensor that later views were traced on with the transposed layout:
    its full-size result must keep those strides (Hugging Face's Llama)."""
    from magis_nb.bench.corpus_models import MODELS

    torch.manual_seed(0)
    case = MODELS["llama"][1]()
    model = case.model.eval()
    batch = {k: v for k, v in case.inputs.items() if k != "labels"}
    prog = trace(model, batch, mode="infer")
    dg = DGraph(prog.graph)
    ref = Reference(model, batch, None, "infer", 0)
    cands = spatial_candidates(prog.graph, {}, 0, halo_only=False)
    assert cands and not spatial_candidates(prog.graph, {}, 0)   # offered only with a halo
    for c in cands:
        n = 2 if c.max_n % 2 == 0 else c.max_n
        split = prog.with_graph(apply_fission(dg, [c.ftrans(n)]))
        chk = ref.check(split.module())
        assert chk.comparison.allclose and chk.measured_peak == split.simulate().peak
