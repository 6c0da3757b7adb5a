"""Tiles of a training step's backward (Note [gradients in tiles]): every
candidate, at every tile count, equals eager (loss, gradients, buffers) with
the measured peak equal to the simulated one."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from magis_nb.analysis.spatial import GRAD_CONV, spatial_candidates
from magis_nb.program import trace
from test_spatial import tiled_checks

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def tiled_steps(model, x, target, max_n=3):
    """`tiled_checks` of ``model``'s training step: the program and
    [(ops, dims, n, measured peak)]."""
    prog, got = tiled_checks(model, (x, target), max_n, F.mse_loss)
    return prog, [(c.ops, c.tiles, n, measured) for c, n, measured, _ in got]


class Chain(nn.Module):
    def __init__(self, layers, act):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.act = act

    def forward(self, x):
        for m in self.layers:
            x = m(x)
            if isinstance(m, nn.Conv2d):
                x = self.act(x)
        return x


@st.composite
def layer(draw, ch):
    kind = draw(st.sampled_from(["conv", "conv", "conv", "tconv", "bn", "max", "pad"]))
    if kind == "bn":
        return nn.BatchNorm2d(ch, affine=draw(st.booleans()))
    if kind == "max":
        return nn.MaxPool2d(2)
    if kind == "pad":
        return nn.ConstantPad2d(tuple(draw(st.integers(-1, 2)) for _ in range(4)), 0.0)
    if kind == "tconv":
        k, s = draw(st.integers(1, 4)), draw(st.integers(1, 3))
        return nn.ConvTranspose2d(ch, ch, k, stride=s, padding=draw(st.integers(0, (k - 1) // 2)),
                                  output_padding=draw(st.integers(0, s - 1)),
                                  groups=draw(st.sampled_from([1, ch])), bias=draw(st.booleans()))
    k = draw(st.integers(1, 5))
    return nn.Conv2d(ch, ch, k, stride=draw(st.integers(1, 3)), padding=draw(st.integers(0, 3)),
                     dilation=draw(st.integers(1, 2)), groups=draw(st.sampled_from([1, ch])),
                     bias=draw(st.booleans()))


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.data())
def test_random_conv_chains_train_in_tiles_exactly(data):
    """Random kernel/stride/padding/dilation/groups, BatchNorm, pools and pads:
    each tiled backward equals eager's step."""
    ch = 2
    layers = [data.draw(layer(ch)) for _ in range(data.draw(st.integers(2, 4)))]
    act = data.draw(st.sampled_from([torch.relu, F.silu, torch.tanh]))
    torch.manual_seed(0)
    model = Chain(layers, act)
    x = torch.randn(data.draw(st.integers(1, 2)), ch, data.draw(st.integers(12, 24)),
                    data.draw(st.integers(12, 20)))
    try:
        with torch.no_grad():
            out = model(x)
    except (RuntimeError, ValueError):
        assume(False)               # the image shrank to nothing: not a valid chain
    assume(any(True for _ in model.parameters()))    # something to train
    _, got = tiled_steps(model, x, torch.randn_like(out))
    assume(got)


def test_convolution_backward_tiles_its_input_gradient_and_sums_its_weights():
    """conv -> BN -> ReLU -> strided conv -> ReLU -> conv: the backward between
    BatchNorm's reductions tiles (two convolutions' backward in one region),
    and so does the first convolution's weight gradient after them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, padding=1, stride=2), nn.ReLU(),
                          nn.Conv2d(4, 2, 3, padding=1))
    x = torch.randn(1, 2, 32, 32)
    prog, got = tiled_steps(model, x, torch.randn(1, 2, 16, 16), max_n=4)
    g = prog.graph
    regions = {ops for ops, *_ in got}
    convs = {frozenset(v for v in ops if g.nodes[v].target == GRAD_CONV) for ops in regions}
    assert max(len(c) for c in convs) == 2
    first = next(n for n in g.ops if n.target == GRAD_CONV and n.outputs[0] is None)
    assert any(first.id in ops for ops in regions)
    assert {dims for _, dims, *_ in got} == {(2,), (2, 3)}


def test_the_backward_tiles_remake_the_relu_and_normalize_they_read():
    """Batch 1, conv -> BN -> ReLU twice: a backward tile region remakes its rows
    of the ReLU and BatchNorm's normalize from the convolution's output (kept
    for BatchNorm's backward anyway), so the ReLU's output dies in the forward:
    the simulated (= measured) peak drops."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 2, 3, padding=1))
    x = torch.randn(1, 3, 64, 64)
    prog, got = tiled_steps(model, x, torch.randn(1, 2, 64, 64), max_n=4)
    g = prog.graph
    rec = {c.recompute for c in spatial_candidates(g, {}, 0)}
    remade = {g.nodes[v].target for r in rec for v in r}
    assert {"aten.relu.default", "magis_nb.bn_elemt.default"} <= remade
    assert min(peak for *_, peak in got) < prog.simulate().peak


def test_the_search_offers_training_tiles_only_when_asked():
    from magis_nb.search.space import Space
    from magis_nb.simulate.cost import make_cost
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))
    prog = trace(model, (torch.randn(1, 2, 32, 32), torch.randn(1, 2, 32, 32)), loss_fn=F.mse_loss)
    cost = make_cost("rtx3090")
    tiled = lambda sp: [c for c in sp.cands if c.tiles]  # noqa: E731
    assert not tiled(Space(prog, cost, async_copies=True))
    assert tiled(Space(prog, cost, async_copies=True, tiles=True))


def test_forward_ops_are_not_tiled_in_a_training_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.ReLU(), nn.Conv2d(2, 2, 3, padding=1))
    x = torch.randn(1, 2, 16, 16)
    prog = trace(model, (x, torch.randn(1, 2, 16, 16)), loss_fn=F.mse_loss)
    cands = spatial_candidates(prog.graph, {}, 0)
    assert cands
    for c in cands:
        assert all(prog.graph.nodes[v].category == "gradient" for v in c.ops)


@pytest.mark.parametrize("layers", [
    [nn.Conv2d(2, 2, 1, bias=False), nn.ConvTranspose2d(2, 2, 1, stride=2, output_padding=1)],
    [nn.ConvTranspose2d(2, 2, 3, stride=3, padding=1, output_padding=2), nn.Conv2d(2, 2, 3)],
    [nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 1, stride=3), nn.Conv2d(2, 2, 3, padding=1)],
])
def test_rows_no_window_reaches(layers):
    """A transposed convolution's rows that no input reaches add to its bias
    gradient alone (found by the random chains above); a strided 1x1
    convolution's input rows that no output reads get a zero gradient."""
    torch.manual_seed(0)
    model = Chain(layers, torch.relu)
    x = torch.randn(1, 2, 12, 12)
    with torch.no_grad():
        out = model(x)
    _, got = tiled_steps(model, x, torch.randn_like(out))
    assert got
