"""Peaks of a MemGraph order computed from scratch, for the schedule tests.

A schedule's ``peak`` is set by the scheduler itself with the package's simulator
(`simulate_memory`, difference arrays over storage intervals): comparing the two
would hold the scheduler against its own number. These helpers recompute the
same quantity the plain way, step by step and storage by storage, from the
definition (DESIGN.md §Memory: live from the producer to the last reader, outputs
and weights stay live): while op ``order[i]`` runs, a storage is live if it is
resident (no producer), or its producer ran at or before step i and it is kept
or its producer or a reader runs at or after step i.
"""
from __future__ import annotations


def is_order(g, order) -> bool:
    """Every op once, each after all of its predecessors."""
    if sorted(order) != list(range(g.n)):
        return False
    done: set[int] = set()
    for v in order:
        if any(p not in done for p in g.preds[v]):
            return False
        done.add(v)
    return True


def naive_live(g, order) -> list[int]:
    """Bytes live while each op of ``order`` runs: each storage's steps from the
    definition, then a running sum over where they start and end."""
    assert is_order(g, order)
    if not order:                  # nothing runs: every storage counts once
        return [sum(s.size for s in g.storages)]
    pos = {v: k for k, v in enumerate(order)}
    last = len(order) - 1
    delta = [0] * (len(order) + 1)
    for s in g.storages:
        if s.producer < 0:
            start, end = 0, last
        else:
            start = pos[s.producer]
            end = last if s.keep else max([start] + [pos[u] for u in s.users])
        delta[start] += s.size
        delta[end + 1] -= s.size
    live, acc = [], 0
    for d in delta[:-1]:
        acc += d
        live.append(acc)
    return live


def naive_peak(g, order) -> int:
    """The most bytes live at any step of ``order`` (`naive_live`)."""
    return max(naive_live(g, order))


def topological_orders(g):
    """Every topological order of ``g`` (exponentially many: small graphs only)."""
    done: list[int] = []
    placed = [False] * g.n

    def rec():
        if len(done) == g.n:
            yield list(done)
            return
        for v in range(g.n):
            if not placed[v] and all(placed[p] for p in g.preds[v]):
                placed[v] = True
                done.append(v)
                yield from rec()
                done.pop()
                placed[v] = False
    yield from rec()


def optimal_peak(g) -> int:
    """The lowest `naive_peak` over all topological orders (brute force)."""
    return min(naive_peak(g, o) for o in topological_orders(g))


def op_bound(g) -> int:
    """A peak no order goes below: the resident bytes plus, for the op that needs
    the most, every storage it reads or allocates (all live while it runs)."""
    resident = sum(s.size for s in g.storages if s.producer < 0)
    most = 0
    for v in range(g.n):
        mine = {k for k, s in enumerate(g.storages)
                if s.producer >= 0 and (s.producer == v or v in s.users)}
        most = max(most, sum(g.storages[k].size for k in mine))
    return resident + most
