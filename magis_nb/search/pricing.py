"""Which swaps and remats a state proposes, and what each costs (the seed's
heuristic H2): only tensors live at the peak, the cheapest per byte saved first.
"""
from __future__ import annotations

from typing import NamedTuple

from ..ir.graph import Ref
from ..ir.passes import written_in_place
from ..rules.remat import can_rematerialize, chain_to_live, swapped_copies
from ..rules.swap import rd_region
from .space import Remat, Space, State, Swap
from .transfers import is_load, is_store


# The share of a step's time its copy stream can be busy with swaps before they
# show: each copy runs in its own tensor's window (a Store after its producer and
# before the peak, a Load after the peak and before its reader), and in a
# training step those windows are the forward's end and the backward's start.
# Paper BTLM split in 16 (x1.085): every one of its swaps in the parts hides
# alone; with the whole idle stream as the bound the batch that fit was 202
# (x1.387), and 128 went to x1.170. At a half it is 60, all hidden (x1.085).
COPY_SHARE = 0.5


class Ranked(NamedTuple):
    """A state's swap and remat candidates, cheapest per byte first: on ops
    outside every split region, and on a split region's part ops (made in every
    part, Note [rewrites inside the parts] in `search.space`)."""
    swaps: list[Swap]
    remats: list[Remat]
    inner_swaps: list[Swap]
    inner_remats: list[Remat]
    # each candidate's price: the step time it is expected to add (seconds), for
    # every part it is made in; a batch's is the sum, and for swaps at least the
    # copy stream's overflow (`batch_price`; `proposals` keeps a latency budget's
    # batches within what the state has left)
    price: dict
    copy: dict         # swap -> seconds its Store and Load take on the copy stream
    copy_idle: float   # seconds of copies the state's step could still hide (COPY_SHARE)


def batch_price(r: Ranked, specs) -> float:
    """The least step time a batch of ``specs`` (ranked swaps or remats) adds.
    Swaps priced one at a time hide behind the compute around them, but their
    copies share one copy stream: a swap batch adds at least what its copies
    take beyond the stream's idle time (paper BTLM split in 16: each of the
    parts' swaps alone hides, 128 of them went x1.085 -> x1.170)."""
    own = sum(r.price[s] for s in specs)
    copies = sum(r.copy.get(s, 0.0) for s in specs)
    return max(own, copies - r.copy_idle)


def ranked(space: Space, st: State) -> Ranked:
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
    # Kept apart so that a state's proposals outside the parts are what they
    # were before rewrites inside the parts existed: a short search spends its
    # few states on those first (`proposals`).
    outer, inside = [], []
    for size, r in st.hot:
        (inside if rd_region(g, r.node) else outer).append((size, r))
    written = written_in_place(g)
    # a recompute reads a swapped tensor's loaded copy (Note [recomputed from a
    # loaded copy] in `rules.remat`): as good a start as a tensor kept live
    loaded = set(swapped_copies(g))
    out: list = []
    price: dict = {}
    copy: dict = {}
    busy = sum(costs.transfer_cost(g.tensor(g.nodes[v].args[1]).nbytes) if is_store(g, v) else
               costs.transfer_cost(g.tensor(Ref(v, 0)).nbytes) for v in st.order
               if is_store(g, v) or is_load(g, v)) if space.async_copies else 0.0
    # outside rewrites may start from outside tensors only; inside ones from any
    for hot, bases in ((outer, {r for _, r in outer}), (inside, {r for _, r in st.hot})):
        swaps, remats = [], []
        per_op: dict[int, tuple] = {}  # op -> (hot bytes, later users, read before the peak)
        for size, r in hot:
            part = rd_region(g, r.node)
            readers = rd.get(r, set())
            if any(is_store(g, u) for u in readers):
                continue  # swapped already; its users read the loaded copy
            users = {u for u in readers if pos[u] > st.peak_step}
            if not users:
                continue
            if part and any(rd_region(g, u) != part for u in users):
                continue  # a rewrite in a split region stays in its part
            # ... and is made in every part (Note [rewrites inside the parts]): n times the price
            times = g.nodes[r.node].region.parts if part else 1
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
            sw = Swap(src, r.out, names)
            price[sw] = times * exposed
            if space.async_copies:
                copy[sw] = times * xfer
            swaps.append((times * exposed / size, -size, len(swaps), sw))
            # Several hot outputs of one op (max pool's values and indices) make
            # one remat, for all their later users.
            size0, users0, before0, _ = per_op.get(r.node, (0, frozenset(), False, 1))
            per_op[r.node] = (size0 + size, users0 | names, before0 or bool(before), times)
        for a, (size, names, before, times) in per_op.items():
            # Recomputing an op whose outputs nobody reads before the peak only
            # moves it (the scheduler's job), and leaves a dead original behind.
            if before and can_rematerialize(g, a) is None:
                chain = chain_to_live(g, a, bases | loaded)
                if chain is not None:
                    cost = times * sum(costs.recompute(g, v) for v in chain + [a])
                    rm = Remat(g.nodes[a].name, names, tuple(g.nodes[v].name for v in chain))
                    price[rm] = cost
                    remats.append((cost / size, -size, len(remats), rm))
        out.append([t[-1] for t in sorted(swaps)] if space.swap else [])
        out.append(compatible(g, [t[-1] for t in sorted(remats)]))
    return Ranked(*out, price, copy, COPY_SHARE * st.latency - busy)


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
                 for r in g.nodes[v].refs()} - inside
        if ids[s.op] in reads or needs & targets:
            continue
        out.append(s)
        targets.add(ids[s.op])
        reads |= needs
    return out
