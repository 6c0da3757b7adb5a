"""Re-materialization: exact memory, eager equality, the inverse restores the graph."""
import pytest
import torch
import torch.nn as nn

from magis_nb.ir import Ref, graph_digest, iter_refs
from magis_nb.program import trace
from magis_nb.rules import can_rematerialize, merge_recompute, rematerialize
from magis_nb.runtime import measure_cpu

MiB = 2**20


class LateUse(nn.Module):
    def forward(self, x):
        a = x * 2          # used early (t1) and late (out)
        t1 = x + a
        t2 = t1 * 2
        t3 = t1 + t2
        return t3 + a


def _ids(prog):
    mul = [n.id for n in prog.graph.ops if n.target == "aten.mul.Tensor"][0]
    late = [n.id for n in prog.graph.ops if n.target == "aten.add.Tensor"][-1]
    return mul, late


def test_remat_lowers_the_peak_exactly():
    """Unsplit: x, a, t1, t2, t3 live together: 5 MiB. With a recomputed for the
    last add, a dies after t1: the peak is x, t1, t2, t3 = 4 MiB."""
    x = torch.randn(MiB // 4)
    prog = trace(LateUse(), (x,), mode="infer")
    assert prog.simulate().peak == 5 * MiB
    a, late = _ids(prog)
    re = prog.with_graph(rematerialize(prog.graph, a, [late]))
    assert re.simulate().peak == 4 * MiB
    mod = re.module()
    m = measure_cpu(lambda: mod(x), [x])
    assert m.peak == 4 * MiB
    torch.testing.assert_close(m.result, LateUse()(x))
    assert mod.code.count("aten.mul.Tensor(x0, 2)") == 2


def test_merge_restores_the_digest():
    prog = trace(LateUse(), (torch.randn(64),), mode="infer")
    a, late = _ids(prog)
    g2 = rematerialize(prog.graph, a, [late])
    assert graph_digest(g2) != graph_digest(prog.graph)
    copy = [n.id for n in g2.ops if n.name.endswith("_re")][0]
    orig = [n.id for n in g2.ops if n.target == "aten.mul.Tensor"][0]
    assert graph_digest(merge_recompute(g2, orig, copy)) == graph_digest(prog.graph)


class Drop(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        return nn.functional.dropout(self.l(x), 0.5).sum()


def test_rng_ops_are_never_recomputed():
    prog = trace(Drop(), (torch.randn(4, 8),))
    draw = [n.id for n in prog.graph.ops if n.rng][0]
    assert "random" in can_rematerialize(prog.graph, draw)
    users = [n.id for n in prog.graph.ops
             if any(r.node == draw for r in iter_refs((n.args, n.kwargs)))]
    with pytest.raises(ValueError, match="random"):
        rematerialize(prog.graph, draw, users[-1:])


def test_remat_in_a_training_step_matches_eager():
    """Recompute every forward activation the backward reads (classic
    checkpointing of the relus): same loss and gradients, simulated == measured."""
    from magis_nb import zoo
    from magis_nb.verify import Reference
    case = zoo.build("mlp", "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    g = prog.graph
    for name in [n.name for n in g.ops if n.target == "aten.relu.default"]:
        relu = [n.id for n in g.ops if n.name == name][0]   # ids move with each rewrite
        late = [n.id for n in g.ops if n.category == "gradient"
                and any(g.storage_of(r) == Ref(relu, 0) for r in iter_refs((n.args, n.kwargs)))]
        if late:
            g = rematerialize(g, relu, late)
    relus = lambda gr: sum(n.target == "aten.relu.default" for n in gr.ops)  # noqa: E731
    assert relus(g) > relus(prog.graph), "some relu output is read by the backward"
    re = prog.with_graph(g)
    chk = Reference(case.model, case.inputs, case.loss_fn, "train").check(re.module())
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak == re.simulate().peak
