"""Note [readers of a stored tensor] in search/proposals.py: a swapped tensor
still read in its original after the peak is live through the peak; the
child that moves those readers to the loaded copy lowers it, and runs like
eager at its simulated peak."""
import torch

from magis_nb import zoo
from magis_nb.program import trace
from magis_nb.runtime import OptimizedModule
from magis_nb.search.pricing import ranked
from magis_nb.search.proposals import proposals, repoints
from magis_nb.search.space import Batch, Space, Swap
from magis_nb.simulate.cost import make_cost
from magis_nb.verify import Reference


def test_readers_after_the_peak_move_to_the_loaded_copy(one_thread):
    torch.manual_seed(0)
    case = zoo.build("unet", "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    space = Space(prog, make_cost("rtx3090"), async_copies=True)
    root = space.evaluate((), (), prog.graph)
    pos = {root.graph.nodes[v].name: i for i, v in enumerate(root.order)}
    # the biggest swap with two readers after the peak, its last one left
    # reading the original: as a swap proposed before a recompute moved there
    full = next(s for s in ranked(space, root).swaps if len(s.users) >= 2)
    last = max(full.users, key=pos.get)
    stale = Swap(full.producer, full.out, full.users - {last})
    g, kept = space.build((), (Batch("swap", frozenset({stale})),))
    st = space.evaluate((), kept, g)
    (batches,) = repoints(st)
    (spec,) = batches[-1].specs
    assert spec.users == full.users
    assert ("repoint", (), batches, set()) in proposals(space, st)
    g2, kept2 = space.build((), batches)
    child = space.evaluate((), kept2, g2)
    assert child.peak < st.peak
    graph, order = child.runs
    chk = Reference(case.model, case.inputs, case.loss_fn, "train").check(
        OptimizedModule(prog.model, prog.captured, graph, order))
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak == child.peak
    # nothing to move once every later reader reads the copy
    assert repoints(child) == []


def test_no_repoint_without_swaps():
    case = zoo.build("gpt", "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    space = Space(prog, make_cost("rtx3090"), async_copies=True)
    assert repoints(space.evaluate((), (), prog.graph)) == []
