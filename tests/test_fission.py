"""Fission: exact memory, random graphs split at random stay allclose, barriers hold,
and the F-Tree mutation rules."""
import dataclasses
import random

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from magis_nb.analysis import DGraph, apply_fission, build_ftree, check, max_parts, mutations
from magis_nb.analysis.ftrans import FTrans, divisors, plan_outputs
from magis_nb.analysis.ftree import Candidate
from magis_nb.program import trace
from magis_nb.runtime import measure_cpu
from magis_nb.verify import Reference

MiB = 2**20


class Chain(nn.Module):
    def forward(self, x):          # x: [4, 262144] float32 = 4 MiB
        a = x * 2
        b = a.relu()
        return b + 1


def test_fission_memory_is_exact():
    """Unsplit: x, a, b live at the relu (12 MiB), then x, b, out (12 MiB).
    Split in 4 along the batch: x (4) + the full output buffer (4) + two part-sized
    tensors at a time (a and b, then b and the part's out): 10 MiB."""
    x = torch.randn(4, MiB // 4)
    prog = trace(Chain(), (x,), mode="infer")
    assert prog.simulate().peak == 12 * MiB
    dg = DGraph(prog.graph)
    ops = frozenset(n.id for n in prog.graph.ops)
    batch = next(c for c in dg.components if ops <= set(c.axis_of) and c.size == 4)
    assert check(dg, ops, batch.id, 4) is None
    split = prog.with_graph(apply_fission(dg, [FTrans(ops, batch.id, 4)]))
    assert split.simulate().peak == 10 * MiB
    mod = split.module()
    m = measure_cpu(lambda: mod(x), [x])
    assert m.peak == 10 * MiB
    torch.testing.assert_close(m.result, Chain()(x))
    assert "for _k in range(4):" in mod.code


# -- random programs of supported ops, split at random --------------------------------
OPS = ["linear", "relu", "gelu", "add", "mul", "softmax", "layernorm", "tanh", "sumbatch"]


class RandomNet(nn.Module):
    def __init__(self, seed: int, depth: int, width: int = 16):
        super().__init__()
        rng = random.Random(seed)
        self.plan = [("linear", 0.0)] + [(rng.choice(OPS), rng.random()) for _ in range(depth)]
        self.lins = nn.ModuleList(nn.Linear(width, width) for _ in self.plan)
        self.ln = nn.LayerNorm(width)

    def forward(self, x):
        vals = [x]
        for i, (op, r) in enumerate(self.plan):
            h = vals[int(r * len(vals))]           # any earlier value: a random DAG
            if op == "linear":
                h = self.lins[i](h)
            elif op == "relu":
                h = torch.relu(h)
            elif op == "gelu":
                h = nn.functional.gelu(h)
            elif op == "add":
                h = h + vals[-1]
            elif op == "mul":
                h = h * vals[-1]
            elif op == "softmax":
                h = torch.softmax(h, -1)
            elif op == "layernorm":
                h = self.ln(h)
            elif op == "tanh":
                h = torch.tanh(h)
            else:                                  # a reduction over the batch, broadcast back
                h = h + h.sum(0, keepdim=True)
            vals.append(h)
        return sum(v.pow(2).mean() for v in vals[1:])


def _random_region(dg, rng: random.Random):
    """Grow a region from a random op inside its component; keep it if valid."""
    comps = [c for c in dg.components if len(c.axis_of) > 1]
    comp = rng.choice(comps)
    ops = comp.ops
    region = {rng.choice(ops)}
    target = rng.randint(1, len(ops))
    g = dg.graph
    for _ in range(4 * target):
        if len(region) >= target:
            break
        v = rng.choice(sorted(region))
        nbrs = [w for w in g.preds(v) + g.succs(v) if w in comp.axis_of and w not in region]
        if nbrs:
            trial = region | {rng.choice(nbrs)}
            if check(dg, trial, comp.id, 1) is None:
                region = trial
    return frozenset(region), comp.id


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), depth=st.integers(2, 7), pick=st.integers(0, 10_000))
def test_random_graph_random_split_is_allclose(seed, depth, pick):
    torch.manual_seed(seed)
    model = RandomNet(seed, depth)
    x = torch.randn(12, 16)
    prog = trace(model, (x,))
    dg = DGraph(prog.graph)
    rng = random.Random(pick)
    ops, comp = _random_region(dg, rng)
    assert check(dg, ops, comp, 1) is None
    n = rng.choice([d for d in divisors(max_parts(dg, ops, comp))])
    split = prog.with_graph(apply_fission(dg, [FTrans(ops, comp, n)]))
    chk = Reference(model, (x,), None, "train").check(split.module())
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak == split.simulate().peak


class WithBarrier(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x).relu()
        h = torch.sort(h, dim=0).values          # no rule: a barrier
        return self.b(h).pow(2).mean()


def test_an_op_without_rule_is_never_inside_a_region():
    prog = trace(WithBarrier(), (torch.randn(16, 8),))
    dg = DGraph(prog.graph)
    sort = [n.id for n in prog.graph.ops if n.target == "aten.sort.default"]
    assert sort and all(dg.dims[v] is None for v in sort)
    assert all(v not in c.axis_of for c in dg.components for v in sort)
    cands = build_ftree(dg, prog.hotspots())
    assert cands, "the linears around the barrier are still candidates"
    for c in cands:
        assert not set(sort) & c.ops
        # nor does any region reach from one side of the barrier to the other
        assert check(dg, c.ops | set(sort), c.comp, 1) is not None


# -- F-Tree mutation rules (§5.1) on a hand-made tree -------------------------------
def _tree():
    #        0 (ops 1..6, n<=12)
    #      /   \
    #     1     2
    #     |
    #     3
    mk = lambda i, ops, parent: Candidate(i, frozenset(ops), 0, 0, 1, 0.0, 0, 12, parent)  # noqa: E731
    c = [mk(0, range(1, 7), None), mk(1, {1, 2, 3}, 0), mk(2, {5, 6}, 0), mk(3, {2}, 1)]
    c[0].children, c[1].children = [1, 2], [3]
    return c


def test_enable_starts_at_leaves():
    got = {(k, tuple(sorted(p.items()))) for k, p in mutations(_tree(), {})}
    assert got == {("enable", ((2, 2),)), ("enable", ((3, 2),))}


def test_mutate_lift_disable_enable_parent():
    got = {(k, tuple(sorted(p.items()))) for k, p in mutations(_tree(), {3: 2})}
    assert ("mutate", ((3, 3),)) in got                  # 2 -> 3, next divisor of 12
    assert ("disable", ()) in got
    assert ("lift", ((1, 2),)) in got                    # the parent replaces the child
    assert ("enable", ((2, 2), (3, 2))) in got           # another leaf
    assert ("enable", ((1, 2),)) in got                  # parent of an enabled node
    assert all(dict(p).get(0, 1) == 1 for _, p in got)   # the root is two steps away


def test_pack_swaps_a_region_for_its_twin_and_back():
    """A packed twin (Note [packed masks]) is reached only by "pack" from its
    region, at the same n, and left by "unpack"; it is never enabled directly."""
    c = _tree()
    twin = Candidate(4, c[1].ops, 0, 0, 1, 0.0, 0, 12, None, [], pack=True, twin=1)
    c[1].twin = 4
    c.append(twin)
    assert {k for k, _ in mutations(c, {})} == {"enable"}
    assert all(4 not in p for _, p in mutations(c, {}))
    got = {(k, tuple(sorted(p.items()))) for k, p in mutations(c, {1: 3})}
    assert ("pack", ((4, 3),)) in got
    got = {(k, tuple(sorted(p.items()))) for k, p in mutations(c, {4: 3})}
    assert got == {("unpack", ((1, 3),)), ("mutate", ((4, 4),)), ("disable", ()),
                   ("enable", ((2, 2), (4, 3)))}


def test_mutate_walks_the_divisors():
    c = _tree()
    plan = {3: 2}
    seen = []
    while True:
        nxt = [p for k, p in mutations(c, plan) if k == "mutate"]
        if not nxt:
            break
        plan = nxt[0]
        seen.append(plan[3])
    assert seen == [3, 4, 6, 12]


@pytest.mark.parametrize("name", ["mlp", "vit", "unet-nobn", "unetpp-magis"])
def test_zoo_best_candidate_saves_memory_and_is_allclose(name):
    from magis_nb import zoo
    case = zoo.build(name, "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    dg = DGraph(prog.graph)
    cands = build_ftree(dg, prog.hotspots())
    best = max(cands, key=lambda c: c.score)
    split = prog.with_graph(apply_fission(dg, [best.ftrans(2)]))
    ref = Reference(case.model, case.inputs, case.loss_fn, "train")
    chk = ref.check(split.module())
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak == split.simulate().peak
    assert chk.measured_peak < 0.75 * prog.simulate().peak


class Upsampler(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x):
        y = nn.functional.avg_pool2d(self.a(x).relu(), 2)
        kw = {} if self.mode == "nearest" else {"align_corners": False}
        return self.b(nn.functional.interpolate(y, scale_factor=2, mode=self.mode, **kw))


@pytest.mark.parametrize("mode", ["nearest", "bilinear", "bicubic"])
def test_interpolation_splits_along_the_batch(mode):
    """F.interpolate reaches the graph as index arithmetic (`_unsafe_index`, and
    `_unsafe_index_put` into `new_zeros` backward): the batch split runs through it
    and its gradient, allclose, with the simulated peak measured to the byte."""
    from magis_nb.zoo.losses import cross_entropy
    torch.manual_seed(0)
    m, x, y = Upsampler(mode), torch.randn(8, 3, 32, 32), torch.randint(0, 2, (8, 32, 32))
    prog = trace(m, (x, y), loss_fn=cross_entropy)
    g = prog.graph
    dg = DGraph(g)
    best = max(build_ftree(dg, prog.hotspots()), key=lambda c: len(c.ops))
    inside = {g.nodes[v].target for v in best.ops}
    assert {"aten._unsafe_index.Tensor", "aten._unsafe_index_put.default",
            "aten.new_zeros.default"} <= inside
    assert dg.components[best.comp].name == "x0[0]"
    split = prog.with_graph(apply_fission(dg, [best.ftrans(4)]))
    chk = Reference(m, (x, y), cross_entropy, "train").check(split.module())
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak == split.simulate().peak < 0.7 * prog.simulate().peak


@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_packed_masks_are_bit_identical_and_smaller(name):
    """Note [packed masks]: the split with packed dropout masks computes the same
    bits as the plain split, matches eager, and its simulated peak, lower, is
    the measured one to the byte."""
    from magis_nb import zoo
    from magis_nb.analysis.masks import packable_masks
    case = zoo.build(name, "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    dg = DGraph(prog.graph)
    best = max(build_ftree(dg, prog.hotspots()), key=lambda c: c.score)
    f = best.ftrans(4)
    masks = packable_masks(prog.graph, f, dg)
    drawn = [n for n in prog.graph.ops if n.target == "aten.bernoulli_.float"]
    # all but (in GPT) the embedding's, applied before the region's first op
    assert len(drawn) - 1 <= len(masks) <= len(drawn) and masks
    plain = prog.with_graph(apply_fission(dg, [f]))
    packed = prog.with_graph(apply_fission(dg, [dataclasses.replace(f, pack=True)]))
    targets = [n.target for n in packed.graph.ops]
    assert targets.count("aten.sum.dim_IntList") - [n.target for n in plain.graph.ops].count(
        "aten.sum.dim_IntList") == len(masks)
    # the same masks, so the same bits as the plain split: loss and every gradient
    runs = []
    for split in (plain, packed):
        for q in case.model.parameters():
            q.grad = None
        torch.manual_seed(3)
        loss = split.module().step(*case.inputs)
        runs.append([loss] + [q.grad for q in case.model.parameters() if q.grad is not None])
    for q in case.model.parameters():
        q.grad = None
    assert len(runs[0]) == len(runs[1]) > 1
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    ref = Reference(case.model, case.inputs, case.loss_fn, "train").check(packed.module())
    assert ref.comparison.allclose, ref.comparison.mismatches
    assert ref.measured_peak == packed.simulate().peak < plain.simulate().peak
    # each mask is allocated after the one before it is packed (a dependency, so in
    # every order): one unpacked mask alive at a time (paper BTLM: all 97, 10.8 GB)
    pg = packed.graph
    kept = {m.name for m in pg.ops if m.target == "aten.sum.dim_IntList" and m.name.endswith("_packed")}
    allocs = [m for m in pg.ops if m.target == "aten.empty_strided.default"
              and any(pg.nodes[d].name in kept for d in m.deps)]
    assert len(allocs) == len(masks) - 1
    # a mask that an op outside the region reads (here its backward) stays whole
    g = prog.graph
    r = next(iter(masks))
    bwd = max(g.readers()[g.storage_of(r)])
    assert bwd in f.ops
    assert r not in packable_masks(g, FTrans(f.ops - {bwd}, f.comp, 4), dg)


def test_convexity_and_region_outputs_match_a_walk_of_the_whole_graph():
    """`reentered` stops its walk at the region's last op in topological order and
    `region_outputs` looks only at the region's successors; both must say what a
    walk over every node says, on the regions F-Tree builds and on arbitrary ones."""
    from magis_nb import zoo
    from magis_nb.analysis.ftrans import region_outputs, reentered
    from magis_nb.analysis.ftree import dominated_sets
    from magis_nb.ir import iter_refs

    def reentered_slow(g, ops):
        frontier = {w for v in ops for w in g.succs(v) if w not in ops}
        seen, stack = set(frontier), list(frontier)
        while stack:
            for w in g.succs(stack.pop()):
                if w not in seen:
                    seen.add(w)
                    stack.append(w)
        return seen & set(ops)

    def outputs_slow(g, ops):
        used = {r for r in g.outputs if r.node in ops}
        for n in g.nodes:
            if n.id not in ops:
                used |= {r for r in iter_refs((n.args, n.kwargs)) if r.node in ops}
        return sorted(used)

    case = zoo.build("gpt", "tiny")
    g = trace(case.model, case.inputs, loss_fn=case.loss_fn).graph
    dg = DGraph(g)
    ops = [n.id for n in g.ops]
    rng = random.Random(0)
    regions = [set(d) for comp in dg.components[:3]
               for d in dominated_sets(g, list(comp.ops)).values()]
    for _ in range(60):                 # windows of program order and random scatters
        i = rng.randrange(len(ops))
        regions.append(set(ops[i:i + rng.randrange(1, 40)]))
        regions.append(set(rng.sample(ops, rng.randrange(1, 30))))
    assert len(regions) > 150
    for r in regions:
        assert reentered(g, r) == reentered_slow(g, r)
        assert region_outputs(g, frozenset(r)) == outputs_slow(g, r)
    assert any(reentered(g, r) for r in regions) and any(not reentered(g, r) for r in regions)


def test_split_weight_gradients_accumulate_in_the_matmul():
    """A batch-split training step sums each part's weight gradient. A gradient
    made by ``mm`` is summed by the GEMM itself (``addmm_`` into the sum, one per
    part), not by a part-sized product and an ``add_``; the program stays
    allclose and its measured peak is the simulated one."""
    from magis_nb import zoo
    from magis_nb.analysis.ftrans import plan_outputs
    case = zoo.build("mlp", "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    dg = DGraph(prog.graph)
    best = max(build_ftree(dg, prog.hotspots()), key=lambda c: c.score)
    g = prog.graph
    by_mm = [r for r, (how, _) in plan_outputs(dg, best.ftrans(4)).items()
             if how == "sum" and g.nodes[r.node].target == "aten.mm.default"]
    assert by_mm
    split = prog.with_graph(apply_fission(dg, [best.ftrans(4)]))
    sg = split.graph
    fused = [n for n in sg.ops if n.target == "aten.addmm_.default"]
    assert len(fused) == 4 * len(by_mm)
    # no add_ reads a product of the split region's matmuls
    assert not any(n.target == "aten.add_.Tensor"
                   and any(sg.nodes[r.node].target in ("aten.mm.default", "aten.addmm_.default")
                           for r in n.args[1:2]) for n in sg.ops)
    ref = Reference(case.model, case.inputs, case.loss_fn, "train")
    chk = ref.check(split.module())
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak == split.simulate().peak


def test_a_tied_weight_sums_both_gradients_into_one_result(monkeypatch):
    """Note [one sum for a tied weight]: GPT ties its output head to the input
    embedding, so the embedding's gradient is the head's ``mm`` plus
    ``embedding_dense_backward``. Split along the batch, both accumulate into one
    full result and their add becomes an alias of it: one vocabulary-sized
    buffer less at the peak, allclose, measured peak = simulated."""
    from magis_nb import zoo
    import magis_nb.analysis.apply as ap
    case = zoo.build("gpt", "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    g = prog.graph
    dg = DGraph(g)
    f = max(build_ftree(dg, prog.hotspots()), key=lambda c: c.score).ftrans(4)
    shared = ap.shared_sums(g, f, plan_outputs(dg, f), {})
    assert len(shared) == 1
    (add, (r1, r2)), = shared.items()
    assert {g.nodes[r1.node].target, g.nodes[r2.node].target} == \
        {"aten.mm.default", "aten.embedding_dense_backward.default"}
    split = prog.with_graph(apply_fission(dg, [f]))
    sg = split.graph
    name = g.nodes[add].name
    alias = next(n for n in sg.ops if n.name == name)
    assert alias.target == "aten.alias.default"
    ref = Reference(case.model, case.inputs, case.loss_fn, "train")
    chk = ref.check(split.module())
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak == split.simulate().peak
    # the same split with two results: exactly one [vocab, d] buffer more
    monkeypatch.setattr(ap, "shared_sums", lambda *a: {})
    two = prog.with_graph(apply_fission(dg, [f]))
    assert two.simulate().peak - split.simulate().peak == g.tensor(r2).nbytes


def test_packed_masks_keep_the_draws_in_eager_order():
    """Packed masks are drawn one after another's packing (a dependency the split
    adds); a draw the packing does not touch keeps its place in the random
    stream, so the split draws eager's masks. PyTorch's TransformerEncoder (the
    corpus' torch-transformer) drew them in another order, and its packed split
    was not allclose."""
    from magis_nb.analysis.ftree import add_pack_twins
    from magis_nb.bench.corpus_models import MODELS
    case = MODELS["torch-transformer"][1]()
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    dg = DGraph(prog.graph)
    cands = build_ftree(dg, prog.hotspots())
    add_pack_twins(dg, cands)
    f = max((c for c in cands if c.pack), key=lambda c: len(c.ops)).ftrans(4)
    split = prog.with_graph(apply_fission(dg, [f]))
    draws = lambda g: [n.name for n in g.ops if n.rng]  # noqa: E731
    assert draws(split.graph) == draws(prog.graph)
    ref = Reference(case.model, case.inputs, case.loss_fn, "train").check(split.module())
    assert ref.comparison.allclose, ref.comparison.mismatches


def test_coarsen_takes_one_region_to_the_next_smaller_divisor():
    """`coarsenings`, the reverse of "mutate" for a search under a memory
    budget: one enabled region at a time, down to 2 parts, never disabled."""
    from magis_nb.analysis.ftree import coarsenings

    got = {tuple(sorted(p.items())) for k, p in coarsenings(_tree(), {3: 6, 2: 2})}
    assert got == {((2, 2), (3, 4))}      # 2 parts is the least: region 2 stays
    assert coarsenings(_tree(), {3: 2}) == []


def test_the_every_block_plan_is_coarsened_within_the_memory_budget():
    """`Search.coarsen`: each region in turn in fewer parts while the plan stays
    within the budget and gets faster, one try per region a pass. Priced here
    by hand: in n parts region 2 adds 256/n to the peak, region 3 32/n, and
    each n to the latency; under a limit of 40 region 2 stops at 8 parts and
    region 3 goes on to 4."""
    import types

    from magis_nb.search import algorithm
    from magis_nb.search.objective import Objective
    from magis_nb.search.space import State

    cands = _tree()
    for c in cands:
        c.max_n = 16

    def peak(d):
        return 256 // d[2] + 32 // d[3]

    def state(plan):
        d = dict(plan)
        return State(tuple(sorted(d.items())), (), None, [], [], peak(d), float(sum(d.values())),
                     [], 0)

    start = state({2: 16, 3: 16})
    s = algorithm.Search(types.SimpleNamespace(cands=cands), start, Objective("mem", 40), 60.0,
                          0, None, None, 1.0)
    tried = []

    def visit(st, rule, plan, batches, touched):
        assert rule == "coarsen" and st.peak <= 40
        tried.append(dict(plan))
        child = state(plan)
        s.record(child)
        return child

    s.visit = visit
    s.coarsen(start)
    assert tried == [{2: 8, 3: 16}, {2: 8, 3: 8}, {2: 4, 3: 8}, {2: 8, 3: 4}, {2: 4, 3: 4},
                     {2: 8, 3: 2}]
    assert s.log.best.plan == ((2, 8), (3, 4))
