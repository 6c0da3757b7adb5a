"""Swaps and remats inside a split region's parts (Note [rewrites inside the
parts] in `search.space`): proposed for a part's activations, made in every
part, never across a part's boundary; the split program stays allclose to
eager at exactly its simulated peak."""
import pytest
import torch

from magis_nb import zoo
from magis_nb.ir import Ref
from magis_nb.program import trace
from magis_nb.rules.swap import rd_region, swap_all
from magis_nb.runtime import OptimizedModule
from magis_nb.search.pricing import ranked
from magis_nb.search.proposals import enable_top, proposals
from magis_nb.search.space import Batch, Remat, Space, Swap, every_part
from magis_nb.simulate.cost import make_cost
from magis_nb.verify import Reference


@pytest.fixture(scope="module")
def split_gpt():
    """Tiny GPT (dropout on) with its whole training step split in 2 along the batch."""
    torch.manual_seed(0)
    case = zoo.build("gpt", "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    space = Space(prog, make_cost("rtx3090"), async_copies=True)
    root = space.evaluate((), (), prog.graph)
    (c, _), = enable_top(space, root)
    plan = ((c, 2),)
    g, _ = space.build(plan, ())
    return case, prog, space, plan, space.evaluate(plan, (), g)


def _inner(specs, kind):
    return [s for s in specs if "_p" in (s.op if kind == "remat" else s.producer)]


@pytest.mark.parametrize("kind", ["remat", "swap"])
def test_rewrites_inside_the_parts_are_allclose_at_the_simulated_peak(one_thread, split_gpt, kind):
    case, prog, space, plan, st = split_gpt
    r = ranked(space, st)
    assert not _inner(r.swaps, "swap") and not _inner(r.remats, "remat")
    specs = _inner(r.inner_remats if kind == "remat" else r.inner_swaps, kind)[:8]
    assert len(specs) == 8          # the parts' activations are proposed
    g, kept = space.build(plan, (Batch(kind, frozenset(specs)),))
    assert kept[0].specs == frozenset(specs)
    names = {n.name for n in g.nodes}
    for s in specs:                 # made in both parts
        op = s.op if kind == "remat" else s.producer
        suffix = "_re" if kind == "remat" else "_load"
        for k in (0, 1):
            assert op[:-1] + str(k) + suffix in names, op
    # a part's copies belong to that part
    for n in g.ops:
        if n.name.endswith(("_re", "_load", "_store")) and "_p" in n.name:
            assert n.region and n.region.part == int(n.name.split("_p")[-1].split("_")[0])
    child = space.evaluate(plan, kept, g)
    assert child.peak < st.peak
    mod = OptimizedModule(prog.model, prog.captured, g, child.order)
    chk = Reference(case.model, case.inputs, case.loss_fn, "train").check(mod)
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak == child.peak


def test_a_rewrite_never_crosses_a_part(split_gpt):
    _, _, space, plan, st = split_gpt
    g = st.graph
    ids = {n.name: n.id for n in g.nodes}
    rd = g.readers()
    # an op of part 0 whose output part 1 reads: none in a batch split, so make
    # the claim directly: a swap with a reader in the other part is refused
    a = next(n for n in g.ops if n.region and n.region.part == 0 and rd.get(Ref(n.id, 0))
             and g.nodes[n.id].outputs[0].alias is None
             and not n.name.startswith(("native_dropout", "empty")))
    other = next(n.id for n in g.ops if n.region and n.region.part == 1)
    assert rd_region(g, other) != rd_region(g, a.id)
    with pytest.raises(ValueError, match="its own part"):
        swap_all(g, [(Ref(a.id, 0), {other})])
    bad = Swap(a.name, 0, frozenset({g.nodes[other].name}))
    _, kept = space.apply(g, Batch("swap", frozenset({bad})))
    assert not kept.specs
    # a spec named in part 1 is renamed for part 0 too; one outside a region is itself
    users = frozenset(g.nodes[u].name for u in rd[Ref(a.id, 0)])
    one = Remat(a.name.replace("_p0", "_p1"), frozenset(u.replace("_p0", "_p1") for u in users))
    both = every_part(g, ids, one)
    assert [s.op for s in both] == [a.name, one.op]
    assert both[0].users == users
    outside = next(n for n in g.ops if not n.region)
    assert every_part(g, ids, Remat(outside.name, frozenset())) == [Remat(outside.name, frozenset())]


def test_rewrites_inside_the_parts_are_proposed_after_the_rest(split_gpt):
    """A short search spends its first states on what it proposed before rewrites
    inside the parts existed: those come last in a state's proposals."""
    _, _, space, _, st = split_gpt
    rules = [p[0] for p in proposals(space, st)]
    inner = [i for i, r in enumerate(rules) if "-in-parts" in r]
    assert inner and inner == list(range(len(rules) - len(inner), len(rules)))
    assert "swap-in-partsx8" in rules and "remat-in-parts" in rules


def test_unpack_comes_last_and_pack_first(split_gpt):
    """Packing a split region's masks is its biggest step and is proposed first;
    unpacking trades the memory back for time and is proposed after everything
    else, the rewrites inside the parts included."""
    _, _, space, plan, st = split_gpt
    (c, n), = plan
    twin = space.cands[c].twin
    assert twin is not None
    rules = [p[0] for p in proposals(space, st)]
    assert rules[0] == "pack" and "unpack" not in rules
    packed_plan = ((twin, n),)
    g, _ = space.build(packed_plan, ())
    packed = space.evaluate(packed_plan, (), g)
    props = proposals(space, packed)
    assert props[-1][0] == "unpack" and props[-1][1] == plan
    assert [p[0] for p in props].count("unpack") == 1 and "pack" not in [p[0] for p in props]


def test_within_a_latency_budget_the_biggest_swap_batch_goes_first(split_gpt):
    """Without a budget to keep within, batches go biggest first; within one, the
    biggest swap batch that fits goes before every remat batch (its copies hide
    behind compute), inside the parts as outside."""
    import re
    _, _, space, _, st = split_gpt

    def batches(props, tag):
        pat = re.compile(rf"(swap|remat){tag}x(\d+)")
        return [(m.group(1), int(m.group(2))) for p in props if (m := pat.fullmatch(p[0]))]

    for tag in ("", "-in-parts"):
        free = batches(proposals(space, st), tag)
        assert [k for _, k in free] == sorted((k for _, k in free), reverse=True)
    budget = proposals(space, st, lat_limit=st.latency * 1.5)
    inner = batches(budget, "-in-parts")
    swaps = [k for kind, k in inner if kind == "swap"]
    assert swaps and any(kind == "remat" and k > swaps[0] for kind, k in inner)
    assert inner[0] == ("swap", max(swaps))
