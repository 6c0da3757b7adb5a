"""Which swaps and remats a state proposes, and what each costs (the seed's
heuristic H2): only tensors live at the peak, the cheapest per byte saved first.
"""
from __future__ import annotations

from ..ir.graph import iter_refs
from ..rules.remat import can_rematerialize, chain_to_live, written_in_place
from .space import Remat, Space, State, Swap
from .transfers import is_load, is_store


def ranked(space: Space, st: State) -> tuple[list[Swap], list[Remat]]:
    """Swap and remat candidates among the peak's tensors, cheapest per byte first.

    A swap costs the part of its Store + Load that the compute between the
    tensor's last use before the peak and its first use after it cannot hide
    (all of it where copies are synchronous). A remat costs its recomputed op
    (`_CostTable.recompute`: a training BatchNorm's is the normalize alone), and
    is only proposed when the op's inputs are live at the peak anyway (resident,
    or hot themselves), or can be recomputed from such through a short chain of
    ops, whose cost it adds: keeping a dead input alive for the recompute would
    eat the gain. Several hot outputs of one op make one remat. With ``space.swap`` off no swap is proposed.
    """
    g = st.graph
    pos = {v: i for i, v in enumerate(st.order)}
    rd = g.readers()
    costs = space.costs
    prefix = [0.0]
    for v in st.order:
        prefix.append(prefix[-1] + costs.of(g, v))
    hot_bases = {r for _, r in st.hot}
    written = written_in_place(g)
    swaps, remats = [], []
    per_op: dict[int, tuple] = {}  # op -> (hot bytes, later users, read before the peak)
    for size, r in st.hot:
        readers = rd.get(r, set())
        if any(is_store(g, u) for u in readers):
            continue  # swapped already; its users read the loaded copy
        users = {u for u in readers if pos[u] > st.peak_step}
        if not users:
            continue
        before = readers - users
        last_before = max([pos[u] for u in before] + [pos[r.node]])
        first_after = min(pos[u] for u in users)
        names = frozenset(g.nodes[u].name for u in users)
        src = g.nodes[r.node].name
        if r in written or is_load(g, r.node):
            continue  # a loaded copy is not swapped again: its Load is moved instead
        xfer = 2 * costs.transfer_cost(size)
        gap = prefix[first_after] - prefix[last_before + 1]
        exposed = max(0.0, xfer - gap) if space.async_copies else xfer
        swaps.append((exposed / size, -size, len(swaps), Swap(src, r.out, names)))
        # Several hot outputs of one op (max pool's values and indices) make
        # one remat, for all their later users.
        size0, users0, before0 = per_op.get(r.node, (0, frozenset(), False))
        per_op[r.node] = (size0 + size, users0 | names, before0 or bool(before))
    for a, (size, names, before) in per_op.items():
        # Recomputing an op whose outputs nobody reads before the peak only
        # moves it (the scheduler's job), and leaves a dead original behind.
        if before and can_rematerialize(g, a) is None:
            chain = chain_to_live(g, a, hot_bases)
            if chain is not None:
                cost = sum(costs.recompute(g, v) for v in chain + [a])
                remats.append((cost / size, -size, len(remats),
                               Remat(g.nodes[a].name, names, tuple(g.nodes[v].name for v in chain))))
    remats = compatible(g, [t[-1] for t in sorted(remats)])
    return ([t[-1] for t in sorted(swaps)] if space.swap else []), remats


def compatible(g, remats: list[Remat]) -> list[Remat]:
    """``remats`` in rank order, less those that would undo an earlier one: a
    recompute reads the original of every tensor outside its chain, so it keeps
    alive a tensor that an earlier remat frees (a conv output, when BatchNorm
    and ReLU are recomputed from it), or frees one an earlier recompute reads.
    Every prefix of the result can go in one batch."""
    ids = {n.name: n.id for n in g.nodes}
    out, targets, reads = [], set(), set()
    for s in remats:
        ops = [ids[c] for c in s.chain] + [ids[s.op]]
        inside = set(ops)
        needs = {g.storage_of(r).node for v in ops
                 for r in iter_refs((g.nodes[v].args, g.nodes[v].kwargs))} - inside
        if ids[s.op] in reads or needs & targets:
            continue
        out.append(s)
        targets.add(ids[s.op])
        reads |= needs
    return out
