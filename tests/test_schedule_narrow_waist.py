"""Narrow-waist values and the block partition on hand-made graphs."""
from magis_nb.schedule import extend_bound, get_reschedule_interval, graph_partition
from magis_nb.schedule import nw_values
from magis_nb.schedule.random_graphs import random_graph
from magis_nb.simulate.memory import MemGraph, Storage


def dag(preds):
    """One 1-byte output per op, read by the op's successors."""
    n = len(preds)
    users = [[v for v in range(n) if u in preds[v]] for u in range(n)]
    st = [Storage(1, u, tuple(users[u])) for u in range(n)]
    return MemGraph(n, [list(p) for p in preds], st, [f"v{i}" for i in range(n)])


def test_chain_all_zero():
    assert nw_values(dag([[], [0], [1], [2]])) == {0: 0, 1: 0, 2: 0, 3: 0}


def test_diamond():
    # a -> {b, c} -> d
    assert nw_values(dag([[], [0], [0], [1, 2]])) == {0: 0, 1: 1, 2: 1, 3: 0}


def test_parallel_chains():
    # a1 -> a2 -> j <- b2 <- b1: a1 is unrelated to b1, b2
    g = dag([[], [0], [], [2], [1, 3]])
    assert nw_values(g) == {0: 2, 1: 2, 2: 2, 3: 2, 4: 0}
    # on the induced subgraph {0, 1, 4} everything lines up
    assert nw_values(g, [0, 1, 4]) == {0: 0, 1: 0, 4: 0}


def test_two_components_partition():
    # chain 0->1->2 and a separate chain 3->4
    g = dag([[], [0], [1], [], [3]])
    parts = graph_partition(g, merge=1, light=-1)
    assert parts == [[0], [1], [2], [3], [4]]
    parts = graph_partition(g, hint=[3, 4, 0, 1, 2], merge=1, light=-1)
    assert parts[0] == [3]


def test_diamonds_cut_at_waists():
    # two diamonds in a row: 0 -> {1, 2} -> 3 -> {4, 5} -> 6
    g = dag([[], [0], [0], [1, 2], [3], [3], [4, 5]])
    parts = graph_partition(g, merge=1, light=-1)
    # nw <= 1 everywhere, each op is a cut; the parallel pair shares a block
    assert parts == [[0], [1, 2], [3], [4, 5], [6]]
    assert graph_partition(g, merge=4, light=-1) == [[0, 1, 2, 3], [4, 5, 6]]


def test_partition_is_a_valid_sequence():
    g = random_graph(3)
    parts = graph_partition(g)
    order = [v for p in parts for v in p]
    assert sorted(order) == list(range(g.n)) and g.is_topological(order)


def test_extend_bound():
    nw = [0, 9, 30, 25, 20, 12, 8, 3, 15]
    assert extend_bound(nw, 6, +1) == 7           # 8 falls to 3 (< 4): stop
    assert extend_bound(nw, 6, -1) == 5           # 8 -> 12 rises and 8 <= 10
    assert extend_bound(nw, 2, -1) == 0           # 30 -> 9 -> 0 falls to a waist
    assert extend_bound(nw, 4, +1, max_steps=2) == 6
    assert get_reschedule_interval(nw, [6, 2]) == (0, 7)


def test_a_batch_split_schedules_part_by_part_in_small_blocks():
    """GPT tiny split in 8 along the batch: each part reads the same weight
    views and dropout masks, and holds long-lived backward chains; with
    thresholds that grew with the graph, part 0 became one block of hundreds
    of ops (and the DP over it the search's main cost). The blocks stay about
    as small as the unsplit program's, and still form a valid sequence."""
    from magis_nb import zoo
    from magis_nb.analysis import DGraph, apply_fission, build_ftree
    from magis_nb.program import trace
    from magis_nb.schedule.full import default_order
    case = zoo.build("gpt", "tiny", device="meta")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    mg0, _, _ = prog.graph.memgraph()
    dg = DGraph(prog.graph)
    best = max(build_ftree(dg, prog.hotspots()), key=lambda c: c.score)
    mg, _, _ = apply_fission(dg, [best.ftrans(8)]).memgraph()
    parts = graph_partition(mg, hint=default_order(mg))
    order = [v for p in parts for v in p]
    assert sorted(order) == list(range(mg.n)) and mg.is_topological(order)
    unsplit = max(len(p) for p in graph_partition(mg0, hint=default_order(mg0)))
    assert max(len(p) for p in parts) <= 2 * unsplit
