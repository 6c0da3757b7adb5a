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


def late_use_ids(prog):
    mul = [n.id for n in prog.graph.ops if n.target == "aten.mul.Tensor"][0]
    late = [n.id for n in prog.graph.ops if n.target == "aten.add.Tensor"][-1]
    return mul, late


def test_remat_lowers_the_peak_exactly():
    """Unsplit: x, a, t1, t2, t3 live together: 5 MiB. With a recomputed for the
    last add, a dies after t1: the peak is x, t1, t2, t3 = 4 MiB."""
    x = torch.randn(MiB // 4)
    prog = trace(LateUse(), (x,), mode="infer")
    assert prog.simulate().peak == 5 * MiB
    a, late = late_use_ids(prog)
    re = prog.with_graph(rematerialize(prog.graph, a, [late]))
    assert re.simulate().peak == 4 * MiB
    mod = re.module()
    m = measure_cpu(lambda: mod(x), [x])
    assert m.peak == 4 * MiB
    torch.testing.assert_close(m.result, LateUse()(x))
    assert mod.code.count("aten.mul.Tensor(x0, 2)") == 2


def test_merge_restores_the_digest():
    prog = trace(LateUse(), (torch.randn(64),), mode="infer")
    a, late = late_use_ids(prog)
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


class DeadChain(nn.Module):
    """b = exp(a) dies early, c = b * 3 is read again at the end: recomputing c
    needs b, which is dead, so the chain is [b's op] and the recompute reads only
    a, alive anyway (it is read at the end too)."""
    def forward(self, x):
        a = x + 1
        b = a.exp()
        c = b * 3
        t = c + a
        u, v = t * 2, t * 3
        t = u + v
        return t + c + a


def _dead_chain():
    prog = trace(DeadChain(), (torch.randn(MiB // 4),), mode="infer")
    g = prog.graph
    byname = {n.name: n.id for n in g.ops}
    return prog, g, byname


def test_chain_to_live_finds_the_dead_inputs_producers():
    from magis_nb.rules.remat import chain_to_live
    prog, g, ids = _dead_chain()
    a, b, c = ids["add"], ids["exp"], ids["mul"]
    assert chain_to_live(g, c, {Ref(a, 0)}) == [b]
    assert chain_to_live(g, c, {Ref(b, 0)}) == []
    assert chain_to_live(g, c, set()) == [a, b]          # x is a graph input
    assert chain_to_live(g, c, set(), limit=1) is None


def test_chain_remat_lowers_the_peak_exactly_and_merges_back():
    """Unsplit, x a c t u v live together: 6 MiB. With c (and exp) recomputed
    for its late reader, c is gone while u and v are made; the recompute itself
    holds x a t b' c': 5 MiB. Measured equals simulated, the result is eager's,
    and merging the copies back in order restores the digest."""
    prog, g, ids = _dead_chain()
    b, c = ids["exp"], ids["mul"]
    late = max(g.readers()[Ref(c, 0)])
    g2 = rematerialize(g, c, [late], chain=[b])
    sw = prog.with_graph(g2)
    assert prog.simulate().peak == 6 * MiB and sw.simulate().peak == 5 * MiB
    x = torch.randn(MiB // 4)
    m = measure_cpu(lambda: sw.module()(x), [x])
    assert m.peak == sw.simulate().peak
    torch.testing.assert_close(m.result, DeadChain()(x))
    names = {n.name: n.id for n in g2.ops}
    assert {"exp_re", "mul_re"} <= set(names)
    back = merge_recompute(g2, names["exp"], names["exp_re"])
    names = {n.name: n.id for n in back.ops}
    back = merge_recompute(back, names["mul"], names["mul_re"])
    assert graph_digest(back) == graph_digest(g)


@pytest.mark.parametrize("name,target", [("gpt", "aten._softmax.default"),
                                         ("unet", "aten.relu.default")])
def test_chain_remat_of_attention_and_conv_blocks_matches_eager(name, target, one_thread):
    """Softmax recomputed from the saved q, k (bmm, view, scale, mask) and ReLU
    from the saved conv output (through BatchNorm, which the copy normalizes with
    the statistics the original saved: its elementwise phase, Note [BatchNorm in
    phases]) for every backward reader: the step equals eager's (buffers
    included) at exactly the simulated, lower peak."""
    from magis_nb import zoo
    from magis_nb.rules.remat import chain_to_live, rematerialize_all
    from magis_nb.verify import Reference
    case = zoo.build(name, "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    g, live, rd = prog.graph, set(prog.hotspots()), prog.graph.readers()
    specs = []
    for n in g.ops:
        r = Ref(n.id, 0)
        if n.target != target or r not in live or can_rematerialize(g, n.id):
            continue
        users = {u for u in rd[r] if g.nodes[u].category == "gradient"}
        chain = chain_to_live(g, n.id, live)
        assert chain, f"{n.name} reads a dead tensor: a chain is needed"
        specs.append((n.id, users, chain))
    assert len(specs) >= 4
    p2 = prog.with_graph(rematerialize_all(g, specs))
    chk = Reference(case.model, case.inputs, case.loss_fn, "train").check(p2.module())
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak == p2.simulate().peak < prog.simulate().peak
    copies = [n.target for n in p2.graph.ops if n.name.endswith("_re")]
    if name == "unet":      # statistics are not reduced again, running stats update once
        assert "magis_nb.bn_elemt.default" in copies
        assert not any(t.startswith(("magis_nb.bn_stats", "magis_nb.bn_running")) for t in copies)


def test_batchnorm_recompute_is_its_elementwise_phase(one_thread):
    """A training BatchNorm is written in phases (Note [BatchNorm in phases]): a
    ReLU recomputed through it copies only the normalize, which reads the saved
    statistics; the step equals eager's (running statistics updated once) at
    the simulated peak, for BatchNorm with and without running stats and
    without affine weights."""
    from magis_nb.rules.remat import rematerialize_all
    from magis_nb.verify import Reference

    for bn in (nn.BatchNorm2d(6), nn.BatchNorm2d(6, track_running_stats=False),
               nn.BatchNorm2d(6, affine=False)):
        model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), bn, nn.ReLU(), nn.Conv2d(6, 4, 3))
        inputs = (torch.randn(8, 3, 32, 32), torch.randn(8, 4, 30, 30))
        loss = lambda out, t: (out - t).square().mean()      # noqa: E731
        prog = trace(model, inputs, loss_fn=loss)
        g, rd = prog.graph, prog.graph.readers()
        norm = next(n for n in g.ops if n.target == "magis_nb.bn_elemt.default")
        relu = next(n for n in g.ops if n.target == "aten.relu.default")
        late = {u for u in rd[Ref(relu.id, 0)] if g.nodes[u].category == "gradient"}
        g2 = rematerialize_all(g, [(relu.id, late, (norm.id,))])
        targets = [n.target for n in g2.ops if n.name.endswith("_re")
                   and n.target != "aten.detach.default"]     # detach: views rebuilt on the copy
        assert targets == ["magis_nb.bn_elemt.default", "aten.relu.default"]
        p2 = prog.with_graph(g2)
        chk = Reference(model, inputs, loss, "train").check(p2.module())
        assert chk.comparison.allclose, chk.comparison.mismatches
        assert chk.measured_peak == p2.simulate().peak

def _bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 2, 1))


def test_a_recompute_reads_a_swapped_tensors_loaded_copy(one_thread):
    """Note [recomputed from a loaded copy]: the first conv output swapped, then
    its block's ReLU recomputed for the backward from the conv output's Load,
    moved up to before the recompute; the original dies in the forward."""
    import torch.nn.functional as F

    from magis_nb.rules.remat import chain_to_live, swapped_copies
    from magis_nb.rules.swap import is_load, swap
    from magis_nb.runtime import OptimizedModule
    from magis_nb.simulate.memory import simulate_memory
    from magis_nb.verify import Reference
    model = _bn_net()
    x, y = torch.randn(4, 3, 16, 16), torch.randn(4, 2, 16, 16)
    prog = trace(model, (x, y), loss_fn=F.mse_loss)
    g = prog.graph
    loss = next(n.id for n in g.ops if n.target == "aten.mse_loss.default")
    conv = next(n.id for n in g.ops if n.target == "aten.convolution.default")
    relu = next(n.id for n in g.ops if n.target == "aten.relu.default")
    late = lambda v: {u for u in g.readers()[Ref(v, 0)] if u > loss}  # noqa: E731
    g1 = swap(g, Ref(conv, 0), late(conv))
    ids = {n.name: n.id for n in g1.nodes}
    conv, relu, loss = ids[g.nodes[conv].name], ids[g.nodes[relu].name], ids[g.nodes[loss].name]
    late = lambda v: {u for u in g1.readers()[Ref(v, 0)] if u > loss}  # noqa: E731
    loads = swapped_copies(g1)
    assert list(loads) == [Ref(conv, 0)]
    live = set(loads) | {Ref(n.id, i) for n in g1.ops if n.target == "magis_nb.bn_finalize.default"
                         for i in range(len(n.outputs))}
    chain = chain_to_live(g1, relu, live)
    assert [g1.nodes[v].target for v in chain] == ["magis_nb.bn_elemt.default"]
    g2 = rematerialize(g1, relu, late(relu), chain)
    copy = next(n for n in g2.ops if n.name.endswith("_re") and n.target == "magis_nb.bn_elemt.default")
    src = g2.nodes[copy.args[0].node]
    assert is_load(g2, src.id) and src.id < copy.id
    p2 = prog.with_graph(g2)
    order = p2.to_node_order(p2.program_order())
    chk = Reference(model, (x, y), F.mse_loss, "train").check(OptimizedModule(model, prog.captured, g2, order))
    mg, ids, _ = g2.memgraph()
    index = {v: i for i, v in enumerate(ids)}
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak == simulate_memory(mg, [index[v] for v in order]).peak
