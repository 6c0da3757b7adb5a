"""Incremental rescheduling after a graph mutation (paper §6.1, Algorithm 2).

Contract of ``reschedule(new_g, old_order, touched)``:
- ``old_order`` is the previous schedule as op *names* (``Schedule.names``); op
  indices change between graphs, names do not. Old names missing from ``new_g``
  (an op a rewrite removed) are skipped.
- ``touched``: names of old ops whose neighbourhood the mutation changed.
- Ops of ``new_g`` whose names are not in ``old_order`` are new (a recompute copy,
  Store/Load, fission parts); each is placed inside a rescheduled interval.
- Result: a ``Schedule`` over all of ``new_g`` whose peak is simulate_memory's.

Each touched op gets an interval of the old order, walked outward by
``extend_bound`` until a narrow waist; overlapping intervals merge. Unlike the
printed algorithm (one interval from the first to the last touched op), intervals
stay separate: see Note [one interval per touched op]. Everything outside the
intervals keeps its old relative order; each interval (with its new ops) is cut
by ``graph_partition`` and ordered by the DP in context, then spliced back.

Note [one interval per touched op]: remat and swap touch a forward producer and a
backward reader hundreds of steps apart; a single interval between them is most
of the graph, i.e. a full reschedule. Two local intervals are what makes the
incremental step cheap, and the new op goes where it helps: an op that allocates
(recompute copy, Load) into the interval of its first reader (as late as
possible), an op that allocates nothing (Store) next to its producer.
"""
from __future__ import annotations

import time
from typing import Iterable, Sequence

from magis_nb.simulate.memory import MemGraph, peak_memory

from .dp import STATE_BUDGET, BlockCache, solve_blocks
from .full import Schedule, schedule
from .narrow_waist import graph_partition, nw_values, topo_order

MAX_STEPS, STOP, WAIST = 20, 10, 4
FLIPS = 2          # new ops whose placement is tried both ways
WHOLE = 64         # intervals up to this many ops are one DP block


def extend_bound(nw: Sequence[int], i: int, d: int, *, max_steps: int = MAX_STEPS,
                 stop: int = STOP, waist: int = WAIST) -> int:
    """Walk from position ``i`` in direction ``d`` (+1/-1) over ``nw`` (the nw
    value of each op of the order): at most ``max_steps`` steps, moving while the
    value keeps falling (or is still above ``stop``), stopping at a waist
    (value < ``waist``). Returns the last position reached."""
    prev, steps = None, 0
    while steps < max_steps and 0 <= i + d < len(nw):
        cur = nw[i]
        if cur < waist or (prev is not None and prev <= stop and cur >= prev):
            break
        prev, i, steps = cur, i + d, steps + 1
    return i


def get_reschedule_interval(nw: Sequence[int], touched_pos: Iterable[int],
                            **kw) -> tuple[int, int]:
    """Algorithm 2 as printed: one interval [beg, end] (inclusive) around all."""
    ps = list(touched_pos)
    return extend_bound(nw, min(ps), -1, **kw), extend_bound(nw, max(ps), +1, **kw)


def get_reschedule_intervals(nw: Sequence[int], touched_pos: Iterable[int],
                             **kw) -> list[tuple[int, int]]:
    """One interval per touched position, merged when they overlap or touch."""
    return _merge([(extend_bound(nw, p, -1, **kw), extend_bound(nw, p, +1, **kw))
                   for p in set(touched_pos)])


def _layout(g, seq, intervals, topo_new, alloc, flips=0):
    """Units for a position layout: gap ops alone, one unit per interval, new ops
    in an interval unit. Returns ((unit per op, {unit: ops}, n_units), number of
    new ops that had a choice) or (None, pair of positions that must join one
    interval because no valid layout exists).

    A new op with a choice goes to its last feasible interval if it allocates
    (as late as possible), else to its first; bit j of ``flips`` reverses that
    for the j-th op with a choice.
    """
    unit, blocks, ivunit, u, k = [-1] * g.n, {}, [], 0, 0
    pos_unit = []
    for p in range(len(seq)):
        while k < len(intervals) and intervals[k][1] < p:
            k += 1
        if k < len(intervals) and intervals[k][0] <= p:
            if p == intervals[k][0]:
                ivunit.append(u)
                blocks[u] = []
                u += 1
            pos_unit.append(ivunit[k])
        else:
            pos_unit.append(u)
            u += 1
    for p, v in enumerate(seq):
        unit[v] = pos_unit[p]
        if unit[v] in blocks:
            blocks[unit[v]].append(v)
    is_block = [x in blocks for x in range(u)]
    first_pos = {}
    for p, x in enumerate(pos_unit):
        first_pos.setdefault(x, p)
    # Latest unit allowed by the successors of each new op (reverse topo).
    hi = {}
    for v in reversed(topo_new):
        h = u - 1
        for s in g.succs[v]:
            hs = hi[s] if s in hi else (unit[s] if is_block[unit[s]] else unit[s] - 1)
            h = min(h, hs)
        hi[v] = h
    choices = 0
    for v in topo_new:
        lo = 0
        for p in g.preds[v]:
            lo = max(lo, unit[p] if is_block[unit[p]] else unit[p] + 1)
        cands = [x for x in ivunit if lo <= x <= hi[v]]
        if not cands:
            a = [first_pos[unit[p]] for p in g.preds[v] if unit[p] >= 0] or [0]
            b = [first_pos[unit[s]] for s in g.succs[v] if unit[s] >= 0 and s not in hi]
            return None, (max(a), min(b) if b else len(seq) - 1)
        late = alloc[v] > 0
        if len(cands) > 1:
            late ^= bool(flips >> choices & 1)
            choices += 1
        unit[v] = cands[-1] if late else cands[0]
        blocks[unit[v]].append(v)
    for v in range(g.n):          # any other rewired edge must still run forward
        for p in g.preds[v]:
            if unit[p] > unit[v] or (unit[p] == unit[v] and not is_block[unit[v]]):
                return None, (first_pos.get(unit[v], 0), first_pos.get(unit[p], 0))
    return (unit, blocks, u), choices


def reschedule(new_g: MemGraph, old_order: Sequence[str], touched: Iterable[str], *,
               nw: dict[int, int] | None = None, budget: int = STATE_BUDGET,
               cache: BlockCache | None = None, **bound_kw) -> Schedule:
    """Reschedule ``new_g`` around ``touched`` keeping the rest of ``old_order``.

    ``nw``: narrow-waist values of ``new_g`` if already known (else computed;
    the walk uses the new graph's values for the old ops, which equal the old
    graph's away from the mutation). ``cache``: blocks solved before.
    """
    t0 = time.perf_counter()
    idx = {name: i for i, name in enumerate(new_g.names)}
    seq = [idx[nm] for nm in old_order if nm in idx]
    seqpos = {nm: p for p, nm in enumerate(nm for nm in old_order if nm in idx)}
    oldpos = {nm: p for p, nm in enumerate(old_order)}
    in_seq = set(seq)
    new_ops = [v for v in range(new_g.n) if v not in in_seq]
    if len(seq) == 0:
        return schedule(new_g, budget=budget, cache=cache)
    if nw is None:
        nw = nw_values(new_g)
    nws = [nw[v] for v in seq]
    pos = []
    for nm in touched:
        if nm in seqpos:
            pos.append(seqpos[nm])
        elif nm in oldpos:     # removed op: its old neighbour in the kept sequence
            pos.append(min(sum(1 for q in old_order[:oldpos[nm]] if q in idx),
                           len(seq) - 1))
    if not pos:
        pos = [len(seq) - 1]
    intervals = get_reschedule_intervals(nws, pos, **bound_kw)
    topo_new = topo_order(new_g, new_ops, set(new_ops), None)
    alloc = [0] * new_g.n
    for s in new_g.storages:
        if s.producer >= 0:
            alloc[s.producer] += s.size
    for _ in range(64):
        lay, info = _layout(new_g, seq, intervals, topo_new, alloc)
        if lay is not None:
            break
        intervals = _merge(intervals + [tuple(sorted(info))])
    else:
        return schedule(new_g, budget=budget, cache=cache)
    hint = _new_op_keys(new_g, seq, topo_new, alloc)
    best, seen = None, set()
    # Where a new op goes is the one decision the old order cannot tell: try
    # both ends for the first ``FLIPS`` ops that have a choice, keep the best.
    for flips in range(1 << min(info, FLIPS)):
        lay, _ = _layout(new_g, seq, intervals, topo_new, alloc, flips)
        if lay is None or (key := tuple(lay[0][v] for v in new_ops)) in seen:
            continue
        seen.add(key)
        unit, blocks, n_units = lay
        order, exact = _solve(new_g, seq, unit, blocks, n_units, hint, budget, cache)
        peak = peak_memory(new_g, order)
        if best is None or peak < best[0]:
            best = (peak, order, exact)
    # ``blocks`` counts the rescheduled intervals.
    return Schedule(new_g, best[1], best[0], "incremental",
                    time.perf_counter() - t0, best[2], len(intervals))


def _merge(iv):
    """Union of inclusive intervals; touching ones merge."""
    out: list[list[int]] = []
    for b, e in sorted(iv):
        if out and b <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([b, e])
    return [(b, e) for b, e in out]


def _solve(g, seq, unit, blocks, n_units, hint, budget, cache):
    """Cut each interval at its narrow waists, order the pieces, splice."""
    units: list[tuple[bool, list[int]]] = []   # (is block, ops)
    seq_by_unit: dict[int, list[int]] = {}
    for v in seq:
        seq_by_unit.setdefault(unit[v], []).append(v)
    for x in range(n_units):
        if x in blocks:
            ops = _local_hint(g, blocks[x], hint)
            # An interval is small: cut it only when the DP could not take it
            # whole (the light-op rules are tuned for whole graphs).
            pieces = [ops] if len(ops) <= WHOLE else graph_partition(g, ops, hint=ops)
            units.extend((True, piece) for piece in pieces)
        else:
            units.append((False, seq_by_unit[x]))
    fine = [0] * g.n
    bl = {}
    for k, (is_b, ops) in enumerate(units):
        for v in ops:
            fine[v] = k
        if is_b:
            bl[k] = ops
    hint_pos = [0] * g.n
    for k, (_, ops) in enumerate(units):
        for i, v in enumerate(ops):
            hint_pos[v] = i
    orders, exact = solve_blocks(g, fine, bl, len(units), hint_pos, budget=budget,
                                 cache=cache)
    return [v for k, (is_b, ops) in enumerate(units)
            for v in (orders[k] if is_b else ops)], exact


def _local_hint(g, ops, hint):
    """A topological order of an interval by the hint keys."""
    return topo_order(g, list(ops), set(ops), {v: hint[v] for v in ops})


def _new_op_keys(g, seq, topo_new, alloc):
    """Hint keys: old ops at their old position; a new op that allocates just
    before its first successor, one that allocates nothing just after its last
    predecessor (the placement _layout chose)."""
    key = [0.0] * g.n
    for p, v in enumerate(seq):
        key[v] = float(p)
    for v in reversed(topo_new):
        if alloc[v]:
            key[v] = min([key[s] for s in g.succs[v]] + [len(seq)]) - 1e-3
    for v in topo_new:
        if not alloc[v]:
            key[v] = max([key[p] for p in g.preds[v]] + [-1.0]) + 1e-3
    return key
