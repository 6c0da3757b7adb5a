"""Graph rewrites that the search applies, on plain MemGraphs (for tests/benches).

Each returns a new graph; old ops keep their names, new ops get fresh unique names,
so schedules relate through ``MemGraph.names``. ``touched`` is the set of *old* op
names around which the old order must be rescheduled (see incremental.py); new
ops are always placed by the rescheduler.
"""
from __future__ import annotations

import random

from magis_nb.simulate.memory import MemGraph, Storage


def _fresh(names: list[str], base: str) -> str:
    taken = set(names)
    k, name = 0, base
    while name in taken:
        k += 1
        name = f"{base}.{k}"
    return name


class _Edit:
    """Mutable copy of a MemGraph: ops may be appended or dropped."""

    def __init__(self, g: MemGraph):
        self.names = list(g.names)
        self.preds = [list(p) for p in g.preds]
        self.st = [dict(size=s.size, producer=s.producer, users=list(s.users),
                        keep=s.keep, category=s.category) for s in g.storages]
        self.dead: set[int] = set()

    def add_op(self, base: str, preds: list[int]) -> int:
        self.names.append(_fresh(self.names, base))
        self.preds.append(list(dict.fromkeys(preds)))
        return len(self.names) - 1

    def add_storage(self, size, producer, users, keep=False, category="activation"):
        self.st.append(dict(size=size, producer=producer, users=list(users),
                            keep=keep, category=category))
        return len(self.st) - 1

    def redirect(self, s: int, user: int, new_s: int) -> None:
        """``user`` reads ``new_s`` instead of ``s``; fix its preds."""
        self.st[s]["users"].remove(user)
        old_p, new_p = self.st[s]["producer"], self.st[new_s]["producer"]
        self.st[new_s]["users"].append(user)
        still = any(user in t["users"] and t["producer"] == old_p for t in self.st)
        ps = self.preds[user]
        if old_p >= 0 and not still and old_p in ps:
            ps.remove(old_p)
        if new_p >= 0 and new_p not in ps:
            ps.append(new_p)

    def build(self) -> MemGraph:
        keep = [v for v in range(len(self.names)) if v not in self.dead]
        idx = {v: i for i, v in enumerate(keep)}
        st = []
        for s in self.st:
            if s["producer"] in self.dead:
                continue
            st.append(Storage(s["size"], idx.get(s["producer"], -1),
                              tuple(idx[u] for u in s["users"] if u in idx),
                              s["keep"], s["category"]))
        return MemGraph(len(keep), [[idx[p] for p in self.preds[v] if p in idx]
                                    for v in keep], st, [self.names[v] for v in keep])


def remat(g: MemGraph, s: int, user: int) -> tuple[MemGraph, set[str]]:
    """``user`` reads a recomputed copy of storage ``s`` (made by a copy of its
    producer, which re-reads the producer's inputs)."""
    e = _Edit(g)
    a = g.storages[s].producer
    a2 = e.add_op(g.names[a] + ".rc", g.preds[a])
    for t in g.inputs_of[a]:
        e.st[t]["users"].append(a2)
    s2 = e.add_storage(g.storages[s].size, a2, [], category=g.storages[s].category)
    e.redirect(s, user, s2)
    return e.build(), {g.names[a], g.names[user]}


def swap(g: MemGraph, s: int, user: int) -> tuple[MemGraph, set[str]]:
    """Store ``s`` to the host after its producer, Load it back for ``user``."""
    e = _Edit(g)
    a = g.storages[s].producer
    st = e.add_op(g.names[a] + ".store", [a])
    e.st[s]["users"].append(st)
    host = e.add_storage(0, st, [], category="host")
    ld = e.add_op(g.names[a] + ".load", [st])
    e.st[host]["users"].append(ld)
    s2 = e.add_storage(g.storages[s].size, ld, [], category=g.storages[s].category)
    e.redirect(s, user, s2)
    return e.build(), {g.names[a], g.names[user]}


def fission(g: MemGraph, v: int) -> tuple[MemGraph, set[str]]:
    """Split op ``v`` (one output) into two half-size ops and a concat."""
    (s,) = g.outputs_of[v]
    e = _Edit(g)
    size = g.storages[s].size
    halves = []
    for k, part in enumerate((size // 2, size - size // 2)):
        h = e.add_op(f"{g.names[v]}.f{k}", g.preds[v])
        for t in g.inputs_of[v]:
            e.st[t]["users"].append(h)
        halves.append(e.add_storage(part, h, [], category=g.storages[s].category))
    c = e.add_op(g.names[v] + ".cat", [e.st[h]["producer"] for h in halves])
    for h in halves:
        e.st[h]["users"].append(c)
    # The concat's output takes over s: same readers, same keep flag.
    e.st[s]["producer"] = c
    for w in g.succs[v]:
        e.preds[w] = [c if p == v else p for p in e.preds[w]]
    for t in g.inputs_of[v]:
        e.st[t]["users"].remove(v)
    e.dead.add(v)
    return e.build(), {g.names[v]}


def random_mutation(g: MemGraph, rng: random.Random) -> tuple[MemGraph, set[str]]:
    """One random remat, swap or fission of ``g``: (new graph, touched old names).

    Remat/swap pick a non-resident storage read by an op that runs far from its
    producer in index order (a saved activation); fission picks a one-output op
    with non-resident readers.
    """
    kind = rng.choice(["remat", "swap", "fission"])
    if kind in ("remat", "swap"):
        cands = [(i, u) for i, s in enumerate(g.storages) if s.producer >= 0
                 and s.size > 0 for u in s.users if u - s.producer > 8]
        if cands:
            s, u = rng.choice(cands)
            if kind == "remat" and g.inputs_of[g.storages[s].producer]:
                return remat(g, s, u)
            return swap(g, s, u)
    cands = [v for v in range(g.n) if len(g.outputs_of[v]) == 1
             and g.storages[g.outputs_of[v][0]].size >= 2 and g.succs[v]]
    return fission(g, rng.choice(cands))


__all__ = ["remat", "swap", "fission", "random_mutation"]
