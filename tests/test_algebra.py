"""The TASO subset: merge matmuls sharing an input, sink a scale into a matmul.
Exact graphs after each rewrite, inverses restore the digest, refusals (fission
region, in-place write), zoo steps allclose to eager at their simulated peak,
and the search proposing the rewrites and replaying them on a fission plan."""
import dataclasses

import pytest
import torch
import torch.nn as nn

from magis_nb.ir import Ref, graph_digest
from magis_nb.ir.graph import Graph, Node, TensorInfo
from magis_nb.program import trace
from magis_nb.rules import lift_scale, merge_matmuls, sink_scale, split_matmul
from magis_nb.rules.algebra import merge_all, merge_groups, why_not_merge
from magis_nb.rules.scale import sink_all, sink_sites, why_not_sink
from magis_nb.runtime import measure_cpu
from magis_nb.runtime.measure import model_baseline

KiB, MiB = 2**10, 2**20


class Shared(nn.Module):
    """Three matmuls read x: x @ w1, x @ w2, x @ w3, each output exactly 1 MiB."""
    def __init__(self, d=256):
        super().__init__()
        self.w = nn.ParameterList([nn.Parameter(torch.randn(d, d) / 16) for _ in range(3)])

    def forward(self, x):
        a, b, c = (x @ w for w in self.w)
        return a.sum() + b.sum() * 2 + c.sum() * 3


class Lin(nn.Module):
    """Three linears on one input (addmm with a transposed weight), widths 3, 5, 2."""
    def __init__(self):
        super().__init__()
        self.l = nn.ModuleList([nn.Linear(4, k) for k in (3, 5, 2)])

    def forward(self, x):
        return torch.cat([lin(x) for lin in self.l], 1).relu()


class Scaled(nn.Module):
    def forward(self, q, k):
        return ((q @ k) / 4.0).softmax(-1)


def _targets(g):
    return [n.target.split(".")[1] for n in g.ops]


def _mms(g, target="aten.mm.default"):
    return [n.id for n in g.ops if n.target == target]


def test_merge_three_mms_exactly_and_split_back():
    """One mm over cat([w1, w2, w3], 1), three column slices named like the mms.
    Unmerged, the peak holds x (1 MiB), the weights (768 KiB), the three
    outputs and the first sum (4 B); merged, the weight copy (768 KiB) lives
    while the 3 MiB merged output is computed. The measured peak agrees and the
    result equals eager."""
    x = torch.randn(1024, 256)
    model = Shared()
    prog = trace(model, (x,), mode="infer")
    g = prog.graph
    assert merge_groups(g) == [tuple(_mms(g))]
    g2 = merge_matmuls(g, _mms(g))
    assert _targets(g2).count("mm") == 1 and _targets(g2).count("cat") == 1
    slices = [n for n in g2.ops if n.target == "aten.slice.Tensor"]
    assert [(n.name, n.args[1:]) for n in slices] == [
        ("mm", (1, 0, 256)), ("mm_1", (1, 256, 512)), ("mm_2", (1, 512, 768))]
    assert len(g2.nodes) == len(g.nodes) + 2          # + cat + merged mm
    merged = next(n for n in g2.ops if n.target == "aten.mm.default")
    assert merged.outputs[0].shape == (1024, 768)
    p2 = prog.with_graph(g2)
    assert prog.simulate().peak == 4 * MiB + 768 * KiB + 4
    assert p2.simulate().peak == 5 * MiB + 512 * KiB
    mod = p2.module()
    m = measure_cpu(lambda: mod(x), model_baseline(model, [x]))
    assert m.peak == p2.simulate().peak
    torch.testing.assert_close(m.result, model(x))
    assert graph_digest(split_matmul(g2, merged.id)) == graph_digest(g)


def test_merge_mms_sharing_the_right_operand():
    """w1 @ x, w2 @ x -> cat([w1, w2], 0) @ x and row slices."""
    class Right(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5, 4))

        def forward(self, x):
            return (self.a @ x).relu().sum() + (self.b @ x).sum()

    x = torch.randn(4, 6)
    prog = trace(Right(), (x,), mode="infer")
    g2 = merge_matmuls(prog.graph, _mms(prog.graph))
    assert [(n.name, n.args[1:]) for n in g2.ops if n.target == "aten.slice.Tensor"] == [
        ("mm", (0, 0, 3)), ("mm_1", (0, 3, 8))]
    torch.testing.assert_close(prog.with_graph(g2).module()(x), Right.__call__(prog.model, x))
    merged = next(n.id for n in g2.ops if n.target == "aten.mm.default")
    assert graph_digest(split_matmul(g2, merged)) == graph_digest(prog.graph)


def test_merge_linears_concatenates_weights_and_biases():
    """addmm(b_i, x, t(W_i)) x3 -> addmm(cat(b), x, cat(t(W), 1)): 2 cats, 1 addmm."""
    x = torch.randn(8, 4)
    model = Lin()
    prog = trace(model, (x,), mode="infer")
    g = prog.graph
    ops = _mms(g, "aten.addmm.default")
    g2 = merge_matmuls(g, ops)
    assert _targets(g2).count("addmm") == 1 and _targets(g2).count("cat") == 3  # 2 + the model's
    torch.testing.assert_close(prog.with_graph(g2).module()(x), model(x))
    merged = next(n.id for n in g2.ops if n.target == "aten.addmm.default")
    assert graph_digest(split_matmul(g2, merged)) == graph_digest(g)


def test_merge_refuses_a_fission_region_and_an_in_place_write():
    prog = trace(Shared(16), (torch.randn(64, 16),), mode="infer")
    g = prog.graph
    ops = _mms(g)
    assert why_not_merge(g, ops) is None
    nodes = [dataclasses.replace(n, region=(0, 0)) if n.id == ops[1] else n for n in g.nodes]
    assert "fission region" in why_not_merge(Graph(nodes, g.outputs, g.output_roles), ops)
    # an op that writes into mm_2's output after it is computed
    t = g.nodes[ops[2]].outputs[0]
    mul_ = Node(len(g.nodes), "mul_", "op", "aten.mul_.Tensor", torch.ops.aten.mul_.Tensor,
                (Ref(ops[2], 0), 2.0), {}, [TensorInfo(t.shape, t.dtype, 0, Ref(ops[2], 0))])
    g3 = Graph(list(g.nodes) + [mul_], g.outputs, g.output_roles)
    assert "written in place" in why_not_merge(g3, ops)
    with pytest.raises(ValueError, match="written in place"):
        merge_matmuls(g3, ops)


def test_sink_scale_exactly_and_lift_back():
    """softmax(view(bmm(q, k)) / 4) -> softmax(view(bmm(q / 4, k))): the div now
    scales q's 2x6x3, not the 2x6x6 product; dividing by 4 is exact."""
    q, k = torch.randn(2, 6, 3), torch.randn(2, 3, 6)
    prog = trace(Scaled(), (q, k), mode="infer")
    g = prog.graph
    (d,) = sink_sites(g)
    g2 = sink_scale(g, d)
    assert _targets(g2) == ["expand", "view", "expand", "view", "div", "bmm", "view", "_softmax"]
    div = next(n for n in g2.ops if n.target == "aten.div.Tensor")
    assert div.name == "div" and div.outputs[0].shape == (2, 6, 3)
    assert torch.equal(prog.with_graph(g2).module()(q, k), Scaled()(q, k))
    assert graph_digest(lift_scale(g2, div.id)) == graph_digest(g)


def test_sink_refuses_a_scale_read_through_a_view_or_in_a_region():
    class Viewed(nn.Module):
        def forward(self, q, k):
            return ((q @ k) / 4.0).view(-1).softmax(-1)

    g = trace(Viewed(), (torch.randn(2, 6, 3), torch.randn(2, 3, 6)), mode="infer").graph
    d = next(n.id for n in g.ops if n.target == "aten.div.Tensor")
    assert "through a view" in why_not_sink(g, d)
    g = trace(Scaled(), (torch.randn(2, 6, 3), torch.randn(2, 3, 6)), mode="infer").graph
    d = next(n.id for n in g.ops if n.target == "aten.div.Tensor")
    nodes = [dataclasses.replace(n, region=(0, 0)) if n.id == d else n for n in g.nodes]
    assert "fission region" in why_not_sink(Graph(nodes, g.outputs, g.output_roles), d)


@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_zoo_step_with_every_merge_and_sink_matches_eager(name):
    """Q/K/V (forward) and weight-gradient (backward) merges, and the attention
    scale sunk onto q, in one training step: loss and gradients allclose to eager,
    measured peak == simulated peak, and undoing every rewrite restores the digest."""
    from magis_nb import zoo
    from magis_nb.verify import Reference
    case = zoo.build(name, "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    g = prog.graph
    groups, sites = merge_groups(g), sink_sites(g)
    assert len(groups) == 8 and len(sites) == 4     # 4 layers: QKV fwd + dW bwd; 4 scales
    merged_names = [g.nodes[gr[0]].name + "_merged" for gr in groups]
    scale_names = [g.nodes[d].name for d in sites]
    g2 = sink_all(merge_all(g, groups), sink_sites(merge_all(g, groups)))
    p2 = prog.with_graph(g2)
    chk = Reference(case.model, case.inputs, case.loss_fn, "train").check(p2.module())
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak == p2.simulate().peak
    g3 = g2
    for nm in scale_names:
        g3 = lift_scale(g3, next(n.id for n in g3.nodes if n.name == nm))
    for nm in merged_names:
        g3 = split_matmul(g3, next(n.id for n in g3.nodes if n.name == nm))
    assert graph_digest(g3) == graph_digest(g)


def test_search_proposes_algebra_and_replays_it_outside_fission_regions():
    """On tiny gpt with the RTX 3090 roofline, merging and sinking save time and
    keep the peak; a merge batch replayed on a plan whose region holds one
    group's matmuls drops that group only; the kill switch stops the proposals."""
    from magis_nb import zoo
    from magis_nb.search.proposals import proposals
    from magis_nb.search.space import Space
    from magis_nb.simulate.cost import make_cost
    case = zoo.build("gpt", "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    space = Space(prog, make_cost("rtx3090"), async_copies=True)
    root = space.evaluate((), (), prog.graph)
    kids = {r: (p, b) for r, p, b, _ in proposals(space, root) if r.startswith(("merge", "sink"))}
    assert set(kids) == {"mergex4", "merge", "sinkx4", "sink"}   # backward merges cost time
    for rule, (plan, batches) in kids.items():
        g, kept = space.build(plan, batches)
        st = space.evaluate(plan, kept, g)
        assert st.latency < root.latency and st.peak == root.peak, rule
    batch = kids["mergex4"][1][-1]
    names = {nm for s in batch.specs for nm in s.ops}
    cid = next(c for c, cand in enumerate(space.cands)
               if names & {space.base.nodes[i].name for i in cand.ops})
    g, kept = space.build(((cid, 2),), (batch,))
    fg = space.fission_graph(((cid, 2),))
    in_region = {n.name for n in fg.ops if n.region}
    assert kept and len(kept[0].specs) < 4
    assert all(not (set(s.ops) & in_region) for s in kept[0].specs)
    off = Space(prog, make_cost("rtx3090"), async_copies=True, algebra=False)
    assert not [r for r, *_ in proposals(off, off.evaluate((), (), prog.graph))
                if r.startswith(("merge", "sink"))]
