"""A convolution of a cat run as one convolution per piece (Note [a convolution
of a cat] in rules/cat_conv.py): the step allclose to eager, its measured peak
equal to the simulated one, the cat's storage gone; refused where the cat has
another reader; and taken before the search where it costs nothing."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import magis_nb
from magis_nb import zoo
from magis_nb.program import trace
from magis_nb.rules.cat_conv import split_all, split_sites, why_not_split
from magis_nb.runtime import OptimizedModule
from magis_nb.search.proposals import cat_splits, proposals
from magis_nb.search.space import Batch, Split
from magis_nb.simulate.memory import simulate_memory
from magis_nb.verify import Reference

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def _peak(g) -> int:
    mg, _, _ = g.memgraph()
    return simulate_memory(mg, list(range(mg.n))).peak


def _check(model, inputs, loss_fn, g, captured):
    ref = Reference(model, inputs, loss_fn, "train")
    res = ref.check(OptimizedModule(model, captured, g, g.program_order()))
    assert res.comparison.allclose, res.comparison.mismatches
    assert res.measured_peak == _peak(g)
    return res


def test_unet_decoder_convolutions_run_per_piece_like_eager_without_the_cats():
    case = zoo.build("unet", "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    g = prog.graph
    sites = split_sites(g)
    # every decoder block's first convolution reads cat([skip, up])
    assert len(sites) == 4
    g2 = split_all(g, sites)
    assert not any(n.target == "aten.cat.default" and n.outputs[0].shape[1] == 16
                   and n.outputs[0].shape[-1] == 128 for n in g2.ops)
    # the cat of the full-resolution block (16 x 16 x 128 x 128 floats) is gone
    # from the program's peak, in program order
    assert _peak(g2) < _peak(g)
    _check(case.model, case.inputs, case.loss_fn, g, prog.captured)
    _check(case.model, case.inputs, case.loss_fn, g2, prog.captured)


class _ThreeWay(nn.Module):
    """A biased, strided, dilated convolution of a cat of three pieces, one of
    them the input (no gradient wanted for it)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 5, 3, padding=1), nn.Conv2d(3, 4, 1)
        self.c = nn.Conv2d(12, 6, 3, stride=2, padding=2, dilation=2)

    def forward(self, x):
        return self.c(torch.cat([torch.relu(self.a(x)), x, self.b(x)], 1))


def test_three_pieces_with_bias_stride_and_dilation_match_eager():
    torch.manual_seed(0)
    model = _ThreeWay()
    x, y = torch.randn(2, 3, 17, 15), torch.randn(2, 6, 9, 8)
    prog = trace(model, (x, y), loss_fn=F.mse_loss)
    g = prog.graph
    (site,) = split_sites(g)
    g2 = split_all(g, [site])
    res = _check(model, (x, y), F.mse_loss, g2, prog.captured)
    assert res.measured_peak < _check(model, (x, y), F.mse_loss, g, prog.captured).measured_peak


class _CatReadTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.c = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(7, 4, 3, padding=1)

    def forward(self, x):
        h = torch.cat([self.a(x), x], 1)
        return self.c(h) + h[:, :4]


def test_a_cat_with_another_reader_is_left_whole():
    torch.manual_seed(0)
    model = _CatReadTwice()
    x, y = torch.randn(2, 3, 8, 8), torch.randn(2, 4, 8, 8)
    g = trace(model, (x, y), loss_fn=F.mse_loss).graph
    assert split_sites(g) == []
    conv = next(n for n in g.ops if n.target == "aten.convolution.default"
                and g.nodes[n.args[0].node].target == "aten.cat.default")
    assert "reads the cat" in why_not_split(g, conv.id)
    with pytest.raises(ValueError, match="cannot split"):
        split_all(g, [conv.id])


def test_the_search_starts_from_the_split_where_it_costs_nothing():
    case = zoo.build("unet", "paper", device="meta")
    kw = dict(loss_fn=case.loss_fn, device_profile="rtx3090", time_budget=60, max_states=1)
    res = magis_nb.optimize(case.model, case.inputs, **kw)
    # simulated RTX 3090: the four splits lower the peak and take no time, and
    # the first state the search proposes has them
    assert sum(a.startswith("split ") for a in res.plan.algebra) == 4
    assert res.plan.peak < res.before.peak and res.plan.latency <= res.before.latency
    assert not res.before.algebra
    off = magis_nb.optimize(case.model, case.inputs, algebra=False, **kw)
    assert not off.plan.algebra and off.plan.peak > res.plan.peak
    # a state without them proposes them for the cats at its peak, biggest first
    space = res.builder.space
    plain = space.evaluate((), (), res.before.state.graph)
    splits = cat_splits(space, plain)
    assert splits and splits[0].op == "convolution_20"   # the full-resolution block
    kids = {rule for rule, *_ in proposals(space, plain)}
    assert "split" in kids and (len(splits) == 1 or f"splitx{len(splits)}" in kids)


def test_cpu_op_timings_leave_the_cats_whole():
    # Note [a convolution of a cat]: the ops timed alone price the split as
    # free, the step measures it slower
    case = zoo.build("unet", "tiny")
    res = magis_nb.optimize(case.model, case.inputs, loss_fn=case.loss_fn, device_profile="measured",
                            time_budget=120, max_states=3, verify=False)
    assert not res.builder.space.split_cats
    assert not any(a.startswith("split ") for p in res.pareto for a in p.algebra)


def test_backward_alone_keeps_the_forward_and_matches_eager():
    # Note [a backward of a cat, one per piece]: the forward convolution of
    # the cat stays, the backwards run per piece, and nothing after the
    # forward reads the cat
    case = zoo.build("unet", "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    g = prog.graph
    sites = split_sites(g, backward=True)
    assert len(sites) == 4
    g2 = split_all(g, sites, whole_forward=sites)
    cat = "aten.cat.default"
    assert sum(n.target == cat for n in g2.ops) == sum(n.target == cat for n in g.ops) + 4  # the weight gradients' cats
    convs = {n.name for n in g2.ops if n.target == "aten.convolution.default"}
    assert {g.nodes[s].name for s in sites} <= convs
    for s in sites:
        name = g.nodes[s].name
        f = next(n for n in g2.ops if n.name == name)
        assert g2.nodes[f.args[0].node].target == cat
        assert len(g2.readers()[f.args[0]]) == 1      # the forward alone reads it
    # a cat whose backward is split has nothing left to split there
    assert split_sites(g2, backward=True) == []
    assert set(split_sites(g2)) == {n.id for n in g2.ops if n.name in {g.nodes[s].name for s in sites}}
    res = _check(case.model, case.inputs, case.loss_fn, g2, prog.captured)
    assert res.measured_peak < _peak(g)


def test_three_pieces_backward_alone_matches_eager():
    torch.manual_seed(0)
    model = _ThreeWay()
    x, y = torch.randn(2, 3, 17, 15), torch.randn(2, 6, 9, 8)
    prog = trace(model, (x, y), loss_fn=F.mse_loss)
    (site,) = split_sites(prog.graph)
    _check(model, (x, y), F.mse_loss, split_all(prog.graph, [site], whole_forward=[site]), prog.captured)


def test_a_cats_input_gradient_at_the_peak_proposes_its_backward_alone():
    # U-Net++'s last block reads a cat of five pieces: at the unsplit
    # program's peak (simulated RTX 3090) its backward's input gradient, as
    # big as the cat, waits for the last piece's reader
    case = zoo.build("unetpp", "tiny", device="meta")
    res = magis_nb.optimize(case.model, case.inputs, loss_fn=case.loss_fn, device_profile="rtx3090",
                            time_budget=60, max_states=1)
    space = res.builder.space
    st = space.evaluate((), (), res.before.state.graph)
    g = st.graph
    grads = {g.nodes[r.node].args[1] for _, r in st.hot_grads}
    conv = next(n for n in g.ops if n.target == "aten.convolution.default" and n.args[0] in grads)
    assert len(g.nodes[conv.args[0].node].args[0]) == 5
    assert Split(conv.name, False) in cat_splits(space, st)
    g2, batches = space.build((), (Batch("split", frozenset({Split(conv.name, False)})),))
    assert batches and space.evaluate((), batches, g2).peak < st.peak
    # and the program it makes is the eager step's
    real = zoo.build("unetpp", "tiny")
    prog = trace(real.model, real.inputs, loss_fn=real.loss_fn)
    site = next(n.id for n in prog.graph.ops if n.name == conv.name)
    _check(real.model, real.inputs, real.loss_fn, split_all(prog.graph, [site], whole_forward=[site]),
           prog.captured)


def test_a_fission_parts_recomputed_cat_has_its_backward_split_in_every_part():
    # A batch split of a U-Net++ backward recomputes each part's slice of a
    # cat for its convolution's backward: no forward convolution reads it,
    # the backward is the site, and the split is made in every part
    case = zoo.build("unetpp", "tiny")
    res = magis_nb.optimize(case.model, case.inputs, loss_fn=case.loss_fn, device_profile="rtx3090",
                            time_budget=60, max_states=1, verify=False)
    space = res.builder.space
    for cid in range(len(space.cands)):
        plan = ((cid, 2),)
        g = space.fission_graph(plan)
        inside = [i for i in split_sites(g, backward=True) if g.nodes[i].region]
        if inside:
            break
    else:
        pytest.fail("no fission part of the tiny U-Net++ holds a cat that only backwards read")
    site = g.nodes[inside[0]]
    assert site.target == "aten.convolution_backward.default" and site.name.endswith("_p0")
    cat = g.nodes[site.args[1].node]
    g2, batches = space.build(plan, (Batch("split", frozenset({Split(site.name, False)})),))
    assert batches
    names = {n.name for n in g2.ops}
    assert cat.name not in names and cat.name[:-1] + "1" not in names     # both parts' cats
    stem = site.name[:-len("_p0")]
    assert {f"{stem}_part0_p0", f"{stem}_part0_p1"} <= names
    st = space.evaluate(plan, batches, g2)
    ref = Reference(case.model, case.inputs, case.loss_fn, "train")
    out = ref.check(OptimizedModule(case.model, space.program.captured, *st.runs))
    assert out.comparison.allclose, out.comparison.mismatches
    assert out.measured_peak == st.peak
