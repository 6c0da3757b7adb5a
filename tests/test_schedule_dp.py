"""Exact peaks of the DP scheduler on small graphs of 1 MiB-sized storages."""
from magis_nb.schedule import BlockCache, schedule, solve_block
from magis_nb.schedule.context import block_problems
from magis_nb.schedule.random_graphs import transformer_like
from magis_nb.simulate.memory import MemGraph, Storage, simulate_memory

from schedule_oracle import naive_live, naive_peak, op_bound, optimal_peak, topological_orders

MiB = 1 << 20


def graph(ops, storages, names=None):
    """ops: preds per op; storages: (size MiB, producer, users, keep)."""
    st = [Storage(sz * MiB, p, tuple(u), k) for sz, p, u, k in storages]
    return MemGraph(len(ops), [list(p) for p in ops], st,
                    names or [f"op{i}" for i in range(len(ops))])


def two_branches(after=False):
    """x -> a; branch R: r(2) -> t(2); branch P: p(5) -> q(1); out = join(t, q).

    The program emits R first (op order); running P first is better because P's
    big temporary then meets only a small tensor. ``after`` adds an op z after
    the join that reads a (a stays live through the branches).
    """
    ops = [[], [0], [1], [0], [3], [2, 4]]
    st = [(1, -1, [0], False),             # x, resident
          (1, 0, [1, 3] + ([6] if after else []), False),   # a
          (2, 1, [2], False),              # r
          (2, 2, [5], False),              # t
          (5, 3, [4], False),              # p
          (1, 4, [5], False),              # q
          (1, 5, [6] if after else [], True)]   # out (kept)
    if after:
        ops.append([0, 5])
        st.append((1, 6, [], True))        # z
    return graph(ops, st)


def brute_force(g):
    """The optimal peak over all topological orders, each peak from scratch."""
    return optimal_peak(g)


def test_program_order_peak_exact():
    g = two_branches()
    # steps: a 2, r 4, t 6, p 1+1+2+5=9, q 1+2+5+1=9, out 1+2+1+1=5
    assert simulate_memory(g, range(6)).live == [m * MiB for m in (2, 4, 6, 9, 9, 5)]
    assert schedule(g, method="program").peak == 9 * MiB


def test_dp_beats_program_order():
    g = two_branches()
    s = schedule(g)
    assert s.peak == 8 * MiB == brute_force(g)
    assert s.order == [0, 3, 4, 1, 2, 5]      # P branch first
    assert s.peak == naive_peak(g, s.order) and s.reference_peak == 9 * MiB


def test_block_in_context():
    """Schedule ops 1..5 as a block after fixed op 0 and before fixed op 6 (which
    keeps a live through the block); the block peak is simulate_memory's."""
    g = two_branches(after=True)
    unit = [0, 1, 1, 1, 1, 1, 2]
    probs = block_problems(g, unit, {1: [1, 2, 3, 4, 5]}, 3)
    p = probs[1]
    assert p.base == 2 * MiB                  # x and a are live at block start
    r = solve_block(p, hint=[0, 1, 2, 3, 4])  # program order inside the block
    assert r.exact and r.peak == 8 * MiB
    assert p.peak_of([0, 1, 2, 3, 4])[0] == 10 * MiB   # R first: 1+1+2+5+1
    full = [0] + [p.ops[i] for i in r.order] + [6]
    tl = simulate_memory(g, full)
    assert max(tl.live[1:6]) == r.peak and tl.peak == 8 * MiB == brute_force(g)
    assert _block_peak(g, p, r.order) == r.peak


def _block_peak(g, p, local):
    """The peak over a block's own steps of ``two_branches(after=True)`` with the
    block (ops 1..5) run in ``local`` order between ops 0 and 6, from scratch."""
    return max(naive_live(g, [0] + [p.ops[i] for i in local] + [6])[1:6])


def test_block_cache_ignores_base():
    """A cached block solved at one base serves another: same order, the peak
    moved by the difference; the schedule is the uncached one."""
    g = two_branches(after=True)
    p = block_problems(g, [0, 1, 1, 1, 1, 1, 2], {1: [1, 2, 3, 4, 5]}, 3)[1]
    cache = BlockCache()
    first = cache.solve(p, [0, 1, 2, 3, 4], 1000)
    p.base += 7 * MiB
    again = cache.solve(p, [0, 1, 2, 3, 4], 1000)
    fresh = solve_block(p, [0, 1, 2, 3, 4], budget=1000)
    assert len(cache.table) == 1
    assert again.order == first.order == fresh.order
    assert again.peak == first.peak + 7 * MiB == fresh.peak
    big = transformer_like(20)
    assert schedule(big, cache=cache).order == schedule(big).order


def test_chain_and_unused_output():
    # a(1) -> b(3) -> c(1); b also produces an unused 2 MiB output (live only
    # during b); resident weight 1 MiB.
    g = graph([[], [0], [1]], [(1, -1, [0, 1, 2], False), (1, 0, [1], False),
                               (3, 1, [2], False), (2, 1, [], False),
                               (1, 2, [], True)])
    s = schedule(g)
    assert s.order == [0, 1, 2] and s.peak == (1 + 1 + 3 + 2) * MiB


def test_big_chain_of_blocks_is_fast_and_exact():
    g = transformer_like(80)                  # ~3700 ops, BERT-like joint graph
    assert g.n > 3000
    s = schedule(g)
    # the peak recomputed from scratch; the program order's too (the scheduler's
    # reference_peak is its own number): no brute force at this size, so bounds
    assert s.peak == naive_peak(g, s.order) and s.exact   # timed in the bench, not here
    assert op_bound(g) <= s.peak <= naive_peak(g, list(range(g.n)))


def test_lower_bound():
    from magis_nb.schedule.bounds import order_lower_bound
    g = two_branches()
    # at q: x, p, q are certain; at t: x, r, t; a is certain only at a, r, p
    assert order_lower_bound(g) <= schedule(g).peak == 8 * MiB
    assert order_lower_bound(g) == 7 * MiB   # p's step: x + a + p


def test_a_huge_block_keeps_the_better_of_hint_and_greedy(monkeypatch):
    """A block over MAX_DP_OPS skips the DP (each of its states is a bitmask of
    the whole block: paper GPT-Neo's 55,651-op block took 279 s): the result is
    the better of the hint and the greedy order, marked inexact, and its peak is
    the block's own for that order."""
    from magis_nb.schedule import dp
    g = two_branches(after=True)
    p = block_problems(g, [0, 1, 1, 1, 1, 1, 2], {1: [1, 2, 3, 4, 5]}, 3)[1]
    hint = [0, 1, 2, 3, 4]
    monkeypatch.setattr(dp, "MAX_DP_OPS", 4)
    r = solve_block(p, hint)
    greedy = dp.greedy_order(p)
    assert not r.exact and r.states == 1
    assert r.peak == min(p.peak_of(hint)[0], p.peak_of(greedy)[0]) == p.peak_of(r.order)[0]
    assert r.peak == min(_block_peak(g, p, hint), _block_peak(g, p, greedy)) \
        == _block_peak(g, p, r.order)
    monkeypatch.setattr(dp, "MAX_DP_OPS", 5)
    assert solve_block(p, hint).exact


def test_a_dp_over_its_work_keeps_the_better_of_hint_and_greedy(monkeypatch):
    """The DP gives up after DP_WORK / ops expansions (the width caps the states
    of a level, not the ready ops each one expands: a block with swaps in every
    part of a split expanded hundreds per state): the better of the hint and the
    greedy order, marked inexact; with the work it needs, the exact result."""
    from magis_nb.schedule import dp
    g = two_branches(after=True)
    p = block_problems(g, [0, 1, 1, 1, 1, 1, 2], {1: [1, 2, 3, 4, 5]}, 3)[1]
    hint = [0, 1, 2, 3, 4]
    whole = solve_block(p, hint)
    assert whole.exact
    monkeypatch.setattr(dp, "DP_WORK", 3 * p.m)       # 3 expansions
    r = solve_block(p, hint)
    greedy = dp.greedy_order(p)
    assert not r.exact
    assert r.peak == min(p.peak_of(hint)[0], p.peak_of(greedy)[0]) == p.peak_of(r.order)[0]
    assert r.peak == min(_block_peak(g, p, hint), _block_peak(g, p, greedy)) \
        == _block_peak(g, p, r.order)
    # the exact result is the best block order of all (brute force, 5 ops)
    assert whole.peak == _block_peak(g, p, whole.order) == min(
        max(live[1:6]) for o in topological_orders(g) if o[0] == 0 and o[-1] == 6
        for live in [naive_live(g, o)])


def test_greedy_order_is_the_width_one_search():
    """`greedy_order` counts readers down instead of testing bitmasks: the same
    order as the search at width 1 (`beam_order`; ties to the lowest op), on random training
    graphs of every kind in the generator and a transformer-like one."""
    from magis_nb.schedule import dp
    from magis_nb.schedule.random_graphs import random_graph

    graphs = [random_graph(seed) for seed in range(12)] + [transformer_like(6)]
    for g in graphs:
        p = block_problems(g, [0] * g.n, {0: list(range(g.n))}, 1)[0]
        fast = dp.greedy_order(p)
        assert fast == dp.beam_order(p, width=1)
        assert sorted(fast) == list(range(g.n))
