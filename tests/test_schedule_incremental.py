"""Incremental rescheduling (Algorithm 2) and properties of every produced order."""
import random

from hypothesis import given, settings, strategies as st

from magis_nb.schedule import Scheduler, reschedule, schedule, solve_block
from magis_nb.schedule.full import default_order
from magis_nb.schedule.context import block_problems
from magis_nb.schedule.mutations import fission, remat, swap
from magis_nb.schedule.random_graphs import random_mutation, random_nasnet, random_randwire
from magis_nb.simulate.memory import MemGraph, Storage, simulate_memory

from schedule_oracle import is_order, naive_peak, op_bound, optimal_peak, topological_orders

MiB = 1 << 20


def small_train_graph(seed):
    if seed % 2:
        return random_randwire(seed, stages=1, nodes=5, base=2 * MiB)
    return random_nasnet(seed, cells=2, blocks=2, base=2 * MiB)


def check(g, s):
    """A valid order whose peak is the one recomputed from scratch (the
    scheduler sets ``peak`` with the package's simulator), and above what every
    order needs (no scheduler claims an optimum here: the graphs are too big
    for a brute force, the bound is what can be held)."""
    assert is_order(g, s.order)
    assert s.peak == naive_peak(g, s.order)
    assert s.peak >= op_bound(g)


@st.composite
def dags(draw, max_ops=9):
    n = draw(st.integers(1, max_ops))
    preds = [sorted(draw(st.sets(st.integers(0, v - 1), max_size=3))) if v else []
             for v in range(n)]
    storages = [Storage(draw(st.integers(0, 4)) * MiB, -1,
                        tuple(draw(st.sets(st.integers(0, n - 1), max_size=2))))]
    for v in range(n):
        users = tuple(sorted(u for u in range(v + 1, n) if v in preds[u]))
        storages.append(Storage(draw(st.integers(0, 4)) * MiB, v, users,
                                draw(st.booleans())))
    perm = draw(st.permutations(range(n)))    # op indices in random order
    inv = {old: new for new, old in enumerate(perm)}
    return MemGraph(n, [[inv[p] for p in preds[old]] for old in perm],
                    [Storage(s.size, inv.get(s.producer, -1),
                             tuple(inv[u] for u in s.users), s.keep) for s in storages],
                    [f"v{old}" for old in perm])


@settings(max_examples=60, deadline=None)
@given(dags(max_ops=8))
def test_full_schedule_valid_and_exact(g):
    """The uncapped DP over one block for the whole graph claims the optimum:
    it is the brute force's over every topological order (at most 8! of them),
    each peak from scratch. `schedule` claims no optimum (it cuts the graph at
    narrow waists): it lies between the optimum and the program order's peak."""
    s = schedule(g)
    check(g, s)
    best = optimal_peak(g)
    assert best <= s.peak <= naive_peak(g, default_order(g))
    p = block_problems(g, [0] * g.n, {0: list(range(g.n))}, 1)[0]
    r = solve_block(p)
    assert r.exact and r.peak == naive_peak(g, [p.ops[i] for i in r.order]) == best


def test_brute_force_sees_every_order():
    """`topological_orders` enumerates them all (the optimum above is over all):
    3 independent ops have 3! orders, a chain one, a diamond two."""
    free = MemGraph(3, [[], [], []], [])
    chain = MemGraph(3, [[], [0], [1]], [])
    diamond = MemGraph(4, [[], [0], [0], [1, 2]], [])
    assert len(list(topological_orders(free))) == 6
    assert list(topological_orders(chain)) == [[0, 1, 2]]
    assert sorted(topological_orders(diamond)) == [[0, 1, 2, 3], [0, 2, 1, 3]]


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 10_000))
def test_incremental_valid(seed, mseed):
    g = small_train_graph(seed)
    old = schedule(g)
    rng = random.Random(mseed)
    ng, touched = random_mutation(g, rng)
    inc = reschedule(ng, old.names, touched)
    check(ng, inc)
    check(ng, schedule(ng))
    # and a second mutation on top of the first
    ng2, touched2 = random_mutation(ng, rng)
    check(ng2, reschedule(ng2, inc.names, touched2))


def test_names_relate_graphs():
    g = small_train_graph(0)
    s = schedule(g)
    v = next(i for i in range(g.n) if len(g.outputs_of[i]) == 1 and g.succs[i])
    ng, touched = fission(g, v)
    assert touched == {g.names[v]} and g.names[v] not in ng.names
    assert {g.names[v] + suffix for suffix in (".f0", ".f1", ".cat")} <= set(ng.names)
    inc = reschedule(ng, s.names, touched)
    check(ng, inc)


def _far_saved(g, s, need_inputs=False):
    """A hotspot storage whose only reader after the loss is one backward op."""
    loss = g.names.index("loss")
    hot = simulate_memory(g, s.order).hotspots
    cands = []
    for i in hot:
        t = g.storages[i]
        late = [u for u in t.users if u > loss]
        if t.producer >= 0 and len(late) == 1 and (g.inputs_of[t.producer]
                                                    or not need_inputs):
            cands.append((t.size, i, late[0]))
    _, sid, user = max(cands)
    return sid, user


def test_swap_places_store_early_and_load_late():
    g = random_nasnet(4, cells=3, blocks=3, base=2 * MiB)
    s = schedule(g)
    sid, user = _far_saved(g, s)
    ng, touched = swap(g, sid, user)
    inc = reschedule(ng, s.names, touched)
    check(ng, inc)
    pos = {ng.names[v]: i for i, v in enumerate(inc.order)}
    a, b = g.names[g.storages[sid].producer], g.names[user]
    assert pos[a] < pos[a + ".store"] <= pos[a] + 25
    assert pos[b] - 25 <= pos[a + ".load"] < pos[b]
    # the swapped tensor is no longer live across the forward/backward boundary
    assert inc.peak < s.peak


def test_remat_copy_runs_near_its_reader():
    g = random_nasnet(6, cells=3, blocks=3, base=2 * MiB)
    s = schedule(g)
    sid, user = _far_saved(g, s, need_inputs=True)
    ng, touched = remat(g, sid, user)
    sch = Scheduler(g)
    inc = sch.mutate(ng, touched)
    check(ng, inc)
    pos = {ng.names[v]: i for i, v in enumerate(inc.order)}
    a, b = g.names[g.storages[sid].producer], g.names[user]
    assert pos[a + ".rc"] > pos["loss"] and pos[a + ".rc"] < pos[b]
    assert sch.current is inc and sch.graph is ng


@settings(max_examples=80, deadline=None)
@given(dags(max_ops=24), st.integers(-1, 2), st.integers(1, 6))
def test_partition_valid(g, light, merge):
    from magis_nb.schedule import graph_partition
    order = [v for b in graph_partition(g, light=light, merge=merge) for v in b]
    assert sorted(order) == list(range(g.n)) and g.is_topological(order)
