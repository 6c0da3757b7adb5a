"""An order-independent lower bound on the peak, to judge how far a schedule is
from optimal without enumerating orders.

When op v runs, a storage is live in *every* topological order if its producer is
v or an ancestor of v (or it is resident) and it is kept or some reader is v or a
descendant of v. The bound is the max over v of those bytes. In a training graph
it is at least the activations saved for the backward, all live at the loss: no
re-ordering goes below it, only remat/swap/fission do.
"""
from __future__ import annotations

from magis_nb.simulate.memory import MemGraph

from .narrow_waist import anc_des, topo_order


def order_lower_bound(g: MemGraph) -> int:
    if g.n == 0:
        return sum(s.size for s in g.storages)
    topo = topo_order(g, list(range(g.n)), None, None)
    pos = {v: i for i, v in enumerate(topo)}
    anc, des = anc_des(g, topo)
    full = (1 << g.n) - 1
    per = [0] * g.n
    for s in g.storages:
        if s.size == 0:
            continue
        if s.producer < 0:
            live = full
        else:
            i = pos[s.producer]
            live = des[i] | (1 << i)          # positions at or after the producer
            if not s.keep:
                before = 0                    # positions at or before a reader
                for u in s.users:
                    j = pos[u]
                    before |= anc[j] | (1 << j)
                live &= before | (1 << i)
        while live:
            low = live & -live
            per[low.bit_length() - 1] += s.size
            live ^= low
    return max(per)
