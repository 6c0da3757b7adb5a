"""Swaps in a schedule: where Store and Load go, and what they cost.

A swap is two graph ops (see `rules.swap`): the Store (``copy_`` of the tensor
into its host buffer) and the Load (``_to_copy`` back). On a GPU they run on a
copy stream: the Store starts when the producer is done, and the tensor's memory
can only be released once it is on the host; the Load must finish before the
first op that reads the loaded copy. So the Store's place in the order is the
point where compute waits for it to finish (its memory is freed there), and the
Load's place is where it is issued (its memory is taken there). The memory-aware
scheduler puts a Store as early and a Load as late as memory allows, which
exposes every transfer; `place_transfers` then moves each Store later and each
Load earlier just far enough that the compute ops in between cover the transfer
time (the seed's "Store as early, Load as late as still hides the transfer").

Where copies are synchronous (a CPU "device" copying into host RAM), they are
ordinary ops that cost their copy time on the one stream; nothing moves.
"""
from __future__ import annotations

import bisect
from typing import Callable, Sequence

from ..ir.graph import Graph, Ref
from ..rules.swap import is_load, is_store, swap_ops  # noqa: F401 -- re-exported
from ..simulate.cost import is_free
from ..simulate.latency import Transfer


def place_transfers(g: Graph, order: Sequence[int], dur: Callable[[int], float],
                    xfer: Callable[[int], float], live: Sequence[int] | None = None) -> list[int]:
    """``order`` (node ids) with every Store and Load re-placed so that the copy
    stream hides them where it can (see module doc).

    The compute ops keep their order. With compute times from ``dur`` (seconds per
    op) and the copy stream running one transfer at a time (``xfer(nbytes)``
    seconds): Stores are issued as soon as their producer is done, in that order,
    and placed before the first compute op that starts after the copy is done.
    Loads are planned backwards from their first reader, each finishing before
    the next one starts and never overlapping a Store, and placed after the last
    compute op that ends before the copy must start.

    ``live``: bytes live at each compute op of ``order`` (the memory-aware
    schedule's timeline). When given, no move may raise the live bytes above
    that schedule's peak: a Store stays where its tensor may die, a Load where
    its copy fits, even if the transfer is then exposed (the latency simulation
    charges it). Hiding a copy never costs memory the scheduler had saved.
    """
    stores, loads = swap_ops(g)
    if not stores:
        return list(order)
    moving = set(stores) | set(loads)
    base = [v for v in order if v not in moving]
    k_of = {v: k for k, v in enumerate(base)}
    room = None
    if live is not None:
        room = [0] * len(base)
        cap = max(live) if live else 0
        for k, v in enumerate(base):
            room[k] = cap - live[k]
    t = [0.0]
    for v in base:
        t.append(t[-1] + dur(v))        # t[k]: start of base[k]; t[k + 1]: its end
    slot: dict[int, int] = {}           # transfer -> index of the compute op it precedes
    busy: list[tuple[float, float]] = []
    copy_free = 0.0
    first_load = {}
    for ld in loads:
        s = g.nodes[ld].args[0].node
        first_load[s] = min(first_load.get(s, len(base)), min(
            (k_of[u] for u in g.succs(ld) if u in k_of), default=len(base)))
    for s in sorted(stores, key=lambda v: k_of.get(g.storage_of(g.nodes[v].args[1]).node, -1)):
        src = g.storage_of(g.nodes[s].args[1]).node
        ready = t[k_of[src] + 1] if src in k_of else 0.0
        st = max(copy_free, ready)
        en = st + xfer(g.tensor(g.nodes[s].args[1]).nbytes)
        copy_free = en
        busy.append((st, en))
        k = bisect.bisect_left(t, en)            # first op starting at or after en
        lo = k_of[src] + 1 if src in k_of else 0
        k = max(lo, min(k, first_load.get(s, len(base)), len(base)))
        if room is not None:
            # the tensor now lives past its last compute reader until the Store
            nb = g.tensor(g.nodes[s].args[1]).nbytes
            last = max([k_of[u] for u in g.succs(src) if u in k_of and k_of[u] < k] + [lo - 1])
            j = last + 1
            while j < k and room[j] >= nb:
                j += 1
            k = max(lo, j)
            for i in range(last + 1, k):
                room[i] -= nb
        slot[s] = k
    need = {}
    for ld in loads:
        readers = [k_of[u] for u in g.succs(ld) if u in k_of]
        need[ld] = min(readers) if readers else len(base)
    back = float("inf")
    for ld in sorted(loads, key=lambda v: -need[v]):
        end = min(t[need[ld]], back)
        x = xfer(g.nodes[ld].outputs[0].nbytes)
        moved = True
        while moved:                     # slide below any Store it would overlap
            moved = False
            for a, b in busy:
                if a < end and end - x < b:
                    end, moved = a, True
        st = end - x
        k = bisect.bisect_right(t, st) - 1       # last op ending by st is base[k-1]
        store = g.nodes[ld].args[0].node
        k = max(min(k, need[ld]), slot.get(store, 0), 0)
        if room is not None:
            nb = g.nodes[ld].outputs[0].nbytes
            j = need[ld]
            while j - 1 >= k and room[j - 1] >= nb:
                j -= 1
            k = max(j, slot.get(store, 0))
            for i in range(k, need[ld]):
                room[i] -= nb
        back = max(st, t[k]) if k < len(t) else st
        slot[ld] = k
    out: list[int] = []
    pending: dict[int, list[int]] = {}
    for v in stores + loads:            # stores first where a pair shares a slot
        pending.setdefault(slot[v], []).append(v)
    for k, v in enumerate(base):
        out.extend(pending.get(k, ()))
        out.append(v)
    out.extend(pending.get(len(base), ()))
    return out


def transfers_of(g: Graph, order: Sequence[int]) -> tuple[list[int], list[Transfer]]:
    """Split a placed order into the compute-stream order and the copy-stream
    transfers (in the order the copy stream runs them)."""
    stores, loads = swap_ops(g)
    moving = set(stores) | set(loads)
    compute = [v for v in order if v not in moving]
    if not moving:
        return compute, []
    pos = {v: i for i, v in enumerate(order)}

    def next_compute(i):
        for v in order[i + 1:]:
            if v not in moving:
                return v
        return None

    def prev_compute(i):
        for v in reversed(order[:i]):
            if v not in moving:
                return v
        return None

    def on_compute(v, earlier: bool):
        # events are recorded on the compute stream: a copy that waits for (or is
        # awaited by) another copy's op hangs on the nearest compute op instead
        if v is None or v not in moving:
            return v
        return prev_compute(pos[v] + 1) if earlier else next_compute(pos[v] - 1)

    xs = []
    for s in stores:
        src = g.storage_of(g.nodes[s].args[1])
        after = on_compute(src.node, True) if g.nodes[src.node].kind == "op" else None
        xs.append((pos[after] if after is not None else -1,
                   Transfer("store", g.tensor(src).nbytes, after, next_compute(pos[s]))))
    # the first op in the order that reads a loaded copy's data, through views of
    # it or not (views do not touch the data; the program readies the copy there)
    loaded, first_reader = set(loads), {}
    for v in order:
        if v in moving or is_free(g.nodes[v]):
            continue
        for r in g.nodes[v].refs():
            ld = g.storage_of(r).node
            if ld in loaded and ld not in first_reader:
                first_reader[ld] = v
    for ld in loads:
        first = first_reader.get(ld)
        after = prev_compute(pos[ld])
        # no op reads its data: the program waits for it right after its line
        # (it may be freed there: runtime/codegen.py)
        before = on_compute(first, False) if first is not None else next_compute(pos[ld])
        xs.append((pos[ld], Transfer("load", g.nodes[ld].outputs[0].nbytes, after, before)))
    xs.sort(key=lambda t: t[0])
    return compute, [t for _, t in xs]

